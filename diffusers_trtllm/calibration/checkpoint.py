"""Skip-Softmax calibrations in checkpoints: ``sparse_attention_config`` in each transformer's ``config.json``.

Three shapes are read (all under a component's ``config.json`` key ``sparse_attention_config``):

- ModelOpt 0.45–0.47 ``export_hf_checkpoint``::

    {"config_groups": {"group_0": {"algorithm": "skip_softmax", "targets": ["WanAttention"],
                                   "ignore": ["blocks.0.attn2", ...],
                                   "threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)",
                                                              "prefill": {"a": 7.93, "b": 8.61}},
                                   "target_sparsity": {"prefill": 0.5}}},
     "producer": {"name": "modelopt", "version": "0.47.0"}}

- NVIDIA's published Wan 2.2 checkpoint: the group carries ``"coefficients": {"a": 2822.62, "b": 4.388}``
  (directly or inside ``threshold_scale_factor``), a scalar ``target_sparsity`` and ``disabled_until_timestep``;
- ModelOpt 0.44: ``threshold_scale_factor`` at the top level, the group says ``"sparse_algo": "softmax_skip"``.

Diffusion attention is prefill only, so the ``prefill`` coefficients are used (``decode`` is ignored). ``formula``
may be absent; when present it must be ``a * exp(b * target_sparsity)`` (whitespace ignored). ModelOpt does not
export what the calibration observed (sparsity range, resolution, fit quality); :func:`write_calibration` puts
that in a sidecar ``sparse_attention_calibration.json`` beside ``config.json``, and readers use its observed
range to warn about extrapolated targets.
"""

from __future__ import annotations

import ast
import json
import logging
from pathlib import Path
from typing import Mapping

from ..config import TRANSFORMER_COMPONENTS, finite_number
from ..errors import AttentionConfigError, invalid
from ..version import __version__
from .curve import SkipCalibration

logger = logging.getLogger("diffusers_trtllm")

CONFIG_KEY = "sparse_attention_config"
CONFIG_NAME = "config.json"
SIDECAR_NAME = "sparse_attention_calibration.json"
FORMULA = "a * exp(b * target_sparsity)"
SKIP_ALGORITHMS = ("skip_softmax", "softmax_skip")  # ModelOpt 0.45+ / 0.44 spelling
# ModelOpt algorithms this package does not run; a checkpoint may carry them beside skip_softmax.
OTHER_MODELOPT_ALGORITHMS = ("sparse_softmax", "triton_sparse_softmax")


class _CalibrationKeyIsRead(logging.Filter):
    """diffusers warns that ``config.json`` keys its model class does not take "will be ignored. Please verify
    your config.json", yet keeps them in ``model.config``, where this package reads ``sparse_attention_config``.
    Drops that warning when this key is the only one it names (any other key still warns)."""

    PREFIX, SUFFIX = "The config attributes ", " were passed to "

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(self.PREFIX) or self.SUFFIX not in message:
            return True
        try:
            # the last suffix: a config value may hold the same words, a class name cannot
            keys = ast.literal_eval(message[len(self.PREFIX):message.rindex(self.SUFFIX)])
        except (ValueError, SyntaxError):
            return True
        return set(keys) != {CONFIG_KEY}


logging.getLogger("diffusers.configuration_utils").addFilter(_CalibrationKeyIsRead())


def parse_sparse_attention_config(data, *, where: str = CONFIG_KEY,
                                  sidecar: Mapping | None = None) -> SkipCalibration | None:
    """The Skip-Softmax curve in one ``sparse_attention_config`` (any of the three shapes), or None when it has
    no ``skip_softmax`` group. ``where`` prefixes field names in errors; ``sidecar`` is the content of
    ``sparse_attention_calibration.json`` (its observed sparsity range is kept). Raises
    :class:`~diffusers_trtllm.AttentionConfigError` naming the field and value for anything malformed."""
    if not isinstance(data, Mapping):
        raise invalid(where, data, "a JSON object with 'config_groups'")
    groups = data.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise invalid(f"{where}.config_groups", groups, "a non-empty object of groups like "
                      '{"group_0": {"algorithm": "skip_softmax", ...}}')
    skip_groups = []
    for name, group in groups.items():
        path = f"{where}.config_groups.{name}"
        if not isinstance(group, Mapping):
            raise invalid(path, group, "a JSON object with 'algorithm'")
        key = "algorithm" if "algorithm" in group else "sparse_algo"
        algorithm = group.get(key)
        if algorithm in SKIP_ALGORITHMS:
            skip_groups.append((path, group))
        elif algorithm in OTHER_MODELOPT_ALGORITHMS:
            logger.warning("%s.%s=%r: diffusers_trtllm runs Skip-Softmax only; this group is ignored",
                           path, key, algorithm)
        else:
            raise invalid(f"{path}.{key}", algorithm, f"one of {list(SKIP_ALGORITHMS)} "
                          f"(or {list(OTHER_MODELOPT_ALGORITHMS)}, which are ignored)")
    if not skip_groups:
        return None
    if len(skip_groups) > 1:
        raise AttentionConfigError(f"{where}: {len(skip_groups)} skip_softmax groups "
                                   f"({[p for p, _ in skip_groups]}); one curve per component is supported")
    path, group = skip_groups[0]
    a, b = _coefficients(data, path, group, where)
    return SkipCalibration(
        a=a, b=b, source=where,
        sparsity_range=_observed_range(sidecar, where),
        ignore=_strings(group.get("ignore", []), f"{path}.ignore"),
        targets=_strings(group.get("targets", []), f"{path}.targets"),
        target_sparsity=_target_sparsity(group.get("target_sparsity"), f"{path}.target_sparsity"),
        disabled_until_timestep=_unit(group.get("disabled_until_timestep"), f"{path}.disabled_until_timestep"),
        reuse_steps=_steps(group.get("reuse_steps"), f"{path}.reuse_steps"))


def _coefficients(data: Mapping, path: str, group: Mapping, where: str) -> tuple[float, float]:
    """(a, b) from the group's threshold_scale_factor (0.45+), the top level's (0.44) or ``coefficients``."""
    for owner, owner_path in ((group, path), (data, where)):
        tsf = owner.get("threshold_scale_factor")
        if tsf is None:
            continue
        tsf_path = f"{owner_path}.threshold_scale_factor"
        if not isinstance(tsf, Mapping):
            raise invalid(tsf_path, tsf, f'an object like {{"formula": "{FORMULA}", "prefill": {{"a": .., "b": ..}}}}')
        if "formula" in tsf:
            _check_formula(tsf["formula"], f"{tsf_path}.formula")
        else:
            _check_formula(group.get("formula"), f"{path}.formula")
        for key in ("prefill", "coefficients"):
            if key in tsf:
                return _a_b(tsf[key], f"{tsf_path}.{key}")
        raise AttentionConfigError(f"{tsf_path}={dict(tsf)!r} has no 'prefill' coefficients {{\"a\": .., \"b\": ..}} "
                                   "(diffusion attention is prefill only; 'decode' is not used)")
    if "coefficients" in group:
        _check_formula(group.get("formula"), f"{path}.formula")
        return _a_b(group["coefficients"], f"{path}.coefficients")
    raise AttentionConfigError(
        f"{path} has no coefficients: expected '{path}.threshold_scale_factor.prefill' (ModelOpt 0.45+), "
        f"'{where}.threshold_scale_factor.prefill' (ModelOpt 0.44) or '{path}.coefficients', each {{\"a\": .., \"b\": ..}}")


def _check_formula(formula, path: str) -> None:
    if formula is not None and (not isinstance(formula, str) or
                                "".join(formula.split()) != "".join(FORMULA.split())):
        raise invalid(path, formula, f"{FORMULA!r} (whitespace ignored)")


def _a_b(params, path: str) -> tuple[float, float]:
    if not isinstance(params, Mapping) or "a" not in params or "b" not in params:
        raise invalid(path, params, '{"a": <number > 0>, "b": <number > 0>}')
    valid = f"a finite number > 0 (factor = {FORMULA} must be positive and grow with the target sparsity)"
    return (finite_number(f"{path}.a", params["a"], above=0.0, valid=valid),
            finite_number(f"{path}.b", params["b"], above=0.0, valid=valid))


def _unit(value, path: str) -> float | None:
    return None if value is None else finite_number(path, value, 0.0, 1.0)


def _steps(value, path: str) -> int | None:
    if value is None or (type(value) is int and value >= 0):
        return value
    raise invalid(path, value, "an int >= 0")


def _target_sparsity(value, path: str) -> float | None:
    if isinstance(value, Mapping):
        return _unit(value.get("prefill"), f"{path}.prefill")
    return _unit(value, path)


def _strings(value, path: str) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(x, str) for x in value):
        raise invalid(path, value, "a list of strings")
    return tuple(value)


def _observed_range(sidecar: Mapping | None, where: str) -> tuple[float, float] | None:
    if sidecar is None or sidecar.get("observed_sparsity") is None:
        return None
    value, field = sidecar["observed_sparsity"], f"{where} sidecar {SIDECAR_NAME}: observed_sparsity"
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise invalid(field, value, "[low, high]")
    return _unit(value[0], f"{field}[0]"), _unit(value[1], f"{field}[1]")


# --- reading ---------------------------------------------------------------------------------------------------

def load_calibration(component_dir: str | Path) -> SkipCalibration | None:
    """The curve in ``component_dir/config.json`` (with its sidecar, when present), or None when it has none."""
    component_dir = Path(component_dir)
    config_path = component_dir / CONFIG_NAME
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise AttentionConfigError(f"{config_path} is not valid JSON: {e}") from None
    if CONFIG_KEY not in config:
        return None
    return parse_sparse_attention_config(config[CONFIG_KEY], where=f"{config_path}: {CONFIG_KEY}",
                                         sidecar=_read_sidecar(component_dir))


def calibrations_from_pretrained(pipeline_dir: str | Path,
                                 components: tuple[str, ...] = TRANSFORMER_COMPONENTS) -> dict[str, SkipCalibration]:
    """Curves of a pipeline folder's transformer components (``transformer/``, ``transformer_2/``)."""
    found = {}
    for component in components:
        if (Path(pipeline_dir) / component / CONFIG_NAME).is_file():
            calibration = load_calibration(Path(pipeline_dir) / component)
            if calibration is not None:
                found[component] = calibration
    return found


def calibrations_from_transformers(transformers: Mapping, explicit: Mapping[str, SkipCalibration] | None = None
                                   ) -> dict[str, SkipCalibration]:
    """Curves of loaded transformers, keyed by component name, each bound to its transformer (``targets``).

    diffusers keeps config.json keys the model class does not take (with a warning) in ``transformer.config``,
    so a checkpoint's ``sparse_attention_config`` is read from there; the sidecar is looked for in the folder
    the transformer was loaded from. ``explicit`` curves replace the ones read.
    """
    found = {}
    for component, transformer in transformers.items():
        config = getattr(transformer, "config", None) or {}
        if CONFIG_KEY not in config:
            continue
        origin = config.get("_name_or_path")
        sidecar = _read_sidecar(Path(origin)) if origin and Path(origin).is_dir() else None
        calibration = parse_sparse_attention_config(config[CONFIG_KEY], where=f"{component}.config.{CONFIG_KEY}",
                                                    sidecar=sidecar)
        if calibration is not None:
            found[component] = calibration
    found.update(explicit or {})
    return {component: calibration.bind(transformers[component]) if component in transformers else calibration
            for component, calibration in found.items()}


def _read_sidecar(component_dir: Path) -> dict | None:
    path = component_dir / SIDECAR_NAME
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise AttentionConfigError(f"{path} is not valid JSON: {e}") from None


# --- writing ---------------------------------------------------------------------------------------------------

def sparse_attention_config(calibration: SkipCalibration, *, producer: Mapping | None = None) -> dict:
    """``calibration`` in ModelOpt 0.45+'s schema (what ``export_hf_checkpoint`` writes), plus
    ``disabled_until_timestep`` when set (as in NVIDIA's Wan 2.2 checkpoint; ModelOpt's reader ignores it) and
    ``reuse_steps`` for a curve of Skip-Softmax reuse (this package's; ModelOpt's reader ignores it too)."""
    group = {"algorithm": "skip_softmax", "targets": list(calibration.targets)}
    if calibration.ignore:
        group["ignore"] = list(calibration.ignore)
    group["threshold_scale_factor"] = {"formula": FORMULA, "prefill": {"a": calibration.a, "b": calibration.b}}
    if calibration.target_sparsity is not None:
        group["target_sparsity"] = {"prefill": calibration.target_sparsity}
    if calibration.disabled_until_timestep is not None:
        group["disabled_until_timestep"] = calibration.disabled_until_timestep
    if calibration.reuse_steps:
        group["reuse_steps"] = calibration.reuse_steps
    return {"config_groups": {"group_0": group},
            "producer": dict(producer or {"name": "diffusers_trtllm", "version": __version__})}


def write_calibration(component_dir: str | Path, calibration: SkipCalibration, sidecar: Mapping | None = None) -> None:
    """Put ``calibration`` into ``component_dir/config.json`` (which must exist: save the transformer or its
    config there first) and ``sidecar`` into ``sparse_attention_calibration.json`` beside it."""
    config_path = Path(component_dir) / CONFIG_NAME
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} does not exist: save the transformer (or transformer.save_config) "
                                "there before writing its calibration")
    config = json.loads(config_path.read_text())
    config[CONFIG_KEY] = sparse_attention_config(calibration)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    if sidecar is not None:
        (Path(component_dir) / SIDECAR_NAME).write_text(json.dumps(sidecar, indent=2) + "\n")

"""The vLLM-Omni command-line flags and their environment variables, as an :class:`AttentionConfig`.

=====================================  ======================================  =================================
flag                                   environment variable                    meaning
=====================================  ======================================  =================================
``--diffusion-attention-backend``      ``DIFFUSION_ATTENTION_BACKEND``         backend of the default spec
``--diffusion-attention-config``       ``DIFFUSION_ATTENTION_CONFIG``          full JSON config, or its file
``--trtllm-gen-sage``                  ``TRTLLM_GEN_SAGE=1``                   FP8 SAGE, the GPU's fastest kernel
``--trtllm-gen-target-sparsity``       ``TRTLLM_GEN_TARGET_SPARSITY``          Skip-Softmax target (calibrated)
``--trtllm-gen-disabled-until-timestep``  ``TRTLLM_GEN_DISABLED_UNTIL_TIMESTEP``  keep steps with t > D dense
=====================================  ======================================  =================================

A flag and its variable may both be set only to the same value; the ``--trtllm-gen-*`` shortcuts edit the
default spec and may not contradict ``--diffusion-attention-config``. Their backend: ``TRTLLM_ATTN`` when no
backend is given (neither ``--diffusion-attention-backend`` nor a non-``auto`` default in the config: the design
document's usage); otherwise the given one when it has the feature (``TRTLLM_ATTN``, ``TORCH_REFERENCE``,
``auto``); ``TORCH_SDPA`` (dense only) refuses them. An invalid value is refused naming the flag or variable
it came from.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
from typing import Iterator, Mapping

from .config import (AUTO, FEATURE_BACKENDS, TRTLLM_ATTN, AttentionConfig, AttentionSpec, AttnQuantSpec,
                     SkipSoftmaxSpec, canonical_backend, env_switch)
from .errors import AttentionConfigError, invalid

FLAGS = {  # dest -> (flag, environment variable)
    "diffusion_attention_backend": ("--diffusion-attention-backend", "DIFFUSION_ATTENTION_BACKEND"),
    "diffusion_attention_config": ("--diffusion-attention-config", "DIFFUSION_ATTENTION_CONFIG"),
    "trtllm_gen_sage": ("--trtllm-gen-sage", "TRTLLM_GEN_SAGE"),
    "trtllm_gen_target_sparsity": ("--trtllm-gen-target-sparsity", "TRTLLM_GEN_TARGET_SPARSITY"),
    "trtllm_gen_disabled_until_timestep": ("--trtllm-gen-disabled-until-timestep",
                                           "TRTLLM_GEN_DISABLED_UNTIL_TIMESTEP"),
}
# No block sizes: the GPU's fastest FP8 SAGE kernel, logged once (backends.trtllm.sage_semantics).
SAGE_PRESET = AttnQuantSpec(dtype_qk="fp8_e4m3")


def add_attention_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the attention flags to ``parser`` (in their own argument group) and return it."""
    group = parser.add_argument_group("attention (diffusers_trtllm)")
    group.add_argument(FLAGS["diffusion_attention_backend"][0], default=None, metavar="NAME",
                       help="TRTLLM_ATTN (alias trtllm-gen), TORCH_SDPA, TORCH_REFERENCE or auto")
    group.add_argument(FLAGS["diffusion_attention_config"][0], default=None, metavar="JSON",
                       help='e.g. {"default":{"backend":"TRTLLM_ATTN","skip_softmax":{"target_sparsity":0.3}}}, '
                            'or the path of a JSON file holding it')
    group.add_argument(FLAGS["trtllm_gen_sage"][0], action="store_true", default=None,
                       help="FP8 SAGE quantization on the GPU's fastest kernel (block sizes unset; logged once)")
    group.add_argument(FLAGS["trtllm_gen_target_sparsity"][0], type=float, default=None, metavar="S",
                       help="Skip-Softmax target sparsity in [0, 1] (needs a calibrated checkpoint)")
    group.add_argument(FLAGS["trtllm_gen_disabled_until_timestep"][0], type=float, default=None, metavar="D",
                       help="keep denoising steps with normalized timestep t > D dense")
    return parser


def _env_value(dest: str, raw: str):
    _, var = FLAGS[dest]
    if dest == "trtllm_gen_sage":
        return env_switch(var, {var: raw}) or None
    if dest.startswith("trtllm_gen_"):
        try:
            return float(raw)
        except ValueError:
            raise invalid(var, raw, "a number") from None
    return raw


def _setting(args: argparse.Namespace | None, environ: Mapping[str, str], dest: str):
    flag, var = FLAGS[dest]
    from_flag = getattr(args, dest, None) if args is not None else None
    from_env = _env_value(dest, environ[var]) if var in environ else None
    if from_flag is not None and from_env is not None and from_flag != from_env:
        raise AttentionConfigError(f"{flag}={from_flag!r} contradicts {var}={environ[var]!r}; set one of them")
    return from_flag if from_flag is not None else from_env


def _source(args: argparse.Namespace | None, dest: str) -> str:
    """Where a setting came from, as an error names it: the flag, else its environment variable."""
    flag, var = FLAGS[dest]
    return flag if args is not None and getattr(args, dest, None) is not None else f"{var} (environment variable)"


@contextlib.contextmanager
def _named(source: str) -> Iterator[None]:
    """Prefix a configuration error raised inside with the flag or variable whose value it is about."""
    try:
        yield
    except AttentionConfigError as e:
        raise AttentionConfigError(f"{source}: {e}") from None


def config_from_args(args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None
                     ) -> AttentionConfig:
    """Build the config from parsed flags (see :func:`add_attention_args`) and environment variables."""
    environ = os.environ if environ is None else environ
    get = {dest: _setting(args, environ, dest) for dest in FLAGS}
    with _named(_source(args, "diffusion_attention_config")):
        get["diffusion_attention_config"] = _config_text(get["diffusion_attention_config"])
        config = AttentionConfig.coerce(get["diffusion_attention_config"])
    default = config.default
    backend = get["diffusion_attention_backend"]
    if backend is not None:
        with _named(_source(args, "diffusion_attention_backend")):
            backend = canonical_backend(backend)
        if get["diffusion_attention_config"] is not None and default.backend not in (AUTO, backend):
            raise AttentionConfigError(
                f"--diffusion-attention-backend={backend} contradicts the config's default backend "
                f"{default.backend}; set one of them")
        default = dataclasses.replace(default, backend=backend)

    shortcuts = {k: get[k] for k in ("trtllm_gen_sage", "trtllm_gen_target_sparsity",
                                     "trtllm_gen_disabled_until_timestep") if get[k] is not None}
    if shortcuts:
        backend_given = backend is not None or _names_default_backend(get["diffusion_attention_config"])
        if not backend_given:
            default = dataclasses.replace(default, backend=TRTLLM_ATTN)
        elif default.backend not in FEATURE_BACKENDS:
            raise AttentionConfigError(
                f"{', '.join(FLAGS[k][0] for k in shortcuts)} {'needs' if len(shortcuts) == 1 else 'need'} a "
                "backend with Skip-Softmax and SAGE "
                f"({', '.join(FEATURE_BACKENDS)}); the backend is {default.backend} (dense only)")
        quant, skip = default.quant, default.skip_softmax
        if "trtllm_gen_sage" in shortcuts:
            # A config's own FP8 SAGE (block sizes given) refines the flag; another dtype contradicts it.
            if quant is not None and quant.dtype_qk != SAGE_PRESET.dtype_qk:
                raise AttentionConfigError(f"--trtllm-gen-sage (FP8 SAGE) contradicts the config's quant {quant}")
            quant = quant or SAGE_PRESET
        skip_fields = {"target_sparsity": shortcuts.get("trtllm_gen_target_sparsity"),
                       "disabled_until_timestep": shortcuts.get("trtllm_gen_disabled_until_timestep")}
        skip_fields = {k: v for k, v in skip_fields.items() if v is not None}
        for field, value in skip_fields.items():  # each value on its own, naming where it came from
            with _named(_source(args, f"trtllm_gen_{field}")):
                SkipSoftmaxSpec(**{field: value})
        if skip_fields:
            current = dataclasses.asdict(skip) if skip is not None else {}
            clash = {k: v for k, v in skip_fields.items() if k in current and current[k] not in (None, 0.0, v)}
            if clash or (skip is not None and skip.threshold is not None and "target_sparsity" in skip_fields):
                raise AttentionConfigError(
                    f"--trtllm-gen-* skip flags {skip_fields} contradict the config's skip_softmax {current}")
            skip = SkipSoftmaxSpec(**{**current, **skip_fields})
        default = dataclasses.replace(default, quant=quant, skip_softmax=skip)
    return AttentionConfig(default=default, per_role=config.per_role)


def _config_text(value):
    """``--diffusion-attention-config``'s value as JSON text: a JSON object as given, or the text of the JSON file
    it names."""
    if not isinstance(value, str) or value.lstrip().startswith("{"):
        return value
    path = os.path.expanduser(value.strip())
    if not os.path.isfile(path):
        raise AttentionConfigError(f"{value!r} is neither a JSON object (it does not start with '{{') nor a JSON "
                                   "file (no such file)")
    with open(path, encoding="utf-8") as file:
        return file.read()


def _names_default_backend(config) -> bool:
    """Whether ``--diffusion-attention-config`` (JSON, dict or config) sets the default spec's backend itself
    (``"auto"`` included: an explicit choice the shortcuts then apply to)."""
    if config is None:
        return False
    if isinstance(config, (AttentionConfig, AttentionSpec)):
        return AttentionConfig.coerce(config).default.backend != AUTO
    data = json.loads(config) if isinstance(config, str) else config
    default = data.get("default") if isinstance(data, Mapping) else None
    return isinstance(default, Mapping) and "backend" in default

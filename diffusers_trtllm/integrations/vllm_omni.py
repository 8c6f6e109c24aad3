"""vLLM-Omni plugin: ``TRTLLM_ATTN`` on vLLM-Omni's diffusers path (``--diffusion-load-format diffusers``).

vllm-omni 0.30.0 serves a plain diffusers pipeline through ``DiffusersAdapterPipeline``; its
``_set_attention_backend`` maps ``diffusion_attention_config.default.backend`` to a diffusers dispatcher backend
and raises for ``TRTLLM_ATTN`` ("Diffusers adapters do not provide a binding"). vLLM-Omni loads the entry-point
group ``vllm_omni.general_plugins`` in every process that builds a diffusion worker; :func:`register` is this
package's entry there. It wraps two vLLM-Omni methods, each only where ``TRTLLM_ATTN`` is selected (by
``default`` or any ``per_role`` entry) on the diffusers load format; otherwise the original runs unchanged:

- ``DiffusersAdapterPipeline._set_attention_backend`` (after the pipeline is loaded and moved to its device):
  converts vLLM-Omni's ``AttentionConfig`` to this package's, refuses with this package's reason when
  ``TRTLLM_ATTN`` cannot run on the pipeline's device, and installs this package's processors on every
  transformer of the pipeline with :func:`~diffusers_trtllm.enable_trtllm_attention` (calibrations read from
  each transformer's ``config.json``; each request a run of its own, its steps from what the pipeline publishes,
  under diffusers 0.40 the transformer's timestep argument). The handle is kept on the adapter as ``trtllm_attention``. vLLM-Omni's log then says,
  once per pipeline, that this package serves ``TRTLLM_ATTN`` and which backend runs each role; what the install
  warns about goes there too.
- ``OmniDiffusionConfig._propagate_skip_softmax_calibration``: on the diffusers load format vLLM-Omni reads the
  calibration from an empty transformer config and so refuses every ``target_sparsity``; this package reads the
  checkpoint's calibration itself when it installs, and refuses ``target_sparsity`` without one there.

This package's extensions of the config (a spec's ``accuracy`` and ``dense_kernel``, the SAGE schedule
``quant.disabled_until_timestep`` / ``disabled_below_timestep``, ``skip_softmax.reuse_steps`` / ``reuse_test``) do not reach it here: vLLM-Omni's own parser of
``diffusion_attention_config`` refuses them as unknown keys before any plugin runs; they work with
``enable_trtllm_attention`` and this package's ``config_from_args``.

Both wrapped methods were read in vllm-omni 0.30.0; on another version selecting ``TRTLLM_ATTN`` is refused.
The per-pipeline hooks of ``PIPELINE_UTILS_REGISTRY`` cannot do it instead: they are keyed by pipeline class, and
``_set_attention_backend`` runs after ``apply_post_load_updates`` and raises for ``TRTLLM_ATTN`` whatever a hook did.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import logging
import warnings
from collections import Counter

import torch

from ..config import (TORCH_REFERENCE, TORCH_SDPA, TRTLLM_ATTN, AttentionConfig, AttentionSpec, AttnQuantSpec,
                      SkipSoftmaxSpec, canonical_backend, env_switch)
from ..errors import AttentionConfigError, BackendUnavailableError, invalid
from ..install import enable_trtllm_attention
from ..version import __version__

# vLLM-Omni's log: its "vllm_omni" logger propagates to vLLM's handler ("vllm"), which a logger outside that
# tree (this package's "diffusers_trtllm") lacks in a vLLM-Omni process.
logger = logging.getLogger("vllm_omni.plugins.diffusers_trtllm")

TESTED_VLLM_OMNI = "0.30.0"
#: the adapter attribute that holds the :class:`~diffusers_trtllm.TrtllmAttentionHandle` of its pipeline
HANDLE_ATTRIBUTE = "trtllm_attention"
#: set to 1 to record per-step statistics in ``adapter.trtllm_attention.stats``. Off by default: they grow with
#: every step served, which a long-running server must not do.
COLLECT_STATS_ENV = "DIFFUSERS_TRTLLM_COLLECT_STATS"
# vLLM-Omni backends the processors can run for roles that do not select TRTLLM_ATTN
DENSE_BACKENDS = (TORCH_SDPA,)
# what the plugin serves itself (vLLM-Omni knows neither ``trtllm-gen`` nor ``TORCH_REFERENCE``)
SERVED_BACKENDS = (TRTLLM_ATTN, TORCH_REFERENCE)
# vLLM-Omni's SAGE V dtype; this package's SAGE always quantizes V per channel to fp8 e4m3
SAGE_V_DTYPE = "fp8_e4m3"
PROBE_TOKENS, PROBE_HEAD_DIM = 128, 128  # one tile at the head_dim every TRT-LLM kernel takes
# What a refusal tells the user to select instead: vLLM-Omni's own diffusers backends, without this package
INSTEAD = ('select another backend in diffusion_attention_config instead, e.g. {"default": {"backend": '
           '"TORCH_SDPA"}} (or FLASH_ATTN on a CUDA GPU, or leave the backend unset): vLLM-Omni serves those itself')
_WRAPPED = "__diffusers_trtllm_wrapped__"


# --- configuration --------------------------------------------------------------------------------------------

def _named_specs(config) -> list[tuple[str, object]]:
    """``(where, spec)`` for the default (when set) and every per_role entry of vLLM-Omni's or this package's
    ``AttentionConfig``."""
    named = [("default", config.default)] if config.default is not None else []
    return named + [(f"per_role[{key!r}]", spec) for key, spec in config.per_role.items()]


def served_here(backend) -> bool:
    """Whether a vLLM-Omni spec's backend is one this package serves: ``TRTLLM_ATTN`` (alias ``trtllm-gen``) or
    its PyTorch reference ``TORCH_REFERENCE``, which vLLM-Omni itself does not know."""
    try:
        return canonical_backend(backend) in SERVED_BACKENDS
    except AttentionConfigError:
        return False


def trtllm_selected_by(config) -> tuple[str, ...]:
    """Where vLLM-Omni's ``AttentionConfig`` selects this package's backends (``"default"``,
    ``"per_role['self']"``)."""
    if config is None:
        return ()
    return tuple(where for where, spec in _named_specs(config) if served_here(spec.backend))


def attention_config_from_vllm_omni(config) -> AttentionConfig:
    """This package's :class:`~diffusers_trtllm.AttentionConfig` for vLLM-Omni's ``diffusion_attention_config``.

    The processors run every attention layer of a transformer, so each spec must name a backend they run:
    ``TRTLLM_ATTN`` (with ``skip_softmax`` / ``quant``) or ``TORCH_SDPA``; an unset default (vLLM-Omni's
    platform default, dense) becomes ``TORCH_SDPA``. ``per_role`` keys keep their meaning (roles, categories,
    ``<component>.<role>``); a key that names no layer is refused when the processors are installed.
    """
    default = (_spec_from_vllm_omni("default", config.default) if config.default is not None
               else AttentionSpec(backend=TORCH_SDPA))
    per_role = {key: _spec_from_vllm_omni(f"per_role[{key!r}]", spec) for key, spec in config.per_role.items()}
    return AttentionConfig(default=default, per_role=per_role)


def _spec_from_vllm_omni(where: str, spec) -> AttentionSpec:
    valid = [*SERVED_BACKENDS, *DENSE_BACKENDS]
    backend = canonical_backend(spec.backend) if served_here(spec.backend) else spec.backend.upper()
    if backend not in valid:
        raise AttentionConfigError(
            f"diffusion_attention_config.{where}.backend={spec.backend!r} cannot be combined with TRTLLM_ATTN on "
            f"the diffusers path: diffusers_trtllm's processors run every attention layer of the transformer, on "
            f"one of {valid}" + (" (or leave the default unset for TORCH_SDPA)" if where == "default" else ""))
    for name in ("fastvideo_vsa_topk", "block_sparse", "skip_calibration"):
        if getattr(spec, name, None) is not None:
            raise AttentionConfigError(
                f"diffusion_attention_config.{where}.{name}={getattr(spec, name)!r} is not used by diffusers_trtllm "
                "on the diffusers path (Skip-Softmax calibrations are read from each transformer's config.json); "
                "remove it")
    skip = spec.skip_softmax
    skip_softmax = None if skip is None else SkipSoftmaxSpec(
        target_sparsity=skip.target_sparsity, threshold=skip.threshold,
        disabled_until_timestep=skip.disabled_until_timestep)
    try:
        return AttentionSpec(backend=backend, skip_softmax=skip_softmax, quant=_quant_from_vllm_omni(spec.quant))
    except AttentionConfigError as e:
        raise AttentionConfigError(f"diffusion_attention_config.{where}: {e}") from None


def _quant_from_vllm_omni(quant) -> AttnQuantSpec | None:
    """vLLM-Omni's ``AttnQuantSpec`` (dtype_qk, dtype_vo, q/k block sizes defaulting to 1/16, FlashInfer
    variant pin) as this package's; what this package cannot honour is refused, naming the field."""
    if quant is None:
        return None
    if quant.flashinfer_backend is not None:
        raise AttentionConfigError(
            f"quant.flashinfer_backend={quant.flashinfer_backend!r} is not supported: diffusers_trtllm chooses the "
            "kernel for the GPU it runs on (README, GPU support); remove it")
    if quant.dtype_vo not in (None, SAGE_V_DTYPE):
        raise invalid("quant.dtype_vo", quant.dtype_vo, f"{SAGE_V_DTYPE!r} or null: diffusers_trtllm's SAGE "
                      "quantizes V per channel to fp8_e4m3")
    if quant.dtype_qk is None:
        if quant.dtype_vo is not None:
            raise invalid("quant.dtype_qk", None, "'int8' or 'fp8_e4m3' when dtype_vo is set (SAGE quantizes Q, K "
                          "and V together)")
        return None
    return AttnQuantSpec(dtype_qk=quant.dtype_qk, q_block_size=quant.q_block_size, k_block_size=quant.k_block_size)


# --- installing on the adapter's pipeline ---------------------------------------------------------------------

def trtllm_unavailable_reason(config: AttentionConfig, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``TRTLLM_ATTN`` cannot run ``config``'s TRTLLM_ATTN specs for attention in ``dtype`` on ``device``
    (one 128-token, head_dim-128 probe per spec through the backend's own check), or ``None``."""
    from ..backends.base import KernelPlan, VarlenQKV, get_backend

    specs = _named_specs(config)
    backend = get_backend(TRTLLM_ATTN)
    probe = VarlenQKV(*(torch.empty(PROBE_TOKENS, 1, PROBE_HEAD_DIM, dtype=dtype, device=device) for _ in range(3)),
                      (PROBE_TOKENS,), (PROBE_TOKENS,))
    for where, spec in specs:
        if spec.backend != TRTLLM_ATTN:
            continue
        plan = KernelPlan(backend=TRTLLM_ATTN, scale=PROBE_HEAD_DIM ** -0.5, skip_factor=1.0 if spec.skips else 0.0,
                          quant=spec.quant)
        reason = backend.unavailable_reason(plan, probe)
        if reason is not None:
            return f"{where}: {reason}"
    return None


def checked_config(pipeline, vllm_omni_config) -> AttentionConfig:
    """This package's config for ``vllm_omni_config``, refused (before anything is installed) when a
    ``TRTLLM_ATTN`` spec cannot run where ``pipeline``'s transformer runs."""
    config = attention_config_from_vllm_omni(vllm_omni_config)
    transformer = getattr(pipeline, "transformer", None)
    if transformer is None:
        raise AttentionConfigError(f"TRTLLM_ATTN is selected but {type(pipeline).__name__} has no transformer; "
                                   "diffusers_trtllm installs attention on transformers only")
    device, dtype = pipeline._execution_device, transformer.dtype  # diffusers' device for the call (offload-aware)
    reason = trtllm_unavailable_reason(config, device, dtype)
    if reason is not None:
        raise BackendUnavailableError(
            f"diffusion_attention_config selects TRTLLM_ATTN ({', '.join(trtllm_selected_by(vllm_omni_config))}), "
            f"but diffusers_trtllm cannot run it for {type(pipeline).__name__} on {device} in {dtype}: {reason}. "
            f"To serve this pipeline there, {INSTEAD}")
    return config


@contextlib.contextmanager
def warnings_to_vllm_log():
    """What this package warns about inside goes to vLLM-Omni's log (a warning goes to stderr once per process,
    which a server's log may not show), once per message."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for message in dict.fromkeys(str(w.message) for w in caught):
        logger.warning("%s", message)


def install_on_pipeline(pipeline, config: AttentionConfig):
    """Install this package's processors on every transformer of ``pipeline`` (loaded by vLLM-Omni's diffusers
    adapter) and say so in vLLM-Omni's log: the backend of each role, and what the install warned about. Returns
    the :class:`~diffusers_trtllm.TrtllmAttentionHandle`."""
    with warnings_to_vllm_log():
        handle = enable_trtllm_attention(pipeline, config, collect_stats=env_switch(COLLECT_STATS_ENV))
    logger.info("TRTLLM_ATTN for %s is served by diffusers_trtllm %s: %s (config %s)", type(pipeline).__name__,
                __version__, backends_by_role(handle), config.to_json())
    return handle


def backends_by_role(handle) -> str:
    """What runs each role of each component, e.g. ``transformer: self_attn TRTLLM_ATTN sage-fp8_e4m3 (40
    layers), cross_attn TORCH_SDPA dense (40 layers)``; a role whose layers differ lists each kind."""
    runs: dict[str, dict[str, Counter]] = {}
    for site, call in handle.planner.calls.items():
        kind = f"{call.backend} {call.mode(call.skips_somewhere)}"
        runs.setdefault(site.component, {}).setdefault(site.role, Counter())[kind] += 1
    return "; ".join(
        f"{component}: " + ", ".join(
            f"{role} " + " / ".join(f"{kind} ({n} layer{'s' if n > 1 else ''})" for kind, n in kinds.items())
            for role, kinds in roles.items())
        for component, roles in runs.items())


# --- wrapping vLLM-Omni ---------------------------------------------------------------------------------------

def _untested_version_error(version: str) -> BackendUnavailableError:
    return BackendUnavailableError(
        f"TRTLLM_ATTN on vLLM-Omni's diffusers path is provided by diffusers_trtllm for vllm-omni "
        f"{TESTED_VLLM_OMNI} (the adapter methods it wraps were read there); installed is vllm-omni {version}. "
        f"Install vllm-omni=={TESTED_VLLM_OMNI}, or {INSTEAD}")


def _set_attention_backend_wrapper(original, version: str):
    @functools.wraps(original)
    def _set_attention_backend(adapter) -> None:
        selected_config = adapter.od_config.diffusion_attention_config
        if not trtllm_selected_by(selected_config):
            return original(adapter)
        if version != TESTED_VLLM_OMNI:
            raise _untested_version_error(version)
        with warnings_to_vllm_log():  # e.g. a threshold >= 1, warned while the config is read
            config = checked_config(adapter._pipeline, selected_config)
        default = selected_config.default
        if default is None or not served_here(default.backend):
            # vLLM-Omni's dense default stays on the attention modules this package's processors do not serve
            # (HunyuanVideo 1.5's text refiner, for one).
            original(adapter)
        setattr(adapter, HANDLE_ATTRIBUTE, install_on_pipeline(adapter._pipeline, config))

    return _set_attention_backend


def _propagate_calibration_wrapper(original, version: str):
    @functools.wraps(original)
    def _propagate_skip_softmax_calibration(od_config, tf_config) -> None:
        if od_config.diffusion_load_format != "diffusers" or \
                not trtllm_selected_by(getattr(od_config, "diffusion_attention_config", None)):
            return original(od_config, tf_config)
        if version != TESTED_VLLM_OMNI:
            raise _untested_version_error(version)
        # diffusers_trtllm reads each transformer's calibration when it installs (install_on_pipeline).
        return None

    return _propagate_skip_softmax_calibration


def _wrap(owner: type, name: str, make_wrapper, version: str) -> None:
    original = getattr(owner, name, None)
    if original is None:
        logger.warning("vllm-omni %s has no %s.%s; diffusers_trtllm's TRTLLM_ATTN binding (written for vllm-omni "
                       "%s) is not installed there", version, owner.__name__, name, TESTED_VLLM_OMNI)
        return
    if getattr(original, _WRAPPED, False):
        return  # vLLM-Omni may load general plugins more than once per process
    wrapper = make_wrapper(original, version)
    setattr(wrapper, _WRAPPED, True)
    setattr(owner, name, wrapper)


def register() -> None:
    """Entry point of the ``vllm_omni.general_plugins`` group: bind ``TRTLLM_ATTN`` on the diffusers path."""
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.models.diffusers_adapter.pipeline_diffusers_adapter import DiffusersAdapterPipeline

    version = importlib.metadata.version("vllm-omni")
    if version != TESTED_VLLM_OMNI:
        logger.warning("diffusers_trtllm's vLLM-Omni plugin was written for vllm-omni %s; installed is %s: "
                       "TRTLLM_ATTN on the diffusers path will be refused", TESTED_VLLM_OMNI, version)
    _wrap(DiffusersAdapterPipeline, "_set_attention_backend", _set_attention_backend_wrapper, version)
    _wrap(OmniDiffusionConfig, "_propagate_skip_softmax_calibration", _propagate_calibration_wrapper, version)

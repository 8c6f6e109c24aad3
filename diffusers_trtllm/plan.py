"""What runs for this layer, this step, this GPU: config + session + call site -> :class:`AttentionPlan`.

The plan resolves, in order: the spec for the call site (``AttentionConfig.resolve``); whether skipping is on
for this step (the timestep gate); λ or the calibrated factor; whether the attention can take skipping and
quantization at all (a causal stream cannot); and which backend runs it (``backends.select_backend``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .backends import select_backend
from .backends.base import DEFAULT_TILE, KernelPlan, VarlenQKV
from .config import AttentionSpec
from .errors import AttentionConfigError
from .session import AttentionSession


@dataclass(frozen=True)
class CallSite:
    """One attention call site: component (``transformer_2``), layer (``blocks.3.attn1``), role, category."""

    component: str
    layer: str
    role: str
    category: str

    @property
    def qualified_layer(self) -> str:
        return f"{self.component}.{self.layer}"


@dataclass(frozen=True)
class AttentionPlan:
    """The decision for one call: the backend that runs, the kernel plan, and why (for logs and reports)."""

    backend: str
    kernel: KernelPlan
    spec_key: str
    notes: tuple[str, ...] = ()

    @property
    def mode(self) -> str:
        """Short name of what runs: ``dense``, ``skip``, ``sage-int8``, ``sage-fp8_e4m3+skip``..."""
        parts = []
        if self.kernel.quant is not None:
            parts.append(f"sage-{self.kernel.quant.dtype_qk}")
        if self.kernel.skips:
            parts.append("skip")
        return "+".join(parts) or "dense"


def skip_factor(spec: AttentionSpec, site: CallSite, session: AttentionSession, max_kv_len: int,
                notes: list[str]) -> float:
    """FlashInfer's threshold scale factor for this call (0 = no skipping), gate and calibration applied."""
    skip = spec.skip_softmax
    if skip is None or not skip.skips:
        return 0.0
    if skip.disabled_until_timestep > 0.0:
        if session.timestep is None:
            session.warn_once("gate-no-timestep", (
                f"skip_softmax.disabled_until_timestep={skip.disabled_until_timestep} is set but no timestep is "
                "known (install with enable_trtllm_attention(pipe, config) so the transformer's timestep is read); "
                "attention stays dense"))
            notes.append("dense: gate set, timestep unknown")
            return 0.0
        if session.timestep > skip.disabled_until_timestep:
            notes.append(f"dense: t={session.timestep:.3f} > disabled_until_timestep={skip.disabled_until_timestep}")
            return 0.0
    if skip.threshold is not None:
        return skip.threshold * max_kv_len
    calibration = session.calibrations.get(site.component)
    if calibration is None:
        raise AttentionConfigError(
            f"skip_softmax.target_sparsity={skip.target_sparsity} needs a Skip-Softmax calibration for component "
            f"{site.component!r}, and it has none: load a calibrated checkpoint (its config.json carries "
            "'sparse_attention_config'), run diffusers_trtllm.calibrate(pipe, prompts), or set "
            "skip_softmax.threshold (λ) instead")
    if calibration.keeps_dense(site.layer):
        notes.append(f"dense: {site.layer} is kept dense by {site.component}'s calibration (ignore/targets)")
        return 0.0
    lo_hi = calibration.sparsity_range
    if lo_hi is not None and not lo_hi[0] <= skip.target_sparsity <= lo_hi[1]:
        session.warn_once(f"extrapolate-{site.component}", (
            f"skip_softmax.target_sparsity={skip.target_sparsity} lies outside the sparsity range "
            f"[{lo_hi[0]:.2f}, {lo_hi[1]:.2f}] observed when {site.component!r} was calibrated; the factor is "
            "extrapolated"))
    factor = calibration.factor(skip.target_sparsity)
    if factor >= max_kv_len:
        session.warn_once(f"lambda-ge-1-{site.component}", (
            f"target_sparsity={skip.target_sparsity} gives λ = {factor / max_kv_len:.2f} >= 1 at kv_len "
            f"{max_kv_len} on {site.component!r}: nearly every KV tile will be skipped"))
    return factor


def plan_attention(session: AttentionSession, site: CallSite, qkv: VarlenQKV, *, scale: float, causal: bool = False,
                   sparse_ok: bool = True, quant_ok: bool = True, tile: tuple[int, int] = DEFAULT_TILE
                   ) -> AttentionPlan:
    """Decide how one attention call runs. ``sparse_ok`` / ``quant_ok`` are False for attention that must stay
    dense / unquantized whatever the config says (the processor knows; the plan's notes say so)."""
    site_key = (site.component, site.layer, site.role, site.category)
    key, spec = session.resolved.get(site_key) or session.config.resolve(*site_key)
    notes: list[str] = []
    factor = skip_factor(spec, site, session, qkv.max_seqlen_kv, notes)
    quant = spec.quant
    if factor and not sparse_ok:
        notes.append(f"dense: {site.role} attention does not take Skip-Softmax")
        factor = 0.0
    if factor and session.skip_probe is not None:
        session.skip_probe(site, qkv, scale=scale, causal=causal, tile=tile)
        notes.append("dense: Skip-Softmax calibration counted this call's skips")
        factor = 0.0
    if quant is not None and not quant_ok:
        notes.append(f"unquantized: {site.role} attention does not take SAGE")
        quant = None
    kernel = KernelPlan(backend=spec.backend, scale=scale, causal=causal, skip_factor=factor, quant=quant, tile=tile,
                        count_skips=session.collect_stats and factor > 0.0)
    backend, why = select_backend(spec.backend, kernel, qkv)
    kernel = replace(kernel, backend=backend)
    if why:
        session.info_once(f"auto-{backend}-{site.role}-{why}", f"{site.role} attention runs on {backend}: {why}")
        notes.append(why)
    return AttentionPlan(backend, kernel, key, tuple(notes))

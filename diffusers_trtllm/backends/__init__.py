"""Backend registry and selection: one dispatch call over small backend modules that declare their limits.

``TRTLLM_ATTN`` (FlashInfer's TRT-LLM kernels, and this package's SAGE kernels on Hopper), ``TORCH_SDPA`` (dense
baseline) and ``TORCH_REFERENCE`` (PyTorch ground truth with every feature, any device: for tests, calibration
and explicit use; ``auto`` never picks it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..config import AUTO, TORCH_REFERENCE, TRTLLM_ATTN
from ..errors import BackendUnavailableError
from . import reference, sdpa, trtllm  # noqa: F401  (registration)
from .base import KernelPlan, KernelResult, VarlenQKV, get_backend, registered_backends, route_of, route_runner
from .sdpa import masked_dense_attention  # noqa: F401  (the op's dense backward)
from .trtllm import dense_route


@dataclass(frozen=True)
class BackendChoice:
    """The backend that runs a call site; ``dropped`` says which requested features ``auto`` could not keep and
    why ("" when all were kept)."""

    name: str
    dropped: str = ""
    #: ``auto`` kept Skip-Softmax and SAGE but not their reuse of tile maps (said in ``dropped``)
    reuse_dropped: bool = False

    @property
    def route(self) -> str:
        """The kernel route the chosen backend runs (the test seam's, where it applied at the choice)."""
        return route_of(self.name)


def _features(plan: KernelPlan) -> list[str]:
    return ((["Skip-Softmax"] if plan.skips else []) + ([f"SAGE {plan.quant.dtype_qk}"] if plan.quant else [])
            + (["Skip-Softmax reuse"] if plan.reuse else []))


def select_backend(requested: str, plan: KernelPlan, qkv: VarlenQKV) -> BackendChoice:
    """An explicit backend that cannot run ``plan`` raises with its reason. ``auto`` takes the most preferred
    backend that runs the plan; when none does (skip or SAGE on a GPU without TRT-LLM kernels, or on a CPU), it
    takes the fastest dense backend and says in ``dropped`` what was dropped and why (where only the reuse of tile
    maps keeps a plan from running, that alone)."""
    if requested != AUTO:
        reason = get_backend(requested).unavailable_reason(plan, qkv)
        if reason:
            raise BackendUnavailableError(f"backend {requested} cannot run this attention: {reason}")
        return BackendChoice(requested)
    candidates = [b for b in registered_backends() if b.name != TORCH_REFERENCE]
    passed_over = []
    for backend in candidates:
        reason = backend.unavailable_reason(plan, qkv)
        if reason is None:
            return BackendChoice(backend.name)
        passed_over.append(f"{backend.name}: {reason}")
    if plan.reuse:
        without = select_backend(AUTO, replace(plan, reuse=False), qkv)
        if not without.dropped:
            return BackendChoice(without.name, f"Skip-Softmax reuse dropped ({'; '.join(passed_over)})",
                                 reuse_dropped=True)
    features = _features(plan)
    if features:
        dense = replace(plan, skip_factor=0.0, quant=None, reuse=False)
        for backend in candidates:
            if backend.unavailable_reason(dense, qkv) is None:
                return BackendChoice(backend.name, f"{' and '.join(features)} dropped ({'; '.join(passed_over)})")
    raise BackendUnavailableError("no backend can run this attention: " + "; ".join(passed_over))


def planned_route(choice: BackendChoice, device: torch.device, dense_kernel: str = AUTO) -> str:
    """The kernel route a call site chosen to run on ``choice`` runs on ``device``, decided once (at install, or
    once per kind of unplanned call): TRTLLM_ATTN's names the dense kernel it runs on Hopper
    (:func:`~.trtllm.dense_route`; an explicit ``dense_kernel`` that cannot run raises)."""
    return dense_route(device, dense_kernel) if choice.route == TRTLLM_ATTN else choice.route


def run_backend(route: str, qkv: VarlenQKV, plan: KernelPlan) -> KernelResult:
    """Run a planned route (:func:`planned_route`)."""
    return route_runner(route)(qkv, plan)

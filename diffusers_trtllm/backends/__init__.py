"""Backend registry and selection: one dispatch call over small backend modules that declare their limits.

``TRTLLM_ATTN`` (FlashInfer's TRT-LLM kernels, and this package's SAGE kernel on Hopper), ``TORCH_SDPA`` (dense
baseline) and ``TORCH_REFERENCE`` (PyTorch ground truth with every feature, any device).
"""

from __future__ import annotations

from ..config import AUTO
from ..errors import BackendUnavailableError
from . import reference, sdpa, trtllm  # noqa: F401  (registration)
from .base import KernelPlan, KernelResult, VarlenQKV, get_backend, registered_backends


def select_backend(requested: str, plan: KernelPlan, qkv: VarlenQKV) -> tuple[str, str]:
    """Return ``(backend name, why)``. An explicit backend that cannot run raises with its reason; ``auto``
    takes the most preferred backend that can and says why the better ones could not (``why`` is "" for an
    explicit choice)."""
    if requested != AUTO:
        reason = get_backend(requested).unavailable_reason(plan, qkv)
        if reason:
            raise BackendUnavailableError(f"backend {requested} cannot run this attention call: {reason}")
        return requested, ""
    passed_over = []
    for backend in registered_backends():
        reason = backend.unavailable_reason(plan, qkv)
        if reason is None:
            why = "auto: " + ("; ".join(passed_over) if passed_over else f"{backend.name} is the preferred backend")
            return backend.name, why
        passed_over.append(f"{backend.name} unavailable ({reason})")
    raise BackendUnavailableError("no backend can run this attention call: " + "; ".join(passed_over))


def run_backend(name: str, qkv: VarlenQKV, plan: KernelPlan) -> KernelResult:
    return get_backend(name).run(qkv, plan)

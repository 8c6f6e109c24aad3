"""FlashAttention-4 (``flash-attn-4`` on PyPI, CuTe DSL) as a dense BF16 kernel: whether it can run, and the call.

On Hopper FlashAttention-4's bf16 forward is faster than cuDNN SDPA and FMHAv2 at the video models' shapes
(benchmarks/RESULTS.md), so ``TRTLLM_ATTN`` runs its dense steps there when it is installed. It has no
Skip-Softmax and no per-block SAGE, so skipping and SAGE steps stay on their own kernels.

One call per batch through ``flash_attn.cute.flash_attn_varlen_func``: q ``[total_q, Hq, D]``, k/v
``[total_kv, Hkv, D]`` (grouped-query heads allowed), sequences delimited by int32 cumulative lengths on the
device (cached per batch layout by the caller), the longest lengths as host ints (FlashAttention-4 sizes its
launch from them), any query and key lengths. The call plan is built without importing FlashAttention-4 (its CuTe
DSL needs CUDA libraries), so CPU tests bind it against the wheel's real signature.

Each new shape class JIT-compiles a kernel on its first call (seconds), cached for the process;
``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1`` keeps the compiled kernels on disk across processes
(FlashAttention-4's own setting).
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect

import torch
from packaging.version import Version

from .flashinfer_calls import KernelCall

DISTRIBUTION = "flash-attn-4"
MODULE = "flash_attn.cute"
VARLEN = "flash_attn_varlen_func"
# The version this package's call plan was bound against (older betas lack arguments it passes or differ in them).
MIN_VERSION = "4.0.0b40"
INSTALL = "pip install 'flash-attn-4>=4.0.0b40' (CUDA 13: 'flash-attn-4[cu13]>=4.0.0b40')"
# Arguments of flash_attn_varlen_func that the call plan passes (checked on the installed wheel).
REQUIRED_PARAMETERS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                       "softmax_scale", "causal", "return_lse")


def installed_version() -> str | None:
    """The installed ``flash-attn-4`` version, or ``None``."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def flash_attn4_module():
    """``flash_attn.cute``, imported once (its CuTe DSL import takes seconds; raises when it cannot load)."""
    import flash_attn.cute

    return flash_attn.cute


@functools.lru_cache(maxsize=None)
def unavailable_reason() -> str | None:
    """Why FlashAttention-4 cannot run here (not installed, too old, fails to import, lacks an argument), or
    ``None``. Cached: the answer does not change within a process."""
    version = installed_version()
    if version is None:
        return f"FlashAttention-4 is not installed ({INSTALL})"
    if Version(version) < Version(MIN_VERSION):
        return f"flash-attn-4 {version} is older than {MIN_VERSION}, the version this package calls ({INSTALL})"
    try:
        module = flash_attn4_module()
    except Exception as exc:  # noqa: BLE001 - any import failure is the reason
        return f"flash-attn-4 {version} is installed but `import {MODULE}` failed: {exc!r}"
    function = getattr(module, VARLEN, None)
    if function is None:
        return f"flash-attn-4 {version} has no {MODULE}.{VARLEN}"
    missing = [p for p in REQUIRED_PARAMETERS if p not in inspect.signature(function).parameters]
    if missing:
        return f"flash-attn-4 {version}'s {MODULE}.{VARLEN} lacks the argument(s) {missing}"
    return None


def varlen_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, scale: float,
                return_lse: bool = False) -> KernelCall:
    """Dense non-causal attention over a packed batch (layout in the module docstring); ``max_seqlen_*`` are host
    ints. FlashAttention-4 returns ``(out, lse)``, ``lse`` None without ``return_lse``, else ``[Hq, total_q]``
    float32, natural log (its varlen layout)."""
    return KernelCall(VARLEN, dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                   max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k),
                                   softmax_scale=float(scale), causal=False, return_lse=bool(return_lse)))


def flash_attn4_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                          cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, scale: float,
                          return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Run :func:`varlen_call`; returns ``out [total_q, Hq, D]`` in q's dtype, with ``return_lse`` also the
    log-sum-exp ``[total_q, Hq]`` float32 (transposed from FlashAttention-4's layout)."""
    out, lse = varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                           return_lse)(flash_attn4_module())
    return (out, lse.t().contiguous()) if return_lse else out

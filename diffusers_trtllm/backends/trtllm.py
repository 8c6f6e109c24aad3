"""``TRTLLM_ATTN``: NVIDIA's TRT-LLM attention kernels through FlashInfer (and this package's SAGE kernel on Hopper).

Which kernel runs, by GPU (head_dim 128, bf16, non-causal only):

==================  ==========================================  ===========================================
GPU                 dense / Skip-Softmax                        SAGE (per-block Q/K, per-channel V)
==================  ==========================================  ===========================================
sm_90 (H100/H200)   FlashInfer ``trtllm_fmha_v2_prefill``       ``kernels.triton_sage`` (this package)
                    (FMHAv2, JIT-built once per machine)
sm_100 (B200)       FlashInfer ``trtllm_ragged_attention_       FlashInfer ``trtllm_sage_attention_quantize``
sm_103 (B300)       deepseek`` (trtllm-gen cubins)              + trtllm-gen; int8 Q/K on sm_100 only
anything else       none: the check says so                     none
==================  ==========================================  ===========================================

Declared constraints (:func:`unavailable_reason` returns the first that fails, as a sentence):

- head_dim 128; q/k/v bf16 on one CUDA device; non-causal; every sequence non-empty;
- Hopper FMHAv2: self-attention (equal lengths, grouped-query heads allowed) and cross-attention on a short
  context (75,600 queries on 512 keys, rel. err. 6.8e-5; 4,096 on 257) were proven against cuDNN SDPA on an H200.
  With fewer queries than keys FMHAv2 0.7.2 returns wrong results, grouped or not (rel. err. 0.17 for 19,320
  queries on 19,920 keys at 32/8 and 32/32 heads, 0.36 for 4,096 on 4,696 at 8/8; ``benchmarks/attention.py``'s
  shape proofs), so such sequences run with zero-padded queries (``kernels.flashinfer_fmha.run_fmha_v2``).
  Cross-attention runs 24% slower than cuDNN there (1.91 vs 1.55 ms, a small share of a step); a ``per_role``
  ``{"cross": {"backend": "TORCH_SDPA"}}`` moves it to cuDNN;
- Blackwell SAGE: Q block 1 with K block 1, 4 or 16 (the kernels FlashInfer 0.7.2's trtllm-gen ships); int8 Q/K
  on sm_100 only, fp8 e4m3 on sm_100 and sm_103;
- FlashInfer >= 0.6.18 with the arguments these calls pass (read from its signatures).

Skip-Softmax decisions are taken per 128 × 128 tile on Hopper (the reference backend at ``tile=(128, 128)``
predicts them); the kernels do not count skipped tiles, so results carry no counts.
"""

from __future__ import annotations

import functools
import inspect

import torch

from ..config import QK_DTYPES, SAGE_BLOCK_SIZES, TRTLLM_ATTN, AttnQuantSpec
from ..errors import BackendUnavailableError
from ..kernels import triton_sage
from ..kernels.flashinfer_calls import FMHA_V2, SAGE_QUANTIZE, TRTLLM_GEN
from ..kernels.flashinfer_fmha import (CubinUnavailableError, flashinfer_prefill, run_fmha_v2, run_trtllm_gen,
                                       warmup)
from ..platform import flashinfer_version, gpu_arch, version_tuple
from .base import KernelPlan, KernelResult, VarlenQKV, register_backend

__all__ = ["CubinUnavailableError", "unavailable_reason", "run", "warmup", "sage_specs_with_kernels"]

HEAD_DIM = 128
SUPPORTED_DTYPES = (torch.bfloat16,)
FMHA_V2_ARCHS = ("sm_90",)
TRTLLM_GEN_ARCHS = ("sm_100", "sm_103")
MIN_FLASHINFER = (0, 6, 18)  # SAGE quantizer with smooth_k and the batch-padded scale layout
SAGE_QK_DTYPES_BY_ARCH = {"sm_100": ("int8", "fp8_e4m3"), "sm_103": ("fp8_e4m3",)}
SAGE_Q_BLOCKS = (1,)
SAGE_K_BLOCKS = (1, 4, 16)

# Arguments each FlashInfer function must accept for the calls in kernels.flashinfer_calls (checked on the
# installed FlashInfer, so an older or changed one is refused with a reason instead of failing mid-pipeline).
REQUIRED_PARAMETERS = {
    FMHA_V2: ("qkv", "input_layout", "mask_mode", "skip_softmax_threshold_scale_factor"),
    TRTLLM_GEN: ("skip_softmax_threshold_scale_factor", "skip_all_rows_active_check", "sage_attn_sfs",
                 "num_elts_per_sage_attn_blk"),
    SAGE_QUANTIZE: ("qk_quant_dtype", "cum_seq_lens_kv", "smooth_k"),
}


@functools.lru_cache(maxsize=None)
def flashinfer_unavailable_reason(function: str) -> str | None:
    """Why ``flashinfer.prefill.<function>`` cannot serve this backend here, or ``None``."""
    version = flashinfer_version()
    install = "pip install 'flashinfer-python>=0.6.18,<0.8'"
    if version is None:
        return f"FlashInfer is not installed ({install})"
    if version_tuple(version) < MIN_FLASHINFER:
        return f"FlashInfer {version} is too old: TRTLLM_ATTN needs 0.6.18 or newer ({install})"
    try:
        prefill = flashinfer_prefill()
    except Exception as exc:  # noqa: BLE001 - any import failure is a reason to refuse
        return f"FlashInfer {version} is installed but `import flashinfer.prefill` failed: {exc!r}"
    fn = getattr(prefill, function, None)
    if fn is None:
        return f"FlashInfer {version} has no flashinfer.prefill.{function}"
    missing = [p for p in REQUIRED_PARAMETERS[function] if p not in inspect.signature(fn).parameters]
    if missing:
        return f"FlashInfer {version}'s flashinfer.prefill.{function} lacks the argument(s) {missing}"
    return None


def sage_specs_with_kernels(arch: str) -> list[AttnQuantSpec]:
    """Default-block SAGE settings (q 1, k 16) for each Q/K dtype the GPU ``arch`` has trtllm-gen kernels for."""
    return [AttnQuantSpec(dtype_qk=dtype) for dtype in SAGE_QK_DTYPES_BY_ARCH.get(arch, ())]


def _common_reason(plan: KernelPlan, qkv: VarlenQKV) -> str | None:
    if plan.causal:
        return ("the plan is causal (e.g. Cosmos 3's text stream); TRTLLM_ATTN runs non-causal attention only: "
                "route causal attention to TORCH_SDPA or TORCH_REFERENCE")
    if qkv.head_dim != HEAD_DIM or qkv.k.shape[-1] != HEAD_DIM or qkv.v.shape[-1] != HEAD_DIM:
        return (f"head_dim is {qkv.head_dim} (k {qkv.k.shape[-1]}, v {qkv.v.shape[-1]}); TRTLLM_ATTN's kernels "
                f"take head_dim {HEAD_DIM} only")
    dtypes = {qkv.q.dtype, qkv.k.dtype, qkv.v.dtype}
    if len(dtypes) != 1 or qkv.q.dtype not in SUPPORTED_DTYPES:
        return (f"q/k/v dtypes are {qkv.q.dtype}/{qkv.k.dtype}/{qkv.v.dtype}; TRTLLM_ATTN takes "
                f"{', '.join(str(d) for d in SUPPORTED_DTYPES)} inputs (SAGE quantizes them itself)")
    if len({qkv.q.device, qkv.k.device, qkv.v.device}) != 1:
        return f"q/k/v are on different devices ({qkv.q.device}, {qkv.k.device}, {qkv.v.device})"
    if min(qkv.seqlens_q) == 0 or min(qkv.seqlens_kv) == 0:
        return (f"a sequence is empty (query lengths {qkv.seqlens_q}, key lengths {qkv.seqlens_kv}); the kernels "
                "run without an empty-row check")
    return None


def _hopper_reason(plan: KernelPlan, qkv: VarlenQKV) -> str | None:
    if plan.quant is not None:  # FlashInfer has no per-block SAGE kernel for sm_90: this package's Triton one
        return triton_sage.triton_sage_unavailable_reason(plan, qkv)
    return flashinfer_unavailable_reason(FMHA_V2)


def _blackwell_reason(plan: KernelPlan, qkv: VarlenQKV, arch: str) -> str | None:
    quant = plan.quant
    if quant is not None:
        dtypes = SAGE_QK_DTYPES_BY_ARCH[arch]
        if quant.dtype_qk not in dtypes:
            return (f"SAGE with {quant.dtype_qk} Q/K has no trtllm-gen kernel on {arch}; it has {list(dtypes)} "
                    f"(valid dtypes in general: {list(QK_DTYPES)})")
        if quant.q_block_size not in SAGE_Q_BLOCKS or quant.k_block_size not in SAGE_K_BLOCKS:
            return (f"SAGE blocks q={quant.q_block_size}, k={quant.k_block_size} have no trtllm-gen kernel; "
                    f"compiled: q block {list(SAGE_Q_BLOCKS)} with k block {list(SAGE_K_BLOCKS)} "
                    f"(of the configurable {list(SAGE_BLOCK_SIZES)})")
        return flashinfer_unavailable_reason(SAGE_QUANTIZE) or flashinfer_unavailable_reason(TRTLLM_GEN)
    return flashinfer_unavailable_reason(TRTLLM_GEN)


def unavailable_reason(plan: KernelPlan, qkv: VarlenQKV) -> str | None:
    """``None`` when TRTLLM_ATTN can run ``plan`` on ``qkv`` on their device, else a sentence saying why not."""
    reason = _common_reason(plan, qkv)
    if reason is not None:
        return reason
    arch = gpu_arch(qkv.q.device)
    if arch is None:
        return (f"the tensors are on {qkv.q.device}; TRTLLM_ATTN needs a CUDA GPU with TRT-LLM kernels: "
                "sm_90 (H100/H200) or sm_100/sm_103 (B200/B300)")
    if arch in FMHA_V2_ARCHS:
        return _hopper_reason(plan, qkv)
    if arch in TRTLLM_GEN_ARCHS:
        return _blackwell_reason(plan, qkv, arch)
    hint = " (workstation Blackwell)" if arch.startswith("sm_12") else ""
    return (f"no TRT-LLM attention kernel for {arch}{hint}; TRTLLM_ATTN runs on sm_90 (H100/H200) and sm_100/"
            "sm_103 (B200/B300)")


def run(qkv: VarlenQKV, plan: KernelPlan) -> KernelResult:
    """Attention over the packed batch in one kernel call (two with SAGE on Blackwell: quantize, attend).

    ``qkv``: :class:`~.base.VarlenQKV` with q ``[total_q, Hq, 128]``, k/v ``[total_kv, Hkv, 128]`` bf16 on a
    CUDA device that :func:`unavailable_reason` accepted. Returns ``out [total_q, Hq, 128]`` bf16 and no tile
    counts (the kernels do not report them).
    """
    arch = gpu_arch(qkv.q.device)
    if arch in FMHA_V2_ARCHS:
        if plan.quant is not None:
            return triton_sage.triton_sage_attention(qkv, plan)
        return KernelResult(run_fmha_v2(qkv, plan))
    if arch in TRTLLM_GEN_ARCHS:
        return KernelResult(run_trtllm_gen(qkv, plan))
    raise BackendUnavailableError(f"TRTLLM_ATTN has no kernel for {arch or qkv.q.device}")


TRTLLM_BACKEND = register_backend(TRTLLM_ATTN, run, unavailable_reason, priority=10)

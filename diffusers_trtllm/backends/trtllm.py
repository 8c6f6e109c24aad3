"""``TRTLLM_ATTN``: NVIDIA's TRT-LLM attention kernels through FlashInfer (and this package's SAGE kernel on Hopper).

Which kernel runs, by GPU (head_dim 128, bf16, non-causal only):

==================  ==========================================  =================================================
GPU                 dense / Skip-Softmax                        SAGE (per-block Q/K, per-channel V)
==================  ==========================================  =================================================
sm_90 (H100/H200)   FlashInfer ``trtllm_fmha_v2_prefill``       fp8: TRT-LLM FMHAv2's warp-specialized SAGE kernel
                    (FMHAv2, JIT-built once per machine)        (``kernels.fmha_v2_sage``, Q block 64, K block
                                                                64/128 or per head, no more queries than keys);
                                                                int8, Q/K blocks 1/4/16 or more queries than
                                                                keys: ``kernels.triton_sage``
sm_100 (B200)       FlashInfer ``trtllm_ragged_attention_       FlashInfer ``trtllm_sage_attention_quantize``
sm_103 (B300)       deepseek`` (trtllm-gen cubins)              + trtllm-gen; int8 Q/K on sm_100 only
anything else       none: the check says so                     none
==================  ==========================================  =================================================

Dense steps on Hopper (no SAGE, skip value 0) run the dense kernel chosen for the call site at install
(:func:`dense_route`, the spec's ``dense_kernel``): ``auto`` takes FlashAttention-4 where it is installed (faster
than FMHAv2 and cuDNN at the video models' shapes), else cuDNN through torch SDPA (as fast as FMHAv2 on
self-attention, faster on cross-attention and with fewer queries than keys); ``fmha_v2``, ``flash_attn4`` or
``cudnn`` pins one and raises at install where it cannot run. Skip-Softmax steps run FMHAv2 whatever the choice
(neither of the others skips). The call site's route carries the choice (``TRTLLM_ATTN+flash_attn4``; calls not
planned at install take ``auto``'s at their first call); the plain route ``TRTLLM_ATTN`` runs FMHAv2.

SAGE block sizes left unset (``None``) take the fastest kernel of the GPU (logged once; on Hopper fp8 with no
more queries than keys per sequence, FMHAv2 with one K scale per sequence and head); an explicit block size or
dtype without a kernel on the GPU is refused, naming what the GPU offers (:func:`sage_block_sizes`).

Declared constraints (:func:`unavailable_reason` returns the first that fails, as a sentence):

- an sm_90, sm_100 or sm_103 GPU (checked first); head_dim 128; q/k/v bf16 on one device; non-causal; every
  sequence non-empty; query heads a multiple of key/value heads;
- Hopper FMHAv2: self-attention (equal lengths, grouped-query heads allowed) and cross-attention on a short
  context are proven against cuDNN SDPA (``benchmarks/attention.py``'s shape proofs). With fewer queries than keys
  FMHAv2 0.7.2 returns wrong results, grouped or not, so such sequences run with zero-padded queries
  (``kernels.flashinfer_fmha.fmha_v2_attention``). Cross-attention is slower than cuDNN there (a small share of a
  step); a ``per_role`` ``{"cross": {"backend": "TORCH_SDPA"}}`` moves it to cuDNN;
- FlashInfer >= 0.6.18 with the arguments these calls pass (read from its signatures).

The log-sum-exp (``KernelPlan.return_lse``, ring attention): FMHAv2 (dense, Skip-Softmax, SAGE) from its softmax
statistics, FlashAttention-4 from its own, trtllm-gen from its base-2 log-sum-exp; SAGE's K smoothing shift
``scale · q · mean(K)`` is added back. A dense step on the cuDNN route runs FMHAv2 when it must return the
log-sum-exp (torch SDPA gives none; FMHAv2 is as fast on self-attention); the Triton SAGE kernel writes it too.

Skip-Softmax reuse (``KernelPlan.reuse``, tile maps kept across steps): both Hopper SAGE kernels read a map and skip
its tiles without loading them, FMHAv2's at 256-key steps of two gathered tiles (``SageSemantics.paired_tiles``), a
fresh map (``KernelPlan.fresh_map``) on its Skip-Softmax kernel's steps, which writes the map
(:func:`sage_semantics` with ``reuse`` and ``fresh_map``; :func:`reuse_unavailable_reason` says which plans run
it).

Skip-Softmax decisions are taken per 128 × 128 tile by FMHAv2 bf16 on Hopper (the reference backend at
``tile=(128, 128)`` predicts them), per 64 × 128 by the FMHAv2 SAGE kernel (both halves of a 256-key step against
the running max at the step's start) and by the Triton SAGE kernel (:data:`TRITON_SKIP_TILE_SM90`); the SAGE
kernels' tiles are part of their semantics (``SageSemantics.skip_tile``), which the reference follows, as it follows
the Triton kernel's rule of skipping only in the heads where its sampled query tiles found skipping to pay
(``SageSemantics.skip_sample``). An explicit
``threshold`` is λ itself: every sequence of a ragged batch gets the factor λ·max_kv_len, hence
λ_i = λ·max_kv_len / kv_len_i (the kernels take one factor per call); the reference does exactly that.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import time

import torch

from torch.nn.attention import SDPBackend, sdpa_kernel

from ..config import AUTO, CUDNN, DENSE_KERNELS, FLASH_ATTN4, FMHA_V2_DENSE, QK_DTYPES, TRTLLM_ATTN, AttnQuantSpec
from ..errors import BackendUnavailableError, invalid
from ..kernels import flash_attn4, fmha_v2_sage, triton_sage
from ..kernels.flashinfer_calls import FMHA_V2, SAGE_QUANTIZE, TRTLLM_GEN
from ..kernels.flashinfer_fmha import (CubinUnavailableError, fmha_v2_attention, flashinfer_prefill,
                                       release_workspaces, trtllm_gen_attention)
from ..kernels.numerics import HEAD_DIM, P_SCALE, head_dim_mismatch
from ..platform import flashinfer_version, gpu_arch, version_tuple
from ..quant import SageSemantics
from .base import (ROUTE_KERNEL_SEPARATOR, KernelPlan, KernelResult, VarlenQKV, dense_kernel_of,
                   more_queries_than_keys, register_backend, tile_map_for)
from .sdpa import SDPA_BACKEND

__all__ = ["CubinUnavailableError", "device_unavailable_reason", "unavailable_reason", "reuse_unavailable_reason",
           "run", "warmup", "release_workspaces", "sage_specs_with_kernels", "sage_semantics", "sage_block_sizes",
           "dense_route", "dense_kernel_of"]

logger = logging.getLogger("diffusers_trtllm")

SUPPORTED_DTYPES = (torch.bfloat16,)
FMHA_V2_ARCHS = ("sm_90",)
TRTLLM_GEN_ARCHS = ("sm_100", "sm_103")
MIN_FLASHINFER = (0, 6, 18)  # SAGE quantizer with smooth_k and the batch-padded scale layout
SAGE_QK_DTYPES_BY_ARCH = {"sm_90": QK_DTYPES, "sm_100": ("int8", "fp8_e4m3"), "sm_103": ("fp8_e4m3",)}
TRITON_SAGE_BLOCKS = (1, 4, 16)  # Q and K blocks of the Triton kernel (and of trtllm-gen's K)
TRTLLM_GEN_Q_BLOCKS = (1,)
PORTABLE_BLOCKS = (1, 16)  # q, k blocks for unset sizes on kernels other than FMHAv2 SAGE
# FMHAv2 SAGE for unset block sizes: the fastest at Wan 2.2's shape (benchmarks/RESULTS.md): one K scale per
# sequence and head (folded into Q's scales: no per-key scaling in the kernel), 256-key KV steps. K blocks of 64
# keys cost more time at the same error on smoothed K; 128-key steps are slower with and without skipping.
FMHA_V2_DEFAULT_K_BLOCK = 0
FMHA_V2_KV_STEP = 256
# sm_90's fp8 tensor cores add each instruction's 32 products to the accumulator at 14 bits below the largest
# exponent among them (fitted on cuBLAS's fast-accumulation fp8 GEMM, benchmarks/RESULTS.md); FMHAv2 keeps its sums
# in that accumulator, so the reference of its semantics sums the same way.
SM90_FP8_ACCUMULATOR_BITS = 14
FMHA_V2_USER_K_BLOCKS = tuple(b for b in fmha_v2_sage.K_BLOCKS if b)  # 0 (per sequence) is internal only
# The Triton SAGE kernel's Skip-Softmax tile on sm_90: its dense launch's tile (one warpgroup per program); with
# 128 × 128 tiles (two warpgroups) the same sparsity takes longer (benchmarks/RESULTS.md).
TRITON_SKIP_TILE_SM90 = (triton_sage.DENSE_LAUNCH.block_m, triton_sage.DENSE_LAUNCH.block_n)

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
    """SAGE settings with unset blocks (the GPU's fastest kernel) for each Q/K dtype the GPU ``arch`` has."""
    return [AttnQuantSpec(dtype_qk=dtype) for dtype in SAGE_QK_DTYPES_BY_ARCH.get(arch, ())]


def sage_block_sizes(arch: str | None, dtype_qk: str,
                     more_queries_than_keys: bool = False) -> dict[str, tuple[int, ...]]:
    """Q and K block sizes with a compiled SAGE kernel for ``dtype_qk`` on ``arch`` (``{"q": ..., "k": ...}``;
    on Hopper FMHAv2's Q block 64 serves sequences with at most as many queries as keys, so
    ``more_queries_than_keys`` (some sequence of the call has more) rules it out)."""
    if arch in FMHA_V2_ARCHS:
        fmha = dtype_qk == "fp8_e4m3" and not more_queries_than_keys
        return {"q": TRITON_SAGE_BLOCKS + ((fmha_v2_sage.Q_BLOCK,) if fmha else ()),
                "k": TRITON_SAGE_BLOCKS + (FMHA_V2_USER_K_BLOCKS if fmha else ())}
    if arch in TRTLLM_GEN_ARCHS:
        return {"q": TRTLLM_GEN_Q_BLOCKS, "k": TRITON_SAGE_BLOCKS}
    return {"q": TRITON_SAGE_BLOCKS, "k": TRITON_SAGE_BLOCKS}


def _hopper_sage_kernel(quant: AttnQuantSpec, more_queries_than_keys: bool) -> str:
    """``"fmha_v2"`` or ``"triton"``: which Hopper SAGE kernel serves ``quant`` (FMHAv2 runs fewer queries than
    keys with zero queries after them, not more)."""
    if quant.dtype_qk != "fp8_e4m3" or more_queries_than_keys:
        return "triton"
    if quant.q_block_size is None:
        return "fmha_v2" if quant.k_block_size in (None, *FMHA_V2_USER_K_BLOCKS) else "triton"
    return "fmha_v2" if quant.q_block_size == fmha_v2_sage.Q_BLOCK else "triton"


@functools.lru_cache(maxsize=None)
def _log_choice(arch: str, quant: AttnQuantSpec, semantics: SageSemantics, kernel: str) -> None:
    logger.warning("TRTLLM_ATTN SAGE %s on %s with unset block sizes: the %s kernel, Q block %d, K block %s",
                   quant.dtype_qk, arch, kernel, semantics.q_block,
                   semantics.k_block or "one per sequence and head")


def fmha_v2_sage_semantics(k_block: int, kv_step: int = FMHA_V2_KV_STEP,
                           fp8_accumulator_bits: int | None = SM90_FP8_ACCUMULATOR_BITS,
                           paired_tiles: bool = False) -> SageSemantics:
    """What the FMHAv2 SAGE kernel with K scale block ``k_block`` and ``kv_step`` keys per step computes
    (``fp8_accumulator_bits`` None: the same with exact sums, a reference for comparison; ``paired_tiles``: the
    tile-map kernel's gathered steps)."""
    return SageSemantics("fp8_e4m3", fmha_v2_sage.Q_BLOCK, k_block, p_scale=fmha_v2_sage.P_SCALE, kv_step=kv_step,
                         fp8_accumulator_bits=fp8_accumulator_bits, skip_tile=fmha_v2_sage.SKIP_TILE,
                         q_padded_to_kv=True, paired_tiles=paired_tiles)


def sage_semantics(quant: AttnQuantSpec, device: torch.device | str, seqlens_q=(1,), seqlens_kv=(1,), heads: int = 1,
                   tile: tuple[int, int] = (128, 128), reuse: bool = False,
                   fresh_map: bool = False) -> SageSemantics:
    """What the SAGE kernel that ``TRTLLM_ATTN`` runs for ``quant`` on ``device`` computes for a batch of these
    lengths and query ``heads`` (block sizes resolved, P's fp8 scale, per-sequence or batch-wide statistics, the
    Triton kernel's sample of query tiles); ``reuse``: for a plan reusing tile maps (FMHAv2's tile-map kernel
    gathers two tiles a step, ``SageSemantics.paired_tiles``), unless ``fresh_map`` (``KernelPlan.fresh_map``:
    FMHAv2 runs a zeroed map on its Skip-Softmax kernel's steps, which writes the map). On a device without TRT-LLM kernels:
    this package's Triton kernel's semantics, with unset blocks as :data:`PORTABLE_BLOCKS`, deciding skips per
    ``tile``."""
    arch = gpu_arch(device)
    more_queries = more_queries_than_keys(seqlens_q, seqlens_kv)
    unset = quant.q_block_size is None or quant.k_block_size is None
    if arch in FMHA_V2_ARCHS and _hopper_sage_kernel(quant, more_queries) == "fmha_v2":
        k_block = FMHA_V2_DEFAULT_K_BLOCK if quant.k_block_size is None else quant.k_block_size
        kv_step = fmha_v2_sage.REUSE_KV_STEP if reuse else FMHA_V2_KV_STEP
        semantics = fmha_v2_sage_semantics(k_block, kv_step, paired_tiles=reuse and not fresh_map)
        kernel = "FMHAv2 (TRT-LLM, warp-specialized)"
    else:
        q_block = PORTABLE_BLOCKS[0] if quant.q_block_size is None else quant.q_block_size
        k_block = PORTABLE_BLOCKS[1] if quant.k_block_size is None else quant.k_block_size
        blackwell = arch in TRTLLM_GEN_ARCHS
        skip_tile = TRITON_SKIP_TILE_SM90 if arch in FMHA_V2_ARCHS else None
        sample = None if blackwell else triton_sage.skip_sample_rule(tuple(seqlens_q), heads, (skip_tile or tile)[0],
                                                                     device)
        semantics = SageSemantics(quant.dtype_qk, q_block, k_block, p_scale=P_SCALE, batch_stats=blackwell,
                                  skip_tile=skip_tile, skip_sample=sample)
        kernel = "trtllm-gen" if blackwell else "Triton"
    if unset and arch is not None:
        _log_choice(arch, quant, semantics, kernel)
    return semantics


def _common_reason(plan: KernelPlan, qkv: VarlenQKV) -> str | None:
    if plan.causal:
        return ("the plan is causal (e.g. Cosmos 3's text stream); TRTLLM_ATTN runs non-causal attention only: "
                "route causal attention to TORCH_SDPA or TORCH_REFERENCE")
    mismatch = head_dim_mismatch(qkv.q, qkv.k, qkv.v)
    if mismatch is not None:
        return f"{mismatch}; TRTLLM_ATTN's kernels take head_dim {HEAD_DIM} only"
    dtypes = {qkv.q.dtype, qkv.k.dtype, qkv.v.dtype}
    if len(dtypes) != 1 or qkv.q.dtype not in SUPPORTED_DTYPES:
        return (f"q/k/v dtypes are {qkv.q.dtype}/{qkv.k.dtype}/{qkv.v.dtype}; TRTLLM_ATTN takes "
                f"{', '.join(str(d) for d in SUPPORTED_DTYPES)} inputs (SAGE quantizes them itself)")
    if len({qkv.q.device, qkv.k.device, qkv.v.device}) != 1:
        return f"q/k/v are on different devices ({qkv.q.device}, {qkv.k.device}, {qkv.v.device})"
    if qkv.q.shape[1] % qkv.k.shape[1]:
        return (f"{qkv.q.shape[1]} query heads on {qkv.k.shape[1]} key/value heads; the kernels need the query "
                "heads to be a whole multiple of the key/value heads")
    if qkv.has_empty_sequence:
        return (f"a sequence is empty (query lengths {qkv.seqlens_q}, key lengths {qkv.seqlens_kv}); the kernels "
                "run without an empty-row check")
    return None


def _sage_block_reason(quant: AttnQuantSpec, arch: str, more_queries_than_keys: bool) -> str | None:
    """Why ``quant``'s explicit dtype or block sizes have no kernel on ``arch``, naming what it offers."""
    dtypes = SAGE_QK_DTYPES_BY_ARCH[arch]
    if quant.dtype_qk not in dtypes:
        return (f"SAGE with {quant.dtype_qk} Q/K has no kernel on {arch}; it has {list(dtypes)} "
                f"(valid dtypes in general: {list(QK_DTYPES)})")
    offered = sage_block_sizes(arch, quant.dtype_qk, more_queries_than_keys)
    if quant.q_block_size is not None and quant.q_block_size not in offered["q"]:
        return _blocks_text(quant, arch, offered, more_queries_than_keys)
    if quant.k_block_size is not None and quant.k_block_size not in offered["k"]:
        return _blocks_text(quant, arch, offered, more_queries_than_keys)
    if arch in FMHA_V2_ARCHS and None not in (quant.q_block_size, quant.k_block_size):
        fmha_q = quant.q_block_size == fmha_v2_sage.Q_BLOCK
        fmha_k = quant.k_block_size in FMHA_V2_USER_K_BLOCKS
        if fmha_q != fmha_k:
            return (f"SAGE blocks q={quant.q_block_size}, k={quant.k_block_size} mix two {arch} kernels: FMHAv2 takes "
                    f"q {fmha_v2_sage.Q_BLOCK} with k {list(FMHA_V2_USER_K_BLOCKS)}, the Triton kernel q and k in "
                    f"{list(TRITON_SAGE_BLOCKS)}")
    return None


def _blocks_text(quant: AttnQuantSpec, arch: str, offered: dict, more_queries_than_keys: bool) -> str:
    note = "" if not more_queries_than_keys or arch not in FMHA_V2_ARCHS else (
        f" (FMHAv2's q block {fmha_v2_sage.Q_BLOCK} serves sequences with at most as many queries as keys: this "
        "call has a sequence with more queries than keys)")
    return (f"SAGE blocks q={quant.q_block_size}, k={quant.k_block_size} have no {quant.dtype_qk} kernel on {arch}; "
            f"compiled: q block {list(offered['q'])}, k block {list(offered['k'])}{note}; leave the block sizes "
            "unset for the fastest")


#: What runs Skip-Softmax reuse, for the reason a plan that cannot gives
REUSE_KERNELS = ("Skip-Softmax reuse (skip_softmax.reuse_steps) runs on Hopper's SAGE kernels, FMHAv2 (fp8_e4m3, "
                 "Q block 64, the default K block, no log-sum-exp) and Triton (int8, or Q/K blocks 1, 4, 16), and on "
                 "TORCH_REFERENCE; set skip_softmax.reuse_steps 0 to run")


def reuse_unavailable_reason(plan: KernelPlan, qkv: VarlenQKV) -> str | None:
    """Why the kernel TRTLLM_ATTN runs for ``plan`` on ``qkv`` cannot reuse Skip-Softmax tile maps (naming what
    can), or None (also when not asked): Hopper's Triton SAGE route reuses them, and the FMHAv2 SAGE route at its
    default K block without the log-sum-exp; the bf16 kernels and Blackwell's have no reuse."""
    if not plan.reuse:
        return None
    quant = plan.quant
    if gpu_arch(qkv.q.device) not in FMHA_V2_ARCHS or quant is None:
        what = "a bf16 plan" if quant is None else "this GPU's SAGE kernel"
        return f"{REUSE_KERNELS} ({what} has no reuse)"
    if _hopper_sage_kernel(quant, qkv.more_queries_than_keys) == "triton":
        return None
    if quant.k_block_size not in (None, fmha_v2_sage.REUSE_K_BLOCK) or plan.return_lse:
        what = f"K block {quant.k_block_size}" if quant.k_block_size else "the log-sum-exp"
        return f"{REUSE_KERNELS} (this plan asks for {what})"
    return None


def _hopper_reason(plan: KernelPlan, qkv: VarlenQKV) -> str | None:
    quant = plan.quant
    if quant is None:
        return flashinfer_unavailable_reason(FMHA_V2)
    more_queries = qkv.more_queries_than_keys
    reason = _sage_block_reason(quant, "sm_90", more_queries)
    if reason is not None:
        return reason
    if _hopper_sage_kernel(quant, more_queries) == "fmha_v2":
        return flashinfer_unavailable_reason(FMHA_V2)  # the generator and JIT come from the same FlashInfer
    return triton_sage.triton_sage_unavailable_reason(qkv.q, qkv.k, qkv.v, causal=plan.causal,
                                                      skip_tile=TRITON_SKIP_TILE_SM90 if plan.skips else None)


def _blackwell_reason(plan: KernelPlan, qkv: VarlenQKV, arch: str) -> str | None:
    if plan.quant is not None:
        reason = _sage_block_reason(plan.quant, arch, False)
        if reason is not None:
            return reason
        return flashinfer_unavailable_reason(SAGE_QUANTIZE) or flashinfer_unavailable_reason(TRTLLM_GEN)
    return flashinfer_unavailable_reason(TRTLLM_GEN)


def device_unavailable_reason(device: torch.device | str) -> str | None:
    """``None`` when ``device`` is a GPU with TRT-LLM attention kernels, else a sentence saying why not. Checked
    first by :func:`unavailable_reason`, and usable before any work (a command line checking its device)."""
    arch = gpu_arch(device)
    if arch in FMHA_V2_ARCHS + TRTLLM_GEN_ARCHS:
        return None
    if arch is None:
        return (f"TRTLLM_ATTN needs an NVIDIA sm_90 (H100/H200), sm_100 or sm_103 (B200/B300) GPU and none was "
                f"found (device {torch.device(device)})")
    hint = " (workstation Blackwell)" if arch.startswith("sm_12") else ""
    return (f"no TRT-LLM attention kernel for {arch}{hint}; TRTLLM_ATTN runs on sm_90 (H100/H200) and sm_100/"
            "sm_103 (B200/B300)")


def unavailable_reason(plan: KernelPlan, qkv: VarlenQKV) -> str | None:
    """``None`` when TRTLLM_ATTN can run ``plan`` on ``qkv`` on their device, else a sentence saying why not
    (the device first: on a machine without a supported GPU, that is the reason whatever the call)."""
    reason = (device_unavailable_reason(qkv.q.device) or _common_reason(plan, qkv)
              or reuse_unavailable_reason(plan, qkv))
    if reason is not None:
        return reason
    arch = gpu_arch(qkv.q.device)
    if arch in FMHA_V2_ARCHS:
        return _hopper_reason(plan, qkv)
    return _blackwell_reason(plan, qkv, arch)


def _run_hopper_sage(qkv: VarlenQKV, plan: KernelPlan) -> KernelResult:
    semantics = sage_semantics(plan.quant, qkv.q.device, qkv.seqlens_q, qkv.seqlens_kv, qkv.q.shape[1], plan.tile,
                               plan.reuse, plan.fresh_map)
    if semantics.q_block == fmha_v2_sage.Q_BLOCK:
        # with reuse the kernel always counts: the result reports the tiles skipped by the test and by reuse
        tile_map = tile_map_for(plan, qkv, fmha_v2_sage.SKIP_TILE)
        counting = (plan.count_skips and plan.skips) or tile_map is not None
        skipped = (torch.zeros(1 if tile_map is None else 2, dtype=torch.int32, device=qkv.q.device)
                   if counting else None)
        result = fmha_v2_sage.fmha_v2_sage_attention(
            qkv.q, qkv.k, qkv.v, qkv.cu_seqlens("kv"), tuple(qkv.seqlens_kv), plan.scale,
            cu_seqlens_q=qkv.cu_seqlens("q"), seqlens_q=tuple(qkv.seqlens_q), k_block=semantics.k_block,
            kv_step=semantics.kv_step, skip_factor=plan.skip_factor, skip_counts=skipped, return_lse=plan.return_lse,
            tile_map=tile_map, fresh_map=tile_map is not None and plan.fresh_map)
        out, lse = result if plan.return_lse else (result, None)
        if not counting:
            return KernelResult(out, lse=lse)
        total = fmha_v2_sage.skip_tiles(tuple(qkv.seqlens_kv), qkv.q.shape[1])
        if tile_map is None:
            return KernelResult(out, skipped[0], total, lse)
        return KernelResult(out, skipped[0], total, lse, tile_map, skipped[1])
    device = qkv.q.device
    lse = torch.empty(qkv.q.shape[:2], dtype=torch.float32, device=device) if plan.return_lse else None
    tile_map = tile_map_for(plan, qkv, semantics.skip_tile or plan.tile)
    reused = torch.zeros((), dtype=torch.int32, device=device) if tile_map is not None and plan.count_skips else None
    out, skipped, total = triton_sage.triton_sage_attention(
        qkv.q, qkv.k, qkv.v, qkv.cu_seqlens("q"), qkv.cu_seqlens("kv"), tuple(qkv.seqlens_q),
        tuple(qkv.seqlens_kv), plan.scale, dtype_qk=semantics.dtype_qk, q_block=semantics.q_block,
        k_block=semantics.k_block, skip_factor=plan.skip_factor, skip_tile=semantics.skip_tile,
        count_skips=plan.count_skips, skip_sample=semantics.skip_sample, tile_map=tile_map, reused=reused,
        lse=lse)
    return KernelResult(out, skipped, total, lse, tile_map, reused)


def run(qkv: VarlenQKV, plan: KernelPlan) -> KernelResult:
    """Attention over the packed batch in one kernel call (plus the SAGE quantizer when ``plan.quant`` is set).

    ``qkv``: :class:`~.base.VarlenQKV` with q ``[total_q, Hq, 128]``, k/v ``[total_kv, Hkv, 128]`` bf16 on a
    CUDA device that :func:`unavailable_reason` accepted. Returns ``out [total_q, Hq, 128]`` bf16; skip counts
    when ``plan.count_skips`` from the SAGE kernels (Triton, FMHAv2), not from the bf16 ones; with
    ``plan.return_lse`` the log-sum-exp ``[total_q, Hq]`` float32; with ``plan.reuse`` the tile map it ran with
    (a plan no kernel reuses for raises :class:`BackendUnavailableError`). On Hopper a dense call runs the kernel its
    route names (``plan.backend``, :func:`dense_route`); the cuDNN route's runs FMHAv2 when asked for the log-sum-exp.
    """
    reason = reuse_unavailable_reason(plan, qkv)
    if reason is not None:
        raise BackendUnavailableError(reason)
    arch = gpu_arch(qkv.q.device)
    lengths = (tuple(qkv.seqlens_q), tuple(qkv.seqlens_kv))
    if arch in FMHA_V2_ARCHS:
        if plan.quant is not None:
            return _run_hopper_sage(qkv, plan)
        dense = "" if plan.skips else dense_kernel_of(plan.backend)
        if dense == FLASH_ATTN4:
            return _with_lse(plan, flash_attn4.flash_attn4_attention(
                qkv.q, qkv.k, qkv.v, qkv.cu_seqlens("q"), qkv.cu_seqlens("kv"), qkv.max_seqlen_q,
                qkv.max_seqlen_kv, plan.scale, return_lse=plan.return_lse))
        if dense == CUDNN and not plan.return_lse:
            with sdpa_kernel(CUDNN_FIRST, set_priority=True):
                return SDPA_BACKEND.run(qkv, plan)
        return _with_lse(plan, fmha_v2_attention(qkv.q, qkv.k, qkv.v, *lengths, plan.scale, plan.skip_factor,
                                                 return_lse=plan.return_lse))
    if arch in TRTLLM_GEN_ARCHS:
        sage = None
        if plan.quant is not None:
            semantics = sage_semantics(plan.quant, qkv.q.device, *lengths)
            sage = (semantics.dtype_qk, semantics.q_block, semantics.k_block)
        return _with_lse(plan, trtllm_gen_attention(qkv.q, qkv.k, qkv.v, *lengths, plan.scale, plan.skip_factor,
                                                    sage=sage, return_lse=plan.return_lse))
    raise BackendUnavailableError(f"TRTLLM_ATTN has no kernel for {arch or qkv.q.device}")


def _with_lse(plan: KernelPlan, result) -> KernelResult:
    """A kernel function's result (``out``, or ``(out, lse)`` where ``plan.return_lse``) as a KernelResult."""
    return KernelResult(result[0], lse=result[1]) if plan.return_lse else KernelResult(result)


def warmup(device: torch.device | str | None = None, dtypes=(torch.bfloat16,), sage: bool = True,
           dense_kernel: str = AUTO, lse: bool = False) -> dict[str, float]:
    """Build or fetch everything TRTLLM_ATTN needs on ``device`` (default: the current CUDA device), now.

    Hopper: JIT-compiles FlashInfer's FMHAv2 module for each dtype (dense and Skip-Softmax kernels are one
    module), the dense kernel ``dense_kernel`` chooses (:func:`dense_route`; FlashAttention-4 compiles per shape
    class, so its warm-up covers the small shape only) and, with ``sage``, the FMHAv2 SAGE kernels and the Triton
    SAGE kernel (minutes the first time on a machine, a load afterwards). Blackwell: loads the trtllm-gen module
    and its cubins (downloaded on first use; see :class:`CubinUnavailableError`) with one small dense call, and
    with ``sage`` one SAGE call per Q/K dtype the GPU has kernels for. ``lse``: each of those calls again returning
    the log-sum-exp (ring attention; on Hopper FlashInfer builds FMHAv2 with statistics as a module of its own).
    Returns seconds per step.
    """
    device = torch.device(device if device is not None else "cuda")
    arch = gpu_arch(device)
    timings: dict[str, float] = {}
    for dtype in dtypes:
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"warmup dtype {dtype} is not supported by TRTLLM_ATTN; supported: "
                             f"{list(SUPPORTED_DTYPES)}")
        plans = [KernelPlan(backend=TRTLLM_ATTN, scale=HEAD_DIM ** -0.5)]
        route = dense_route(device, dense_kernel)
        if route != TRTLLM_ATTN:
            plans.append(KernelPlan(backend=route, scale=HEAD_DIM ** -0.5))
        if sage:
            plans += [KernelPlan(backend=TRTLLM_ATTN, scale=HEAD_DIM ** -0.5, quant=quant)
                      for quant in sage_specs_with_kernels(arch)]
        if lse:
            plans += [dataclasses.replace(plan, return_lse=True) for plan in plans]
        qkv = VarlenQKV(*(torch.zeros(256, 1, HEAD_DIM, dtype=dtype, device=device) for _ in range(3)),
                        (256,), (256,))
        for plan in plans:
            reason = unavailable_reason(plan, qkv)
            if reason is not None:
                raise RuntimeError(f"TRTLLM_ATTN cannot warm up on {device}: {reason}")
            step = f"{arch} {dtype}" + (f" sage {plan.quant.dtype_qk}" if plan.quant else "") + (
                f" dense {dense_kernel_of(plan.backend)}" if dense_kernel_of(plan.backend) else "") + (
                " lse" if plan.return_lse else "")
            logger.info("TRTLLM_ATTN warm-up: %s", step)
            start = time.perf_counter()
            run(qkv, plan)
            torch.cuda.synchronize(device)
            timings[step] = time.perf_counter() - start
    return timings


# --------------------------------------------------------------------------------------- Hopper's dense kernel

#: What each Hopper dense kernel is, in the words of the install log.
DENSE_KERNEL_TITLES = {FMHA_V2_DENSE: "FMHAv2 (FlashInfer)", FLASH_ATTN4: "FlashAttention-4",
                       CUDNN: "cuDNN through torch SDPA (FlashAttention-2 for grouped-query heads)"}
# torch SDPA's kernels for the cuDNN route, in order: where cuDNN refuses a call (it takes no grouped-query heads:
# Cosmos 3), torch takes the next, as diffusers' default attention does, so such a site runs what the default runs.
CUDNN_FIRST = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def cudnn_unavailable_reason() -> str | None:
    """Why torch's cuDNN attention cannot run here, or ``None``."""
    if not torch.backends.cudnn.is_available():
        return f"torch {torch.__version__} has no cuDNN"
    return None


def dense_kernel_unavailable_reason(kernel: str) -> str | None:
    """Why Hopper dense kernel ``kernel`` (one of :data:`DENSE_KERNEL_TITLES`) cannot run here, or ``None``."""
    if kernel == FLASH_ATTN4:
        return flash_attn4.unavailable_reason()
    if kernel == CUDNN:
        return cudnn_unavailable_reason()
    return flashinfer_unavailable_reason(FMHA_V2)


def dense_route(device: torch.device | str, dense_kernel: str = AUTO) -> str:
    """The route of a ``TRTLLM_ATTN`` call site on ``device`` (at install): on sm_90 ``TRTLLM_ATTN+<kernel>`` with
    the dense kernel ``dense_kernel`` names (``auto``: FlashAttention-4 where it runs, else cuDNN, else FMHAv2,
    logged once), elsewhere ``TRTLLM_ATTN``. An explicit kernel that cannot run raises
    :class:`BackendUnavailableError` with the reason."""
    if dense_kernel not in DENSE_KERNELS:
        raise invalid("dense_kernel", dense_kernel, f"one of {list(DENSE_KERNELS)}")
    arch = gpu_arch(device)
    if arch not in FMHA_V2_ARCHS:
        if dense_kernel != AUTO:
            raise BackendUnavailableError(
                f"dense_kernel={dense_kernel!r} chooses among Hopper's (sm_90) dense kernels, and "
                f"{torch.device(device)} is {arch or 'not a CUDA GPU'}; TRTLLM_ATTN runs dense attention there on "
                "its own kernel: leave dense_kernel 'auto'")
        return TRTLLM_ATTN
    if dense_kernel == AUTO:
        passed_over = {}
        for kernel in (FLASH_ATTN4, CUDNN, FMHA_V2_DENSE):
            reason = dense_kernel_unavailable_reason(kernel)
            if reason is None:
                break
            passed_over[kernel] = reason
        _log_dense_choice(arch, kernel, tuple(passed_over.items()))
    else:
        kernel = dense_kernel
        reason = dense_kernel_unavailable_reason(kernel)
        if reason is not None:
            raise BackendUnavailableError(f"dense_kernel={kernel!r} ({DENSE_KERNEL_TITLES[kernel]}) cannot run on "
                                          f"{arch}: {reason}; valid here: {_runnable_dense_kernels()}")
    return f"{TRTLLM_ATTN}{ROUTE_KERNEL_SEPARATOR}{kernel}"


def _runnable_dense_kernels() -> list[str]:
    return [AUTO] + [k for k in DENSE_KERNEL_TITLES if dense_kernel_unavailable_reason(k) is None]


@functools.lru_cache(maxsize=None)
def _log_dense_choice(arch: str, kernel: str, passed_over: tuple[tuple[str, str], ...]) -> None:
    version = f" {flash_attn4.installed_version()}" if kernel == FLASH_ATTN4 else ""
    why = "".join(f"; not {DENSE_KERNEL_TITLES[k]}: {reason}" for k, reason in passed_over)
    logger.warning("TRTLLM_ATTN dense steps on %s run %s%s (Skip-Softmax steps: FMHAv2, SAGE steps: the SAGE "
                   "kernel)%s; the spec's dense_kernel pins one of %s", arch, DENSE_KERNEL_TITLES[kernel], version,
                   why, list(DENSE_KERNEL_TITLES))


# Every route gives the log-sum-exp.
TRTLLM_BACKEND = register_backend(TRTLLM_ATTN, run, unavailable_reason, priority=10, returns_lse=True)

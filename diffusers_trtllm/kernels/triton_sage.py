"""SAGE attention with Skip-Softmax for Hopper (sm_90): fused Triton kernels.

The project's own SAGE kernel: TRT-LLM FMHAv2's SAGE kernel (:mod:`.fmha_v2_sage`) is faster for fp8 self-attention
with Q blocks of 64 tokens; this one serves int8, Q/K blocks of 1, 4 or 16 tokens and unequal query and key lengths,
and counts skipped tiles. Its quantizer (:func:`quantize_into`) also feeds the FMHAv2 kernel. It implements exactly
the semantics of :mod:`diffusers_trtllm.quant` and
:func:`diffusers_trtllm.backends.reference.reference_attention`, so that Skip-Softmax calibrations made with the
reference transfer:

- Q and K quantized per block of 1, 4 or 16 tokens (blocks aligned to each sequence's start) to int8 or
  fp8 e4m3, K smoothed by its per-sequence mean; V per channel to fp8 e4m3;
- Q·Kᵀ on the tensor cores in int8 (int32 accumulation, exact) or fp8 (sm_90's fp8 accumulator is not fp32:
  the output then differs from the fp32 reference by 7e-3 to 1e-2 instead of int8's 2.5e-3 bf16 floor;
  ``AttentionLaunch.fp8_qk_chunk`` adds in fp32 more often, for a little accuracy and 5-14% speed), P quantized
  to fp8 as ``P·448`` and P·V in fp8 with fp32 accumulation across KV tiles; row sums from unquantized P;
- Skip-Softmax: a KV tile is skipped for a query tile when every row has ``exp(tile_max - running_max) < λ``
  with ``λ_i = skip_factor / kv_len_i``; a skipped tile leaves the running max, row sum and accumulator alone.

Two launches quantize, one attends:

1. ``_kv_stats_kernel`` — a reduction over K and V: per (sequence, kv head, channel) the sum of K (for the
   smoothing mean) and the max of |V| (for V's per-channel scale), accumulated with atomics.
2. ``_sage_quantize_kernel`` — one pass over Q, K and V writing int8/fp8 values and their scales.
3. ``_sage_attention_kernel`` — the attention itself, Skip-Softmax in the same kernel, optional skip counting.

Tiles: dense attention runs 64 × 128 (query rows × keys, one warpgroup per program; the fastest measured).
With skipping, the kernel tile *is* the skip-decision tile (``skip_tile``), so skip decisions and counts match the
reference at that tile, tile for tile. ``TRTLLM_ATTN`` passes 64 × 128 on Hopper, the dense launch's tile: at
128 × 128 (two warpgroups) the same sparsity took 17-19 % longer on an H200 (benchmarks/RESULTS.md).
Skipping runs one of two schedules per run of KV tiles, with bit-identical results: *branching* (a skipped tile's
exps, V load and P·V are not run, but Triton cannot software-pipeline loads inside the branch, so with little to
skip it is the slower one) and *branch-free* (every tile's work issued, a skipped tile's P zeroed, the tile vote
one ``bar.red`` on sm_90: a fixed cost over dense whatever the sparsity). A run after one that skipped few of its
tiles is branch-free, else branching (:func:`skip_launch`, benchmarks/RESULTS.md). Even branch-free, the tile
vote has a fixed cost over dense, which a head that skips few of its tiles does not earn back; so by default each
head skips only where it pays: a sample of its query tiles (:func:`skip_sample_rule`: about two waves of the
GPU's programs) attends first, skipping, in a launch of its own, and the head's other query tiles skip only if
the sample skipped at least :data:`SKIP_PAYS_FROM` of its KV tiles, else they run the dense launch's
code (a launch of the dense kernel whose programs of paying heads return at once). The reference follows the rule
(``SageSemantics.skip_sample``).
Measured on an H200 (benchmarks/RESULTS.md): 628-632 TFLOP/s for the attention launch at Wan 2.2's shape, 1.10×
cuDNN SDPA dense including the 1.9 ms of quantization.

Runs where Triton has fp8 tensor-core dots: sm_89 and newer (only sm_90, an H200, was measured). Under
``TRITON_INTERPRET=1`` the same kernels run on the CPU (slowly; for tests).
"""

from __future__ import annotations  # keeps Triton's "tl.constexpr" annotations unevaluated when Triton is absent

import math
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .numerics import FP8_MAX, HEAD_DIM, P_SCALE, QK_TORCH_DTYPES, TINY_SCALE, head_dim_mismatch, qmax

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch wheels ship without Triton; the module still answers why it cannot run
    triton = tl = None

V_TOKEN_ALIGN = 16  # each sequence's V^T columns start on a 16-byte boundary, so V loads vectorize
QUANTIZE_TOKENS = 64  # tokens per program of the quantization pass (raised to the Q/K block when larger)
# The K/V reduction: tokens per chunk, and chunks one program folds before its atomics (128 × 4 took 0.77 ms at
# Wan's shape on an H200, 64 × 8 1.06 ms; the quantization pass is fastest at 64 tokens)
STATS_TOKENS = 128
STATS_CHUNKS = 4
ROUND_MAGIC = 12582912.0  # 1.5 * 2**23: (x + M) - M rounds |x| < 2**22 to the nearest integer, ties to even
LOG2E = 1.4426950408889634

_jit = triton.jit if triton is not None else (lambda fn: fn)
_jit_not_specializing = ((lambda *names: triton.jit(do_not_specialize=names)) if triton is not None
                         else (lambda *names: lambda fn: fn))
_constexpr = tl.constexpr if tl is not None else (lambda value: value)
# Kernels may read only constexpr globals.
_V_TOKEN_ALIGN = _constexpr(V_TOKEN_ALIGN)
_TINY_SCALE = _constexpr(TINY_SCALE)
_FP8_MAX = _constexpr(FP8_MAX)
_P_SCALE = _constexpr(P_SCALE)
_ROUND_MAGIC = _constexpr(ROUND_MAGIC)
_LOG2_P_SCALE = _constexpr(math.log2(P_SCALE))


@dataclass(frozen=True)
class AttentionLaunch:
    """Tile shape and schedule of the attention kernel.

    With skipping on, ``block_m × block_n`` is the skip-decision tile and must equal ``plan.tile``; dense runs
    may use any shape (see :data:`DENSE_LAUNCH`).
    """

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3
    # Q·Kᵀ channels (of 128) that sm_90's reduced-precision fp8 accumulator sums before an fp32 add; 128 is the
    # fastest (the default), 32 the closest to fp32 accumulation but it spills registers. int8 accumulates exactly
    # in int32 regardless.
    fp8_qk_chunk: int = 128
    # Skipping visits KV tiles in runs, each on one of two schedules with identical results: branch-free (every
    # tile's exps and P·V issued, a skipped tile's P zeroed; Triton keeps its loads pipelined) after a run that
    # skipped fewer than ``branch_free_below`` of its tiles, else branching (a skipped tile's exps, V load and P·V
    # not run). 0 keeps every run branching, above 1 every run branch-free. Runs start at ``skip_chunk`` tiles and
    # double while the schedule stays.
    skip_chunk: int = 8
    branch_free_below: float = 0.0
    # Skipping only where it pays: every ``skip_sample_every``-th query tile of each (sequence, head) attends first,
    # in a launch of its own, with skipping; the head's other query tiles skip only if those skipped at least
    # ``skip_pays_from`` of their KV tiles, and otherwise attend on the dense kernel (no vote: dense speed, dense
    # results). 0 skips everywhere.
    skip_sample_every: int = 0
    skip_pays_from: float = 0.0


# AttentionLaunch.branch_free_below of skipping (:func:`skip_launch`): a run that skipped little is followed by a
# branch-free one. Of the thresholds measured on an H200 this one had the best worst case over sparsities, for fp8
# and int8 (benchmarks/RESULTS.md, benchmarks/triton_skip_schedules.py)
BRANCH_FREE_BELOW = 0.1
# AttentionLaunch.skip_pays_from of skipping, fp8 and int8 alike: a head whose sample skipped less of its tiles
# did not earn back the vote and the launch split in two on an H200 (timed in alternating pairs,
# benchmarks/RESULTS.md).
SKIP_PAYS_FROM = 0.30
# The sample launch holds about this many waves of programs (each program a whole query tile against all keys):
# a launch of whole waves costs its share of the work, a last partial wave leaves SMs idle for up to a program's
# time (benchmarks/RESULTS.md, timed in pairs with nothing to skip at Wan's shape: one query tile in 32, 5.6 waves,
# cost 0.6-0.8 %; one in 91, 1.97 waves, 0.1-0.2 %).
SKIP_SAMPLE_WAVES = 2
# Programs of the 64 × 128 tile an SM holds at once (their shared memory), and the SMs of an H200: without a GPU,
# the reference of the kernel's rule samples as on an H200.
PROGRAMS_PER_SM = 2
H200_SMS = 132

# The fastest dense shape measured on the H200 (benchmarks/sage.py): 64 × 128 with one warpgroup runs ~13% faster
# than 128 × 128 with two (587 vs 521 TFLOP/s at 16k tokens × 40 heads), which needs all 255 registers per thread.
DENSE_LAUNCH = AttentionLaunch(64, 128, num_warps=4, num_stages=3)


def skip_sample_rule(seqlens_q: tuple[int, ...], heads: int, tile_rows: int,
                     device: torch.device | str) -> tuple[int, float]:
    """``(every, pays_from)`` of the sampled skipping rule for a batch: every ``every``-th query tile of
    ``tile_rows`` rows of each (sequence, head) is the sample, as many per (sequence, head) as fill
    :data:`SKIP_SAMPLE_WAVES` waves of ``device``'s programs (one in two at most); ``pays_from`` is
    :data:`SKIP_PAYS_FROM`."""
    device = torch.device(device)
    on_gpu = device.type == "cuda" and torch.cuda.is_available()
    sms = torch.cuda.get_device_properties(device).multi_processor_count if on_gpu else H200_SMS
    per_head = max(1, SKIP_SAMPLE_WAVES * PROGRAMS_PER_SM * sms // (len(seqlens_q) * heads))
    query_tiles = -(-max(seqlens_q) // tile_rows)
    return max(2, -(-query_tiles // per_head)), SKIP_PAYS_FROM


def skip_launch(tile: tuple[int, int], sample: tuple[int, float]) -> AttentionLaunch:
    """The launch for a skipping plan: the kernel tile is the skip tile, with one warp per 16 query rows (a
    warpgroup per 64), alternating schedules by :data:`BRANCH_FREE_BELOW`, skipping in the heads where it pays
    by ``sample`` (:func:`skip_sample_rule`)."""
    every, pays_from = sample
    return AttentionLaunch(tile[0], tile[1], num_warps=max(1, tile[0] // 16), branch_free_below=BRANCH_FREE_BELOW,
                           skip_sample_every=every, skip_pays_from=pays_from)


class SageQuantized(NamedTuple):
    """Q, K, V of one packed batch quantized for SAGE (output of :func:`sage_quantize`).

    For ``B`` sequences, ``Tq``/``Tk`` packed query/key tokens, ``Hq``/``Hkv`` heads, ``D = 128``:

    - ``q``: ``[Tq, Hq, D]`` int8 or ``torch.float8_e4m3fn``; ``k``: ``[Tk, Hkv, D]``, same dtype, K smoothed.
    - ``q_scale``: ``[Hq, ceil(Tq / q_block) + B - 1]`` float32; sequence ``i``'s blocks start at column
      ``cu_seqlens_q[i] // q_block + i`` (blocks never straddle sequences; the ``+ i`` makes room for each
      sequence's partial last block). ``k_scale`` likewise with ``k_block`` and ``cu_seqlens_kv``.
    - ``v_t``: ``[Hkv, D, 16 * (ceil(Tk / 16) + B)]`` ``torch.float8_e4m3fn``, V transposed (tokens
      contiguous, the K-major operand layout Hopper's fp8 tensor cores need for P·V); sequence ``i``'s tokens
      start at column ``16 * (ceil(cu_seqlens_kv[i] / 16) + i)``; its columns past the last token, up to a
      multiple of 16, hold zeros.
    - ``v_scale``: ``[B, Hkv, D]`` float32, one scale per sequence, head and channel.

    ``value ≈ quantized value × scale`` for every tensor, as :func:`diffusers_trtllm.quant.quantize_sequence`.
    """

    q: torch.Tensor
    q_scale: torch.Tensor
    k: torch.Tensor
    k_scale: torch.Tensor
    v_t: torch.Tensor
    v_scale: torch.Tensor
    q_block: int
    k_block: int


class QuantizeTargets(NamedTuple):
    """Where :func:`quantize_into` writes, for attention kernels with other layouts than :class:`SageQuantized`.

    ``q`` ``[Tq, Hq, D]`` / ``k`` ``[Tk, Hkv, D]`` (any row and head strides, channels contiguous) receive the
    values. ``q_scale`` / ``k_scale``: ``[B, H, blocks]`` float32 when ``scales_by_sequence`` (sequence ``i``'s
    block ``j`` at ``[i, h, j]``), else :class:`SageQuantized`'s packed ``[H, columns]``; ``k_scale`` is unused
    with ``k_block`` 0. ``v``: ``[Tk, Hkv, D]`` fp8 (token and head strides) unless ``v_transposed``
    (:class:`SageQuantized`'s ``v_t``). ``v_scale``: ``[B, Hkv, D]`` float32. ``v_fmha_v2_order`` (with
    ``v_transposed``): keys and channels in the order FMHAv2's fp8 V transpose leaves them in shared memory
    (its ``Transposer``: LDSM.T, byte permutes, STSM): within each 16-key group of a sequence, column ``4·a + b``
    holds key ``2·a + b % 2 + 8·(b // 2)`` (the order in which FMHAv2 packs P's accumulator into its fp8 P·V
    operand); within each 16-channel group, rows 0-7 hold the even channels and rows 8-15 the odd ones.
    """

    q: torch.Tensor
    q_scale: torch.Tensor
    k: torch.Tensor
    k_scale: torch.Tensor
    v: torch.Tensor
    v_scale: torch.Tensor
    scales_by_sequence: bool
    v_transposed: bool
    v_fmha_v2_order: bool = False


def scale_columns(tokens: int, batch: int, block: int) -> int:
    """Columns of a block-scale tensor for ``tokens`` packed tokens in ``batch`` sequences."""
    return -(-tokens // block) + batch - 1


def v_columns(tokens: int, batch: int) -> int:
    """Columns of ``SageQuantized.v_t`` for ``tokens`` packed key tokens in ``batch`` sequences."""
    return V_TOKEN_ALIGN * (-(-tokens // V_TOKEN_ALIGN) + batch)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_sage_unavailable_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                                   skip_tile: tuple[int, int] | None = None) -> str | None:
    """``None`` when :func:`triton_sage_attention` can run on these tensors here, else a sentence saying why.

    Needs: Triton importable; a CUDA device of compute capability 8.9 or newer (fp8 tensor cores; only sm_90 was
    measured), or ``TRITON_INTERPRET=1`` for CPU tensors; non-causal; head_dim 128; bf16/fp16 q, k, v; a skip
    tile (when skipping) with sides that are powers of two from 16 to 128.
    """
    if triton is None:
        return "the Triton SAGE kernel needs Triton, which is not installed (it ships with CUDA builds of PyTorch)"
    if causal:
        return "the Triton SAGE kernel implements non-causal attention only"
    mismatch = head_dim_mismatch(q, k, v)
    if mismatch is not None:
        return f"the Triton SAGE kernel needs head_dim {HEAD_DIM}; {mismatch}"
    dtypes = {q.dtype, k.dtype, v.dtype}
    if len(dtypes) != 1 or q.dtype not in (torch.bfloat16, torch.float16):
        return f"the Triton SAGE kernel takes bf16 or fp16 q, k, v of one dtype; got {sorted(map(str, dtypes))}"
    if skip_tile is not None and not all(side in (16, 32, 64, 128) for side in skip_tile):
        return f"the Triton SAGE kernel decides skips on tiles with sides 16, 32, 64 or 128; the skip tile is {skip_tile}"
    if q.device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(q.device)
        if (major, minor) < (8, 9):
            return (f"the Triton SAGE kernel needs fp8 tensor cores (sm_89 or newer); this GPU is "
                    f"sm_{major}{minor}")
    elif not _interpreting():
        return f"the Triton SAGE kernel runs on CUDA GPUs (or on the CPU under TRITON_INTERPRET=1); q is on {q.device}"
    return None


def quantize_into(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  cu_seqlens_kv: torch.Tensor, max_seqlen_q: int, max_seqlen_kv: int, targets: QuantizeTargets, *,
                  dtype_qk: str, q_block: int, k_block: int) -> None:
    """Quantize a packed batch for SAGE into ``targets`` in two Triton launches (a K-sum/V-amax reduction, then one
    pass over Q, K and V). Semantics: :mod:`diffusers_trtllm.quant` per sequence, Q/K blocks of ``q_block`` /
    ``k_block`` tokens from each sequence's start (``k_block`` 0: one K scale per sequence and head, multiplied
    into Q's scales).

    ``q``: ``[Tq, Hq, 128]``, ``k``/``v``: ``[Tk, Hkv, 128]``, any float dtype, channels contiguous;
    ``cu_seqlens_*``: ``[B + 1]`` int32 on their device. GPUs: sm_89 and newer (or the Triton interpreter).
    """
    batch, heads_q, heads_kv = cu_seqlens_q.shape[0] - 1, q.shape[1], k.shape[1]
    device = q.device
    tokens = max(QUANTIZE_TOKENS, q_block, k_block)
    stats = [torch.zeros(batch, heads_kv, HEAD_DIM, dtype=torch.float32, device=device) for _ in range(2)]
    k_range = [torch.full((batch, heads_kv, HEAD_DIM), fill, dtype=torch.float32, device=device)
               for fill in (-math.inf, math.inf)] if k_block == 0 else [stats[0], stats[0]]
    k_sum, v_amax = stats
    _kv_stats_kernel[(-(-max_seqlen_kv // (STATS_TOKENS * STATS_CHUNKS)), heads_kv, batch)](
        k, v, k_sum, *k_range, v_amax, cu_seqlens_kv, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        TOKENS=STATS_TOKENS, CHUNKS=STATS_CHUNKS, HEAD_DIM=HEAD_DIM, K_RANGE=k_block == 0)
    q_chunks, kv_chunks = -(-max_seqlen_q // tokens), -(-max_seqlen_kv // tokens)
    seq_stride = (lambda t: t.stride(0)) if targets.scales_by_sequence else (lambda t: 0)
    head_stride = (lambda t: t.stride(1)) if targets.scales_by_sequence else (lambda t: t.stride(0))
    k_scale = targets.q_scale if k_block == 0 else targets.k_scale
    _sage_quantize_kernel[(q_chunks + kv_chunks, max(heads_q, heads_kv), batch)](
        q, k, v, k_sum, *k_range, v_amax, cu_seqlens_q, cu_seqlens_kv,
        targets.q, targets.q_scale, targets.k, k_scale, targets.v, targets.v_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        targets.q.stride(0), targets.q.stride(1), targets.k.stride(0), targets.k.stride(1),
        targets.v.stride(0), targets.v.stride(1), head_stride(targets.q_scale), seq_stride(targets.q_scale),
        head_stride(k_scale), seq_stride(k_scale), q_chunks, heads_q, heads_kv,
        QMAX=qmax(dtype_qk), QK_INT8=dtype_qk == "int8",
        Q_BLOCK=q_block, K_BLOCK=k_block, SCALES_BY_SEQUENCE=targets.scales_by_sequence,
        V_TRANSPOSED=targets.v_transposed, V_FMHA_V2_ORDER=targets.v_fmha_v2_order, TOKENS=tokens, HEAD_DIM=HEAD_DIM, num_warps=4 if tokens <= 64 else 8)


def sage_quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  cu_seqlens_kv: torch.Tensor, max_seqlen_q: int, max_seqlen_kv: int, *, dtype_qk: str,
                  q_block: int, k_block: int) -> SageQuantized:
    """Quantize a packed batch into the attention kernel's layouts (:class:`SageQuantized`) with
    :func:`quantize_into`. ``q_block`` / ``k_block``: 1, 4 or 16 tokens."""
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    batch, heads_q, heads_kv = cu_seqlens_q.shape[0] - 1, q.shape[1], k.shape[1]
    device = q.device
    value_dtype = QK_TORCH_DTYPES[dtype_qk]
    out = SageQuantized(
        q=torch.empty(q.shape, dtype=value_dtype, device=device),
        q_scale=torch.empty(heads_q, scale_columns(q.shape[0], batch, q_block), dtype=torch.float32, device=device),
        k=torch.empty(k.shape, dtype=value_dtype, device=device),
        k_scale=torch.empty(heads_kv, scale_columns(k.shape[0], batch, k_block), dtype=torch.float32, device=device),
        v_t=torch.empty(heads_kv, HEAD_DIM, v_columns(k.shape[0], batch), dtype=torch.float8_e4m3fn, device=device),
        v_scale=torch.empty(batch, heads_kv, HEAD_DIM, dtype=torch.float32, device=device),
        q_block=q_block, k_block=k_block)
    quantize_into(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                  QuantizeTargets(out.q, out.q_scale, out.k, out.k_scale, out.v_t, out.v_scale,
                                  scales_by_sequence=False, v_transposed=True),
                  dtype_qk=dtype_qk, q_block=q_block, k_block=k_block)
    return out


def _barrier_vote(launch: AttentionLaunch, device: torch.device) -> bool:
    """Whether the branch-free schedule may decide with :func:`_all_rows_by_barrier`: compiled for sm_90, where a
    warpgroup's 64-row tile gives each thread two rows (Hopper's wgmma layout)."""
    return (launch.block_m == 64 and launch.num_warps == 4 and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] == 9)


def sage_attention_quantized(quantized: SageQuantized, cu_seqlens_q: torch.Tensor, cu_seqlens_kv: torch.Tensor,
                             seqlens_q: tuple[int, ...], seqlens_kv: tuple[int, ...], scale: float, *,
                             out_dtype: torch.dtype = torch.bfloat16, skip_factor: float = 0.0,
                             skip_tile: tuple[int, int] = (128, 128), count_skips: bool = False,
                             skip_sample: tuple[int, float] | None = None, launch: AttentionLaunch | None = None):
    """Attention over already-quantized Q, K, V (from :func:`sage_quantize` of the same batch).

    ``seqlens_q`` / ``seqlens_kv``: per-sequence lengths (host ints; they size the launch and the tile count).
    Returns ``(out [Tq, Hq, 128] out_dtype, skipped, total)``: with ``count_skips`` and skipping, the skipped
    (head, query tile, KV tile) triples of ``skip_tile`` as a 0-dim int64 device tensor (no host sync) and their
    total as a host int; else ``None``.
    Skipping (``skip_factor > 0``, λ_i = skip_factor / kv_len_i) decides per kernel tile, which is
    ``skip_tile``; ``launch`` overrides the tile shape and schedule (with skipping its tile must equal
    ``skip_tile``). A skipping launch that samples (``AttentionLaunch.skip_sample_every``) is three kernel
    launches: the sampled query tiles, then (on the dense kernel) the others of the heads where skipping does not
    pay, then those of the heads where it pays. ``skip_sample``: the default launch's ``(every, pays_from)``
    (default :func:`skip_sample_rule` of this batch on this device).
    """
    skips = skip_factor > 0.0
    q = quantized.q
    batch, heads_q, heads_kv = len(seqlens_q), q.shape[1], quantized.k.shape[1]
    if launch is None and skips:
        launch = skip_launch(skip_tile, skip_sample or skip_sample_rule(seqlens_q, heads_q, skip_tile[0], q.device))
    elif launch is None:
        launch = DENSE_LAUNCH
    if skips and (launch.block_m, launch.block_n) != tuple(skip_tile):
        raise ValueError(f"skip decisions are made per kernel tile: launch tile {launch.block_m}x{launch.block_n} "
                         f"must equal the skip tile {skip_tile}")
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    skipped = torch.zeros((), dtype=torch.int32, device=q.device)
    query_tiles = -(-max(seqlens_q) // launch.block_m)
    sample_every = launch.skip_sample_every if skips else 0
    # per (sequence, head): KV tiles the sampled query tiles skipped, and all they visited (without sampling the
    # kernel never reads it: any int32 tensor will do)
    sample_counts = torch.zeros(batch, heads_q, 2, dtype=torch.int32, device=q.device) if sample_every else skipped
    args = (
        quantized.q, quantized.k, quantized.v_t, quantized.q_scale, quantized.k_scale, quantized.v_scale,
        out, skipped, sample_counts, cu_seqlens_q, cu_seqlens_kv,
        quantized.q.stride(0), quantized.q.stride(1), quantized.k.stride(0), quantized.k.stride(1),
        quantized.v_t.stride(0), quantized.v_t.stride(1), out.stride(0), out.stride(1),
        quantized.q_scale.stride(0), quantized.k_scale.stride(0),
        quantized.q_block.bit_length() - 1, quantized.k_block.bit_length() - 1,
        scale * LOG2E, skip_factor, heads_q // heads_kv, heads_kv, sample_every, round(launch.skip_pays_from * 100))
    constants = dict(
        QK_INT8=quantized.q.dtype == torch.int8,
        HEAD_DIM=HEAD_DIM, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, FP8_QK_CHUNK=launch.fp8_qk_chunk,
        BARRIER_VOTE=_barrier_vote(launch, q.device), num_warps=launch.num_warps, num_stages=launch.num_stages)
    # Dense programs leave the skip schedule out of the compiled kernel's key: a dense launch and the heads of a
    # skipping launch of the same tile that do not pay run one binary. (Compiled separately, the same loop ran up
    # to 2 % faster or slower, by how Triton laid out the kernel: benchmarks/RESULTS.md.)
    dense = dict(SKIP=False, COUNT_SKIPS=False, SKIP_CHUNK=0, BRANCH_FREE_PERCENT=0, SAMPLE_PASS=False)
    skipping = dict(SKIP=True, COUNT_SKIPS=count_skips, SKIP_CHUNK=launch.skip_chunk,
                    BRANCH_FREE_PERCENT=round(launch.branch_free_below * 100), SAMPLE_PASS=False)
    grid = (query_tiles, heads_q, batch)
    if sample_every:  # the sampled query tiles first: the other tiles read what they skipped
        _sage_attention_kernel[(-(-query_tiles // sample_every), heads_q, batch)](
            *args, **constants, **{**skipping, "SAMPLE_PASS": True})
    if sample_every or not skips:
        _sage_attention_kernel[grid](*args, **constants, **dense)
    if skips:
        _sage_attention_kernel[grid](*args, **constants, **skipping)
    if not count_skips:
        return out, None, None
    tq, tk = skip_tile  # the reference's count, also when a dense launch used another tile
    total = heads_q * sum(-(-nq // tq) * -(-nkv // tk) for nq, nkv in zip(seqlens_q, seqlens_kv))
    return out, skipped.to(torch.int64), total  # the total is known on the host: no copy to the device


def triton_sage_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                          cu_seqlens_kv: torch.Tensor, seqlens_q: tuple[int, ...], seqlens_kv: tuple[int, ...],
                          scale: float, *, dtype_qk: str = "int8", q_block: int = 1, k_block: int = 16,
                          skip_factor: float = 0.0, skip_tile: tuple[int, int] = (128, 128),
                          count_skips: bool = False, skip_sample: tuple[int, float] | None = None):
    """SAGE attention (with Skip-Softmax when ``skip_factor > 0``) on a packed batch.

    ``q``: ``[Tq, Hq, 128]``, ``k``/``v``: ``[Tk, Hkv, 128]``, bf16 or fp16, ragged (FlashInfer layout, sequence
    ``i`` owning rows ``cu_seqlens[i]:cu_seqlens[i + 1]``; ``cu_seqlens_*`` ``[B + 1]`` int32 on the tensors'
    device, ``seqlens_*`` the same lengths as host ints), ``Hq % Hkv == 0`` (GQA). ``dtype_qk``: ``"int8"`` or
    ``"fp8_e4m3"``; ``q_block`` / ``k_block``: 1, 4 or 16 tokens. Returns ``(out [Tq, Hq, 128] in q's dtype,
    skipped, total)`` as :func:`sage_attention_quantized`, which also takes ``skip_sample``. GPUs: sm_89 and
    newer with Triton (measured on sm_90 only). Raises ``ValueError`` with the reason when
    :func:`triton_sage_unavailable_reason` is not ``None``.
    """
    reason = triton_sage_unavailable_reason(q, k, v, skip_tile=skip_tile if skip_factor > 0.0 else None)
    if reason is not None:
        raise ValueError(reason)
    quantized = sage_quantize(q, k, v, cu_seqlens_q, cu_seqlens_kv, max(seqlens_q), max(seqlens_kv),
                              dtype_qk=dtype_qk, q_block=q_block, k_block=k_block)
    return sage_attention_quantized(quantized, cu_seqlens_q, cu_seqlens_kv, seqlens_q, seqlens_kv, scale,
                                    out_dtype=q.dtype, skip_factor=skip_factor, skip_tile=skip_tile,
                                    count_skips=count_skips, skip_sample=skip_sample)


@_jit
def _round_half_even(x):
    """Round float32 values with |x| < 2**22 to integers, ties to even (torch.round's rule)."""
    return (x + _ROUND_MAGIC) - _ROUND_MAGIC


@_jit
def _kv_stats_kernel(k_ptr, v_ptr, k_sum_ptr, k_max_ptr, k_min_ptr, v_amax_ptr, cu_kv_ptr, stride_kt, stride_kh,
                     stride_vt, stride_vh, TOKENS: tl.constexpr, CHUNKS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     K_RANGE: tl.constexpr):
    """Per (sequence, kv head): add the column sums of K over CHUNKS · TOKENS tokens into k_sum and their column
    max of |V| into v_amax ([B, Hkv, D] float32, zero-initialised); with K_RANGE also K's column max and min (k_max
    / k_min, initialised to -inf / +inf), from which the quantizer gets one smoothed-K scale per sequence and head.
    Each program folds its chunks in registers and adds to the totals once (atomics per chunk cost more time than
    reading K and V)."""
    program, head, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(cu_kv_ptr + seq)
    length = tl.load(cu_kv_ptr + seq + 1) - start
    first = program * CHUNKS * TOKENS
    if first >= length:
        return
    dims = tl.arange(0, HEAD_DIM)
    k_sum = tl.zeros((HEAD_DIM,), tl.float32)
    v_amax = tl.zeros((HEAD_DIM,), tl.float32)
    k_max = tl.full((HEAD_DIM,), float("-inf"), tl.float32)
    k_min = tl.full((HEAD_DIM,), float("inf"), tl.float32)
    for chunk in range(CHUNKS):
        tokens = first + chunk * TOKENS + tl.arange(0, TOKENS)
        valid = (tokens < length)[:, None]
        rows = (start + tokens).to(tl.int64)[:, None]
        k = tl.load(k_ptr + rows * stride_kt + head * stride_kh + dims[None, :], mask=valid, other=0.0)
        v = tl.load(v_ptr + rows * stride_vt + head * stride_vh + dims[None, :], mask=valid, other=0.0)
        k = k.to(tl.float32)
        k_sum += tl.sum(k, 0)
        v_amax = tl.maximum(v_amax, tl.max(tl.abs(v.to(tl.float32)), 0))
        if K_RANGE:
            k_max = tl.maximum(k_max, tl.max(tl.where(valid, k, float("-inf")), 0))
            k_min = tl.minimum(k_min, tl.min(tl.where(valid, k, float("inf")), 0))
    stats = (seq * tl.num_programs(1) + head) * HEAD_DIM + dims
    tl.atomic_add(k_sum_ptr + stats, k_sum)
    tl.atomic_max(v_amax_ptr + stats, v_amax)
    if K_RANGE:
        tl.atomic_max(k_max_ptr + stats, k_max)
        tl.atomic_min(k_min_ptr + stats, k_min)


@_jit
def _quantize_token_blocks(x, QMAX: tl.constexpr, IS_INT8: tl.constexpr, BLOCK: tl.constexpr,
                           TOKENS: tl.constexpr):
    """x [TOKENS, D] float32 (rows past the sequence end are 0) -> (values on the int8/fp8 grid as float32,
    scales [TOKENS // BLOCK]); the block scale is amax / QMAX, as quant.quantize_blocks."""
    block_amax = tl.max(tl.reshape(tl.max(tl.abs(x), 1), (TOKENS // BLOCK, BLOCK)), 1)
    scales = tl.math.div_rn(tl.maximum(block_amax, _TINY_SCALE), QMAX)
    token_scales = tl.reshape(tl.broadcast_to(scales[:, None], (TOKENS // BLOCK, BLOCK)), (TOKENS,))
    return _round_to_grid(tl.math.div_rn(x, token_scales[:, None]), QMAX, IS_INT8), scales


@_jit
def _round_to_grid(scaled, QMAX: tl.constexpr, IS_INT8: tl.constexpr):
    if IS_INT8:
        return tl.minimum(tl.maximum(_round_half_even(scaled), -QMAX), QMAX)
    return tl.minimum(tl.maximum(scaled, -QMAX), QMAX)  # the fp8 cast at the store rounds to nearest even


@_jit
def _block_scale_offset(seq, start, head, head_stride, seq_stride, BLOCK: tl.constexpr,
                        SCALES_BY_SEQUENCE: tl.constexpr):
    """Where (seq, head)'s first block scale lives: ``seq * seq_stride + head * head_stride`` in the
    ``[B, H, blocks]`` layout, ``head * head_stride + start // BLOCK + seq`` in the packed ``[H, columns]`` one."""
    if SCALES_BY_SEQUENCE:
        return seq.to(tl.int64) * seq_stride + (head * head_stride).to(tl.int64)
    return (head * head_stride + start // BLOCK + seq).to(tl.int64)


@_jit
def _store_token_blocks(x, values_ptr, scales_ptr, row_stride, head_offset, scale_offset, scale_factor, seq_start,
                        first, length, QMAX: tl.constexpr, IS_INT8: tl.constexpr, BLOCK: tl.constexpr,
                        TOKENS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Quantize one sequence's Q or K rows ``first : first + TOKENS`` and store values and block scales (times
    ``scale_factor``)."""
    values, scales = _quantize_token_blocks(x, QMAX, IS_INT8, BLOCK, TOKENS)
    dims = tl.arange(0, HEAD_DIM)
    tokens = first + tl.arange(0, TOKENS)
    rows = (seq_start + tokens).to(tl.int64)[:, None]
    tl.store(values_ptr + rows * row_stride + head_offset + dims[None, :],
             values.to(values_ptr.dtype.element_ty), mask=(tokens < length)[:, None])
    blocks = first // BLOCK + tl.arange(0, TOKENS // BLOCK)
    tl.store(scales_ptr + scale_offset + blocks, scales * scale_factor, mask=blocks * BLOCK < length)


@_jit
def _sequence_k_scale(k_sum_ptr, k_max_ptr, k_min_ptr, stats, length, QMAX: tl.constexpr):
    """One scale for a whole sequence's smoothed K of one head: max over channels and tokens of |k - mean|,
    from the column sum, max and min, over QMAX; and the mean itself."""
    k_mean = tl.math.div_rn(tl.load(k_sum_ptr + stats), length.to(tl.float32))
    spread = tl.maximum(tl.load(k_max_ptr + stats) - k_mean, k_mean - tl.load(k_min_ptr + stats))
    return tl.math.div_rn(tl.maximum(tl.max(spread, 0), _TINY_SCALE), QMAX), k_mean


@_jit
def _sage_quantize_kernel(q_ptr, k_ptr, v_ptr, k_sum_ptr, k_max_ptr, k_min_ptr, v_amax_ptr, cu_q_ptr, cu_kv_ptr,
                          q_out_ptr, q_scale_ptr, k_out_ptr, k_scale_ptr, v_out_ptr, v_scale_ptr,
                          stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                          stride_q_out_t, stride_q_out_h, stride_k_out_t, stride_k_out_h, v_out_stride_0,
                          v_out_stride_1, q_scale_head_stride, q_scale_seq_stride, k_scale_head_stride,
                          k_scale_seq_stride, q_chunks, heads_q, heads_kv,
                          QMAX: tl.constexpr, QK_INT8: tl.constexpr, Q_BLOCK: tl.constexpr,
                          K_BLOCK: tl.constexpr, SCALES_BY_SEQUENCE: tl.constexpr, V_TRANSPOSED: tl.constexpr,
                          V_FMHA_V2_ORDER: tl.constexpr, TOKENS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One pass over Q, K, V: programs [0, q_chunks) quantize TOKENS query rows of one head, the rest quantize
    TOKENS key/value rows of one kv head (K smoothed by k_sum / length; V by v_amax / 448).

    K_BLOCK 0: one K scale per sequence and head (from the K range statistics), folded into Q's block scales;
    no K scales are stored. V_TRANSPOSED: V goes to the attention kernel's ``[Hkv, D, columns]`` layout (strides
    0/1: head/channel), keys permuted within 16-key groups when V_FMHA_V2_ORDER (:class:`QuantizeTargets`), else
    to ``[tokens, Hkv, D]`` (strides 0/1: token/head)."""
    chunk, head, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    dims = tl.arange(0, HEAD_DIM)
    if chunk < q_chunks:
        start = tl.load(cu_q_ptr + seq)
        length = tl.load(cu_q_ptr + seq + 1) - start
        if chunk * TOKENS >= length or head >= heads_q:
            return
        tokens = chunk * TOKENS + tl.arange(0, TOKENS)
        rows = (start + tokens).to(tl.int64)[:, None]
        q = tl.load(q_ptr + rows * stride_qt + head * stride_qh + dims[None, :], mask=(tokens < length)[:, None],
                    other=0.0).to(tl.float32)
        if K_BLOCK == 0:
            kv_head = head // (heads_q // heads_kv)
            kv_length = tl.load(cu_kv_ptr + seq + 1) - tl.load(cu_kv_ptr + seq)
            k_scale, _ = _sequence_k_scale(k_sum_ptr, k_max_ptr, k_min_ptr, (seq * heads_kv + kv_head) * HEAD_DIM
                                           + dims, kv_length, QMAX)
        else:
            k_scale = 1.0
        _store_token_blocks(q, q_out_ptr, q_scale_ptr, stride_q_out_t, head * stride_q_out_h,
                            _block_scale_offset(seq, start, head, q_scale_head_stride, q_scale_seq_stride, Q_BLOCK,
                                                SCALES_BY_SEQUENCE),
                            k_scale, start, chunk * TOKENS, length, QMAX, QK_INT8, Q_BLOCK, TOKENS, HEAD_DIM)
    else:
        chunk -= q_chunks
        start = tl.load(cu_kv_ptr + seq)
        length = tl.load(cu_kv_ptr + seq + 1) - start
        if chunk * TOKENS >= length or head >= heads_kv:
            return
        tokens = chunk * TOKENS + tl.arange(0, TOKENS)
        valid = (tokens < length)[:, None]
        rows = (start + tokens).to(tl.int64)[:, None]
        stats = (seq * heads_kv + head) * HEAD_DIM + dims
        k = tl.load(k_ptr + rows * stride_kt + head * stride_kh + dims[None, :], mask=valid, other=0.0)
        if K_BLOCK == 0:
            k_scale, k_mean = _sequence_k_scale(k_sum_ptr, k_max_ptr, k_min_ptr, stats, length, QMAX)
            k = tl.where(valid, k.to(tl.float32) - k_mean[None, :], 0.0)
            tl.store(k_out_ptr + rows * stride_k_out_t + head * stride_k_out_h + dims[None, :],
                     _round_to_grid(tl.math.div_rn(k, k_scale), QMAX, QK_INT8).to(k_out_ptr.dtype.element_ty),
                     mask=valid)
        else:
            k_mean = tl.math.div_rn(tl.load(k_sum_ptr + stats), length.to(tl.float32))
            k = tl.where(valid, k.to(tl.float32) - k_mean[None, :], 0.0)
            _store_token_blocks(k, k_out_ptr, k_scale_ptr, stride_k_out_t, head * stride_k_out_h,
                                _block_scale_offset(seq, start, head, k_scale_head_stride, k_scale_seq_stride,
                                                    K_BLOCK, SCALES_BY_SEQUENCE),
                                1.0, start, chunk * TOKENS, length, QMAX, QK_INT8, K_BLOCK, TOKENS, HEAD_DIM)
        v_scale = tl.math.div_rn(tl.maximum(tl.load(v_amax_ptr + stats), _TINY_SCALE), _FP8_MAX)
        if chunk == 0:
            tl.store(v_scale_ptr + stats, v_scale)
        v = tl.load(v_ptr + rows * stride_vt + head * stride_vh + dims[None, :], mask=valid, other=0.0)
        v = tl.minimum(tl.maximum(tl.math.div_rn(v.to(tl.float32), v_scale[None, :]), -_FP8_MAX), _FP8_MAX)
        if V_TRANSPOSED:
            # Zeros (from the masked load) fill the sequence's columns up to the next multiple of 16: the
            # attention kernel reads V^T in 16-byte vectors masked at that multiple.
            v_start = _V_TOKEN_ALIGN * ((start + _V_TOKEN_ALIGN - 1) // _V_TOKEN_ALIGN + seq)
            padded_length = (length + _V_TOKEN_ALIGN - 1) // _V_TOKEN_ALIGN * _V_TOKEN_ALIGN
            v_t_head = v_out_ptr + head.to(tl.int64) * v_out_stride_0
            if V_FMHA_V2_ORDER:
                v = _fmha_v2_v_order(v, TOKENS, HEAD_DIM)
            # permuted in registers, not through the addresses: the stores stay contiguous along keys
            tl.store(v_t_head + dims[None, :] * v_out_stride_1 + (v_start + tokens)[:, None],
                     v.to(tl.float8e4nv), mask=(tokens < padded_length)[:, None])
        else:
            tl.store(v_out_ptr + rows * v_out_stride_0 + head * v_out_stride_1 + dims[None, :],
                     v.to(tl.float8e4nv), mask=valid)


@_jit
def _fmha_v2_v_order(v, TOKENS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """``v [TOKENS, HEAD_DIM]`` -> the same values with keys and channels in FMHAv2's V order
    (:class:`QuantizeTargets`): within each 16-key group key ``8·h + 2·a + e`` moves to ``4·a + 2·h + e``, within
    each 16-channel group channel ``2·p + e`` to ``8·e + p``."""
    v = tl.permute(tl.reshape(v, (TOKENS // 16, 2, 4, 2, HEAD_DIM)), (0, 2, 1, 3, 4))
    v = tl.permute(tl.reshape(v, (TOKENS, HEAD_DIM // 16, 8, 2)), (0, 1, 3, 2))
    return tl.reshape(v, (TOKENS, HEAD_DIM))


@_jit
def _attend_kv_tile(q, q_scale, row_invalid, m_i, l_i, acc, skipped, k_base, stride_kt, k_scale_base, k_block_shift,
                    v_base, j, kv_len, v_len, log2_lambda,
                    QK_INT8: tl.constexpr, FP8_QK_CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_N: tl.constexpr, SKIP: tl.constexpr, MASKED: tl.constexpr, BRANCH_FREE: tl.constexpr,
                    BARRIER_VOTE: tl.constexpr):
    """Fold KV tile ``j : j + BLOCK_N`` into the running max ``m_i``, row sum ``l_i`` and accumulator ``acc``.

    Scores are ``t * q_scale`` with ``t = (q · k) * k_scale``: q_scale > 0 per row commutes with the row max, so
    the per-element work is one multiply for the scores and one fused multiply-add inside exp2. P is produced
    directly as ``448 · P`` (log2 448 folded into the subtracted max) and summed that way. ``BRANCH_FREE``: a
    skipped tile is folded in with P = 0 instead of being branched around (same results).
    """
    cols = j + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    k_ptrs = k_base + cols.to(tl.int64)[:, None] * stride_kt + dims[None, :]
    if MASKED:
        col_valid = cols < kv_len
        k = tl.load(k_ptrs, mask=col_valid[:, None], other=0.0)
        k_scale = tl.load(k_scale_base + (cols >> k_block_shift), mask=col_valid, other=0.0)
    else:
        k = tl.load(k_ptrs)
        k_scale = tl.load(k_scale_base + (cols >> k_block_shift))
    if QK_INT8:
        t = tl.dot(q, tl.trans(k), out_dtype=tl.int32).to(tl.float32) * k_scale[None, :]
    else:
        # sm_90's fp8 tensor cores accumulate with reduced precision; every FP8_QK_CHUNK channels the partial
        # product is added in fp32.
        t = tl.dot(q, tl.trans(k), max_num_imprecise_acc=FP8_QK_CHUNK) * k_scale[None, :]
    if MASKED:
        t = tl.where(col_valid[None, :], t, float("-inf"))
    tile_max = tl.max(t, 1) * q_scale
    if SKIP:
        # On the first tile m_i = -inf, so no valid row finds it negligible: it is never skipped. Rows past the
        # sequence end never hold a skip back.
        negligible = (tile_max - m_i < log2_lambda) | row_invalid
    else:
        negligible = row_invalid
    if BRANCH_FREE:
        m_i, l_i, acc, skip_rows = _fold_scores(t, q_scale, tile_max, m_i, l_i, acc, v_base, cols, v_len,
                                                negligible, MASKED, True, BARRIER_VOTE)
        skipped += skip_rows.to(tl.int32)
    elif SKIP and _all_rows(negligible):
        skipped += 1
    else:
        # V^T is loaded in here so that a skipped tile does not wait for it: with the dot in a branch, Triton does
        # not software-pipeline the load either way, and loading it before the skip test was 25-40 % slower at
        # every sparsity on the H200 (benchmarks/RESULTS.md, issue 11; commit d9f3559).
        m_i, l_i, acc, _ = _fold_scores(t, q_scale, tile_max, m_i, l_i, acc, v_base, cols, v_len, negligible,
                                        MASKED, False, BARRIER_VOTE)
    return m_i, l_i, acc, skipped


@_jit
def _attend_kv_tiles(q, q_scale, row_invalid, m_i, l_i, acc, skipped, k_base, stride_kt, k_scale_base,
                     k_block_shift, v_base, start, end, kv_len, v_len, log2_lambda,
                     QK_INT8: tl.constexpr, FP8_QK_CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_N: tl.constexpr, SKIP: tl.constexpr, BRANCH_FREE: tl.constexpr,
                     BARRIER_VOTE: tl.constexpr):
    """:func:`_attend_kv_tile` over the full tiles ``start : end`` (one loop, software-pipelined by Triton)."""
    for j in range(start, end, BLOCK_N):
        m_i, l_i, acc, skipped = _attend_kv_tile(
            q, q_scale, row_invalid, m_i, l_i, acc, skipped, k_base, stride_kt, k_scale_base, k_block_shift,
            v_base, j, kv_len, v_len, log2_lambda,
            QK_INT8, FP8_QK_CHUNK, HEAD_DIM, BLOCK_N, SKIP, False, BRANCH_FREE, BARRIER_VOTE)
    return m_i, l_i, acc, skipped


@_jit
def _all_rows(negligible):
    """The tile-wide Skip-Softmax decision: every row's test passed."""
    return tl.min(negligible.to(tl.int32), 0) == 1


@_jit
def _fold_scores(t, q_scale, tile_max, m_i, l_i, acc, v_base, cols, v_len, negligible, MASKED: tl.constexpr,
                 BRANCH_FREE: tl.constexpr, BARRIER_VOTE: tl.constexpr):
    """The online-softmax update with one tile's scores ``t``. ``BRANCH_FREE``: the skip decision is taken here,
    and a skipped tile leaves the state bit-identical (its P zeroed, the old max, row sum and alpha = 1 kept).
    Returns the new state and the decision."""
    v_ptrs = v_base + cols[None, :]
    if MASKED:
        v_t = tl.load(v_ptrs, mask=cols[None, :] < v_len, other=0.0)
    else:
        v_t = tl.load(v_ptrs)
    m_new = tl.maximum(m_i, tile_max)
    subtracted = m_new - _LOG2_P_SCALE
    if BRANCH_FREE:
        # A skipped row subtracts +inf: its P is exp2(-inf) = 0 and its row sum 0, at a select per row instead of
        # one per element of P.
        if BARRIER_VOTE:
            skip_rows = _all_rows_by_barrier(negligible)
        else:
            skip_rows = tl.zeros_like(negligible) | _all_rows(negligible)
        m_new = tl.where(skip_rows, m_i, m_new)  # (skipped at λ ≥ 1, a tile may hold a larger max)
        subtracted = tl.where(skip_rows, float("inf"), subtracted)
    else:
        skip_rows = False
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(t * q_scale[:, None] - subtracted[:, None])
    row_sum = tl.sum(p, 1)
    l_i = l_i * alpha + row_sum
    # Product then fp32 add: passing acc into an fp8 dot would accumulate across tiles in the tensor core's
    # reduced-precision fp8 accumulator on sm_90.
    acc = acc * alpha[:, None] + tl.dot(p.to(tl.float8e4nv), tl.trans(v_t))
    return m_new, l_i, acc, skip_rows


@_jit
def _all_rows_by_barrier(negligible):
    """:func:`_all_rows` as a ``[BLOCK_M]`` vector (every element the decision), in one ``bar.red.and`` across
    the program's threads instead of a reduction through shared memory (on an H200 that cut the branch-free
    schedule's cost over dense by about half). Needs every thread to hold exactly two rows, so that one call
    sees all of its rows: a 64-row tile of one warpgroup on sm_90 (:func:`_barrier_vote`)."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred a, b; setp.ne.b32 a, $2, 0; setp.ne.b32 b, $3, 0; and.pred a, a, b; "
        "bar.red.and.pred b, 0, a; selp.b32 $0, 1, 0, b; mov.b32 $1, $0; }",
        "=r,=r,r,r", [negligible.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=2) != 0


# the sampling settings are plain arguments, so that a dense launch and a sampling launch's dense programs share
# one binary
@_jit_not_specializing("sample_every", "pays_from_percent")
def _sage_attention_kernel(q_ptr, k_ptr, v_t_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr, out_ptr, skipped_ptr,
                           sample_counts_ptr, cu_q_ptr, cu_kv_ptr,
                           stride_qt, stride_qh, stride_kt, stride_kh, v_t_head_stride, v_t_dim_stride,
                           stride_ot, stride_oh, q_scale_stride, k_scale_stride,
                           q_block_shift, k_block_shift, score_scale, skip_factor, group_size, heads_kv,
                           sample_every, pays_from_percent,
                           QK_INT8: tl.constexpr,
                           HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           FP8_QK_CHUNK: tl.constexpr, SKIP: tl.constexpr, COUNT_SKIPS: tl.constexpr,
                           SKIP_CHUNK: tl.constexpr, BRANCH_FREE_PERCENT: tl.constexpr, SAMPLE_PASS: tl.constexpr,
                           BARRIER_VOTE: tl.constexpr):
    """One program: BLOCK_M query rows of one head of one sequence against all of that sequence's keys.

    Scores live in the log2 domain (``score_scale`` = softmax scale · log2 e), so the skip test
    ``exp(tile_max - m) < λ`` becomes ``tile_max₂ - m₂ < log2 λ``.

    ``sample_every`` > 0 (AttentionLaunch.skip_sample_every): the ``SAMPLE_PASS`` launch attends every
    sample_every-th query tile, skipping, and adds its skipped and visited KV tiles to ``sample_counts`` ``[B, H,
    2]``. Then the other query tiles: with ``SKIP``, of the (sequence, head)s whose sample skipped at least
    pays_from_percent % of its tiles; without, of the others.
    """
    tile, head, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    sample_counts = sample_counts_ptr + (seq * tl.num_programs(1) + head) * 2
    if sample_every > 0:
        if SAMPLE_PASS:
            tile = tile * sample_every
        elif tile % sample_every == 0:
            return
        elif (tl.load(sample_counts) * 100 >= pays_from_percent * tl.load(sample_counts + 1)) != SKIP:
            return
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    kv_start = tl.load(cu_kv_ptr + seq)
    kv_len = tl.load(cu_kv_ptr + seq + 1) - kv_start
    kv_head = head // group_size

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = rows < q_len
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (q_start + rows).to(tl.int64)[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=row_valid[:, None], other=0.0)
    # Rows past the sequence end get scale 0; their (possibly NaN) results stay in their own rows, never stored,
    # and they never hold a skip back.
    q_scale_base = q_scale_ptr + head * q_scale_stride + (q_start >> q_block_shift) + seq
    q_scale = tl.load(q_scale_base + (rows >> q_block_shift), mask=row_valid, other=0.0) * score_scale

    k_base = k_ptr + kv_head * stride_kh + kv_start.to(tl.int64) * stride_kt
    k_scale_base = k_scale_ptr + kv_head * k_scale_stride + (kv_start >> k_block_shift) + seq
    v_start = tl.multiple_of(_V_TOKEN_ALIGN * ((kv_start + _V_TOKEN_ALIGN - 1) // _V_TOKEN_ALIGN + seq), _V_TOKEN_ALIGN)
    v_base = v_t_ptr + kv_head.to(tl.int64) * v_t_head_stride + dims[:, None] * v_t_dim_stride + v_start
    # V^T columns up to a multiple of 16 hold zeros (see the quantizer): masking there keeps 16-byte loads.
    v_len = tl.multiple_of((kv_len + _V_TOKEN_ALIGN - 1) // _V_TOKEN_ALIGN * _V_TOKEN_ALIGN, _V_TOKEN_ALIGN)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    log2_lambda = tl.log2(skip_factor / kv_len.to(tl.float32))
    skipped = tl.zeros((BLOCK_M,), tl.int32)  # every element the count (the vote's result is a row vector)
    row_invalid = ~row_valid
    # Full KV tiles run unmasked; a partial last tile runs once more with masks.
    full_end = kv_len // BLOCK_N * BLOCK_N
    if not SKIP:
        m_i, l_i, acc, skipped = _attend_kv_tiles(
            q, q_scale, row_invalid, m_i, l_i, acc, skipped, k_base, stride_kt, k_scale_base, k_block_shift,
            v_base, 0, full_end, kv_len, v_len, log2_lambda,
            QK_INT8, FP8_QK_CHUNK, HEAD_DIM, BLOCK_N, False, False, BARRIER_VOTE)
    elif BRANCH_FREE_PERCENT > 0:
        # Runs of tiles on one schedule (AttentionLaunch.skip_chunk): each run's skip rate sets the next run's
        # schedule, and a run that keeps it is twice as long, so that a steady program restarts Triton's software
        # pipeline (a stall for the first loads) only a few times.
        start = tl.zeros((), tl.int32)
        run_tiles = tl.full((), SKIP_CHUNK, tl.int32)
        branch_free = tl.full((), True, tl.int1)  # the first tiles are seldom skipped (the running max is new)
        while start < full_end:
            end = tl.minimum(start + run_tiles * BLOCK_N, full_end)
            skipped_before = skipped
            if branch_free:
                m_i, l_i, acc, skipped = _attend_kv_tiles(
                    q, q_scale, row_invalid, m_i, l_i, acc, skipped, k_base, stride_kt, k_scale_base, k_block_shift,
                    v_base, start, end, kv_len, v_len, log2_lambda,
                    QK_INT8, FP8_QK_CHUNK, HEAD_DIM, BLOCK_N, True, True, BARRIER_VOTE)
            else:
                m_i, l_i, acc, skipped = _attend_kv_tiles(
                    q, q_scale, row_invalid, m_i, l_i, acc, skipped, k_base, stride_kt, k_scale_base, k_block_shift,
                    v_base, start, end, kv_len, v_len, log2_lambda,
                    QK_INT8, FP8_QK_CHUNK, HEAD_DIM, BLOCK_N, True, False, BARRIER_VOTE)
            run_skips = tl.max(skipped - skipped_before, 0)
            next_branch_free = run_skips * 100 < BRANCH_FREE_PERCENT * ((end - start) // BLOCK_N)
            run_tiles = tl.where(next_branch_free == branch_free, run_tiles * 2, SKIP_CHUNK)
            branch_free = next_branch_free
            start = end
    else:  # every tile branching
        m_i, l_i, acc, skipped = _attend_kv_tiles(
            q, q_scale, row_invalid, m_i, l_i, acc, skipped, k_base, stride_kt, k_scale_base, k_block_shift,
            v_base, 0, full_end, kv_len, v_len, log2_lambda,
            QK_INT8, FP8_QK_CHUNK, HEAD_DIM, BLOCK_N, True, False, BARRIER_VOTE)
    if full_end < kv_len:
        m_i, l_i, acc, skipped = _attend_kv_tile(
            q, q_scale, row_invalid, m_i, l_i, acc, skipped, k_base, stride_kt,
            k_scale_base, k_block_shift, v_base, full_end, kv_len, v_len, log2_lambda,
            QK_INT8, FP8_QK_CHUNK, HEAD_DIM, BLOCK_N, SKIP, True, False, BARRIER_VOTE)

    # acc and l_i both carry the factor 448 of P's fp8 encoding, which cancels here.
    v_scale = tl.load(v_scale_ptr + (seq * heads_kv + kv_head) * HEAD_DIM + dims)
    out = acc / l_i[:, None] * v_scale[None, :]
    tl.store(out_ptr + (q_start + rows).to(tl.int64)[:, None] * stride_ot + head * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
    if COUNT_SKIPS:
        tl.atomic_add(skipped_ptr, tl.max(skipped, 0))
    if SKIP and SAMPLE_PASS:
        tl.atomic_add(sample_counts, tl.max(skipped, 0))
        tl.atomic_add(sample_counts + 1, (kv_len + BLOCK_N - 1) // BLOCK_N)

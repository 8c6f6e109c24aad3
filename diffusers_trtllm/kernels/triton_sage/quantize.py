"""The SAGE quantizer of the Triton kernels, two launches over a packed batch:

1. ``_kv_stats_kernel``: per (sequence, kv head, channel) the sum of K (for the smoothing mean) and the max of |V|
   (for V's per-channel scale): each program's K sums in a row of their own, added in a fixed order after it;
2. ``_sage_quantize_kernel``: one pass over Q, K and V writing int8 / fp8 values and their scales.

Semantics: :mod:`diffusers_trtllm.quant` per sequence (Q and K per block of 1, 4 or 16 tokens from each sequence's
start, K smoothed by its mean, V per channel to fp8 e4m3). :func:`sage_quantize` writes the layouts of this
package's attention kernel (:class:`SageQuantized`); :func:`quantize_into` writes any :class:`QuantizeTargets`,
which is how the FMHAv2 SAGE kernel (:mod:`..fmha_v2_sage`) gets its inputs.
"""

from __future__ import annotations  # keeps Triton's "tl.constexpr" annotations unevaluated when Triton is absent

import math
from typing import NamedTuple

import torch

from ..numerics import FP8_MAX, HEAD_DIM, QK_TORCH_DTYPES, TINY_SCALE, qmax
from ._triton import constexpr, jit, tl

V_TOKEN_ALIGN = 16  # each sequence's V^T columns start on a 16-byte boundary, so V loads vectorize
QUANTIZE_TOKENS = 64  # tokens per program of the quantization pass (raised to the Q/K block when larger)
# The K/V reduction: tokens per chunk, and chunks one program folds before it writes its sums
STATS_TOKENS = 128
STATS_CHUNKS = 4
ROUND_MAGIC = 12582912.0  # 1.5 * 2**23: (x + M) - M rounds |x| < 2**22 to the nearest integer, ties to even

_V_TOKEN_ALIGN = constexpr(V_TOKEN_ALIGN)
_TINY_SCALE = constexpr(TINY_SCALE)
_FP8_MAX = constexpr(FP8_MAX)
_ROUND_MAGIC = constexpr(ROUND_MAGIC)


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

    - ``q_dot_k_mean``: ``[Tq, Hq]`` float32 (from ``sage_quantize(..., q_dot_k_mean=True)``, else None):
      :class:`QuantizeTargets`' field of that name.

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
    q_dot_k_mean: torch.Tensor | None = None


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
    ``q_padded_to_kv``: ``q`` (and its scales) has the keys' layout, ``[Tk, Hq, D]``: sequence ``i``'s queries go
    to rows ``cu_seqlens_kv[i]`` onwards, followed by zero rows (scale blocks of them: ``TINY_SCALE / qmax``) up
    to its key length, so a kernel taking equal query and key lengths serves sequences with fewer queries than
    keys; every sequence needs at most as many queries as keys. ``q_dot_k_mean`` (optional, ``[Tq, Hq]``
    float32, rows contiguous): receives each query row's dot product with its sequence's K mean (of the row's kv
    head), from the unquantized values. Smoothing lowers the row's scores by the softmax scale times it, so a
    kernel adds that back to give the log-sum-exp of the unsmoothed scores (ring attention merges by it).
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
    q_padded_to_kv: bool = False
    q_dot_k_mean: torch.Tensor | None = None


def scale_columns(tokens: int, batch: int, block: int) -> int:
    """Columns of a block-scale tensor for ``tokens`` packed tokens in ``batch`` sequences."""
    return -(-tokens // block) + batch - 1


def v_columns(tokens: int, batch: int) -> int:
    """Columns of ``SageQuantized.v_t`` for ``tokens`` packed key tokens in ``batch`` sequences."""
    return V_TOKEN_ALIGN * (-(-tokens // V_TOKEN_ALIGN) + batch)


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
    v_amax = torch.zeros(batch, heads_kv, HEAD_DIM, dtype=torch.float32, device=device)
    k_range = [torch.full((batch, heads_kv, HEAD_DIM), fill, dtype=torch.float32, device=device)
               for fill in (-math.inf, math.inf)] if k_block == 0 else [v_amax, v_amax]
    # float atomics would add the programs' K sums in the order they finish, so the smoothing mean, the quantized
    # K and the attention output would change from call to call in their last bits: each program writes its own
    # row, summed in a fixed order
    programs = -(-max_seqlen_kv // (STATS_TOKENS * STATS_CHUNKS))
    k_sums = torch.zeros(programs, batch, heads_kv, HEAD_DIM, dtype=torch.float32, device=device)
    _kv_stats_kernel[(programs, heads_kv, batch)](
        k, v, k_sums, *k_range, v_amax, cu_seqlens_kv, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        TOKENS=STATS_TOKENS, CHUNKS=STATS_CHUNKS, HEAD_DIM=HEAD_DIM, K_RANGE=k_block == 0)
    k_sum = k_sums.sum(0)
    q_rows = max_seqlen_kv if targets.q_padded_to_kv else max_seqlen_q  # rows Q programs write per sequence
    q_chunks, kv_chunks = -(-q_rows // tokens), -(-max_seqlen_kv // tokens)
    seq_stride = (lambda t: t.stride(0)) if targets.scales_by_sequence else (lambda t: 0)
    head_stride = (lambda t: t.stride(1)) if targets.scales_by_sequence else (lambda t: t.stride(0))
    k_scale = targets.q_scale if k_block == 0 else targets.k_scale
    # without q_dot_k_mean the kernel never reads its pointer: any float32 tensor will do
    q_dot_k_mean = targets.q_scale if targets.q_dot_k_mean is None else targets.q_dot_k_mean
    _sage_quantize_kernel[(q_chunks + kv_chunks, max(heads_q, heads_kv), batch)](
        q, k, v, k_sum, *k_range, v_amax, cu_seqlens_q, cu_seqlens_kv,
        targets.q, targets.q_scale, targets.k, k_scale, targets.v, targets.v_scale, q_dot_k_mean,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        targets.q.stride(0), targets.q.stride(1), targets.k.stride(0), targets.k.stride(1),
        targets.v.stride(0), targets.v.stride(1), head_stride(targets.q_scale), seq_stride(targets.q_scale),
        head_stride(k_scale), seq_stride(k_scale), q_dot_k_mean.stride(0), q_chunks, heads_q, heads_kv,
        QMAX=qmax(dtype_qk), QK_INT8=dtype_qk == "int8",
        Q_BLOCK=q_block, K_BLOCK=k_block, SCALES_BY_SEQUENCE=targets.scales_by_sequence,
        V_TRANSPOSED=targets.v_transposed, V_FMHA_V2_ORDER=targets.v_fmha_v2_order,
        Q_PADDED_TO_KV=targets.q_padded_to_kv, Q_DOT_K_MEAN=targets.q_dot_k_mean is not None, TOKENS=tokens, HEAD_DIM=HEAD_DIM, num_warps=4 if tokens <= 64 else 8)


def sage_quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  cu_seqlens_kv: torch.Tensor, max_seqlen_q: int, max_seqlen_kv: int, *, dtype_qk: str,
                  q_block: int, k_block: int, q_dot_k_mean: bool = False) -> SageQuantized:
    """Quantize a packed batch into the attention kernel's layouts (:class:`SageQuantized`) with
    :func:`quantize_into`. ``q_block`` / ``k_block``: 1, 4 or 16 tokens. ``q_dot_k_mean``: also each query row's
    dot product with its K mean (what the attention kernel's log-sum-exp needs)."""
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
        q_block=q_block, k_block=k_block,
        q_dot_k_mean=torch.empty(q.shape[:2], dtype=torch.float32, device=device) if q_dot_k_mean else None)
    quantize_into(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                  QuantizeTargets(out.q, out.q_scale, out.k, out.k_scale, out.v_t, out.v_scale,
                                  scales_by_sequence=False, v_transposed=True, q_dot_k_mean=out.q_dot_k_mean),
                  dtype_qk=dtype_qk, q_block=q_block, k_block=k_block)
    return out



@jit
def _round_half_even(x):
    """Round float32 values with |x| < 2**22 to integers, ties to even (torch.round's rule)."""
    return (x + _ROUND_MAGIC) - _ROUND_MAGIC


@jit
def _kv_stats_kernel(k_ptr, v_ptr, k_sums_ptr, k_max_ptr, k_min_ptr, v_amax_ptr, cu_kv_ptr, stride_kt, stride_kh,
                     stride_vt, stride_vh, TOKENS: tl.constexpr, CHUNKS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     K_RANGE: tl.constexpr):
    """Per (sequence, kv head): the column sums of K over this program's CHUNKS · TOKENS tokens into its row of
    k_sums ([programs, B, Hkv, D] float32, zero-initialised: the caller adds the rows) and their column max of |V|
    into v_amax ([B, Hkv, D] float32, zero-initialised); with K_RANGE also K's column max and min (k_max / k_min,
    initialised to -inf / +inf), from which the quantizer gets one smoothed-K scale per sequence and head. Each
    program folds its chunks in registers and writes once (max and min by atomics, whose order does not matter)."""
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
    tl.store(k_sums_ptr + program * tl.num_programs(2) * tl.num_programs(1) * HEAD_DIM + stats, k_sum)
    tl.atomic_max(v_amax_ptr + stats, v_amax)
    if K_RANGE:
        tl.atomic_max(k_max_ptr + stats, k_max)
        tl.atomic_min(k_min_ptr + stats, k_min)


@jit
def _quantize_token_blocks(x, QMAX: tl.constexpr, IS_INT8: tl.constexpr, BLOCK: tl.constexpr,
                           TOKENS: tl.constexpr):
    """x [TOKENS, D] float32 (rows past the sequence end are 0) -> (values on the int8/fp8 grid as float32,
    scales [TOKENS // BLOCK]); the block scale is amax / QMAX, as quant.quantize_blocks."""
    block_amax = tl.max(tl.reshape(tl.max(tl.abs(x), 1), (TOKENS // BLOCK, BLOCK)), 1)
    scales = tl.math.div_rn(tl.maximum(block_amax, _TINY_SCALE), QMAX)
    token_scales = tl.reshape(tl.broadcast_to(scales[:, None], (TOKENS // BLOCK, BLOCK)), (TOKENS,))
    return _round_to_grid(tl.math.div_rn(x, token_scales[:, None]), QMAX, IS_INT8), scales


@jit
def _round_to_grid(scaled, QMAX: tl.constexpr, IS_INT8: tl.constexpr):
    if IS_INT8:
        return tl.minimum(tl.maximum(_round_half_even(scaled), -QMAX), QMAX)
    return tl.minimum(tl.maximum(scaled, -QMAX), QMAX)  # the fp8 cast at the store rounds to nearest even


@jit
def _block_scale_offset(seq, start, head, head_stride, seq_stride, BLOCK: tl.constexpr,
                        SCALES_BY_SEQUENCE: tl.constexpr):
    """Where (seq, head)'s first block scale lives: ``seq * seq_stride + head * head_stride`` in the
    ``[B, H, blocks]`` layout, ``head * head_stride + start // BLOCK + seq`` in the packed ``[H, columns]`` one."""
    if SCALES_BY_SEQUENCE:
        return seq.to(tl.int64) * seq_stride + (head * head_stride).to(tl.int64)
    return (head * head_stride + start // BLOCK + seq).to(tl.int64)


@jit
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


@jit
def _sequence_k_scale(k_sum_ptr, k_max_ptr, k_min_ptr, stats, length, QMAX: tl.constexpr):
    """One scale for a whole sequence's smoothed K of one head: max over channels and tokens of |k - mean|,
    from the column sum, max and min, over QMAX; and the mean itself."""
    k_mean = tl.math.div_rn(tl.load(k_sum_ptr + stats), length.to(tl.float32))
    spread = tl.maximum(tl.load(k_max_ptr + stats) - k_mean, k_mean - tl.load(k_min_ptr + stats))
    return tl.math.div_rn(tl.maximum(tl.max(spread, 0), _TINY_SCALE), QMAX), k_mean


@jit
def _sage_quantize_kernel(q_ptr, k_ptr, v_ptr, k_sum_ptr, k_max_ptr, k_min_ptr, v_amax_ptr, cu_q_ptr, cu_kv_ptr,
                          q_out_ptr, q_scale_ptr, k_out_ptr, k_scale_ptr, v_out_ptr, v_scale_ptr, q_dot_k_mean_ptr,
                          stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                          stride_q_out_t, stride_q_out_h, stride_k_out_t, stride_k_out_h, v_out_stride_0,
                          v_out_stride_1, q_scale_head_stride, q_scale_seq_stride, k_scale_head_stride,
                          k_scale_seq_stride, q_dot_k_mean_stride, q_chunks, heads_q, heads_kv,
                          QMAX: tl.constexpr, QK_INT8: tl.constexpr, Q_BLOCK: tl.constexpr,
                          K_BLOCK: tl.constexpr, SCALES_BY_SEQUENCE: tl.constexpr, V_TRANSPOSED: tl.constexpr,
                          V_FMHA_V2_ORDER: tl.constexpr, Q_PADDED_TO_KV: tl.constexpr, Q_DOT_K_MEAN: tl.constexpr,
                          TOKENS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One pass over Q, K, V: programs [0, q_chunks) quantize TOKENS query rows of one head, the rest quantize
    TOKENS key/value rows of one kv head (K smoothed by k_sum / length; V by v_amax / 448).
    Q_PADDED_TO_KV: query rows are written from the sequence's first key row up to its key length, zeros past
    its queries (:class:`QuantizeTargets`). Q_DOT_K_MEAN: Q programs also store each query row's dot product with
    its K mean (the mean the K programs subtract).

    K_BLOCK 0: one K scale per sequence and head (from the K range statistics), folded into Q's block scales;
    no K scales are stored. V_TRANSPOSED: V goes to the attention kernel's ``[Hkv, D, columns]`` layout (strides
    0/1: head/channel), keys permuted within 16-key groups when V_FMHA_V2_ORDER (:class:`QuantizeTargets`), else
    to ``[tokens, Hkv, D]`` (strides 0/1: token/head)."""
    chunk, head, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    dims = tl.arange(0, HEAD_DIM)
    if chunk < q_chunks:
        start = tl.load(cu_q_ptr + seq)
        length = tl.load(cu_q_ptr + seq + 1) - start
        if Q_PADDED_TO_KV:
            out_start = tl.load(cu_kv_ptr + seq)
            out_length = tl.load(cu_kv_ptr + seq + 1) - out_start
        else:
            out_start, out_length = start, length
        if chunk * TOKENS >= out_length or head >= heads_q:
            return
        tokens = chunk * TOKENS + tl.arange(0, TOKENS)
        rows = (start + tokens).to(tl.int64)[:, None]
        # rows past the queries load as 0: the zero padding (and a partial last block's fill)
        q = tl.load(q_ptr + rows * stride_qt + head * stride_qh + dims[None, :], mask=(tokens < length)[:, None],
                    other=0.0).to(tl.float32)
        kv_head = head // (heads_q // heads_kv)
        kv_length = tl.load(cu_kv_ptr + seq + 1) - tl.load(cu_kv_ptr + seq)
        k_stats = (seq * heads_kv + kv_head) * HEAD_DIM + dims
        if K_BLOCK == 0:
            k_scale, _ = _sequence_k_scale(k_sum_ptr, k_max_ptr, k_min_ptr, k_stats, kv_length, QMAX)
        else:
            k_scale = 1.0
        if Q_DOT_K_MEAN:
            k_mean = tl.math.div_rn(tl.load(k_sum_ptr + k_stats), kv_length.to(tl.float32))
            tl.store(q_dot_k_mean_ptr + (start + tokens).to(tl.int64) * q_dot_k_mean_stride + head,
                     tl.sum(q * k_mean[None, :], 1), mask=tokens < length)
        _store_token_blocks(q, q_out_ptr, q_scale_ptr, stride_q_out_t, head * stride_q_out_h,
                            _block_scale_offset(seq, out_start, head, q_scale_head_stride, q_scale_seq_stride,
                                                Q_BLOCK, SCALES_BY_SEQUENCE),
                            k_scale, out_start, chunk * TOKENS, out_length, QMAX, QK_INT8, Q_BLOCK, TOKENS, HEAD_DIM)
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


@jit
def _fmha_v2_v_order(v, TOKENS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """``v [TOKENS, HEAD_DIM]`` -> the same values with keys and channels in FMHAv2's V order
    (:class:`QuantizeTargets`): within each 16-key group key ``8·h + 2·a + e`` moves to ``4·a + 2·h + e``, within
    each 16-channel group channel ``2·p + e`` to ``8·e + p``."""
    v = tl.permute(tl.reshape(v, (TOKENS // 16, 2, 4, 2, HEAD_DIM)), (0, 2, 1, 3, 4))
    v = tl.permute(tl.reshape(v, (TOKENS, HEAD_DIM // 16, 8, 2)), (0, 1, 3, 2))
    return tl.reshape(v, (TOKENS, HEAD_DIM))


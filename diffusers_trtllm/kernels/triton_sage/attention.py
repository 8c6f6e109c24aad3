"""The Triton SAGE attention kernel: one program attends ``block_m`` query rows of one head of one sequence to all
of that sequence's keys, over the quantizer's outputs (:mod:`.quantize`).

Q·Kᵀ runs on the tensor cores in int8 (int32 accumulation, exact) or fp8 (sm_90's fp8 accumulator is not fp32;
``AttentionLaunch.fp8_qk_chunk`` says how often it adds in fp32); P is quantized to fp8 as ``P · 448`` and P·V
runs in fp8 with fp32 accumulation across KV tiles; row sums come from unquantized P. Skip-Softmax is decided in
the same kernel per kernel tile: a KV tile is skipped for a query tile when every row has
``exp(tile_max - running_max) < λ`` with ``λ_i = skip_factor / kv_len_i``, and a skipped tile leaves the running
max, row sum and accumulator alone. How tiles and schedules are chosen: :mod:`.launch`.

A *tile map* carries skip decisions from one call to the next (a denoising step to the following one): an int32
tensor ``[B, Hq, q_tiles, kv_words]``, ``q_tiles = ceil(max_seqlen_q / tile_q)``, ``kv_words =
ceil(ceil(max_seqlen_kv / tile_kv) / 32)`` for the skip tile ``(tile_q, tile_kv)``; bit ``j % 32`` of word ``[b, h,
i, j // 32]`` set means KV tile ``j`` is skipped for query tile ``i`` of query head ``h`` of sequence ``b`` (tiles
counted from each sequence's first row; bits past a sequence's tiles are 0). A tile set on entry is *skipped by
reuse*: not loaded, no Q·Kᵀ, no exp, no P·V, never in the running max or the row sum. The others are computed and
tested as without a map, and on exit the map holds every tile skipped in the call, by reuse or by the test.
"""

from __future__ import annotations  # keeps Triton's "tl.constexpr" annotations unevaluated when Triton is absent

import math
import os

import torch

from ..numerics import HEAD_DIM, P_SCALE, TILE_MAP_BITS, head_dim_mismatch, tile_map_shape
from ._triton import constexpr, jit, jit_not_specializing, tl, triton
from .launch import DENSE_LAUNCH, AttentionLaunch, skip_launch, skip_sample_rule
from .quantize import _V_TOKEN_ALIGN, SageQuantized, sage_quantize

LOG2E = 1.4426950408889634

_LOG2_P_SCALE = constexpr(math.log2(P_SCALE))
_LN2 = constexpr(math.log(2.0))
_MAP_WORD_BITS = constexpr(TILE_MAP_BITS)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_sage_unavailable_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                                   skip_tile: tuple[int, int] | None = None) -> str | None:
    """``None`` when :func:`triton_sage_attention` can run on these tensors here, else a sentence saying why.

    Needs: Triton importable; a CUDA device of compute capability 8.9 or newer (fp8 tensor cores; tuned and
    tested on sm_90), or ``TRITON_INTERPRET=1`` for CPU tensors; non-causal; head_dim 128; bf16/fp16 q, k, v; a skip
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


def _barrier_vote(launch: AttentionLaunch, device: torch.device) -> bool:
    """Whether the branch-free schedule may decide with :func:`_all_rows_by_barrier`: compiled for sm_90, where a
    warpgroup's 64-row tile gives each thread two rows (Hopper's wgmma layout)."""
    return (launch.block_m == 64 and launch.num_warps == 4 and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] == 9)


def sage_attention_quantized(quantized: SageQuantized, cu_seqlens_q: torch.Tensor, cu_seqlens_kv: torch.Tensor,
                             seqlens_q: tuple[int, ...], seqlens_kv: tuple[int, ...], scale: float, *,
                             out_dtype: torch.dtype = torch.bfloat16, skip_factor: float = 0.0,
                             skip_tile: tuple[int, int] = (128, 128), count_skips: bool = False,
                             skip_sample: tuple[int, float] | None = None, launch: AttentionLaunch | None = None,
                             tile_map: torch.Tensor | None = None, reused: torch.Tensor | None = None,
                             lse: torch.Tensor | None = None):
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

    ``tile_map``: a tile map of ``skip_tile`` (module docstring), updated in place; its tiles are skipped by
    reuse in every launch (also without ``skip_factor``: then nothing is tested), and the sampled rule counts the
    sampled tiles' reused skips as skipped. ``skipped`` counts the tiles skipped by the test only; to ``reused``
    (optional, a 0-dim int32 tensor on the device) the kernel adds the count of those skipped by reuse.
    ``lse``: float32 ``[Tq, Hq]`` (rows contiguous) to receive each row's log-sum-exp, natural log of the sum of
    exp(scale · scores) over the keys it kept, K's smoothing mean added back (needs ``quantized.q_dot_k_mean``);
    ``-inf`` for a row that kept no key.
    """
    skips = skip_factor > 0.0
    q = quantized.q
    batch, heads_q, heads_kv = len(seqlens_q), q.shape[1], quantized.k.shape[1]
    if launch is None and skips:
        launch = skip_launch(skip_tile, skip_sample or skip_sample_rule(seqlens_q, heads_q, skip_tile[0], q.device))
    elif launch is None and tile_map is not None:
        launch = skip_launch(skip_tile, (0, 0.0))  # the map's tile; nothing tested, nothing sampled
    elif launch is None:
        launch = DENSE_LAUNCH
    if (skips or tile_map is not None) and (launch.block_m, launch.block_n) != tuple(skip_tile):
        raise ValueError(f"skip decisions are made per kernel tile: launch tile {launch.block_m}x{launch.block_n} "
                         f"must equal the skip tile {skip_tile}")
    _check_outputs(quantized, seqlens_q, seqlens_kv, skip_tile, tile_map, reused, lse)
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    skipped = torch.zeros((), dtype=torch.int32, device=q.device)
    query_tiles = -(-max(seqlens_q) // launch.block_m)
    sample_every = launch.skip_sample_every if skips else 0
    # per (sequence, head): KV tiles the sampled query tiles skipped, and all they visited (without sampling the
    # kernel never reads it: any int32 tensor will do; likewise for the other optional tensors)
    sample_counts = torch.zeros(batch, heads_q, 2, dtype=torch.int32, device=q.device) if sample_every else skipped
    tile_map_arg = skipped if tile_map is None else tile_map
    row_stats = [quantized.q_scale if x is None else x for x in (lse, quantized.q_dot_k_mean)]
    args = (
        quantized.q, quantized.k, quantized.v_t, quantized.q_scale, quantized.k_scale, quantized.v_scale,
        out, skipped, sample_counts, cu_seqlens_q, cu_seqlens_kv,
        tile_map_arg, skipped if reused is None else reused, *row_stats,
        quantized.q.stride(0), quantized.q.stride(1), quantized.k.stride(0), quantized.k.stride(1),
        quantized.v_t.stride(0), quantized.v_t.stride(1), out.stride(0), out.stride(1),
        quantized.q_scale.stride(0), quantized.k_scale.stride(0),
        *(tile_map_arg.stride(d) if tile_map is not None else 0 for d in range(3)),
        *(x.stride(0) for x in row_stats),
        quantized.q_block.bit_length() - 1, quantized.k_block.bit_length() - 1,
        scale * LOG2E, skip_factor, heads_q // heads_kv, heads_kv, sample_every, round(launch.skip_pays_from * 100))
    constants = dict(
        QK_INT8=quantized.q.dtype == torch.int8,
        HEAD_DIM=HEAD_DIM, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, FP8_QK_CHUNK=launch.fp8_qk_chunk,
        REUSE=tile_map is not None, COUNT_REUSED=reused is not None, RETURN_LSE=lse is not None,
        BARRIER_VOTE=_barrier_vote(launch, q.device), num_warps=launch.num_warps, num_stages=launch.num_stages)
    # Dense programs leave the skip schedule out of the compiled kernel's key: a dense launch and the heads of a
    # skipping launch of the same tile that do not pay run one binary, so they run at the same speed (compiled
    # apart, the same loop's speed varies with how Triton lays out each binary).
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


def _check_outputs(quantized: SageQuantized, seqlens_q, seqlens_kv, skip_tile, tile_map, reused, lse) -> None:
    """Raise ``ValueError`` unless the optional tensors the kernel writes have the shapes, dtypes, layouts and
    device it writes them in (host metadata only: no sync)."""
    q = quantized.q
    wanted = {"tile_map": (tile_map, torch.int32, tile_map_shape(seqlens_q, seqlens_kv, q.shape[1], skip_tile)),
              "reused": (reused, torch.int32, ()), "lse": (lse, torch.float32, tuple(q.shape[:2]))}
    for name, (x, dtype, shape) in wanted.items():
        if x is not None and (x.dtype != dtype or tuple(x.shape) != shape or x.device != q.device
                              or (x.dim() and x.stride(-1) != 1)):
            raise ValueError(f"{name} must be {dtype} of shape {shape} on {q.device} with a contiguous last "
                             f"dimension; got {x.dtype} {tuple(x.shape)} on {x.device}, strides {x.stride()}")
    if lse is not None and quantized.q_dot_k_mean is None:
        raise ValueError("the log-sum-exp adds K's smoothing mean back: quantize with sage_quantize(..., "
                         "q_dot_k_mean=True)")


def triton_sage_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                          cu_seqlens_kv: torch.Tensor, seqlens_q: tuple[int, ...], seqlens_kv: tuple[int, ...],
                          scale: float, *, dtype_qk: str = "int8", q_block: int = 1, k_block: int = 16,
                          skip_factor: float = 0.0, skip_tile: tuple[int, int] = (128, 128),
                          count_skips: bool = False, skip_sample: tuple[int, float] | None = None,
                          tile_map: torch.Tensor | None = None, reused: torch.Tensor | None = None,
                          lse: torch.Tensor | None = None):
    """SAGE attention (with Skip-Softmax when ``skip_factor > 0``) on a packed batch.

    ``q``: ``[Tq, Hq, 128]``, ``k``/``v``: ``[Tk, Hkv, 128]``, bf16 or fp16, ragged (FlashInfer layout, sequence
    ``i`` owning rows ``cu_seqlens[i]:cu_seqlens[i + 1]``; ``cu_seqlens_*`` ``[B + 1]`` int32 on the tensors'
    device, ``seqlens_*`` the same lengths as host ints), ``Hq % Hkv == 0`` (GQA). ``dtype_qk``: ``"int8"`` or
    ``"fp8_e4m3"``; ``q_block`` / ``k_block``: 1, 4 or 16 tokens. Returns ``(out [Tq, Hq, 128] in q's dtype,
    skipped, total)`` as :func:`sage_attention_quantized`, which also takes ``skip_sample``, ``tile_map``,
    ``reused`` and ``lse`` (the quantizer then also computes what the log-sum-exp needs). GPUs: sm_89 and
    newer with Triton (tuned on sm_90). Raises ``ValueError`` with the reason when
    :func:`triton_sage_unavailable_reason` is not ``None``.
    """
    deciding = skip_factor > 0.0 or tile_map is not None
    reason = triton_sage_unavailable_reason(q, k, v, skip_tile=skip_tile if deciding else None)
    if reason is not None:
        raise ValueError(reason)
    quantized = sage_quantize(q, k, v, cu_seqlens_q, cu_seqlens_kv, max(seqlens_q), max(seqlens_kv),
                              dtype_qk=dtype_qk, q_block=q_block, k_block=k_block, q_dot_k_mean=lse is not None)
    return sage_attention_quantized(quantized, cu_seqlens_q, cu_seqlens_kv, seqlens_q, seqlens_kv, scale,
                                    out_dtype=q.dtype, skip_factor=skip_factor, skip_tile=skip_tile,
                                    count_skips=count_skips, skip_sample=skip_sample, tile_map=tile_map,
                                    reused=reused, lse=lse)



@jit
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
        # not software-pipeline the load either way, and loading it before the skip test was slower at every
        # sparsity (benchmarks/RESULTS.md).
        m_i, l_i, acc, _ = _fold_scores(t, q_scale, tile_max, m_i, l_i, acc, v_base, cols, v_len, negligible,
                                        MASKED, False, BARRIER_VOTE)
    return m_i, l_i, acc, skipped


@jit
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


@jit
def _attend_kv_tile_bits(q, q_scale, row_invalid, m_i, l_i, acc, skipped, k_base, stride_kt, k_scale_base,
                         k_block_shift, v_base, first_tile, todo, kv_len, v_len, log2_lambda,
                         QK_INT8: tl.constexpr, FP8_QK_CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_N: tl.constexpr, SKIP: tl.constexpr, BRANCH_FREE: tl.constexpr,
                         BARRIER_VOTE: tl.constexpr):
    """:func:`_attend_kv_tile` over the full tiles ``first_tile + b`` for the set bits ``b`` of ``todo`` (uint32),
    in ascending order. One loop of one iteration per tile attended, each tile's index from the lowest bit left:
    no branch around the loads (Triton software-pipelines them) and no iteration for a tile left out. Returns the
    state and the bits of the tiles the test skipped (per row, every element the same)."""
    test_bits = tl.zeros_like(skipped).to(tl.uint32)
    for _ in range(_popcount(todo)):
        lowest = todo & (0 - todo)
        todo = todo ^ lowest
        skipped_before = skipped
        m_i, l_i, acc, skipped = _attend_kv_tile(
            q, q_scale, row_invalid, m_i, l_i, acc, skipped, k_base, stride_kt, k_scale_base, k_block_shift,
            v_base, (first_tile + _bit_index(lowest)) * BLOCK_N, kv_len, v_len, log2_lambda,
            QK_INT8, FP8_QK_CHUNK, HEAD_DIM, BLOCK_N, SKIP, False, BRANCH_FREE, BARRIER_VOTE)
        test_bits = test_bits | ((skipped - skipped_before).to(tl.uint32) * lowest)
    return m_i, l_i, acc, skipped, test_bits


@jit
def _attend_kv_tiles_by_map(q, q_scale, row_invalid, m_i, l_i, acc, skipped, k_base, stride_kt, k_scale_base,
                            k_block_shift, v_base, map_row, kv_len, v_len, log2_lambda,
                            QK_INT8: tl.constexpr, FP8_QK_CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr,
                            BLOCK_N: tl.constexpr, SKIP: tl.constexpr, BRANCH_FREE_PERCENT: tl.constexpr,
                            BARRIER_VOTE: tl.constexpr):
    """Every KV tile of one query tile that its tile-map row ``map_row`` (int32 words) does not skip, word by word:
    each word read once; with ``SKIP`` written back once with the tiles the test skipped added. Each word's tiles
    are one run of one schedule (as :func:`_sage_attention_kernel`'s runs): branch-free after a word whose
    tested tiles were skipped less than BRANCH_FREE_PERCENT % of the time. Returns the state and the count of
    tiles skipped by reuse."""
    full_tiles = kv_len // BLOCK_N
    tiles = (kv_len + BLOCK_N - 1) // BLOCK_N
    reused = tl.zeros((), tl.int32)
    branch_free = tl.full((), BRANCH_FREE_PERCENT > 0, tl.int1)  # the first tiles are seldom skipped
    for word_index in range(0, (tiles + _MAP_WORD_BITS - 1) // _MAP_WORD_BITS):
        word = tl.load(map_row + word_index).to(tl.uint32, bitcast=True)
        first = word_index * _MAP_WORD_BITS
        reused += _popcount(word & _low_bits(tiles - first))
        todo = (word ^ 0xFFFFFFFF) & _low_bits(full_tiles - first)  # (~ on uint32 fails in the interpreter)
        if BRANCH_FREE_PERCENT > 0 and branch_free:  # (a constexpr 0 compiles the branching loop only)
            m_i, l_i, acc, skipped, test_bits = _attend_kv_tile_bits(
                q, q_scale, row_invalid, m_i, l_i, acc, skipped, k_base, stride_kt, k_scale_base, k_block_shift,
                v_base, first, todo, kv_len, v_len, log2_lambda,
                QK_INT8, FP8_QK_CHUNK, HEAD_DIM, BLOCK_N, SKIP, True, BARRIER_VOTE)
        else:
            m_i, l_i, acc, skipped, test_bits = _attend_kv_tile_bits(
                q, q_scale, row_invalid, m_i, l_i, acc, skipped, k_base, stride_kt, k_scale_base, k_block_shift,
                v_base, first, todo, kv_len, v_len, log2_lambda,
                QK_INT8, FP8_QK_CHUNK, HEAD_DIM, BLOCK_N, SKIP, False, BARRIER_VOTE)
        partial = full_tiles - first  # the partial last tile's bit, when it is in this word
        if (tiles > full_tiles) & (partial < _MAP_WORD_BITS) & (((word >> partial) & 1) == 0):
            skipped_before = skipped
            m_i, l_i, acc, skipped = _attend_kv_tile(
                q, q_scale, row_invalid, m_i, l_i, acc, skipped, k_base, stride_kt, k_scale_base, k_block_shift,
                v_base, full_tiles * BLOCK_N, kv_len, v_len, log2_lambda,
                QK_INT8, FP8_QK_CHUNK, HEAD_DIM, BLOCK_N, SKIP, True, False, BARRIER_VOTE)
            test_bits = test_bits | ((skipped - skipped_before).to(tl.uint32) << partial)
        if SKIP:
            new_bits = tl.max(test_bits, 0)
            tl.store(map_row + word_index, (word | new_bits).to(tl.int32, bitcast=True))
            tested = _popcount(todo)
            if BRANCH_FREE_PERCENT > 0:
                branch_free = tl.where(tested > 0, _popcount(new_bits) * 100 < BRANCH_FREE_PERCENT * tested,
                                       branch_free)
    return m_i, l_i, acc, skipped, reused


@jit
def _popcount(bits):
    """Set bits of uint32 ``bits`` (SWAR), as int32."""
    bits = bits - ((bits >> 1) & 0x55555555)
    bits = (bits & 0x33333333) + ((bits >> 2) & 0x33333333)
    bits = (bits + (bits >> 4)) & 0x0F0F0F0F
    return ((bits * 0x01010101) >> 24).to(tl.int32)


@jit
def _bit_index(power_of_two):
    """``b`` for uint32 ``2**b``: the exponent of its float32 value (exact for a power of two)."""
    return (power_of_two.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127


@jit
def _low_bits(count):
    """uint32 with its lowest ``count`` bits set, ``count`` clamped to [0, 32]."""
    all_bits = tl.full((), 0xFFFFFFFF, tl.uint32)
    # PTX clamps a shift of 32 or more to 32 (all bits out); the select covers the interpreter too
    return tl.where(count >= _MAP_WORD_BITS, all_bits, (all_bits << tl.maximum(count, 0)) ^ all_bits)


@jit
def _all_rows(negligible):
    """The tile-wide Skip-Softmax decision: every row's test passed."""
    return tl.min(negligible.to(tl.int32), 0) == 1


@jit
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


@jit
def _all_rows_by_barrier(negligible):
    """:func:`_all_rows` as a ``[BLOCK_M]`` vector (every element the decision), in one ``bar.red.and`` across
    the program's threads instead of a reduction through shared memory, the larger part of the branch-free
    schedule's cost over dense. Needs every thread to hold exactly two rows, so that one call
    sees all of its rows: a 64-row tile of one warpgroup on sm_90 (:func:`_barrier_vote`)."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred a, b; setp.ne.b32 a, $2, 0; setp.ne.b32 b, $3, 0; and.pred a, a, b; "
        "bar.red.and.pred b, 0, a; selp.b32 $0, 1, 0, b; mov.b32 $1, $0; }",
        "=r,=r,r,r", [negligible.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=2) != 0


# the sampling settings are plain arguments, so that a dense launch and a sampling launch's dense programs share
# one binary
@jit_not_specializing("sample_every", "pays_from_percent")
def _sage_attention_kernel(q_ptr, k_ptr, v_t_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr, out_ptr, skipped_ptr,
                           sample_counts_ptr, cu_q_ptr, cu_kv_ptr, tile_map_ptr, reused_ptr, lse_ptr,
                           q_dot_k_mean_ptr,
                           stride_qt, stride_qh, stride_kt, stride_kh, v_t_head_stride, v_t_dim_stride,
                           stride_ot, stride_oh, q_scale_stride, k_scale_stride,
                           map_seq_stride, map_head_stride, map_tile_stride, lse_stride, q_dot_k_mean_stride,
                           q_block_shift, k_block_shift, score_scale, skip_factor, group_size, heads_kv,
                           sample_every, pays_from_percent,
                           QK_INT8: tl.constexpr,
                           HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           FP8_QK_CHUNK: tl.constexpr, SKIP: tl.constexpr, COUNT_SKIPS: tl.constexpr,
                           SKIP_CHUNK: tl.constexpr, BRANCH_FREE_PERCENT: tl.constexpr, SAMPLE_PASS: tl.constexpr,
                           REUSE: tl.constexpr, COUNT_REUSED: tl.constexpr, RETURN_LSE: tl.constexpr,
                           BARRIER_VOTE: tl.constexpr):
    """One program: BLOCK_M query rows of one head of one sequence against all of that sequence's keys.

    Scores live in the log2 domain (``score_scale`` = softmax scale · log2 e), so the skip test
    ``exp(tile_max - m) < λ`` becomes ``tile_max₂ - m₂ < log2 λ``.

    ``sample_every`` > 0 (AttentionLaunch.skip_sample_every): the ``SAMPLE_PASS`` launch attends every
    sample_every-th query tile, skipping, and adds its skipped and visited KV tiles to ``sample_counts`` ``[B, H,
    2]``. Then the other query tiles: with ``SKIP``, of the (sequence, head)s whose sample skipped at least
    pays_from_percent % of its tiles (tiles skipped by reuse included); without, of the others.

    ``REUSE``: the KV tiles of the program's row of the tile map (int32 ``[B, Hq, q_tiles, kv_words]``, module
    docstring) are skipped by reuse and the row gets the tiles the test skipped (:func:`_attend_kv_tiles_by_map`);
    ``COUNT_REUSED`` adds their count to ``reused_ptr``. ``RETURN_LSE``: each row's natural log-sum-exp, the
    smoothing shift ``scale · q_dot_k_mean`` added back, to ``lse_ptr`` (float32 ``[Tq, Hq]``).
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
    reused = tl.zeros((), tl.int32)
    if REUSE:
        map_row = tile_map_ptr + seq * map_seq_stride + head * map_head_stride + tile * map_tile_stride
        m_i, l_i, acc, skipped, reused = _attend_kv_tiles_by_map(
            q, q_scale, row_invalid, m_i, l_i, acc, skipped, k_base, stride_kt, k_scale_base, k_block_shift,
            v_base, map_row, kv_len, v_len, log2_lambda,
            QK_INT8, FP8_QK_CHUNK, HEAD_DIM, BLOCK_N, SKIP, BRANCH_FREE_PERCENT, BARRIER_VOTE)
    elif not SKIP:
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
    if not REUSE and full_end < kv_len:  # (the map's walk attends the partial tile itself)
        m_i, l_i, acc, skipped = _attend_kv_tile(
            q, q_scale, row_invalid, m_i, l_i, acc, skipped, k_base, stride_kt,
            k_scale_base, k_block_shift, v_base, full_end, kv_len, v_len, log2_lambda,
            QK_INT8, FP8_QK_CHUNK, HEAD_DIM, BLOCK_N, SKIP, True, False, BARRIER_VOTE)

    # acc and l_i both carry the factor 448 of P's fp8 encoding, which cancels here.
    v_scale = tl.load(v_scale_ptr + (seq * heads_kv + kv_head) * HEAD_DIM + dims)
    out = acc / l_i[:, None] * v_scale[None, :]
    tl.store(out_ptr + (q_start + rows).to(tl.int64)[:, None] * stride_ot + head * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
    if RETURN_LSE:
        stat_rows = (q_start + rows).to(tl.int64)
        shift = tl.load(q_dot_k_mean_ptr + stat_rows * q_dot_k_mean_stride + head, mask=row_valid, other=0.0)
        # m_i and the row sum are in the log2 domain of the scaled scores, the sum times P's factor 448; smoothing
        # lowered every score by scale · q · mean(K), added back
        lse = _LN2 * (m_i + tl.log2(l_i) - _LOG2_P_SCALE + score_scale * shift)
        tl.store(lse_ptr + stat_rows * lse_stride + head, tl.where(l_i > 0.0, lse, float("-inf")), mask=row_valid)
    if COUNT_SKIPS:
        tl.atomic_add(skipped_ptr, tl.max(skipped, 0))
    if COUNT_REUSED:
        tl.atomic_add(reused_ptr, reused)
    if SKIP and SAMPLE_PASS:
        tl.atomic_add(sample_counts, tl.max(skipped, 0) + reused)
        tl.atomic_add(sample_counts + 1, (kv_len + BLOCK_N - 1) // BLOCK_N)

"""``TORCH_REFERENCE``: tiled online-softmax attention with Skip-Softmax and SAGE, in PyTorch, on any device.

The ground truth for tests and calibration. It follows the kernels' tile structure: queries in tiles of
``tile[0]`` rows, keys in tiles of ``tile[1]`` columns, a running max / row sum / accumulator per query row.
A KV tile is skipped for a query tile (no exp, no P·V, no update of the running max) when for every row r of
the query tile ``exp(tile_max_r - running_max_r) < λ`` (scores already scaled), λ = skip_factor / kv_len. The
first KV tile is never skipped (the running max starts at -inf). Memory is bounded by
``query_chunk × tile[1] × heads``, never S × S, so 32k-token problems run on a CPU.

Computation runs in float32 (float64 when the inputs are float64); the output is cast back to q's dtype.

SAGE follows the semantics of the kernel ``TRTLLM_ATTN`` runs for the plan's quantization on the tensors' GPU
(:func:`~.trtllm.sage_semantics`: per-sequence or batch-wide K mean and V scales, block sizes, P's fp8 scale), so
the reference and the kernel agree to the output rounding; on a CPU, this package's Triton kernel's semantics.
Skip decisions are per ``plan.tile`` (per the SAGE kernel's own tile where it fixes one,
``SageSemantics.skip_tile``), against the running max at the start of the kernel's online-softmax step (the Hopper
FMHAv2 SAGE kernel decides per 64 × 128 within 256-key steps: that tile and step reproduce it exactly). For
kernels whose fp8 sums stay in sm_90's tensor-core accumulator (``SageSemantics.fp8_accumulator_bits``), the
reference sums as those tensor cores do (:func:`fp8_gmma_matmul`): fp8 P turns score differences of that
accumulator's rounding into whole fp8 steps of P, so exact sums would leave the kernel well above the bf16 floor.
The emulation materializes every product, far slower than exact sums: a reference for tests at small shapes,
not for whole videos.
"""

from __future__ import annotations

import math

import torch

from ..config import TORCH_REFERENCE
from ..kernels.numerics import bits_set
from ..quant import SageSemantics, batch_statistics, quantize_p, quantize_sequence
from .base import (KernelPlan, KernelResult, VarlenQKV, pack_tile_map, register_backend, tile_map_for,
                   unpack_tile_map)
from .trtllm import sage_semantics

QUERY_CHUNK = 2048  # query rows processed together; a multiple of every supported tile height
GMMA_K = 32  # products one sm_90 fp8 tensor-core instruction adds into its accumulator
GMMA_ROWS = 256  # rows emulated together: bounds the [rows, 32, columns] products in memory


def mask_future_keys(scores: torch.Tensor, q_start: int, k_start: int, sq: int, skv: int) -> torch.Tensor:
    """Causal masking of a ``[..., rows, cols]`` block of scores whose first row is query ``q_start`` and first
    column key ``k_start``: -inf where the key lies after the query, the last query aligned with the last key."""
    qpos = torch.arange(q_start, q_start + scores.shape[-2], device=scores.device)[:, None] + (skv - sq)
    kpos = torch.arange(k_start, k_start + scores.shape[-1], device=scores.device)[None, :]
    return scores.masked_fill(kpos > qpos, -math.inf)


def step_keys(kv_step: int | None, tile_keys: int) -> int:
    """Keys per online-softmax step: ``kv_step``, or one tile of ``tile_keys`` when None. Raises ``ValueError``
    unless it is a positive multiple of the tile."""
    step = tile_keys if kv_step is None else kv_step
    if step <= 0:
        raise ValueError(f"kv_step={kv_step!r} is not positive")
    if step % tile_keys:
        raise ValueError(f"kv_step={kv_step!r} is not a multiple of the tile's {tile_keys} keys")
    return step


def aligned_sum(terms: torch.Tensor, bits: int) -> torch.Tensor:
    """Sum over ``terms``' second-to-last dimension as one sm_90 fp8 tensor-core instruction adds: every term
    truncated toward zero to a multiple of ``2^(e - bits)``, ``2^e`` the power of two just above the largest
    magnitude among them. Exact in float32 (a few dozen terms on one grid of ``bits`` bits)."""
    exponent = torch.frexp(terms.abs().amax(dim=-2, keepdim=True)).exponent
    step = torch.ldexp(torch.ones_like(exponent, dtype=terms.dtype), exponent - bits)
    return (torch.trunc(terms / step) * step).sum(dim=-2)


def fp8_gmma_matmul(a: torch.Tensor, b: torch.Tensor, bits: int, acc: torch.Tensor | None = None,
                    active: torch.Tensor | None = None) -> torch.Tensor:
    """``acc + a @ b`` (``a [..., M, K]``, ``b [..., K, N]``, fp8 values) summed as sm_90's fp8 tensor cores do:
    K in groups of :data:`GMMA_K` from the first column, each group's products and the running accumulator
    added by :func:`aligned_sum`. ``acc`` ``[..., M, N]``: the accumulator to continue (None: zeros).
    ``active`` ``[..., M, ceil(K / GMMA_K)]`` bool: groups a row issues (a skipped tile issues none and leaves
    its rows' accumulator untouched)."""
    m, k = a.shape[-2:]
    if acc is None:
        acc = torch.zeros(*a.shape[:-1], b.shape[-1], dtype=a.dtype, device=a.device)
    out = []
    for r in range(0, m, GMMA_ROWS):
        rows = acc[..., r:r + GMMA_ROWS, :]
        for g, c in enumerate(range(0, k, GMMA_K)):
            products = a[..., r:r + GMMA_ROWS, c:c + GMMA_K, None] * b[..., None, c:c + GMMA_K, :]
            summed = aligned_sum(torch.cat([rows[..., None, :], products], dim=-2), bits)
            rows = summed if active is None else torch.where(active[..., r:r + GMMA_ROWS, g, None], summed, rows)
        out.append(rows)
    return torch.cat(out, dim=-2)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, causal: bool = False,
                        skip_lambda: float = 0.0, quant: SageSemantics | None = None,
                        tile: tuple[int, int] = (128, 128), kv_step: int | None = None,
                        query_chunk: int = QUERY_CHUNK, k_mean: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None, with_lse: bool = False,
                        tile_map: torch.Tensor | None = None) -> tuple:
    """Attention of one sequence. q ``[Sq, Hq, D]``, k/v ``[Skv, Hkv, D]`` (GQA when Hkv < Hq).

    ``skip_lambda`` is λ (0 = dense); ``quant`` the :class:`~diffusers_trtllm.quant.SageSemantics` of a SAGE
    kernel, or None. ``k_mean`` / ``v_scale`` ``[Hkv, D]``: batch-wide statistics replacing the sequence's own
    (:func:`~diffusers_trtllm.quant.batch_statistics`). ``kv_step``: keys per online-softmax step (a multiple of
    ``tile[1]``, default ``tile[1]``); every tile of a step is decided against the running max at the step's
    start (the FMHAv2 SAGE kernel decides per 128-key half of its 256-key step). Returns ``(out [Sq, Hq, D] in
    q's dtype, skipped tiles, total tiles)``; tiles count (head, query tile, KV tile) triples. ``causal`` aligns
    the last query with the last key (bottom-right, as FlashInfer's kernels and ``TORCH_SDPA``); a query that
    sees no key gets 0.

    With ``quant.skip_sample`` (the Triton kernel's rule), a head's query tiles other than every ``every``-th skip
    only if those sampled tiles skipped at least ``pays_from`` of their KV tiles, and are attended dense otherwise.

    ``with_lse``: also return the log-sum-exp of each query row's scaled scores over the keys it kept (float32 or
    float64 ``[Sq, Hq]``, ``-inf`` for a row that sees no key): what merges partial results over split keys
    (ring attention). With SAGE it is of the scores the kernel computes, K's smoothing mean added back (smoothing
    shifts each row's scores by ``scale · q · mean(K)``, which differs between key splits).

    ``tile_map`` (int32 ``[Hq, ≥ query tiles, words]``, :func:`~.base.tile_map_for`'s layout for this sequence):
    Skip-Softmax reuse. A tile whose bit is set is skipped without being computed (its scores enter neither the
    running max nor the sum); the others are tested as above (with ``quant.paired_tiles``, each against the running
    max at the start of its gathered step, :func:`first_of_paired_steps`); on return the map holds every tile
    skipped (updated in place) and the skipped count is of the tiles the test skipped (the reused ones are the bits
    set on entry).
    """
    if quant is not None and quant.q_padded_to_kv and q.shape[0] != k.shape[0]:
        if causal or q.shape[0] > k.shape[0]:
            raise ValueError(f"SageSemantics.q_padded_to_kv pads queries to the keys in non-causal attention; got "
                             f"{q.shape[0]} queries on {k.shape[0]} keys, causal={causal}")
        zeros = q.new_zeros(k.shape[0] - q.shape[0], *q.shape[1:])
        # the padded queries' tiles have map rows of their own, dropped after the call; with paired tiles a query
        # tile past the map's rows reuses every tile, as the kernel's tiles without a map row do
        padded_map = None if tile_map is None else torch.nn.functional.pad(
            tile_map, (0, 0, 0, -(-k.shape[0] // tile[0]) - tile_map.shape[1]), value=-1 if quant.paired_tiles else 0)
        result = reference_attention(torch.cat([q, zeros]), k, v, scale, skip_lambda=skip_lambda, quant=quant,
                                     tile=tile, kv_step=kv_step, query_chunk=query_chunk, k_mean=k_mean,
                                     v_scale=v_scale, with_lse=with_lse, tile_map=padded_map)
        if tile_map is not None:
            tile_map.copy_(padded_map[:, :tile_map.shape[1]])
        return (result[0][:q.shape[0]], *result[1:3]) + ((result[3][:q.shape[0]],) if with_lse else ())
    sample = quant.skip_sample if quant is not None else None
    if skip_lambda == 0.0 or sample is None:
        out, skipped, tiles, lse = _tiled_attention(q, k, v, scale, causal, skip_lambda, quant, tile, kv_step,
                                                    query_chunk, k_mean, v_scale, tile_map)
        result = out, skipped if isinstance(skipped, int) else skipped.sum(), tiles * q.shape[1]
        return result + ((lse,) if with_lse else ())
    if causal:
        raise ValueError("sampled Skip-Softmax (SageSemantics.skip_sample) is defined for non-causal attention only")
    every, pays_from = sample
    # sampled or not, from the shape alone (a mask's nonzero() would be a data-dependent read: tests/test_host_sync.py)
    rows = {True: [], False: []}
    for row in range(q.shape[0]):
        rows[row // tile[0] % every == 0].append(row)
    sampled, others = (torch.tensor(rows[flag], dtype=torch.long, device=q.device) for flag in (True, False))
    # the two sets are whole query tiles in order (a partial last tile ends its set): each keeps its map rows
    q_tiles = -(-q.shape[0] // tile[0])
    tile_ids = {flag: torch.tensor([t for t in range(q_tiles) if (t % every == 0) == flag], dtype=torch.long,
                                   device=q.device) for flag in (True, False)}
    maps = {flag: None if tile_map is None else tile_map.index_select(1, ids) for flag, ids in tile_ids.items()}
    parts = [q.index_select(0, sampled), k, v, scale, causal]
    out_s, skipped_s, tiles_s, lse_s = _tiled_attention(*parts, skip_lambda, quant, tile, kv_step, query_chunk,
                                                        k_mean, v_scale, maps[True])
    # the kernel's integer test: skipped · 100 >= percent · visited, per head; a reused skip counts as skipped
    reused_s = 0 if tile_map is None else tiles_in_map(tile_map.index_select(1, tile_ids[True]))
    pays = (skipped_s + reused_s) * 100 >= round(pays_from * 100) * tiles_s
    parts[0] = q.index_select(0, others)
    out_o, skipped_o, tiles_o, lse_o = _tiled_attention(*parts, torch.where(pays, skip_lambda, 0.0), quant, tile,
                                                        kv_step, query_chunk, k_mean, v_scale, maps[False])
    if tile_map is not None:
        for flag, ids in tile_ids.items():
            tile_map.index_copy_(1, ids, maps[flag])
    out = torch.empty_like(q).index_copy_(0, sampled, out_s).index_copy_(0, others, out_o)
    result = out, (skipped_s + skipped_o).sum(), (tiles_s + tiles_o) * q.shape[1]
    if not with_lse:
        return result
    return result + (lse_s.new_empty(q.shape[:2]).index_copy_(0, sampled, lse_s).index_copy_(0, others, lse_o),)


def first_of_paired_steps(reused: torch.Tensor) -> torch.Tensor:
    """bool ``[H, query tiles, KV tiles]``: where KV tile ``j`` opens a step of the tile-map kernel's gathered
    steps for query tile ``i`` (``SageSemantics.paired_tiles``), given ``reused`` (the map's bits, same shape).
    Query tiles ``2k`` and ``2k + 1`` share steps: the first tile (loaded whatever the map: it starts the
    softmax) and the tiles either computes (not reused by both; a missing partner reuses everything), two to a
    step in key order, so a tile opens a step where an even number of them come before it."""
    heads, q_tiles, kv_tiles = reused.shape
    padded = torch.nn.functional.pad(reused, (0, 0, 0, q_tiles % 2), value=True)
    loaded = ~padded.view(heads, -1, 2, kv_tiles).all(dim=2)  # [H, pairs, KV tiles]
    loaded[..., 0] = True
    before = loaded.cumsum(dim=-1) - loaded.long()
    return (loaded & (before % 2 == 0)).repeat_interleave(2, dim=1)[:, :q_tiles]


def tiles_in_map(tile_map: torch.Tensor) -> torch.Tensor:
    """Set bits per head (int64 ``[H]``) of a sequence's tile map ``[H, query tiles, words]``."""
    return bits_set(tile_map).flatten(1).sum(1)


def _tiled_attention(q, k, v, scale, causal, skip_lambda, quant, tile, kv_step, query_chunk, k_mean, v_scale,
                     tile_map=None):
    """:func:`reference_attention`'s tile loop; ``skip_lambda`` a float or one λ per query head (0: dense);
    ``tile_map`` the sequence's map (reuse; updated in place). Returns (out, tiles the test skipped per head
    ``[H]`` (int 0 when not skipping), tiles per head, lse ``[Sq, H]``)."""
    out_dtype = q.dtype
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    sq, hq, d = q.shape
    skv, hkv = k.shape[:2]
    tq, tk = tile
    # gathered steps: the loop goes a tile at a time, deciding each against its step's running max
    paired = tile_map is not None and quant is not None and quant.paired_tiles
    step = tk if paired else step_keys(kv_step, tk)
    chunk = max(tq, query_chunk // tq * tq)
    q, k, v = (x.to(compute) for x in (q, k, v))
    if hkv != hq:
        k, v = (x.repeat_interleave(hq // hkv, dim=1) for x in (k, v))
        k_mean, v_scale = (None if x is None else x.repeat_interleave(hq // hkv, dim=0) for x in (k_mean, v_scale))
    # SAGE smooths K by its mean, which shifts each row's scores (and its log-sum-exp) by scale · q · mean(K)
    lse_shift = (None if quant is None else
                 scale * (q * (k.mean(dim=0) if k_mean is None else k_mean.to(compute))[None]).sum(-1).transpose(0, 1))
    bits = quant.fp8_accumulator_bits if quant is not None else None
    if bits and tk % GMMA_K:
        raise ValueError(f"tile={tile!r}: emulating fp8 tensor-core sums needs key tiles of whole {GMMA_K}-key "
                         "instructions")
    if quant is not None:
        sage = quantize_sequence(q, k, v, quant, k_mean, v_scale)
        if bits:  # scores = gmma(q_values, k_values) * q_scale * softmax scale * k_scale
            q, k, v, v_scale = sage.q, sage.k, sage.v, sage.v_scale
            q_factor = (sage.q_scale * scale).transpose(0, 1)  # [H, Sq, 1]
            k_factor = sage.k_scale.transpose(0, 1).transpose(1, 2)  # [H, 1, Skv]
        else:
            q, k, v, v_scale = sage.q * (sage.q_scale * scale), sage.k * sage.k_scale, sage.v, sage.v_scale
            # scores = (q_values · k_values) * q_scale * k_scale * softmax scale, folded into q and k; exact for
            # int8 values (|sum| < 2^24) and fp8 values up to fp32 accumulation order.
    else:
        q = q * scale
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, S, D]
    out = torch.empty(hq, sq, d, dtype=compute, device=q.device)
    lse = torch.empty(hq, sq, dtype=compute, device=q.device)
    skipped = tiles = 0
    # per-head λ: some heads may skip; with a tile map every head skips what the map holds
    skipping = torch.is_tensor(skip_lambda) or skip_lambda > 0.0 or tile_map is not None
    lam = torch.as_tensor(skip_lambda, dtype=compute, device=q.device).reshape(-1, 1, 1)
    if tile_map is not None:
        reused_all = unpack_tile_map(tile_map[:, :-(-sq // tq)], -(-skv // tk))  # [H, query tiles, KV tiles]
        skipped_all = reused_all.clone()
        opens_step = first_of_paired_steps(reused_all) if paired else None
    for c0 in range(0, sq, chunk):
        rows = min(chunk, sq - c0)
        qc = qh[:, c0:c0 + rows]
        m = torch.full((hq, rows), -math.inf, dtype=compute, device=q.device)
        lsum = torch.zeros(hq, rows, dtype=compute, device=q.device)
        acc = torch.zeros(hq, rows, d, dtype=compute, device=q.device)
        step_m = m  # the running max at the step's start, which the tests compare with
        ntq = -(-rows // tq)
        row_pad = ntq * tq - rows
        for j0 in range(0, skv, step):
            if bits:
                s = (fp8_gmma_matmul(qc, kh[:, j0:j0 + step].transpose(1, 2), bits)
                     * q_factor[:, c0:c0 + rows] * k_factor[..., j0:j0 + step])
            else:
                s = qc @ kh[:, j0:j0 + step].transpose(1, 2)  # [H, rows, ≤ step]
            if causal:
                s = mask_future_keys(s, c0, j0, sq, skv)
            cols = s.shape[-1]
            ntk = -(-cols // tk)
            # per-tile row maxima [H, rows, ntk]; a partial last tile is padded with -inf
            tmax = torch.nn.functional.pad(s, (0, ntk * tk - cols), value=-math.inf).view(hq, rows, ntk, tk).amax(-1)
            if paired:  # a gathered step opens at this tile for some query tiles: their rows' max at its start
                opens = opens_step[:, c0 // tq:c0 // tq + ntq, j0 // tk].repeat_interleave(tq, dim=1)[:, :rows]
                step_m = torch.where(opens, m, step_m)
            else:
                step_m = m
            if skipping:
                # A row finds a tile negligible when it adds nothing (all masked) or when its max is far below the
                # running max at the step's start; a row with no running max yet (first step) never does. A head
                # with λ = 0 runs dense.
                started = (step_m > -math.inf)[..., None]
                below = ((tmax == -math.inf) | (started & (torch.exp(tmax - step_m[..., None]) < lam))) & (lam > 0)
                padded = torch.nn.functional.pad(below, (0, 0, 0, row_pad), value=True)
                tile_skip = padded.view(hq, ntq, tq, ntk).all(dim=2)  # [H, ntq, ntk]
                if tile_map is not None:
                    # a reused tile is skipped untested (its scores are never computed by a kernel)
                    tiles_here = (slice(None), slice(c0 // tq, c0 // tq + ntq), slice(j0 // tk, j0 // tk + ntk))
                    reused = reused_all[tiles_here]
                    tile_skip = tile_skip & ~reused
                    skipped_all[tiles_here] |= tile_skip
                    tile_skip_all = tile_skip | reused
                else:
                    tile_skip_all = tile_skip
                skipped = skipped + tile_skip.sum(dim=(1, 2))  # stays on the device: no sync per tile
                keep_tiles = ~tile_skip_all.repeat_interleave(tq, dim=1)[:, :rows]  # [H, rows, ntk]
                tmax = torch.where(keep_tiles, tmax, -math.inf)
                keep = keep_tiles.repeat_interleave(tk, dim=2)[..., :cols].to(compute)
                issued = keep_tiles.repeat_interleave(tk // GMMA_K, dim=2) if bits else None
            else:
                keep = issued = None
            tiles += ntq * ntk
            new_m = torch.maximum(m, tmax.amax(-1))
            safe_m = torch.where(new_m == -math.inf, torch.zeros_like(new_m), new_m)
            p = torch.exp(s - safe_m[..., None])
            if keep is not None:
                p = torch.where(keep > 0, p, 0.0)  # a skipped tile adds no exp, no P·V, nothing to the running max
            alpha = torch.exp(m - safe_m)
            pv_in = quantize_p(p, quant.p_scale) if quant is not None else p
            lsum = lsum * alpha + p.sum(-1)
            if bits:
                acc = fp8_gmma_matmul(pv_in, vh[:, j0:j0 + step], bits, acc * alpha[..., None], issued)
            else:
                acc = acc * alpha[..., None] + pv_in @ vh[:, j0:j0 + step]
            m = new_m
        # a row that sees no key (causal, more queries than keys) gets 0, as PyTorch's SDPA gives
        out[:, c0:c0 + rows] = torch.where(lsum[..., None] > 0, acc / lsum[..., None], 0.0)
        lse[:, c0:c0 + rows] = torch.where(lsum > 0, m + torch.log(lsum), -math.inf)
    if tile_map is not None:
        tile_map[:, :skipped_all.shape[1]] = pack_tile_map(skipped_all, tile_map.shape[-1])
    if quant is not None:
        out = out * (v_scale[:, None, :].to(compute) / quant.p_scale)
        lse = lse + lse_shift.nan_to_num()  # no keys: no shift (the row keeps -inf)
    return out.transpose(0, 1).to(out_dtype), skipped, tiles, lse.transpose(0, 1)


def _run(qkv: VarlenQKV, plan: KernelPlan) -> KernelResult:
    out = torch.empty_like(qkv.q)
    skipped = total = 0
    semantics = (sage_semantics(plan.quant, qkv.q.device, qkv.seqlens_q, qkv.seqlens_kv, qkv.q.shape[1], plan.tile,
                                plan.reuse, plan.fresh_map) if plan.quant else None)
    k_mean = v_scale = None
    if semantics is not None and semantics.batch_stats:
        k_mean, v_scale = batch_statistics(qkv.k.float(), qkv.v.float())
    lse = torch.empty(qkv.q.shape[:2], dtype=torch.float32, device=qkv.q.device) if plan.return_lse else None
    tile = (semantics.skip_tile or plan.tile) if semantics else plan.tile
    tile_map = tile_map_for(plan, qkv, tile)
    reused = None if tile_map is None else tiles_in_map(tile_map.flatten(0, 1)).sum()
    for b, ((q, k, v, rows), kv_len) in enumerate(zip(qkv.sequences(), qkv.seqlens_kv)):
        lam = plan.skip_factor / kv_len if plan.skips and kv_len else 0.0  # a sample without keys gets zeros
        o, s, t, *row_lse = reference_attention(
            q, k, v, plan.scale, causal=plan.causal, skip_lambda=lam, quant=semantics, tile=tile,
            kv_step=semantics.kv_step if semantics else None, k_mean=k_mean, v_scale=v_scale,
            with_lse=plan.return_lse, tile_map=None if tile_map is None else tile_map[b])
        out[rows] = o
        if lse is not None:
            lse[rows] = row_lse[0].float()
        skipped += s
        total += t
    return KernelResult(out, skipped, total, lse, tile_map, reused)


def _check(plan: KernelPlan, qkv: VarlenQKV) -> str | None:
    return None  # any device, dtype, head_dim and feature


REFERENCE_BACKEND = register_backend(TORCH_REFERENCE, _run, _check, priority=0, returns_lse=True)

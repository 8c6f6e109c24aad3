"""How many KV tiles many Skip-Softmax thresholds λ would skip in one attention call, in one pass.

The rule is the reference backend's (``backends/reference.py``): a KV tile is skipped for a query tile when for
every row r ``exp(tile_max_r - running_max_r) < λ``, with scores already scaled; the first KV tile never is.
Per (head, query tile, KV tile) this needs one number, the worst row's gap ``max_r(tile_max_r - running_max_r)``,
and λ skips the tile iff ``gap < log λ``. So one pass that computes the gaps counts every λ at once.

The running max is the dense one (every tile updates it). For λ <= 1 this is exact, not an approximation: a tile
that is skipped has ``tile_max_r < running_max_r + log λ <= running_max_r`` in every row, so it would not have
raised the running max anyway, and the dense and the skipping running max are equal at every tile. For λ > 1
(degenerate, warned about at run time) the count under the dense max is a lower bound. ModelOpt's calibration
kernel counts under the dense running max too.
"""

from __future__ import annotations

import math

import torch

from ..backends.reference import mask_future_keys, step_keys

QUERY_CHUNK = 2048  # query rows scored together
KV_CHUNK = 4096  # key columns scored together; memory ~ heads × QUERY_CHUNK × KV_CHUNK


def skip_gaps(q: torch.Tensor, k: torch.Tensor, scale: float, *, tile: tuple[int, int] = (128, 128),
              kv_step: int | None = None, causal: bool = False, query_chunk: int = QUERY_CHUNK,
              kv_chunk: int = KV_CHUNK) -> torch.Tensor:
    """Worst-row gaps of one sequence: q ``[Sq, Hq, D]``, k ``[Skv, Hkv, D]`` -> ``[Hq, query tiles, KV tiles]``.

    ``+inf`` where no λ skips (a row has no running max yet: the first KV tile), ``-inf`` where every λ does
    (every row is masked). Rows are independent, so q may be any tile-aligned subset of a sequence's queries
    (non-causal). ``kv_step``: keys per online-softmax step (a multiple of ``tile[1]``; default ``tile[1]``): each
    tile's gap is to the running max at its step's start, as the reference's ``kv_step`` decides. Computed in
    float32 (float64 for float64 inputs).
    """
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    sq, hq, _ = q.shape
    skv, hkv = k.shape[:2]
    tq, tk = tile
    tiles_per_step = step_keys(kv_step, tk) // tk
    q_step = max(tq, query_chunk // tq * tq)
    kv_cols = max(tk, kv_chunk // tk * tk)
    qh = (q.to(compute) * scale).transpose(0, 1)
    kh = k.to(compute).transpose(0, 1)
    if hkv != hq:
        kh = kh.repeat_interleave(hq // hkv, dim=0)
    kv_pad = -skv % tk
    gaps = []
    for c0 in range(0, sq, q_step):
        rows = min(q_step, sq - c0)
        tile_max = []  # per KV tile, each row's max score: [H, rows, KV tiles]
        for j0 in range(0, skv, kv_cols):
            s = qh[:, c0:c0 + rows] @ kh[:, j0:j0 + kv_cols].transpose(1, 2)
            if causal:
                s = mask_future_keys(s, c0, j0, sq, skv)
            if j0 + kv_cols >= skv and kv_pad:
                s = torch.nn.functional.pad(s, (0, kv_pad), value=-math.inf)
            tile_max.append(s.view(hq, rows, -1, tk).amax(dim=-1))
        tile_max = torch.cat(tile_max, dim=-1)
        # the dense running max before each KV tile (-inf before the first)
        running = torch.nn.functional.pad(tile_max.cummax(dim=-1).values[..., :-1], (1, 0), value=-math.inf)
        if tiles_per_step > 1:  # the running max at each tile's step start
            step_start = torch.arange(running.shape[-1], device=running.device) // tiles_per_step * tiles_per_step
            running = running[..., step_start]
        # no running max yet: tile_max - (-inf) is +inf, so no λ skips; a masked tile is -inf, so every λ does
        gap = torch.where(tile_max == -math.inf, -math.inf, tile_max - running)
        # padding rows of the last query tile never block a skip
        gap = torch.nn.functional.pad(gap, (0, 0, 0, -rows % tq), value=-math.inf)
        gaps.append(gap.view(hq, -1, tq, gap.shape[-1]).amax(dim=2))
    return torch.cat(gaps, dim=1)


def count_skips(gaps: torch.Tensor, lambdas) -> torch.Tensor:
    """Skipped tiles per λ (int64 ``[len(lambdas)]``, on the gaps' device) for gaps from :func:`skip_gaps`."""
    log_lambdas = torch.tensor([math.log(lam) for lam in lambdas], dtype=gaps.dtype, device=gaps.device)
    flat = gaps.reshape(-1).sort().values
    # tiles with gap < log λ: the insertion point of log λ (left side keeps ties unskipped, as exp(gap) < λ does)
    return torch.searchsorted(flat, log_lambdas, side="left")

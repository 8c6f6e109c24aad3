"""The accuracy probe's arithmetic: exact attention for a few query rows of a call, beside what ran.

The rows are spread evenly over the call's packed query tokens (row ``j`` of ``n`` is token
``floor((2j + 1) · total / 2n)``), all heads; their exact attention is computed in float64, dense, over every key
of their sequence (causal where the call is). Their indices are made on the device from ``arange``, so probing
copies nothing between host and device and never waits for the GPU. Keys and values are converted to float64
a few heads at a time (:data:`PROBE_CHUNK_BYTES`), so the extra memory stays bounded at any sequence length.
"""

from __future__ import annotations

import bisect

import torch

from .backends.base import VarlenQKV

#: float64 keys + values converted at once, per probed sequence: bounds the probe's memory at long sequences
#: (Wan 2.2 at 720p: 6 of 40 heads at a time).
PROBE_CHUNK_BYTES = 1 << 30


def probe_row_indices(total: int, rows: int) -> list[int]:
    """The packed query rows a probe of ``rows`` rows reads in a call of ``total`` query tokens (host ints, for
    tests and for grouping rows by sequence)."""
    n = min(rows, total)
    return [((2 * j + 1) * total) // (2 * n) for j in range(n)]


def exact_attention_rows(q_rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                         positions: torch.Tensor | None) -> torch.Tensor:
    """float64 attention of ``q_rows [m, Hq, D]`` on one sequence's ``k, v [S, Hkv, D]`` (query head ``h`` reads
    key head ``h // (Hq / Hkv)``). ``positions`` (``[m]``, the rows' query positions aligned so that the last query
    meets the last key) makes it causal; None attends to every key."""
    m, heads_q, dim = q_rows.shape
    keys, heads_kv = k.shape[0], k.shape[1]
    group = heads_q // heads_kv
    q64 = q_rows.double().view(m, heads_kv, group, dim)
    out = torch.empty(m, heads_kv, group, v.shape[-1], dtype=torch.float64, device=q_rows.device)
    chunk = max(1, PROBE_CHUNK_BYTES // (keys * (dim + v.shape[-1]) * 8))
    for h in range(0, heads_kv, chunk):
        kc, vc = k[:, h:h + chunk].double(), v[:, h:h + chunk].double()
        scores = torch.einsum("mhgd,nhd->hgmn", q64[:, h:h + chunk], kc) * scale
        if positions is not None:
            future = torch.arange(keys, device=k.device)[None, :] > positions[:, None]  # [m, S]
            scores = scores.masked_fill(future, float("-inf"))
        out[:, h:h + chunk] = torch.einsum("hgmn,nhd->mhgd", torch.softmax(scores, dim=-1), vc)
    return out.view(m, heads_q, -1)


def probe_error_sums(qkv: VarlenQKV, out: torch.Tensor, rows: int, scale: float, causal: bool) -> torch.Tensor:
    """``[Σ (out − exact)², Σ exact²]`` float64 on the device over ``rows`` probed query rows of the packed call
    ``qkv`` whose result was ``out [total_q, Hq, D]``."""
    total = qkv.q.shape[0]
    n = min(rows, total)
    device = qkv.q.device
    starts = [0]
    for length in qkv.seqlens_q:
        starts.append(starts[-1] + length)
    first_row = {}  # sequence -> first and past-the-last probe index j whose row lies in it
    for j, row in enumerate(probe_row_indices(total, rows)):
        seq = bisect.bisect_right(starts, row) - 1
        first_row.setdefault(seq, [j, j])[1] = j + 1
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    kv_start = [0]
    for length in qkv.seqlens_kv:
        kv_start.append(kv_start[-1] + length)
    for seq, (j0, j1) in first_row.items():
        index = ((2 * torch.arange(j0, j1, device=device) + 1) * total) // (2 * n)
        k = qkv.k[kv_start[seq]:kv_start[seq + 1]]
        v = qkv.v[kv_start[seq]:kv_start[seq + 1]]
        positions = None
        if causal:
            positions = index - starts[seq] + (k.shape[0] - qkv.seqlens_q[seq])
        exact = exact_attention_rows(qkv.q.index_select(0, index), k, v, scale, positions)
        ran = out.index_select(0, index).double()
        sums += torch.stack([(ran - exact).square().sum(), exact.square().sum()])
    return sums

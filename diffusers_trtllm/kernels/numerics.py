"""Numbers every attention kernel of the package and its PyTorch reference share: the head dim the kernels are
built for, the int8 / fp8 e4m3 grids Q, K, V and P are quantized to, and the floor that keeps a block scale finite.

Defined here, at the bottom of the package, so that the kernels and the layers above them (``quant``, the
backends) read one definition.
"""

from __future__ import annotations

import torch

HEAD_DIM = 128  # channels per head of every TRT-LLM and Triton kernel the package runs
FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT8_MAX = 127.0  # symmetric int8 grid: -128 is never used
P_SCALE = FP8_MAX  # softmax numerators P in [0, 1] enter P·V as fp8(P · 448), unless a kernel says otherwise
TINY_SCALE = 1e-12  # floor of a block's amax: an all-zero block keeps a finite, nonzero scale
QK_TORCH_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}  # Q/K value dtype by config name


def qmax(dtype_qk: str) -> float:
    """The largest magnitude on the Q/K grid of ``dtype_qk`` (``"int8"`` or ``"fp8_e4m3"``)."""
    return INT8_MAX if dtype_qk == "int8" else FP8_MAX


def head_dim_mismatch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """``None`` when q, k and v all have :data:`HEAD_DIM` channels, else the head dims they have, in words."""
    if q.shape[-1] == k.shape[-1] == v.shape[-1] == HEAD_DIM:
        return None
    return f"head_dim is {q.shape[-1]} (k {k.shape[-1]}, v {v.shape[-1]})"


def smoothing_lse_shift(q: torch.Tensor, k_mean: torch.Tensor, scale: float, rows_per_chunk: int = 8192) -> torch.Tensor:
    """What K smoothing takes off each query row's log-sum-exp: ``scale · q · mean(K)``, to be added back.

    ``q`` ``[n, Hq, D]`` (any float dtype), ``k_mean`` ``[Hkv, D]`` float32 (``Hq % Hkv == 0``; query head ``h``
    reads key head ``h // (Hq / Hkv)``). Returns ``[n, Hq]`` float32, summed in float32 a chunk of rows at a time
    (no float copy of the whole of ``q``)."""
    heads_q, heads_kv = q.shape[1], k_mean.shape[0]
    mean = k_mean.float().repeat_interleave(heads_q // heads_kv, dim=0)[:, :, None]  # [Hq, D, 1]
    shift = torch.empty(q.shape[0], heads_q, dtype=torch.float32, device=q.device)
    for start in range(0, q.shape[0], rows_per_chunk):
        rows = q[start:start + rows_per_chunk].float().transpose(0, 1)  # [Hq, rows, D]
        shift[start:start + rows_per_chunk] = torch.bmm(rows, mean)[..., 0].T * scale
    return shift


#: KV tiles per int32 word of a Skip-Softmax tile map (bit ``j % 32`` of word ``j // 32``: KV tile ``j`` skipped)
TILE_MAP_BITS = 32


def tile_map_shape(seqlens_q, seqlens_kv, heads_q: int, tile: tuple[int, int]) -> tuple[int, int, int, int]:
    """``(batch, heads_q, query tiles, words)`` of the tile map of a batch with these lengths (host ints) whose
    kernel decides skips per ``tile`` (query rows, keys): one bit per KV tile, :data:`TILE_MAP_BITS` to a word."""
    kv_tiles = -(-max(seqlens_kv) // tile[1])
    return len(seqlens_q), heads_q, -(-max(seqlens_q) // tile[0]), -(-kv_tiles // TILE_MAP_BITS)


def bits_set(words: torch.Tensor) -> torch.Tensor:
    """int64, shaped like int32 ``words``: the bits set in each word (a tile map's skipped tiles per word), on
    their device without a host read."""
    x = words.to(torch.int64) & 0xFFFFFFFF
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return (x * 0x01010101) >> 24 & 0xFF

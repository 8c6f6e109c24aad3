"""Attention inputs for the benchmarks: random, local ("peaky") and replayed from a real pipeline.

All generators return packed ``[tokens, heads, head_dim]`` bf16 tensors on the given device.

- ``random``: q, k, v ~ N(0, 1). Scores are small and near-uniform, the worst case for Skip-Softmax: hardly a
  tile is negligible, so it measures the kernels' cost and the overhead of the skip test.
- ``peaky``: the probes' model of a video transformer's locality. Tokens sit on a line; each token's q and k are
  the same smooth positional feature (sin/cos of the position at 64 log-spaced frequencies from 1e-4 to 10^-0.5,
  so nearby tokens are similar and far ones are not) plus independent N(0, 0.3²) noise, all times ``sharpness``.
  A query's scores then peak around its own position and fall off with distance; ``sharpness`` sets how fast
  (3 gives rel. err. ~2e-3 at a 1.3-1.4x skip speed-up at Wan's size). v ~ N(0, 1).
- ``published_curve``: attention whose 128 × 128 Skip-Softmax sparsity follows a published calibration curve
  (factor = a·exp(b·s), λ = factor / S). Each (head, 128-key tile) gets one logit offset added to all its keys: a
  fraction ``1 - ln(S/a)/b`` of the tiles at 0, the rest uniform in ``[-ln(S/a), 0]`` nats, over small noise
  (q, k ~ N(0, 0.3²)); one query channel is constant 1 and the matching key channel carries the offset. A late
  tile is then skipped when its offset is below ln λ = ln(a/S) + b·s, which a fraction s of the tiles is. Its
  speed at a sparsity is realistic, its errors are not (within-tile attention is flat).
- ``replay``: q, k, v saved from a real pipeline with :func:`save_qkv` (e.g. from a processor's call), loaded
  with :func:`load_qkv`.
"""

from __future__ import annotations

import math

import torch


def random_qkv(tokens: int, heads: int, head_dim: int = 128, device="cuda", seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(tokens, heads, head_dim, device=device, dtype=torch.bfloat16, generator=gen)
            for _ in range(3)]


def peaky_qkv(tokens: int, heads: int, head_dim: int = 128, sharpness: float = 3.0, device="cuda", seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    pos = torch.arange(tokens, device=device, dtype=torch.float32)[:, None]
    freqs = torch.logspace(-4, -0.5, head_dim // 2, device=device)[None, :]
    feature = torch.cat([torch.sin(pos * freqs), torch.cos(pos * freqs)], dim=1)[:, None, :]  # [S, 1, D]

    def noisy():
        noise = torch.randn(tokens, heads, head_dim, device=device, generator=gen) * 0.3
        return ((feature + noise) * sharpness).to(torch.bfloat16)

    q, k = noisy(), noisy()
    v = torch.randn(tokens, heads, head_dim, device=device, generator=gen).to(torch.bfloat16)
    return [q, k, v]


WAN22_720P_CURVE = (2822.62, 4.388)  # NVIDIA's published Wan 2.2 720p/81f calibration: factor = a·exp(b·s)


def published_curve_qkv(tokens: int, heads: int, head_dim: int = 128, curve=WAN22_720P_CURVE, tile: int = 128,
                        device="cuda", seed: int = 0):
    a, b = curve
    span = math.log(tokens / a)  # offsets range over [-span, 0] nats
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(tokens, heads, head_dim, device=device, generator=gen) * 0.3
    k = torch.randn(tokens, heads, head_dim, device=device, generator=gen) * 0.3
    v = torch.randn(tokens, heads, head_dim, device=device, generator=gen)
    tiles = -(-tokens // tile)
    at_zero = torch.rand(heads, tiles, device=device, generator=gen) < 1.0 - span / b
    offsets = torch.where(at_zero, 0.0, -span * torch.rand(heads, tiles, device=device, generator=gen))
    q[..., 0] = 1.0
    k[..., 0] = offsets.repeat_interleave(tile, dim=1)[:, :tokens].T * head_dim ** 0.5  # score = offset at scale D^-½
    return [x.to(torch.bfloat16) for x in (q, k, v)]


def skip_factor(target_sparsity: float, curve=WAN22_720P_CURVE) -> float:
    """The published curve's Skip-Softmax factor (λ · kv_len) for ``target_sparsity``."""
    a, b = curve
    return a * math.exp(b * target_sparsity)


def save_qkv(path: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **meta) -> None:
    """Save one attention call's inputs (``[S, H, D]`` or ``[B, S, H, D]``) for ``--qkv`` replay."""
    torch.save({"q": q.detach().cpu(), "k": k.detach().cpu(), "v": v.detach().cpu(), **meta}, path)


def load_qkv(path: str, device="cuda"):
    """Load :func:`save_qkv`'s file as packed ``[S, H, D]`` bf16 tensors (the first batch element of a 4-D save)."""
    data = torch.load(path, map_location="cpu")
    out = []
    for name in ("q", "k", "v"):
        t = data[name]
        if t.dim() == 4:
            t = t[0]
        out.append(t.to(device=device, dtype=torch.bfloat16).contiguous())
    return out

"""SAGE quantization in PyTorch: the reference every SAGE kernel of this package is checked against.

What a kernel computes is described by :class:`SageSemantics` (block sizes, P's fp8 scale, whether K's mean and
V's scales are taken per sequence or over the whole packed batch); ``backends.trtllm.sage_semantics`` says which
semantics each kernel has. Per sequence (or per batch, see below) and per head:

- K is smoothed: its mean over the sequence's tokens is subtracted. Each query row's scores then shift by one
  constant, which softmax (and the Skip-Softmax rule, a difference of scores in one row) ignores.
- Q and K are quantized per block of ``block_size`` consecutive tokens (all ``head_dim`` channels share the
  block's scale): ``scale = amax / qmax`` with qmax 127 for int8 (round to nearest, clamp to ±127) and 448 for
  fp8 e4m3 (round to nearest even by the cast). Blocks never straddle two sequences.
- V is quantized per channel (one scale per head and channel over the sequence's tokens) to fp8 e4m3.
- P (softmax numerators, in [0, 1] after the running max is subtracted) is quantized to fp8 e4m3 as P·p_scale
  (448 for this package's Triton kernel, 256 for FMHAv2), so the P·V product also runs in fp8; the row sums use
  unquantized P.
- ``batch_stats``: K's mean and V's per-channel scales come from all tokens of the packed batch rather than from
  each sequence (FlashInfer's trtllm-gen quantizer, whose ``k_mean`` / ``v_scale`` are ``[H, D]``).
- ``k_block`` 0: one K scale per sequence and head (a block as long as the sequence).
- ``fp8_accumulator_bits``: Q·Kᵀ and P·V summed as Hopper's fp8 tensor cores sum (see :class:`SageSemantics`),
  for kernels whose accumulators never leave the tensor core between instructions; None: exact float32 sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels.numerics import FP8_MAX, INT8_MAX, P_SCALE, TINY_SCALE, qmax


@dataclass(frozen=True)
class SageSemantics:
    """What one SAGE kernel computes: Q/K dtype and blocks (tokens; ``k_block`` 0 = one scale per sequence and
    head), P's fp8 scale, whether K's mean and V's scales are batch-wide, and the keys per online-softmax step its
    Skip-Softmax decisions compare against (``None``: each decision tile is its own step).

    ``fp8_accumulator_bits``: the kernel's fp8 products are summed by sm_90's tensor cores, each instruction
    adding its 32 products to the accumulator after aligning all of them to the largest exponent among them and
    the accumulator and truncating to this many bits; Q·Kᵀ chains its four instructions (head_dim 128), P·V keeps
    one accumulator across all KV steps (rescaled exactly in between). ``None``: exact float32 sums.

    ``skip_tile``: ``(query rows, keys)`` per Skip-Softmax decision where the kernel fixes it (``None``: the plan's
    tile).

    ``skip_sample``: ``(every, pays_from)`` where the kernel skips only in the heads where skipping pays: each
    (sequence, head)'s every ``every``-th query tile (from the first) skips; its other query tiles skip only if
    those skipped at least a fraction ``pays_from`` of their KV tiles, and are attended dense otherwise. ``None``:
    every query tile skips.

    ``q_padded_to_kv``: the kernel runs a sequence with fewer queries than keys as self-attention on its keys, its
    queries followed by zero query rows up to its key length (quantized and attended like the real rows, so a
    query tile holding both skips only where the zero rows' rule allows it too); the zero rows' outputs are
    dropped.

    ``paired_tiles``: with a tile map (Skip-Softmax reuse), each step of the kernel holds two KV tiles gathered
    from those that either query tile of a pair ``2k``, ``2k + 1`` computes (a tile both reuse is not loaded;
    a query tile without a map row reuses every tile), two to a step in key order; each tile is decided against
    the running max at its step's start, and a tile its query tile reuses, though loaded for its partner, enters
    nothing. Without a map the steps are ``kv_step``'s."""

    dtype_qk: str
    q_block: int
    k_block: int
    p_scale: float = P_SCALE
    batch_stats: bool = False
    kv_step: int | None = None
    fp8_accumulator_bits: int | None = None
    skip_tile: tuple[int, int] | None = None
    skip_sample: tuple[int, float] | None = None
    q_padded_to_kv: bool = False
    paired_tiles: bool = False


def scale_of(amax: torch.Tensor, q_max: float) -> torch.Tensor:
    """``amax / q_max`` correctly rounded, as the kernels' quantizers divide (amax floored at a tiny value). The
    divisor is a tensor on purpose: CUDA PyTorch multiplies by the rounded reciprocal of a Python-number divisor,
    one ulp off in some blocks, and every value of such a block can then round to another fp8 neighbour."""
    return amax.clamp_min(TINY_SCALE) / torch.full_like(amax, q_max)


def round_to(x: torch.Tensor, dtype_qk: str) -> torch.Tensor:
    """Round already-scaled values onto the target grid, returned in x's dtype (exact values of the target type)."""
    if dtype_qk == "int8":
        return torch.round(x).clamp_(-INT8_MAX, INT8_MAX)
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(x.dtype)


def quantize_blocks(x: torch.Tensor, block_size: int, dtype_qk: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize one sequence ``x [tokens, heads, D]`` per block of ``block_size`` tokens.

    Returns ``(values [tokens, heads, D], scales [heads, ceil(tokens / block_size)])``: values hold exact int8 /
    fp8 numbers in x's dtype, and ``values * scale`` (the scale broadcast over the block) approximates x.
    """
    t, h, d = x.shape
    nblk = -(-t // block_size)
    pad = nblk * block_size - t
    xp = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) if pad else x
    blocks = xp.reshape(nblk, block_size, h, d)
    amax = blocks.abs().amax(dim=(1, 3))  # [nblk, h]
    scale = scale_of(amax, qmax(dtype_qk))
    values = round_to(blocks / scale[:, None, :, None], dtype_qk).reshape(nblk * block_size, h, d)[:t]
    return values, scale.transpose(0, 1).contiguous()


def expand_block_scales(scale: torch.Tensor, block_size: int, tokens: int) -> torch.Tensor:
    """``[heads, nblocks]`` block scales -> ``[tokens, heads, 1]`` per-token scales."""
    return scale.repeat_interleave(block_size, dim=1)[:, :tokens].transpose(0, 1)[..., None]


def quantize_v_per_channel(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``v [tokens, heads, D]`` -> ``(fp8 values in v's dtype, scales [heads, D])``."""
    scale = scale_of(v.abs().amax(dim=0), FP8_MAX)
    return round_to(v / scale, "fp8_e4m3"), scale


def quantize_p(p: torch.Tensor, p_scale: float = P_SCALE) -> torch.Tensor:
    """Softmax numerators in [0, 1] -> fp8 values of ``p * p_scale`` (divide the P·V product by ``p_scale``)."""
    return round_to(p * p_scale, "fp8_e4m3")


@dataclass
class SageSequence:
    """One sequence quantized for SAGE: integer/fp8 values and their scales, all in the compute dtype."""

    q: torch.Tensor  # [Tq, H, D] quantized values
    q_scale: torch.Tensor  # [Tq, H, 1] per-token view of the block scales
    k: torch.Tensor  # [Tk, H, D] smoothed, quantized values
    k_scale: torch.Tensor  # [Tk, H, 1]
    v: torch.Tensor  # [Tk, H, D] fp8 values
    v_scale: torch.Tensor  # [H, D]


def quantize_sequence(q, k, v, semantics: SageSemantics, k_mean: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> SageSequence:
    """Quantize one sequence's Q, K, V (``[tokens, heads, D]``, any float dtype) as the module docstring says.

    ``k_mean`` ``[heads, D]`` / ``v_scale`` ``[heads, D]`` replace the sequence's own statistics (batch-wide
    semantics: see :func:`batch_statistics`)."""
    k = k - (k.mean(dim=0) if k_mean is None else k_mean.to(k.dtype))[None]
    k_block = semantics.k_block or k.shape[0]
    qv, qs = quantize_blocks(q, semantics.q_block, semantics.dtype_qk)
    kv, ks = quantize_blocks(k, k_block, semantics.dtype_qk)
    if v_scale is None:
        vv, vs = quantize_v_per_channel(v)
    else:
        vs = v_scale.to(v.dtype)
        vv = round_to(v / vs, "fp8_e4m3")
    return SageSequence(qv, expand_block_scales(qs, semantics.q_block, q.shape[0]), kv,
                        expand_block_scales(ks, k_block, k.shape[0]), vv, vs)


def batch_statistics(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K's mean and V's per-channel fp8 scale over every token of a packed batch (``[tokens, heads, D]`` each):
    ``(k_mean [heads, D], v_scale [heads, D])``, the statistics of batch-wide semantics."""
    return k.mean(dim=0), scale_of(v.abs().amax(dim=0), FP8_MAX)

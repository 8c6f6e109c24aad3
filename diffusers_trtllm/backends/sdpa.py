"""``TORCH_SDPA``: dense attention through ``torch.nn.functional.scaled_dot_product_attention``.

The dense baseline on any device; PyTorch picks the kernel (cuDNN or flash on Hopper). Equal-length batches run
as one call; ragged batches one call per sequence.

Causal attention aligns the last query with the last key (bottom-right), as FlashInfer's and TRT-LLM's kernels
and the reference do; PyTorch's ``is_causal`` aligns the first query with the first key (top-left), so when the
query and key lengths differ the mask is built here. A query that sees no key gets 0, as in the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import TORCH_SDPA
from .base import KernelPlan, KernelResult, VarlenQKV, register_backend


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """Dense attention of ``[B, S, H, D]`` tensors (grouped-query heads allowed), causal bottom-right; ``[B, Sq, Hq,
    D]`` out. Differentiable, and traced by inductor like diffusers' native backend."""
    sq, skv = q.shape[1], k.shape[1]
    bottom_right = causal and sq != skv
    mask = torch.ones(sq, skv, dtype=torch.bool, device=q.device).tril(skv - sq) if bottom_right else None
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         is_causal=causal and not bottom_right, scale=scale,
                                         enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def masked_dense_attention(q, k, v, valid_lengths, scale: float, causal: bool) -> torch.Tensor:
    """``[B, S, H, D]`` dense attention with SDPA (``TORCH_SDPA``'s), each sample among its valid prefix (0
    elsewhere; valid prefixes come with non-causal self-attention only)."""
    if valid_lengths is None:
        return sdpa_attention(q, k, v, scale, causal)
    positions = torch.arange(q.shape[1], device=q.device)
    valid = positions[None, :] < valid_lengths.to(q.device)[:, None]  # [B, S]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=valid[:, None, :, None] &
        valid[:, None, None, :], scale=scale, enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)
    return torch.where(valid[:, :, None, None], out, 0.0)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: KernelPlan) -> torch.Tensor:
    return sdpa_attention(q, k, v, plan.scale, plan.causal)


def _run(qkv: VarlenQKV, plan: KernelPlan) -> KernelResult:
    if qkv.uniform:
        b = qkv.batch_size
        out = _sdpa(qkv.q.view(b, -1, *qkv.q.shape[1:]), qkv.k.view(b, -1, *qkv.k.shape[1:]),
                    qkv.v.view(b, -1, *qkv.v.shape[1:]), plan)
        return KernelResult(out.reshape(qkv.q.shape))
    out = torch.empty_like(qkv.q)
    for q, k, v, rows in qkv.sequences():
        out[rows] = _sdpa(q[None], k[None], v[None], plan)[0]
    return KernelResult(out)


def _check(plan: KernelPlan, qkv: VarlenQKV) -> str | None:
    if plan.skips or plan.quant is not None:
        return "TORCH_SDPA runs dense attention only (no Skip-Softmax, no SAGE)"
    return None


SDPA_BACKEND = register_backend(TORCH_SDPA, _run, _check, priority=5)

"""Call plans for FlashInfer's TRT-LLM attention kernels: the exact arguments of each call, computed, not run.

Building a call touches no GPU and imports no FlashInfer, so CPU tests can bind every plan against the installed
FlashInfer's real signatures (``inspect.signature(fn).bind(**call.kwargs)``) and check the derived values.

Kernels (FlashInfer >= 0.6.18, ``flashinfer.prefill``):

- ``trtllm_fmha_v2_prefill``: TRT-LLM FMHAv2, Hopper (sm_90). Dense BF16 and Skip-Softmax, layout
  ``SEPARATE_Q_K_V``, non-causal (``mask_mode="padding"``). JIT-compiled on first use.
- ``trtllm_ragged_attention_deepseek``: trtllm-gen, datacenter Blackwell (sm_100, sm_103). Dense BF16,
  Skip-Softmax and SAGE (per-block Q/K scales, per-channel V scale). Cubins are downloaded on first use.
- ``trtllm_sage_attention_quantize``: the SAGE quantizer feeding the trtllm-gen call.

All tensors are ragged: ``q [total_q, heads_q, 128]``, ``k``/``v`` ``[total_kv, heads_kv, 128]``, sequence ``i``
owning rows ``cum_seq_lens[i]:cum_seq_lens[i + 1]``; a whole batch (CFG pairs, unequal lengths) is one call.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from .numerics import QK_TORCH_DTYPES

FMHA_V2 = "trtllm_fmha_v2_prefill"
TRTLLM_GEN = "trtllm_ragged_attention_deepseek"
SAGE_QUANTIZE = "trtllm_sage_attention_quantize"

SAGE_V_BLOCK = 1  # V scales are per channel: one scale per (head, channel), i.e. blocks of one element
SAGE_P_BLOCK = 0  # no P scale tensor: the kernel quantizes P itself
LN2 = math.log(2.0)  # trtllm-gen's log-sum-exp is in base 2


@dataclass(frozen=True)
class RaggedIndex:
    """Where each sequence lives in the packed tensors, in the form the kernels take.

    ``cum_seq_lens_q`` / ``cum_seq_lens_kv``: ``[batch + 1]`` int32; ``seq_lens_kv``: ``[batch]`` int32 (KV length
    per sequence), all on the tensors' device. The host ints size the launch without reading the device.
    """

    cum_seq_lens_q: torch.Tensor
    cum_seq_lens_kv: torch.Tensor
    seq_lens_kv: torch.Tensor
    max_q_len: int
    max_kv_len: int
    batch_size: int


def build_ragged_index(seqlens_q: Sequence[int], seqlens_kv: Sequence[int],
                       device: torch.device | str) -> RaggedIndex:
    """Build the index with one host-to-device copy; the three tensors are views of one int32 buffer."""
    batch = len(seqlens_q)
    host = [0]
    for n in seqlens_q:
        host.append(host[-1] + n)
    host.append(0)
    for n in seqlens_kv:
        host.append(host[-1] + n)
    host.extend(seqlens_kv)
    buf = torch.tensor(host, dtype=torch.int32, device=device)
    cu_q = buf[:batch + 1]
    cu_kv = buf[batch + 1:2 * batch + 2]
    lens_kv = buf[2 * batch + 2:]
    return RaggedIndex(cu_q, cu_kv, lens_kv, max(seqlens_q), max(seqlens_kv), batch)


@dataclass(frozen=True)
class KernelCall:
    """One FlashInfer call: the function's name in ``flashinfer.prefill`` and its keyword arguments."""

    function: str
    kwargs: Mapping[str, Any]

    def bind(self, module) -> inspect.BoundArguments:
        """Bind the arguments to ``module.<function>``'s signature (raises ``TypeError`` on a mismatch)."""
        return inspect.signature(getattr(module, self.function)).bind(**self.kwargs)

    def __call__(self, module):
        return getattr(module, self.function)(**self.kwargs)


def fmha_v2_layout(return_lse: bool) -> str:
    """FlashInfer's FMHAv2 input layout of :func:`fmha_v2_call` (each layout is its own JIT module)."""
    return "CONTIGUOUS_Q_KV" if return_lse else "SEPARATE_Q_K_V"


def fmha_v2_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, workspace: torch.Tensor, index: RaggedIndex,
                 scale: float, skip_factor: float, return_lse: bool = False) -> KernelCall:
    """FMHAv2 (Hopper) dense or Skip-Softmax attention, non-causal.

    q ``[total_q, Hq, D]``, k/v ``[total_kv, Hkv, D]``, contiguous (the kernel derives strides from shapes), bf16.
    ``scale`` multiplies Q·Kᵀ (bmm1); the output needs no rescale (bmm2 = 1). ``skip_factor`` 0 runs dense; else
    a KV tile is skipped when ``exp(tile_max - running_max) < skip_factor / kv_len`` for every row of its
    128-row query tile. ``return_lse``: the call returns ``(out, stats)`` with FMHAv2's softmax statistics
    (:func:`fmha_v2_stats_lse` turns them into the log-sum-exp); it passes K and V stacked into one ``[total_kv, 2,
    Hkv, D]`` tensor (a copy), the only layout for which the kernels save statistics (FlashInfer's C++ ends the
    process on any other: "only CONTIGUOUS_Q_KV layout supports saving softmax stats").
    """
    qkv = (q, torch.stack([k, v], dim=1)) if return_lse else (q, k, v)
    return KernelCall(FMHA_V2, dict(
        qkv=qkv, input_layout=fmha_v2_layout(return_lse), workspace_buffer=workspace, seq_lens=index.seq_lens_kv,
        max_q_len=index.max_q_len, max_kv_len=index.max_kv_len, bmm1_scale=float(scale), bmm2_scale=1.0,
        batch_size=index.batch_size, cum_seq_lens_q=index.cum_seq_lens_q, cum_seq_lens_kv=index.cum_seq_lens_kv,
        mask_mode="padding", save_softmax_stats=bool(return_lse),
        skip_softmax_threshold_scale_factor=float(skip_factor)))


def fmha_v2_stats_lse(stats: torch.Tensor, scale: float, head_dim: int) -> torch.Tensor:
    """Natural log-sum-exp ``[rows, H]`` float32 from FMHAv2's softmax statistics ``[rows, H, 2]`` float32.

    The warp-specialized kernels (``fmha/hopper/fragment.h``'s ``Softmax_saver_tma``, FlashInfer 0.7.2 and 0.7.4)
    store per row ``(max / sqrt(head_dim), sum)``: ``max`` the row's largest unscaled score Q·Kᵀ over the keys it
    kept (this package's SAGE kernels: of smoothed K, and divided by the row's Q block scale, which the caller
    multiplies back first), ``sum`` = Σ exp(scale · (score - max)) over them (e4m3: P's fp8 scale divided out).
    Hence LSE = scale · max + ln(sum), whatever ``scale`` is (the stored max assumes 1 / sqrt(d)).
    """
    return stats[..., 0] * (scale * head_dim ** 0.5) + stats[..., 1].log()


@dataclass(frozen=True)
class SageScales:
    """Outputs of the SAGE quantizer that the attention call consumes, with their block sizes.

    ``q_scale [Hq, ceil(total_q / q_block) + batch - 1]`` and ``k_scale [Hkv, ceil(total_kv / k_block) + batch
    - 1]`` float32 (each sequence starts a new block, hence up to ``batch - 1`` extra blocks); ``v_scale
    [Hkv, D]`` float32, one scale per head and channel over all tokens.
    """

    q_scale: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    q_block_size: int
    k_block_size: int


def sage_scale_shapes(total_q: int, total_kv: int, heads_q: int, heads_kv: int, head_dim: int, batch: int,
                      q_block_size: int, k_block_size: int) -> dict[str, tuple[int, int]]:
    """Shapes of the quantizer's scale tensors (FlashInfer >= 0.6.18's batch-padded layout)."""
    return {"q_scale": (heads_q, math.ceil(total_q / q_block_size) + batch - 1),
            "k_scale": (heads_kv, math.ceil(total_kv / k_block_size) + batch - 1),
            "v_scale": (heads_kv, head_dim)}


def sage_quantize_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: RaggedIndex, dtype_qk: str,
                       q_block_size: int, k_block_size: int) -> KernelCall:
    """SAGE quantization (Blackwell): Q/K per token block to int8 or fp8 e4m3, K smoothed, V per channel to fp8.

    Returns 7 tensors: quantized q, k, v, then q_scale, k_scale, v_scale (see :class:`SageScales`) and K's mean.
    """
    return KernelCall(SAGE_QUANTIZE, dict(
        query=q, key=k, value=v, q_block_size=q_block_size, k_block_size=k_block_size,
        qk_quant_dtype=QK_TORCH_DTYPES[dtype_qk], cum_seq_lens_q=index.cum_seq_lens_q,
        cum_seq_lens_kv=index.cum_seq_lens_kv, smooth_k=True))


def trtllm_gen_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, workspace: torch.Tensor, index: RaggedIndex,
                    scale: float, skip_factor: float, sage: SageScales | None = None,
                    return_lse: bool = False) -> KernelCall:
    """trtllm-gen (Blackwell) ragged attention, non-causal: dense, Skip-Softmax, and/or SAGE.

    Dense: q/k/v bf16 ``[tokens, heads, 128]``. SAGE: q/k int8 or fp8 e4m3 and v fp8 e4m3 from the quantizer,
    with ``sage`` holding their scales; the kernel dequantizes per block, so bmm1 carries only the softmax scale
    and bmm2 is 1. The output is bf16 either way. ``skip_factor`` 0 selects the kernels without skipping (the
    argument is then ``None``, not 0). Every sequence must be non-empty (``skip_all_rows_active_check``: no
    device-to-host read to look for empty rows). ``return_lse``: the call returns ``(out, lse)``, ``lse``
    ``[total_q, Hq]`` float32 in base 2 (FlashInfer's launcher sets ``lseScale`` 1, "keeps base 2", 0.7.2 and
    0.7.4): times :data:`LN2` for the natural log; with SAGE, of the smoothed K.
    """
    kwargs = dict(
        query=q, key=k, value=v, workspace_buffer=workspace, seq_lens=index.seq_lens_kv, max_q_len=index.max_q_len,
        max_kv_len=index.max_kv_len, bmm1_scale=float(scale), bmm2_scale=1.0, o_sf_scale=-1.0,
        batch_size=index.batch_size, window_left=-1, cum_seq_lens_q=index.cum_seq_lens_q,
        cum_seq_lens_kv=index.cum_seq_lens_kv, enable_pdl=True, is_causal=False, return_lse=bool(return_lse),
        skip_softmax_threshold_scale_factor=float(skip_factor) if skip_factor > 0.0 else None,
        skip_all_rows_active_check=True)
    if sage is not None:
        kwargs["sage_attn_sfs"] = (sage.q_scale, sage.k_scale, None, sage.v_scale)
        kwargs["num_elts_per_sage_attn_blk"] = (sage.q_block_size, sage.k_block_size, SAGE_P_BLOCK, SAGE_V_BLOCK)
    return KernelCall(TRTLLM_GEN, kwargs)

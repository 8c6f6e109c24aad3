"""TRTLLM_ATTN on a GPU with TRT-LLM kernels (H100/H200, B200/B300): correctness against cuDNN SDPA and the
reference backend. Skipped without CUDA (conftest), without FlashInfer, or on a GPU TRTLLM_ATTN refuses."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from diffusers_trtllm.backends import select_backend, trtllm
from diffusers_trtllm.backends.base import KernelPlan, VarlenQKV
from diffusers_trtllm.backends.reference import reference_attention
from diffusers_trtllm.config import AUTO, TRTLLM_ATTN
from diffusers_trtllm.platform import gpu_arch

pytestmark = pytest.mark.gpu

SCALE = 128 ** -0.5


@pytest.fixture(scope="module", autouse=True)
def trtllm_gpu():
    pytest.importorskip("flashinfer")
    arch = gpu_arch("cuda")
    if arch not in trtllm.FMHA_V2_ARCHS + trtllm.TRTLLM_GEN_ARCHS:
        pytest.skip(f"TRTLLM_ATTN has no kernels for {arch}")
    return arch


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def cudnn(q, k, v):
    """``[S, H, D]`` attention of one sequence through cuDNN (k/v heads repeated for GQA)."""
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], scale=SCALE)
    return out[0].transpose(0, 1)


def randn(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)


def peaky(tokens, heads, sharpness=3.0):
    """Local attention: q and k share a smooth positional feature (see benchmarks/data.py)."""
    pos = torch.arange(tokens, device="cuda", dtype=torch.float32)[:, None]
    freqs = torch.logspace(-4, -0.5, 64, device="cuda")[None, :]
    feature = torch.cat([torch.sin(pos * freqs), torch.cos(pos * freqs)], 1)[:, None, :]
    q, k = (((feature + torch.randn(tokens, heads, 128, device="cuda") * 0.3) * sharpness).bfloat16()
            for _ in range(2))
    return q, k, randn(tokens, heads, 128)


@pytest.mark.parametrize("seqlens,heads_q,heads_kv", [
    ((4096,), 8, 8),
    ((4096, 4096), 8, 8),  # CFG batch
    ((1000, 1531, 777), 8, 8),  # ragged, unequal lengths, not multiples of the tile
    ((2048, 3000), 32, 8),  # grouped-query heads
])
def test_dense_matches_cudnn(seqlens, heads_q, heads_kv):
    check_against_cudnn(seqlens, seqlens, heads_q, heads_kv)


@pytest.mark.parametrize("seqlens_q,seqlens_kv,heads_q,heads_kv", [
    ((8192,), (512,), 8, 8), ((4096, 4096), (257, 257), 8, 8),  # Wan text / Wan 2.1 I2V image cross-attention
    ((19320,), (19920,), 32, 8), ((4096, 1000), (4696, 1000), 8, 8),  # fewer queries than keys: padded queries
])
def test_unequal_lengths_match_cudnn(seqlens_q, seqlens_kv, heads_q, heads_kv):
    check_against_cudnn(seqlens_q, seqlens_kv, heads_q, heads_kv)


def check_against_cudnn(seqlens, seqlens_kv, heads_q, heads_kv):
    total, total_kv = sum(seqlens), sum(seqlens_kv)
    qkv = VarlenQKV(randn(total, heads_q, 128), randn(total_kv, heads_kv, 128), randn(total_kv, heads_kv, 128),
                    seqlens, seqlens_kv)
    plan = KernelPlan(TRTLLM_ATTN, SCALE)
    assert trtllm.unavailable_reason(plan, qkv) is None
    out = trtllm.run(qkv, plan).out
    assert out.shape == qkv.q.shape and out.dtype == torch.bfloat16
    for q, k, v, rows in qkv.sequences():
        assert rel_err(out[rows], cudnn(q, k, v)) <= 1e-3


def test_skip_with_nothing_to_skip_matches_dense():
    qkv = VarlenQKV(randn(4096, 8, 128), randn(4096, 8, 128), randn(4096, 8, 128), (4096,), (4096,))
    dense = trtllm.run(qkv, KernelPlan(TRTLLM_ATTN, SCALE)).out
    barely = trtllm.run(qkv, KernelPlan(TRTLLM_ATTN, SCALE, skip_factor=1e-6 * 4096)).out
    assert rel_err(barely, dense) <= 1e-3


def test_skip_decisions_follow_the_reference_tiles(trtllm_gpu):
    """The kernel skips what the reference backend at 128 × 128 tiles skips (Hopper's granularity)."""
    if trtllm_gpu not in trtllm.FMHA_V2_ARCHS:
        pytest.skip("tile granularity measured on Hopper only")
    tokens, heads, lam = 8192, 4, 0.1
    q, k, v = peaky(tokens, heads)
    qkv = VarlenQKV(q, k, v, (tokens,), (tokens,))
    dense = trtllm.run(qkv, KernelPlan(TRTLLM_ATTN, SCALE)).out
    skipped = trtllm.run(qkv, KernelPlan(TRTLLM_ATTN, SCALE, skip_factor=lam * tokens)).out
    ref, n_skipped, n_total = reference_attention(q, k, v, SCALE, skip_lambda=lam, tile=(128, 128))
    assert n_skipped / n_total > 0.2  # the data is peaky enough for the test to mean something
    kernel_vs_ref, kernel_vs_dense = rel_err(skipped, ref), rel_err(skipped, dense)
    assert kernel_vs_ref < 5e-3 and kernel_vs_ref < kernel_vs_dense, (kernel_vs_ref, kernel_vs_dense)


def test_auto_picks_trtllm_for_every_non_causal_shape(trtllm_gpu):
    plan = KernelPlan(AUTO, SCALE)
    self_attn = VarlenQKV(randn(1024, 8, 128), randn(1024, 8, 128), randn(1024, 8, 128), (1024,), (1024,))
    assert select_backend(AUTO, plan, self_attn).name == TRTLLM_ATTN
    cross = VarlenQKV(randn(1024, 8, 128), randn(512, 8, 128), randn(512, 8, 128), (1024,), (512,))
    assert select_backend(AUTO, plan, cross).name == TRTLLM_ATTN
    long_context = VarlenQKV(randn(512, 8, 128), randn(1024, 8, 128), randn(1024, 8, 128), (512,), (1024,))
    assert select_backend(AUTO, plan, long_context).name == TRTLLM_ATTN


def test_warmup_is_quick_once_built():
    trtllm.warmup()  # builds or fetches on a fresh machine
    timings = trtllm.warmup()
    assert timings and all(math.isfinite(t) and t < 30 for t in timings.values()), timings

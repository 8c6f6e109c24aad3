"""The Skip-Softmax and SAGE rules at their edges, through the public API: lengths that differ (cross-attention),
a timestep exactly at the gate, sizes past the reference's query chunk, the sparsity's denominator, the
quantization grids' maxima against the formats they document, and K smoothing where it matters."""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.attention_dispatch import attention_backend, dispatch_attention_fn

from diffusers_trtllm import BACKEND_NAME, enable_trtllm_attention, set_dispatch_config
from diffusers_trtllm.backends.reference import QUERY_CHUNK, reference_attention
from diffusers_trtllm.quant import SageSemantics, quantize_blocks, quantize_p, quantize_sequence

from helpers import rel_err, tiny_wan, wan_inputs


def positional_qkv(positions: torch.Tensor, heads: int = 2, dim: int = 32, sharpness: float = 3.0,
                   dtype=torch.float32):
    """Q or K rows for tokens at ``positions`` whose scores peak where positions are close, and V."""
    freqs = torch.logspace(-3, -0.5, dim // 2, dtype=torch.float64)[None]
    angle = positions.double()[:, None] * freqs
    features = torch.cat([angle.sin(), angle.cos()], 1)[:, None].expand(len(positions), heads, dim)
    x = (features + 0.3 * torch.randn(len(positions), heads, dim, dtype=torch.float64)) * sharpness
    return x.to(dtype)


# --- an explicit threshold is scaled by the key length --------------------------------------------------------

@pytest.fixture
def dispatch_config():
    yield set_dispatch_config
    set_dispatch_config(None)


def test_explicit_threshold_in_cross_attention_is_lambda_times_the_key_length(dispatch_config):
    """1,024 queries on 384 keys: the kernel's factor is λ·384, so every query tile skips with λ itself; a factor
    of λ·1,024 (the query length) would skip with 8/3 λ, which skips more here."""
    sq, skv, lam, scale = 1024, 384, 2.0 ** -6, 32 ** -0.5  # λ·384 / 384 is exactly λ in floating point
    q = positional_qkv(torch.arange(sq))
    k = positional_qkv(torch.linspace(0, sq - 1, skv))
    v = torch.randn(skv, 2, 32)
    dispatch_config({"default": {"backend": "TORCH_REFERENCE", "skip_softmax": {"threshold": lam}}})
    with attention_backend(BACKEND_NAME):
        out = dispatch_attention_fn(q[None], k[None], v[None], scale=scale)[0]
    expected, skipped, total = reference_attention(q, k, v, scale, skip_lambda=lam)
    by_query_length, skipped_by_query_length, _ = reference_attention(q, k, v, scale, skip_lambda=lam * sq / skv)
    assert 0 < skipped < skipped_by_query_length < total  # the rule is exercised and the two factors differ
    assert torch.equal(out, expected)
    assert not torch.allclose(out, by_query_length, atol=1e-4)


# --- the timestep gate: off while t > D, on at t == D ---------------------------------------------------------

def sparsity_of_one_call(config, timestep: int) -> float | None:
    """Overall achieved sparsity of one tiny-Wan transformer call at ``timestep`` (of 1,000 train timesteps)."""
    transformer = tiny_wan()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # λ >= 1 and the host read of the timestep argument both warn
        handle = enable_trtllm_attention(transformer, config)
    with handle, torch.no_grad():
        transformer(**wan_inputs(batch=1, frames=3, timestep=timestep))
        return handle.stats.summary()["sparsity"]


SKIP_EVERY_TILE = 1e6  # λ: every KV tile after a query tile's first one is skipped (scores differ by far less)


@pytest.mark.parametrize("timestep,skips", [(501, False), (500, True), (499, True)])
def test_timestep_gate_skips_from_the_step_whose_timestep_equals_it(timestep, skips):
    """D = 0.5 and t = timestep / 1000: t = 0.501 runs dense, t = 0.5 exactly skips."""
    config = {"default": {"backend": "TORCH_REFERENCE", "skip_softmax": {
        "threshold": SKIP_EVERY_TILE, "disabled_until_timestep": 0.5}}}
    sparsity = sparsity_of_one_call(config, timestep)
    assert (sparsity > 0) if skips else (sparsity is None)  # a call the gate kept dense skipped nothing


# --- the sparsity is skipped tiles over all tiles -------------------------------------------------------------

def test_sparsity_is_skipped_tiles_over_all_tiles_per_layer_step_and_call():
    """192 video tokens (2 query tiles) on 192 keys (2 KV tiles) in self-attention, on 512 text keys (4 KV tiles)
    in cross-attention, 2 heads, 2 layers; skipping every tile it may skips all but each query tile's first."""
    config = {"default": {"backend": "TORCH_REFERENCE", "skip_softmax": {"threshold": SKIP_EVERY_TILE}}}
    transformer = tiny_wan()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = enable_trtllm_attention(transformer, config)
    with handle, torch.no_grad():
        transformer(**wan_inputs(batch=1, frames=3))
        summary, records = handle.stats.summary(), handle.stats.records
    for (_, layer, _, _), record in records.items():
        assert record.sparsity == (0.5 if layer.endswith("attn1") else 0.75)
    heads, query_tiles = 2, 2
    self_skipped, self_total = heads * query_tiles * 1, heads * query_tiles * 2
    cross_skipped, cross_total = heads * query_tiles * 3, heads * query_tiles * 4
    for block in range(2):
        assert summary["per_layer"][f"transformer.blocks.{block}.attn1"] == self_skipped / self_total == 0.5
        assert summary["per_layer"][f"transformer.blocks.{block}.attn2"] == cross_skipped / cross_total == 0.75
    overall = (2 * self_skipped + 2 * cross_skipped) / (2 * self_total + 2 * cross_total)
    assert summary["sparsity"] == overall == 2 / 3
    assert list(summary["per_step"].values()) == [overall]


# --- the causal reference past its query chunk ----------------------------------------------------------------

@pytest.mark.parametrize("sq,skv", [(2300, 2300), (2200, 2100)])
def test_causal_reference_past_its_query_chunk_matches_sdpa(sq, skv):
    """Queries beyond the first chunk of rows keep their own positions in the causal mask (the last query sees the
    last key; a query that sees no key gets 0)."""
    assert sq > QUERY_CHUNK
    q = torch.randn(sq, 1, 16, dtype=torch.float64)
    k, v = torch.randn(skv, 1, 16, dtype=torch.float64), torch.randn(skv, 1, 16, dtype=torch.float64)
    out, _, _ = reference_attention(q, k, v, 0.25, causal=True)
    mask = torch.ones(sq, skv, dtype=torch.bool).tril(skv - sq)
    expected = F.scaled_dot_product_attention(*(x.transpose(0, 1) for x in (q, k, v)), attn_mask=mask,
                                              scale=0.25).transpose(0, 1)
    expected = torch.where(mask.any(1)[:, None, None], expected, 0.0)  # SDPA gives NaN where a row sees no key
    assert (out - expected).abs().max().item() < 1e-12


# --- the quantization grids' maxima are the formats' ----------------------------------------------------------

FP8_E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448: the OCP fp8 e4m3 format (no infinities)
INT8_MAX = torch.iinfo(torch.int8).max  # 127: symmetric int8


@pytest.mark.parametrize("dtype_qk,grid_max", [("fp8_e4m3", FP8_E4M3_MAX), ("int8", INT8_MAX)])
@pytest.mark.parametrize("block", [1, 4, 16])
def test_every_block_uses_its_formats_whole_range(dtype_qk, grid_max, block):
    """Each block's largest magnitude lands on the format's largest finite value: a smaller maximum wastes range,
    a larger one overflows the kernels' int8 / fp8 registers."""
    x = torch.randn(48, 3, 64, dtype=torch.float64) * torch.logspace(-2, 2, 48, dtype=torch.float64)[:, None, None]
    values, scales = quantize_blocks(x, block, dtype_qk)
    per_block = values.abs().reshape(48 // block, block, 3, 64).amax(dim=(1, 3))  # [blocks, heads]
    assert torch.equal(per_block, torch.full_like(per_block, grid_max))
    amax = x.abs().reshape(48 // block, block, 3, 64).amax(dim=(1, 3))
    assert torch.allclose(scales.T, amax / grid_max, rtol=1e-15, atol=0)


def test_v_and_p_use_the_fp8_range():
    v = torch.randn(40, 2, 64, dtype=torch.float64) * 7
    sage = quantize_sequence(v, v, v, SageSemantics("int8", 1, 16))
    assert torch.equal(sage.v.abs().amax(0), torch.full((2, 64), FP8_E4M3_MAX, dtype=torch.float64))
    assert torch.allclose(sage.v_scale, v.abs().amax(0) / FP8_E4M3_MAX, rtol=1e-15, atol=0)
    # P in [0, 1] is stored as fp8(P · 448) unless a kernel's semantics give another scale
    p = torch.tensor([1.0, 0.5, 2.0 ** -9, 0.0], dtype=torch.float64)
    assert quantize_p(p).tolist() == [FP8_E4M3_MAX, 224.0, 0.875, 0.0]
    assert quantize_p(p, 256.0).tolist() == [256.0, 128.0, 0.5, 0.0]


# --- K smoothing ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype_qk,bound", [("int8", 0.05), ("fp8_e4m3", 0.07)])
def test_sage_error_stays_within_the_bound_only_because_k_is_smoothed(dtype_qk, bound):
    """Real K carries a large per-channel offset. Softmax ignores it, but quantized unsmoothed, the offset takes the
    grid's range: each block's step grows with it and the error leaves the bound (unsmoothed: > 3x the bound)."""
    q, k, v = (torch.randn(600, 2, 128, dtype=torch.float64) for _ in range(3))
    k = k + 40.0 * torch.randn(1, 2, 128, dtype=torch.float64)
    exact = F.scaled_dot_product_attention(*(x.transpose(0, 1) for x in (q, k, v))).transpose(0, 1)
    out, _, _ = reference_attention(q, k, v, 128 ** -0.5, quant=SageSemantics(dtype_qk, 1, 16))
    assert rel_err(out, exact) < bound
    # the same attention on K without its offset: smoothing makes the two all but identical
    centred, _, _ = reference_attention(q, k - k.mean(0), v, 128 ** -0.5, quant=SageSemantics(dtype_qk, 1, 16))
    assert rel_err(out, centred) < 1e-6
    assert math.isfinite(rel_err(out, exact))

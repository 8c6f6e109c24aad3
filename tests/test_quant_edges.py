"""SAGE quantization (diffusers_trtllm.quant) at its edges: values past a grid's end saturate to it, Q and K use
the grid they are configured for, K's scale blocks (``k_block`` tokens, or one per sequence and head), and the
batch-wide statistics (K's mean, V's scales) replacing a sequence's own."""

import pytest
import torch

from diffusers_trtllm.kernels.numerics import FP8_MAX, INT8_MAX
from diffusers_trtllm.quant import (SageSemantics, batch_statistics, expand_block_scales, quantize_blocks,
                                    quantize_sequence, round_to)


@pytest.mark.parametrize("dtype_qk,grid_max", [("int8", INT8_MAX), ("fp8_e4m3", FP8_MAX)])
def test_values_past_the_grid_saturate_at_both_ends(dtype_qk, grid_max):
    x = torch.tensor([-1e4, -grid_max - 1, grid_max + 1, 1e4])
    assert round_to(x, dtype_qk).tolist() == [-grid_max, -grid_max, grid_max, grid_max]


def sequence(tokens: int = 24, heads: int = 2, dim: int = 8, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # a per-token spread, so that blocks of tokens have different maxima
    spread = torch.linspace(0.5, 4.0, tokens)[:, None, None]
    return [(torch.randn(tokens, heads, dim, generator=g) * spread + 1.5).to(dtype) for _ in range(3)]


@pytest.mark.parametrize("dtype_qk", ["int8", "fp8_e4m3"])
def test_q_and_k_take_their_configured_grid_and_blocks(dtype_qk):
    """Q per 4 tokens, K (smoothed) per 8 tokens, both on the configured grid: int8 keeps integers that fp8 e4m3
    cannot hold (125 lies between its neighbours 120 and 128)."""
    q, k, v = sequence()
    sage = quantize_sequence(q, k, v, SageSemantics(dtype_qk, 4, 8))
    q_values, q_scales = quantize_blocks(q, 4, dtype_qk)
    k_values, k_scales = quantize_blocks(k - k.mean(0), 8, dtype_qk)
    assert torch.equal(sage.q, q_values) and torch.equal(sage.k, k_values)
    assert torch.equal(sage.q_scale, expand_block_scales(q_scales, 4, 24))
    assert torch.equal(sage.k_scale, expand_block_scales(k_scales, 8, 24))
    assert k_scales.shape == (2, 3) and len(set(k_scales[0].tolist())) == 3  # three blocks, three scales
    if dtype_qk == "int8":
        off_fp8_grid = sage.q != round_to(sage.q, "fp8_e4m3")
        assert off_fp8_grid.any()


def test_k_block_0_is_one_scale_per_sequence_and_head():
    q, k, v = sequence()
    sage = quantize_sequence(q, k, v, SageSemantics("int8", 4, 0))
    smoothed = k - k.mean(0)
    expected = smoothed.abs().amax(dim=(0, 2)) / INT8_MAX  # [heads]
    assert torch.allclose(sage.k_scale, expected[None, :, None].expand(24, 2, 1), rtol=1e-6, atol=0)
    assert torch.equal(sage.k, quantize_blocks(smoothed, 24, "int8")[0])


def test_batch_statistics_are_over_every_token_of_the_packed_batch():
    k = torch.tensor([[[1.0, -2.0]], [[3.0, 4.0]], [[5.0, 0.0]]], dtype=torch.float64)  # [tokens, heads, D]
    v = torch.tensor([[[448.0, -8.0]], [[-896.0, 4.0]], [[1.0, 2.0]]], dtype=torch.float64)
    k_mean, v_scale = batch_statistics(k, v)
    assert k_mean.tolist() == [[3.0, 2 / 3]] and v_scale.tolist() == [[2.0, 8 / FP8_MAX]]


def test_batch_statistics_replace_the_sequences_own():
    """One sequence of a packed batch of two quantized with the batch's K mean and V scales, not its own."""
    q, k, v = sequence(seed=1)
    _, k_other, v_other = sequence(seed=2)
    k_mean, v_scale = batch_statistics(torch.cat([k, k_other * 3]), torch.cat([v, v_other * 3]))
    sage = quantize_sequence(q, k, v, SageSemantics("fp8_e4m3", 4, 8, batch_stats=True), k_mean, v_scale)
    assert not torch.allclose(k_mean, k.mean(0)) and (v_scale > v.abs().amax(0) / FP8_MAX).all()
    assert torch.equal(sage.k, quantize_blocks(k - k_mean, 8, "fp8_e4m3")[0])
    assert torch.equal(sage.v_scale, v_scale) and torch.equal(sage.v, round_to(v / v_scale, "fp8_e4m3"))


def test_a_low_precision_sequence_stays_in_its_dtype_with_float32_statistics():
    q, k, v = sequence(dtype=torch.bfloat16)
    k_mean, v_scale = batch_statistics(k.float(), v.float())
    sage = quantize_sequence(q, k, v, SageSemantics("int8", 4, 8, batch_stats=True), k_mean, v_scale)
    assert {x.dtype for x in (sage.q, sage.q_scale, sage.k, sage.k_scale, sage.v, sage.v_scale)} == {torch.bfloat16}

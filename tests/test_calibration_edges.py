"""One-pass Skip-Softmax counting (``calibration.skip_gaps`` / ``count_skips``) at its edges: unequal query and
key heads (GQA), a gap exactly at log λ, sizes past its query and key chunks, causal rows that see no key, against
the reference backend; and the precision the gaps are computed in."""

import math

import pytest
import torch

from diffusers_trtllm.backends.reference import reference_attention
from diffusers_trtllm.calibration import count_skips, skip_gaps


def peaky(s: int, heads: int, d: int = 32, sharpness: float = 3.0) -> torch.Tensor:
    pos = torch.arange(s, dtype=torch.float64)[:, None] * torch.logspace(-3, -0.5, d // 2, dtype=torch.float64)
    base = torch.cat([pos.sin(), pos.cos()], 1)[:, None].expand(s, heads, d)
    return (base + 0.3 * torch.randn(s, heads, d, dtype=torch.float64)) * sharpness


def gqa_problem(s=600, heads_q=6, heads_kv=2, d=32):
    """Key heads that differ (each one sharper than the last), so pairing a query head with the wrong key head
    changes its gaps."""
    q = peaky(s, heads_q, d)
    k = peaky(s, heads_kv, d) * torch.linspace(0.3, 1.5, heads_kv, dtype=torch.float64)[None, :, None]
    return q, k, torch.randn(s, heads_kv, d, dtype=torch.float64)


def test_gqa_query_head_h_is_counted_against_key_head_h_over_the_group_size():
    """6 query heads on 2 key heads: query heads 0-2 share key head 0, 3-5 key head 1 (as the kernels and the
    reference group them)."""
    q, k, _ = gqa_problem()
    gaps = skip_gaps(q, k, 32 ** -0.5, tile=(64, 128))
    for h in range(6):
        alone = skip_gaps(q[:, h:h + 1], k[:, h // 3:h // 3 + 1], 32 ** -0.5, tile=(64, 128))
        assert torch.equal(gaps[h:h + 1], alone)


def test_gqa_counts_equal_the_reference_for_every_lambda():
    q, k, v = gqa_problem()
    lambdas = [1e-3, 0.02, 0.1, 0.5]
    counts = count_skips(skip_gaps(q, k, 32 ** -0.5, tile=(64, 128)), lambdas).tolist()
    expected = [int(reference_attention(q, k, v, 32 ** -0.5, skip_lambda=lam, tile=(64, 128))[1]) for lam in lambdas]
    assert counts == expected and 0 < counts[0] < counts[-1]


def test_a_gap_equal_to_log_lambda_is_not_skipped():
    """The rule is exp(gap) < λ, strict: a tile whose gap is exactly log λ stays."""
    gaps = torch.tensor([[[math.inf, math.log(0.25), math.log(0.5) - 1e-12, -math.inf]]], dtype=torch.float64)
    assert count_skips(gaps, [0.25, 0.5, 1.0]).tolist() == [1, 3, 3]


@pytest.mark.parametrize("causal", [False, True])
def test_counts_past_the_query_and_key_chunks_equal_the_reference(causal):
    """Chunks of 128 query rows and 256 keys (the defaults are 2,048 and 4,096) on 400 × 600: rows of the second
    and later chunks keep their positions (causal) and their own running max."""
    q, k = peaky(400, 2), peaky(600, 2)
    v = torch.randn(600, 2, 32, dtype=torch.float64)
    lambdas = [0.01, 0.3]
    gaps = skip_gaps(q, k, 32 ** -0.5, tile=(64, 128), causal=causal, query_chunk=128, kv_chunk=256)
    # float64 matmuls over other chunk sizes may round differently (a CPU's BLAS blocks by shape): a few ulps
    torch.testing.assert_close(gaps, skip_gaps(q, k, 32 ** -0.5, tile=(64, 128), causal=causal), rtol=1e-12, atol=0)
    expected = [int(reference_attention(q, k, v, 32 ** -0.5, causal=causal, skip_lambda=lam, tile=(64, 128))[1])
                for lam in lambdas]
    assert count_skips(gaps, lambdas).tolist() == expected


def test_causal_counts_with_more_queries_than_keys_equal_the_reference():
    """Bottom-right causal on 300 queries × 200 keys: the first 100 rows see no key, so their tiles are masked
    (skipped for every λ) from the first KV tile on, before any running max exists."""
    q, k = peaky(300, 2), peaky(200, 2)
    v = torch.randn(200, 2, 32, dtype=torch.float64)
    lambdas = [0.01, 0.3, 1.0]
    counts = count_skips(skip_gaps(q, k, 32 ** -0.5, tile=(64, 64), causal=True), lambdas).tolist()
    expected = [int(reference_attention(q, k, v, 32 ** -0.5, causal=True, skip_lambda=lam, tile=(64, 64))[1])
                for lam in lambdas]
    assert counts == expected


@pytest.mark.parametrize("dtype,gap_dtype", [(torch.float64, torch.float64), (torch.float32, torch.float32),
                                             (torch.bfloat16, torch.float32)])
def test_gaps_are_float64_for_float64_inputs_and_float32_otherwise(dtype, gap_dtype):
    q, k = peaky(128, 1).to(dtype), peaky(256, 1).to(dtype)
    assert skip_gaps(q, k, 32 ** -0.5).dtype == gap_dtype



def test_tiles_of_negative_scores_at_both_ends_count_as_the_reference_does():
    """Scores -5 on the first KV tile, 10 on the second, -5 on a half tile of 8 keys at the end: the first tile is
    never skipped (no running max yet: gap +inf, not -5 against a running max of 0), and the last one's 8 padding
    keys score -inf (its gap is -15, not -10 as padding scored 0 would make it)."""
    unit = torch.zeros(4, dtype=torch.float64)
    unit[0] = 1.0
    q = unit.expand(16, 1, 4)
    k = torch.cat([(-5.0 * unit).expand(16, 1, 4), (10.0 * unit).expand(16, 1, 4), (-5.0 * unit).expand(8, 1, 4)])
    v = torch.randn(40, 1, 4, dtype=torch.float64)
    gaps = skip_gaps(q, k, 1.0, tile=(16, 16))
    assert gaps.tolist() == [[[math.inf, 15.0, -15.0]]]
    lambdas = [1e-5, 0.01]  # log λ: -11.5 and -4.6, between the gaps the two mistakes would give
    expected = [int(reference_attention(q, k, v, 1.0, skip_lambda=lam, tile=(16, 16))[1]) for lam in lambdas]
    assert count_skips(gaps, lambdas).tolist() == expected == [1, 1]


@pytest.mark.gpu
def test_counts_on_the_gpu_stay_there_and_equal_the_cpus():
    q, k = peaky(600, 2), peaky(600, 2)
    lambdas = [0.01, 0.3]
    on_cpu = count_skips(skip_gaps(q, k, 32 ** -0.5, tile=(64, 128), kv_step=256), lambdas)
    gaps = skip_gaps(q.cuda(), k.cuda(), 32 ** -0.5, tile=(64, 128), kv_step=256)
    counts = count_skips(gaps, lambdas)
    assert gaps.device.type == counts.device.type == "cuda"
    assert counts.tolist() == on_cpu.tolist()

"""TORCH_REFERENCE's rules at their edges: the backend runs each sequence with the semantics of the SAGE kernel it
stands for (the CPU's for this batch's lengths and heads; a GPU kernel's batch-wide statistics and KV step), a
sample with no valid token, and the fp8 tensor-core emulation's shapes and precision."""

import math

import pytest
import torch

from diffusers_trtllm import ops
from diffusers_trtllm.backends import reference, run_backend
from diffusers_trtllm.backends.base import KernelPlan, VarlenQKV
from diffusers_trtllm.backends.reference import aligned_sum, fp8_gmma_matmul, reference_attention
from diffusers_trtllm.backends.trtllm import fmha_v2_sage_semantics, sage_semantics
from diffusers_trtllm.config import AttnQuantSpec
from diffusers_trtllm.quant import SageSemantics, batch_statistics
from diffusers_trtllm.run_state import initial_settings

from helpers import counted_op, rel_err
from test_semantics_edges import positional_qkv



def positional(n: int):
    """q, k, v ``[n, 2, 32]`` float32 whose scores peak near the diagonal (tiles far from it are skippable)."""
    positions = torch.arange(n)
    return positional_qkv(positions), positional_qkv(positions), torch.randn(n, 2, 32)


@pytest.mark.parametrize("factor", [0.0, 400.0, 512.0], ids=["dense", "skipping", "lambda_1"])
def test_sage_on_the_cpu_samples_query_tiles_by_the_batchs_lengths_and_query_heads(factor):
    """The Triton kernel's sampled skipping: its sample of query tiles depends on the batch's query lengths and
    query heads (2 heads here: every 2nd tile; counting the 64 channels as heads would give every 4th). It holds at
    λ = 1 exactly (factor 512 on 512 keys) as below, and SAGE without skipping is the same kernel dense."""
    s, heads, dim, tile = 512, 2, 64, (16, 64)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, s, heads, dim, generator=g) for _ in range(3))
    q[:, :, 0] *= 3  # head 0 peakier: it skips more than head 1
    quant = AttnQuantSpec("int8")
    settings = initial_settings(factor)
    out, counts, _ = counted_op(q, k, v, None, settings, "TORCH_REFERENCE", dim ** -0.5, False, ops.encode_quant(quant),
                          False, *tile, True)
    semantics = sage_semantics(quant, "cpu", (s,), (s,), heads, tile)
    assert semantics.skip_sample == (2, 0.3)
    expected, skipped, total = reference_attention(q[0], k[0], v[0], dim ** -0.5, skip_lambda=factor / s,
                                                   quant=semantics, tile=tile)
    assert torch.equal(out[0], expected)
    assert counts == [int(skipped), total, 1, 1] and (0 < skipped) == (factor > 0)


def test_sage_on_the_cpu_samples_by_the_query_tiles_of_the_calls_tile():
    """64 heads of 512 queries in tiles of 16 rows: 32 query tiles per head, sampled every 4th (in the default
    tiles of 128 rows there would be 4, sampled every 2nd)."""
    s, heads, dim, tile, factor = 512, 64, 4, (16, 64), 400.0
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, s, heads, dim, generator=g) for _ in range(3))
    q[:, :, ::2] *= 3
    quant = AttnQuantSpec("int8")
    out, counts, _ = counted_op(q, k, v, None, initial_settings(factor), "TORCH_REFERENCE", dim ** -0.5, False,
                          ops.encode_quant(quant), False, *tile, True)
    semantics = sage_semantics(quant, "cpu", (s,), (s,), heads, tile)
    assert semantics.skip_sample == (4, 0.3)
    expected, skipped, total = reference_attention(q[0], k[0], v[0], dim ** -0.5, skip_lambda=factor / s,
                                                   quant=semantics, tile=tile)
    assert torch.equal(out[0], expected) and counts == [int(skipped), total, 1, 1] and 0 < skipped


def run_with_semantics(monkeypatch, semantics, q, k, v, lens, skip_factor, tile=(128, 128)):
    """The backend on a packed batch, as if its SAGE kernel had ``semantics`` (a GPU's)."""
    monkeypatch.setattr(reference, "sage_semantics", lambda *args: semantics)
    plan = KernelPlan("TORCH_REFERENCE", 32 ** -0.5, quant=AttnQuantSpec(semantics.dtype_qk), skip_factor=skip_factor,
                      tile=tile, count_skips=True)
    return run_backend("TORCH_REFERENCE", VarlenQKV(q, k, v, lens, lens), plan)


@pytest.mark.parametrize("query_heads", [2, 4], ids=["mha", "gqa"])
def test_batch_wide_statistics_quantize_every_sequence_with_the_whole_batchs_k_mean_and_v_scale(monkeypatch,
                                                                                                  query_heads):
    """trtllm-gen's semantics: K's mean and V's scales over every token of the batch, not per sequence (the two
    sequences' K are offset oppositely, so the two differ); with grouped heads each key head's statistics serve
    its query heads."""
    lens = (200, 130)
    torch.manual_seed(0)
    parts = [positional(n) for n in lens]
    q, k, v = (torch.cat(x) for x in zip(*parts))
    q = q.repeat_interleave(query_heads // 2, dim=1)
    k[:lens[0]] += 2.0
    k[lens[0]:] -= 2.0
    v[lens[0]:] *= 4.0
    semantics = SageSemantics("int8", 1, 16, batch_stats=True)
    result = run_with_semantics(monkeypatch, semantics, q, k, v, lens, 0.0)
    k_mean, v_scale = batch_statistics(k, v)
    rows = (slice(0, lens[0]), slice(lens[0], None))
    for r in rows:
        expected, _, _ = reference_attention(q[r], k[r], v[r], 32 ** -0.5, quant=semantics, k_mean=k_mean,
                                             v_scale=v_scale)
        assert torch.equal(result.out[r], expected)
    for left_out in ("k_mean", "v_scale"):  # each matters for the first sequence
        stats = {"k_mean": k_mean, "v_scale": v_scale, left_out: None}
        other, _, _ = reference_attention(q[rows[0]], k[rows[0]], v[rows[0]], 32 ** -0.5, quant=semantics, **stats)
        assert not torch.equal(other, result.out[rows[0]]), left_out


def test_skips_are_decided_per_kv_step_of_the_sage_kernel(monkeypatch):
    """FMHAv2's SAGE kernel decides a 256-key step's tiles against the running max at the step's start."""
    s = 1024
    torch.manual_seed(3)
    q, k, v = positional(s)
    semantics = fmha_v2_sage_semantics(64, fp8_accumulator_bits=None)  # exact sums: fast, same decisions
    assert semantics.kv_step == 256
    result = run_with_semantics(monkeypatch, semantics, q, k, v, (s,), 40.0)
    expected, skipped, total = reference_attention(q, k, v, 32 ** -0.5, skip_lambda=40.0 / s, quant=semantics,
                                                   tile=semantics.skip_tile, kv_step=256)
    per_tile_step, skipped_per_tile_step, _ = reference_attention(q, k, v, 32 ** -0.5, skip_lambda=40.0 / s,
                                                                  quant=semantics, tile=semantics.skip_tile)
    assert torch.equal(result.out, expected) and result.skipped_tiles == skipped and result.total_tiles == total
    assert skipped != skipped_per_tile_step  # the rule is exercised


@pytest.mark.parametrize("skip_factor", [0.0, 2.0])
def test_a_sample_without_valid_tokens_gets_zeros(skip_factor):
    """A batch whose first sample has no valid token: its rows are 0, the other sample is attended as alone,
    with and without Skip-Softmax."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 2, 16, generator=g)
    out = torch.ops.diffusers_trtllm.attention(q, q, q, torch.tensor([0, 6]), initial_settings(skip_factor),
                                               "TORCH_REFERENCE", 0.25, False, "", False, 128, 128, True)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    expected = reference_attention(q[1], q[1], q[1], 0.25, skip_lambda=skip_factor / 6)[0]
    torch.testing.assert_close(out[1], expected, rtol=0, atol=0)


def kept_key_tiles(key_tiles: int, kept=((0, 2),)):
    """64 queries on ``key_tiles`` tiles of 16 keys; in head h every query's scores peak in the key tiles
    ``kept[h]`` only: each query tile keeps those and skips the rest."""
    g = torch.Generator().manual_seed(0)
    heads = len(kept)
    q = torch.zeros(64, heads, 16)
    q[..., 0] = 4.0
    k = torch.zeros(16 * key_tiles, heads, 16)
    k[..., 0] = -4.0
    for h, tiles in enumerate(kept):
        for t in tiles:
            k[16 * t:16 * (t + 1), h, 0] = 4.0
    q, k = (x + 0.1 * torch.randn(x.shape, generator=g) for x in (q, k))
    return q, k, torch.randn(k.shape, generator=g)


@pytest.mark.parametrize("key_tiles, pays_from, pays", [
    (5, 0.60, True), (5, 0.61, False),  # the sample skips 3 of 5 key tiles, 60 % exactly
    (7, 0.71, True), (7, 0.72, False),  # 5 of 7, 71.4 %: within one percent below 72 %
])
def test_skipping_pays_from_a_sample_rate_of_pays_from_exactly(key_tiles, pays_from, pays):
    """The kernel's integer test, skipped · 100 >= round(pays_from · 100) · tiles: query tiles 0 and 2 are the sample
    (every 2nd); tiles 1 and 3 skip as they do only where the sample's rate reaches ``pays_from``."""
    q, k, v = kept_key_tiles(key_tiles)
    semantics = SageSemantics("int8", 1, 16, skip_sample=(2, pays_from))
    _, skipped, total = reference_attention(q, k, v, 0.25, skip_lambda=0.1, quant=semantics, tile=(16, 16))
    per_query_tile = key_tiles - 2
    assert total == 4 * key_tiles
    assert int(skipped) == (4 if pays else 2) * per_query_tile


def test_a_sample_that_always_pays_changes_nothing_else_of_the_run():
    """With ``pays_from`` 0 every query tile skips as without a sample: the sampled and the other tiles both run with
    the call's KV step and batch statistics."""
    torch.manual_seed(5)
    q, k, v = positional(512)
    k_mean, v_scale = batch_statistics(k + 1.0, v * 3.0)  # statistics other than the sequence's own
    run = dict(skip_lambda=0.05, tile=(64, 128), kv_step=256, k_mean=k_mean, v_scale=v_scale)
    plain, skipped, total = reference_attention(q, k, v, 32 ** -0.5, quant=SageSemantics("int8", 1, 16), **run)
    sampled, skipped_sampled, total_sampled = reference_attention(
        q, k, v, 32 ** -0.5, quant=SageSemantics("int8", 1, 16, skip_sample=(2, 0.0)), **run)
    for left_out in ("kv_step", "k_mean", "v_scale"):  # each matters here
        other = reference_attention(q, k, v, 32 ** -0.5, quant=SageSemantics("int8", 1, 16),
                                    **{name: value for name, value in run.items() if name != left_out})
        assert not torch.equal(other[0], plain), left_out
    assert 0 < skipped
    assert torch.equal(sampled, plain) and int(skipped_sampled) == int(skipped) and total_sampled == total


def test_whether_skipping_pays_is_decided_per_head():
    """Head 0's sample skips 3 of 5 key tiles (pays at 50 %), head 1's 1 of 5 (does not): head 0's other query tiles
    skip as its sample does, head 1's run dense."""
    q, k, v = kept_key_tiles(5, kept=((0, 2), (0, 1, 2, 3)))
    semantics = SageSemantics("int8", 1, 16, skip_sample=(2, 0.5))
    _, skipped, total = reference_attention(q, k, v, 0.25, skip_lambda=0.1, quant=semantics, tile=(16, 16))
    assert total == 2 * 4 * 5
    assert int(skipped) == 4 * 3 + 2 * 1


@pytest.mark.parametrize("lam, skips", [(1.0, False), (1.0 + 2.0 ** -20, True)])
def test_a_tile_as_high_as_the_running_max_is_kept_up_to_lambda_1(lam, skips):
    """The rule is strict, exp(tile max − running max) < λ: a key tile repeating the first one (a gap of 0, exp 1)
    is kept at λ = 1 exactly and skipped just above it."""
    g = torch.Generator().manual_seed(0)
    q, first = torch.randn(16, 1, 16, generator=g), torch.randn(16, 1, 16, generator=g)
    k = torch.cat([first, first])
    _, skipped, total = reference_attention(q, k, torch.randn(32, 1, 16, generator=g), 0.25, skip_lambda=lam,
                                            tile=(16, 16))
    assert total == 2 and int(skipped) == int(skips)


def test_a_partial_last_key_tile_is_decided_by_its_keys_alone():
    """24 keys in tiles of 16: the last tile holds 8 keys, all far below the first tile (scores -8 against 0.5),
    so it is skipped; its 8 missing keys do not count as scores of 0."""
    q = torch.zeros(16, 1, 16)
    q[..., 0] = 1.0
    k = torch.zeros(24, 1, 16)
    k[:16, :, 0], k[16:, :, 0] = 0.5, -8.0
    _, skipped, total = reference_attention(q, k, torch.randn(24, 1, 16), 1.0, skip_lambda=0.1, tile=(16, 16))
    assert total == 2 and int(skipped) == 1


def test_a_query_tile_that_sees_no_key_skips_every_key_tile():
    """Causal, 64 queries on 16 keys (bottom-right): query tiles 0 to 2 see no key, so their one key tile adds
    nothing and counts as skipped; their rows are 0."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(64, 1, 16, generator=g)
    k, v = (torch.randn(16, 1, 16, generator=g) for _ in range(2))
    out, skipped, total = reference_attention(q, k, v, 0.25, causal=True, skip_lambda=0.01, tile=(16, 16))
    assert total == 4 and int(skipped) == 3
    assert torch.equal(out[:48], torch.zeros_like(out[:48])) and out[48:].abs().sum() > 0


def test_queries_padded_to_the_keys_run_as_that_self_attention():
    """FMHAv2's semantics for fewer queries than keys: the queries followed by zero rows up to the key length, run
    with every setting of the call (step, tile, statistics), the real rows returned and every tile counted."""
    torch.manual_seed(6)
    q, k, v = positional(512)  # two 256-key steps: the second far from the 100 queries
    q = q[:100]
    semantics = fmha_v2_sage_semantics(64, fp8_accumulator_bits=None)
    k_mean, v_scale = batch_statistics(k + 1.0, v * 3.0)  # statistics other than the sequence's own
    run = dict(skip_lambda=0.1, tile=semantics.skip_tile, kv_step=semantics.kv_step, k_mean=k_mean, v_scale=v_scale)
    out, skipped, total = reference_attention(q, k, v, 32 ** -0.5, quant=semantics, **run)
    unpadded = SageSemantics(**{**semantics.__dict__, "q_padded_to_kv": False})
    padded_q = torch.cat([q, q.new_zeros(412, *q.shape[1:])])
    expected, expected_skipped, expected_total = reference_attention(padded_q, k, v, 32 ** -0.5, quant=unpadded, **run)
    assert torch.equal(out, expected[:100]) and 0 < int(skipped) == int(expected_skipped) and total == expected_total
    for left_out in run:  # each setting matters here
        other = reference_attention(padded_q, k, v, 32 ** -0.5, quant=unpadded,
                                    **{name: value for name, value in run.items() if name != left_out})
        assert not torch.equal(other[0][:100], out), left_out


@pytest.mark.parametrize("kv_step", [0, -128])
def test_a_kv_step_below_one_key_is_refused(kv_step):
    q = torch.randn(8, 1, 16)
    with pytest.raises(ValueError, match=f"^kv_step={kv_step} is not positive$"):
        reference_attention(q, q, q, 1.0, skip_lambda=0.1, kv_step=kv_step)


def test_one_key_per_step_is_the_smallest_kv_step():
    """One-key tiles take one-key steps: ``kv_step=1`` is what leaving it unset gives them."""
    q = torch.randn(8, 1, 16, generator=torch.Generator().manual_seed(0))
    stepped = reference_attention(q, q, q, 1.0, skip_lambda=0.1, tile=(1, 1), kv_step=1)
    assert torch.equal(stepped[0], reference_attention(q, q, q, 1.0, skip_lambda=0.1, tile=(1, 1))[0])


def test_sampled_skipping_refuses_causal_attention_saying_so():
    q = torch.randn(8, 1, 16)
    with pytest.raises(ValueError, match=r"^sampled Skip-Softmax \(SageSemantics.skip_sample\) is defined for "
                                         r"non-causal attention only$"):
        reference_attention(q, q, q, 1.0, causal=True, skip_lambda=0.1,
                            quant=SageSemantics("int8", 1, 16, skip_sample=(2, 0.3)))


# --- the fp8 tensor-core emulation ---------------------------------------------------------------------------

def small_integers(*shape, seed):
    """Integers in [-8, 8]: exact in fp8 e4m3, with products and sums exact in float32."""
    return torch.randint(-8, 9, shape, generator=torch.Generator().manual_seed(seed)).float()


@pytest.mark.parametrize("batch", [(), (2,)], ids=["matrix", "batched"])
def test_fp8_gmma_matmul_from_a_zero_accumulator_is_the_product(batch):
    """Without ``acc`` the sums start from zero: with a grid wide enough for every partial sum the emulation is
    the exact product, for plain and batched matrices, more rows than one block of 256 and a last group of 8 of the
    32 products."""
    a, b = small_integers(*batch, 300, 40, seed=0), small_integers(*batch, 40, 24, seed=1)
    got = fp8_gmma_matmul(a, b, 40)
    assert got.shape == (*batch, 300, 24) and got.dtype == torch.float32
    assert torch.equal(got, a @ b)


def test_emulated_fp8_sums_on_a_grid_finer_than_float32_equal_exact_sums():
    """The emulated path (FMHAv2's fp8 tensor-core sums) with more accumulator bits than float32 has: the same
    output as exact sums to float32 rounding and the same skipped tiles, with grouped heads and two KV steps."""
    torch.manual_seed(4)
    positions = torch.arange(256)
    q, k = positional_qkv(positions, heads=4, dim=64), positional_qkv(positions, heads=2, dim=64)
    v = torch.randn(256, 2, 64)
    runs = [reference_attention(q, k, v, 64 ** -0.5, skip_lambda=0.05, tile=(64, 64), kv_step=128,
                                quant=SageSemantics("fp8_e4m3", 64, 0, p_scale=256.0, kv_step=128,
                                                    fp8_accumulator_bits=bits)) for bits in (None, 60)]
    (exact, skipped, total), (emulated, skipped_emulated, total_emulated) = runs
    assert 0 < skipped == skipped_emulated and total == total_emulated
    torch.testing.assert_close(emulated, exact, rtol=0, atol=2e-5)
    dense = reference_attention(q.double(), k.double(), v.double(), 64 ** -0.5)[0]
    assert rel_err(exact, dense) < 0.1  # P enters P·V at the semantics' own scale (256), and leaves it


def test_emulated_fp8_sums_refuse_a_key_tile_of_a_partial_instruction_saying_so():
    q = torch.randn(64, 1, 64)
    with pytest.raises(ValueError, match=r"^tile=\(64, 48\): emulating fp8 tensor-core sums needs key tiles of whole "
                                         r"32-key instructions$"):
        reference_attention(q, q, q, 1.0, tile=(64, 48), quant=SageSemantics("fp8_e4m3", 64, 0,
                                                                              fp8_accumulator_bits=14))


def test_low_precision_inputs_are_computed_in_float32_and_returned_in_their_dtype():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(150, 2, 32, generator=g) for _ in range(3))
    in_float32 = reference_attention(q, k, v, 32 ** -0.5, skip_lambda=0.01, tile=(64, 64))[0]
    in_float64 = reference_attention(q.double(), k.double(), v.double(), 32 ** -0.5, skip_lambda=0.01,
                                     tile=(64, 64))[0]
    assert in_float32.dtype == torch.float32 and in_float64.dtype == torch.float64
    assert not torch.equal(in_float32, in_float64.float())  # float32 sums, as the kernels accumulate
    torch.testing.assert_close(in_float32, in_float64.float(), rtol=0, atol=1e-5)
    bf16 = [x.bfloat16() for x in (q, k, v)]
    out = reference_attention(*bf16, 32 ** -0.5, skip_lambda=0.01, tile=(64, 64))[0]
    expected = reference_attention(*(x.float() for x in bf16), 32 ** -0.5, skip_lambda=0.01, tile=(64, 64))[0]
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected.bfloat16())


def test_a_float64_run_compares_with_lambda_in_float64():
    """A key tile whose gap to the running max is ln(0.1) + 2e-9: exp(gap) is above λ = 0.1 in float64 (kept) but
    below 0.1 rounded to float32 (it would be skipped)."""
    q = torch.zeros(16, 1, 4, dtype=torch.float64)
    q[..., 0] = 1.0
    k = torch.zeros(32, 1, 4, dtype=torch.float64)
    k[16:, :, 0] = math.log(0.1) + 2e-9
    assert torch.tensor(0.1).item() > math.exp(math.log(0.1) + 2e-9) > 0.1  # float32(0.1) > exp(gap) > 0.1
    _, skipped, total = reference_attention(q, k, torch.randn(32, 1, 4, dtype=torch.float64), 1.0, skip_lambda=0.1,
                                            tile=(16, 16))
    assert total == 2 and int(skipped) == 0


def test_aligned_sum_keeps_float64_terms_in_float64():
    """float64 terms (a float64 reference run) are truncated on their own grid, also below float32's range."""
    tiny = 2.0 ** -140
    terms = torch.tensor([[3 * tiny], [tiny / 3]], dtype=torch.float64)
    got = aligned_sum(terms, 14)
    grid = 2.0 ** (-138 - 14)  # the largest term is below 2^-138
    assert got.dtype == torch.float64
    assert got.item() == 3 * tiny + (tiny / 3 // grid) * grid


def merge_by_lse(parts):
    """Partial attentions ``(out [S, H, D], lse [S, H])`` over disjoint key chunks, merged as ring attention does."""
    out, lse = parts[0]
    for out_b, lse_b in parts[1:]:
        top = torch.maximum(lse, lse_b)
        w_a, w_b = torch.exp(lse - top), torch.exp(lse_b - top)
        out = (out * w_a[..., None] + out_b * w_b[..., None]) / (w_a + w_b)[..., None]
        lse = top + torch.log(w_a + w_b)
    return out, lse


@pytest.mark.parametrize("chunks", [2, 3])
def test_partial_results_over_key_chunks_merge_by_their_log_sum_exp(chunks):
    """Grouped heads, more keys than queries. Dense: the merged chunks are one attention, to float64 rounding, and
    the log-sum-exp is the exact one. SAGE: each chunk smooths K by its own mean, which shifts its scores by
    scale · q · mean; the log-sum-exp carries the shift, so the merged chunks are as close to exact attention as one
    SAGE call is, and a merge without the shift is not."""
    g = torch.Generator().manual_seed(chunks)
    q = torch.randn(300, 4, 64, generator=g, dtype=torch.float64)
    k = torch.randn(600, 2, 64, generator=g, dtype=torch.float64) + 0.5  # a mean that smoothing removes
    v = torch.randn(600, 2, 64, generator=g, dtype=torch.float64)
    scale, bounds = 64 ** -0.5, [600 * i // chunks for i in range(chunks + 1)]
    exact, _, _, exact_lse = reference_attention(q, k, v, scale, with_lse=True)
    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(2, dim=1)) * scale
    torch.testing.assert_close(exact_lse, torch.logsumexp(scores, dim=-1).T, rtol=1e-12, atol=1e-12)
    dense = [reference_attention(q, k[a:b], v[a:b], scale, with_lse=True) for a, b in zip(bounds, bounds[1:])]
    out, lse = merge_by_lse([(o, l) for o, _, _, l in dense])
    torch.testing.assert_close(out, exact, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, exact_lse, rtol=1e-12, atol=1e-12)

    int8 = sage_semantics(AttnQuantSpec("int8"), torch.device("cpu"), (300,), (600,))
    one_call = rel_err(reference_attention(q, k, v, scale, quant=int8)[0], exact)
    sage = [reference_attention(q, k[a:b], v[a:b], scale, quant=int8, with_lse=True)
            for a, b in zip(bounds, bounds[1:])]
    merged = rel_err(merge_by_lse([(o, l) for o, _, _, l in sage])[0], exact)
    kk = k.repeat_interleave(2, dim=1)
    unshifted = rel_err(merge_by_lse([(o, l - scale * (q * kk[a:b].mean(dim=0)).sum(-1))
                                      for (o, _, _, l), a, b in zip(sage, bounds, bounds[1:])])[0], exact)
    assert merged <= 1.1 * one_call and unshifted > 1.3 * one_call, (one_call, merged, unshifted)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_paired_tiles_decide_as_256_key_steps_over_the_tiles_a_pair_of_query_tiles_loads(seed):
    """The FMHAv2 tile-map kernel's gathered steps (SageSemantics.paired_tiles): where both query tiles of a pair
    reuse the same tiles, a pair decides as the 256-key-step kernel on its keys without those tiles (each tile
    against the running max at its step's start, a step two loaded tiles). Scores are exact sums and K's
    statistics are fixed, so both see the same fp8 scores; the map's new bits must agree tile for tile."""
    from diffusers_trtllm.backends.base import pack_tile_map, unpack_tile_map

    g = torch.Generator().manual_seed(seed)
    n, heads, tiles = 128 * 12, 2, 12
    positions = torch.arange(n, dtype=torch.float32)[:, None]
    feature = torch.cat([torch.sin(positions * torch.logspace(-3, -1, 64)),
                         torch.cos(positions * torch.logspace(-3, -1, 64))], 1)[:, None]
    q, k = (feature * 1.5 + 0.3 * torch.randn(n, heads, 128, generator=g) for _ in range(2))
    v = torch.randn(n, heads, 128, generator=g)
    k[0] = 6.0  # K's largest value in tile 0, which every pair loads: its fp8 scale is the same without other tiles
    k_mean, v_scale = batch_statistics(k, v)
    semantics = fmha_v2_sage_semantics(0, 256, fp8_accumulator_bits=None, paired_tiles=True)
    reused = torch.rand(heads, n // 128, tiles, generator=g) < 0.4  # per (head, pair of query tiles)
    reused[..., 0] = False
    tile_map = pack_tile_map(reused.repeat_interleave(2, dim=1), 1)
    lam = 0.02
    common = dict(quant=semantics, tile=(64, 128), kv_step=256, k_mean=k_mean, v_scale=v_scale)
    _, skipped, _ = reference_attention(q, k, v, 128 ** -0.5, skip_lambda=lam, tile_map=tile_map, **common)
    new = unpack_tile_map(tile_map, tiles) & ~reused.repeat_interleave(2, dim=1)
    assert int(skipped) == int(new.sum()) > 0
    unpaired = dict(common, quant=fmha_v2_sage_semantics(0, 256, fp8_accumulator_bits=None))
    for pair in range(n // 128):
        for h in range(heads):
            loaded = [t for t in range(tiles) if not reused[h, pair, t]]
            keys = torch.cat([torch.arange(128 * t, 128 * t + 128) for t in loaded])
            rows = slice(128 * pair, 128 * pair + 128)
            single = dict(unpaired, k_mean=k_mean[h:h + 1], v_scale=v_scale[h:h + 1])
            compact_map = torch.zeros(1, -(-len(keys) // 64), 1, dtype=torch.int32)
            reference_attention(q[rows, h:h + 1], k[keys, h:h + 1], v[keys, h:h + 1], 128 ** -0.5, skip_lambda=lam,
                                tile_map=compact_map, **single)
            compact = unpack_tile_map(compact_map[0, :2], len(loaded))  # the pair's two real query tiles
            expected = torch.zeros(2, tiles, dtype=torch.bool)
            expected[:, loaded] = compact
            assert torch.equal(new[h, 2 * pair:2 * pair + 2], expected), (pair, h)

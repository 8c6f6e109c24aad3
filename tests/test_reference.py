"""TORCH_REFERENCE against float64 attention: dense exactness, the Skip-Softmax rule, SAGE error bounds."""

import math
import resource

import pytest
import torch
import torch.nn.functional as F

from diffusers_trtllm.backends import run_backend
from diffusers_trtllm.backends.base import KernelPlan, VarlenQKV
from diffusers_trtllm.backends.reference import aligned_sum, fp8_gmma_matmul, reference_attention
from diffusers_trtllm.quant import SageSemantics, quantize_blocks, quantize_sequence

from helpers import counted_run, rel_err


def exact_attention(q, k, v, causal=False):
    """float64 SDPA on [S, H, D] (GQA by repeating K/V heads)."""
    rep = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(rep, dim=1) for x in (k, v))
    out = F.scaled_dot_product_attention(*(x.double().transpose(0, 1) for x in (q, k, v)), is_causal=causal)
    return out.transpose(0, 1)


def local_qkv(s=1024, h=2, d=64, sharpness=3.0, dtype=torch.float64):
    """Tokens on a line with smooth positional features: attention concentrates near the diagonal (peaky)."""
    pos = torch.arange(s, dtype=torch.float64)[:, None]
    freqs = torch.logspace(-3, -0.5, d // 2, dtype=torch.float64)[None]
    feat = torch.cat([torch.sin(pos * freqs), torch.cos(pos * freqs)], 1)[:, None].expand(s, h, d)
    q = (feat + 0.3 * torch.randn(s, h, d, dtype=torch.float64)) * sharpness
    k = (feat + 0.3 * torch.randn(s, h, d, dtype=torch.float64)) * sharpness
    return q.to(dtype), k.to(dtype), torch.randn(s, h, d, dtype=dtype)


@pytest.mark.parametrize("sq,skv,causal", [(700, 700, False), (300, 520, False), (384, 384, True), (200, 450, True)])
def test_dense_matches_float64_attention(sq, skv, causal):
    q = torch.randn(sq, 4, 32, dtype=torch.float64)
    k, v = torch.randn(skv, 2, 32, dtype=torch.float64), torch.randn(skv, 2, 32, dtype=torch.float64)
    out, skipped, total = reference_attention(q, k, v, 32 ** -0.5, causal=causal, tile=(64, 128))
    mask = torch.ones(sq, skv, dtype=torch.bool).tril(skv - sq) if causal else None  # last query sees last key
    ref = F.scaled_dot_product_attention(*(x.transpose(0, 1) for x in (q, k.repeat_interleave(2, 1),
                                                                       v.repeat_interleave(2, 1))),
                                         attn_mask=mask).transpose(0, 1)
    assert (out - ref).abs().max().item() < 1e-12
    assert skipped == 0 and total == 4 * math.ceil(sq / 64) * math.ceil(skv / 128)


def test_lambda_zero_is_dense_exactly_and_tiny_lambda_skips_nothing():
    q, k, v = local_qkv()
    dense, _, _ = reference_attention(q, k, v, 64 ** -0.5)
    zero, skipped0, _ = reference_attention(q, k, v, 64 ** -0.5, skip_lambda=0.0)
    tiny, skipped_tiny, _ = reference_attention(q, k, v, 64 ** -0.5, skip_lambda=1e-300)
    assert torch.equal(zero, dense) and torch.equal(tiny, dense)
    assert skipped0 == 0 and skipped_tiny == 0
    assert rel_err(dense, exact_attention(q, k, v)) < 1e-12


def test_skipped_tiles_grow_with_lambda_and_error_stays_small_where_attention_is_peaky():
    q, k, v = local_qkv(s=2048, sharpness=4.0)
    exact = exact_attention(q, k, v)
    counts, errors = [], []
    for lam in (1e-6, 1e-4, 1e-2, 0.1, 0.5):
        out, skipped, total = reference_attention(q, k, v, 64 ** -0.5, skip_lambda=lam)
        counts.append(skipped / total)
        errors.append(rel_err(out, exact))
    assert all(a <= b for a, b in zip(counts, counts[1:])), counts
    assert counts[-1] > 0.3 and counts[0] < counts[-1]
    assert errors[0] < 1e-6  # skipping tiles whose weight is < 1e-6 of the running max barely moves the output
    assert max(errors) < 0.1


def brute_force_skip_decisions(q, k, scale, lam, tile, kv_step=None):
    """Independent restatement of the rule: for each (head, q tile), walk KV steps keeping the running max of
    the tiles not skipped; a tile is skipped when every row's exp(tile max - running max at its step's start) < λ."""
    tq, tk = tile
    step = kv_step or tk
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    h, sq, skv = s.shape
    skipped = 0
    for head in range(h):
        for r0 in range(0, sq, tq):
            running = torch.full((min(tq, sq - r0),), -math.inf, dtype=s.dtype)
            for j0 in range(0, skv, step):
                at_start = running.clone()
                for c0 in range(j0, min(j0 + step, skv), tk):
                    tile_max = s[head, r0:r0 + tq, c0:c0 + tk].amax(-1)
                    if bool(torch.all(torch.exp(tile_max - at_start) < lam)):
                        skipped += 1
                    else:
                        running = torch.maximum(running, tile_max)
    return skipped


@pytest.mark.parametrize("tile,kv_step", [((128, 128), None), ((64, 128), None), ((32, 64), None),
                                          ((64, 128), 256), ((32, 64), 256)])
def test_skip_decisions_match_a_brute_force_restatement_of_the_rule(tile, kv_step):
    q, k, v = local_qkv(s=640, h=2, d=32, sharpness=4.0)
    for lam in (0.01, 0.2):
        _, skipped, _ = reference_attention(q, k, v, 32 ** -0.5, skip_lambda=lam, tile=tile, kv_step=kv_step)
        assert skipped == brute_force_skip_decisions(q, k, 32 ** -0.5, lam, tile, kv_step)


def test_tiles_of_one_step_are_decided_against_the_running_max_at_its_start():
    # One query; keys in tiles of 2. Step 1 (keys 0-3) sets the running max to 0; in step 2, keys 4-5 score 10
    # and keys 6-7 score 5. Against the running max at step 2's start (0) keys 6-7 are far from negligible;
    # against the max after keys 4-5 (10) they are (e^-5 < λ = 0.01).
    scores = torch.tensor([0.0, 0.0, 0.0, 0.0, 10.0, 10.0, 5.0, 5.0], dtype=torch.float64)
    q = torch.ones(1, 1, 1, dtype=torch.float64)
    k = scores[:, None, None]
    v = torch.arange(8, dtype=torch.float64)[:, None, None]
    weights = torch.softmax(scores, 0)
    without_last = torch.softmax(scores[:6], 0)
    stepped, skipped_stepped, total = reference_attention(q, k, v, 1.0, skip_lambda=0.01, tile=(1, 2), kv_step=4)
    per_tile, skipped_per_tile, _ = reference_attention(q, k, v, 1.0, skip_lambda=0.01, tile=(1, 2))
    assert (skipped_stepped, skipped_per_tile, total) == (0, 1, 4)
    assert torch.allclose(stepped.flatten(), weights @ v.flatten(), rtol=1e-12)
    assert torch.allclose(per_tile.flatten(), without_last @ v.flatten()[:6], rtol=1e-12)


def test_kv_step_must_hold_whole_tiles():
    q = torch.randn(8, 1, 16)
    with pytest.raises(ValueError, match="kv_step=192 is not a multiple of the tile's 128 keys"):
        reference_attention(q, q, q, 1.0, skip_lambda=0.1, kv_step=192)


def test_aligned_sum_truncates_every_term_to_the_bits_below_the_largest():
    terms = torch.tensor([[1.5], [2.0 ** -13], [2.0 ** -14 * 3], [-(2.0 ** -12) * 1.75]])
    # largest magnitude 1.5 < 2^1: grid 2^(1 - 14) = 2^-13; each term truncated toward zero onto it
    assert aligned_sum(terms, 14).item() == 1.5 + 2.0 ** -13 + 2.0 ** -13 - 3 * 2.0 ** -13
    assert aligned_sum(terms, 40).item() == terms.sum().item()
    assert aligned_sum(torch.zeros(3, 2), 14).tolist() == [0.0, 0.0]


def _fp8_values(*shape, generator):
    return (torch.randn(*shape, generator=generator) * 60).clamp(-448, 448).to(torch.float8_e4m3fn).float()


def test_fp8_gmma_matmul_sums_groups_of_32_into_the_accumulator():
    gen = torch.Generator().manual_seed(3)
    a, b, acc = _fp8_values(2, 300, 96, generator=gen), _fp8_values(2, 96, 40, generator=gen), torch.randn(2, 300, 40)
    exact = acc.double() + a.double() @ b.double()
    assert torch.allclose(fp8_gmma_matmul(a, b, 60, acc).double(), exact, rtol=1e-5, atol=0.1)  # float32 sums
    # brute force: the accumulator and each group of 32 products added on one truncated grid, group by group
    brute = acc.clone()
    for g in range(3):
        products = a[..., 32 * g:32 * (g + 1), None] * b[:, None, 32 * g:32 * (g + 1)]  # [2, 300, 32, 40]
        terms = torch.cat([brute[..., None, :], products], dim=-2)
        step = 2.0 ** (torch.frexp(terms.abs().amax(dim=-2)).exponent - 14).float()
        brute = (torch.trunc(terms / step[..., None, :]) * step[..., None, :]).sum(dim=-2)
    got = fp8_gmma_matmul(a, b, 14, acc)
    assert torch.equal(got, brute) and not torch.allclose(got.double(), exact, rtol=1e-5, atol=0.1)
    # a row whose group is not issued keeps its accumulator through that group
    active = torch.ones(2, 300, 3, dtype=torch.bool)
    active[:, :7] = False
    assert torch.equal(fp8_gmma_matmul(a, b, 14, acc, active)[:, :7], acc[:, :7])


@pytest.mark.parametrize("skip", [0.0, 0.02])
def test_emulated_fp8_accumulation_only_changes_how_sums_round(skip):
    """With a grid finer than float32 the emulated path equals the exact one: the scales, steps and skipped tiles
    reach the emulated sums as they reach the exact ones."""
    torch.manual_seed(4)
    q, k, v = local_qkv(s=600, h=2, d=128, dtype=torch.float32)
    base = SageSemantics("fp8_e4m3", 64, 0, p_scale=256.0, kv_step=256)
    runs = {bits: reference_attention(q, k, v, 128 ** -0.5, skip_lambda=skip, tile=(64, 128), kv_step=256,
                                      quant=SageSemantics(**{**base.__dict__, "fp8_accumulator_bits": bits}))
            for bits in (None, 60, 14)}
    assert runs[None][1:] == runs[60][1:] and (skip == 0.0 or runs[None][1] > 0)
    assert rel_err(runs[60][0], runs[None][0]) < 1e-5
    assert 1e-4 < rel_err(runs[14][0], runs[None][0]) < 2e-2  # P's fp8 steps turn accumulator rounding into noise


def test_emulated_fp8_accumulation_needs_whole_instructions_per_tile():
    q = torch.randn(64, 1, 128)
    with pytest.raises(ValueError, match="whole 32-key"):
        reference_attention(q, q, q, 1.0, tile=(64, 16),
                            quant=SageSemantics("fp8_e4m3", 64, 0, fp8_accumulator_bits=14))


def test_int8_block_quantization_error_is_at_most_half_a_step():
    x = torch.randn(50, 3, 128, dtype=torch.float64)
    for block in (1, 4, 16):
        values, scales = quantize_blocks(x, block, "int8")
        assert values.abs().max() <= 127 and torch.equal(values, values.round())
        per_token = scales.repeat_interleave(block, 1)[:, :50].T[..., None]
        assert ((values * per_token - x).abs() <= per_token / 2 + 1e-12).all()


def test_smooth_k_removes_the_token_mean():
    q, k, v = (torch.randn(64, 2, 128, dtype=torch.float64) for _ in range(3))
    shifted = k + 5.0  # a large common offset, as real K has
    sage = quantize_sequence(q, shifted, v, SageSemantics("int8", 1, 16))
    assert (sage.k * sage.k_scale).mean(0).abs().max() < 0.05


# Error bounds on N(0,1) inputs, D = 128, vs float64. V per channel in fp8 e4m3 (3 mantissa bits, relative
# rounding error up to 2^-4) alone gives ~2.4e-2 here, P in fp8 adds about as much again; int8 Q/K (per-token
# error < 0.4 %) adds little, fp8 Q/K (≈ 3 %) more. Measured: int8 3.5e-2, fp8 5.0e-2 (mean over seeds). The bounds
# leave ~40 % headroom and still catch a dropped scale or a wrong block mapping (errors >= 1e-1). Unsmoothed K
# needs K's offset to dominate its spread: test_semantics_edges.py.
SAGE_BOUNDS = {"int8": 0.05, "fp8_e4m3": 0.07}


@pytest.mark.parametrize("dtype_qk", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("q_block,k_block", [(1, 16), (4, 4), (16, 1), (1, 1)])
def test_sage_error_against_float64_is_within_the_bound(dtype_qk, q_block, k_block):
    q, k, v = (torch.randn(600, 2, 128, dtype=torch.float64) for _ in range(3))
    k = k + 3.0  # non-zero mean K: smoothing must remove it or the int8/fp8 grid is wasted on the offset
    out, _, _ = reference_attention(q, k, v, 128 ** -0.5, quant=SageSemantics(dtype_qk, q_block, k_block))
    err = rel_err(out, exact_attention(q, k, v))
    assert 1e-3 < err < SAGE_BOUNDS[dtype_qk], err


def test_sage_int8_is_more_accurate_than_fp8_on_the_same_inputs():
    q, k, v = (torch.randn(512, 2, 128, dtype=torch.float64) for _ in range(3))
    exact = exact_attention(q, k, v)
    errs = {dt: rel_err(reference_attention(q, k, v, 128 ** -0.5, quant=SageSemantics(dt, 1, 16))[0], exact)
            for dt in ("int8", "fp8_e4m3")}
    assert errs["int8"] < errs["fp8_e4m3"]


def test_ragged_batch_through_the_backend_equals_per_sequence_calls():
    lens_q, lens_kv = (300, 129, 77), (300, 200, 513)
    q = torch.randn(sum(lens_q), 4, 32)
    k, v = torch.randn(sum(lens_kv), 4, 32), torch.randn(sum(lens_kv), 4, 32)
    qkv = VarlenQKV(q, k, v, lens_q, lens_kv)
    plan = KernelPlan("TORCH_REFERENCE", scale=32 ** -0.5, skip_factor=50.0)
    result = run_backend("TORCH_REFERENCE", qkv, plan)
    # heads · Σ query tiles · KV tiles at the plan's 128 × 128
    assert plan.tile == (128, 128) and result.total_tiles == 4 * (3 * 3 + 2 * 2 + 1 * 5)
    skipped = 0
    for (qi, ki, vi, rows), nkv in zip(qkv.sequences(), lens_kv):
        out, s, _ = reference_attention(qi, ki, vi, plan.scale, skip_lambda=plan.skip_factor / nkv)
        assert torch.equal(result.out[rows], out)
        skipped += s
    assert result.skipped_tiles == skipped


def test_backend_decides_skips_per_the_sage_kernels_own_tile(monkeypatch):
    """A SAGE kernel that fixes its skip tile (Hopper's) is followed tile for tile, whatever the plan's tile."""
    from diffusers_trtllm.backends import reference
    from diffusers_trtllm.config import AttnQuantSpec

    own_tile = (32, 64)
    semantics = SageSemantics("int8", 1, 16, skip_tile=own_tile)
    monkeypatch.setattr(reference, "sage_semantics", lambda *args: semantics)
    q, k, v = (x.float() for x in local_qkv(s=512, h=2, d=32))
    qkv = VarlenQKV(q, k, v, (512,), (512,))
    plan = KernelPlan("TORCH_REFERENCE", 32 ** -0.5, quant=AttnQuantSpec("int8"), skip_factor=50.0, tile=(128, 128))
    result = run_backend("TORCH_REFERENCE", qkv, plan)
    out, skipped, total = reference_attention(q, k, v, plan.scale, skip_lambda=50.0 / 512, quant=semantics,
                                              tile=own_tile)
    assert result.total_tiles == total == 2 * (512 // 32) * (512 // 64)  # own tile; the plan's would give 2 · 4 · 4
    assert 0 < result.skipped_tiles == skipped and torch.equal(result.out, out.to(result.out.dtype))


def test_sampled_skipping_keeps_skipping_only_in_heads_whose_sample_skipped_enough():
    """``SageSemantics.skip_sample`` (the Triton kernel's rule): every ``every``-th query tile skips; a head's
    other tiles skip only if those skipped at least ``pays_from`` of their tiles, else they are computed dense."""
    q, k, v = (x.float() for x in local_qkv(s=1024, h=2, d=32))
    q[:, 1] *= 0.1  # head 1: flat attention, nothing near the threshold
    tile, lam = (64, 128), 0.05
    every_tile, skipped_all, total = reference_attention(q, k, v, 32 ** -0.5, skip_lambda=lam,
                                                         quant=SageSemantics("int8", 1, 16), tile=tile)
    dense, _, _ = reference_attention(q, k, v, 32 ** -0.5, quant=SageSemantics("int8", 1, 16), tile=tile)
    per_head = [int(reference_attention(q[:, h:h + 1], k[:, h:h + 1], v[:, h:h + 1], 32 ** -0.5, skip_lambda=lam,
                                        quant=SageSemantics("int8", 1, 16), tile=tile)[1]) for h in range(2)]
    assert per_head[0] > 0 and per_head[0] + per_head[1] == int(skipped_all)

    def sampled(every, pays_from):
        semantics = SageSemantics("int8", 1, 16, skip_sample=(every, pays_from))
        return reference_attention(q, k, v, 32 ** -0.5, skip_lambda=lam, quant=semantics, tile=tile)

    for every in (1, 3):  # every tile in the sample, or a sample whose rate pays: as if every tile skipped
        out, skipped, n = sampled(every, 0.0)
        assert n == total and int(skipped) == int(skipped_all) and torch.allclose(out, every_tile, atol=1e-6)
    out, skipped, n = sampled(4, 1.01)  # never pays: only the sampled tiles (0, 4, 8, ...) skip
    rows_sampled = torch.arange(1024) // tile[0] % 4 == 0
    assert n == total and 0 < int(skipped) < int(skipped_all)
    assert torch.allclose(out[~rows_sampled], dense[~rows_sampled], atol=1e-6)
    assert torch.allclose(out[rows_sampled], every_tile[rows_sampled], atol=1e-6)
    # between the two heads' rates: head 0 keeps skipping everywhere, head 1 only in its sample
    rate_0 = per_head[0] / (total // 2)
    out, skipped, _ = sampled(4, rate_0 / 2)
    assert torch.allclose(out[:, 0], every_tile[:, 0], atol=1e-6)
    assert torch.allclose(out[~rows_sampled, 1], dense[~rows_sampled, 1], atol=1e-6)
    with pytest.raises(ValueError, match="non-causal"):
        reference_attention(q, k, v, 32 ** -0.5, causal=True, skip_lambda=lam,
                            quant=SageSemantics("int8", 1, 16, skip_sample=(4, 0.25)), tile=tile)


@pytest.mark.slow
def test_memory_stays_bounded_at_32k_tokens_on_cpu():
    s, d = 32768, 32
    q, k, v = (torch.randn(s, 1, d) for _ in range(3))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    out, skipped, total = reference_attention(q, k, v, d ** -0.5, skip_lambda=0.01)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert out.shape == q.shape and torch.isfinite(out).all() and total == 256 * 256
    assert grown_mib < 512, f"peak grew {grown_mib:.0f} MiB; S x S fp32 scores alone would be 4096 MiB"
    rows = torch.randint(0, s, (64,))
    check = exact_attention(q[rows].double(), k.double(), v.double())
    dense_rows, _, _ = reference_attention(q[rows], k, v, d ** -0.5)
    assert rel_err(dense_rows, check) < 1e-5


@pytest.mark.parametrize("lens_q,lens_kv", [((200,) * 2, (450,) * 2), ((450,) * 2, (200,) * 2),
                                            ((300, 129, 77), (300, 200, 40))])
def test_causal_sdpa_and_reference_align_the_last_query_with_the_last_key(lens_q, lens_kv):
    """Bottom-right causal, as FlashInfer's kernels: TORCH_SDPA used PyTorch's top-left is_causal when the
    lengths differ. Queries that see no key (more queries than keys) get 0 on both."""
    q = torch.randn(sum(lens_q), 4, 32)
    k, v = torch.randn(sum(lens_kv), 2, 32), torch.randn(sum(lens_kv), 2, 32)
    qkv = VarlenQKV(q, k, v, lens_q, lens_kv)
    plan = KernelPlan("TORCH_SDPA", scale=32 ** -0.5, causal=True)
    sdpa = run_backend("TORCH_SDPA", qkv, plan).out
    reference = run_backend("TORCH_REFERENCE", qkv, plan).out
    for qi, ki, vi, rows in qkv.sequences():
        sq, skv = len(qi), len(ki)
        mask = torch.ones(sq, skv, dtype=torch.bool).tril(skv - sq)
        expected = F.scaled_dot_product_attention(*(x.double().transpose(0, 1) for x in (
            qi, ki.repeat_interleave(2, 1), vi.repeat_interleave(2, 1))), attn_mask=mask).transpose(0, 1)
        assert rel_err(sdpa[rows], expected) < 1e-6 and rel_err(reference[rows], expected) < 1e-6
        blind = max(sq - skv, 0)  # rows before the first key
        assert not sdpa[rows][:blind].any() and not reference[rows][:blind].any()


def test_explicit_threshold_on_a_ragged_batch_gives_each_sequence_lambda_max_len_over_len():
    """The kernels take one threshold scale factor per call, λ·max_kv_len; sequence i skips with
    λ_i = λ·max_kv_len / kv_len_i (the longest exactly λ, shorter ones more). The attention op (HunyuanVideo's
    padded batch: each sample attends among its valid prefix) and the reference do the same."""
    from diffusers_trtllm import HunyuanVideo15TrtllmAttnProcessor
    from diffusers_trtllm.dispatch import run_attention

    lam, lens = 0.02, (1024, 600, 300)
    parts = [local_qkv(s=max(lens), dtype=torch.float32) for _ in lens]
    q, k, v = (torch.stack([p[i] for p in parts]) for i in range(3))  # [B, S, H, D], valid prefixes of lens
    call = HunyuanVideo15TrtllmAttnProcessor(
        {"default": {"backend": "TORCH_REFERENCE", "skip_softmax": {"threshold": lam}}}).calls["joint_attn"]
    with counted_run(call) as run:
        out = run_attention(call, q, k, v, scale=64 ** -0.5, valid_lengths=torch.tensor(lens))
    skipped = 0
    for b, n in enumerate(lens):
        expected, s, _ = reference_attention(q[b, :n], k[b, :n], v[b, :n], 64 ** -0.5,
                                             skip_lambda=lam * max(lens) / n)
        assert torch.equal(out[b, :n], expected)
        assert not out[b, n:].any()  # padded rows attend to nothing
        skipped += int(s)
    assert skipped > 0
    assert run.counts_of(0) == [skipped, run.counts_of(0)[1], 1, 1]


def test_query_heads_must_be_a_multiple_of_key_heads_for_every_backend():
    """Checked where every backend's input is built, so no kernel path (trtllm-gen included) can miss it."""
    with pytest.raises(ValueError, match="query heads 6 not a multiple of key heads 4"):
        VarlenQKV.from_bshd(torch.randn(1, 8, 6, 32), torch.randn(1, 8, 4, 32), torch.randn(1, 8, 4, 32))

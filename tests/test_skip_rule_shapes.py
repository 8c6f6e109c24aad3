"""Skip-Softmax's rule beyond symmetric shapes: grouped-query heads and unequal query and key lengths (Cosmos 3's
``gen_full``, Wan's cross-attention), against a brute-force tile loop written from the rule alone (DESIGN §3):
a KV tile is skipped when every query row of its query tile has ``exp(tile max - running max) < λ``, where the
running max is the one before the tile; a skipped tile updates nothing. Both the reference's output and its skipped
count, and the calibration's one-pass counts (``skip_gaps`` / ``count_skips``), must agree with it."""

import math

import pytest
import torch

from diffusers_trtllm.backends.reference import reference_attention
from diffusers_trtllm.calibration.counting import count_skips, skip_gaps

SHAPES = [  # (queries, keys, query heads, key heads): GQA, fewer and more queries than keys, partial last tiles
    (200, 333, 4, 2), (333, 200, 4, 1), (64, 512, 6, 3), (130, 129, 2, 2)]
TILES = [(64, 128), (128, 64), (32, 32)]
LAMBDAS = [0.02, 0.3]


def brute_force(q, k, v, scale, lam, tile):
    """(output, skipped tiles, tiles) of Skip-Softmax, one (head, query tile, KV tile) at a time in float64."""
    sq, hq, d = q.shape
    skv, hkv = k.shape[:2]
    tq, tk = tile
    out = torch.zeros(sq, hq, d, dtype=torch.float64)
    skipped = tiles = 0
    for h in range(hq):
        kh, vh = k[:, h // (hq // hkv)], v[:, h // (hq // hkv)]  # query head h reads key head h // group
        for r0 in range(0, sq, tq):
            qt = q[r0:r0 + tq, h]
            m = torch.full((qt.shape[0],), -math.inf, dtype=torch.float64)
            lsum = torch.zeros(qt.shape[0], dtype=torch.float64)
            acc = torch.zeros(qt.shape[0], d, dtype=torch.float64)
            for c0 in range(0, skv, tk):
                tiles += 1
                s = (qt @ kh[c0:c0 + tk].T) * scale
                tile_max = s.max(dim=1).values
                if bool((torch.exp(tile_max - m) < lam).all()):
                    skipped += 1
                    continue
                new_m = torch.maximum(m, tile_max)
                p = torch.exp(s - new_m[:, None])
                correction = torch.exp(m - new_m)
                lsum = lsum * correction + p.sum(dim=1)
                acc = acc * correction[:, None] + p @ vh[c0:c0 + tk]
                m = new_m
            out[r0:r0 + tq, h] = acc / lsum[:, None]
    return out, skipped, tiles


def peaked(sq, skv, hq, hkv, seed):
    """Small random scores plus one logit offset per (key head, block of 32 keys), shared by every query (through a
    constant query channel): the first block high, the others spread over [-8, 0] nats, so that λ in [0.02, 0.3]
    skips some tiles of every tile shape and keeps others."""
    g = torch.Generator().manual_seed(seed)
    q = 0.3 * torch.randn(sq, hq, 16, generator=g, dtype=torch.float64)
    k = 0.3 * torch.randn(skv, hkv, 16, generator=g, dtype=torch.float64)
    offsets = -8.0 * torch.rand(-(-skv // 32), hkv, generator=g, dtype=torch.float64)
    offsets[0] = 4.0
    q[..., 0] = 1.0
    k[..., 0] = offsets.repeat_interleave(32, dim=0)[:skv] / 16 ** -0.5
    v = torch.randn(skv, hkv, 16, generator=g, dtype=torch.float64)
    return q, k, v


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{s[0]}q-{s[1]}k-{s[2]}/{s[3]}h" for s in SHAPES])
@pytest.mark.parametrize("tile", TILES, ids=[f"{t[0]}x{t[1]}" for t in TILES])
def test_the_reference_and_the_calibration_counts_follow_the_rule_at_gqa_and_unequal_lengths(shape, tile):
    q, k, v = peaked(*shape, seed=sum(shape) + tile[0])
    scale = 16 ** -0.5
    gaps = skip_gaps(q, k, scale, tile=tile)
    counted = count_skips(gaps, LAMBDAS)
    some_skip = False
    for lam, one_pass in zip(LAMBDAS, counted):
        expected, skipped, tiles = brute_force(q, k, v, scale, lam, tile)
        out, ref_skipped, ref_tiles = reference_attention(q, k, v, scale, skip_lambda=lam, tile=tile)
        assert (int(ref_skipped), ref_tiles) == (skipped, tiles)
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
        some_skip = some_skip or 0 < skipped < tiles
        assert int(one_pass) == skipped  # one pass over all λ counts what the online rule skips (λ <= 1)
    assert some_skip  # the data exercise the rule, not only its ends


GROUPED = [s for s in SHAPES if s[3] > 1]


@pytest.mark.parametrize("shape", GROUPED, ids=[f"{s[0]}q-{s[1]}k-{s[2]}/{s[3]}h" for s in GROUPED])
def test_the_sampled_rule_decides_per_head_from_its_sampled_query_tiles_at_gqa_and_unequal_lengths(shape):
    """The Triton kernel's rule (SAGE + Skip-Softmax): every ``every``-th query tile of a head is its sample and
    skips; the head's other query tiles skip only if the sample skipped at least ``pays_from`` of its KV tiles, and
    run dense otherwise. Checked against the reference run head by head (a query head on its key head) on row
    subsets without the rule, which is exact with one Q scale per token (``q_block`` 1)."""
    from diffusers_trtllm.quant import SageSemantics

    sq, skv, hq, hkv = shape
    q, k, v = peaked(sq, skv, hq, hkv, seed=sq)
    k[:, 1:, 0] = 0.0  # key heads after the first without offsets: flat scores, where skipping does not pay
    scale, tile, lam = 16 ** -0.5, (32, 32), 0.05
    plain = SageSemantics("int8", q_block=1, k_block=16)
    sampled = SageSemantics("int8", q_block=1, k_block=16, skip_sample=(2, 0.3))
    out, skipped, tiles = reference_attention(q, k, v, scale, skip_lambda=lam, quant=sampled, tile=tile)
    rows = torch.arange(sq)
    in_sample = rows // tile[0] % 2 == 0
    expected, expected_skipped, decided = torch.empty_like(out), 0, set()
    for h in range(hq):
        kh, vh = (x[:, [h // (hq // hkv)]] for x in (k, v))
        o_s, s_s, t_s = reference_attention(q[in_sample][:, [h]], kh, vh, scale, skip_lambda=lam, quant=plain,
                                            tile=tile)
        pays = int(s_s) * 100 >= 30 * t_s
        decided.add(pays)
        o_o, s_o, _ = reference_attention(q[~in_sample][:, [h]], kh, vh, scale, skip_lambda=lam if pays else 0.0,
                                          quant=plain, tile=tile)
        expected[in_sample, h], expected[~in_sample, h] = o_s[:, 0], o_o[:, 0]
        expected_skipped += int(s_s) + int(s_o)
    assert int(skipped) == expected_skipped and tiles == -(-sq // tile[0]) * -(-skv // tile[1]) * hq
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    assert decided == {True, False}, decided  # some heads' samples pay, some not: both branches of the rule ran

"""Skip-Softmax reuse (``skip_softmax.reuse_steps``): the tiles a step skipped are skipped untested at the next ones.

- The semantics on ``TORCH_REFERENCE``: a zeroed map changes nothing and ends holding exactly the tiles the test
  skipped (checked against the one-pass gaps of ``calibration.counting``, an independent computation); a tile in
  the map is attended as if its keys were absent (float64, against dense masked attention), so its keys are never
  read; a reuse step adds what its own test skips. At the edges: grouped-query heads, fewer and more queries than
  keys, partial tiles, more KV tiles than one 32-bit word (bit 31), query chunks and KV steps of several tiles,
  ragged batches.
- The run plumbing through the public API on the tiny Wan 2.2 pipeline (classifier-free guidance: two passes per
  step): which steps reuse, each pass its own map, maps freed when the call ends, requests in threads each their
  own, a mode change testing every tile again, the guard dropping reuse first, the refusal where no kernel
  reuses, and the config's validation.
"""

import copy
import math
import pathlib
import subprocess
import sys

import pytest
import torch

from diffusers_trtllm import AttentionConfig, enable_trtllm_attention
from diffusers_trtllm.backends import base, select_backend, trtllm
from diffusers_trtllm.backends.base import (KernelPlan, KernelResult, VarlenQKV, pack_tile_map, tile_map_for,
                                            tile_map_shape, unpack_tile_map)
from diffusers_trtllm.backends.reference import reference_attention, tiles_in_map
from diffusers_trtllm.calibration.counting import skip_gaps
from diffusers_trtllm.config import AttnQuantSpec
from diffusers_trtllm.dispatch import set_dispatch_config
from diffusers_trtllm.errors import AttentionConfigError, BackendUnavailableError
from diffusers_trtllm.run_state import REUSE, REUSE_FRESH, REUSE_KEEP, REUSE_OFF, SKIP
from diffusers_trtllm.tiny_pipelines import tiny_wan22_pipeline

from helpers import load_script, run_together

# (queries, keys, query heads, key heads, tile, kv_step, query chunk): self-attention with partial tiles; Wan's
# cross-attention shape (fewer queries than keys, 2 words of KV tiles: bit 31 used); GQA with a KV step of two
# tiles and query chunks smaller than the sequence; more queries than keys
SHAPES = {
    "self-partial": (150, 150, 2, 2, (16, 32), None, 2048),
    "cross-two-words": (70, 1100, 2, 2, (16, 32), None, 2048),
    "gqa-step-chunk": (96, 520, 4, 2, (16, 32), 64, 32),
    "more-queries": (260, 96, 2, 1, (32, 32), None, 64),
}


def local_problem(sq, skv, hq, hkv, d=32, seed=0, dtype=torch.float32):
    """Attention with locality: a band of strong keys per query region, so a λ skips a fair share of tiles."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, hq, d, generator=g, dtype=dtype)
    k = torch.randn(skv, hkv, d, generator=g, dtype=dtype)
    v = torch.randn(skv, hkv, d, generator=g, dtype=dtype)
    k[: max(1, skv // 5)] *= 4.0
    return q, k, v


def fresh_map(sq, skv, hq, tile):
    return torch.zeros(tile_map_shape((sq,), (skv,), hq, tile)[1:], dtype=torch.int32)


def kv_tiles(skv, tile):
    return -(-skv // tile[1])


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_a_zeroed_map_changes_nothing_and_ends_holding_the_tiles_the_test_skipped(shape):
    sq, skv, hq, hkv, tile, kv_step, chunk = shape
    q, k, v = local_problem(sq, skv, hq, hkv)
    lam, scale = 0.05, q.shape[-1] ** -0.5
    out, skipped, total = reference_attention(q, k, v, scale, skip_lambda=lam, tile=tile, kv_step=kv_step,
                                              query_chunk=chunk)
    tile_map = fresh_map(sq, skv, hq, tile)
    out_m, skipped_m, total_m = reference_attention(q, k, v, scale, skip_lambda=lam, tile=tile, kv_step=kv_step,
                                                    query_chunk=chunk, tile_map=tile_map)
    assert torch.equal(out_m, out) and int(skipped_m) == int(skipped) and total_m == total
    assert 0 < int(skipped) < total
    # tile by tile: under the dense running max a tile is skipped iff its worst row's gap < log λ (exact, λ <= 1)
    gaps = skip_gaps(q, k, scale, tile=tile, kv_step=kv_step)
    assert torch.equal(unpack_tile_map(tile_map, kv_tiles(skv, tile)), gaps < math.log(lam))


def masked_attention(q, k, v, scale, skipped, tile):
    """float64 attention where query tile i ignores the keys of the KV tiles ``skipped[h, i]`` marks."""
    hq, hkv = q.shape[1], k.shape[1]
    k, v = (x.repeat_interleave(hq // hkv, dim=1) for x in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    hidden = skipped.repeat_interleave(tile[0], dim=1)[:, : q.shape[0]].repeat_interleave(tile[1], dim=2)
    scores = scores.masked_fill(hidden[..., : k.shape[0]], -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_tiles_in_the_map_are_attended_as_if_their_keys_were_absent(shape):
    """λ = 0 (the test skips nothing): only the map skips. Each query tile's output is exact attention over the
    keys its map keeps, to float64 rounding; the map comes back unchanged and no tile counts as test-skipped."""
    sq, skv, hq, hkv, tile, kv_step, chunk = shape
    q, k, v = local_problem(sq, skv, hq, hkv, seed=1, dtype=torch.float64)
    g = torch.Generator().manual_seed(2)
    skipped = torch.rand(hq, -(-sq // tile[0]), kv_tiles(skv, tile), generator=g) < 0.5
    skipped[..., 0] = False  # every query keeps a key
    tile_map = pack_tile_map(skipped, tile_map_shape((sq,), (skv,), hq, tile)[-1])
    entering = tile_map.clone()
    out, test_skipped, _ = reference_attention(q, k, v, q.shape[-1] ** -0.5, tile=tile, kv_step=kv_step,
                                               query_chunk=chunk, tile_map=tile_map)
    expected = masked_attention(q, k, v, q.shape[-1] ** -0.5, skipped, tile)
    assert (out - expected).abs().max() < 1e-12
    assert torch.equal(tile_map, entering) and int(test_skipped) == 0
    assert int(tiles_in_map(tile_map).sum()) == int(skipped.sum())


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_a_reuse_step_reads_no_key_of_its_map_and_adds_what_its_test_skips(shape):
    sq, skv, hq, hkv, tile, kv_step, chunk = shape
    q, k, v = local_problem(sq, skv, hq, hkv, seed=3)
    lam, scale = 0.2, q.shape[-1] ** -0.5
    first = fresh_map(sq, skv, hq, tile)
    reference_attention(q, k, v, scale, skip_lambda=lam, tile=tile, kv_step=kv_step, query_chunk=chunk,
                        tile_map=first)
    # the next step's inputs drift a little; the map carries the first step's decisions
    q2, k2 = q + 0.3 * torch.randn_like(q), k + 0.3 * torch.randn_like(k)
    reuse = first.clone()
    out, test_skipped, _ = reference_attention(q2, k2, v, scale, skip_lambda=lam, tile=tile, kv_step=kv_step,
                                               query_chunk=chunk, tile_map=reuse)
    entering, leaving = (unpack_tile_map(m, kv_tiles(skv, tile)) for m in (first, reuse))
    assert bool((leaving | ~entering).all())  # nothing the map held is tested again
    assert int((leaving & ~entering).sum()) == int(test_skipped)
    # a query tile reads no key or value of the tiles its map holds: poisoned there, its rows are the same
    group, poisoned_somewhere = hq // hkv, False
    for i in range(entering.shape[1]):
        unread = entering[:, i].view(hkv, group, -1).all(dim=1)  # [Hkv, KV tiles] every query head of a group
        if not unread.any():
            continue
        poisoned_somewhere = True
        k_bad, v_bad = k2.clone(), v.clone()
        for h, j in unread.nonzero().tolist():
            k_bad[j * tile[1]:(j + 1) * tile[1], h] = 1e4
            v_bad[j * tile[1]:(j + 1) * tile[1], h] = 1e6
        poisoned, *_ = reference_attention(q2, k_bad, v_bad, scale, skip_lambda=lam, tile=tile, kv_step=kv_step,
                                           query_chunk=chunk, tile_map=first.clone())
        rows = slice(i * tile[0], (i + 1) * tile[0])
        assert torch.equal(poisoned[rows], out[rows]), i
    assert poisoned_somewhere


def test_map_words_round_trip_every_bit_including_the_sign_bit():
    bits = torch.rand(3, 5, 70, generator=torch.Generator().manual_seed(0)) < 0.5
    bits[..., 31] = True
    words = pack_tile_map(bits, 3)
    assert words.dtype == torch.int32 and bool((words[..., 0] < 0).all())
    assert torch.equal(unpack_tile_map(words, 70), bits)


def test_the_backend_keeps_one_map_per_batch_with_each_sequences_own_tiles():
    """A ragged batch: the map is shaped by the longest sequence, each sequence's bits stay within its own tiles,
    a map of another geometry is replaced by a zeroed one, and the reused count is the entering map's."""
    lengths_q, lengths_kv, heads, tile = (40, 130), (300, 90), 2, (16, 32)
    parts = [local_problem(nq, nkv, heads, heads, seed=i) for i, (nq, nkv) in enumerate(zip(lengths_q, lengths_kv))]
    qkv = VarlenQKV(*(torch.cat([p[i] for p in parts]) for i in range(3)), lengths_q, lengths_kv)
    plan = KernelPlan("TORCH_REFERENCE", 32 ** -0.5, skip_factor=0.05 * 300, tile=tile, count_skips=True,
                      reuse=True, tile_map=torch.zeros(1, 1, 1, 1, dtype=torch.int32))
    first = base.get_backend("TORCH_REFERENCE").run(qkv, plan)
    assert tuple(first.tile_map.shape) == (2, heads, 9, 1) and int(first.reused_tiles) == 0
    per_sequence = unpack_tile_map(first.tile_map, 10)
    assert not per_sequence[1, :, :, 3:].any() and not per_sequence[0, :, 3:].any()  # past each one's tiles
    assert int(first.skipped_tiles) == int(per_sequence.sum()) > 0
    again = base.get_backend("TORCH_REFERENCE").run(qkv, KernelPlan(**{**plan.__dict__, "tile_map": first.tile_map}))
    assert again.tile_map is first.tile_map and int(again.reused_tiles) == int(per_sequence.sum())
    assert tile_map_for(KernelPlan("TORCH_REFERENCE", 1.0), qkv, tile) is None  # no reuse: no map at all


# --- through the pipeline ------------------------------------------------------------------------------------------

STEPS = 6


def reuse_config(reuse_steps=2, **skip):
    return {"default": {"backend": "TORCH_REFERENCE",
                        "skip_softmax": {"threshold": 0.3, "reuse_steps": reuse_steps, **skip}}}


def generate(pipe, steps=STEPS, prompt="a fox in snow"):
    # 3 × 8 × 16 video tokens: three 128-key tiles, so the kept maps have tiles to hold
    return pipe(prompt, negative_prompt="blur", height=128, width=256, num_frames=9, num_inference_steps=steps,
                generator=torch.Generator().manual_seed(steps), output_type="latent").frames


@pytest.fixture
def pipe():
    pipe = tiny_wan22_pipeline(two_experts=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture
def spy(monkeypatch):
    """Every call the reference runs: its plan, the map it was handed and the map it left (None, or the tensor
    and a copy of its bits then)."""
    calls = []
    reference = base.get_backend("TORCH_REFERENCE")

    def runner(qkv, plan):
        given = None if plan.tile_map is None else (plan.tile_map, plan.tile_map.clone())
        result = reference.runner(qkv, plan)
        left = None if result.tile_map is None else (result.tile_map, result.tile_map.clone())
        calls.append((plan, given, left))
        return result

    monkeypatch.setitem(base._REGISTRY, "TORCH_REFERENCE",
                        base.FunctionBackend("TORCH_REFERENCE", reference.check, runner, reference.priority,
                                             reference.returns_lse))
    return calls


def test_maps_are_reused_for_reuse_steps_each_pass_its_own_then_tested_afresh(pipe, spy):
    with enable_trtllm_attention(pipe, reuse_config(reuse_steps=2)) as handle:
        generate(pipe)
        modes = handle.stats.modes()
        summary = handle.stats.summary()
    reusing = [step for step, m in modes.items() if any(mode.endswith("skip+reuse") for mode in m)]
    assert reusing == [1, 2, 4, 5]  # made at 0 and 3, reused by the two steps after each
    per_step = len(spy) // STEPS
    assert per_step == 2 * 2 * len(pipe.transformer.blocks)  # two passes (CFG) of a block's two attentions
    steps = [spy[s * per_step:(s + 1) * per_step] for s in range(STEPS)]
    assert all(plan.reuse for plan, _, _ in spy)
    assert all(given is None for _, given, _ in steps[0])  # a run's first step decides from scratch
    # a window's first step says its map holds no tile (FMHAv2 runs it on the Skip-Softmax kernel's steps)
    assert [{plan.fresh_map for plan, _, _ in calls} for calls in steps] == [{step in (0, 3)} for step in range(STEPS)]
    assert [{plan.map_zeroed for plan, _, _ in calls} for calls in steps] == [{step == 3} for step in range(STEPS)]
    for step in range(1, STEPS):
        for (_, given, _), (_, _, left_before) in zip(steps[step], steps[step - 1]):
            assert given[0] is left_before[0]  # the same call site and pass: the map it left the step before
            assert torch.equal(given[1], left_before[1]) if step != 3 else not given[1].any()  # 3: afresh
        maps = [given[0] for _, given, _ in steps[step]]
        assert len({m.data_ptr() for m in maps}) == len(maps)  # each (block, role, pass) its own map
    assert 0 < summary["reused"] < summary["sparsity"]


def test_reusing_steps_that_test_nothing_skip_the_makers_tiles_and_leave_the_map(pipe, spy):
    """``reuse_test: false``: a reusing step runs at factor 0 on its map (no test), so the map stays as the step
    that made it left it, where a testing reuse step adds the tiles its test skips; the making steps test."""
    runs = {}
    for reuse_test in (False, True):
        spy.clear()
        with enable_trtllm_attention(pipe, reuse_config(reuse_steps=2, threshold=0.9, reuse_test=reuse_test)) as h:
            generate(pipe)
            modes = h.stats.modes()
        assert [step for step, m in modes.items() if any(mode.endswith("skip+reuse") for mode in m)] == [1, 2, 4, 5]
        per_step = len(spy) // STEPS
        runs[reuse_test] = [spy[s * per_step:(s + 1) * per_step] for s in range(STEPS)]
    steps = runs[False]
    for step in range(STEPS):
        reusing = step not in (0, 3)
        assert all(plan.reuse and (plan.skip_factor == 0.0) == reusing for plan, _, _ in steps[step])
        if reusing:
            maker = steps[0 if step < 3 else 3]
            assert all(torch.equal(left[1], made[1]) and torch.equal(given[1], made[1])
                       for (_, given, left), (_, _, made) in zip(steps[step], maker))
    assert any(given[1].any() for s in (1, 2, 4, 5) for _, given, _ in steps[s])  # there was something to reuse
    grew = [not torch.equal(left[1], given[1]) for s in (1, 2, 4, 5) for _, given, left in runs[True][s]]
    assert any(grew)  # where reuse steps test, their maps grow


@pytest.mark.parametrize("value", [1, "false", None])
def test_reuse_test_must_be_a_bool(value):
    with pytest.raises(AttentionConfigError, match=r"skip_softmax.reuse_test=.* is invalid: expected true .* or "
                                                   r"false \(they test nothing\)"):
        AttentionConfig.from_dict(reuse_config(reuse_test=value))


def test_reuse_off_hands_no_plan_a_map_and_gives_todays_output(pipe, spy):
    config = reuse_config(reuse_steps=0)
    with enable_trtllm_attention(pipe, config):
        off = generate(pipe, steps=3)
    assert spy and not any(plan.reuse or given is not None for plan, given, _ in spy)
    del config["default"]["skip_softmax"]["reuse_steps"]
    with enable_trtllm_attention(pipe, config):
        assert torch.equal(generate(pipe, steps=3), off)


def scoped(pipe):
    """diffusers' per-request pattern: a shallow copy with a scheduler of its own."""
    local = copy.copy(pipe)
    local.scheduler = copy.deepcopy(pipe.scheduler)
    return local


def test_maps_belong_to_the_call_freed_at_its_end_and_never_shared_between_requests(pipe):
    with enable_trtllm_attention(pipe, reuse_config(reuse_steps=3)) as handle:
        alone = {steps: generate(scoped(pipe), steps) for steps in (5, 3)}
        assert handle.stats.tile_map_bytes() == {}  # the call ended: its maps are gone
        together = run_together({steps: lambda steps=steps: generate(scoped(pipe), steps) for steps in (5, 3)})
    for steps, out in together.items():
        assert torch.equal(out, alone[steps]), steps


def test_a_gate_switching_mode_tests_every_tile_again(pipe, spy):
    """SAGE scheduled to start mid-run: the step it starts at makes its maps afresh, whatever reuse_steps says."""
    config = reuse_config(reuse_steps=10)
    config["default"]["quant"] = {"dtype_qk": "int8", "disabled_below_timestep": 0.5}
    with enable_trtllm_attention(pipe, config) as handle:
        generate(pipe)
        modes = handle.stats.modes()
    switch = next(step for step, m in modes.items() if not any("sage" in mode for mode in m))
    assert all(any(mode.endswith("+reuse") for mode in modes[s]) for s in range(1, switch))
    assert not any(mode.endswith("+reuse") for mode in modes[switch])
    assert all(any(mode.endswith("+reuse") for mode in modes[s]) for s in range(switch + 1, STEPS))


def test_the_probe_reports_each_layers_error_at_the_steps_that_reused(pipe):
    config = reuse_config(reuse_steps=2)
    config["default"]["accuracy"] = {"probe_every": 1, "probe_rows": 32}
    with enable_trtllm_attention(pipe, config) as handle:
        generate(pipe, steps=3)
        errors, table = handle.stats.errors(), handle.stats.error_table()
    layers = {layer for _, layer in errors}
    assert {step for step, _ in errors} == {0, 1, 2} and len(layers) == 4
    assert all(0 < error < 0.05 for error in errors.values())
    assert table.count("TORCH_REFERENCE:skip, TORCH_REFERENCE:skip+reuse") == 4  # every layer, both ways


def test_the_guard_takes_reuse_away_first_where_the_probed_step_reused(pipe):
    """A probed step above the bound: a site that reused maps at it loses reuse (the next steps test every tile,
    keeping Skip-Softmax); one that did not loses Skip-Softmax."""
    config = reuse_config(reuse_steps=10)
    config["default"]["accuracy"] = {"probe_every": 1, "max_error": 0.01}
    with enable_trtllm_attention(pipe, config) as handle:
        planner = handle.planner
        run = planner.new_run()
        planner.plan_step(run, 0.9, 0)
        run.step_calls = [1] * len(run.calls)  # every site ran the step
        planner.plan_step(run, 0.8, 1)
        assert run.settings[:, REUSE].tolist() == [REUSE_KEEP] * len(run.calls)
        run.settings[1, REUSE] = REUSE_FRESH  # site 1 tested every tile at this step
        with pytest.warns(UserWarning) as caught:
            planner.guard(run, 1, {0: (1.0, 1.0), 1: (1.0, 1.0)})
        assert "runs without Skip-Softmax reuse for the rest" in str(caught[0].message)
        assert "runs without Skip-Softmax for the rest" in str(caught[1].message)
        assert run.guard_dropped[:2] == [{"reuse"}, {"skip"}]
        run.step_calls = [1] * len(run.calls)
        planner.plan_step(run, 0.7, 2)
        assert run.settings[0, SKIP] > 0 and run.settings[0, REUSE] == REUSE_OFF  # still skipping, untested none
        assert run.settings[1, SKIP] == 0 and run.settings[1, REUSE] == REUSE_OFF
        assert run.settings[2, REUSE] == REUSE_KEEP


def test_auto_keeps_skip_and_sage_where_only_reuse_cannot_run(monkeypatch):
    """A backend that runs Skip-Softmax but not its reuse: auto takes it and says it dropped reuse alone; asked
    explicitly, it is refused with its reason."""
    def check(plan, qkv):
        return "no reuse here" if plan.reuse else None

    monkeypatch.setitem(base._REGISTRY, "FAST", base.FunctionBackend("FAST", check, None, priority=50))
    qkv = VarlenQKV(*(torch.zeros(4, 1, 8) for _ in range(3)), (4,), (4,))
    plan = KernelPlan("auto", 1.0, skip_factor=1.0, reuse=True)
    choice = select_backend("auto", plan, qkv)
    assert choice.name == "FAST" and choice.reuse_dropped and "Skip-Softmax reuse dropped" in choice.dropped
    with pytest.raises(BackendUnavailableError, match="no reuse here"):
        select_backend("FAST", plan, qkv)


@pytest.mark.parametrize("quant,lengths,reason", [
    (None, (256, 256), "a bf16 plan has no reuse"),
    (AttnQuantSpec("fp8_e4m3", k_block_size=64), (256, 256), "this plan asks for K block 64"),
    (AttnQuantSpec("fp8_e4m3"), (256, 256, "lse"), "this plan asks for the log-sum-exp"),
    (AttnQuantSpec("fp8_e4m3"), (256, 256), None),  # FMHAv2 SAGE
    (AttnQuantSpec("int8"), (256, 256), None),  # Triton SAGE
    (AttnQuantSpec("fp8_e4m3"), (512, 256), None),  # more queries than keys: Triton SAGE
])
def test_trtllm_attn_reuses_on_hoppers_sage_kernels_and_refuses_elsewhere_naming_them(monkeypatch, quant, lengths,
                                                                                     reason):
    monkeypatch.setattr(trtllm, "gpu_arch", lambda device: "sm_90")
    lse = lengths[2:] == ("lse",)
    qkv = VarlenQKV(*(torch.zeros(n, 2, 128, dtype=torch.bfloat16) for n in (lengths[0], lengths[1], lengths[1])),
                    lengths[:1], lengths[1:2])
    plan = KernelPlan("TRTLLM_ATTN", 0.1, skip_factor=5.0, quant=quant, reuse=True, return_lse=lse)
    found = trtllm.reuse_unavailable_reason(plan, qkv)
    assert (found is None) == (reason is None)
    if reason is not None:
        assert reason in found and "FMHAv2 (fp8_e4m3" in found and "Triton (int8" in found
        with pytest.raises(BackendUnavailableError, match="reuse_steps"):
            trtllm.run(qkv, plan)
    monkeypatch.setattr(trtllm, "gpu_arch", lambda device: "sm_100")
    assert "this GPU's SAGE kernel has no reuse" in trtllm.reuse_unavailable_reason(
        KernelPlan("TRTLLM_ATTN", 0.1, skip_factor=5.0, quant=AttnQuantSpec("fp8_e4m3"), reuse=True), qkv)
    assert KernelResult(torch.zeros(1)).reused_tiles is None


def test_fmha_v2s_reuse_steps_one_tile_at_a_time_and_the_reference_follows(monkeypatch):
    """A reuse plan on the FMHAv2 SAGE route runs its tile-map kernel, whose KV step is one 128-key tile (a skip
    plan keeps FlashInfer's 256-key steps); the reference asks for the same kernel's semantics."""
    from diffusers_trtllm.backends import reference
    from diffusers_trtllm.kernels import fmha_v2_sage

    monkeypatch.setattr(trtllm, "gpu_arch", lambda device: "sm_90")
    monkeypatch.setattr(trtllm, "flashinfer_unavailable_reason", lambda function: None)
    fp8 = AttnQuantSpec("fp8_e4m3")
    qkv = VarlenQKV(*(torch.zeros(256, 2, 128, dtype=torch.bfloat16) for _ in range(3)), (256,), (256,))
    plan = KernelPlan("TRTLLM_ATTN", 0.1, skip_factor=5.0, quant=fp8, reuse=True)
    assert trtllm.unavailable_reason(plan, qkv) is None
    reusing = trtllm.sage_semantics(fp8, "cuda", reuse=True)
    assert reusing.kv_step == fmha_v2_sage.REUSE_KV_STEP == 256 and reusing.paired_tiles
    assert trtllm.sage_semantics(fp8, "cuda").kv_step == trtllm.FMHA_V2_KV_STEP == 256
    asked = []
    chosen = reference.sage_semantics
    monkeypatch.setattr(reference, "sage_semantics", lambda *args: asked.append(args[-1]) or chosen(*args))
    for reuse in (True, False):
        reference._run(qkv, KernelPlan("TORCH_REFERENCE", 0.1, skip_factor=5.0, quant=fp8, reuse=reuse))
    assert asked == [True, False]


@pytest.mark.parametrize("value", [-1, 1.5, True, "2"])
def test_reuse_steps_must_be_a_whole_number_of_steps(value):
    with pytest.raises(AttentionConfigError, match=r"skip_softmax.reuse_steps=.* is invalid: expected an int >= 0"):
        AttentionConfig.from_dict(reuse_config(reuse_steps=value))


def test_reuse_needs_something_to_skip_and_a_pipeline():
    with pytest.raises(AttentionConfigError, match="reuse_steps=2 is invalid: expected 0 unless"):
        AttentionConfig.from_dict({"default": {"skip_softmax": {"reuse_steps": 2}}})
    with pytest.raises(AttentionConfigError, match="reuse_steps need the pipeline's steps"):
        set_dispatch_config({"default": {"skip_softmax": {"threshold": 0.3, "reuse_steps": 2}}})


def test_the_benchmark_checks_its_arguments_without_a_gpu():
    proc = subprocess.run([sys.executable, "benchmarks/skip_reuse.py", "--seq", "16384", "--dry-run"],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and "16384 tokens × 40 heads × 128, 1310720 tiles" in proc.stdout, proc.stderr
    bench = load_script("benchmarks/skip_reuse.py")
    with pytest.raises(SystemExit):
        bench.parse(["--sparsity", "1.5"])
    assert bench.tiles(75_600, 40) == 40 * 1182 * 591
    # a reuse window's mean step: its first step and the reusing ones, each field weighted by its steps
    first, reusing = (104.6, 30.0, 0.0, 90.0), (68.4, 3.0, 60.0, 45.0)
    assert bench.window_mean(first, reusing, 2) == pytest.approx((80.4666, 12.0, 40.0, 60.0), rel=1e-4)
    assert abs(bench.zero_fraction(75_600) - 0.25) < 0.01  # DESIGN.md §7: a quarter of the tiles at 0


def test_the_profiling_script_refuses_bad_arguments_and_a_machine_without_hopper():
    script = "benchmarks/reuse_profile.py"
    bad = subprocess.run([sys.executable, script, "--sparsity", "1.5"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--sparsity must lie in (0, 1)" in bad.stderr.splitlines()[-1]
    missing = subprocess.run([sys.executable, script, "--tile-map-patch", "no/such.patch"], capture_output=True,
                             text=True)
    assert missing.returncode == 2 and "--tile-map-patch no/such.patch: no such file" in missing.stderr
    no_rounds = subprocess.run([sys.executable, script, "--rounds", "0"], capture_output=True, text=True)
    assert no_rounds.returncode == 2 and "--rounds be >= 1" in no_rounds.stderr.splitlines()[-1]
    if not torch.cuda.is_available():
        proc = subprocess.run([sys.executable, script, "--once"], capture_output=True, text=True)
        assert proc.returncode == 1 and proc.stderr.strip() == "reuse_profile: needs an sm_90 GPU (H100/H200)"


def test_the_profiling_scripts_rounds_alternate_the_order_of_the_cases():
    """--rounds: each round times every case, the order reversed every other round, so that no case always runs
    after the others (a GPU runs hotter as a pass goes on)."""
    round_orders = load_script("benchmarks/reuse_profile.py").round_orders
    orders = round_orders(["dense256", "fresh", "reuse"], 3)
    assert orders == [["dense256", "fresh", "reuse"], ["reuse", "fresh", "dense256"], ["dense256", "fresh", "reuse"]]
    assert round_orders(["a", "b"], 1) == [["a", "b"]]


def test_the_profiling_script_builds_an_other_tile_map_patch_apart(tmp_path, monkeypatch):
    """--tile-map-patch: the headers and the module's name follow the given patch; the other patches stay."""
    from diffusers_trtllm.kernels import fmha_v2_sage

    monkeypatch.setattr(fmha_v2_sage, "PATCH_FOLDER", fmha_v2_sage.PATCH_FOLDER)
    package_headers = fmha_v2_sage.patched_headers()
    package_name = fmha_v2_sage._module_name(fmha_v2_sage.kernel_sources())
    patch = (fmha_v2_sage.PATCH_FOLDER / "tile_map_reuse.patch").read_text()
    marked = "// the halves of the step this warpgroup reuses (bit 0 the first)"
    assert patch.count(marked) == 1
    (tmp_path / "other.patch").write_text(patch.replace(marked, marked.replace("(bit 0", "(A/B: bit 0")))
    load_script("benchmarks/reuse_profile.py").use_tile_map_patch(tmp_path / "other.patch")
    headers = fmha_v2_sage.patched_headers()
    assert [path for path in headers if headers[path] != package_headers[path]] == ["fmha/warpspec/compute.h"]
    assert "reuses (A/B: bit 0 the first)" in headers["fmha/warpspec/compute.h"]
    assert [p.name for p in fmha_v2_sage.header_patch_files()] == [
        f"{name}.patch" for name in fmha_v2_sage.HEADER_PATCHES]
    assert all(p.read_text() == (pathlib.Path(fmha_v2_sage.__file__).with_name("csrc") / "fmha_v2_patches" /
                                 p.name).read_text() for p in fmha_v2_sage.header_patch_files()
               if p.name != "tile_map_reuse.patch")
    assert fmha_v2_sage._module_name(fmha_v2_sage.kernel_sources()) != package_name


def test_the_drift_model_moves_as_many_decisions_each_way_among_the_movable_tiles():
    from diffusers_trtllm.backends.base import pack_tile_map, unpack_tile_map

    bench = load_script("benchmarks/skip_reuse.py")
    tiles = torch.rand(2, 3, 50, generator=torch.Generator().manual_seed(0)) < 0.6
    movable = torch.ones_like(tiles)
    movable[..., :2] = False
    drifted = unpack_tile_map(bench.drift_map(pack_tile_map(tiles, 2), 50, 0.1, torch.Generator().manual_seed(1),
                                              movable), 50)
    cleared, set_ = int((tiles & ~drifted).sum()), int((drifted & ~tiles).sum())
    assert cleared == set_ == round(0.1 * int((tiles & movable).sum())) > 0
    assert torch.equal(drifted[..., :2], tiles[..., :2])  # tiles that may not move keep their decision

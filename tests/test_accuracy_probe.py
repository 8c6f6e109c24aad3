"""The accuracy probe, its guard and the SAGE step schedule, through the public API.

- The probe's error is the relative error of what ran against exact attention (float64) on the documented rows:
  an offline computation from the op's own inputs and output gives the same number.
- The guard takes SAGE (else skipping) away from a layer above its bound for the rest of the pipeline call, warning
  with the layer, the error and the bound; a layer within the bound keeps it; the next call starts afresh.
- The SAGE step schedule (``quant.disabled_until_timestep`` / ``disabled_below_timestep``) follows the scheduler.
- The probe changes no output; compiled, it adds no graph break, recompile or host read.

The outlier layer: block 0's self-attention with 4 of its 16 query/key channels' norm weights × 8, so its logits
are large where fp8's 3 mantissa bits lose most (DESIGN.md: outliers give fp8 SAGE its largest errors); its probed
error under fp8 SAGE is ~0.25 against ~0.02 for the untouched layers, and :data:`BOUND` lies between.
"""

import copy
import math
import re
import warnings

import pytest
import torch
import torch._dynamo.utils as dynamo_utils
from diffusers import FlowMatchEulerDiscreteScheduler

import test_host_sync
from diffusers_trtllm import AttentionConfig, AttentionConfigError, WanTrtllmAttnProcessor, enable_trtllm_attention
from diffusers_trtllm.dispatch import set_dispatch_config
from diffusers_trtllm.tiny_pipelines import tiny_wan22_pipeline

from helpers import PUBLISHES_STEPS, LoopPipeline, cosmos3_transformer_call, pipeline_context, tiny_wan, wan_inputs

BOUND = 0.1
OUTLIER = "transformer.blocks.0.attn1"
FP8_SAGE = {"backend": "TORCH_REFERENCE", "quant": {"dtype_qk": "fp8_e4m3"}}


def outlier_wan(gain: float = 8.0):
    """The tiny Wan transformer whose block 0 self-attention has outlier channels in q and k (module docstring)."""
    model = tiny_wan()
    with torch.no_grad():
        attn = model.blocks[0].attn1
        attn.norm_q.weight[:4] *= gain
        attn.norm_k.weight[:4] *= gain
    return model


def layer_modes(handle) -> dict[str, dict[int, str]]:
    """Per layer, per step, the mode it ran in."""
    modes: dict = {}
    for (step, layer, _, mode) in handle.stats.records:
        modes.setdefault(layer, {})[step] = mode
    return modes


def package_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("diffusers_trtllm:")]


# ------------------------------------------------------------------------------------------------ the probe's error

def offline_sums(q, k, v, out, rows, scale, causal) -> tuple[float, float]:
    """(Σ error², Σ exact²) over the probe's rows (token floor((2j + 1) · total / 2n) of the flattened batch, all
    heads), exact attention in float64 computed here row by row."""
    batch, sq, heads_q, _ = q.shape
    skv, heads_kv = k.shape[1], k.shape[2]
    total = batch * sq
    n = min(rows, total)
    error_sq = exact_sq = 0.0
    for j in range(n):
        b, i = divmod(((2 * j + 1) * total) // (2 * n), sq)
        keys = k[b].double().repeat_interleave(heads_q // heads_kv, dim=1)
        values = v[b].double().repeat_interleave(heads_q // heads_kv, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b, i].double(), keys) * scale
        if causal:
            scores[:, i + skv - sq + 1:] = -math.inf
        exact = torch.einsum("hn,nhd->hd", scores.softmax(-1), values)
        error_sq += (out[b, i].double() - exact).square().sum().item()
        exact_sq += exact.square().sum().item()
    return error_sq, exact_sq


@pytest.mark.parametrize("name", ["wan", "cosmos3"])
def test_the_probed_error_equals_an_offline_computation_of_the_same_rows(name, monkeypatch):
    """Wan: batch 2, self- and cross-attention; Cosmos 3: a causal text stream and grouped-query attention of
    fewer queries than keys. Each layer's reported error pools all its calls (roles, batch) in the step."""
    rows = 7
    if name == "wan":
        model, inputs = tiny_wan(), wan_inputs(batch=2, frames=1, height=8, width=8)
    else:
        model, inputs = cosmos3_transformer_call()
    calls = []
    original = torch.ops.diffusers_trtllm.attention
    monkeypatch.setattr(torch.ops.diffusers_trtllm, "attention",
                        lambda *args: calls.append((current[0], args, out := original(*args))) or out)
    config = {"default": {"backend": "TORCH_REFERENCE", "quant": {"dtype_qk": "int8"},
                          "accuracy": {"probe_rows": rows}}}
    current = [None]
    with enable_trtllm_attention(model, config) as handle, torch.no_grad():
        layers = {site.layer for site in handle.planner.calls}
        hooks = [module.register_forward_pre_hook(lambda m, a, layer=f"transformer.{module_name}":
                                                  current.__setitem__(0, layer))
                 for module_name, module in model.named_modules() if module_name in layers]
        model(**inputs)
        for hook in hooks:
            hook.remove()
        reported = handle.stats.errors()
    expected: dict = {}
    for layer, args, out in calls:
        q, k, v, valid_lengths, _, _, scale, causal = args[:8]
        assert valid_lengths is None
        error_sq, exact_sq = offline_sums(q, k, v, out, rows, scale, causal)
        pair = expected.setdefault((0, layer), [0.0, 0.0])
        pair[0] += error_sq
        pair[1] += exact_sq
    assert set(reported) == set(expected) and len(reported) >= 2
    for key, (error_sq, exact_sq) in expected.items():
        assert reported[key] == pytest.approx(math.sqrt(error_sq / exact_sq), rel=1e-9)
        assert reported[key] > 1e-3  # int8 SAGE: a real error was measured, not the float32 floor


# ------------------------------------------------------------------------------------------------ the guard

@pytest.mark.parametrize("gain, trips", [(1.0, False), (8.0, True)], ids=["within", "outlier"])
def test_the_guard_takes_sage_away_from_the_layer_above_its_bound_only(gain, trips):
    pipe = LoopPipeline(outlier_wan(gain), FlowMatchEulerDiscreteScheduler(shift=1.0))
    inputs = wan_inputs(batch=1, frames=1, height=16, width=16)
    config = {"default": dict(FP8_SAGE, accuracy={"probe_rows": 16, "max_error": BOUND})}
    with enable_trtllm_attention(pipe, config) as handle:
        for _ in range(2):  # the second pipeline call starts with SAGE again
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                pipe(inputs, 3)
            errors, modes = handle.stats.errors(), layer_modes(handle)
            others = {layer: error for (step, layer), error in errors.items() if layer != OUTLIER}
            assert others and max(others.values()) < BOUND
            assert all(m == {0: "sage-fp8_e4m3", 1: "sage-fp8_e4m3", 2: "sage-fp8_e4m3"}
                       for layer, m in modes.items() if layer != OUTLIER)
            if not trips:
                assert package_warnings(caught) == [] and errors[(0, OUTLIER)] < BOUND
                assert modes[OUTLIER] == {0: "sage-fp8_e4m3", 1: "sage-fp8_e4m3", 2: "sage-fp8_e4m3"}
                continue
            assert errors[(0, OUTLIER)] > BOUND
            assert package_warnings(caught) == [
                f"diffusers_trtllm: {OUTLIER} (self_attn attention, sage-fp8_e4m3): probed error "
                f"{errors[(0, OUTLIER)]:.3g} at step 0 exceeds the bound accuracy.max_error={BOUND:g}; it runs "
                "without SAGE for the rest of this pipeline call"]
            assert modes[OUTLIER] == {0: "sage-fp8_e4m3", 1: "dense", 2: "dense"}
            assert errors[(1, OUTLIER)] < 1e-5  # dense: the float32 floor


def test_the_guard_drops_sage_first_then_skipping_and_reports_a_dense_layer_once():
    """SAGE + Skip-Softmax on cross-attention (512 text keys: four KV tiles; λ = 5 skips a large share of them)
    with a bound below what either gives: step 0 trips SAGE, step 1 (skip alone) trips skipping, step 2 runs
    dense. Self-attention runs dense with a bound below its float32 floor: reported once per pipeline call,
    nothing to drop."""
    pipe = LoopPipeline(tiny_wan(qk_gain=3.0), FlowMatchEulerDiscreteScheduler(shift=1.0))
    inputs = wan_inputs(batch=1, frames=1, height=16, width=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # λ >= 1 is said to skip nearly every tile: meant here
        config = AttentionConfig.from_dict({
            "default": {"backend": "TORCH_REFERENCE", "accuracy": {"max_error": 1e-12}},
            "per_role": {"cross_attn": {"backend": "TORCH_REFERENCE", "quant": {"dtype_qk": "int8"},
                                        "skip_softmax": {"threshold": 5.0},
                                        "accuracy": {"probe_rows": 64, "max_error": 1e-4}}}})
    with enable_trtllm_attention(pipe, config) as handle:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pipe(inputs, 4)
        modes, errors = layer_modes(handle), handle.stats.errors()
    for block in (0, 1):
        layer = f"transformer.blocks.{block}.attn2"
        assert modes[layer] == {0: "sage-int8+skip", 1: "skip", 2: "dense", 3: "dense"}
        assert errors[(1, layer)] > 1e-4 > errors[(2, layer)]
        assert modes[f"transformer.blocks.{block}.attn1"] == {step: "dense" for step in range(4)}
    messages = package_warnings(caught)
    assert sum("without SAGE" in m for m in messages) == 2 and sum("without Skip-Softmax" in m for m in messages) == 2
    dense = [m for m in messages if "nothing to drop" in m]
    assert len(dense) == 2 and all("attn1 (self_attn attention, dense)" in m for m in dense)


# ------------------------------------------------------------------------------------------------ SAGE step schedule

def test_the_sage_step_schedule_follows_the_scheduler():
    until, below = 0.8, 0.4  # UniPC, 8 steps: t = 0.999 0.954 0.9 0.833 0.75 0.643 0.5 0.301
    pipe = tiny_wan22_pipeline(0)
    pipe.set_progress_bar_config(disable=True)
    config = {"default": {"backend": "TORCH_REFERENCE", "quant": {
        "dtype_qk": "int8", "disabled_until_timestep": until, "disabled_below_timestep": below}}}
    probe = copy.deepcopy(pipe.scheduler)
    probe.set_timesteps(8)
    train = probe.config.num_train_timesteps
    expected = {i: "sage-int8" if below <= t / train <= until else "dense"
                for i, t in enumerate(probe.timesteps.tolist())}
    assert set(expected.values()) == {"dense", "sage-int8"} and expected[0] == expected[7] == "dense"
    with enable_trtllm_attention(pipe, config) as handle:
        pipe("a fox", height=32, width=32, num_frames=1, num_inference_steps=8, output_type="latent",
             generator=torch.Generator().manual_seed(0))
        modes = layer_modes(handle)
    # two experts: each layer ran the steps of its expert
    assert all(m == {step: expected[step] for step in m} for m in modes.values()), (modes, expected)
    assert set().union(*modes.values()) == set(expected)


def test_a_bare_transformer_follows_the_sage_schedule_from_its_timestep_argument():
    model = tiny_wan()
    config = {"default": {"backend": "TORCH_REFERENCE", "quant": {"dtype_qk": "int8", "disabled_until_timestep": 0.8}}}
    with pytest.warns(UserWarning, match="reads the transformer's timestep argument"):
        handle = enable_trtllm_attention(model, config)
    with handle, torch.no_grad():
        for timestep in (900, 500):
            model(**wan_inputs(batch=1, frames=1, height=8, width=8, timestep=timestep))
        modes = layer_modes(handle)
    assert all(m == {0: "dense", 1: "sage-int8"} for m in modes.values())


# ------------------------------------------------------------------------------------------------ outputs and compile

def test_the_probe_changes_no_output():
    pipe = tiny_wan22_pipeline(0, two_experts=True)
    pipe.set_progress_bar_config(disable=True)
    spec = {"backend": "TORCH_REFERENCE", "quant": {"dtype_qk": "fp8_e4m3"}, "skip_softmax": {"threshold": 0.5}}

    def generate(config):
        with enable_trtllm_attention(pipe, config) as handle:
            frames = pipe("a fox", height=32, width=32, num_frames=1, num_inference_steps=3, output_type="latent",
                          generator=torch.Generator().manual_seed(0)).frames
            return frames, handle.stats.summary()

    off, off_summary = generate({"default": spec})
    on, on_summary = generate({"default": dict(spec, accuracy={"probe_rows": 32})})
    assert torch.equal(on, off)
    assert off_summary["error"] is None and off_summary["error_per_layer"] == {}
    assert on_summary["error"] > 0 and len(on_summary["error_per_step"]) == 3
    assert {k: v for k, v in on_summary.items() if not k.startswith("error")} == \
        {k: v for k, v in off_summary.items() if not k.startswith("error")}


def test_compiled_blocks_with_the_probe_the_guard_and_the_schedule_make_one_graph():
    """Both experts' blocks compiled (fullgraph), SAGE held off at the first steps, the probe every other step and a
    guard that trips in every SAGE layer: one graph over two pipeline calls, output equal to eager."""
    pipe = tiny_wan22_pipeline(0, two_experts=True)
    pipe.set_progress_bar_config(disable=True)
    config = {"default": {"backend": "TORCH_REFERENCE",
                          "quant": {"dtype_qk": "int8", "disabled_until_timestep": 0.9},
                          "accuracy": {"probe_rows": 8, "probe_every": 2, "max_error": 1e-3}}}

    def generate():
        return pipe("a fox", height=32, width=32, num_frames=1, num_inference_steps=5, output_type="latent",
                    generator=torch.Generator().manual_seed(0)).frames

    with enable_trtllm_attention(pipe, config) as handle, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = generate()
        eager_modes = layer_modes(handle)
        assert any("sage-int8" in m.values() and "dense" in list(m.values())[2:] for m in eager_modes.values())
        torch._dynamo.reset()
        dynamo_utils.counters.clear()
        for transformer in (pipe.transformer, pipe.transformer_2):
            for block in transformer.blocks:
                block.compile(fullgraph=True, backend="eager")
        try:
            first = generate()
            second = generate()
        finally:
            for transformer in (pipe.transformer, pipe.transformer_2):
                for block in transformer.blocks:
                    block._compiled_call_impl = None
        assert layer_modes(handle) == eager_modes
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 1
    assert torch.equal(first, eager) and torch.equal(second, eager)


def test_the_whole_model_traces_as_one_graph_with_the_probe_on():
    model = tiny_wan()
    config = {"default": dict(FP8_SAGE, accuracy={"probe_rows": 4, "max_error": BOUND})}
    with enable_trtllm_attention(model, config), torch.no_grad():
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(model)(**wan_inputs(batch=1, frames=1, height=8, width=8))
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons


@pytest.mark.parametrize("probed_step", [True, pytest.param(False, marks=pytest.mark.skipif(
    not PUBLISHES_STEPS, reason="diffusers 0.40's cache_context publishes no step index"))])
def test_no_host_read_on_the_attention_path_with_the_probe_on(probed_step, monkeypatch):
    """test_host_sync's detector, watching inside the probed op: the probe's rows are made on the device and its
    sums stay there, at probed steps and others."""
    model = tiny_wan()
    config = {"default": dict(FP8_SAGE, accuracy={"probe_rows": 8, "probe_every": 1 if probed_step else 2})}
    with enable_trtllm_attention(model, config) as handle, torch.no_grad():
        context = pipeline_context(model, step=1)  # step 1: probed at probe_every 1 only
        reads = test_host_sync.HostReads()
        with context, reads:
            model(**wan_inputs(batch=1, frames=1, height=8, width=8))
        assert reads.reads == []
        assert bool(handle.stats.errors()) == probed_step


# ------------------------------------------------------------------------------------------------ refusals

@pytest.mark.parametrize("accuracy, message", [
    ({"probe_rows": 0}, "accuracy.probe_rows=0 is invalid: expected an int in [1, 1024]"),
    ({"probe_rows": 1025}, "accuracy.probe_rows=1025 is invalid: expected an int in [1, 1024]"),
    ({"probe_rows": 2.0}, "accuracy.probe_rows=2.0 is invalid: expected an int in [1, 1024]"),
    ({"probe_every": 0}, "accuracy.probe_every=0 is invalid: expected an int >= 1"),
    ({"max_error": 0.0}, "accuracy.max_error=0.0 is invalid: expected a finite number > 0"),
    ({"max_error": math.inf}, "accuracy.max_error=inf is invalid: expected a finite number > 0"),
    ({"rows": 4}, "accuracy: unknown key(s) ['rows']; valid keys are ['max_error', 'probe_every', 'probe_rows']"),
    ("on", "accuracy='on' is invalid: expected a mapping with keys probe_rows, probe_every, max_error"),
])
def test_accuracy_values_are_refused_at_their_edges(accuracy, message):
    with pytest.raises(AttentionConfigError, match=re.escape(message)):
        AttentionConfig.from_dict({"default": {"backend": "TORCH_REFERENCE", "accuracy": accuracy}})
    assert AttentionConfig.from_dict({"default": {"accuracy": {"probe_rows": 1024, "probe_every": 1,
                                                               "max_error": 1e-9}}}).default.accuracy.probe_rows == 1024


@pytest.mark.parametrize("quant, message", [
    ({"dtype_qk": "int8", "disabled_until_timestep": 1.5},
     "quant.disabled_until_timestep=1.5 is invalid: expected a finite number in [0, 1]"),
    ({"dtype_qk": "int8", "disabled_below_timestep": -0.1},
     "quant.disabled_below_timestep=-0.1 is invalid: expected a finite number in [0, 1]"),
    ({"dtype_qk": "int8", "disabled_until_timestep": 0.5, "disabled_below_timestep": 0.5},
     "quant.disabled_below_timestep=0.5 is invalid: expected a value below quant.disabled_until_timestep=0.5"),
    ({"disabled_until_timestep": 0.9}, "quant.disabled_until_timestep=0.9 is invalid: expected 0 unless "
                                       "quant.dtype_qk is set"),
])
def test_sage_schedules_are_refused_at_their_edges(quant, message):
    with pytest.raises(AttentionConfigError, match=re.escape(message)):
        AttentionConfig.from_dict({"default": {"backend": "TORCH_REFERENCE", "quant": quant}})
    spec = AttentionConfig.from_dict({"default": {"quant": {"dtype_qk": "int8", "disabled_until_timestep": 0.5,
                                                            "disabled_below_timestep": 0.49}}}).default.quant
    assert [spec.runs_at(t) for t in (None, 0.51, 0.5, 0.49, 0.48)] == [False, False, True, True, False]


@pytest.mark.parametrize("spec", [
    {"backend": "TORCH_REFERENCE", "accuracy": {"probe_rows": 4}},
    {"backend": "TORCH_REFERENCE", "quant": {"dtype_qk": "int8", "disabled_below_timestep": 0.1}},
], ids=["accuracy", "schedule"])
def test_what_needs_a_pipeline_is_refused_without_one(spec):
    need = "needs the pipeline's steps and statistics"
    with pytest.raises(AttentionConfigError, match=need):
        WanTrtllmAttnProcessor({"default": spec})
    with pytest.raises(AttentionConfigError, match=need):
        set_dispatch_config({"default": spec})
    set_dispatch_config(None)


def test_the_probe_without_statistics_is_refused():
    with pytest.raises(AttentionConfigError, match="accuracy \\(the probe\\) is set for 4 layers .* but "
                                                   "collect_stats=False"):
        enable_trtllm_attention(tiny_wan(), {"default": {"backend": "TORCH_SDPA", "accuracy": {}}},
                                collect_stats=False)


def test_the_table_shows_the_probe():
    model = tiny_wan()
    config = {"default": dict(FP8_SAGE, accuracy={"probe_rows": 4})}
    with enable_trtllm_attention(model, config) as handle, torch.no_grad():
        model(**wan_inputs(batch=1, frames=1, height=8, width=8))
        stats = handle.stats
        table, layers = stats.table(), stats.error_table()
    worst_layer, worst = max(stats.errors().items(), key=lambda kv: kv[1])
    assert table.splitlines()[0] == "| step | modes | sparsity | probed error | worst layer (error) |"
    assert f"| {stats.error_per_step()[0]:.2e} | {worst_layer[1]} ({worst:.2e}) |" in table
    assert len(layers.splitlines()) == 2 + 4
    assert f"| {OUTLIER} | TORCH_REFERENCE:sage-fp8_e4m3 | {stats.error_per_layer()[OUTLIER]:.2e} | 0 (" in layers

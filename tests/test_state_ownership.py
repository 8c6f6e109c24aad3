"""Who owns which state: a call's settings travel with the call, a run belongs to the pipeline call that makes it.

Ordinary diffusers code must not change what runs: replacing ``pipe.scheduler`` after install, two pipelines in
two threads, one scheduler shared by two pipelines, a direct transformer call between pipeline calls, a bare
transformer over many runs, and diffusers' processor code making its calls in another order.
"""

import copy

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

from diffusers_trtllm import AttentionConfigError, enable_trtllm_attention
from diffusers_trtllm.backends.base import TRTLLM_ON_REFERENCE_ENV
from diffusers_trtllm.processors import base as processor_base
from diffusers_trtllm.run_state import Run
from diffusers_trtllm.tiny_pipelines import TINY_TEXT_LEN, tiny_wan22_pipeline

from helpers import (I2V_IMAGE_TOKENS, PUBLISHES_STEPS, LoopPipeline, cosmos3_transformer_call, predicted_gate_modes,
                     run_together, tiny_wan, wan_inputs)

GATE = 0.8
GATED_SKIP = {"default": {"backend": "TORCH_REFERENCE",
                          "skip_softmax": {"threshold": 0.3, "disabled_until_timestep": GATE}}}
SAGE = {"default": {"backend": "TORCH_REFERENCE", "quant": {"dtype_qk": "int8"}}}
UNGATED_SKIP = {"default": {"backend": "TORCH_REFERENCE", "skip_softmax": {"threshold": 0.3}}}
STEPS = 6


def generate(pipe, steps=STEPS):
    return pipe("a fox in snow", negative_prompt="blur", height=96, width=160, num_frames=5,
                num_inference_steps=steps, generator=torch.Generator().manual_seed(0), output_type="latent").frames


def tiny_pipe(two_experts=False, seed=0):
    pipe = tiny_wan22_pipeline(seed, two_experts=two_experts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def step_modes(handle) -> dict[int, str]:
    """Per step, the one mode every layer ran in (asserts the layers agree)."""
    modes = {}
    for step, counts in handle.stats.modes().items():
        assert len(counts) == 1, counts
        modes[step] = next(iter(counts)).split(":")[1]
    return modes


def expected_gate(scheduler, steps=STEPS, *, from_sigmas=None) -> dict[int, str]:
    probe = copy.deepcopy(scheduler)
    probe.set_timesteps(steps)
    expected = predicted_gate_modes(probe, GATE, from_sigmas=from_sigmas)
    assert set(expected.values()) == {"dense", "skip"}, expected  # the run crosses the gate
    return expected


def nothing_of_ours_on(scheduler) -> bool:
    return not {"step", "set_timesteps", "set_begin_index"} & set(vars(scheduler))


def test_a_scheduler_replaced_after_install_is_followed():
    """diffusers' own Wan example replaces the scheduler after loading; the gate then follows the new one."""
    pipe = tiny_pipe()
    with enable_trtllm_attention(pipe, GATED_SKIP) as handle:
        pipe.scheduler = UniPCMultistepScheduler.from_config(pipe.scheduler.config, flow_shift=8.0)
        generate(pipe)
        assert step_modes(handle) == expected_gate(pipe.scheduler)
        assert nothing_of_ours_on(pipe.scheduler)
        pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0)  # another kind, other timesteps
        generate(pipe)
        assert step_modes(handle) == expected_gate(pipe.scheduler)


def test_two_pipelines_in_two_threads_give_what_each_gives_alone():
    """Different configs on two pipelines running at the same time: every output bit-identical to the same
    pipeline run alone, every step's statistics too."""
    pipes = {"skip": tiny_pipe(seed=0), "sage": tiny_pipe(seed=1)}
    handles = {name: enable_trtllm_attention(pipes[name], config)
               for name, config in (("skip", GATED_SKIP), ("sage", SAGE))}
    alone = {name: (generate(pipe), handles[name].stats.summary()) for name, pipe in pipes.items()}
    for _ in range(3):
        results = run_together({name: lambda name=name: (generate(pipes[name]), handles[name].stats.summary())
                                for name in pipes})
        for name in pipes:
            assert torch.equal(results[name][0], alone[name][0]), name
            assert results[name][1] == alone[name][1], name
    for handle in handles.values():
        handle.restore()


@pytest.mark.parametrize("order", ["first-installed-first", "last-installed-first"])
def test_one_scheduler_shared_by_two_pipelines(order):
    """Pipelines built from shared components: each handle's gate keeps working whichever is restored first, and
    after every restore nothing of the package is on the scheduler."""
    first, second = tiny_pipe(seed=0), tiny_pipe(seed=1)
    second.scheduler = first.scheduler
    expected = expected_gate(first.scheduler)
    h1, h2 = enable_trtllm_attention(first, GATED_SKIP), enable_trtllm_attention(second, GATED_SKIP)
    for pipe, handle in ((first, h1), (second, h2)):
        generate(pipe)
        assert step_modes(handle) == expected
    restored, remaining = ((h1, (second, h2)) if order == "first-installed-first" else (h2, (first, h1)))
    restored.restore()
    assert nothing_of_ours_on(first.scheduler)
    generate(remaining[0])
    assert step_modes(remaining[1]) == expected
    remaining[1].restore()
    assert nothing_of_ours_on(first.scheduler)
    for pipe in (first, second):
        assert type(pipe).__mro__[1].__name__ == "DiffusionPipeline"  # WanPipeline itself again
        assert "_diffusers_trtllm_clock" not in vars(pipe)


def test_install_leaves_the_pipeline_class_and_restore_the_outputs():
    pipe = tiny_pipe()
    original_class = type(pipe)
    reference = generate(pipe)
    with enable_trtllm_attention(pipe, {"default": {"backend": "TORCH_SDPA"}}):
        assert type(pipe) is original_class
    assert type(pipe) is original_class
    assert torch.equal(generate(pipe), reference)


@pytest.mark.parametrize("config", [GATED_SKIP, SAGE, UNGATED_SKIP], ids=["gated-skip", "sage", "ungated-skip"])
def test_a_direct_transformer_call_between_runs_is_a_run_of_its_own(config):
    """A transformer call outside a pipeline call is a transformer-driven run of its own, with and without a
    timestep gate alike: handle.stats shows it (one step), and the next pipeline call runs and counts exactly as
    the first."""
    pipe = tiny_pipe()
    with enable_trtllm_attention(pipe, config) as handle:
        first = generate(pipe)
        first_stats = handle.stats.summary()
        assert sorted(first_stats["per_step"]) == list(range(STEPS))
        with torch.no_grad():
            pipe.transformer(**wan_inputs(batch=1, frames=1, height=12, width=20))
        direct = handle.stats
        assert sorted(direct.per_step()) == [0]
        assert {rec.calls for rec in direct.records.values()} == {1}
        second = generate(pipe)
        assert torch.equal(first, second)
        assert handle.stats.summary() == first_stats


def test_a_bare_transformer_over_many_runs_keeps_bounded_statistics():
    """Without a pipeline, a rising timestep starts a new run: 30 runs of 4 steps keep 4 steps of records."""
    model = tiny_wan()
    inputs = wan_inputs(batch=1, frames=1, height=8, width=8)
    with pytest.warns(UserWarning, match="reads the transformer's timestep"):
        handle = enable_trtllm_attention(model, GATED_SKIP)
    sites = len(handle.planner.calls)
    with handle, torch.no_grad():
        for _ in range(30):
            for t in (950, 850, 700, 400):
                model(**{**inputs, "timestep": torch.tensor([t])})
            records = handle.stats.records
            assert sorted({step for step, *_ in records}) == [0, 1, 2, 3]
            assert len(records) <= 4 * sites
            assert {rec.calls for rec in records.values()} == {1}
        assert step_modes(handle) == {0: "dense", 1: "dense", 2: "skip", 3: "skip"}


def test_a_loop_pipeline_counts_each_run_from_zero():
    pipe = LoopPipeline(tiny_wan(), FlowMatchEulerDiscreteScheduler(shift=3.0))
    inputs = wan_inputs(batch=1, frames=1, height=8, width=8)
    with enable_trtllm_attention(pipe, SAGE) as handle, torch.no_grad():
        for steps in (3, 5, 2):
            pipe(inputs, steps)
            assert sorted(handle.stats.per_step()) == list(range(steps))
            assert {rec.calls for rec in handle.stats.records.values()} == {1}


def _recorded_roles(monkeypatch):
    """(role, query length, key length, causal) of every attention call the processors make."""
    seen = []
    real = processor_base.run_attention

    def recording(call, query, key, value, **kwargs):
        seen.append((call.site.role, query.shape[1], key.shape[1], call.causal))
        return real(call, query, key, value, **kwargs)

    monkeypatch.setattr(processor_base, "run_attention", recording)
    return seen


def test_each_wan_role_gets_its_own_call_whatever_the_order(monkeypatch):
    """Wan 2.1 I2V's cross-attention makes two calls (image tokens, text tokens); each carries its own role's
    plan, found by the role the processor names, not by the order diffusers' code makes them in."""
    model = tiny_wan(i2v=True)
    inputs = wan_inputs(batch=1, frames=1, height=8, width=8, i2v=True)
    seen = _recorded_roles(monkeypatch)
    with enable_trtllm_attention(model, {"default": {"backend": "TORCH_SDPA"},
                                         "per_role": {"image_cross_attn": SAGE["default"]}}) as handle:
        with torch.no_grad():
            model(**inputs)
    video_tokens = 4 * 4  # 8 × 8 latents, patch 2 × 2, one frame
    assert set(seen) == {("self_attn", video_tokens, video_tokens, False),
                         ("image_cross_attn", video_tokens, I2V_IMAGE_TOKENS, False),
                         ("cross_attn", video_tokens, TINY_TEXT_LEN, False)}
    modes = {(layer.rsplit(".", 1)[-1], rec.mode) for (_, layer, *_), rec in handle.stats.records.items()}
    assert modes == {("attn1", "dense"), ("attn2", "dense"), ("attn2", "sage-int8")}


def test_each_cosmos3_role_gets_its_own_call(monkeypatch):
    transformer, kwargs = cosmos3_transformer_call()
    seen = _recorded_roles(monkeypatch)
    with enable_trtllm_attention(transformer, {"default": {"backend": "TORCH_REFERENCE"}}), torch.no_grad():
        transformer(**kwargs)
    roles = {role: (q, k, causal) for role, q, k, causal in seen}
    text, gen = roles["und_causal"][0], roles["gen_full"][0]
    assert roles == {"und_causal": (text, text, True), "gen_full": (gen, text + gen, False)}


def test_statistics_off_counts_nothing(monkeypatch):
    """With statistics off a call allocates nothing for counts; with them on, every call counts."""
    counted = []
    real = Run.count_call
    monkeypatch.setattr(Run, "count_call", lambda *args: counted.append(1) or real(*args))
    model = tiny_wan()
    inputs = wan_inputs(batch=1, frames=1, height=8, width=8)
    for collect_stats in (False, True):
        counted.clear()
        with enable_trtllm_attention(model, SAGE, collect_stats=collect_stats), torch.no_grad():
            model(**inputs)
        assert bool(counted) == collect_stats, (collect_stats, counted)


def test_the_reference_seam_is_decided_at_install(monkeypatch):
    """TRTLLM_ATTN on the reference (the CPU test seam) is chosen when the call site is planned: the variable
    is not read per call."""
    monkeypatch.setenv(TRTLLM_ON_REFERENCE_ENV, "1")
    transformer, kwargs = cosmos3_transformer_call()
    config = {"default": {"backend": "TRTLLM_ATTN"}, "per_role": {"und_causal": {"backend": "TORCH_SDPA"}}}
    with enable_trtllm_attention(transformer, config) as handle:
        monkeypatch.delenv(TRTLLM_ON_REFERENCE_ENV)
        with torch.no_grad():
            transformer(**kwargs)  # TRTLLM_ATTN's kernels would refuse a CPU
        assert {rec.backend for rec in handle.stats.records.values()} == {"TRTLLM_ATTN", "TORCH_SDPA"}


def test_a_summary_reads_the_counters_with_one_host_copy(monkeypatch):
    """Every step's counters stay on the device until a summary is asked for; then one ``.cpu()`` brings them all
    (on a GPU the only device-to-host copy statistics make)."""
    copies = []
    real_cpu = torch.Tensor.cpu
    pipe = LoopPipeline(tiny_wan(), FlowMatchEulerDiscreteScheduler(shift=3.0))
    with enable_trtllm_attention(pipe, SAGE) as handle, torch.no_grad():
        pipe(wan_inputs(batch=1, frames=1, height=8, width=8), 4)
        monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **kw: copies.append(self.shape) or
                            real_cpu(self, *a, **kw))
        summary = handle.stats.summary()
        handle.stats.table()
    assert sorted(summary["per_step"]) == [0, 1, 2, 3]
    assert copies == [torch.Size([4, len(handle.planner.calls), 3])]  # steps × sites × tile counters, once


def test_auto_that_drops_a_feature_warns_once_whatever_the_shapes():
    """The unbound processor chooses per kind of call; the warning that auto dropped Skip-Softmax is said once,
    not once per batch shape."""
    from diffusers_trtllm import WanTrtllmAttnProcessor

    model = tiny_wan()
    model.set_attn_processor(WanTrtllmAttnProcessor({"default": {"skip_softmax": {"threshold": 0.1}}}))
    with pytest.warns(UserWarning) as record, torch.no_grad():
        for size in (8, 12, 16):
            model(**wan_inputs(batch=1, frames=1, height=size, width=size))
    dropped = [w for w in record if "Skip-Softmax dropped" in str(w.message)]
    assert len(dropped) == 1, [str(w.message) for w in record]


def test_steps_come_in_number_order_past_ten():
    pipe = LoopPipeline(tiny_wan(), FlowMatchEulerDiscreteScheduler(shift=3.0))
    with enable_trtllm_attention(pipe, SAGE) as handle, torch.no_grad():
        pipe(wan_inputs(batch=1, frames=1, height=8, width=8), 12)
    assert list(handle.stats.per_step()) == list(range(12))
    assert list(handle.stats.summary()["per_step"]) == list(range(12))


@pytest.mark.parametrize("publish", [pytest.param(True, marks=pytest.mark.skipif(
    not PUBLISHES_STEPS, reason="diffusers 0.40's cache_context takes a name only")), False],
    ids=["published-step", "custom-loop"])
def test_a_begin_index_starts_the_run_at_that_step_and_its_timestep(publish):
    """img2img's begin index: a loop publishing its step index (as diffusers' pipelines do) starts the run at that
    step, with its sigma; a loop publishing nothing runs from the timestep it passes (steps numbered from 0)."""
    scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0)
    pipe = LoopPipeline(tiny_wan(), scheduler, publish=publish)
    expected = expected_gate(scheduler, steps=6, from_sigmas=publish)
    with enable_trtllm_attention(pipe, GATED_SKIP) as handle, torch.no_grad():
        pipe(wan_inputs(batch=1, frames=1, height=8, width=8), 6, begin=2)
        first = 2 if publish else 0
        assert step_modes(handle) == {i - 2 + first: expected[i] for i in range(2, 6)}


def test_the_gate_reads_t_with_the_schedulers_own_num_train_timesteps():
    """t = timestep / num_train_timesteps of the scheduler the pipeline has at the call (500 here, not 1000)."""
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=500, shift=1.0)
    pipe = LoopPipeline(tiny_wan(), scheduler)
    expected = expected_gate(scheduler, steps=6, from_sigmas=False)
    with enable_trtllm_attention(pipe, GATED_SKIP) as handle, torch.no_grad():
        pipe(wan_inputs(batch=1, frames=1, height=8, width=8), 6)
        assert step_modes(handle) == expected


def test_a_scheduler_method_the_user_wrapped_stays_theirs():
    scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0)
    pipe = LoopPipeline(tiny_wan(), scheduler)
    steps_seen = []
    original_step = scheduler.step

    def user_step(*args, **kwargs):
        steps_seen.append(1)
        return original_step(*args, **kwargs)

    scheduler.step = user_step
    with enable_trtllm_attention(pipe, GATED_SKIP) as handle, torch.no_grad():
        pipe(wan_inputs(batch=1, frames=1, height=8, width=8), 4)
        assert vars(scheduler)["step"] is user_step and len(steps_seen) == 4
        assert sorted(handle.stats.per_step()) == [0, 1, 2, 3]


def test_an_object_that_is_neither_pipeline_nor_transformer_is_refused():
    from types import SimpleNamespace

    with pytest.raises(AttentionConfigError, match="takes a diffusers pipeline .* or a transformer; got a "
                                                   "SimpleNamespace: pass pipe.transformer"):
        enable_trtllm_attention(SimpleNamespace(transformer=tiny_wan(), scheduler=None), SAGE)

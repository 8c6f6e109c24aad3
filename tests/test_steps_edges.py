"""The denoising clock (diffusers_trtllm.steps) at its edges, without a model: timesteps normalized by the train
timesteps, steps past either end of the schedule with no timestep, a scheduler's own step index, and a bare
transformer's timestep argument (equal: the same step; lower: the next; higher: a new run)."""

import pytest
import torch

from diffusers_trtllm.config import AttentionConfig
from diffusers_trtllm.plan import AttentionCall, CallPlanner, CallSite
from diffusers_trtllm.stats import AttentionStats
from diffusers_trtllm.steps import DenoisingClock


@pytest.fixture
def clock():
    planner = CallPlanner(AttentionConfig())
    call = AttentionCall(CallSite("transformer", "a", "self", "self"), "TORCH_REFERENCE", False, None, None,
                         counting=True)
    planner.calls = {call.site: call}
    return DenoisingClock(planner, AttentionStats([call]), 1000, gated=True)


def counted_call(clock: DenoisingClock) -> None:
    (call,) = clock.planner.calls.values()
    call.counts += torch.tensor([1, 2, 1, 1])


def test_timesteps_are_normalized_and_a_step_off_the_schedule_has_none(clock):
    clock.start_run()
    clock.set_timesteps(torch.tensor([999, 500, 0]), 1000)
    assert (clock.step, clock.planner.timestep) == (0, 0.999)
    seen = []
    for step in (2, 3, -1, 1):
        clock.set_step(step)
        seen.append(clock.planner.timestep)
    assert seen == [0.0, None, None, 0.5]
    clock.set_timesteps(torch.tensor([500]), 500)
    assert clock.planner.timestep == 1.0


def test_a_step_ends_at_the_schedulers_own_index_when_it_has_one(clock):
    clock.start_run()
    clock.set_timesteps(torch.tensor([900, 600, 300]), 1000)
    counted_call(clock)
    clock.end_step()
    assert (clock.step, clock.planner.timestep) == (1, 0.6)
    counted_call(clock)
    clock.end_step(next_step=0)
    assert (clock.step, clock.planner.timestep) == (0, 0.9)
    assert sorted(clock.stats.per_step()) == [0, 1]


def test_a_bare_transformers_timestep_argument_makes_steps_and_runs(clock):
    steps = []
    for raw in (800, 800, torch.tensor([200.0, 600.0]), None, 600, 900):
        clock.observe(raw)
        counted_call(clock)
        steps.append((clock.step, clock.planner.timestep))
    assert steps == [(0, 0.8), (0, 0.8), (1, 0.6), (1, 0.6), (1, 0.6), (0, 0.9)]
    clock.flush()
    assert list(clock.stats.per_step()) == [0]  # the run that started at 900 holds one step
    clock.in_pipeline_call = True
    clock.observe(100)
    assert clock.planner.timestep == 0.9


def test_counters_are_kept_only_while_a_run_is_open(clock):
    counted_call(clock)
    clock.flush()
    assert clock.stats.records == {}
    clock.start_run()
    counted_call(clock)
    clock.flush()
    assert list(clock.stats.records) == [(0, "transformer.a", "TORCH_REFERENCE", "dense")]

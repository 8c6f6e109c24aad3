"""The denoising clock (diffusers_trtllm.steps) at its edges, without a model: timesteps normalized by the train
timesteps, steps past either end of the schedule with no timestep, a scheduler's own step index, and a bare
transformer's timestep argument (equal: the same step; lower: the next; higher: a new run), the step each plan is
for (the accuracy probe's steps), schedulers without set_begin_index or a config, an interrupted pipeline call."""

import types

import pytest
import torch
from diffusers import DDIMScheduler, EulerDiscreteScheduler

from diffusers_trtllm.config import AccuracySpec, AttentionConfig
from diffusers_trtllm.ops import PROBE
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



def test_a_run_whose_scheduler_was_set_before_it_steps_without_timesteps(clock):
    """A run in which the scheduler steps without set_timesteps (its timesteps were set before the pipeline call):
    each step is planned with no timestep, and the previous run's timesteps are not reused."""
    clock.start_run()
    clock.set_timesteps(torch.tensor([900, 600]), 1000)
    clock.start_run()
    assert clock.planner.timestep is None
    counted_call(clock)
    clock.end_step()
    assert (clock.step, clock.planner.timestep) == (1, None)
    assert list(clock.stats.per_step()) == [0]

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


# --- the step handed to the planner: the accuracy probe's steps (0, probe_every, 2·probe_every... of each run) -----

def probed_clock_with(num_train_timesteps: int = 1000) -> DenoisingClock:
    """A clock whose one site is probed at every second step (``settings[PROBE]``: the rows the op checks)."""
    planner = CallPlanner(AttentionConfig())
    call = AttentionCall(CallSite("transformer", "a", "self", "self"), "TORCH_REFERENCE", False, None, None,
                         accuracy=AccuracySpec(probe_rows=4, probe_every=2), counting=True)
    planner.calls = {call.site: call}
    return DenoisingClock(planner, AttentionStats([call]), num_train_timesteps, gated=True)


@pytest.fixture
def probed_clock():
    return probed_clock_with()


def probe_rows(clock: DenoisingClock) -> int:
    (call,) = clock.planner.calls.values()
    return int(call.settings[PROBE])


def test_steps_set_by_the_scheduler_are_probed_every_probe_every(probed_clock):
    clock = probed_clock
    clock.start_run()
    clock.set_timesteps(torch.tensor([900, 600, 300, 100]), 1000)
    rows = [probe_rows(clock)]
    for step in (1, 2, 3):
        clock.set_step(step)  # img2img's begin index, or the scheduler's own index at a step's end
        rows.append(probe_rows(clock))
    assert rows == [4, 0, 4, 0]
    assert clock.planner.step == 3


def test_each_run_and_each_new_schedule_starts_probed_at_step_0(probed_clock):
    clock = probed_clock
    clock.start_run()
    clock.set_timesteps(torch.tensor([900, 600, 300]), 1000)
    clock.end_step()
    assert (clock.planner.step, probe_rows(clock)) == (1, 0)
    clock.set_timesteps(torch.tensor([500, 250]), 1000)  # a second schedule in the same call (a second stage)
    assert (clock.planner.step, clock.planner.timestep, probe_rows(clock)) == (0, 0.5, 4)
    clock.end_step()
    clock.start_run()  # the next run starts at step 0 with no timestep known yet
    assert (clock.planner.step, clock.planner.timestep, probe_rows(clock)) == (0, None, 4)


def test_a_bare_transformers_steps_are_probed_every_probe_every(probed_clock):
    clock = probed_clock
    seen = []
    for raw in (900, 600, 300, 300, 100):
        clock.observe(raw)
        seen.append((clock.planner.step, probe_rows(clock)))
    assert seen == [(0, 4), (1, 0), (2, 4), (2, 4), (3, 0)]


# --- a pipeline's scheduler reporting to the clock ------------------------------------------------------------------

class Interrupted(Exception):
    pass


class DenoisingLoop:
    """A pipeline call's shape: ``set_timesteps``, then per timestep one transformer call (here: what the clock
    planned for it is recorded) and ``scheduler.step``; it can start mid-schedule without ``set_begin_index`` and
    stop with an exception before a step."""

    def __init__(self, scheduler, clock: DenoisingClock):
        self.scheduler, self.clock, self.seen = scheduler, clock, []
        clock.follow(self)

    def __call__(self, steps: int, start: int = 0, interrupt_at: int | None = None):
        self.scheduler.set_timesteps(steps)
        sample = torch.zeros(1, 2)
        for i, t in enumerate(self.scheduler.timesteps[start:]):
            if i == interrupt_at:
                raise Interrupted
            self.seen.append((self.clock.planner.step, self.clock.planner.timestep))
            sample = self.scheduler.scale_model_input(sample, t)
            sample = self.scheduler.step(torch.zeros_like(sample), t, sample).prev_sample
        return sample


def test_after_a_step_the_clock_takes_the_schedulers_own_index():
    # A loop over timesteps[2:] without set_begin_index: the scheduler finds its index from the first timestep it
    # steps, so from the second transformer call on, step and timestep are the scheduler's, not a count from 0.
    scheduler = EulerDiscreteScheduler()
    loop = DenoisingLoop(scheduler, probed_clock_with())
    loop(4, start=2)
    timesteps = (scheduler.timesteps / 1000).tolist()
    assert loop.seen[1] == (3, timesteps[3])


def test_a_scheduler_without_set_begin_index_still_reports_its_steps():
    loop = DenoisingLoop(DDIMScheduler(), probed_clock_with())  # DDIM has no set_begin_index, no index
    loop(3)
    assert loop.seen == [(0, 0.666), (1, 0.333), (2, 0.0)]


class SchedulerWithoutConfig:
    """A scheduler that is not a diffusers one: set_timesteps, timesteps and step, no config."""

    def set_timesteps(self, steps: int):
        self.timesteps = torch.linspace(750, 250, steps)

    def scale_model_input(self, sample, t):
        return sample

    def step(self, model_output, t, sample):
        return types.SimpleNamespace(prev_sample=sample)


def test_a_scheduler_without_a_config_has_1000_train_timesteps():
    loop = DenoisingLoop(SchedulerWithoutConfig(), probed_clock_with(num_train_timesteps=500))
    loop(3)
    assert loop.seen == [(0, 0.75), (1, 0.5), (2, 0.25)]


def test_a_direct_call_after_an_interrupted_pipeline_call_starts_a_new_run():
    clock = probed_clock_with()
    loop = DenoisingLoop(DDIMScheduler(), clock)
    with pytest.raises(Interrupted):
        loop(4, interrupt_at=2)  # stopped at t = 0.5, its run no longer open
    clock.observe(250)  # lower than where the pipeline stopped, yet the first step of a new run
    assert (clock.step, clock.planner.step, clock.planner.timestep) == (0, 0, 0.25)



# --- a bare transformer's timestep argument -------------------------------------------------------------------------

class TimestepModule(torch.nn.Module):
    def forward(self, hidden_states, timestep):
        return hidden_states


def hooked(clock: DenoisingClock) -> TimestepModule:
    module = TimestepModule()
    clock.timestep_hook(module, lambda bound: bound.get("timestep"))
    return module


def test_a_positional_timestep_argument_is_read(probed_clock):
    module = hooked(probed_clock)
    for raw in (800, 600):
        module(torch.zeros(1), torch.tensor([raw]))
    assert (probed_clock.step, probed_clock.planner.timestep) == (1, 0.6)


def test_a_call_that_does_not_fit_the_forward_fails_with_the_forwards_own_error(probed_clock):
    module = hooked(probed_clock)
    with pytest.raises(TypeError, match="unexpected keyword argument 'timesteps'"):
        module(torch.zeros(1), timestep=torch.tensor([800]), timesteps=torch.tensor([800]))

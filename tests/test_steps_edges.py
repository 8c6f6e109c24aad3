"""A handle's runs (diffusers_trtllm.steps) at their edges, without a model: the cache context a pipeline publishes
(its step index and sigma; a lower step or a name seen twice in a step starts a new run; diffusers' reset ends
it), a name-only context (a name seen twice begins the next step; the timestep argument gives t where a gate
needs it), a transformer's timestep argument (equal: the same step; lower: the next; higher: a new run), the step
each plan is for (the accuracy probe's steps), and runs that belong to the thread or task that opened them."""

import contextvars
import threading

import diffusers.hooks.hooks
import pytest
import torch

from diffusers_trtllm.config import AccuracySpec, AttentionConfig
from diffusers_trtllm.plan import AttentionCall, CallPlanner, CallSite
from diffusers_trtllm.run_state import PROBE, open_run, run_here
from diffusers_trtllm.steps import RunTracker, TimestepReader

if not hasattr(diffusers.hooks.hooks, "CacheContext"):
    pytest.skip("diffusers 0.40's cache_context publishes a name only (the name-only path is tested through "
                "pipelines)", allow_module_level=True)
CacheContext = diffusers.hooks.hooks.CacheContext


def tracker_with(num_train_timesteps: int = 1000, gated: bool = True) -> RunTracker:
    """A tracker of one site probed at every second step (``settings[PROBE]``: the rows the op checks)."""
    planner = CallPlanner(AttentionConfig())
    call = AttentionCall(CallSite("transformer", "a", "self", "self"), "TORCH_REFERENCE", False, None, None,
                         accuracy=AccuracySpec(probe_rows=4, probe_every=2), counting=True)
    planner.calls = {call.site: call}
    planner.collect_stats = True
    return RunTracker(planner, num_train_timesteps, gated=gated)


@pytest.fixture
def tracker():
    tracker = tracker_with()
    yield tracker
    run = open_run(tracker.key)
    if run is not None:
        tracker.end(run)


def where(tracker: RunTracker) -> tuple:
    """(step, t, probe rows) of the run open in this thread."""
    run = open_run(tracker.key)
    return run.step, run.timestep, int(run.settings[0, PROBE])


def counted_call(tracker: RunTracker) -> None:
    run = open_run(tracker.key)
    run.count_call(0, 1, 2)


def context(name="cond", step=None, sigma=None, timestep=None):
    return CacheContext(name, step_index=step, sigma=sigma, timestep=timestep)


# --- a pipeline that publishes its step ---------------------------------------------------------------------------

def test_published_steps_plan_at_their_sigma_and_cfg_halves_share_a_step(tracker):
    seen = []
    for step, sigma in enumerate((0.9, 0.6, 0.3)):
        for name in ("cond", "uncond"):
            tracker.on_cache_context(context(name, step, sigma))
            counted_call(tracker)
            seen.append(where(tracker))
    assert seen == [(0, 0.9, 4)] * 2 + [(1, 0.6, 0)] * 2 + [(2, 0.3, 4)] * 2
    run = open_run(tracker.key)
    tracker.on_reset()
    assert not run.is_open and run_here(tracker.key) is run
    assert {step: rec.calls for (step, *_), rec in run.data["stats"].records.items()} == {0: 2, 1: 2, 2: 2}


def test_a_published_timestep_is_normalized_by_the_train_timesteps():
    tracker = tracker_with(num_train_timesteps=500)
    tracker.on_cache_context(context(step=0, sigma=0.1, timestep=torch.tensor([250.0])))
    assert where(tracker)[1] == 0.5
    tracker.on_cache_context(context(step=1, sigma=0.1, timestep=100))
    assert where(tracker)[1] == 0.2


@pytest.mark.parametrize("second", [(2, "cond"), (4, "cond")], ids=["a lower step", "the same step and name"])
def test_a_lower_step_or_a_name_seen_twice_in_a_step_starts_a_new_run(tracker, second):
    """A pipeline call that raised never reached diffusers' reset: the next call's first context starts over."""
    for step in (3, 4):
        tracker.on_cache_context(context(step=step, sigma=0.5))
    first = open_run(tracker.key)
    tracker.on_cache_context(context(second[1], second[0], 0.8))
    assert open_run(tracker.key) is not first
    assert where(tracker)[:2] == (second[0], 0.8)


def test_a_begin_index_starts_the_run_at_its_step_and_probe_steps_count_from_0(tracker):
    tracker.on_cache_context(context(step=2, sigma=0.5))
    assert where(tracker) == (2, 0.5, 4)
    tracker.on_cache_context(context(step=3, sigma=0.25))
    assert where(tracker) == (3, 0.25, 0)


# --- a pipeline that publishes only a name (HunyuanVideo 1.5) -------------------------------------------------------

def test_a_name_seen_twice_begins_the_next_step_and_the_timestep_argument_gives_t(tracker):
    seen = []
    for raw in (900, 600):
        for name in ("pred_cond", "pred_uncond"):
            tracker.on_cache_context(context(name))
            tracker.on_transformer_call(torch.tensor([float(raw)]))
            seen.append(where(tracker))
    assert seen == [(0, 0.9, 4)] * 2 + [(1, 0.6, 0)] * 2


def test_without_a_gate_a_name_only_run_never_reads_the_timestep_argument():
    tracker = tracker_with(gated=False)
    reads = []

    class Watched:
        def detach(self):
            reads.append(1)
            return self

    tracker.on_cache_context(context("pred_cond"))
    tracker.on_transformer_call(Watched())
    assert reads == [] and where(tracker)[:2] == (0, None)
    tracker.end(open_run(tracker.key))


# --- no pipeline: the transformer's timestep argument ---------------------------------------------------------------

def test_a_transformers_timestep_argument_makes_steps_and_runs(tracker):
    steps = []
    for raw in (800, 800, torch.tensor([200.0, 600.0]), None, 600, 900):
        tracker.on_transformer_call(raw)
        counted_call(tracker)
        steps.append(where(tracker)[:2])
    assert steps == [(0, 0.8), (0, 0.8), (1, 0.6), (1, 0.6), (1, 0.6), (0, 0.9)]
    assert list(tracker.stats_run().data["stats"].per_step()) == []  # the run that started at 900: step 0 open


def test_a_transformer_call_inside_a_published_run_changes_nothing(tracker):
    tracker.on_cache_context(context(step=0, sigma=0.9))
    run = open_run(tracker.key)
    tracker.on_transformer_call(torch.tensor([100.0]))
    assert open_run(tracker.key) is run and where(tracker)[:2] == (0, 0.9)


def test_a_bare_transformers_steps_are_probed_every_probe_every(tracker):
    seen = []
    for raw in (900, 600, 300, 300, 100):
        tracker.on_transformer_call(raw)
        seen.append(where(tracker)[::2])
    assert seen == [(0, 4), (1, 0), (2, 4), (2, 4), (3, 0)]


class TimestepModule(torch.nn.Module):
    def forward(self, hidden_states, timestep):
        return hidden_states


def test_a_positional_timestep_argument_is_read(tracker):
    module = TimestepModule()
    module.register_forward_pre_hook(TimestepReader(tracker, ("timestep",)), with_kwargs=True)
    for raw in (800, 600):
        module(torch.zeros(1), torch.tensor([raw]))
    assert where(tracker)[:2] == (1, 0.6)


def test_a_call_that_does_not_fit_the_forward_fails_with_the_forwards_own_error(tracker):
    module = TimestepModule()
    module.register_forward_pre_hook(TimestepReader(tracker, ("timestep",)), with_kwargs=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'timesteps'"):
        module(torch.zeros(1), timestep=torch.tensor([800]), timesteps=torch.tensor([800]))


# --- a run belongs to the thread or task that opened it --------------------------------------------------------------

def test_runs_in_two_threads_and_two_contexts_are_their_own(tracker):
    tracker.on_cache_context(context(step=5, sigma=0.1))
    seen = {}

    def other(name, sigma):
        tracker.on_cache_context(context(step=0, sigma=sigma))
        seen[name] = where(tracker)[:2]

    thread = threading.Thread(target=other, args=("thread", 0.7))
    thread.start()
    thread.join()
    contextvars.copy_context().run(other, "task", 0.4)
    assert seen == {"thread": (0, 0.7), "task": (0, 0.4)}
    assert where(tracker)[:2] == (5, 0.1)  # this thread's run is untouched
    assert tracker.last_ended is None  # no other thread's run ended

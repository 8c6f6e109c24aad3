"""A handle's runs: where each starts, which step it is at, and that step's timestep.

A run is one pipeline call, owned by the thread or task that makes it (:mod:`~diffusers_trtllm.run_state`). The
handle learns of it through diffusers' own channel, a stateful hook in each transformer's ``HookRegistry``:

- **Pipelines that publish their step** (diffusers' Wan and Cosmos 3 pipelines wrap every transformer call in
  ``transformer.cache_context(name, step_index=i, sigma=...)``): the first context opens a run in the calling
  thread or task, a new ``step_index`` closes the step and plans the next at its normalized timestep t (the
  context's ``timestep`` / ``num_train_timesteps`` where given, else its ``sigma``: the flow-matching time, which
  is t before the scheduler rounds timesteps to integers), and diffusers' ``maybe_free_model_hooks`` at the end of
  the call (``reset_stateful_hooks``) closes the run. A step index below the current one, or a context name seen
  twice in one step, starts a new run (a call that raised before its end).
- **Pipelines that publish only a name** (HunyuanVideo 1.5; every pipeline under diffusers 0.40, whose
  ``cache_context`` takes a name only): the first context opens a run, a name seen twice
  begins the next step, and where a timestep gate is configured, the transformer's timestep argument gives t (one
  host read per transformer call).
- **No pipeline** (a bare transformer, a custom loop, a transformer called directly outside a pipeline call): a
  forward pre-hook reads the transformer's timestep argument (one host read per call): a call with a new timestep
  is a new step of the thread's transformer-driven run, one with a higher timestep than the last (or the first)
  starts a new run. This holds with and without a timestep gate, so statistics mean the same either way.

Nothing is read on the per-call attention path, and nothing of the user's objects is re-classed or wrapped: the
transformer carries one named, removable hook in its ``HookRegistry`` and one forward pre-hook, both picklable.
Whole-model ``torch.compile`` skips the pre-hook (runs of pipelines that publish their step need none).

At the end of a step probed by a site with an accuracy guard, the run's probed errors are read (one host copy,
once per probed step) and handed to the planner's guard before the next step is planned.
"""

from __future__ import annotations

import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.hooks.hooks import BaseState, StateManager

from .plan import CallPlanner
from .processors.base import bound_arguments
from .run_state import Run, open_run, run_here, set_run_here
from .stats import AttentionStats

#: the name of the handle's hook in a transformer's ``HookRegistry``
HOOK_NAME = "diffusers_trtllm"
PIPELINE, TRANSFORMER = "pipeline", "transformer"


class RunTracker:
    """Opens, steps and closes a handle's runs from the channels above (see the module docstring).

    ``gated``: some site's settings follow the timestep (Skip-Softmax's gate, the SAGE step schedule).
    """

    def __init__(self, planner: CallPlanner, num_train_timesteps: int, *, gated: bool):
        self.planner = planner
        self.num_train_timesteps = num_train_timesteps
        self.gated = gated
        #: the last run that ended in any thread (what ``handle.stats`` shows where the caller's thread has none)
        self.last_ended: Run | None = None

    def __getstate__(self):
        return {**self.__dict__, "last_ended": None}  # a copy starts without the original's runs

    @property
    def key(self) -> int:
        return self.planner.run_key.value

    # --- runs and steps -----------------------------------------------------------------------------------------
    def begin(self, source: str) -> Run:
        """A new run in this thread or task, in place of the one here: counters zeroed, step 0 at no timestep. The
        run it replaces is left as it is (a task copies its creator's context: that run may be its creator's)."""
        run = self.planner.new_run()
        run.data.update(stats=AttentionStats(run), source=source, names=set(), published_step=False, fresh=True)
        set_run_here(self.key, run)
        return run

    def end(self, run: Run) -> None:
        """Close ``run``: its last step is kept, it stays this thread's run for ``handle.stats``."""
        if not run.is_open:
            return
        self._close_step(run)
        run.close()
        self.last_ended = run

    def advance(self, run: Run, step: int, timestep: float | None) -> None:
        """Step ``run.step`` ended: keep its statistics, let the guard judge it, plan ``step`` at ``timestep``."""
        if not run.data["fresh"]:
            self._close_step(run)
        run.data["fresh"] = False
        self.planner.plan_step(run, timestep, step)

    def _close_step(self, run: Run) -> None:
        stats = run.data["stats"]
        stats.close_step(run.step)
        if self.planner.guarding(run):
            self.planner.guard(run, run.step, stats.step_errors(run.step))

    def stats_run(self) -> Run | None:
        """The run ``handle.stats`` shows: this thread's (open or last ended), else the last ended anywhere."""
        return run_here(self.key) or self.last_ended

    # --- channel 1: diffusers' cache context ----------------------------------------------------------------------
    def on_cache_context(self, context) -> None:
        """A pipeline entered ``transformer.cache_context(...)``: a ``CacheContext`` (diffusers 0.42), or only its
        name (diffusers 0.40); None: it left it."""
        if context is None:
            return
        if isinstance(context, str):
            context = _NameOnly(context)
        run = open_run(self.key)
        step, name = context.step_index, context.name
        if run is None or run.data["source"] != PIPELINE or self._starts_over(run, step, name):
            run = self.begin(PIPELINE)
        names = run.data["names"]
        if step is None:  # a name-only channel: a name seen in this step begins the next one
            if name in names or run.data["fresh"]:
                self.advance(run, 0 if run.data["fresh"] else run.step + 1, run.timestep)
                names.clear()
        elif run.data["fresh"] or step != run.step:
            self.advance(run, step, self._timestep_of(context))
            names.clear()
        names.add(name)
        run.data["published_step"] = step is not None

    @staticmethod
    def _starts_over(run: Run, step: int | None, name: str) -> bool:
        if run.data["fresh"]:
            return False
        if step is None:
            return run.data["published_step"]
        return step < run.step or (step == run.step and name in run.data["names"])

    def _timestep_of(self, context) -> float | None:
        if context.timestep is not None:
            return self._normalized(context.timestep)
        return None if context.sigma is None else float(context.sigma)

    def on_reset(self) -> None:
        """diffusers reset the transformer's stateful hooks (``maybe_free_model_hooks`` ends every pipeline call):
        the run open in this thread or task ends."""
        run = open_run(self.key)
        if run is not None and run.data["source"] == PIPELINE:
            self.end(run)

    # --- channel 2: the transformer's timestep argument ---------------------------------------------------------
    def on_transformer_call(self, raw) -> None:
        """A transformer call with timestep argument ``raw`` (a tensor, number or None), read only if needed."""
        run = open_run(self.key)
        if run is not None and run.data["source"] == PIPELINE:
            if not run.data["published_step"] and self.gated and raw is not None:
                t = self._normalized(raw)
                if t != run.timestep:
                    self.planner.plan_step(run, t, run.step)
            return
        if raw is None:  # no timestep: the call belongs to the run in progress
            if run is None:
                self.advance(self.begin(TRANSFORMER), 0, None)
            return
        t = self._normalized(raw)
        if run is None or run.timestep is None or t > run.timestep:
            run = self.begin(TRANSFORMER)
            self.advance(run, 0, t)
        elif t != run.timestep:
            self.advance(run, run.step + 1, t)

    def _normalized(self, raw) -> float:
        value = float(raw.detach().float().max()) if torch.is_tensor(raw) else float(raw)
        return value / self.num_train_timesteps


class _NameOnly:
    """What diffusers before 0.42 publishes of a cache context: its name."""

    step_index = timestep = sigma = None

    def __init__(self, name: str):
        self.name = name


class _StepChannel(StateManager):
    """Where diffusers' ``cache_context`` delivers a pipeline's position: to the tracker, which keeps it in the
    calling thread's run (never on this shared object)."""

    def __init__(self, tracker: RunTracker):
        super().__init__(BaseState)
        self.tracker = tracker

    def set_context(self, context) -> None:
        self.tracker.on_cache_context(context)


class RunHook(ModelHook):
    """The handle's hook in a transformer's ``HookRegistry``: stateful, so diffusers hands it each cache context
    and resets it at the end of each pipeline call. It does nothing in ``forward``."""

    _is_stateful = True

    def __init__(self, tracker: RunTracker):
        super().__init__()
        self.channel = _StepChannel(tracker)

    def reset_state(self, module: torch.nn.Module) -> torch.nn.Module:
        self.channel.tracker.on_reset()
        return module


class TimestepReader:
    """A forward pre-hook (with kwargs) that hands the transformer's timestep argument to the tracker."""

    def __init__(self, tracker: RunTracker, names: tuple[str, ...]):
        self.tracker, self.names = tracker, names

    def __call__(self, module, args, kwargs) -> None:
        if torch.compiler.is_compiling():  # whole-model compile: the cache-context channel serves pipelines
            return
        self.tracker.on_transformer_call(read_timestep_arguments(bound_arguments(module, args, kwargs), self.names))


def read_timestep_arguments(bound: dict, names: tuple[str, ...]) -> torch.Tensor | None:
    """The raw timesteps a transformer call got in its arguments ``names`` (all noisy modalities), or None."""
    present = [t.flatten() for name in names if (t := bound.get(name)) is not None and torch.is_tensor(t) and t.numel()]
    return torch.cat(present) if present else None


def attach(tracker: RunTracker, transformer: torch.nn.Module, timestep_names: tuple[str, ...]):
    """Attach the tracker to ``transformer``: its hook in the ``HookRegistry`` and the timestep pre-hook. Returns
    the function that detaches them, leaving the transformer's attributes as they were."""
    had_registry = "_diffusers_hook" in transformer.__dict__
    registry = HookRegistry.check_if_exists_or_initialize(transformer)
    missing = object()
    forward = transformer.__dict__.get("forward", missing)
    registry.register_hook(RunHook(tracker), HOOK_NAME)
    # The hook does nothing in forward: keep the transformer's forward as it was (diffusers' rewrite is a local
    # function, which would make the transformer unpicklable).
    _set_forward(transformer, forward, missing)
    pre_hook = transformer.register_forward_pre_hook(TimestepReader(tracker, timestep_names), with_kwargs=True)

    def detach():
        pre_hook.remove()
        current = transformer.__dict__.get("forward", missing)
        registry.remove_hook(HOOK_NAME, recurse=False)
        _set_forward(transformer, current, missing)
        if not had_registry and not registry.hooks and transformer.__dict__.get("_diffusers_hook") is registry:
            del transformer._diffusers_hook

    return detach


def _set_forward(module: torch.nn.Module, forward, missing) -> None:
    if forward is missing:
        module.__dict__.pop("forward", None)
    else:
        module.forward = forward


def installed_tracker(transformer: torch.nn.Module) -> RunTracker | None:
    """The tracker attached to ``transformer``, if any."""
    registry = transformer.__dict__.get("_diffusers_hook")
    hook = registry.get_hook(HOOK_NAME) if registry is not None else None
    return hook.channel.tracker if hook is not None else None


def num_train_timesteps(scheduler) -> int:
    """The scheduler's ``num_train_timesteps`` (what normalizes its timesteps to t), 1000 without one."""
    return getattr(getattr(scheduler, "config", None), "num_train_timesteps", None) or 1000

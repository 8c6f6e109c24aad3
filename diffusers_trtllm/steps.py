"""The denoising clock of a handle: which run and step its pipeline is at, and that step's timestep.

A handle follows its own pipeline, not a scheduler object. Each call of the pipeline (``pipe(...)``) is a run on
the scheduler the pipeline has at that moment: for the duration of that call only, the scheduler's
``set_timesteps`` (the run's timesteps, copied to the host once), ``set_begin_index`` and ``step`` (a step ends)
report to the clock, which plans each step outside the transformer; when the call returns they are the
scheduler's own again. So replacing ``pipe.scheduler`` is followed at the next call, a scheduler shared by two
pipelines carries nothing of either between calls, and nothing is read on the per-call attention path (the
transformer can be compiled whole).

At the end of a step probed by a site with an accuracy guard, the clock reads that step's probed errors (one
host copy, once per probed step) and hands them to the planner's guard before planning the next step.

Outside a pipeline call (a bare transformer, or a pipeline's transformer called directly), and only when a
timestep gate (Skip-Softmax's or the SAGE step schedule) is configured, a forward pre-hook reads the
transformer's timestep argument (one host read per transformer call): a new timestep is a new step, a rising one
a new run.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Callable

import torch

from .errors import AttentionConfigError
from .plan import CallPlanner
from .stats import AttentionStats

TimestepReader = Callable[[dict], "torch.Tensor | float | None"]

#: The pipeline attribute that names the clock following it (set by :meth:`DenoisingClock.follow`).
_CLOCK_ATTRIBUTE = "_diffusers_trtllm_clock"
#: Scheduler methods that report to the clock during a pipeline call.
_REPORTING = ("set_timesteps", "set_begin_index", "step")


class DenoisingClock:
    """Drives ``planner`` and ``stats`` from a pipeline's calls (or, without one, from the transformer's argument).

    ``running``: a run is open (a pipeline call in progress, or a transformer-driven run); statistics close steps
    only then, so calls between a pipeline's runs belong to no run (their counters are zeroed when the next starts).
    """

    def __init__(self, planner: CallPlanner, stats: AttentionStats, num_train_timesteps: int, *, gated: bool):
        self.planner = planner
        self.stats = stats
        self.num_train_timesteps = num_train_timesteps
        self.gated = gated
        self.step = 0
        self.timesteps: list[float] = []
        self.running = False
        self.in_pipeline_call = False
        self._undo: list[Callable[[], None]] = []

    # --- runs and steps -----------------------------------------------------------------------------------------
    def start_run(self) -> None:
        """A run starts: statistics and counters zeroed, step 0, no timestep known yet."""
        self.stats.start_run()
        self.planner.start_run()
        self.running = True
        self.step = 0
        self.timesteps = []
        self.planner.plan_step(None, 0)

    def set_timesteps(self, timesteps: torch.Tensor, num_train_timesteps: int) -> None:
        """The run's timesteps (one host copy per run); plans the current step."""
        self.num_train_timesteps = num_train_timesteps
        self.timesteps = [t / num_train_timesteps for t in torch.as_tensor(timesteps).float().tolist()]
        self.step = 0
        self.planner.plan_step(self._timestep_at(self.step), self.step)

    def set_step(self, step: int) -> None:
        """The scheduler starts (or continues) at ``step`` of its timesteps (img2img's begin index)."""
        self.step = step
        self.planner.plan_step(self._timestep_at(step), step)

    def end_step(self, next_step: int | None = None) -> None:
        """A denoising step ended: keep its statistics, let the guard judge it, and plan the next one (the
        scheduler's own step index when it has one)."""
        self._close_step()
        self.set_step(self.step + 1 if next_step is None else next_step)

    def _close_step(self) -> None:
        self.stats.close_step(self.step)
        if self.planner.guarding():
            self.planner.guard(self.step, self.stats.step_errors())

    def flush(self) -> None:
        """Keep the counters of the step in progress (before statistics are read)."""
        if self.running:
            self.stats.close_step(self.step)

    def _timestep_at(self, step: int) -> float | None:
        return self.timesteps[step] if 0 <= step < len(self.timesteps) else None

    # --- pipeline-driven ----------------------------------------------------------------------------------------
    def follow(self, pipe) -> None:
        """Follow ``pipe``'s calls (undone by :meth:`detach`): its class becomes a subclass of the same name
        whose ``__call__`` opens :meth:`pipeline_call` when this clock is the pipeline's."""
        original = type(pipe)
        if not callable(pipe) or not hasattr(pipe, "__dict__"):
            raise AttentionConfigError(
                f"enable_trtllm_attention takes a diffusers pipeline (called as pipe(...)) or a transformer; got a "
                f"{original.__name__}: pass pipe.transformer to install on the transformer alone")
        followed = _followed_class(original)
        pipe.__dict__[_CLOCK_ATTRIBUTE] = self
        pipe.__class__ = followed

        def undo():
            if pipe.__dict__.get(_CLOCK_ATTRIBUTE) is self:
                del pipe.__dict__[_CLOCK_ATTRIBUTE]
            if type(pipe) is followed:
                pipe.__class__ = original

        self._undo.append(undo)

    @contextlib.contextmanager
    def pipeline_call(self, pipe):
        """One pipeline call: a run on the scheduler ``pipe`` has now, reporting to this clock until it returns."""
        if self.in_pipeline_call:  # a pipeline calling itself: one run
            yield
            return
        scheduler = getattr(pipe, "scheduler", None)
        if self.gated and not (hasattr(scheduler, "set_timesteps") and hasattr(scheduler, "step")):
            raise AttentionConfigError(
                "skip_softmax.disabled_until_timestep, quant.disabled_below_timestep or quant."
                f"disabled_until_timestep needs the pipeline's timesteps, but pipe.scheduler is "
                f"{type(scheduler).__name__}, which has no set_timesteps/step; give the pipeline a diffusers "
                "scheduler or remove the gate")
        undo = [] if scheduler is None else self._report_from(scheduler)
        self.start_run()
        self.in_pipeline_call = True
        try:
            yield
        finally:
            self.in_pipeline_call = self.running = False
            while undo:
                undo.pop()()

    def _report_from(self, scheduler) -> list[Callable[[], None]]:
        num_train = num_train_timesteps(scheduler)
        after = {"set_timesteps": lambda: self.set_timesteps(scheduler.timesteps, num_train),
                 "set_begin_index": lambda: self.set_step(scheduler.begin_index or 0),
                 "step": lambda: self.end_step(_step_index(scheduler))}
        undo = []
        for name in _REPORTING:
            original = getattr(scheduler, name, None)
            if original is None:
                continue
            wrapper = _reporting(original, after[name])
            had_own = name in scheduler.__dict__
            setattr(scheduler, name, wrapper)
            undo.append(functools.partial(_unwrap, scheduler, name, wrapper, original if had_own else None))
        return undo

    def detach(self) -> None:
        while self._undo:
            self._undo.pop()()

    # --- transformer-driven (no pipeline call) ------------------------------------------------------------------
    def observe(self, raw) -> None:
        """A transformer call outside a pipeline call with raw timestep ``raw``: a new value is a new step, a
        rising one (or the first) a new run."""
        if self.in_pipeline_call or raw is None:
            return
        value = float(raw.detach().float().max()) if torch.is_tensor(raw) else float(raw)
        t = value / self.num_train_timesteps
        current = self.planner.timestep if self.running else None
        if current is None or t > current:
            self.start_run()
        elif t != current:
            self._close_step()
            self.step += 1
        self.planner.plan_step(t, self.step)

    def timestep_hook(self, module: torch.nn.Module, reader: TimestepReader) -> None:
        """A forward pre-hook on ``module`` that feeds its timestep argument to :meth:`observe`."""
        signature = inspect.signature(module.forward)

        def hook(mod, args, kwargs):
            if self.in_pipeline_call:
                return
            try:
                bound = signature.bind_partial(*args, **kwargs).arguments
            except TypeError:
                bound = kwargs
            self.observe(reader(bound))

        handle = module.register_forward_pre_hook(hook, with_kwargs=True)
        self._undo.append(handle.remove)


def num_train_timesteps(scheduler) -> int:
    """The scheduler's ``num_train_timesteps`` (what normalizes its timesteps to t), 1000 without one."""
    return getattr(getattr(scheduler, "config", None), "num_train_timesteps", None) or 1000


def _step_index(scheduler) -> int | None:
    index = getattr(scheduler, "step_index", None)
    return index if isinstance(index, int) else None


def _reporting(original, after: Callable[[], None]):
    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        result = original(*args, **kwargs)
        after()
        return result

    return wrapped


def _unwrap(scheduler, name: str, wrapper, own_original) -> None:
    # Only our own wrapper is removed; a wrapper set over it later is left to whoever set it.
    if scheduler.__dict__.get(name) is wrapper:
        if own_original is None:
            del scheduler.__dict__[name]
        else:
            scheduler.__dict__[name] = own_original


@functools.lru_cache(maxsize=None)  # one subclass per pipeline class the process uses
def _followed_class(cls: type) -> type:
    original_call = cls.__call__

    @functools.wraps(original_call)
    def __call__(self, *args, **kwargs):
        clock = self.__dict__.get(_CLOCK_ATTRIBUTE)
        if clock is None:
            return original_call(self, *args, **kwargs)
        with clock.pipeline_call(self):
            return original_call(self, *args, **kwargs)

    return type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})

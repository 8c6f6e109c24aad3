"""The denoising clock: which step a pipeline is at and its timestep, read from the pipeline's scheduler.

The clock wraps the scheduler's ``set_timesteps`` (a pipeline call starts: step 0, statistics of the last call
dropped) and ``step`` (a denoising step ends). It copies the scheduler's timesteps to the host once per pipeline
call and re-plans once per step, all outside the transformer: nothing is read on the per-call path, and the
transformer can be compiled whole. A transformer installed without a pipeline has no scheduler; then, only when
a timestep gate is configured, a forward pre-hook reads the transformer's timestep argument (one host read per
transformer call, which whole-model ``torch.compile`` cannot trace: compile per block in that form).
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch

from .plan import CallPlanner
from .stats import AttentionStats

TimestepReader = Callable[[dict], "torch.Tensor | float | None"]


class DenoisingClock:
    """Drives ``planner`` and ``stats`` from a scheduler (or, without one, from the transformer's argument)."""

    def __init__(self, planner: CallPlanner, stats: AttentionStats, num_train_timesteps: int):
        self.planner = planner
        self.stats = stats
        self.num_train_timesteps = num_train_timesteps
        self.step = 0
        self.timesteps: list[float] = []
        self._undo: list[Callable[[], None]] = []

    # --- scheduler-driven ---------------------------------------------------------------------------------------
    def attach(self, scheduler) -> None:
        """Wrap ``scheduler.set_timesteps`` and ``scheduler.step`` on this instance (undone by :meth:`detach`)."""
        for name, after in (("set_timesteps", lambda: self.start_run(scheduler.timesteps)),
                            ("step", self.end_step)):
            original = getattr(scheduler, name)

            @functools.wraps(original)
            def wrapped(*args, _original=original, _after=after, **kwargs):
                result = _original(*args, **kwargs)
                _after()
                return result

            setattr(scheduler, name, wrapped)
            self._undo.append(functools.partial(_restore_attribute, scheduler, name, original))

    def start_run(self, timesteps: torch.Tensor) -> None:
        """A pipeline call starts: step 0 at the first of ``timesteps`` (one host copy per call)."""
        self.stats.clear()
        self.timesteps = [t / self.num_train_timesteps for t in torch.as_tensor(timesteps).float().tolist()]
        self.step = 0
        self.planner.plan_step(self.timesteps[0] if self.timesteps else None)

    def end_step(self) -> None:
        """A denoising step ended: keep its statistics and plan the next one."""
        self.stats.close_step(self.step, self.planner.calls.values())
        self.step += 1
        self.planner.plan_step(self.timesteps[self.step] if self.step < len(self.timesteps) else None)

    def flush(self) -> None:
        """Keep the counters of the step in progress (before statistics are read)."""
        self.stats.close_step(self.step, self.planner.calls.values())

    def detach(self) -> None:
        while self._undo:
            self._undo.pop()()

    # --- transformer-driven (no scheduler) ------------------------------------------------------------------------
    def observe(self, raw) -> None:
        """A transformer call with raw timestep ``raw`` starts; a new value starts a new step."""
        if raw is None:
            return
        value = float(raw.detach().float().max()) if torch.is_tensor(raw) else float(raw)
        t = value / self.num_train_timesteps
        if t != self.planner.timestep:
            if self.planner.timestep is not None:
                self.end_step()
            self.planner.plan_step(t)

    def timestep_hook(self, module: torch.nn.Module, reader: TimestepReader):
        """A forward pre-hook on ``module`` that feeds its timestep argument to :meth:`observe`."""
        signature = inspect.signature(module.forward)

        def hook(mod, args, kwargs):
            try:
                bound = signature.bind_partial(*args, **kwargs).arguments
            except TypeError:
                bound = kwargs
            self.observe(reader(bound))

        handle = module.register_forward_pre_hook(hook, with_kwargs=True)
        self._undo.append(handle.remove)


def _restore_attribute(obj, name: str, original) -> None:
    # The wrapper was set on the instance; dropping it uncovers the class's method again.
    if getattr(obj, name, None) is not original:
        try:
            delattr(obj, name)
        except AttributeError:
            setattr(obj, name, original)

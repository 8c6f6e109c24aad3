"""Per-pipeline runtime state: the config, calibrations, the current timestep, layer names and statistics.

One :class:`AttentionSession` per pipeline, so two pipelines in one process never share timestep state. The
timestep is read on every transformer call by a forward pre-hook (diffusers never passes it to processors).
"""

from __future__ import annotations

import inspect
import logging
import warnings
from typing import Callable, Mapping

import torch

from .calibration.curve import SkipCalibration
from .config import AttentionConfig
from .stats import AttentionStats

logger = logging.getLogger("diffusers_trtllm")

TimestepReader = Callable[[dict], "torch.Tensor | float | None"]


def read_timestep_kwarg(name: str = "timestep") -> TimestepReader:
    """A reader that takes the transformer's ``name`` argument (bound by name or position)."""
    return lambda bound: bound.get(name)


class AttentionSession:
    """Runtime state shared by all processors installed on one pipeline.

    ``timestep`` is the normalized t in [0, 1] (1 = pure noise) of the current transformer call: the maximum of
    the raw timestep over the batch divided by ``num_train_timesteps``. ``step`` counts distinct timesteps seen,
    so the two CFG calls of one denoising step (and the two experts of Wan 2.2 A14B) share a step index.
    """

    def __init__(self, config: AttentionConfig | Mapping | str | None = None,
                 calibrations: Mapping[str, SkipCalibration] | None = None, *, num_train_timesteps: int = 1000,
                 collect_stats: bool = True):
        self.config = AttentionConfig.coerce(config)
        self.calibrations = dict(calibrations or {})
        self.num_train_timesteps = num_train_timesteps
        self.collect_stats = collect_stats
        self.stats = AttentionStats()
        self.timestep: float | None = None
        self.step = -1
        self._layer_names: dict[int, tuple[str, str]] = {}
        self._warned: set[str] = set()
        # (component, layer, role, category) -> (per_role key, spec), resolved for all sites at install time
        self.resolved: dict = {}
        # Calibration (diffusers_trtllm.calibrate) sets this: every call that would skip is handed to
        # it as (site, qkv, scale=, causal=, tile=) to count skips for many λ, and then runs dense.
        self.skip_probe: Callable | None = None

    # --- timestep -------------------------------------------------------------------------------------------
    def set_timestep(self, raw) -> None:
        """Record the raw scheduler timestep of the call about to run (tensor of any shape, or a number)."""
        if raw is None:
            return
        value = float(raw.detach().float().max()) if torch.is_tensor(raw) else float(raw)
        t = value / self.num_train_timesteps
        if t != self.timestep:
            self.step += 1
            self.timestep = t

    def reset(self) -> None:
        """Forget the timestep and step count (a new generation starts); statistics are kept."""
        self.timestep = None
        self.step = -1

    def timestep_hook(self, module: torch.nn.Module, reader: TimestepReader):
        """Register a forward pre-hook on ``module`` that feeds its timestep argument to this session."""
        signature = inspect.signature(module.forward)

        def hook(mod, args, kwargs):
            try:
                bound = signature.bind_partial(*args, **kwargs).arguments
            except TypeError:
                bound = kwargs
            self.set_timestep(reader(bound))

        return module.register_forward_pre_hook(hook, with_kwargs=True)

    # --- layer names ----------------------------------------------------------------------------------------
    def register_layers(self, component: str, transformer: torch.nn.Module) -> None:
        """Learn the qualified names of ``transformer``'s attention modules (for globs and per-layer stats)."""
        for name, module in transformer.named_modules():
            self._layer_names[id(module)] = (component, name)

    def layer_of(self, attn: torch.nn.Module, default_component: str) -> tuple[str, str]:
        """``(component, layer name)`` of an attention module; unregistered modules get ``#n`` in call order."""
        key = id(attn)
        if key not in self._layer_names:
            self._layer_names[key] = (default_component, f"{type(attn).__name__}#{len(self._layer_names)}")
        return self._layer_names[key]

    # --- logging --------------------------------------------------------------------------------------------
    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=3)

    def info_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.info(message)

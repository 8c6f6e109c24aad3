"""A run's state and where the attention op finds it: the bottom of the run machinery, importing nothing of the
package.

A *run* is one pipeline call (or one transformer-driven run without a pipeline): its timesteps and step, every
call site's settings for that step, its counters and the accuracy probe's sums. Runs live in a
:class:`contextvars.ContextVar`, keyed by the :class:`RunKey` of the handle that planned them, so a run belongs to
the thread or asyncio task whose pipeline call opened it: shallow copies of a pipeline, ``from_pipe`` twins that
share a transformer and pipelines in several threads each run their own. The attention op reads the run inside
its body (opaque to ``torch.compile``), never in traced code.
"""

from __future__ import annotations

import contextvars
import itertools
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

#: indices into a site's settings row
SKIP, SAGE, PROBE = 0, 1, 2
SETTINGS = 3
#: a call's own settings (what runs outside a run) also carry its handle's run key and its site index, so every
#: call site reaches the op through tensor values, never through a Python constant the compiler specializes on
OWNER, SITE = 3, 4
#: columns of a site's device counters: skipped KV tiles, tiles
TILES = 2

_KEYS = itertools.count(1)


class RunKey:
    """Identifies one handle's runs. A copy (``copy.deepcopy``, pickle) of an installed transformer gets a key of
    its own, so a copy never reads the original's runs."""

    __slots__ = ("value",)

    def __init__(self):
        self.value = next(_KEYS)

    def __reduce__(self):
        return RunKey, ()

    def __repr__(self) -> str:
        return f"RunKey({self.value})"


def initial_settings(skip_value: float = 0.0) -> torch.Tensor:
    """A call's own settings: skip value, SAGE on (as the op's ``quant`` argument says), not probed, no run."""
    settings = torch.zeros(SITE + 1, dtype=torch.float64)
    settings[SKIP], settings[SAGE] = skip_value, 1.0
    return settings


@dataclass(eq=False)
class Run:
    """One run's state, indexed by call site (the planner's order).

    ``settings``: float64 CPU ``[sites, 3]``, planned once per step (skip value, SAGE switch, probe rows).
    ``tiles`` / ``error_sums``: on the attention device, added to by the op when ``counting`` (skipped and all KV
    tiles; the probe's ``[Σ error², Σ exact²]``); ``call_counts``: on the host, per site ``[calls, calls whose
    backend counted tiles]`` since the counters were last kept.
    ``probing``: per site, this step's calls that would skip go to ``calls[i].probe`` and run dense (calibration).
    ``guard_dropped``: per site, what the accuracy guard took away for the rest of the run.
    ``data``: what the run's owner keeps beside (statistics, the step's channel).
    """

    key: int
    calls: tuple
    settings: torch.Tensor
    tiles: torch.Tensor
    error_sums: torch.Tensor
    counting: bool
    call_counts: list = field(default_factory=list)
    probing: list = field(default_factory=list)
    guard_dropped: list = field(default_factory=list)
    step_probed: list = field(default_factory=list)
    step: int | None = None
    timestep: float | None = None
    is_open: bool = True
    data: dict = field(default_factory=dict)

    @classmethod
    def start(cls, key: int, calls, device: torch.device, counting: bool) -> "Run":
        sites = len(calls)
        # ordinary tensors even when the run starts inside torch.inference_mode (vLLM-Omni calls pipelines there):
        # the statistics update them in place outside it too
        with torch.inference_mode(False):
            settings = initial_settings()[:SETTINGS].repeat(sites, 1)
            tiles = torch.zeros(sites, TILES, dtype=torch.int64, device=device)
            error_sums = torch.zeros(sites, 2, dtype=torch.float64, device=device)
        return cls(key, tuple(calls), settings, tiles, error_sums, counting, [[0, 0] for _ in range(sites)],
                   probing=[False] * sites, guard_dropped=[set() for _ in range(sites)], step_probed=[False] * sites)

    def count_call(self, site: int, skipped=None, total=None) -> None:
        """One call of ``site``; ``skipped`` / ``total`` (device or host numbers) where its backend counted tiles.
        In place, no copy between host and device."""
        calls = self.call_counts[site]
        calls[0] += 1
        if skipped is not None:
            row = self.tiles[site]
            row[0] += skipped
            row[1] += total
            calls[1] += 1

    @property
    def called(self) -> bool:
        """Some site was called since the counters were last kept."""
        return any(calls for calls, _ in self.call_counts)

    def counts_of(self, site: int) -> list[int]:
        """``[skipped tiles, tiles, calls, calls that counted tiles]`` of ``site`` so far (a host read)."""
        return self.tiles[site].tolist() + self.call_counts[site]


#: per context: handle key -> its run there (open, or the last one that ended there)
_RUNS: contextvars.ContextVar[Mapping[int, Run]] = contextvars.ContextVar("diffusers_trtllm_runs", default={})


def run_here(key: int) -> Run | None:
    """The run of handle ``key`` in this thread or task: open, or the last that ended here; None if none."""
    return _RUNS.get().get(key)


def open_run(key: int) -> Run | None:
    """The open run of handle ``key`` in this thread or task, or None (what the attention op runs under)."""
    run = _RUNS.get().get(key)
    return run if run is not None and run.is_open else None


def set_run_here(key: int, run: Run | None) -> None:
    """Make ``run`` handle ``key``'s run in this thread or task (None forgets it). The mapping is replaced, never
    changed in place: a task that copied this context keeps what it had."""
    runs: dict[int, Any] = dict(_RUNS.get())
    if run is None:
        runs.pop(key, None)
    else:
        runs[key] = run
    _RUNS.set(runs)

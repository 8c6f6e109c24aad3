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
SKIP, SAGE, PROBE, REUSE = 0, 1, 2, 3
SETTINGS = 4
#: a call's own settings (what runs outside a run) also carry its handle's run key and its site index, so every
#: call site reaches the op through tensor values, never through a Python constant the compiler specializes on
OWNER, SITE = 4, 5
#: ``[REUSE]`` values: no tile map; test every tile and keep the map; skip the map's tiles untested
REUSE_OFF, REUSE_FRESH, REUSE_KEEP = 0.0, 1.0, 2.0
#: columns of a site's device counters: KV tiles skipped by the test, tiles, tiles skipped by reuse
TILES = 3
#: tile maps a site keeps per step (a classifier-free-guidance pass is one): a call past them tests every tile
MAX_BRANCHES = 4

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

    ``settings``: float64 CPU ``[sites, 4]``, planned once per step (skip value, SAGE switch, probe rows, reuse).
    ``tiles`` / ``error_sums``: on the attention device, added to by the op when ``counting`` (KV tiles skipped by
    the test, all, skipped by reuse; the probe's ``[Σ error², Σ exact²]``); ``call_counts``: on the host, per
    site ``[calls, calls whose backend counted tiles]`` since the counters were last kept.
    ``tile_maps``: Skip-Softmax reuse, per ``(site, branch)`` (the site's n-th call in a step is branch n): the
    lengths of the call that made it and its map; ``step_calls``: per site, calls in this step;
    ``reuse_state``: per site, ``(its [REUSE] this step, the SAGE switch its maps were made with, steps they were
    reused since; None: no maps)``.
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
    tile_maps: dict = field(default_factory=dict)
    step_calls: list = field(default_factory=list)
    reuse_state: list = field(default_factory=list)
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
                   probing=[False] * sites, guard_dropped=[set() for _ in range(sites)], step_probed=[False] * sites,
                   step_calls=[0] * sites, reuse_state=[(REUSE_OFF, 0.0, None)] * sites)

    def count_call(self, site: int, skipped=None, total=None, reused=None) -> None:
        """One call of ``site``; ``skipped`` / ``total`` / ``reused`` (device or host numbers) where its backend
        counted tiles. In place, no copy between host and device."""
        calls = self.call_counts[site]
        calls[0] += 1
        if skipped is not None:
            row = self.tiles[site]
            row[0] += skipped
            row[1] += total
            if reused is not None:
                row[2] += reused
            calls[1] += 1

    def tile_map(self, site: int, lengths: tuple) -> tuple[int, torch.Tensor | None]:
        """This call's branch of ``site`` (counted per step) and its tile map when one was made by a call of the
        same ``lengths`` (else None: every tile is tested). Branches past :data:`MAX_BRANCHES` get -1."""
        branch = self.step_calls[site]
        self.step_calls[site] += 1
        if branch >= MAX_BRANCHES:
            return -1, None
        kept = self.tile_maps.get((site, branch))
        return branch, kept[1] if kept is not None and kept[0] == lengths else None

    def keep_tile_map(self, site: int, branch: int, lengths: tuple, tile_map: torch.Tensor | None) -> None:
        if branch >= 0 and tile_map is not None:
            self.tile_maps[(site, branch)] = (lengths, tile_map)

    def drop_tile_maps(self, site: int | None = None) -> None:
        """Free ``site``'s tile maps (every site's when None)."""
        for key in [key for key in self.tile_maps if site is None or key[0] == site]:
            del self.tile_maps[key]

    def tile_map_bytes(self, site: int) -> int:
        """Memory held by ``site``'s tile maps."""
        return sum(m.numel() * m.element_size() for (s, _), (_, m) in self.tile_maps.items() if s == site)

    def close(self) -> None:
        """The run ended: its tile maps are freed (what is read afterwards is its statistics)."""
        self.is_open = False
        self.drop_tile_maps()

    @property
    def called(self) -> bool:
        """Some site was called since the counters were last kept."""
        return any(calls for calls, _ in self.call_counts)

    def counts_of(self, site: int) -> list[int]:
        """``[tiles skipped by the test, tiles, calls, calls that counted tiles]`` of ``site`` so far (a host read;
        tiles skipped by reuse are ``tiles[site, 2]``)."""
        return self.tiles[site, :2].tolist() + self.call_counts[site]


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

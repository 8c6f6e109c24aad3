"""What ran: per denoising step and attention layer, the backend, the mode, the achieved sparsity and, where the
accuracy probe is on, the relative error of what ran against exact attention on the probed rows.

Nothing is recorded on the per-call path: the attention op adds its tile counts (and the probe's error sums) to
its run's per-site counters on the device, and at each step boundary (outside any traced region)
:meth:`AttentionStats.close_step` keeps the step's counters as device copies and zeroes them. They reach the host
in one copy per kind when a summary is asked for (and the guard reads a probed step's errors once). Statistics
belong to one run (a pipeline call): each run has its own, so memory stays flat over many calls.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
import math

import torch


@dataclass
class CallRecord:
    """Every call of one layer in one step (CFG halves and batch items add up)."""

    backend: str
    mode: str
    calls: int = 0
    skipped: int = 0
    total: int = 0
    #: tiles skipped because the step before skipped them (Skip-Softmax reuse), apart from ``skipped`` (the test's)
    reused: int = 0
    counted: bool = True
    probed: bool = False
    error_sq: float = 0.0
    exact_sq: float = 0.0

    @property
    def skips(self) -> bool:
        """The calls ran Skip-Softmax (their mode says so)."""
        return "skip" in self.mode.split("+")

    @property
    def sparsity(self) -> float | None:
        """Skipped KV tiles (by the test or by reuse) / all tiles, or None when the backend did not count."""
        if not self.counted:
            return None
        return (self.skipped + self.reused) / self.total if self.total else 0.0

    @property
    def error(self) -> float | None:
        """The accuracy probe's relative error ``sqrt(Σ error² / Σ exact²)`` on its rows, or None when the
        probe did not run."""
        return relative_error(self.error_sq, self.exact_sq) if self.probed else None


def relative_error(error_sq: float, exact_sq: float) -> float:
    """``sqrt(error_sq / exact_sq)`` (0 for an exact zero output, infinite for any error on it)."""
    if not exact_sq:
        return 0.0 if not error_sq else math.inf
    return math.sqrt(error_sq / exact_sq)


class AttentionStats:
    """Records keyed by ``(step, "component.layer", backend, mode)``: a layer whose attention calls run
    differently (Cosmos 3's dense causal stream beside its skipping generation stream) keeps one record per way.

    ``run``: the :class:`~diffusers_trtllm.run_state.Run` whose counters these statistics keep (none: empty
    statistics); the accuracy probe's error sums are kept for its sites with an ``accuracy`` spec.
    """

    def __init__(self, run=None):
        self._run = run if run is not None and run.counting else None
        calls = self._run.calls if self._run is not None else ()
        self._probed = [i for i, call in enumerate(calls) if call.accuracy is not None]
        # (step, modes, tiles [sites, 3], host call counts [sites][2], probed flags, error sums [probed, 2] or None)
        self._steps: list[tuple] = []
        self._records: dict = {}

    def close_step(self, step: int) -> None:
        """Keep the run's counters as step ``step`` (device copies, no host sync) and zero them; nothing when no
        call counted since the last close."""
        run = self._run
        if run is None or not run.called:
            return
        modes = tuple(call.mode_of(row) for call, row in zip(run.calls, run.settings.tolist()))
        sums = run.error_sums[self._probed].clone() if self._probed else None
        probed = tuple(run.step_probed[i] for i in self._probed)
        calls = [list(pair) for pair in run.call_counts]
        self._steps.append((step, modes, run.tiles.clone(), calls, probed, sums))
        run.tiles.zero_()
        run.error_sums.zero_()
        for pair in run.call_counts:
            pair[:] = (0, 0)

    def step_errors(self, step: int) -> dict[int, tuple[float, float]]:
        """Step ``step``'s ``(Σ error², Σ exact²)`` per probed site index, if it was the last closed (one host
        copy): what the guard reads at the end of a probed step."""
        if not self._steps or self._steps[-1][0] != step or self._steps[-1][5] is None:
            return {}
        return dict(zip(self._probed, map(tuple, self._steps[-1][5].cpu().tolist())))

    @property
    def records(self) -> dict:
        """``{(step, layer, backend, mode): CallRecord}`` for every site that ran (one host copy per kind of
        counter of the steps closed since the last read)."""
        if not self._steps:
            return self._records
        records, calls = self._records, self._run.calls
        values = torch.stack([tiles for _, _, tiles, *_ in self._steps]).cpu().tolist()
        errors = (torch.stack([sums for *_, sums in self._steps]).cpu().tolist() if self._probed else
                  [[] for _ in self._steps])
        for (step, modes, _, host, probed, _), rows, sums in zip(self._steps, values, errors):
            probe = {index: (flag, pair) for index, flag, pair in zip(self._probed, probed, sums)}
            for index, (call, mode, (skipped, total, reused), (n_calls, counted)) in enumerate(
                    zip(calls, modes, rows, host)):
                if not n_calls:
                    continue
                key = (step, call.site.qualified_layer, call.backend, mode)
                rec = records.setdefault(key, CallRecord(call.backend, mode))
                rec.calls += n_calls
                rec.skipped += skipped
                rec.total += total
                rec.reused += reused
                rec.counted = rec.counted and counted == n_calls
                flag, (error_sq, exact_sq) = probe.get(index, (False, (0.0, 0.0)))
                if flag:
                    rec.probed = True
                    rec.error_sq += error_sq
                    rec.exact_sq += exact_sq
        self._steps.clear()
        return records

    def _sparsity_by(self, index: int, reused_only: bool = False) -> dict:
        """Skipped (``reused_only``: by reuse) / all KV tiles per group, over the calls that ran Skip-Softmax;
        None for a group where none did (the gate kept it dense, or it does not skip) or none was counted."""
        skipped, total, counted = defaultdict(int), defaultdict(int), set()
        records = self.records
        for key, rec in records.items():
            if rec.skips and rec.counted:
                group = key[index]
                skipped[group] += rec.reused + (0 if reused_only else rec.skipped)
                total[group] += rec.total
                counted.add(group)
        groups = sorted({key[index] for key in records})  # steps in number order, layers by name
        return {g: (skipped[g] / total[g] if total[g] else 0.0) if g in counted else None for g in groups}

    def per_step(self) -> dict[int, float | None]:
        """Achieved sparsity per denoising step over the layers that ran Skip-Softmax in it (None: none did, or
        none was counted)."""
        return self._sparsity_by(0)

    def per_layer(self) -> dict[str, float | None]:
        """Achieved sparsity per layer over the steps it ran Skip-Softmax in (None: it never did, or was never
        counted)."""
        return self._sparsity_by(1)

    def reused_per_step(self) -> dict[int, float | None]:
        """The share of KV tiles skipped by reuse (part of :meth:`per_step`'s sparsity) per step."""
        return self._sparsity_by(0, reused_only=True)

    def tile_map_bytes(self) -> dict[str, int]:
        """Memory the run's Skip-Softmax tile maps hold now, per layer that keeps some (freed when the run
        ends, so empty afterwards)."""
        run = self._run
        if run is None:
            return {}
        held = {call.site.qualified_layer: run.tile_map_bytes(i) for i, call in enumerate(run.calls)}
        return {layer: size for layer, size in held.items() if size}

    def skipping(self, index: int = 0) -> set:
        """The steps (``index`` 1: layers) where some call ran Skip-Softmax."""
        return {key[index] for key, rec in self.records.items() if rec.skips}

    def _error_by(self, group) -> dict:
        """The probe's relative error pooled by ``group(record key)`` over the probed records."""
        sums: dict = {}
        for key, rec in self.records.items():
            if rec.probed:
                pair = sums.setdefault(group(key), [0.0, 0.0])
                pair[0] += rec.error_sq
                pair[1] += rec.exact_sq
        return {g: relative_error(*sums[g]) for g in sorted(sums)}

    def error_per_step(self) -> dict[int, float]:
        """The accuracy probe's relative error per probed step over all probed layers."""
        return self._error_by(lambda key: key[0])

    def error_per_layer(self) -> dict[str, float]:
        """The accuracy probe's relative error per probed layer over its probed steps."""
        return self._error_by(lambda key: key[1])

    def errors(self) -> dict[tuple[int, str], float]:
        """The accuracy probe's relative error per probed ``(step, layer)``."""
        return self._error_by(lambda key: key[:2])

    def modes(self) -> dict[int, dict[str, int]]:
        """Per step, how many layers ran each ``backend:mode``."""
        out: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for (step, *_), rec in self.records.items():
            out[step][f"{rec.backend}:{rec.mode}"] += 1
        return {s: dict(m) for s, m in sorted(out.items())}

    def summary(self) -> dict:
        """One-call summary: sparsity over the calls that ran Skip-Softmax (overall, per step, per layer; None
        where none did; ``reused``: the share of tiles skipped by reuse, part of ``sparsity``), and the modes that
        ran; where the accuracy probe ran, its relative error overall
        (``error``, None when it did not), per step and per layer."""
        counted = [r for r in self.records.values() if r.skips and r.counted]
        reused, total = sum(r.reused for r in counted), sum(r.total for r in counted)
        skipped = sum(r.skipped for r in counted) + reused
        probed = [r for r in self.records.values() if r.probed]
        error = relative_error(sum(r.error_sq for r in probed), sum(r.exact_sq for r in probed)) if probed else None
        return {"sparsity": skipped / total if total else None, "reused": reused / total if total else None,
                "per_step": self.per_step(),
                "per_layer": self.per_layer(), "modes": self.modes(), "error": error,
                "error_per_step": self.error_per_step(), "error_per_layer": self.error_per_layer()}

    def table(self) -> str:
        """Markdown table: one row per step with its modes, achieved sparsity over the layers that skipped
        ("off": no layer ran Skip-Softmax in the step, e.g. the timestep gate kept it dense; "n/a": the backend
        does not count; "(… reused)": the share skipped by reuse) and, where the accuracy probe ran, its relative error over all probed layers and the
        worst layer's ("-": the step was not probed)."""
        errors, error_per_step = self.errors(), self.error_per_step()
        worst: dict = {}
        for (step, layer), error in errors.items():
            if step not in worst or error > worst[step][1]:
                worst[step] = (layer, error)
        lines = ["| step | modes | sparsity | probed error | worst layer (error) |", "|---:|---|---:|---:|---|"]
        per_step, skipping, reused = self.per_step(), self.skipping(), self.reused_per_step()
        for step, modes in self.modes().items():
            sp = per_step.get(step)
            text = ", ".join(f"{n}× {m}" for m, n in sorted(modes.items()))
            probe = (f"{error_per_step[step]:.2e} | {worst[step][0]} ({worst[step][1]:.2e})" if step in worst
                     else "- | -")
            shown = "off" if step not in skipping else "n/a" if sp is None else f"{sp:.3f}"
            if reused.get(step):
                shown += f" ({reused[step]:.3f} reused)"
            lines.append(f"| {step} | {text} | {shown} | {probe} |")
        return "\n".join(lines)

    def error_table(self) -> str:
        """Markdown table of the accuracy probe per layer: what ran, its relative error over the probed steps,
        the worst probed step's, and its sparsity ("" when the probe did not run)."""
        errors, per_layer, sparsity = self.errors(), self.error_per_layer(), self.per_layer()
        skipping = self.skipping(1)
        if not per_layer:
            return ""
        modes: dict = defaultdict(set)
        for (_, layer, backend, mode), rec in self.records.items():
            if rec.probed:
                modes[layer].add(f"{backend}:{mode}")
        lines = ["| layer | ran (probed steps) | probed error | worst step (error) | sparsity |",
                 "|---|---|---:|---:|---:|"]
        for layer, error in per_layer.items():
            step, worst = max(((s, e) for (s, name), e in errors.items() if name == layer), key=lambda x: x[1])
            sp = sparsity.get(layer)
            lines.append(f"| {layer} | {', '.join(sorted(modes[layer]))} | {error:.2e} | {step} ({worst:.2e}) | "
                         f"{'off' if layer not in skipping else 'n/a' if sp is None else f'{sp:.3f}'} |")
        return "\n".join(lines)

"""What ran: per denoising step and attention layer, the backend, the mode and the achieved sparsity.

Nothing is recorded on the per-call path: the attention op adds its tile counts to a per-site counter on the
device, and at each step boundary (outside any traced region) :meth:`AttentionStats.close_step` keeps the step's
counters as one stacked device tensor and zeroes them. They reach the host in one copy when a summary is asked
for. Statistics hold one run (a pipeline call): a new run zeroes the counters and drops the last run's records, so
memory stays flat over many calls.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

import torch


@dataclass
class CallRecord:
    """Every call of one layer in one step (CFG halves and batch items add up)."""

    backend: str
    mode: str
    calls: int = 0
    skipped: int = 0
    total: int = 0
    counted: bool = True

    @property
    def sparsity(self) -> float | None:
        """Skipped KV tiles / all tiles, or None when the backend did not count."""
        if not self.counted:
            return None
        return self.skipped / self.total if self.total else 0.0


class AttentionStats:
    """Records keyed by ``(step, "component.layer", backend, mode)``: a layer whose attention calls run
    differently (Cosmos 3's dense causal stream beside its skipping generation stream) keeps one record per way.

    ``calls``: the planned calls whose counters these statistics keep (those with ``counting`` set).
    """

    def __init__(self, calls: Iterable = ()):
        self._calls = [call for call in calls if call.counting]
        self._steps: list[tuple[int, tuple[str, ...], torch.Tensor]] = []
        self._records: dict = {}

    def start_run(self) -> None:
        """A run starts: the last run's records are dropped and every counter is zeroed."""
        self._steps.clear()
        self._records.clear()
        if self._calls:
            torch._foreach_zero_([call.counts for call in self._calls])

    def close_step(self, step: int) -> None:
        """Keep the counters as step ``step`` (one stacked device copy, no host sync) and zero them."""
        if not self._calls:
            return
        counts = [call.counts for call in self._calls]
        modes = tuple(call.mode(bool(call.skip_value)) for call in self._calls)
        self._steps.append((step, modes, torch.stack(counts)))
        torch._foreach_zero_(counts)

    @property
    def records(self) -> dict:
        """``{(step, layer, backend, mode): CallRecord}`` for every site that ran (one host copy of the steps
        closed since the last read)."""
        if self._steps:
            values = torch.stack([counts for *_, counts in self._steps]).cpu().tolist()
            for (step, modes, _), rows in zip(self._steps, values):
                for call, mode, (skipped, total, calls, counted) in zip(self._calls, modes, rows):
                    if not calls:
                        continue
                    key = (step, call.site.qualified_layer, call.backend, mode)
                    rec = self._records.setdefault(key, CallRecord(call.backend, mode))
                    rec.calls += calls
                    rec.skipped += skipped
                    rec.total += total
                    rec.counted = rec.counted and counted == calls
            self._steps.clear()
        return self._records

    def _sparsity_by(self, index: int) -> dict:
        skipped, total, uncounted = defaultdict(int), defaultdict(int), set()
        records = self.records
        for key, rec in records.items():
            group = key[index]
            if rec.counted:
                skipped[group] += rec.skipped
                total[group] += rec.total
            else:
                uncounted.add(group)
        groups = sorted({key[index] for key in records}, key=str)
        return {g: (None if g in uncounted and not total[g] else
                    (skipped[g] / total[g] if total[g] else 0.0)) for g in groups}

    def per_step(self) -> dict[int, float | None]:
        """Achieved sparsity per denoising step over all layers (None when nothing was counted)."""
        return self._sparsity_by(0)

    def per_layer(self) -> dict[str, float | None]:
        """Achieved sparsity per layer over all steps."""
        return self._sparsity_by(1)

    def modes(self) -> dict[int, dict[str, int]]:
        """Per step, how many layers ran each ``backend:mode``."""
        out: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for (step, *_), rec in self.records.items():
            out[step][f"{rec.backend}:{rec.mode}"] += 1
        return {s: dict(m) for s, m in sorted(out.items())}

    def summary(self) -> dict:
        """One-call summary: overall sparsity, per step, per layer, and the modes that ran."""
        counted = [r for r in self.records.values() if r.counted]
        skipped, total = sum(r.skipped for r in counted), sum(r.total for r in counted)
        return {"sparsity": skipped / total if total else None, "per_step": self.per_step(),
                "per_layer": self.per_layer(), "modes": self.modes()}

    def table(self) -> str:
        """Markdown table: one row per step with its modes and achieved sparsity."""
        lines = ["| step | modes | sparsity |", "|---:|---|---:|"]
        per_step = self.per_step()
        for step, modes in self.modes().items():
            sp = per_step.get(step)
            text = ", ".join(f"{n}× {m}" for m, n in sorted(modes.items()))
            lines.append(f"| {step} | {text} | {'n/a' if sp is None else f'{sp:.3f}'} |")
        return "\n".join(lines)

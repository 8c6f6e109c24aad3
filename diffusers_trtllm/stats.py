"""What ran: per denoising step and attention layer, the backend, the mode and the achieved sparsity.

Nothing is recorded on the per-call path: the attention op adds its tile counts to a per-site counter on the
device, and at each step boundary (outside any traced region) :meth:`AttentionStats.close_step` keeps a copy of
every counter and zeroes it. Values are read from the device only when a summary is asked for. Statistics hold
the current (or last) pipeline call only: a new call clears them, so memory stays flat over many calls.
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
    differently (Cosmos 3's dense causal stream beside its skipping generation stream) keeps one record per way."""

    def __init__(self):
        self._pending: list[tuple[int, str, str, str, torch.Tensor]] = []
        self._records: dict = {}

    def close_step(self, step: int, calls: Iterable) -> None:
        """Keep a copy of each call site's device counters as step ``step`` and zero them (no host sync)."""
        for call in calls:
            if not call.counting:
                continue
            mode = call.mode(bool(call.skip_value))
            self._pending.append((step, call.site.qualified_layer, call.backend, mode, call.counts.clone()))
            call.counts.zero_()

    def clear(self) -> None:
        self._pending.clear()
        self._records.clear()

    @property
    def records(self) -> dict:
        """``{(step, layer, backend, mode): CallRecord}`` for every site that ran (reads the device counters)."""
        if self._pending:
            values = torch.stack([p[4].cpu() for p in self._pending]).tolist()
            for (step, layer, backend, mode, _), (skipped, total, calls, counted) in zip(self._pending, values):
                if not calls:
                    continue
                rec = self._records.setdefault((step, layer, backend, mode), CallRecord(backend, mode))
                rec.calls += calls
                rec.skipped += skipped
                rec.total += total
                rec.counted = rec.counted and counted == calls
            self._pending.clear()
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

"""What ran: per denoising step and attention layer, the backend, the mode and the achieved sparsity."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch


@dataclass
class CallRecord:
    """Accumulated over every call of one layer in one step (CFG halves and batch items add up)."""

    backend: str
    mode: str
    calls: int = 0
    skipped: int | torch.Tensor = 0
    total: int | torch.Tensor = 0
    counted: bool = True

    def add(self, skipped, total) -> None:
        self.calls += 1
        if skipped is None or total is None:
            self.counted = False
        elif self.counted:
            self.skipped = self.skipped + skipped
            self.total = self.total + total

    @property
    def sparsity(self) -> float | None:
        """Skipped KV tiles / all tiles, or None when the backend did not count."""
        if not self.counted:
            return None
        total = int(self.total)
        return int(self.skipped) / total if total else 0.0


@dataclass
class AttentionStats:
    """Records keyed by ``(step, "component.layer", backend, mode)``: a layer whose attention calls run
    differently (Cosmos 3's dense causal stream beside its skipping generation stream) keeps one record per way.
    Device counters are summed lazily, so recording never waits for the GPU."""

    records: dict = field(default_factory=dict)

    def record(self, step: int, layer: str, backend: str, mode: str, skipped, total) -> None:
        key = (step, layer, backend, mode)
        if key not in self.records:
            self.records[key] = CallRecord(backend, mode)
        self.records[key].add(skipped, total)

    def clear(self) -> None:
        self.records.clear()

    def _sparsity_by(self, index: int) -> dict:
        skipped, total, uncounted = defaultdict(int), defaultdict(int), set()
        for key, rec in self.records.items():
            group = key[index]
            if rec.counted:
                skipped[group] += int(rec.skipped)
                total[group] += int(rec.total)
            else:
                uncounted.add(group)
        groups = sorted({key[index] for key in self.records}, key=str)
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
        skipped = sum(int(r.skipped) for r in self.records.values() if r.counted)
        total = sum(int(r.total) for r in self.records.values() if r.counted)
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

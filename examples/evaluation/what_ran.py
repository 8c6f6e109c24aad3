"""What ran: a run's attention stats as per-(step, layer) sparsity (:func:`sparsity_grid`) and as a Markdown
summary of the modes per step and layer (:func:`describe_attention_plan`)."""

from __future__ import annotations

import re
from typing import Sequence

from .reports import format_number


def _layer_step_records(stats) -> dict[tuple[int, str], list]:
    """``(step, layer) -> [CallRecord, ...]`` (a layer may run more than one way in a step)."""
    grouped: dict[tuple[int, str], list] = {}
    for key, rec in stats.records.items():
        grouped.setdefault((key[0], key[1]), []).append(rec)
    return grouped


def sparsity_grid(stats) -> dict[tuple[int, str], float | None]:
    """Achieved sparsity per ``(step, layer)``; None where Skip-Softmax did not run (dense layers, steps the gate
    kept dense) or the backend did not count."""
    grid = {}
    for key, recs in _layer_step_records(stats).items():
        if any(not r.counted or "skip" not in r.mode for r in recs):
            grid[key] = None
            continue
        total = sum(int(r.total) for r in recs)
        grid[key] = sum(int(r.skipped) for r in recs) / total if total else 0.0
    return grid


def compress_layer_names(names: Sequence[str]) -> list[str]:
    """``transformer.blocks.0.attn1 … transformer.blocks.39.attn1`` -> ``transformer.blocks.[0-39].attn1``."""
    groups: dict[str, list[int]] = {}
    plain = []
    for name in names:
        match = re.search(r"\.(\d+)(?=\.|$)", name)
        if match is None:
            plain.append(name)
            continue
        pattern = name[:match.start(1)] + "{}" + name[match.end(1):]
        groups.setdefault(pattern, []).append(int(match.group(1)))
    out = []
    for pattern, indices in groups.items():
        indices = sorted(set(indices))
        runs, start = [], indices[0]
        for prev, cur in zip(indices, indices[1:] + [None]):
            if cur != prev + 1:
                runs.append(f"{start}" if start == prev else f"{start}-{prev}")
                start = cur
        text = runs[0] if len(runs) == 1 and "-" not in runs[0] else f"[{','.join(runs)}]"
        out.append(pattern.format(text))
    return sorted(plain + out)


def _step_ranges(steps: Sequence[int]) -> str:
    return f"{steps[0]}" if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"


def describe_attention_plan(stats) -> str:
    """Markdown table of what ran: consecutive steps with the same per-layer modes share a row per mode, with the
    layers (compressed) and, on rows that skip, those layers' achieved sparsity per step (n/a: not counted)."""
    records = _layer_step_records(stats)
    per_step: dict[int, dict[str, list[str]]] = {}
    for (step, layer), recs in sorted(records.items()):
        mode = " & ".join(sorted(f"{r.backend}:{r.mode}" for r in recs))
        per_step.setdefault(step, {}).setdefault(mode, []).append(layer)

    def sparsity(step: int, layers: list[str]) -> str:
        recs = [r for layer in layers for r in records[(step, layer)]]
        if any(not r.counted for r in recs):
            return "n/a"
        total = sum(int(r.total) for r in recs)
        return format_number(sum(int(r.skipped) for r in recs) / total if total else 0.0, 3)

    lines = ["| steps | ran | layers | sparsity per step |", "|---|---|---|---|"]
    steps = sorted(per_step)
    i = 0
    while i < len(steps):
        j = i
        while j + 1 < len(steps) and per_step[steps[j + 1]] == per_step[steps[i]]:
            j += 1
        group = steps[i:j + 1]
        for mode, layers in sorted(per_step[steps[i]].items()):
            measured = " ".join(sparsity(s, layers) for s in group) if "skip" in mode else "- (dense)"
            lines.append(f"| {_step_ranges(group)} | {mode} | {', '.join(compress_layer_names(layers))} | "
                         f"{measured} |")
        i = j + 1
    return "\n".join(lines)

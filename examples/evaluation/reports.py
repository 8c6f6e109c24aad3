"""Reports: Markdown tables, plots (matplotlib, imported inside the plotting functions), a generation's numbers
(:class:`RunRecord`) and the test plan's tables (:func:`plan_tables`)."""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from .configs import TABLE_BACKENDS, TABLE_SAGE, TABLE_SAGE_SKIP, TABLE_SKIP


def format_number(value, digits: int, suffix: str = "") -> str:
    """Fixed-point text for tables: ``n/a`` for None, ``inf`` for infinity."""
    if value is None:
        return "n/a"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return f"{value:.{digits}f}{suffix}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]], align: str | None = None) -> str:
    """A Markdown table; ``align`` has one character per column, ``l`` or ``r`` (default: all left)."""
    align = align or "l" * len(headers)
    rule = ["---:" if a == "r" else "---" for a in align]
    escape = lambda cell: str(cell).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(rule) + " |"]
    lines += ["| " + " | ".join(escape(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def plot_quality_vs_speedup(points: Sequence[tuple[str, float, float]], ylabel: str, path: str,
                            title: str = "") -> str:
    """Scatter of ``(label, speed-up, quality)`` points, each labelled, to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, speedup, quality in points:
        ax.scatter(speedup, quality)
        ax.annotate(label, (speedup, quality), fontsize=7, xytext=(4, 3), textcoords="offset points")
    ax.axvline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("transformer speed-up vs reference (×)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_sparsity(grids: Mapping[str, Mapping[tuple[int, str], float | None]], path: str, title: str = "") -> str:
    """Per configuration: achieved sparsity per step (top row) and per step × layer as a heatmap; layers and steps
    without counts are blank. ``grids`` maps a configuration label to :func:`sparsity_grid`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    labels = list(grids)
    fig, axes = plt.subplots(2, len(labels), figsize=(4.2 * len(labels), 7), squeeze=False)
    for col, label in enumerate(labels):
        grid = grids[label]
        steps = sorted({s for s, _ in grid})
        layers = sorted({layer for _, layer in grid}, key=_natural_key)
        matrix = np.full((len(layers), len(steps)), np.nan)
        for (step, layer), value in grid.items():
            if value is not None:
                matrix[layers.index(layer), steps.index(step)] = value
        with warnings.catch_warnings():  # a step with no counted layer has no mean: left blank
            warnings.simplefilter("ignore", RuntimeWarning)
            step_mean = np.nanmean(matrix, axis=0)
        axes[0, col].plot(steps, step_mean, marker="o")
        axes[0, col].set_ylim(-0.02, 1.02)
        axes[0, col].set_title(label, fontsize=8)
        axes[0, col].set_xlabel("step")
        axes[0, col].set_ylabel("mean sparsity over layers")
        image = axes[1, col].imshow(matrix, aspect="auto", vmin=0, vmax=1, cmap="viridis", interpolation="nearest")
        axes[1, col].set_yticks(range(len(layers)), [_short_layer(name) for name in layers], fontsize=5)
        axes[1, col].set_xlabel("step")
        fig.colorbar(image, ax=axes[1, col], fraction=0.046)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _natural_key(name: str):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _short_layer(name: str) -> str:
    return name.replace("transformer_blocks.", "").replace("blocks.", "")


@dataclass
class RunRecord:
    """One generation's numbers (used by the examples for tables and JSON)."""

    label: str
    table: str = TABLE_BACKENDS
    gate: float | None = None
    ran_on: str = ""
    run_s: float | None = None
    transformer_s: float | None = None
    transformer_calls: int = 0
    sparsity: float | None = None
    per_step: dict = field(default_factory=dict)
    lpips: float | None = None
    psnr: float | None = None
    ssim: float | None = None
    speedup_transformer: float | None = None
    speedup_run: float | None = None
    note: str = ""

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        data["per_step"] = {str(k): v for k, v in self.per_step.items()}
        for key in ("psnr",):  # JSON has no infinity
            if data[key] is not None and math.isinf(data[key]):
                data[key] = "inf"
        return data

    def cells(self, model: str) -> list[str]:
        """This record as a row of :data:`RESULT_COLUMNS`."""
        return [model, self.label, self.ran_on or "n/a", format_number(self.gate, 2),
                format_number(self.lpips, 4), format_number(self.psnr, 2), format_number(self.ssim, 4),
                format_number(self.speedup_transformer, 3, "×"), format_number(self.speedup_run, 3, "×"),
                format_number(self.transformer_s, 3), format_number(self.run_s, 3),
                format_number(self.sparsity, 3), self.note]


RESULT_COLUMNS = ("Model", "config", "ran on", "D", "LPIPS ↓", "PSNR (dB) ↑", "SSIM ↑", "speed-up (transformer)",
                  "speed-up (run)", "transformer (s)", "run (s)", "sparsity", "notes")
RESULT_ALIGN = "lllrrrrrrrrrl"

# The test plan's tables: title, the configurations' tables shown in it, whether the reference row leads it.
PLAN_TABLES = (
    ("Step 1 — SAGE", (TABLE_SAGE,), True),
    ("Step 2 — Skip-Softmax (sweep of D = disabled_until_timestep)", (TABLE_SKIP,), False),
    ("Step 3 — SAGE + Skip (sweep of D)", (TABLE_SAGE_SKIP,), False),
    ("Step 4 — cross-backend comparison (every configuration)", (TABLE_SAGE, TABLE_SKIP, TABLE_SAGE_SKIP,
                                                                 TABLE_BACKENDS), True),
)


def plan_tables(model: str, records: Sequence[RunRecord]) -> str:
    """The test plan's four tables in Markdown, from ``records`` (the first is the reference)."""
    reference, rest = records[0], records[1:]
    sections = []
    for title, tables, with_reference in PLAN_TABLES:
        rows = ([reference] if with_reference else []) + [r for r in rest if r.table in tables]
        sections.append(f"## {title}\n\n" + markdown_table(RESULT_COLUMNS, [r.cells(model) for r in rows],
                                                           RESULT_ALIGN))
    return "\n\n".join(sections)

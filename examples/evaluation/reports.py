"""Reports: Markdown tables, plots (matplotlib, imported inside the plotting functions), a generation's numbers
(:class:`RunRecord`) and the test plan's tables (:func:`plan_tables`)."""

from __future__ import annotations

import dataclasses
import math
import re
import textwrap
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


MARKERS = "osD^vP*Xhp<>"


def plot_quality_vs_speedup(points: Sequence[tuple[str, float | None, float]], ylabel: str, path: str,
                            title: str = "", note: str = "") -> str:
    """Quality against transformer speed-up, one marker per ``(label, speed-up, quality)`` point, named in a
    legend beside the axes (labels written at the points overlap). Points without a speed-up (a backend whose
    time means nothing, e.g. TORCH_REFERENCE) are drawn as a quality-only dot plot instead; ``note`` says why
    under the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [p for p in points if p[1] is not None]
    untimed = [p for p in points if p[1] is None]
    fig, ax = plt.subplots(figsize=(10, 0.9 + 0.32 * max(len(untimed), 10)) if untimed and not timed
                           else (10, 5))
    if timed:
        for i, (label, speedup, quality) in enumerate(timed):
            ax.scatter(speedup, quality, marker=MARKERS[i % len(MARKERS)], s=45, label=label)
        ax.axvline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("transformer speed-up vs reference (×)")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    else:
        labels = [label for label, _, _ in untimed][::-1]
        ax.scatter([quality for _, _, quality in untimed][::-1], range(len(labels)), s=30)
        ax.set_yticks(range(len(labels)), labels, fontsize=8)
        ax.set_xlabel(ylabel)
    ax.set_title(title + ("\n" + "\n".join(textwrap.wrap(note, 110)) if note else ""), fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_sparsity(grids: Mapping[str, Mapping[tuple[int, str], float | None]], path: str, title: str = "") -> str:
    """Achieved sparsity of the configurations that skipped: mean over the skipping layers per step, all
    configurations in one panel; then per configuration a step × layer heatmap of the layers that ran
    Skip-Softmax. Grey cells: nothing counted there (the gate kept the step dense on a backend that does not
    count, or the layer's expert did not run that step). ``grids`` maps a configuration label to
    :func:`sparsity_grid`. The sparsity axis and the colour scale run from 0 to the highest value counted (a
    little above it), not to 1: a trained model may skip most tiles, a tiny random one a few percent."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from matplotlib.ticker import MaxNLocator

    labels = list(grids)
    counted = [value for grid in grids.values() for value in grid.values() if value is not None]
    top = _axis_top(max(counted, default=0.0))
    columns = min(3, len(labels))
    heat_rows = -(-len(labels) // columns)
    fig = plt.figure(figsize=(13, 4.4 + 3.2 * heat_rows), layout="constrained")
    layout = fig.add_gridspec(1 + heat_rows, columns, height_ratios=[1.4] + [1.0] * heat_rows)
    mean_ax = fig.add_subplot(layout[0, :])
    heat_axes = []
    cmap = plt.get_cmap("viridis").with_extremes(bad="0.85")
    image, highest_mean = None, 0.0
    for index, label in enumerate(labels):
        grid = grids[label]
        steps = sorted({s for s, _ in grid})
        layers = sorted({layer for (_, layer), value in grid.items() if value is not None}, key=_natural_key)
        matrix = np.full((len(layers), len(steps)), np.nan)
        for (step, layer), value in grid.items():
            if value is not None:
                matrix[layers.index(layer), steps.index(step)] = value
        with warnings.catch_warnings():  # a step with no counted layer has no mean: no point
            warnings.simplefilter("ignore", RuntimeWarning)
            step_mean = np.nanmean(matrix, axis=0)
        mean_ax.plot(steps, step_mean, marker=MARKERS[index % len(MARKERS)], label=label)
        highest_mean = max(highest_mean, float(np.nanmax(step_mean, initial=0.0)))
        ax = fig.add_subplot(layout[1 + index // columns, index % columns])
        heat_axes.append(ax)
        image = ax.imshow(np.ma.masked_invalid(matrix), aspect="auto", vmin=0, vmax=top, cmap=cmap,
                          interpolation="nearest")
        every = max(1, len(layers) // 16)  # at most ~16 layer names per heatmap stay readable
        ax.set_yticks(range(0, len(layers), every), [_short_layer(layers[i]) for i in range(0, len(layers), every)],
                      fontsize=7)
        ax.set_xticks(range(len(steps)), steps, fontsize=7)
        ax.set_xlabel("step", fontsize=8)
        ax.set_title(label, fontsize=8)
    mean_top = _axis_top(highest_mean)
    mean_ax.set_ylim(-0.02 * mean_top, mean_top)
    mean_ax.set_xlabel("denoising step")
    mean_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    mean_ax.set_ylabel("mean sparsity\n(skipping layers)")
    mean_ax.grid(alpha=0.3)
    # under the axes, not beside them: beside, it would narrow every heatmap column as well
    mean_ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncols=min(3, len(labels)))
    if image is not None:
        fig.colorbar(image, ax=heat_axes, fraction=0.02, label="skipped / all KV tiles")
    fig.suptitle(f"{title}\nheatmaps: the layers that ran Skip-Softmax (rows) per step; grey: no Skip-Softmax "
                 "counted there (the gate kept the step dense, or the layer's expert did not run)", fontsize=9)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _axis_top(highest: float) -> float:
    """An axis end a tenth above ``highest`` at two significant digits, at most 1 (nothing counted: 1)."""
    if highest <= 0:
        return 1.0
    return min(1.0, float(f"{highest * 1.1:.2g}"))


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
    #: some call ran Skip-Softmax (else the sparsity column says "off")
    skipped: bool = False
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
                format_number(self.sparsity, 3) if self.skipped else "off", self.note]


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

"""Plots of the results people look at first, drawn from the tables in ``benchmarks/RESULTS.md``.

- ``seconds_per_video.png``: seconds per video by configuration, text encoding, denoising and VAE decode stacked,
  one panel per model (the "Seconds per video" tables);
- ``skip_curve.png``: speed over cuDNN against the published curve's sparsity target s, one line per kernel
  (the "published-curve table");
- ``reuse_curve.png``: the same for FMHAv2 SAGE fp8 dense, with Skip-Softmax and with its reuse across steps
  (the "Reuse against sparsity" table).

RESULTS.md is the record; the plots are redrawn from it after a device run updates a table:

    python benchmarks/plot_results.py                 # writes the PNGs next to RESULTS.md
"""

import argparse
import pathlib
import re
import sys

HERE = pathlib.Path(__file__).resolve().parent
VIDEO_TABLES = {"Wan 2.2 A14B": "#### Wan 2.2 A14B", "HunyuanVideo 1.5": "#### HunyuanVideo 1.5"}
# each curve plot: its table's heading and the plot's title
CURVES = {
    "skip_curve": ("### The published-curve table",
                   "Skip-Softmax kernels at Wan 2.2's self-attention shape (75,600 tokens × 40 heads), H200"),
    "reuse_curve": ("### Reuse against sparsity",
                    "FMHAv2 SAGE fp8 with Skip-Softmax and its reuse across steps, H100\n"
                    "Wan 2.2's self-attention shape (75,600 tokens × 40 heads), published-curve data"),
}
PHASES = {"text encoding (s)": "text encoding", "denoising, 40 steps (s)": "denoising",
          "denoising, 50 steps (s)": "denoising", "VAE decode (s)": "VAE decode"}
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


class ResultsError(ValueError):
    """RESULTS.md lacks a table the plots read, or a cell is not what the plot expects."""


def table_after(text: str, heading: str) -> list[dict[str, str]]:
    """The first markdown table after the line starting with ``heading``: one dict per row, by column title
    (bold markup and the footnote star removed)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(heading)), None)
    if start is None:
        raise ResultsError(f"no heading starting {heading!r}")
    first = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("|")), None)
    if first is None:
        raise ResultsError(f"no table after {heading!r}")
    rows = []
    for line in lines[first:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip().replace("**", "").rstrip("*").strip() for cell in line.strip("|").split("|")])
    header, body = rows[0], rows[2:]
    return [dict(zip(header, row)) for row in body]


def number(cell: str, where: str) -> float:
    """The first number in ``cell`` ("673.2", "1,595.0", "122.9, 1.65×" → 122.9)."""
    found = NUMBER.search(cell)
    if found is None:
        raise ResultsError(f"{where}: {cell!r} holds no number")
    return float(found.group().replace(",", ""))


def ratio(cell: str, where: str) -> float:
    """The ``×`` figure of a "ms, ratio×" cell."""
    found = re.search(r"(\d+(?:\.\d+)?)×", cell)
    if found is None:
        raise ResultsError(f"{where}: {cell!r} holds no ×-ratio")
    return float(found.group(1))


def video_phases(text: str) -> dict[str, list[tuple[str, dict[str, float], float]]]:
    """Per model: (configuration, seconds per phase, × best diffusers) for every configuration that ran."""
    models = {}
    for model, heading in VIDEO_TABLES.items():
        ran = []
        for row in table_after(text, heading):
            if row.get("seconds per video", "n/a") == "n/a":
                continue
            where = f"{model}, {row['configuration']}"
            phases = {name: number(row[column], where) for column, name in PHASES.items() if column in row}
            ran.append((row["configuration"], phases, number(row["× best diffusers"], where)))
        models[model] = ran
    return models


def block_words(k_block: int, kv_step: int) -> str:
    """A FMHAv2 SAGE column's blocks in words: ``k0, 256`` is one K scale per sequence and head, 256-key steps."""
    scale = "K scale per sequence and head" if k_block == 0 else f"K scale per {k_block} keys"
    return f"{scale}, {kv_step}-key steps"


def speed_curves(text: str, heading: str) -> tuple[list[float], dict[str, list[float]]]:
    """The table of × cuDNN against s after ``heading``: the s values and, per kernel column, × cuDNN at each."""
    rows = table_after(text, heading)
    curves, kernel = {}, ""
    for column in (c for c in rows[0] if c not in ("s", "sparsity")):
        # a column titled by its blocks alone ("k64, 256") is a variant of the kernel before it
        kernel = column.split(" (")[0] if not re.match(r"k\d", column) else kernel
        blocks = re.search(r"k(\d+), (\d+)", column)
        label = f"{kernel} ({block_words(*map(int, blocks.groups()))})" if blocks else column
        curves[label] = [ratio(row[column], f"s = {row['s']}, {column}") for row in rows]
    return [number(row["s"], "s") for row in rows], curves


def pyplot():
    """matplotlib's pyplot drawing to files (no screen needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_video(models, path: pathlib.Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(len(models), 1, figsize=(10, 2.2 + 0.55 * sum(len(r) for r in models.values())),
                             gridspec_kw={"height_ratios": [len(r) for r in models.values()]})
    colors = {"text encoding": "#9ecae1", "denoising": "#3182bd", "VAE decode": "#fd8d3c"}
    for ax, (model, ran) in zip(axes, models.items()):
        names = [name for name, _, _ in ran][::-1]
        left = [0.0] * len(ran)
        for phase, color in colors.items():
            widths = [phases.get(phase, 0.0) for _, phases, _ in ran][::-1]
            ax.barh(names, widths, left=left, color=color, label=phase)
            left = [a + b for a, b in zip(left, widths)]
        for y, (total, (_, _, speed)) in enumerate(zip(left, ran[::-1])):
            ax.text(total, y, f"  {total:,.0f} s  ({speed:.2f}×)", va="center", fontsize=9)
        ax.set_xlim(0, max(left) * 1.3)
        ax.set_title(f"{model}: seconds per 720p / 81-frame video on one H200 (× best diffusers configuration)",
                     fontsize=10, loc="left")
        ax.tick_params(axis="y", labelsize=9)
    axes[-1].set_xlabel("seconds (random full-size weights; denoising timed for a few steps and scaled, as "
                        "RESULTS.md says)", fontsize=9)
    axes[-1].legend(loc="center right", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_curve(s_values, kernels, title: str, path: pathlib.Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for kernel, ratios in kernels.items():
        ax.plot(s_values, ratios, marker="o", label=kernel)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlabel("sparsity target s of the published Wan 2.2 curve")
    ax.set_ylabel("speed over cuDNN SDPA (×)")
    ax.set_title(title, fontsize=10, loc="left")
    ax.set_xticks(s_values)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict[str, pathlib.Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=pathlib.Path, default=HERE / "RESULTS.md", help="the results file")
    parser.add_argument("--out", type=pathlib.Path, default=HERE, help="folder for the PNGs")
    args = parser.parse_args(argv)
    try:
        text = args.results.read_text(encoding="utf-8")
        models = video_phases(text)
        curves = {name: speed_curves(text, heading) for name, (heading, _) in CURVES.items()}
    except (OSError, ResultsError) as e:
        print(f"plot_results: {args.results}: {e}", file=sys.stderr)
        sys.exit(2)
    args.out.mkdir(parents=True, exist_ok=True)
    written = {name: args.out / f"{name}.png" for name in ("seconds_per_video", *CURVES)}
    plot_video(models, written["seconds_per_video"])
    for name, (s_values, kernels) in curves.items():
        plot_curve(s_values, kernels, CURVES[name][1], written[name])
    for path in written.values():
        print(path)
    return written


if __name__ == "__main__":
    main()

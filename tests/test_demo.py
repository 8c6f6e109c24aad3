"""The main job: examples/demo.py on the tiny built-in pipeline, numbers checked against what each config means."""

import contextlib
import io

import pytest

from helpers import load_script


@pytest.fixture(scope="module")
def demo_rows():
    demo = load_script("examples/demo.py")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rows = demo.main(["--steps", "4", "--gate", "0.8"])  # default 192×320×9: 720 tokens, 6 KV tiles
    return {row["config"]: row for row in rows}, demo, printed.getvalue()


def test_demo_compares_every_config_to_dense(demo_rows):
    rows, demo, _ = demo_rows
    assert list(rows)[0] == demo.REFERENCE_LABEL
    # on a CPU the configurations run on TORCH_REFERENCE (auto would run Skip-Softmax and SAGE dense on SDPA)
    dense = rows["dense (TORCH_REFERENCE)"]
    assert dense["rel_diff"] < 1e-5 and dense["backends"] == "TORCH_REFERENCE"
    for label in ("SAGE int8", "SAGE fp8"):
        assert 1e-4 < rows[label]["rel_diff"] < 5e-2  # quantized, but the same video
        assert rows[label]["backends"] == "TORCH_REFERENCE"


def test_demo_output_explains_itself(demo_rows):
    rows, demo, printed = demo_rows
    header, table = printed.split("Columns:", 1)
    for i, label in enumerate(rows, 1):  # which configuration runs, before it runs
        assert f"[{i}/{len(rows)}] {label}: {{" in header
    assert "untimed 1-step warm-up" in header
    for column in ("ran on:", "time:", "rel. diff to dense:", "sparsity:", "sparsity per step:"):
        assert f"- {column}" in table
    assert "random weights give nearly uniform attention" in table and "say nothing about GPU speed" in table
    assert demo.format_table(list(rows.values())) in table
    assert "| SAGE int8 | TORCH_REFERENCE |" in table and table.count("| - | - |") == 4  # dense rows: no sparsity


def test_demo_skip_rows_follow_the_gate(demo_rows):
    rows, _, _ = demo_rows
    skip = rows["skip λ=0.5, D=0.8"]
    per_step = [v for _, v in sorted(skip["per_step"].items())]
    assert len(per_step) == 4 and per_step[0] is None and 0 not in skip["skipping"]  # t = 0.999 > D: dense
    assert skip["sparsity"] > 0 and max(v for v in per_step if v is not None) > 0
    assert demo_table_steps(skip)[0] == "off"
    assert skip["backends"] == "TORCH_REFERENCE"


def demo_table_steps(row) -> list[str]:
    """The demo table's sparsity-per-step cells of ``row``."""
    from helpers import load_script

    line = next(line for line in load_script("examples/demo.py").format_table([row]).splitlines()
                if line.startswith(f"| {row['config']} |"))
    return line.split(" | ")[5].split()

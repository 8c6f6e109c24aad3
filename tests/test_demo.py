"""The main job: examples/demo.py on the tiny built-in pipeline, numbers checked against what each config means."""

import pytest

from helpers import load_script


@pytest.fixture(scope="module")
def demo_rows():
    demo = load_script("examples/demo.py")
    rows = demo.main(["--steps", "4", "--gate", "0.8"])  # default 192×320×9: 720 tokens, 6 KV tiles
    return {row["config"]: row for row in rows}, demo


def test_demo_compares_every_config_to_dense(demo_rows):
    rows, demo = demo_rows
    assert list(rows)[0] == demo.REFERENCE_LABEL
    dense = rows["dense (TORCH_REFERENCE)"]  # the demo's CPU default: auto would drop skip and SAGE here
    assert dense["rel_diff"] < 1e-5 and dense["backends"] == "TORCH_REFERENCE"
    for label in ("SAGE int8", "SAGE fp8"):
        assert 1e-4 < rows[label]["rel_diff"] < 5e-2  # quantized, but the same video
        assert rows[label]["backends"] == "TORCH_REFERENCE"


def test_demo_skip_rows_follow_the_gate(demo_rows):
    rows, _ = demo_rows
    skip = rows["skip λ=0.5, D=0.8"]
    per_step = [v for _, v in sorted(skip["per_step"].items())]
    assert len(per_step) == 4 and per_step[0] == 0.0  # t = 0.999 > D: dense
    assert skip["sparsity"] > 0 and max(per_step) > 0
    assert skip["backends"] == "TORCH_REFERENCE"

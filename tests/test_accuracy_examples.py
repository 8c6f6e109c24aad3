"""The examples print the accuracy probe's table when it is on: generate.py from the config's ``accuracy`` key,
demo.py with ``--probe-rows``."""

import contextlib
import io
import json

from helpers import load_script

CONFIG = {"default": {"backend": "TORCH_REFERENCE", "quant": {"dtype_qk": "int8"}, "accuracy": {"probe_rows": 8}}}


def test_generate_prints_the_per_layer_error_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DIFFUSION_ATTENTION_CONFIG", json.dumps(CONFIG))
    result = load_script("examples/generate.py").main(["--steps", "2", "--output", str(tmp_path / "fox.mp4")])
    printed = capsys.readouterr().out
    summary = result["summary"]
    assert f"all layers: {summary['error']:.2e}):\n| layer | ran (probed steps) | probed error |" in printed
    for layer, error in summary["error_per_layer"].items():
        assert f"| {layer} | TORCH_REFERENCE:sage-int8 | {error:.2e} |" in printed


def test_demo_adds_the_probed_error_column():
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rows = load_script("examples/demo.py").main(["--steps", "1", "--height", "64", "--width", "64", "--frames",
                                                     "1", "--probe-rows", "4"])
    table = printed.getvalue().split("| config |", 1)[1]
    assert table.startswith(" ran on | time (s) | rel. diff to dense | sparsity | sparsity per step | probed error |")
    errors = {row["config"]: row["error"] for row in rows}
    assert errors["dense (TORCH_SDPA)"] < 1e-5 < errors["SAGE int8"] < 0.1
    assert f"| {errors['SAGE int8']:.2e} |" in table

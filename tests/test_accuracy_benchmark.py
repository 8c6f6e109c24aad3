"""benchmarks/accuracy_probe.py --tiny: the CPU form of the H200 run, its rows and tables as they will be reported."""

import pytest

from helpers import load_script


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    output = tmp_path_factory.mktemp("accuracy_probe") / "accuracy_probe.json"
    return load_script("benchmarks/accuracy_probe.py").main(["--tiny", "--compile", "none", "--repeats", "1",
                                                             "--output", str(output)])


def test_the_cost_rows_time_the_probe_off_and_on(tiny_run):
    ms = tiny_run["cost"]["ms"]
    assert set(ms) == {"probe off", "probe on, step not probed", "probe on, probed step", "probed error (all layers)"}
    assert all(value > 0 for value in ms.values())
    assert "| probe on, probed step |" in tiny_run["markdown"] and tiny_run["output"].is_file()


def test_the_error_tables_cover_every_layer_of_each_configuration(tiny_run):
    errors = tiny_run["errors"]
    assert list(errors) == ["SAGE fp8_e4m3", "SAGE int8", "SAGE fp8_e4m3 + skip λ=0.5"]
    for label, table in errors.items():
        layers = table["per_layer"]
        assert len(layers) == 4 and table["markdown"].count("| transformer.blocks.") == 4
        self_attention = [e for layer, e in layers.items() if layer.endswith("attn1")]
        cross_attention = [e for layer, e in layers.items() if layer.endswith("attn2")]
        assert all(1e-3 < e < 0.1 for e in self_attention), (label, layers)  # SAGE's error on QK-normed-like data
        assert all(e < 1e-5 for e in cross_attention), (label, layers)  # dense TORCH_SDPA: the float32 floor

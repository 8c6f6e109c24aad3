"""The edges a user meets first, through the public API and the scripts as users run them: environment switches
read one way, what the statistics' numbers mean."""

import argparse
import os

import pytest
import torch

from diffusers_trtllm import (AttentionConfig, AttentionConfigError, add_attention_args, config_from_args,
                              enable_trtllm_attention)
from diffusers_trtllm.backends.base import TRTLLM_ON_REFERENCE_ENV
from diffusers_trtllm.config import env_switch

from helpers import load_script, pipeline_context, tiny_wan, wan_inputs

SWITCHES = [TRTLLM_ON_REFERENCE_ENV, "TRTLLM_GEN_SAGE", "DIFFUSERS_TRTLLM_COLLECT_STATS"]


@pytest.mark.parametrize("raw, on", [("1", True), ("true", True), ("TRUE", True), (" yes ", True), ("on", True),
                                     ("0", False), ("false", False), ("No", False), ("off", False), ("", False)])
def test_every_switch_reads_the_same_words(raw, on):
    for name in SWITCHES:
        assert env_switch(name, {name: raw}) is on, name
    assert env_switch("UNSET", {}) is False


@pytest.mark.parametrize("name", SWITCHES)
def test_a_switch_value_it_does_not_know_is_refused_naming_the_variable(name):
    with pytest.raises(AttentionConfigError) as refused:
        env_switch(name, {name: "maybe"})
    assert str(refused.value) == (f"{name}='maybe' is invalid: expected one of ['1', 'true', 'yes', 'on', '0', "
                                  "'false', 'no', 'off'] (or empty)")


def test_the_reference_seam_takes_true(monkeypatch):
    """``DIFFUSERS_TRTLLM_TRTLLM_ATTN_ON_REFERENCE=true`` runs TRTLLM_ATTN on the reference, as ``1`` does."""
    monkeypatch.setenv(TRTLLM_ON_REFERENCE_ENV, "true")
    model = tiny_wan()
    with enable_trtllm_attention(model, {"default": {"backend": "TRTLLM_ATTN"}}) as handle, torch.no_grad():
        model(**wan_inputs(batch=1, frames=1, height=8, width=8))
        assert {rec.backend for rec in handle.stats.records.values()} == {"TRTLLM_ATTN"}


def test_the_sage_shortcut_variable_takes_the_same_words():
    assert config_from_args(None, {"TRTLLM_GEN_SAGE": "yes"}).default.quant.dtype_qk == "fp8_e4m3"
    assert config_from_args(None, {"TRTLLM_GEN_SAGE": "off"}).default.quant is None


# --- output paths: one line, exit 2, before any work ------------------------------------------------------------------

def output_cases(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    a_folder = tmp_path / "a_folder"
    a_folder.mkdir()
    return [("generate.py", ["--output", str(a_folder)], "is an existing folder; give a file path"),
            ("generate.py", ["--output", str(a_file / "fox.mp4")], "cannot make a folder under"),
            ("calibrate.py", ["--output-dir", str(a_file)], "is an existing file; give a folder"),
            ("demo.py", ["--output-dir", str(a_file)], "is an existing file; give a folder"),
            ("evaluate.py", ["--output-dir", str(a_file)], "is an existing file; give a folder"),
            ("evaluate.py", ["--output-dir", str(a_file / "out")], "cannot make a folder under")]


@pytest.mark.parametrize("case", range(6))
def test_an_output_that_cannot_be_written_stops_the_script_before_any_work(case, tmp_path, capsys, monkeypatch):
    script, argv, message = output_cases(tmp_path)[case]
    module = load_script(f"examples/{script}")
    monkeypatch.setattr(module, "load_model" if hasattr(module, "load_model") else "load_pipeline",
                        lambda *a, **k: pytest.fail("the model was loaded before the output was checked"))
    with pytest.raises(SystemExit) as stopped:
        module.main(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_an_unwritable_output_folder_is_refused(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.access(locked, os.W_OK):  # root writes anywhere: nothing to check here
        pytest.skip("this user can write a read-only folder")
    with pytest.raises(SystemExit) as stopped:
        load_script("examples/generate.py").main(["--output", str(locked / "fox.mp4")])
    assert stopped.value.code == 2 and "is not writable" in capsys.readouterr().err


# --- --diffusion-attention-config: JSON or a JSON file ---------------------------------------------------------------

def test_the_attention_config_flag_takes_a_json_file(tmp_path):
    path = tmp_path / "attention.json"
    path.write_text('{"default": {"backend": "TORCH_REFERENCE", "skip_softmax": {"threshold": 0.5}}}')
    parser = add_attention_args(argparse.ArgumentParser())
    config = config_from_args(parser.parse_args(["--diffusion-attention-config", str(path)]), {})
    assert config.default.backend == "TORCH_REFERENCE" and config.default.skip_softmax.threshold == 0.5
    assert config_from_args(None, {"DIFFUSION_ATTENTION_CONFIG": str(path)}) == config


def test_a_config_that_is_neither_json_nor_a_file_says_so_in_one_line(tmp_path):
    parser = add_attention_args(argparse.ArgumentParser())
    with pytest.raises(AttentionConfigError) as refused:
        config_from_args(parser.parse_args(["--diffusion-attention-config", str(tmp_path / "missing.json")]), {})
    assert str(refused.value) == (f"--diffusion-attention-config: '{tmp_path / 'missing.json'}' is neither a JSON "
                                  "object (it does not start with '{') nor a JSON file (no such file)")


def test_generate_reads_the_config_file_from_the_command_line(tmp_path, capsys):
    path = tmp_path / "attention.json"
    path.write_text("{not json")
    with pytest.raises(SystemExit) as stopped:
        load_script("examples/generate.py").main(["--diffusion-attention-config", str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and len(err) == 1 and "attention config is not valid JSON" in err[0], err


# --- what the numbers mean ---------------------------------------------------------------------------------------

def test_a_step_the_gate_kept_dense_says_off_and_sparsity_covers_the_layers_that_skip():
    """Skip-Softmax on self-attention only, behind a gate at t = 0.8: the steps above it show "off", not 0.000;
    a step's and the run's sparsity are over the self-attention calls, the dense cross-attention not averaged in."""
    from diffusers_trtllm.tiny_pipelines import tiny_wan22_pipeline

    pipe = tiny_wan22_pipeline(0)
    pipe.set_progress_bar_config(disable=True)
    config = {"default": {"backend": "TORCH_REFERENCE"},
              "per_role": {"self_attn": {"backend": "TORCH_REFERENCE",
                                         "skip_softmax": {"threshold": 0.5, "disabled_until_timestep": 0.8}}}}
    with enable_trtllm_attention(pipe, config) as handle:
        pipe("a fox", height=96, width=160, num_frames=5, num_inference_steps=6, output_type="latent",
             generator=torch.Generator().manual_seed(0))
        stats = handle.stats
    rows = [row.split(" | ") for row in stats.table().splitlines()[2:]]
    gated = {int(row[0].strip("| ")) for row in rows if row[2] == "off"}
    skipping = stats.skipping()
    assert gated and skipping and gated.isdisjoint(skipping) and gated | skipping == set(stats.modes())
    records = [rec for rec in stats.records.values() if rec.skips]
    assert {layer.rsplit(".", 1)[-1] for (_, layer, *_), rec in stats.records.items() if rec.skips} == {"attn1"}
    assert stats.summary()["sparsity"] == sum(r.skipped for r in records) / sum(r.total for r in records)
    assert all(value is None for layer, value in stats.per_layer().items() if layer.endswith("attn2"))


# --- messages -----------------------------------------------------------------------------------------------------

def test_a_config_warning_points_at_the_users_line():
    """Not at the dataclass's generated ``__init__`` (``<string>``) nor at this package."""
    with pytest.warns(UserWarning, match=">= 1 skips nearly every KV tile") as caught:
        AttentionConfig.coerce({"default": {"skip_softmax": {"threshold": 1.5}}})
    assert caught[0].filename == __file__


def test_the_vllm_omni_log_line_names_layers_a_calibration_keeps_dense_as_dense():
    from diffusers_trtllm import SkipCalibration
    from diffusers_trtllm.integrations.vllm_omni import backends_by_role

    curve = SkipCalibration(2.0, 3.0, ignore=("blocks.0.*",))
    config = {"default": {"backend": "TORCH_REFERENCE", "skip_softmax": {"target_sparsity": 0.3}}}
    with enable_trtllm_attention(tiny_wan(), config, calibrations={"transformer": curve}) as handle:
        line = backends_by_role(handle)
    assert line == ("transformer: self_attn TORCH_REFERENCE dense (1 layer) / TORCH_REFERENCE skip (1 layer), "
                    "cross_attn TORCH_REFERENCE dense (1 layer) / TORCH_REFERENCE skip (1 layer)")


def test_a_transformer_compiled_before_install_is_installed_through():
    """``pipe.transformer = torch.compile(pipe.transformer)`` then install: the processors go onto the module it
    compiled, which recompiles on its next call; restore puts diffusers' back."""
    model = tiny_wan()
    inputs = wan_inputs(batch=1, frames=1, height=8, width=8)
    config = {"default": {"backend": "TORCH_REFERENCE", "quant": {"dtype_qk": "int8"}}}
    with enable_trtllm_attention(model, config), torch.no_grad():
        expected = model(**inputs)[0]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        compiled(**inputs)
    with enable_trtllm_attention(compiled, config) as handle, torch.no_grad():
        with pytest.warns(UserWarning, match="attention ran outside any run, so handle.stats does not count it"):
            got = compiled(**inputs)[0]  # compiled whole: the pre-hook that starts a bare transformer's runs is skipped
        assert {type(p).__name__ for p in model.attn_processors.values()} == {"WanTrtllmAttnProcessor"}
        assert handle.stats.modes() == {}
        with pipeline_context(compiled):  # as a pipeline calls it: a run of its own, counted
            compiled(**inputs)
        assert {mode for modes in handle.stats.modes().values() for mode in modes} == {"TORCH_REFERENCE:sage-int8"}
    assert torch.equal(got, expected)
    assert {type(p).__name__ for p in model.attn_processors.values()} == {"WanAttnProcessor"}


# --- set-up ---------------------------------------------------------------------------------------------------------

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def test_the_development_guides_example_command_selects_tests():
    import re
    import subprocess
    import sys

    text = (ROOT / "docs" / "development.md").read_text()
    command = re.search(r"`python -m pytest -q (tests/[^`]+)`", text).group(1).split()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                           *command], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and " tests collected" in proc.stdout, proc.stdout[-500:]


@pytest.mark.parametrize("written", ["evaluation_out/report.json", "calibrated_tiny/config.json", "output.mp4"])
def test_what_the_examples_write_by_default_is_ignored_by_git(written):
    import subprocess

    proc = subprocess.run(["git", "check-ignore", "-q", written], cwd=ROOT)
    assert proc.returncode == 0, written


# --- the examples' range arguments at their boundaries -------------------------------------------------------------

class ReachedTheWork(Exception):
    pass


CALIBRATE_RANGES = [
    (["--lambda-max", "1.0"], None), (["--lambda-max", "1.0001"], "--lambda-min 1e-06 / --lambda-max 1.0001"),
    (["--lambda-min", "0"], "--lambda-min 0 / --lambda-max 1 are invalid"),
    (["--lambda-min", "0.5", "--lambda-max", "0.5"], "expected 0 < min < max <= 1"),
    (["--fit-range", "0", "1"], None), (["--fit-range", "0.5", "0.5"], "--fit-range 0.5 0.5 is invalid"),
    (["--fit-range", "-0.01", "0.9"], "--fit-range -0.01 0.9 is invalid"),
    (["--fit-range", "0.1", "1.01"], "--fit-range 0.1 1.01 is invalid"),
    (["--gate", "1.0"], None), (["--gate", "1.5"], "disabled_until_timestep=1.5 is invalid"),
    (["--target-sparsity", "0"], None), (["--target-sparsity", "1"], None),
    (["--target-sparsity", "1.01"], "target_sparsity=1.01 is invalid"),
    (["--kv-step", "256"], None), (["--kv-step", "200"], "kv_step=200 is invalid"),
]


def reaches_the_work_or_stops_in_one_line(script: str, loader: str, argv: list[str], refused: str | None,
                                          capsys, monkeypatch) -> None:
    """Run ``script`` with ``argv``: with ``refused`` None it reaches the work (``loader`` is called), else it stops
    before, one line holding ``refused`` on stderr, exit 2."""
    module = load_script(f"examples/{script}")
    monkeypatch.setattr(module, loader, lambda *a, **k: (_ for _ in ()).throw(ReachedTheWork()))
    if refused is None:
        with pytest.raises(ReachedTheWork):
            module.main(argv)
        return
    with pytest.raises(SystemExit) as stopped:
        module.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and len(err) == 1 and refused in err[0], err


@pytest.mark.parametrize("argv, refused", CALIBRATE_RANGES, ids=[" ".join(a) for a, _ in CALIBRATE_RANGES])
def test_calibrates_range_arguments_at_their_boundaries(argv, refused, tmp_path, capsys, monkeypatch):
    reaches_the_work_or_stops_in_one_line("calibrate.py", "load_pipeline", argv + ["--output-dir", str(tmp_path)],
                                          refused, capsys, monkeypatch)


GENERATE_RANGES = [
    (["--trtllm-gen-target-sparsity", "0"], None), (["--trtllm-gen-target-sparsity", "1"], None),
    (["--trtllm-gen-target-sparsity", "-0.1"], "target_sparsity=-0.1 is invalid"),
    (["--trtllm-gen-disabled-until-timestep", "1"], None),
    (["--trtllm-gen-disabled-until-timestep", "1.2"], "disabled_until_timestep=1.2 is invalid"),
    (["--frames", "1"], None), (["--frames", "2"], "--frames 2 is invalid"),
]


@pytest.mark.parametrize("argv, refused", GENERATE_RANGES, ids=[" ".join(a) for a, _ in GENERATE_RANGES])
def test_generates_range_arguments_at_their_boundaries(argv, refused, tmp_path, capsys, monkeypatch):
    argv = argv + ["--diffusion-attention-backend", "TORCH_REFERENCE", "--output", str(tmp_path / "fox.mp4")]
    reaches_the_work_or_stops_in_one_line("generate.py", "load_model", argv, refused, capsys, monkeypatch)


# --- the vLLM-Omni plugin's defaults with their variables unset ---------------------------------------------------

def test_the_plugin_collects_no_statistics_with_its_variable_unset(monkeypatch):
    from diffusers_trtllm.integrations.vllm_omni import COLLECT_STATS_ENV, install_on_pipeline

    monkeypatch.delenv(COLLECT_STATS_ENV, raising=False)
    handle = install_on_pipeline(tiny_wan(), AttentionConfig.coerce({"default": {"backend": "TORCH_REFERENCE"}}))
    try:
        assert handle.planner.collect_stats is False
    finally:
        handle.restore()
    monkeypatch.setenv(COLLECT_STATS_ENV, "yes")
    with install_on_pipeline(tiny_wan(), AttentionConfig()) as handle:
        assert handle.planner.collect_stats is True

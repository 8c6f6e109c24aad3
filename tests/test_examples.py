"""The examples and the step benchmark run end to end offline (tiny random pipelines on the CPU), and what they
write comes from the run: tables parsed back match the returned records, plots are real PNGs."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from helpers import load_script

from evaluation import (REFERENCE_LABEL, SAGE_ATTN_LABEL, LpipsScorer, VideoShape, compress_layer_names,
                                         format_number, psnr, sageattention_unavailable_reason, ssim)

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def markdown_rows(text: str, heading: str) -> list[dict[str, str]]:
    """The rows of the first table after the heading that starts with ``## heading``, keyed by header cells."""
    lines = text.split(f"## {heading}", 1)[1].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = []
    for line in lines[first:]:
        if not line.startswith("|"):
            break
        table.append([cell.strip() for cell in line.strip()[1:-1].split(" | ")])
    return [dict(zip(table[0], row)) for row in table[2:]]


# ------------------------------------------------------------------------------------------------ metrics


def test_psnr_and_ssim_of_identical_and_perturbed_videos():
    video = torch.rand(3, 3, 32, 40)
    assert psnr(video, video) == math.inf
    assert ssim(video, video) == pytest.approx(1.0)
    shifted = (video + 0.1).clamp(0, 1)
    mse = torch.mean((shifted.double() - video.double()) ** 2).item()
    assert psnr(shifted, video) == pytest.approx(10 * math.log10(1 / mse))
    noisy = (video + 0.2 * torch.randn_like(video)).clamp(0, 1)
    assert ssim(noisy, video) < ssim(shifted, video) < 1.0
    assert ssim(noisy, video) == pytest.approx(ssim(video, noisy))
    assert ssim(video[:, :, :6, :6], video[:, :, :6, :6]) == pytest.approx(1.0)  # smaller than the window


def test_lpips_says_why_when_it_cannot_load():
    scorer = LpipsScorer()
    video = torch.rand(2, 3, 64, 64)
    if scorer.unavailable is None:  # lpips installed with its weights: the reference scores 0 against itself
        assert scorer.score(video, video) == pytest.approx(0.0, abs=1e-6)
    else:
        assert "LPIPS" in scorer.unavailable and scorer.score(video, video) is None


def test_compress_layer_names():
    names = [f"transformer.blocks.{i}.attn1" for i in (0, 1, 2, 5)] + ["transformer_2.blocks.3.attn2", "norm"]
    assert compress_layer_names(names) == ["norm", "transformer.blocks.[0-2,5].attn1",
                                           "transformer_2.blocks.3.attn2"]


# ------------------------------------------------------------------------------------------------ evaluate.py


@pytest.fixture(scope="module")
def evaluation(tmp_path_factory):
    out = tmp_path_factory.mktemp("evaluate")
    result = load_script("examples/evaluate.py").main(
        ["--output-dir", str(out), "--steps", "2", "--gates", "1.0", "0.8", "--threshold", "0.5"])
    return out, result


def test_evaluate_tables_match_the_run(evaluation):
    out, result = evaluation
    records = {r.label: r for r in result["records"]}
    text = (out / "tables.md").read_text()
    rows = {row["config"]: row for row in markdown_rows(text, "Step 4")}
    assert set(rows) == set(records)
    reference = rows[REFERENCE_LABEL]
    assert reference["PSNR (dB) ↑"] == "inf" and reference["SSIM ↑"] == "1.0000"
    assert reference["speed-up (transformer)"] == "1.000×"
    if result["lpips_unavailable"] is None:
        assert reference["LPIPS ↓"] == "0.0000"
    else:
        assert reference["LPIPS ↓"] == "n/a" and result["lpips_unavailable"] in text
    measured = [r for r in records.values() if r.run_s is not None]
    assert len(measured) == 7  # reference, dense, SAGE, 2 × skip, 2 × SAGE + skip
    for record in measured:
        row = rows[record.label]
        assert record.transformer_calls > 0
        if record.label == REFERENCE_LABEL:
            assert record.speedup_transformer == 1.0 and record.speedup_run == 1.0
        else:  # TORCH_REFERENCE's time is not a kernel's: no speed-up printed, and the row says why
            assert record.speedup_transformer is None and record.speedup_run is None
            assert row["speed-up (transformer)"] == "n/a" and "TORCH_REFERENCE" in row["notes"]
            assert record.label.startswith("TORCH_REFERENCE ")  # not labelled as trtllm-gen BF16
        assert row["speed-up (transformer)"] == format_number(record.speedup_transformer, 3, "×")
        assert row["speed-up (run)"] == format_number(record.speedup_run, 3, "×")
        assert row["transformer (s)"] == format_number(record.transformer_s, 3)
        assert row["PSNR (dB) ↑"] == format_number(record.psnr, 2)
        assert row["SSIM ↑"] == format_number(record.ssim, 4)
        assert row["sparsity"] == (format_number(record.sparsity, 3) if record.skipped else "off")
        if record.label != REFERENCE_LABEL:
            assert "TORCH_REFERENCE" in row["ran on"]  # the CPU runs the TRT-LLM configurations on the reference
    assert records["TORCH_REFERENCE FP8-SAGE"].psnr < math.inf  # quantization changes the video
    assert all(records[label].sparsity is None and rows[label]["sparsity"] == "off"
               for label in ("TORCH_REFERENCE FP32 dense", "TORCH_REFERENCE FP8-SAGE"))  # no Skip-Softmax ran
    # the plan's Step 2 lists the D sweep
    assert [row["D"] for row in markdown_rows(text, "Step 2")] == ["1.00", "0.80"]
    peer = rows[SAGE_ATTN_LABEL]
    reason = sageattention_unavailable_reason("cpu")
    assert reason and peer["notes"].startswith("not run:") and peer["PSNR (dB) ↑"] == "n/a"


def test_evaluate_json_and_plots(evaluation):
    out, result = evaluation
    data = json.loads((out / "results.json").read_text())
    assert [r["label"] for r in data["results"]] == [r.label for r in result["records"]]
    for saved, record in zip(data["results"], result["records"]):
        assert saved["speedup_transformer"] == record.speedup_transformer
        assert saved["sparsity"] == record.sparsity
    assert data["results"][0]["psnr"] == "inf"
    for name, path in result["paths"].items():
        if name.endswith("plot"):
            assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 5000
    counted = any(r.sparsity for r in result["records"])
    assert ("sparsity_plot" in result["paths"]) == counted
    # the gate keeps step 0 (t = 1) dense at D = 0.8, not step 1 (t = 0.75): its what-ran section says so
    text = (out / "tables.md").read_text()
    gated = text.split("### TORCH_REFERENCE Skip D=0.80", 1)[1].split("###", 1)[0]
    assert "| 0 | TORCH_REFERENCE:dense |" in gated and "TORCH_REFERENCE:skip" in gated


# ------------------------------------------------------------------------------------------------ generate.py


def test_generate_with_environment_config(tmp_path, monkeypatch, capsys):
    config = {"default": {"backend": "TORCH_REFERENCE", "quant": {"dtype_qk": "int8"},
                          "skip_softmax": {"threshold": 0.5, "disabled_until_timestep": 0.9}},
              "per_role": {"cross": {"backend": "TORCH_SDPA"}}}
    monkeypatch.setenv("DIFFUSION_ATTENTION_CONFIG", json.dumps(config))
    output = tmp_path / "fox.mp4"
    result = load_script("examples/generate.py").main(["--steps", "2", "--output", str(output)])
    assert output.stat().st_size > 0
    printed = capsys.readouterr().out
    assert result["plan"] in printed
    # step 0 (t = 1 > D, high-noise expert) is SAGE only, step 1 (t = 0.75, low-noise expert) SAGE + skip;
    # cross-attention stays on TORCH_SDPA
    assert "| 0 | TORCH_REFERENCE:sage-int8 | transformer.blocks.[0-1].attn1 |" in printed
    assert "| 1 | TORCH_REFERENCE:sage-int8+skip | transformer_2.blocks.[0-1].attn1 |" in printed
    assert "TORCH_SDPA:dense | transformer.blocks.[0-1].attn2" in printed
    assert sorted(result["summary"]["per_step"]) == [0, 1]
    assert result["transformer_seconds"] > 0
    # the gated step says so; the overall figure says it covers only what skipped; features ran, so no note
    assert "sparsity per step, over the layers that ran Skip-Softmax in it" in printed and "0: off, 1: " in printed
    assert "overall sparsity, over the calls that ran Skip-Softmax" in printed
    assert "no feature of diffusers_trtllm ran" not in printed


def test_generate_with_its_defaults_on_a_cpu_says_no_feature_of_the_package_ran(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("DIFFUSION_ATTENTION_CONFIG", raising=False)
    load_script("examples/generate.py").main(["--steps", "1", "--output", str(tmp_path / "fox.mp4")])
    printed = capsys.readouterr().out
    assert "every attention call ran dense on TORCH_SDPA" in printed and "no feature of diffusers_trtllm ran" in printed
    assert "overall sparsity" not in printed


def docstring_target(script: str) -> float:
    """The --trtllm-gen-target-sparsity value the script's docstring (its --help) shows for the calibrate story."""
    text = load_script(f"examples/{script}").__doc__
    return float(re.search(r"--model calibrated_tiny .*?--trtllm-gen-target-sparsity ([0-9.]+)", text, re.S).group(1))


@pytest.mark.slow
def test_calibrate_then_generate_tells_one_story(tmp_path, monkeypatch, capsys):
    """calibrate.py with its defaults ends with the generate.py command to run: one target, inside the sparsity
    every expert reached, the one both scripts' --help show and the checkpoint suggests; that command loads the
    folder at the calibrated shape without an extrapolation warning, says which curves it read, and the
    low-noise expert lands near the target. diffusers does not warn that the curve "will be ignored"."""
    from diffusers_trtllm.calibration.checkpoint import CONFIG_KEY

    monkeypatch.chdir(tmp_path)
    calibration = load_script("examples/calibrate.py").main([])
    assert Path("calibrated_tiny/calibration.png").read_bytes()[:8] == PNG_MAGIC
    command = capsys.readouterr().out.strip().splitlines()[-1]
    prefix = "python examples/generate.py --model calibrated_tiny --diffusion-attention-backend TORCH_REFERENCE "
    assert command.startswith(prefix + "--trtllm-gen-target-sparsity "), command
    target = float(command.split()[-1])
    assert target == docstring_target("calibrate.py") == docstring_target("generate.py")
    for fit in calibration.fits.values():
        low, high = fit.observed_range
        assert low <= target <= high and fit.calibration.target_sparsity == target

    warnings_seen = []
    config_logger = logging.getLogger("diffusers.configuration_utils")
    handler = logging.Handler()
    handler.emit = lambda record: warnings_seen.append(record.getMessage())
    config_logger.addHandler(handler)
    try:
        with warnings.catch_warnings():
            # outside the observed range the curve would warn that it extrapolates
            warnings.filterwarnings("error", message=r"skip_softmax\.target_sparsity=.* lies outside")
            sparse = load_script("examples/generate.py").main(command.split()[2:] + ["--steps", "2"])
    finally:
        config_logger.removeHandler(handler)
    assert not [message for message in warnings_seen if CONFIG_KEY in message]
    printed = capsys.readouterr().out
    assert sparse["shape"] == VideoShape(256, 448, 9, 2)  # the calibrated shape, read back (steps overridden)
    assert ("Skip-Softmax calibration loaded from calibrated_tiny (calibrated at 256×448, 9 frames, 4 steps):"
            in printed)
    for component, fit in calibration.fits.items():
        curve = fit.calibration
        assert (f"  {component}: factor = a·exp(b·s), a = {curve.a:.4g}, b = {curve.b:.4g}, observed sparsity "
                f"{curve.sparsity_range[0]:.2f}–{curve.sparsity_range[1]:.2f}, suggests target_sparsity {target:g}"
                in printed)
    # the last step runs on transformer_2, sparse: the curve puts it near the target
    last = max(sparse["summary"]["per_step"])
    skipping = [value for layer, value in sparse["summary"]["per_layer"].items()
                if layer.startswith("transformer_2.") and layer.endswith("attn1")]
    assert skipping and all(abs(value - target) < 0.15 for value in skipping), (target, skipping)
    assert f"| {last} | TORCH_REFERENCE:skip | transformer_2.blocks.[0-1].attn1 |" in printed


def fake_result(*ranges):
    from diffusers_trtllm import CalibrationResult
    from diffusers_trtllm.calibration.curve import SkipCalibration
    from diffusers_trtllm.calibration.fit import ComponentFit

    return CalibrationResult({f"c{i}": ComponentFit(SkipCalibration(1.0, 5.0, sparsity_range=r), [], 1.0, ())
                              for i, r in enumerate(ranges)})


@pytest.mark.parametrize("ranges,target", [
    ([(0.103, 0.450), (0.103, 0.446)], 0.3),  # the middle, 0.2745, at one decimal
    ([(0.31, 0.34)], 0.33),  # the middle, 0.325, is 0.3 at one decimal (outside), 0.33 at two
    ([(0.1, 0.5), (0.45, 0.9)], 0.5),
    ([(0.1, 0.2), (0.3, 0.4)], None),  # no common range: no single target
])
def test_calibrate_suggests_a_target_inside_every_observed_range(ranges, target):
    suggested = load_script("examples/calibrate.py").suggested_target(fake_result(*ranges))
    assert suggested == (pytest.approx(target) if target is not None else None)
    if suggested is not None:
        assert all(low <= suggested <= high for low, high in ranges)


# ------------------------------------------------------------------------------------------------ benchmark


def test_transformer_step_benchmark_runs_standalone(tmp_path):
    output = tmp_path / "step.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "benchmarks/transformer_step.py", "--tiny", "--configs", "sdpa", "cudnn",
                           "dense", "skip", "sage", "none", "--lambdas", "0.5", "--output", str(output)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(output.read_text())
    assert {res["model"] for res in data["results"]} >= {"Wan 2.2 A14B"}
    for res in data["results"]:
        rows = {row["label"]: row for row in res.get("rows", [])}
        if "skipped" in res:
            continue
        assert rows["TORCH_SDPA cuDNN"]["error"].startswith("not run")
        timed = [row for row in rows.values() if row["ms"] is not None]
        assert len(timed) == 6 and all(row["ms"] > 0 and row["vs_sdpa"] > 0 for row in timed)
        assert rows["TORCH_SDPA"]["vs_sdpa"] == 1.0
        assert "attention_share_sdpa" in res
        assert f"| TORCH_REFERENCE skip λ=0.5 | {rows['TORCH_REFERENCE skip λ=0.5']['ms']:.1f} |" in proc.stdout


def test_transformer_step_reports_the_tiles_skipped_and_reused(tmp_path, monkeypatch):
    """Skip rows report the share of tiles skipped at a run's second step, reuse rows the share reused too;
    the tiny Wan's self-attention made positional (constant q and k: scores follow RoPE) so that far tiles skip."""
    benchmark = load_script("benchmarks/transformer_step.py")
    build = benchmark.build_transformer

    def positional(*args):
        model = build(*args)
        for block in model.blocks:
            for projection in (block.attn1.to_q, block.attn1.to_k):
                projection.weight.data.zero_()
                projection.bias.data.fill_(1.0)
            block.attn1.norm_q.weight.data.fill_(3.0)
            block.attn1.norm_k.weight.data.fill_(3.0)
        return model

    monkeypatch.setattr(benchmark, "build_transformer", positional)
    result = benchmark.main(["--tiny", "--models", "wan", "--frames", "33", "--configs", "sdpa", "skip", "sage_reuse",
                             "sage_reuse_untested", "--lambdas", "0.5", "--output", str(tmp_path / "step.json")])
    sdpa, skip, reuse, untested = result["results"][0]["rows"]
    assert sdpa["sparsity"] is None and sdpa["reused"] is None
    assert 0.2 < skip["sparsity"] < 0.9 and not skip["reused"]
    assert 0.2 < reuse["reused"] <= reuse["sparsity"] < 0.9
    # reusing calls that test nothing skip only what the first call's test skipped
    assert untested["label"].endswith("+ reuse untested") and 0.2 < untested["reused"] == untested["sparsity"]
    assert f"| {skip['sparsity']:.3f} |" in result["markdown"]
    assert f"| {reuse['sparsity']:.3f} ({reuse['reused']:.3f}) |" in result["markdown"]


def test_transformer_step_benchmark_records_a_failing_configuration(tmp_path, monkeypatch):
    benchmark = load_script("benchmarks/transformer_step.py")

    def broken():
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(benchmark, "no_attention", broken)
    result = benchmark.main(["--tiny", "--models", "wan", "--configs", "sdpa", "none", "--output",
                             str(tmp_path / "step.json")])
    rows = {row["label"]: row for row in result["results"][0]["rows"]}
    assert rows["attention removed"]["error"] == "RuntimeError: kernel exploded"
    assert rows["TORCH_SDPA"]["ms"] > 0
    assert "RuntimeError: kernel exploded" in result["markdown"]


def test_host_cost_benchmark_runs_and_compares_with_diffusers(tmp_path):
    rows = load_script("benchmarks/host_cost.py").main(["--calls", "5", "--repeats", "1", "--json",
                                                         str(tmp_path / "host.json")])
    assert {r["case"].split(":")[0] for r in rows} == {"module", "function"}
    assert all(r["us_per_call"] > 0 for r in rows) and rows[0]["vs_diffusers"] == 1.0

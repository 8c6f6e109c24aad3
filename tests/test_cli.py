"""The command line as a user meets it: every flag, shape, model or configuration mistake in the example scripts is
one line on stderr with exit status 2, found before any expensive work; the shape rules against the pipelines
themselves; the --trtllm-gen-* shortcut rules and the flag or variable their errors name; the Python API's errors
for the same mistakes."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import load_script, tiny_wan, wan_inputs
from test_hunyuan_video15 import transformer_inputs

from evaluation import MODELS, ModelLoadError, ShapeRule, resolve_model, shape_rule_of

from diffusers_trtllm import (AttentionConfig, AttentionConfigError, AttentionSpec, AttnQuantSpec,
                              BackendUnavailableError, HunyuanVideo15TrtllmAttnProcessor, SkipSoftmaxSpec,
                              WanTrtllmAttnProcessor, add_attention_args, config_from_args)
from diffusers_trtllm.backends.base import TRTLLM_ON_REFERENCE_ENV
from diffusers_trtllm import tiny_pipelines
from diffusers_trtllm.tiny_pipelines import tiny_hunyuan_video15_transformer

ROOT = Path(__file__).resolve().parents[1]
NO_GPU = "TRTLLM_ATTN and --device cuda run on this GPU: nothing to refuse"
GPU_MESSAGE = "TRTLLM_ATTN needs an NVIDIA sm_90 (H100/H200), sm_100 or sm_103 (B200/B300) GPU and none was found"


def run_script(script: str, *argv: str, tmp_path: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run an example as a user would (this checkout's package), offline, with an empty model cache; ``env``
    adds environment variables."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("DIFFUSION_ATTENTION_", "TRTLLM_GEN_"))}
    environ.pop(TRTLLM_ON_REFERENCE_ENV, None)
    environ.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"),
                   PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
                   **(env or {}))
    env = environ
    return subprocess.run([sys.executable, str(ROOT / "examples" / script), *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


def run_in_process(script: str, *argv: str, capsys) -> subprocess.CompletedProcess:
    """The same through the script's ``main`` (no interpreter start-up: most cases are tested this way)."""
    with pytest.raises(SystemExit) as exited:
        load_script(f"examples/{script}").main(list(argv))
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(argv, exited.value.code, captured.out, captured.err)


def assert_one_line_error(proc: subprocess.CompletedProcess, script: str, *fragments: str) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and ": error: " in lines[0], proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0]
    assert proc.stdout == ""  # refused before anything ran (no video, no reference row)
    return lines[0]


@pytest.fixture
def clean_environment(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("DIFFUSION_ATTENTION_", "TRTLLM_GEN_")) or name == TRTLLM_ON_REFERENCE_ENV:
            monkeypatch.delenv(name)


# Interpreter runs: what a user sees, stderr and exit status included.
@pytest.mark.parametrize("script,argv,fragments", [
    ("generate.py", ["--steps", "0"], ["--steps: 0 is invalid: expected an integer >= 1"]),
    ("generate.py", ["--diffusion-attention-config", '{"default": {"backend": "nope"}}'],
     ["backend='nope' is invalid", "TORCH_REFERENCE"]),
    ("generate.py", ["--model", "Wan-AI/Wan2.2-T2V-A14B-Diffusers"],
     ["cannot load 'Wan-AI/Wan2.2-T2V-A14B-Diffusers' with WanPipeline"]),
    # context parallelism: its defaults split over one process (diffusers would raise), or no torchrun started it
    ("context_parallel.py", [], ["--ring 1 × --ulysses 1 splits the call over one process", "torchrun"]),
    ("context_parallel.py", ["--ring", "2"], ["--ring 2 × --ulysses 1 must equal the processes torchrun starts "
                                              "(WORLD_SIZE=unset)"]),
    ("context_parallel.py", ["--ulysses", "0"], ["--ulysses: 0 is invalid: expected an integer >= 1"]),
])
def test_a_mistake_is_one_line_on_stderr_and_exit_status_2(tmp_path, script, argv, fragments):
    line = assert_one_line_error(run_script(script, *argv, tmp_path=tmp_path), script, *fragments)
    assert line.startswith(f"{script}: error: ")


WAN_HEIGHT = ("--height 100 is invalid for Wan 2.2 A14B: expected a multiple of 16 (VAE compression 8 × patch 2), e.g. "
              "96 or 112")
WAN_WIDTH = "--width 8 is invalid for Wan 2.2 A14B: expected a multiple of 16 (VAE compression 8 × patch 2), e.g. 16"
WAN_FRAMES = "--frames 6 is invalid for Wan 2.2 A14B: expected 1 + a multiple of 4"


# Interpreter runs of the refusals the examples make before any model is built (diffusers would otherwise print
# a traceback, or round the size or frame count without a word).
@pytest.mark.parametrize("script,argv,env,fragments", [
    *[(script, ["--height", "100"], {}, [WAN_HEIGHT]) for script in ("demo.py", "generate.py", "evaluate.py",
                                                                     "calibrate.py")],
    ("generate.py", ["--width", "8"], {}, [WAN_WIDTH]),
    ("demo.py", ["--frames", "6"], {}, [WAN_FRAMES, "e.g. 5 or 9"]),
    ("generate.py", ["--model", "./calibrated_tiny"], {}, ["--model ./calibrated_tiny: no such folder"]),
    ("generate.py", ["--model", "calibrated_tiny"], {},
     ["unknown model 'calibrated_tiny', and no folder of that name"]),
    ("generate.py", [], {"DIFFUSION_ATTENTION_BACKEND": "bogus"},
     ["DIFFUSION_ATTENTION_BACKEND (environment variable): backend='bogus' is invalid: expected one of"]),
    ("evaluate.py", ["--target-sparsity", "0.5"], {},
     ["skip_softmax.target_sparsity=0.5 applies to transformer.", "'transformer' has no Skip-Softmax calibration"]),
])
def test_a_shape_model_or_variable_the_example_cannot_take_is_one_line_before_any_work(tmp_path, script, argv, env,
                                                                                        fragments):
    assert_one_line_error(run_script(script, *argv, tmp_path=tmp_path, env=env), script, *fragments)
    assert not any(tmp_path.iterdir()) or [p.name for p in tmp_path.iterdir()] == ["hf_home"]  # nothing written


def test_example_warnings_show_no_library_file(tmp_path):
    """A warning raised inside the package (λ >= 1 here, while the demo builds its configurations) prints as
    'Category: message', without the package's file and source line."""
    proc = run_script("demo.py", "--threshold", "1.5", "--height", "100", tmp_path=tmp_path)
    warning, error = proc.stderr.strip().splitlines()
    assert warning.startswith("UserWarning: skip_softmax.threshold=1.5 >= 1 skips nearly every KV tile")
    assert ".py" not in warning and str(ROOT) not in proc.stderr
    assert error.startswith("demo.py: error: --height 100") and proc.returncode == 2


@pytest.mark.parametrize("script", ["demo.py", "generate.py", "evaluate.py", "calibrate.py"])
@pytest.mark.parametrize("argv,fragment", [
    (["--width", "8"], WAN_WIDTH), (["--height", "100"], WAN_HEIGHT), (["--frames", "6"], WAN_FRAMES),
    (["--frames", "8"], "--frames 8 is invalid for Wan 2.2 A14B"),
])
def test_every_example_refuses_what_wan_cannot_take(clean_environment, capsys, script, argv, fragment):
    assert_one_line_error(run_in_process(script, *argv, capsys=capsys), script, fragment)


@pytest.mark.parametrize("script,argv,fragments", [
    ("generate.py", ["--model", "hunyuan", "--tiny", "--height", "136"],
     ["--height 136 is invalid for HunyuanVideo 1.5: expected a multiple of 16 (VAE compression 16 × patch 1), "
      "e.g. 128 or 144"]),
    ("demo.py", ["--model", "cosmos", "--width", "132"],
     ["--width 132 is invalid for Cosmos 3 Super: expected a multiple of 8", "e.g. 128 or 136"]),
    ("evaluate.py", ["--model", "cosmos", "--tiny", "--frames", "7"], ["--frames 7 is invalid for Cosmos 3 Super"]),
    ("evaluate.py", ["--source", "./missing"], ["--source ./missing: no such folder"]),
    ("evaluate.py", ["--source", "a/b/c", "--model", "wan"], ["--source a/b/c: no such folder"]),
    ("calibrate.py", ["--model", "~/missing"], ["--model ~/missing: no such folder"]),
    ("calibrate.py", ["--model", "no-such-model"], ["unknown model 'no-such-model'"]),
])
def test_other_models_rules_and_missing_folders_are_refused(clean_environment, capsys, script, argv, fragments):
    assert_one_line_error(run_in_process(script, *argv, capsys=capsys), script, *fragments)


def test_the_model_table_states_the_rule_each_pipeline_has():
    """The rule checked before loading is the one derived from the built pipeline (VAE scale factor × patch
    size), for every model's tiny pipeline, and for the real Wan and HunyuanVideo configurations of the speed
    run."""
    for entry in MODELS.values():
        assert shape_rule_of(getattr(tiny_pipelines, entry.tiny_builder)()) == entry.shape_rule, entry.name
        if entry.speed is not None and entry.transformer_class != "Cosmos3OmniTransformer":  # tiny VAE 8×, real 16×
            (vae_temporal, vae_spatial), (patch_t, patch_h, _) = entry.speed.vae_scale, entry.speed.patch
            assert entry.shape_rule == ShapeRule(vae_spatial, patch_h, vae_temporal, patch_t), entry.name


@pytest.mark.parametrize("height,width,frames,ok", [
    (720, 1280, 81, True), (16, 16, 1, True), (None, None, None, True), (720, 1280, 5, True),
    (728, 1280, 81, False), (720, 1288, 81, False), (720, 1280, 80, False), (720, 1280, 82, False),
])
def test_shape_rule_edges(height, width, frames, ok):
    problem = MODELS["Wan-AI/Wan2.2-T2V-A14B-Diffusers"].shape_rule.problem("Wan", height, width, frames)
    assert (problem is None) == ok, problem


def test_a_model_argument_is_a_folder_a_known_model_or_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    wan = MODELS["Wan-AI/Wan2.2-T2V-A14B-Diffusers"]
    assert resolve_model(None) == (wan, None) and resolve_model("WAN") == (wan, None)
    folder = tmp_path / "pipe"
    folder.mkdir()
    with pytest.raises(ModelLoadError, match="'pipe' is not a pipeline folder: it has no model_index.json"):
        resolve_model("pipe")
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "HunyuanVideo15Pipeline"}))
    assert resolve_model("pipe") == (MODELS["hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_t2v"], Path("pipe"))
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    with pytest.raises(ModelLoadError, match="holds a FluxPipeline, none of the evaluated pipelines"):
        resolve_model("pipe")
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(ModelLoadError, match="--source notes.txt: a file, not a pipeline folder or model id"):
        resolve_model("notes.txt", "--source")
    for path in ("./x", "../x", "/x", "~/x", "x/", "a/b/c", "a\\b"):
        with pytest.raises(ModelLoadError, match=r": no such folder$"):
            resolve_model(path)
    with pytest.raises(ModelLoadError, match="unknown model 'org/name', and no folder of that name here"):
        resolve_model("org/name")  # a Hub id's shape: not known, and not a folder either


@pytest.mark.skipif(torch.cuda.is_available(), reason=NO_GPU)
def test_trtllm_attn_on_a_cpu_is_refused_before_the_demo_computes_anything(tmp_path):
    line = assert_one_line_error(run_script("demo.py", "--backend", "TRTLLM_ATTN", tmp_path=tmp_path), "demo.py",
                                 GPU_MESSAGE)
    assert "head_dim" not in line


@pytest.mark.parametrize("script,argv,fragments", [
    ("demo.py", ["--frames", "-1"], ["--frames: -1 is invalid"]),
    ("calibrate.py", ["--steps", "0"], ["--steps: 0 is invalid"]),
    ("generate.py", ["--diffusion-attention-backend", "auto", "--trtllm-gen-target-sparsity", "2"],
     ["skip_softmax.target_sparsity=2.0 is invalid: expected a finite number in [0, 1]"]),
    ("generate.py", ["--diffusion-attention-backend", "TORCH_SDPA", "--trtllm-gen-sage"],
     ["--trtllm-gen-sage needs a backend with Skip-Softmax and SAGE", "the backend is TORCH_SDPA"]),
    ("demo.py", ["--threshold", "-1"], ["skip_softmax.threshold=-1.0 is invalid"]),
    ("evaluate.py", ["--backend", "bogus"], ["backend='bogus' is invalid"]),
    ("calibrate.py", ["--target-sparsity", "1.5"], ["skip_softmax.target_sparsity=1.5 is invalid"]),
    ("calibrate.py", ["--lambda-min", "0"], ["--lambda-min 0 / --lambda-max 1 are invalid"]),
    ("calibrate.py", ["--reuse-steps", "-1"], ["--reuse-steps -1 is invalid: expected an int >= 0"]),
    ("demo.py", ["--model", "no-such-model"], ["unknown model 'no-such-model'", "Wan-AI/Wan2.2-T2V-A14B-Diffusers"]),
])
def test_configuration_mistakes_are_refused_in_one_line(clean_environment, capsys, script, argv, fragments):
    assert_one_line_error(run_in_process(script, *argv, capsys=capsys), script, *fragments)


@pytest.mark.skipif(torch.cuda.is_available(), reason=NO_GPU)
@pytest.mark.parametrize("script,argv,fragments", [
    ("generate.py", ["--diffusion-attention-backend", "TRTLLM_ATTN"], [GPU_MESSAGE]),
    ("generate.py", ["--diffusion-attention-config", '{"per_role": {"self": {"backend": "trtllm-gen"}}}'],
     [GPU_MESSAGE]),
    ("evaluate.py", ["--backend", "TRTLLM_ATTN"], [GPU_MESSAGE]),
    ("generate.py", ["--device", "cuda"], ["--device cuda", "sees no CUDA GPU"]),
    ("demo.py", ["--device", "cuda:0"], ["--device cuda:0", "sees no CUDA GPU"]),
])
def test_what_this_machine_cannot_run_is_refused_in_one_line(clean_environment, capsys, script, argv, fragments):
    assert_one_line_error(run_in_process(script, *argv, capsys=capsys), script, *fragments)


# ------------------------------------------------------------------------------------------- shortcut flags


def shortcut_config(argv, environ=None) -> AttentionSpec:
    args = add_attention_args(argparse.ArgumentParser()).parse_args(argv)
    return config_from_args(args, environ or {}).default


SAGE = AttnQuantSpec("fp8_e4m3")


@pytest.mark.parametrize("arch,kernel,blocks", [("sm_90", "FMHAv2", (64, 0)), ("sm_100", "trtllm-gen", (1, 16)),
                                               (None, None, (1, 16))])
def test_trtllm_gen_sage_runs_the_gpus_fastest_fp8_kernel_and_says_which(arch, kernel, blocks, monkeypatch, caplog):
    """The flag gives no block sizes: Hopper runs FMHAv2's warp-specialized SAGE kernel (Q block 64, one K scale
    per sequence and head), Blackwell trtllm-gen, a machine without either the reference's portable blocks; the
    GPU's choice is logged once."""
    from diffusers_trtllm.backends import trtllm

    quant = shortcut_config(["--trtllm-gen-sage"]).quant
    monkeypatch.setattr(trtllm, "gpu_arch", lambda device: arch)
    trtllm._log_choice.cache_clear()
    with caplog.at_level("WARNING", logger="diffusers_trtllm"):
        semantics = trtllm.sage_semantics(quant, "cuda")
        trtllm.sage_semantics(quant, "cuda")
    assert (semantics.dtype_qk, semantics.q_block, semantics.k_block) == ("fp8_e4m3", *blocks)
    logged = [r.getMessage() for r in caplog.records if "unset block sizes" in r.getMessage()]
    assert len(logged) == (1 if kernel else 0) and all(kernel in m for m in logged)


def test_shortcuts_without_a_backend_imply_trtllm_attn():
    assert shortcut_config(["--trtllm-gen-sage"]) == AttentionSpec("TRTLLM_ATTN", quant=SAGE)
    assert shortcut_config([], {"TRTLLM_GEN_TARGET_SPARSITY": "0.5"}) == AttentionSpec(
        "TRTLLM_ATTN", skip_softmax=SkipSoftmaxSpec(target_sparsity=0.5))


@pytest.mark.parametrize("backend", ["auto", "TORCH_REFERENCE", "trtllm-gen"])
def test_shortcuts_apply_to_an_explicit_backend_that_has_the_feature(backend):
    expected = AttentionSpec(backend, quant=SAGE,
                             skip_softmax=SkipSoftmaxSpec(target_sparsity=0.4, disabled_until_timestep=0.86))
    argv = ["--trtllm-gen-sage", "--trtllm-gen-target-sparsity", "0.4", "--trtllm-gen-disabled-until-timestep",
            "0.86"]
    assert shortcut_config(["--diffusion-attention-backend", backend, *argv]) == expected
    assert shortcut_config(argv, {"DIFFUSION_ATTENTION_BACKEND": backend}) == expected
    config = f'{{"default": {{"backend": "{backend}"}}}}'
    assert shortcut_config(["--diffusion-attention-config", config, *argv]) == expected


@pytest.mark.parametrize("argv,environ,named", [
    ([], {"DIFFUSION_ATTENTION_BACKEND": "bogus"}, "DIFFUSION_ATTENTION_BACKEND (environment variable): backend="),
    (["--diffusion-attention-backend", "bogus"], {}, "--diffusion-attention-backend: backend='bogus' is invalid"),
    ([], {"DIFFUSION_ATTENTION_CONFIG": "{bad"}, "DIFFUSION_ATTENTION_CONFIG (environment variable): attention "
                                                 "config is not valid JSON"),
    (["--diffusion-attention-config", '{"default": {"backend": "nope"}}'], {},
     "--diffusion-attention-config: backend='nope' is invalid"),
    ([], {"TRTLLM_GEN_TARGET_SPARSITY": "2"}, "TRTLLM_GEN_TARGET_SPARSITY (environment variable): "
                                              "skip_softmax.target_sparsity=2.0 is invalid"),
    (["--trtllm-gen-disabled-until-timestep", "-1"], {}, "--trtllm-gen-disabled-until-timestep: "
                                                         "skip_softmax.disabled_until_timestep=-1.0 is invalid"),
])
def test_an_invalid_value_names_the_flag_or_variable_it_came_from(argv, environ, named):
    with pytest.raises(AttentionConfigError) as raised:
        shortcut_config(argv, environ)
    assert str(raised.value).startswith(named), raised.value


def test_shortcuts_refuse_torch_sdpa():
    with pytest.raises(AttentionConfigError, match=r"--trtllm-gen-sage, --trtllm-gen-disabled-until-timestep need "
                                                   r"a backend .* the backend is TORCH_SDPA"):
        shortcut_config(["--diffusion-attention-backend", "TORCH_SDPA", "--trtllm-gen-sage",
                         "--trtllm-gen-disabled-until-timestep", "0.9"])


# ------------------------------------------------------------------------------------------- Python API


@pytest.mark.skipif(torch.cuda.is_available(), reason=NO_GPU)
def test_trtllm_attn_on_a_cpu_names_the_missing_gpu(monkeypatch):
    monkeypatch.delenv(TRTLLM_ON_REFERENCE_ENV, raising=False)
    model = tiny_wan()  # head_dim 16 as well: the missing GPU is what the error must name
    model.set_attn_processor(WanTrtllmAttnProcessor({"default": {"backend": "TRTLLM_ATTN"}}))
    with pytest.raises(BackendUnavailableError, match="needs an NVIDIA sm_90.*none was found"):
        model(**wan_inputs(batch=1))


def test_a_processor_of_another_model_is_refused_by_name():
    wan = tiny_wan()
    wan.set_attn_processor(HunyuanVideo15TrtllmAttnProcessor(AttentionConfig()))
    with pytest.raises(TypeError, match=r"HunyuanVideo15TrtllmAttnProcessor is made for HunyuanVideo15Transformer3DModel"
                                        r".* called on a WanAttention; its processor is WanTrtllmAttnProcessor"):
        wan(**wan_inputs(batch=1))
    hunyuan = tiny_hunyuan_video15_transformer()
    hunyuan.set_attn_processor(WanTrtllmAttnProcessor(AttentionConfig()))
    with pytest.raises(TypeError, match=r"WanTrtllmAttnProcessor is made for WanTransformer3DModel.* called on an? "
                                        r"Attention"):
        hunyuan(**transformer_inputs())


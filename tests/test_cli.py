"""The command line as a user meets it: every flag or configuration mistake in the example scripts is one line on
stderr with exit status 2, found before any expensive work; the --trtllm-gen-* shortcut rules; the Python API's
errors for the same mistakes."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import load_script, tiny_wan, wan_inputs
from test_hunyuan_video15 import transformer_inputs

from diffusers_trtllm import (AttentionConfig, AttentionConfigError, AttentionSpec, AttnQuantSpec,
                              BackendUnavailableError, HunyuanVideo15TrtllmAttnProcessor, SkipSoftmaxSpec,
                              WanTrtllmAttnProcessor, add_attention_args, config_from_args)
from diffusers_trtllm.backends.base import TRTLLM_ON_REFERENCE_ENV
from diffusers_trtllm.tiny_pipelines import tiny_hunyuan_video15_transformer

ROOT = Path(__file__).resolve().parents[1]
NO_GPU = "TRTLLM_ATTN and --device cuda run on this GPU: nothing to refuse"
GPU_MESSAGE = "TRTLLM_ATTN needs an NVIDIA sm_90 (H100/H200), sm_100 or sm_103 (B200/B300) GPU and none was found"


def run_script(script: str, *argv: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run an example as a user would (this checkout's package), offline, with an empty model cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DIFFUSION_ATTENTION_", "TRTLLM_GEN_"))}
    env.pop(TRTLLM_ON_REFERENCE_ENV, None)
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"),
               PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
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
])
def test_a_mistake_is_one_line_on_stderr_and_exit_status_2(tmp_path, script, argv, fragments):
    line = assert_one_line_error(run_script(script, *argv, tmp_path=tmp_path), script, *fragments)
    assert line.startswith(f"{script}: error: ")


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


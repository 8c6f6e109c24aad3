"""``benchmarks/video_seconds.py``: the seconds-per-video benchmark runs its whole path on the tiny pipelines (CPU),
its phases and scaling add up, diffusers' backends that refuse the model's attention become rows saying why, the
full-size pipelines are built at their real sizes without downloads (on the meta device here), and bad arguments
are one line and exit status 2."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import load_script

bench = load_script("benchmarks/video_seconds.py")
SMALL = ("--height", "64", "--width", "64", "--frames", "5")  # smaller than the tiny default: seconds on a CPU


def rows_by_label(result):
    return {row["label"]: row for row in result["rows"]}


def test_wan_tiny_video_phases_add_up(tmp_path):
    output = tmp_path / "wan.json"
    result = bench.main(["--tiny", "--model", "wan", "--steps", "2", "--configs", "diffusers", "dense", "sage_skip",
                         "--threshold", "0.5", "--compile", "eager", *SMALL, "--json", str(output)])
    rows = rows_by_label(result)
    assert list(rows) == ["diffusers default processors", "TORCH_REFERENCE dense",
                          "TORCH_REFERENCE SAGE fp8 + skip λ=0.5"]
    first, *later = rows.values()
    assert not first["decode_shared"] and first["decode_s"] > 0
    for row in rows.values():
        assert row["error"] == "" and row["steps_run"] == 2
        assert row["transformer_calls"] == 4  # 2 steps × CFG (cond, uncond)
        assert row["text_s"] > 0 and row["warmup_s"] > 0
        assert row["per_step_s"] == pytest.approx(row["denoise_s"] / 2)
        assert row["per_call_s"] * row["transformer_calls"] <= row["denoise_s"]  # the calls lie inside denoising
        assert row["video_s"] == pytest.approx(row["text_s"] + 40 * row["per_step_s"] + row["decode_s"])
    for row in later:
        assert row["decode_shared"] and row["decode_s"] == first["decode_s"]
    assert first["vs_best_diffusers"] == 1.0
    for row in later:
        assert row["vs_best_diffusers"] == pytest.approx(first["video_s"] / row["video_s"])
    assert json.loads(output.read_text())["rows"] == result["rows"]
    assert output.with_suffix(".md").read_text() == result["markdown"]
    assert "40 steps (2 run, denoising scaled ×20)" in result["markdown"]
    assert f"| {first['decode_s']:.1f}* |" in result["markdown"]


def test_hunyuan_tiny_backends_refusing_its_mask_are_rows_saying_why(tmp_path):
    result = bench.main(["--tiny", "--model", "hunyuan", "--steps", "1", "--configs", "diffusers",
                         "diffusers:_native_flash", "diffusers:flash_varlen", "diffusers:_native_math", "sage",
                         "--compile", "none", *SMALL, "--json", str(tmp_path / "hunyuan.json")])
    rows = rows_by_label(result)
    assert rows["diffusers backend _native_flash"]["error"].startswith("refused: ValueError: `attn_mask` is not")
    assert rows["diffusers backend flash_varlen"]["error"].startswith("refused: RuntimeError:")
    assert "flash-attn" in rows["diffusers backend flash_varlen"]["error"]  # the missing package, named
    timed = {label: row for label, row in rows.items() if row["video_s"] is not None}
    assert set(timed) == {"diffusers default processors", "diffusers backend _native_math", "TORCH_REFERENCE SAGE fp8"}
    assert all(row["transformer_calls"] == 2 for row in timed.values())  # 1 step × CFG through the guider
    best = min(row["video_s"] for row in timed.values() if row["diffusers"])
    for row in timed.values():
        assert row["vs_best_diffusers"] == pytest.approx(best / row["video_s"])
        assert row["video_s"] == pytest.approx(row["text_s"] + 50 * row["per_step_s"] + row["decode_s"])


def test_time_budget_spent_records_every_row_as_not_run(tmp_path):
    result = bench.main(["--tiny", "--model", "wan", "--configs", "diffusers", "sage", "--time-budget", "1e-9",
                         "--json", str(tmp_path / "wan.json")])
    assert [row["error"] for row in result["rows"]] == ["not run: time budget spent"] * 2
    assert "best diffusers configuration: none ran" in result["markdown"]


def test_warmup_steps_reach_both_wan_experts():
    """Two warm-up steps compile and build for both A14B experts: the second runs the low-noise one."""
    from diffusers_trtllm.tiny_pipelines import tiny_wan22_pipeline

    pipe = tiny_wan22_pipeline()
    pipe.set_progress_bar_config(disable=True)
    called = []
    for name in ("transformer", "transformer_2"):
        getattr(pipe, name).register_forward_pre_hook(lambda *_, name=name: called.append(name))
    with torch.no_grad(), bench.first_blocks_only(pipe, "blocks"):
        pipe(bench.PROMPT, height=32, width=32, num_frames=5, num_inference_steps=bench.WARMUP_STEPS,
             output_type="latent", **bench.VIDEO_MODELS["wan"].call_kwargs)
    assert called == ["transformer", "transformer", "transformer_2", "transformer_2"]
    assert len(pipe.transformer.blocks) == 2  # restored after the warm-up


def test_backends_group_lists_diffusers_backends_once_math_last():
    from diffusers.models.attention_dispatch import AttentionBackendName

    entry = bench.VIDEO_MODELS["hunyuan"].entry
    configs = bench.video_configs(["diffusers", "backends", "diffusers:flex", "sage_skip"], entry,
                                  "TORCH_REFERENCE", 0.4)
    backends = [c.backend for c in configs if c.backend is not None]
    assert len(backends) == len(set(backends))
    assert set(backends) == {m.value for m in AttentionBackendName} - {"native", "trtllm"}
    assert backends[:2] == ["_native_cudnn", "_native_efficient"] and backends[-1] == "_native_math"
    assert configs[0].diffusers and configs[0].backend is None
    skip = configs[-1].attention.default
    assert not configs[-1].diffusers and skip.skip_softmax.threshold == 0.4 and skip.quant.dtype_qk == "fp8_e4m3"


def test_wan_package_configs_keep_cross_attention_on_sdpa():
    entry = bench.VIDEO_MODELS["wan"].entry
    (dense,) = bench.video_configs(["dense"], entry, "TRTLLM_ATTN", 0.65)
    assert dense.attention.default.backend == "TRTLLM_ATTN"
    assert dense.attention.per_role["cross"].backend == "TORCH_SDPA"


@pytest.mark.parametrize("key, sizes", [
    ("wan", {"transformer": 14.29e9, "transformer_2": 14.29e9, "text_encoder": 5.68e9, "vae": 0.127e9}),
    ("hunyuan", {"transformer": 8.33e9, "text_encoder": 7.07e9, "text_encoder_2": 0.218e9}),
])
def test_full_size_pipelines_build_offline_at_real_size(key, sizes):
    model = bench.VIDEO_MODELS[key]
    pipe = model.build_full(model.entry, torch.device("meta"), torch.bfloat16)
    for name, expected in sizes.items():
        params = sum(p.numel() for p in getattr(pipe, name).parameters())
        assert params == pytest.approx(expected, rel=2e-3), name
    vae_dtype = next(pipe.vae.parameters()).dtype
    assert vae_dtype == (torch.float32 if key == "wan" else torch.bfloat16)


def test_hunyuan_character_tokenizer_pads_to_the_real_encoder_length():
    """1,000 + 108 tokens reach the Qwen encoder, and the 108 the pipeline crops are exactly the template prefix."""
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import format_text_input

    model = bench.VIDEO_MODELS["hunyuan"]
    pipe = model.build_full(model.entry, torch.device("meta"), torch.bfloat16)
    crop = pipe.prompt_template_encode_start_idx
    ids = pipe.tokenizer.apply_chat_template(
        format_text_input([bench.PROMPT], pipe.system_message), add_generation_prompt=True, tokenize=True,
        return_dict=True, padding="max_length", max_length=pipe.tokenizer_max_length + crop, truncation=True,
        return_tensors="pt").input_ids[0]
    assert crop == 108 and len(ids) == 1108
    assert pipe.tokenizer.decode(ids[crop:crop + len(bench.PROMPT)]) == bench.PROMPT


@pytest.mark.parametrize("argv, message", [
    (["--frames", "80"], "--frames 80 is invalid: expected 4k + 1"),
    (["--height", "100"], "--height 100 is invalid: expected a multiple of 16"),
    (["--steps", "41"], "--steps 41 is more than the 40 steps per video"),
    (["--steps", "0"], "argument --steps: 0 is invalid"),
    (["--configs", "fast"], "--configs 'fast' is invalid"),
    (["--configs", "diffusers:nope"], "diffusers 0.42 has no attention backend 'nope'"),
    (["--threshold", "0"], "--threshold 0.0 is invalid: expected λ > 0"),
    (["--model", "cosmos"], "argument --model: invalid choice"),
])
def test_bad_arguments_are_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--tiny", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_full_size_run_without_a_gpu_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--model", "wan"])
    assert exit_info.value.code == 2
    assert "sees no CUDA GPU; use --tiny on a CPU" in capsys.readouterr().err

"""Calibrate the tiny Wan 2.2 pipeline, save, reload, and check that target_sparsity lands where the curve says.

Calibration setting, and why: the tiny pipeline's default transformer (head_dim 16) saturates at ~14% sparsity
even at λ = 1 (too few RoPE frequencies: tokens at the same place in other frames score like the diagonal), and
at its default 192×320×9 frames only ~2–6% of the 128×128 tiles can be skipped. Both experts are therefore rebuilt
with head_dim 32 (``tiny_wan_transformer(attention_head_dim=32)``, qk_gain 3) and run at 256×448×9 frames
(1,344 tokens, 11×11 tiles per head): λ from 1e-6 to 1 then gives 0–45% sparsity (the upper limit is local
attention's: KV tiles before the diagonal are never below the running max), a smooth log-linear curve.
"""

import json
import warnings

import numpy as np
import pytest
import torch

from diffusers_trtllm import CalibrationError, calibrate, enable_trtllm_attention
from diffusers_trtllm.calibration import calibrations_from_pretrained
from diffusers_trtllm.calibration.checkpoint import SIDECAR_NAME
from diffusers_trtllm.tiny_pipelines import tiny_wan22_pipeline, tiny_wan_transformer

SHAPE = dict(height=256, width=448, num_frames=9, num_inference_steps=4)
PROMPTS = ["a red fox in fresh snow", "waves breaking on black rocks"]
LAMBDAS = np.geomspace(1e-6, 1.0, 31)
TARGETS = (0.15, 0.25, 0.35)


def calibration_pipeline():
    pipe = tiny_wan22_pipeline(qk_gain=3.0)
    pipe.transformer = tiny_wan_transformer(0, qk_gain=3.0, attention_head_dim=32)
    pipe.transformer_2 = tiny_wan_transformer(1, qk_gain=3.0, attention_head_dim=32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    pipe = calibration_pipeline()
    result = calibrate(pipe, PROMPTS, lambdas=LAMBDAS, target_sparsity=0.25, progress=False, **SHAPE)
    folder = tmp_path_factory.mktemp("tiny_wan22")
    pipe.save_pretrained(folder)
    result.save(folder)
    return pipe, result, folder


def achieved_sparsity(stats) -> dict[str, float]:
    """Skipped / all tiles per component over the calls that ran sparse (the population calibration counted)."""
    counts = {}
    for key, record in stats.records.items():
        if "skip" in record.mode:
            component = key[1].split(".")[0]
            skipped, total = counts.get(component, (0, 0))
            counts[component] = (skipped + int(record.skipped), total + int(record.total))
    return {component: skipped / total for component, (skipped, total) in counts.items()}


def test_fit_and_checkpoint(calibrated):
    _, result, folder = calibrated
    assert set(result.fits) == {"transformer", "transformer_2"}
    for component, fit in result.fits.items():
        cal = fit.calibration
        assert fit.r_squared > 0.85, (component, fit.r_squared)
        lo, hi = cal.sparsity_range
        assert lo <= 0.15 and hi >= 0.35, (component, cal.sparsity_range)
        assert cal.ignore == ("blocks.0.attn2", "blocks.1.attn2")  # cross-attention ran dense
        assert cal.targets == ("WanAttention",)
        config = json.loads((folder / component / "config.json").read_text())
        group = config["sparse_attention_config"]["config_groups"]["group_0"]
        assert group["threshold_scale_factor"]["prefill"] == {"a": cal.a, "b": cal.b}
        assert group["target_sparsity"] == {"prefill": 0.25}
        sidecar = json.loads((folder / component / SIDECAR_NAME).read_text())
        assert sidecar["deployment"]["num_frames"] == 9 and sidecar["kv_len"] == [1344]
        assert sidecar["fit"]["r_squared"] == pytest.approx(fit.r_squared)
        assert set(sidecar["versions"]) >= {"torch", "diffusers", "diffusers_trtllm"}
    loaded = calibrations_from_pretrained(folder)
    assert {c: (cal.a, cal.b, cal.sparsity_range) for c, cal in loaded.items()} == \
        {c: (f.calibration.a, f.calibration.b, f.calibration.sparsity_range) for c, f in result.fits.items()}


def test_reloaded_pipeline_hits_each_target(calibrated):
    """Reload the saved pipeline: enable_trtllm_attention reads the curves from its transformers' configs; the
    reference backend's achieved sparsity on the calibration prompts lands within 0.1 of every target."""
    from diffusers import WanPipeline

    _, result, folder = calibrated
    pipe = WanPipeline.from_pretrained(folder)  # diffusers logs that it keeps the unexpected config key
    pipe.set_progress_bar_config(disable=True)
    for target in TARGETS:
        config = {"default": {"backend": "TORCH_REFERENCE", "skip_softmax": {"target_sparsity": target}}}
        per_prompt = []
        with enable_trtllm_attention(pipe, config) as handle:
            assert handle.planner.calibrations["transformer"].sparsity_range == \
                result.fits["transformer"].calibration.sparsity_range
            for i, prompt in enumerate(PROMPTS):
                pipe(prompt, generator=torch.Generator().manual_seed(i), output_type="latent", **SHAPE)
                per_prompt.append(achieved_sparsity(handle.stats))  # statistics hold the last pipeline call
        assert all(set(achieved) == {"transformer", "transformer_2"} for achieved in per_prompt)
        for component in ("transformer", "transformer_2"):
            sparsity = sum(achieved[component] for achieved in per_prompt) / len(per_prompt)
            assert abs(sparsity - target) < 0.1, (component, target, sparsity)


def test_gate_keeps_high_noise_expert_uncalibrated():
    """With D = 0.86 the high-noise expert (t >= 0.875) never runs sparse: no curve for it, and the low-noise
    expert's curve records the gate. An impossible fit range fails with the observed range in the message."""
    pipe = calibration_pipeline()
    result = calibrate(pipe, PROMPTS[:1], lambdas=LAMBDAS, disabled_until_timestep=0.86, progress=False, **SHAPE)
    assert set(result.fits) == {"transformer_2"}
    assert result.fits["transformer_2"].calibration.disabled_until_timestep == 0.86
    with pytest.raises(CalibrationError, match=r"sparsity in \[0.95, 1.0\].*observed range"):
        calibrate(pipe, PROMPTS[:1], lambdas=LAMBDAS, fit_range=(0.95, 1.0), progress=False,
                  height=128, width=256, num_frames=5, num_inference_steps=2)


@pytest.mark.parametrize("family,role,layer", [("hunyuan_video15", "joint_attn", "transformer_blocks.0.attn"),
                                               ("cosmos3", "gen_full", "layers.0.self_attn")])
def test_default_sparse_roles_follow_the_model(family, role, layer):
    """HunyuanVideo 1.5 has no `self` attention and Cosmos 3's `self` is its causal text stream: the old default
    ("self",) counted nothing there and returned no curve. Each model's video attention is calibrated now."""
    from diffusers_trtllm import tiny_pipelines

    pipe = getattr(tiny_pipelines, f"tiny_{family}_pipeline")()
    pipe.set_progress_bar_config(disable=True)
    result = calibrate(pipe, PROMPTS[0], height=128, width=192, num_frames=5, num_inference_steps=2,
                       lambdas=LAMBDAS, tile=(16, 16), fit_range=(0.0, 1.0), progress=False)
    assert set(result.fits) == {"transformer"}
    assert result.settings["calibration"]["sparse_roles"] == [role]
    assert layer in result.fits["transformer"].layers


def test_a_run_that_counts_nothing_raises_naming_the_roles():
    from diffusers_trtllm.tiny_pipelines import tiny_cosmos3_pipeline

    pipe = tiny_cosmos3_pipeline()
    pipe.set_progress_bar_config(disable=True)
    with pytest.raises(CalibrationError, match=r"counted no attention call.*und_causal \(self\), gen_full \(joint\)"):
        calibrate(pipe, PROMPTS[0], height=128, width=192, num_frames=5, num_inference_steps=1,
                  sparse_roles=("self",), progress=False)  # the causal text stream never skips
    wan = calibration_pipeline()
    with pytest.raises(CalibrationError, match=r"t > disabled_until_timestep=0.01.*self_attn \(self\)"):
        calibrate(wan, PROMPTS[0], height=128, width=256, num_frames=5, num_inference_steps=1,
                  disabled_until_timestep=0.01, progress=False)  # the only step has t = 1


def test_tile_is_the_tile_counted():
    """`tile=` was only written to the sidecar; counting always used 128 × 128. 256 tokens per sequence:
    32 × 32 tiles are 8 × 8 per head, 32 × 64 tiles 8 × 4, so each point counts half as many tiles."""
    pipe = calibration_pipeline()
    shape = dict(height=128, width=256, num_frames=5, num_inference_steps=1)
    fits = {tile: calibrate(pipe, PROMPTS[0], lambdas=LAMBDAS, tile=tile, fit_range=(0.0, 1.0), progress=False,
                            **shape).fits["transformer"] for tile in ((32, 32), (32, 64))}
    small, wide = (fits[tile].points for tile in ((32, 32), (32, 64)))
    assert {p["kv_len"] for p in small} == {256}
    assert all(p["tiles"] == 2 * q["tiles"] for p, q in zip(small, wide))
    assert [p["sparsity"] for p in small] != [p["sparsity"] for p in wide]
    # kv_step: the same tiles, each decided against the running max at its 64-key step's start
    stepped = calibrate(pipe, PROMPTS[0], lambdas=LAMBDAS, tile=(32, 32), kv_step=64, fit_range=(0.0, 1.0),
                        progress=False, **shape)
    assert stepped.settings["calibration"]["kv_step"] == 64
    points = stepped.fits["transformer"].points
    assert all(p["tiles"] == q["tiles"] for p, q in zip(points, small))
    assert [p["sparsity"] for p in points] != [p["sparsity"] for p in small]
    with pytest.raises(ValueError, match=r"tile=\(0, 128\) is invalid"):
        calibrate(pipe, PROMPTS[0], tile=(0, 128), progress=False, **shape)
    with pytest.raises(ValueError, match="kv_step=96 is invalid: expected a positive multiple of the tile's 64 key"):
        calibrate(pipe, PROMPTS[0], tile=(32, 64), kv_step=96, progress=False, **shape)


def test_sparse_roles_the_model_lacks_raise_before_running():
    from diffusers_trtllm import AttentionConfigError
    from diffusers_trtllm.tiny_pipelines import tiny_hunyuan_video15_pipeline

    pipe = tiny_hunyuan_video15_pipeline()
    with pytest.raises(AttentionConfigError, match=r"'self' matches no attention layer.*roles \['joint_attn'\]"):
        calibrate(pipe, PROMPTS[0], height=128, width=192, num_frames=5, num_inference_steps=1,
                  sparse_roles=("self",), progress=False)


def test_suggesting_a_target_outside_the_observed_sparsity_warns():
    pipe = calibration_pipeline()
    with pytest.warns(UserWarning, match=r"target_sparsity=0.95, outside the sparsity \[.*extrapolation"):
        result = calibrate(pipe, PROMPTS[0], height=128, width=256, num_frames=5, num_inference_steps=1,
                           lambdas=LAMBDAS, tile=(32, 32), fit_range=(0.0, 1.0), target_sparsity=0.95, progress=False)
    assert result.fits["transformer"].calibration.target_sparsity == 0.95


def test_the_reuse_curve_is_what_reuse_achieves():
    """``calibrate(..., reuse_steps=2)`` counts a tile skipped where its reuse window skipped it: never less than
    the curve without reuse, and at each λ what a run with that threshold and reuse then skips."""
    pipe = calibration_pipeline()
    lambdas = (1e-3, 1e-2, 1e-1)
    curves = {}
    for reuse_steps in (0, 2):
        result = calibrate(pipe, PROMPTS[0], lambdas=lambdas, reuse_steps=reuse_steps, fit_range=(0.0, 1.0),
                           progress=False, **SHAPE)
        assert result.settings["calibration"]["reuse_steps"] == reuse_steps
        assert {fit.calibration.reuse_steps for fit in result.fits.values()} == {reuse_steps or None}
        curves[reuse_steps] = {(c, p["lambda"]): p["sparsity"] for c, fit in result.fits.items() for p in fit.points}
    assert all(curves[2][key] >= curves[0][key] for key in curves[0])
    assert any(curves[2][key] > curves[0][key] + 0.01 for key in curves[0])
    for lam in lambdas[1:]:
        config = {"default": {"backend": "TORCH_REFERENCE", "skip_softmax": {"threshold": lam, "reuse_steps": 2}},
                  "per_role": {"cross_attn": {"backend": "TORCH_REFERENCE"}}}
        with enable_trtllm_attention(pipe, config) as handle:
            pipe(PROMPTS[0], generator=torch.Generator().manual_seed(0), output_type="latent", **SHAPE)
            counts = {}
            for key, record in handle.stats.records.items():
                if record.skips:
                    tiles = counts.setdefault(key[1].split(".")[0], [0, 0])
                    tiles[0] += record.skipped + record.reused
                    tiles[1] += record.total
        for component, (skipped, total) in counts.items():
            assert abs(skipped / total - curves[2][(component, lam)]) < 0.01, (component, lam)


def test_a_curve_run_with_another_reuse_steps_than_calibrated_warns():
    pipe = calibration_pipeline()
    result = calibrate(pipe, PROMPTS[0], lambdas=(1e-3, 1e-2, 1e-1), reuse_steps=2, fit_range=(0.0, 1.0),
                       progress=False, **SHAPE)
    calibrations = {c: fit.calibration for c, fit in result.fits.items()}
    # reusing steps that test nothing follow the curve without reuse
    for reuse_steps, reuse_test, warned in ((0, True, True), (2, True, False), (2, False, True)):
        config = {"default": {"backend": "TORCH_REFERENCE", "skip_softmax": {
            "target_sparsity": 0.3, "reuse_steps": reuse_steps, "reuse_test": reuse_test}}}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            enable_trtllm_attention(pipe, config, calibrations=calibrations).restore()
        messages = [str(w.message) for w in caught if "calibrated with reuse_steps=2" in str(w.message)]
        assert bool(messages) == warned, (reuse_steps, reuse_test, messages)


def test_reuse_steps_is_checked_before_any_work():
    with pytest.raises(ValueError, match=r"reuse_steps=-1 is invalid: expected an int >= 0"):
        calibrate(object(), "p", reuse_steps=-1, **SHAPE)

"""TRTLLM_ATTN on vLLM-Omni's diffusers path, against the real vllm-omni 0.30.0: its DiffusersAdapterPipeline
loads a tiny two-expert Wan 2.2 pipeline, and this package's plugin is loaded through its entry point by
vLLM-Omni's own ``load_omni_general_plugins()``. The three models side by side: test_three_models.py."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
import torch
from conftest import CALL_KWARGS, SAMPLING, attention_processors, generate, load_adapter
from diffusers import DiffusionPipeline, UniPCMultistepScheduler

from diffusers_trtllm import (AttentionConfig, AttentionConfigError, BackendUnavailableError, WanTrtllmAttnProcessor,
                              enable_trtllm_attention)
from diffusers_trtllm.backends.base import TRTLLM_ON_REFERENCE_ENV
from diffusers_trtllm.integrations import vllm_omni as plugin

GATE = 0.95  # with 6 UniPC steps at flow shift 3 (t = 0.999, 0.937, 0.857, ...) skipping starts at step 1
BOUNDARY = 0.875  # the tiny pipeline's boundary_ratio: the high-noise expert runs while t >= 0.875
SKIP_GATED = {"default": {"backend": "TRTLLM_ATTN",
                          "skip_softmax": {"target_sparsity": 0.5, "disabled_until_timestep": GATE}}}


def test_the_entry_point_is_what_vllm_omni_loads(plugins_loaded):
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.models.diffusers_adapter import DiffusersAdapterPipeline
    from vllm_omni.plugins import OMNI_DEFAULT_PLUGINS_GROUP

    (entry,) = [e for e in entry_points(group=OMNI_DEFAULT_PLUGINS_GROUP) if e.name == "diffusers_trtllm"]
    assert entry.load() is plugin.register
    for method in (DiffusersAdapterPipeline._set_attention_backend,
                   OmniDiffusionConfig._propagate_skip_softmax_calibration):
        assert getattr(method, plugin._WRAPPED)
    plugin.register()  # vLLM-Omni may load plugins again: nothing is wrapped twice
    assert not getattr(DiffusersAdapterPipeline._set_attention_backend.__wrapped__, plugin._WRAPPED, False)


def test_torch_sdpa_behaves_exactly_as_without_the_plugin(pipeline_dir, sdpa_without_plugin, plugins_loaded):
    processors, video = sdpa_without_plugin
    adapter = load_adapter(pipeline_dir, {"default": {"backend": "TORCH_SDPA"}})
    assert attention_processors(adapter._pipeline) == processors
    assert not hasattr(adapter, plugin.HANDLE_ATTRIBUTE)
    torch.testing.assert_close(generate(adapter), video, rtol=0, atol=0)


def normalized_timesteps(pipeline_dir) -> list[float]:
    """t = timestep / num_train_timesteps of each denoising step, from the pipeline's own scheduler."""
    scheduler = UniPCMultistepScheduler.from_pretrained(pipeline_dir, subfolder="scheduler")
    scheduler.set_timesteps(SAMPLING["num_inference_steps"])
    return (scheduler.timesteps.float() / scheduler.config.num_train_timesteps).tolist()


def test_gate_switches_at_the_predicted_step_and_output_equals_the_package_directly(pipeline_dir, plugins_loaded,
                                                                                      on_reference):
    adapter = load_adapter(pipeline_dir, SKIP_GATED)
    handle = getattr(adapter, plugin.HANDLE_ATTRIBUTE)
    assert handle.components == ("transformer", "transformer_2")
    for component in handle.components:
        assert all(isinstance(p, WanTrtllmAttnProcessor)
                   for p in getattr(adapter._pipeline, component).attn_processors.values())
    video = generate(adapter)

    t = normalized_timesteps(pipeline_dir)
    switch = next(step for step, t_step in enumerate(t) if t_step <= GATE)
    assert 0 < switch and t[switch] >= BOUNDARY  # the gate switches inside the high-noise expert's steps
    modes = handle.stats.modes()
    assert sorted(modes) == list(range(len(t)))
    for step, counts in modes.items():
        if step < switch:
            assert counts == {"TRTLLM_ATTN:dense": 4}, step
        elif t[step] >= BOUNDARY:  # the high-noise expert: its calibration's ignore list keeps blocks.0.attn1 dense
            assert counts == {"TRTLLM_ATTN:skip": 3, "TRTLLM_ATTN:dense": 1}, step
        else:
            assert counts == {"TRTLLM_ATTN:skip": 4}, step

    pipe = DiffusionPipeline.from_pretrained(pipeline_dir, torch_dtype=torch.float32)
    direct = enable_trtllm_attention(pipe, SKIP_GATED)
    expected = pipe(**CALL_KWARGS, generator=torch.Generator("cpu").manual_seed(SAMPLING["seed"])).frames
    assert direct.stats.modes() == modes
    torch.testing.assert_close(video, expected, rtol=0, atol=0)


def test_per_role_settings_reach_the_processors(pipeline_dir, plugins_loaded, on_reference):
    """SAGE + threshold on self-attention by role, cross-attention on TORCH_SDPA by category."""
    config = {"default": {"backend": "TRTLLM_ATTN", "skip_softmax": {"threshold": 0.3},
                          "quant": {"dtype_qk": "int8", "q_block_size": 1, "k_block_size": 16}},
              "per_role": {"cross": {"backend": "TORCH_SDPA"}}}
    adapter = load_adapter(pipeline_dir, config)
    generate(adapter)
    modes = getattr(adapter, plugin.HANDLE_ATTRIBUTE).stats.modes()
    assert all(counts == {"TRTLLM_ATTN:sage-int8+skip": 2, "TORCH_SDPA:dense": 2} for counts in modes.values())


def test_a_threshold_at_or_above_1_is_warned_in_vllms_log(pipeline_dir, plugins_loaded, on_reference, vllm_log):
    load_adapter(pipeline_dir, {"default": {"backend": "TRTLLM_ATTN", "skip_softmax": {"threshold": 1.5}}})
    assert len(vllm_log.messages("skip_softmax.threshold=1.5 >= 1 skips nearly every KV tile")) == 1


def test_trtllm_attn_selected_by_role_only_keeps_the_rest_dense(pipeline_dir, plugins_loaded, on_reference):
    adapter = load_adapter(pipeline_dir, {"per_role": {"self_attn": {"backend": "TRTLLM_ATTN",
                                                                     "quant": {"dtype_qk": "fp8_e4m3"}}}})
    generate(adapter)
    modes = getattr(adapter, plugin.HANDLE_ATTRIBUTE).stats.modes()
    assert all(counts == {"TRTLLM_ATTN:sage-fp8_e4m3": 2, "TORCH_SDPA:dense": 2} for counts in modes.values())


def test_vllm_omni_config_objects_convert_to_what_the_same_json_means_here():
    from vllm_omni.diffusion.data import AttentionConfig as OmniAttentionConfig

    trtllm = {"backend": "TRTLLM_ATTN", "skip_softmax": {"target_sparsity": 0.65, "disabled_until_timestep": 0.86},
              "quant": {"dtype_qk": "fp8_e4m3", "q_block_size": 1, "k_block_size": 16}}
    expert_2 = {"backend": "TRTLLM_ATTN", "skip_softmax": {"threshold": 0.4}}
    omni = OmniAttentionConfig(default=trtllm, per_role={"cross": {"backend": "TORCH_SDPA"},
                                                         "transformer_2": {"self_attn": expert_2}})
    assert plugin.attention_config_from_vllm_omni(omni) == AttentionConfig.from_dict(
        {"default": trtllm, "per_role": {"cross": {"backend": "TORCH_SDPA"}, "transformer_2.self_attn": expert_2}})


@pytest.mark.parametrize("config, message", [
    ({"default": {"backend": "FLASH_ATTN"}, "per_role": {"self": {"backend": "TRTLLM_ATTN"}}},
     "diffusion_attention_config.default.backend='FLASH_ATTN' cannot be combined with TRTLLM_ATTN"),
    ({"default": {"backend": "TRTLLM_ATTN", "quant": {"dtype_qk": "int8", "dtype_vo": "bfloat16"}}},
     "quant.dtype_vo='bfloat16' is invalid: expected 'fp8_e4m3' or null"),
    ({"default": {"backend": "TRTLLM_ATTN", "quant": {"dtype_qk": "bfloat16"}}},
     "diffusion_attention_config.default: quant.dtype_qk='bfloat16' is invalid"),
    ({"default": {"backend": "TRTLLM_ATTN", "quant": {"dtype_qk": "int8", "flashinfer_backend": "trtllm-gen"}}},
     "quant.flashinfer_backend='trtllm-gen' is not supported"),
    ({"default": {"backend": "TRTLLM_ATTN"}, "per_role": {"ltx2.audio_to_video": {"backend": "TORCH_SDPA"}}},
     "per_role key 'ltx2.audio_to_video' matches no attention layer of this pipeline"),
])
def test_settings_this_package_cannot_honour_are_refused_at_load(pipeline_dir, plugins_loaded, on_reference, config,
                                                                 message):
    with pytest.raises(AttentionConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_adapter(pipeline_dir, config)


def test_target_sparsity_without_a_calibrated_checkpoint_is_refused_by_this_package(tmp_path, plugins_loaded,
                                                                                   on_reference):
    from diffusers_trtllm.tiny_pipelines import tiny_wan22_pipeline

    tiny_wan22_pipeline(0).save_pretrained(tmp_path)
    with pytest.raises(AttentionConfigError, match="'transformer' has no Skip-Softmax calibration"):
        load_adapter(tmp_path, SKIP_GATED)


def test_an_untested_vllm_omni_version_refuses_trtllm_attn_only(pipeline_dir, plugins_loaded, on_reference,
                                                                monkeypatch):
    from vllm_omni.diffusion.models.diffusers_adapter import DiffusersAdapterPipeline

    original = DiffusersAdapterPipeline._set_attention_backend.__wrapped__
    monkeypatch.setattr(DiffusersAdapterPipeline, "_set_attention_backend",
                        plugin._set_attention_backend_wrapper(original, "0.31.0"))
    with pytest.raises(BackendUnavailableError, match="for vllm-omni 0.30.0 .*; installed is vllm-omni 0.31.0"):
        load_adapter(pipeline_dir, {"default": {"backend": "TRTLLM_ATTN"}})
    adapter = load_adapter(pipeline_dir, {"default": {"backend": "TORCH_SDPA"}})
    assert not hasattr(adapter, plugin.HANDLE_ATTRIBUTE)


@pytest.mark.parametrize("backend, served", [("trtllm-gen", "TRTLLM_ATTN"), ("TORCH_REFERENCE", "TORCH_REFERENCE")])
def test_the_readmes_spellings_are_served_by_the_plugin(pipeline_dir, plugins_loaded, on_reference, backend, served):
    """vLLM-Omni knows neither ``trtllm-gen`` (this package's alias of TRTLLM_ATTN) nor ``TORCH_REFERENCE``; the
    plugin serves both instead of leaving vLLM-Omni's bare refusal. (With ``skip_softmax`` or ``quant``
    vLLM-Omni's own parser asks for the name TRTLLM_ATTN and says so: docs/vllm-omni.md.)"""
    adapter = load_adapter(pipeline_dir, {"default": {"backend": backend},
                                          "per_role": {"cross": {"backend": "TORCH_SDPA"}}})
    generate(adapter)
    modes = getattr(adapter, plugin.HANDLE_ATTRIBUTE).stats.modes()
    ran = {mode for counts in modes.values() for mode in counts}
    assert ran == {f"{served}:dense", "TORCH_SDPA:dense"}

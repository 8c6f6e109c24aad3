"""Wan 2.2, HunyuanVideo 1.5 and Cosmos 3 through vLLM-Omni 0.30.0's real diffusers adapter, each loaded by path
from a saved tiny pipeline: this package's processors on every transformer, a short request, the same output as
this package called directly, what vLLM-Omni's log says, and the refusals."""

from __future__ import annotations

import pytest
import torch
from conftest import MODELS, generate, load_adapter, request_batch
from diffusers import DiffusionPipeline

from diffusers_trtllm import AttentionConfigError, BackendUnavailableError, enable_trtllm_attention
from diffusers_trtllm.backends.base import TRTLLM_ON_REFERENCE_ENV
from diffusers_trtllm.integrations import vllm_omni as plugin

SKIP = {"default": {"backend": "TRTLLM_ATTN", "skip_softmax": {"threshold": 0.3}}}
# What vLLM-Omni's log says each role runs with SKIP (layers per tiny transformer: 2)
SERVED = {
    "wan22": "transformer: self_attn TRTLLM_ATTN skip (2 layers), cross_attn TRTLLM_ATTN skip (2 layers); "
             "transformer_2: self_attn TRTLLM_ATTN skip (2 layers), cross_attn TRTLLM_ATTN skip (2 layers)",
    "hunyuan_video15": "transformer: joint_attn TRTLLM_ATTN skip (2 layers)",
    "cosmos3": "transformer: und_causal TORCH_SDPA dense (2 layers), gen_full TRTLLM_ATTN skip (2 layers)",
}
PIPELINES = {"wan22": "WanPipeline", "hunyuan_video15": "HunyuanVideo15Pipeline", "cosmos3": "Cosmos3OmniPipeline"}
COSMOS3_CAUSAL = ("'und_causal' attention is causal and the default backend TRTLLM_ATTN runs non-causal attention "
                  "only, so 'und_causal' runs dense on TORCH_SDPA")


@pytest.mark.parametrize("name", list(MODELS))
def test_each_model_runs_on_this_packages_processors_as_the_package_directly(name, saved_pipeline, plugins_loaded,
                                                                            on_reference, vllm_log):
    """For Cosmos 3 this is the TRTLLM_ATTN default in vLLM-Omni's format, with no per_role entry: its causal text
    stream runs on TORCH_SDPA, said once in vLLM-Omni's log."""
    model, folder = MODELS[name], saved_pipeline(name)
    adapter = load_adapter(folder, SKIP, model=name)
    handle = getattr(adapter, plugin.HANDLE_ATTRIBUTE)
    assert handle.components == tuple(model.calibrations)
    for component in handle.components:
        processors = getattr(adapter._pipeline, component).attn_processors
        ours = {n: type(p).__name__ for n, p in processors.items() if not n.startswith(model.left_alone or "\0")}
        assert ours and set(ours.values()) == {model.processor}, component
    assert vllm_log.messages("is served by diffusers_trtllm") == [
        f"TRTLLM_ATTN for {PIPELINES[name]} is served by diffusers_trtllm {plugin.__version__}: {SERVED[name]} "
        f"(config {plugin.attention_config_from_vllm_omni(adapter.od_config.diffusion_attention_config).to_json()})"]
    assert vllm_log.messages("und_causal' attention is causal") == (
        [f"diffusers_trtllm: {COSMOS3_CAUSAL}; a per_role entry for 'und_causal' chooses its backend instead"]
        if name == "cosmos3" else [])

    call_kwargs = adapter._build_call_kwargs(request_batch(model.sampling))
    served = generate(adapter, model.sampling)
    pipe = DiffusionPipeline.from_pretrained(folder, torch_dtype=torch.float32)
    direct = enable_trtllm_attention(pipe, SKIP)
    expected = pipe(**call_kwargs)
    expected = expected.frames if hasattr(expected, "frames") else expected.video
    assert handle.stats.modes() == direct.stats.modes() and len(handle.stats.modes()) == model.sampling[
        "num_inference_steps"]
    torch.testing.assert_close(served, expected, rtol=0, atol=0)


def test_cosmos3_per_role_auto_is_dropped_by_vllm_omni_and_the_causal_stream_still_runs_on_sdpa(
        saved_pipeline, plugins_loaded, on_reference):
    """vLLM-Omni's config parser discards a spec whose backend is "auto": the config is the bare TRTLLM_ATTN
    default, which loads."""
    adapter = load_adapter(saved_pipeline("cosmos3"), {"default": {"backend": "TRTLLM_ATTN"},
                                                       "per_role": {"und_causal": {"backend": "auto"}}},
                           model="cosmos3")
    assert adapter.od_config.diffusion_attention_config.per_role == {}
    calls = getattr(adapter, plugin.HANDLE_ATTRIBUTE).planner.calls
    assert {(site.role, call.backend) for site, call in calls.items()} == {("und_causal", "TORCH_SDPA"),
                                                                         ("gen_full", "TRTLLM_ATTN")}


def test_cosmos3_causal_stream_given_trtllm_by_per_role_is_refused_naming_a_backend_vllm_omni_can_express(
        saved_pipeline, plugins_loaded, on_reference):
    with pytest.raises(BackendUnavailableError, match=r"und_causal attention, per_role key 'und_causal'\): backend "
                                                      r"TRTLLM_ATTN cannot run this attention.*"
                                                      r"\{'und_causal': \{\"backend\": \"TORCH_SDPA\"\}\}"):
        load_adapter(saved_pipeline("cosmos3"), {"default": {"backend": "TORCH_SDPA"},
                                                 "per_role": {"und_causal": {"backend": "TRTLLM_ATTN"}}},
                     model="cosmos3")


@pytest.mark.parametrize("name", list(MODELS))
def test_trtllm_attn_on_the_cpu_is_refused_at_load_saying_what_to_select_instead(name, saved_pipeline,
                                                                                 plugins_loaded, monkeypatch):
    monkeypatch.delenv(TRTLLM_ON_REFERENCE_ENV, raising=False)
    with pytest.raises(BackendUnavailableError) as error:
        load_adapter(saved_pipeline(name), SKIP, dtype=torch.bfloat16, model=name)
    message = str(error.value)
    assert f"selects TRTLLM_ATTN (default), but diffusers_trtllm cannot run it for {PIPELINES[name]} on cpu" in message
    assert "TRTLLM_ATTN needs an NVIDIA sm_90 (H100/H200), sm_100 or sm_103 (B200/B300) GPU" in message
    assert message.endswith(f"To serve this pipeline there, {plugin.INSTEAD}")
    assert "do not provide a binding" not in message


@pytest.mark.parametrize("name, per_role, refusal", [
    ("hunyuan_video15", {"cross": {"backend": "TORCH_SDPA"}},
     r"per_role key 'cross' matches no attention layer of this pipeline; valid keys: components \['transformer'\], "
     r"roles \['joint_attn'\]"),
    ("hunyuan_video15", {"transformer_2": {"backend": "TORCH_SDPA"}}, "per_role key 'transformer_2' matches no"),
    ("cosmos3", {"cross": {"backend": "TORCH_SDPA"}},
     r"per_role key 'cross' matches no attention layer .* roles \['gen_full', 'und_causal'\], categories "
     r"\['joint', 'self'\]"),
])
def test_per_role_keys_the_model_lacks_are_refused_at_load(name, per_role, refusal, saved_pipeline, plugins_loaded,
                                                           on_reference):
    with pytest.raises(AttentionConfigError, match=refusal):
        load_adapter(saved_pipeline(name), {"default": {"backend": "TRTLLM_ATTN"}, "per_role": per_role}, model=name)


@pytest.mark.parametrize("name", ["hunyuan_video15", "cosmos3"])
def test_target_sparsity_reads_each_checkpoints_calibration(name, saved_pipeline, plugins_loaded, on_reference):
    """vLLM-Omni itself refuses target_sparsity on the diffusers path; the plugin reads the calibration that the
    saved transformer's config.json carries."""
    adapter = load_adapter(saved_pipeline(name), {"default": {"backend": "TRTLLM_ATTN",
                                                              "skip_softmax": {"target_sparsity": 0.5}}}, model=name)
    calls = getattr(adapter, plugin.HANDLE_ATTRIBUTE).planner.calls.values()
    calibration = MODELS[name].calibrations["transformer"]
    assert {(c.calibration.a, c.calibration.b, c.calibration.source) for c in calls if c.skip is not None} == {
        (calibration.a, calibration.b, "transformer.config.sparse_attention_config")}

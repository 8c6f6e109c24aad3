"""Installing, reinstalling and restoring processors; what ``auto`` drops on a CPU; pipeline calls restart the step
count; statistics stay bounded over many calls; refusals with the fix in the message."""

import argparse
import gc
import tracemalloc
import warnings

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from diffusers_trtllm import errors as errors_module
from diffusers_trtllm import (AttentionConfigError, BackendUnavailableError, WanTrtllmAttnProcessor,
                              enable_trtllm_attention)
from diffusers_trtllm.backends.base import TRTLLM_ON_REFERENCE_ENV
from diffusers_trtllm.cli import add_attention_args, config_from_args
from diffusers_trtllm.tiny_pipelines import TINY_TEXT_DIM, tiny_cosmos3_transformer, tiny_wan22_pipeline

from helpers import LoopPipeline, cosmos3_transformer_call, tiny_wan


def tiny_call_inputs():
    """One video token and 16 text tokens: a Wan transformer call of a few milliseconds."""
    return dict(hidden_states=torch.randn(1, 16, 1, 2, 2), timestep=torch.tensor([500]),
                encoder_hidden_states=torch.randn(1, 16, TINY_TEXT_DIM), return_dict=False)


@pytest.mark.parametrize("spec, dropped", [
    ({"skip_softmax": {"threshold": 0.1}}, "Skip-Softmax dropped"),
    ({"quant": {"dtype_qk": "int8"}}, "SAGE int8 dropped"),
    ({"skip_softmax": {"threshold": 0.1}, "quant": {"dtype_qk": "int8"}}, "Skip-Softmax and SAGE int8 dropped"),
], ids=["skip", "sage", "skip+sage"])
def test_auto_on_cpu_runs_sdpa_and_warns_once_visibly(spec, dropped):
    model = tiny_wan()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # what a user sees: each distinct warning once
        handle = enable_trtllm_attention(model, {"default": spec})
        with torch.no_grad():
            model(**tiny_call_inputs())
            model(**tiny_call_inputs())
    ours = [w for w in caught if "diffusers_trtllm" in str(w.message)]
    assert len(ours) == 1 and ours[0].category is UserWarning  # UserWarning: shown by default, unlike Deprecation
    message = str(ours[0].message)
    assert "['cross_attn', 'self_attn']" in message and dropped in message and "TRTLLM_ATTN" in message, message
    assert {(rec.backend, rec.mode) for rec in handle.stats.records.values()} == {("TORCH_SDPA", "dense")}
    assert {call.backend for call in handle.planner.calls.values()} == {"TORCH_SDPA"}  # never TORCH_REFERENCE


def test_sage_skipping_on_the_triton_rule_says_once_per_process_that_heads_skip_only_where_it_pays():
    model = tiny_wan()
    spec = {"backend": "TORCH_REFERENCE", "skip_softmax": {"threshold": 0.1}, "quant": {"dtype_qk": "int8"}}
    errors_module._SAID.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = enable_trtllm_attention(model, {"default": spec})
        with torch.no_grad():
            model(**tiny_call_inputs())
        with torch.no_grad():
            model(**tiny_call_inputs())  # a second call: nothing more said
        handle.restore()
        enable_trtllm_attention(model, {"default": spec}).restore()  # nor at a second install
    ours = [str(w.message) for w in caught if "diffusers_trtllm" in str(w.message)]
    assert len(ours) == 1 and "['cross_attn', 'self_attn']" in ours[0] and ">= 30%" in ours[0], ours
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # SAGE without skipping, or skipping without SAGE: nothing to say
        for other in ({"skip_softmax": {"threshold": 0.1}}, {"quant": {"dtype_qk": "int8"}}):
            enable_trtllm_attention(tiny_wan(), {"default": {"backend": "TORCH_REFERENCE", **other}}).restore()


@pytest.mark.parametrize("config, match", [
    ({"per_role": {"blocks.0.*": {"backend": "TORCH_SDPA"}}}, r"per_role keys \['blocks.0.\*'\] name layers"),
    ({"per_role": {"blocks.1.attn1": {"backend": "TORCH_SDPA"}}}, r"per_role keys \['blocks.1.attn1'\] name layers"),
    ({"per_role": {"transformer": {"backend": "TORCH_SDPA"}}}, r"per_role keys \['transformer'\] name layers or comp"),
    ({"default": {"backend": "TORCH_REFERENCE",
                  "skip_softmax": {"threshold": 0.5, "disabled_until_timestep": 0.9}}}, "disabled_until_timestep"),
    ({"default": {"backend": "TORCH_REFERENCE", "skip_softmax": {"target_sparsity": 0.5}}}, "target_sparsity need"),
], ids=["layer-glob", "layer", "component", "gate", "target_sparsity"])
def test_unbound_processor_refuses_what_only_install_knows(config, match):
    with pytest.raises(AttentionConfigError, match=match) as error:
        WanTrtllmAttnProcessor(config)
    assert "enable_trtllm_attention" in str(error.value)  # the fix


def test_second_install_raises_naming_the_handle():
    model = tiny_wan()
    handle = enable_trtllm_attention(model, {"default": {"backend": "TORCH_SDPA"}})
    with pytest.raises(AttentionConfigError,
                       match="installed by the handle returned by enable_trtllm_attention.*restore()"):
        enable_trtllm_attention(model, {"default": {"backend": "TORCH_REFERENCE"}})
    handle.restore()
    enable_trtllm_attention(model, {"default": {"backend": "TORCH_REFERENCE"}}).restore()  # after restore: fine

    model.set_attn_processor(WanTrtllmAttnProcessor({"default": {"backend": "TORCH_SDPA"}}))
    with pytest.raises(AttentionConfigError, match="installed by transformer.set_attn_processor"):
        enable_trtllm_attention(model, {"default": {"backend": "TORCH_SDPA"}})


def test_restore_is_idempotent_and_restores_only_its_own_processors():
    model = tiny_wan()
    originals = dict(model.attn_processors)
    handle = enable_trtllm_attention(model, {"default": {"backend": "TORCH_SDPA"}})
    users = WanAttnProcessor()
    model.blocks[0].attn1.set_processor(users)  # the user replaces one of ours after install
    handle.restore()
    after = model.attn_processors
    assert after["blocks.0.attn1.processor"] is users
    assert all(after[name] is proc for name, proc in originals.items() if name != "blocks.0.attn1.processor")
    handle.restore()
    assert model.attn_processors == after
    assert not model._forward_pre_hooks and not hasattr(model, "_diffusers_trtllm_handle")


def test_each_pipeline_call_starts_at_step_zero():
    pipe = tiny_wan22_pipeline(two_experts=False)
    pipe.set_progress_bar_config(disable=True)

    def generate(steps):
        pipe("a fox", height=32, width=32, num_frames=1, num_inference_steps=steps, output_type="latent",
             generator=torch.Generator().manual_seed(0))

    with enable_trtllm_attention(pipe, {"default": {"backend": "TORCH_SDPA"}}) as handle:
        generate(3)
        assert list(handle.stats.per_step()) == [0, 1, 2]
        generate(2)
        assert list(handle.stats.per_step()) == [0, 1]
        assert {rec.calls for rec in handle.stats.records.values()} == {2}  # CFG: two calls per step, no leftovers


def test_memory_stays_flat_over_a_thousand_calls():
    """200 pipeline calls of 5 steps (1000 transformer calls): the statistics hold the last call only and nothing
    else grows. Memory is compared between two windows of 80 calls after a warm-up, so the allocator's steady
    state (small tensors it keeps for reuse) is not counted as growth; a leak of one object per call would be."""
    pipe = LoopPipeline(tiny_wan(), FlowMatchEulerDiscreteScheduler(shift=3.0))
    config = {"default": {"backend": "TORCH_REFERENCE", "skip_softmax": {"threshold": 0.3,
                                                                         "disabled_until_timestep": 0.5}}}
    inputs = tiny_call_inputs()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny call is dominated by thread start-up otherwise
    try:
        with enable_trtllm_attention(pipe, config) as handle, torch.no_grad():
            def pipeline_calls(n):
                for _ in range(n):
                    pipe(inputs, steps=5)
                    assert len(handle.stats.per_step()) == 5
                gc.collect()
                return tracemalloc.take_snapshot()

            tracemalloc.start()
            pipeline_calls(40)
            first = pipeline_calls(80)
            growth = sum(s.size_diff for s in pipeline_calls(80).compare_to(first, "filename"))
            tracemalloc.stop()
            stats = handle.stats
            assert len(stats.records) <= 5 * len(handle.planner.calls) and not stats._steps
    finally:
        torch.set_num_threads(threads)
    assert growth < 16 * 1024, f"{growth} bytes more after 400 transformer calls"


COSMOS3_CAUSAL_ON_SDPA = ("'und_causal' attention is causal and the default backend TRTLLM_ATTN runs non-causal "
                          "attention only, so 'und_causal' runs dense on TORCH_SDPA")


@pytest.mark.parametrize("given", ["python", "cli flag"])
def test_cosmos3_trtllm_default_runs_the_causal_stream_on_sdpa_and_says_so_once(given, monkeypatch):
    """The causal text stream never takes Skip-Softmax or SAGE: under a TRTLLM_ATTN default it runs on TORCH_SDPA,
    whether the default comes from the Python API or the CLI flag (vLLM-Omni's config: tests/vllm_omni_plugin)."""
    monkeypatch.setenv(TRTLLM_ON_REFERENCE_ENV, "1")
    config = ({"default": {"backend": "TRTLLM_ATTN", "skip_softmax": {"threshold": 0.3}}} if given == "python" else
              config_from_args(add_attention_args(argparse.ArgumentParser()).parse_args(
                  ["--diffusion-attention-backend", "trtllm-gen"]), environ={}))
    model, inputs = cosmos3_transformer_call()
    with warnings.catch_warnings(record=True, action="default") as caught, \
            enable_trtllm_attention(model, config) as handle, torch.no_grad():
            model(**inputs)
            model(**inputs)
    assert [str(w.message) for w in caught if "und_causal" in str(w.message)] == [
        f"diffusers_trtllm: {COSMOS3_CAUSAL_ON_SDPA}; a per_role entry for 'und_causal' chooses its backend instead"]
    backends = {(site.role, call.backend) for site, call in handle.planner.calls.items()}
    assert backends == {("und_causal", "TORCH_SDPA"), ("gen_full", "TRTLLM_ATTN")}
    assert set(handle.stats.modes()[0]) == {"TORCH_SDPA:dense", "TRTLLM_ATTN:skip" if given == "python" else
                                            "TRTLLM_ATTN:dense"}


@pytest.mark.parametrize("per_role", [{"und_causal": {"backend": "TRTLLM_ATTN"}},
                                      {"self": {"backend": "TRTLLM_ATTN"}}], ids=["role", "category"])
def test_cosmos3_causal_stream_given_trtllm_by_per_role_is_refused_at_install(per_role, monkeypatch):
    monkeypatch.setenv(TRTLLM_ON_REFERENCE_ENV, "1")
    with pytest.raises(BackendUnavailableError,
                       match=r"und_causal attention, per_role key '(und_causal|self)'\): backend TRTLLM_ATTN cannot run "
                             r"this attention: TRTLLM_ATTN runs non-causal attention only.*Fix: .*"
                             r"\{'und_causal': \{\"backend\": \"TORCH_SDPA\"\}\}"):
        enable_trtllm_attention(tiny_cosmos3_transformer(), {"default": {"backend": "TRTLLM_ATTN"},
                                                             "per_role": per_role})


def test_cosmos3_explicit_trtllm_default_refuses_the_causal_stream_on_cpu():
    """Without the seam a CPU refuses TRTLLM_ATTN for every role, with the fix in the message."""
    with pytest.raises(BackendUnavailableError, match=r"Fix: give this role a backend that runs it"):
        enable_trtllm_attention(tiny_cosmos3_transformer(), {"default": {"backend": "TRTLLM_ATTN"}})

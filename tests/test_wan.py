"""Wan processors on tiny transformers and a tiny two-expert Wan 2.2 pipeline: parity, gate, roles, install."""

import warnings

import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from diffusers_trtllm import (AttentionConfigError, BackendUnavailableError, SkipCalibration,
                              WanTrtllmAttnProcessor, enable_trtllm_attention)
from diffusers_trtllm.tiny_pipelines import tiny_wan22_pipeline

from helpers import max_rel_err, predicted_gate_modes, tiny_wan, wan_inputs


@pytest.mark.parametrize("i2v", [False, True], ids=["wan22_t2v", "wan21_i2v"])
@pytest.mark.parametrize("backend", ["TORCH_SDPA", "TORCH_REFERENCE", "auto"])
def test_dense_processor_reproduces_the_default_processor(i2v, backend):
    model = tiny_wan(i2v=i2v)
    inputs = wan_inputs(i2v=i2v)
    with torch.no_grad():
        expected = model(**inputs)[0]
        model.set_attn_processor(WanTrtllmAttnProcessor({"default": {"backend": backend}}))
        got = model(**inputs)[0]
    assert max_rel_err(got, expected) <= 1e-5


def test_i2v_image_cross_attention_is_its_own_role():
    model = tiny_wan(i2v=True)
    handle = enable_trtllm_attention(model, {"per_role": {"image_cross_attn": {"backend": "TORCH_REFERENCE"}},
                                             "default": {"backend": "TORCH_SDPA"}})
    with torch.no_grad():
        model(**wan_inputs(i2v=True))
    backends = {(layer.rsplit(".", 1)[-1], rec.backend) for (_, layer, *_), rec in handle.stats.records.items()}
    assert backends == {("attn1", "TORCH_SDPA"), ("attn2", "TORCH_SDPA"), ("attn2", "TORCH_REFERENCE")}


def test_explicit_trtllm_backend_on_cpu_raises_with_the_reason():
    with pytest.raises(BackendUnavailableError, match="TRTLLM_ATTN cannot run this attention: .*needs an NVIDIA sm_90.*none was found"):
        enable_trtllm_attention(tiny_wan(), {"default": {"backend": "TRTLLM_ATTN"}})  # at install
    model = tiny_wan()
    model.set_attn_processor(WanTrtllmAttnProcessor({"default": {"backend": "TRTLLM_ATTN"}}))
    with pytest.raises(BackendUnavailableError, match="TRTLLM_ATTN cannot run"):  # unbound: at the first call
        with torch.no_grad():
            model(**wan_inputs())


def test_auto_never_runs_the_reference_and_warns_once_what_it_drops():
    model = tiny_wan()
    with pytest.warns(UserWarning, match=r"auto runs \['cross_attn', 'self_attn'\] attention dense: "
                                         r"Skip-Softmax dropped .*TRTLLM_ATTN") as record:
        handle = enable_trtllm_attention(model, {"default": {"skip_softmax": {"threshold": 0.1}}})
    assert len([w for w in record if "auto runs" in str(w.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            model(**wan_inputs())
            model(**wan_inputs())
    assert {(rec.backend, rec.mode) for rec in handle.stats.records.values()} == {("TORCH_SDPA", "dense")}


def test_unbound_processor_refuses_what_it_cannot_see():
    with pytest.raises(AttentionConfigError, match="disabled_until_timestep / target_sparsity need the pipeline"):
        WanTrtllmAttnProcessor({"default": {"skip_softmax": {"threshold": 0.5, "disabled_until_timestep": 0.9}}})
    with pytest.raises(AttentionConfigError, match="name layers or components"):
        WanTrtllmAttnProcessor({"per_role": {"blocks.0.*": {"backend": "TORCH_SDPA"}}})


def expected_modes(pipe, steps, gate):
    """Per step: which expert runs (t >= boundary -> transformer) and whether skipping is on (t <= gate)."""
    pipe.scheduler.set_timesteps(steps)
    boundary = pipe.config.boundary_ratio * pipe.scheduler.config.num_train_timesteps
    modes = predicted_gate_modes(pipe.scheduler, gate)
    return [("transformer" if t >= boundary else "transformer_2", modes[i])
            for i, t in enumerate(pipe.scheduler.timesteps.tolist())]


@pytest.fixture(scope="module")
def pipe():
    pipeline = tiny_wan22_pipeline()
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def generate(pipe, steps=8, **kwargs):
    return pipe("a fox in snow", negative_prompt="blur", height=96, width=160, num_frames=5,
                num_inference_steps=steps, generator=torch.Generator().manual_seed(0), output_type="pt",
                **kwargs).frames


def test_pipeline_gate_switches_at_the_step_the_scheduler_predicts(pipe):
    gate = 0.8
    config = {"default": {"backend": "TORCH_REFERENCE",
                          "skip_softmax": {"threshold": 0.3, "disabled_until_timestep": gate}}}
    with enable_trtllm_attention(pipe, config) as handle:
        generate(pipe)
    expected = expected_modes(pipe, 8, gate)
    assert {e for e, _ in expected} == {"transformer", "transformer_2"}  # both experts ran
    assert any(m == "skip" for _, m in expected) and any(m == "dense" for _, m in expected)
    for step, (expert, mode) in enumerate(expected):
        records = {layer: rec for (s, layer, *_), rec in handle.stats.records.items() if s == step}
        assert records and all(layer.startswith(expert + ".") for layer in records), (step, list(records))
        assert {rec.mode for rec in records.values()} == {mode}, step
        assert all(rec.calls == 2 for rec in records.values())  # conditional + unconditional call
    per_step = handle.stats.per_step()
    assert all(per_step[s] is None for s, (_, m) in enumerate(expected) if m == "dense")  # the gate: no skipping


def test_enable_and_restore_on_both_experts(pipe):
    originals = {name: {k: type(v) for k, v in getattr(pipe, name).attn_processors.items()}
                 for name in ("transformer", "transformer_2")}
    dense = generate(pipe, steps=3)
    handle = enable_trtllm_attention(pipe, {"default": {"backend": "TORCH_SDPA"}})
    assert handle.components == ("transformer", "transformer_2")
    assert all(isinstance(p, WanTrtllmAttnProcessor) for p in pipe.transformer_2.attn_processors.values())
    assert torch.allclose(generate(pipe, steps=3), dense, atol=1e-5)
    handle.restore()
    for name, procs in originals.items():
        assert {k: type(v) for k, v in getattr(pipe, name).attn_processors.items()} == procs
    assert all(isinstance(p, WanAttnProcessor) for p in pipe.transformer.attn_processors.values())
    assert not pipe.transformer._forward_pre_hooks


def test_per_component_and_glob_roles_reach_the_right_layers(pipe):
    config = {"default": {"backend": "TORCH_SDPA"},
              "per_role": {"transformer_2": {"backend": "TORCH_REFERENCE"},
                           "transformer.blocks.1.*": {"backend": "TORCH_REFERENCE",
                                                      "quant": {"dtype_qk": "int8"}}}}
    with enable_trtllm_attention(pipe, config) as handle:
        generate(pipe, steps=4)
    seen = {layer: (rec.backend, rec.mode) for (_, layer, *_), rec in handle.stats.records.items()}
    assert seen["transformer.blocks.0.attn1"] == ("TORCH_SDPA", "dense")
    assert seen["transformer.blocks.1.attn2"] == ("TORCH_REFERENCE", "sage-int8")
    assert seen["transformer_2.blocks.0.attn1"] == ("TORCH_REFERENCE", "dense")


def test_install_time_errors(pipe):
    with pytest.raises(AttentionConfigError, match="matches no attention layer"):
        enable_trtllm_attention(pipe, {"per_role": {"transformer_3": {}}})
    with pytest.raises(AttentionConfigError, match=r"target_sparsity=0.5 .* no Skip-Softmax calibration"):
        enable_trtllm_attention(pipe, {"default": {"skip_softmax": {"target_sparsity": 0.5}}})
    # a failed install leaves the pipeline as it was
    assert all(isinstance(p, WanAttnProcessor) for p in pipe.transformer.attn_processors.values())


def test_target_sparsity_resolves_through_the_component_calibration(pipe):
    calib = {"transformer": SkipCalibration(a=2.0, b=4.0), "transformer_2": SkipCalibration(a=4.0, b=4.0)}  # λ < 1
    config = {"default": {"backend": "TORCH_REFERENCE", "skip_softmax": {"target_sparsity": 0.5}}}
    with enable_trtllm_attention(pipe, config, calibrations=calib) as handle:
        generate(pipe, steps=4)
        for component in calib:
            proc = getattr(pipe, component).blocks[0].attn1.processor
            assert float(proc.calls["self_attn"].skip_value) == pytest.approx(calib[component].factor(0.5))
    assert handle.stats.summary()["sparsity"] is not None


def test_two_pipelines_never_share_timestep_state():
    first, second = tiny_wan22_pipeline(two_experts=False), tiny_wan22_pipeline(two_experts=False)
    for p in (first, second):
        p.set_progress_bar_config(disable=True)
    config = {"default": {"backend": "TORCH_SDPA"}}
    with enable_trtllm_attention(first, config) as h1, enable_trtllm_attention(second, config) as h2:
        generate(first, steps=3)
        assert list(h1.stats.per_step()) == [0, 1, 2] and h2.stats.per_step() == {}
        generate(second, steps=5)
        assert list(h1.stats.per_step()) == [0, 1, 2] and list(h2.stats.per_step()) == [0, 1, 2, 3, 4]

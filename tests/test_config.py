"""The config contract: the TRTLLM_ATTN user guide's ranges and rules, JSON forms, per-role resolution, CLI/env."""

import argparse
import math

import pytest

from diffusers_trtllm import (AttentionConfig, AttentionConfigError, AttentionSpec, AttnQuantSpec, SkipSoftmaxSpec,
                              add_attention_args, config_from_args)

GUIDE_SKIP_JSON = ('{"default":{"backend":"TRTLLM_ATTN",'
                   '"skip_softmax":{"target_sparsity":0.65,"disabled_until_timestep":0.86}}}')
GUIDE_SAGE_JSON = ('{"default":{"backend":"TRTLLM_ATTN",'
                   '"quant":{"dtype_qk":"fp8_e4m3","q_block_size":1,"k_block_size":16}}}')


def test_guide_json_examples_parse_to_the_python_forms():
    skip = AttentionConfig.from_json(GUIDE_SKIP_JSON)
    assert skip == AttentionConfig(default=AttentionSpec(
        backend="TRTLLM_ATTN", skip_softmax=SkipSoftmaxSpec(target_sparsity=0.65, disabled_until_timestep=0.86)))
    sage = AttentionConfig.from_json(GUIDE_SAGE_JSON)
    assert sage.default.quant == AttnQuantSpec(dtype_qk="fp8_e4m3", q_block_size=1, k_block_size=16)
    assert AttentionConfig.from_json(sage.to_json()) == sage


def test_defaults_and_dense_quant():
    assert AttnQuantSpec() == AttnQuantSpec(None, None, None)  # unset blocks: the GPU's fastest SAGE kernel
    assert SkipSoftmaxSpec().disabled_until_timestep == 0.0
    # dtype_qk absent means dense: the spec drops the no-op quant
    assert AttentionSpec(quant=AttnQuantSpec()).quant is None


@pytest.mark.parametrize("field,kwargs,fragment", [
    ("skip_softmax.target_sparsity", dict(target_sparsity=1.5), "[0, 1]"),
    ("skip_softmax.target_sparsity", dict(target_sparsity=-0.1), "[0, 1]"),
    ("skip_softmax.target_sparsity", dict(target_sparsity=math.nan), "finite"),
    ("skip_softmax.target_sparsity", dict(target_sparsity="0.5"), "finite"),
    ("skip_softmax.threshold", dict(threshold=-1.0), ">= 0"),
    ("skip_softmax.threshold", dict(threshold=math.inf), "finite"),
    ("skip_softmax.threshold", dict(threshold=True), "finite"),
    ("skip_softmax.disabled_until_timestep", dict(disabled_until_timestep=1.2), "[0, 1]"),
    ("skip_softmax.disabled_until_timestep", dict(disabled_until_timestep=-math.inf), "[0, 1]"),
])
def test_invalid_skip_softmax_values_name_field_value_and_range(field, kwargs, fragment):
    with pytest.raises(AttentionConfigError) as err:
        SkipSoftmaxSpec(**kwargs)
    message = str(err.value)
    assert field in message and fragment in message
    assert repr(next(iter(kwargs.values())))[:3] in message or "nan" in message


def test_target_sparsity_and_threshold_are_mutually_exclusive():
    with pytest.raises(AttentionConfigError, match="mutually exclusive"):
        SkipSoftmaxSpec(target_sparsity=0.5, threshold=0.1)


def test_threshold_at_or_above_one_warns():
    with pytest.warns(UserWarning, match="skips nearly every"):
        SkipSoftmaxSpec(threshold=1.0)


@pytest.mark.parametrize("kwargs,field,value", [
    (dict(dtype_qk="fp16"), "quant.dtype_qk", "'fp16'"),
    (dict(dtype_qk="fp8"), "quant.dtype_qk", "'fp8'"),
    (dict(dtype_qk="int8", q_block_size=2), "quant.q_block_size", "2"),
    (dict(dtype_qk="int8", k_block_size=32), "quant.k_block_size", "32"),
    (dict(dtype_qk="int8", k_block_size=0), "quant.k_block_size", "0"),
    (dict(dtype_qk="int8", q_block_size=True), "quant.q_block_size", "True"),
])
def test_invalid_quant_values(kwargs, field, value):
    with pytest.raises(AttentionConfigError) as err:
        AttnQuantSpec(**kwargs)
    message = str(err.value)
    assert f"{field}={value}" in message
    assert "int8" in message or "[1, 4, 16]" in message


@pytest.mark.parametrize("spec", [
    {"backend": "TORCH_SDPA", "skip_softmax": {"threshold": 0.1}},
    {"backend": "TORCH_SDPA", "quant": {"dtype_qk": "int8"}},
])
def test_features_only_on_backends_that_support_them(spec):
    with pytest.raises(AttentionConfigError, match="runs dense attention only"):
        AttentionSpec.from_dict(spec)


def test_unknown_backend_and_keys_are_rejected_with_valid_choices():
    with pytest.raises(AttentionConfigError, match=r"backend='FLASH'.*TRTLLM_ATTN"):
        AttentionSpec(backend="FLASH")
    with pytest.raises(AttentionConfigError, match=r"unknown key\(s\) \['sparsity'\].*target_sparsity"):
        AttentionConfig.from_dict({"default": {"skip_softmax": {"sparsity": 0.5}}})
    with pytest.raises(AttentionConfigError, match="unknown key"):
        AttentionConfig.from_dict({"defaults": {}})
    with pytest.raises(AttentionConfigError, match="not valid JSON"):
        AttentionConfig.from_json("{default:")
    with pytest.raises(AttentionConfigError, match=r"per_role\['cross'\].*quant.dtype_qk"):
        AttentionConfig.from_dict({"per_role": {"cross": {"quant": {"dtype_qk": "int4"}}}})


def test_backend_aliases():
    assert AttentionSpec(backend="trtllm-gen").backend == "TRTLLM_ATTN"
    assert AttentionSpec(backend="torch_sdpa").backend == "TORCH_SDPA"
    assert AttentionSpec(backend="AUTO").backend == "auto"


def test_per_role_resolution_order():
    sdpa, ref, trt = ({"backend": b} for b in ("TORCH_SDPA", "TORCH_REFERENCE", "TRTLLM_ATTN"))
    config = AttentionConfig.from_dict({"default": {"backend": "auto"}, "per_role": {
        "cross": sdpa, "self_attn": ref, "transformer_2": trt, "transformer_2.cross": ref,
        "transformer.blocks.1.*": sdpa}})
    resolve = config.resolve
    assert resolve("transformer", "blocks.0.attn1", "self_attn", "self") == ("self_attn", config.per_role["self_attn"])
    assert resolve("transformer", "blocks.0.attn2", "cross_attn", "cross")[0] == "cross"
    assert resolve("transformer", "blocks.1.attn1", "self_attn", "self")[0] == "transformer.blocks.1.*"
    assert resolve("transformer_2", "blocks.0.attn2", "cross_attn", "cross")[0] == "transformer_2.cross"
    assert resolve("transformer_2", "blocks.0.attn1", "self_attn", "self")[0] == "self_attn"
    assert resolve("transformer_2", "blocks.0.attn1", "joint_attn", "joint")[0] == "transformer_2"
    assert resolve("transformer", "blocks.0.attn1", "joint_attn", "joint") == ("default", config.default)


def test_check_keys_rejects_a_key_that_names_no_layer():
    sites = [("transformer", "blocks.0.attn1", "self_attn", "self")]
    AttentionConfig.from_dict({"per_role": {"self": {}, "blocks.*": {}, "transformer.self_attn": {}}}).check_keys(sites)
    with pytest.raises(AttentionConfigError, match=r"'slef'.*self_attn"):
        AttentionConfig.from_dict({"per_role": {"slef": {}}}).check_keys(sites)


def parse(argv, environ=None):
    args = add_attention_args(argparse.ArgumentParser()).parse_args(argv)
    return config_from_args(args, environ or {})


def test_cli_flags_build_the_design_document_configs():
    assert parse([]) == AttentionConfig()
    assert parse(["--diffusion-attention-backend", "trtllm-gen"]).default == AttentionSpec("TRTLLM_ATTN")
    sage_skip = parse(["--diffusion-attention-backend", "trtllm-gen", "--trtllm-gen-sage",
                       "--trtllm-gen-target-sparsity", "0.5", "--trtllm-gen-disabled-until-timestep", "0.6"]).default
    assert sage_skip.quant == AttnQuantSpec("fp8_e4m3", 1, 16)
    assert sage_skip.skip_softmax == SkipSoftmaxSpec(target_sparsity=0.5, disabled_until_timestep=0.6)
    assert parse(["--diffusion-attention-config", GUIDE_SKIP_JSON]) == AttentionConfig.from_json(GUIDE_SKIP_JSON)


def test_environment_variables_mirror_the_flags():
    env = {"DIFFUSION_ATTENTION_BACKEND": "TRTLLM_ATTN", "TRTLLM_GEN_SAGE": "1",
           "TRTLLM_GEN_TARGET_SPARSITY": "0.65", "TRTLLM_GEN_DISABLED_UNTIL_TIMESTEP": "0.86"}
    from_env = config_from_args(None, env)
    assert from_env == parse(["--diffusion-attention-backend", "TRTLLM_ATTN", "--trtllm-gen-sage",
                              "--trtllm-gen-target-sparsity", "0.65", "--trtllm-gen-disabled-until-timestep", "0.86"])
    assert config_from_args(None, {"TRTLLM_GEN_SAGE": "0"}) == AttentionConfig()
    assert config_from_args(None, {"DIFFUSION_ATTENTION_CONFIG": GUIDE_SAGE_JSON}).default.quant.dtype_qk == "fp8_e4m3"


@pytest.mark.parametrize("argv,env,match", [
    (["--diffusion-attention-backend", "TORCH_SDPA"], {"DIFFUSION_ATTENTION_BACKEND": "TRTLLM_ATTN"}, "contradicts"),
    (["--diffusion-attention-backend", "TORCH_SDPA", "--trtllm-gen-sage"], {}, "the backend is TORCH_SDPA"),
    (["--diffusion-attention-backend", "TORCH_SDPA", "--diffusion-attention-config", GUIDE_SKIP_JSON], {},
     "contradicts the config's default backend"),
    (["--diffusion-attention-config", GUIDE_SKIP_JSON, "--trtllm-gen-target-sparsity", "0.3"], {},
     "contradict the config's skip_softmax"),
    (["--diffusion-attention-config", GUIDE_SAGE_JSON.replace("fp8_e4m3", "int8"), "--trtllm-gen-sage"], {},
     "contradicts the config's quant"),
    ([], {"TRTLLM_GEN_SAGE": "maybe"}, "TRTLLM_GEN_SAGE='maybe'"),
    ([], {"TRTLLM_GEN_TARGET_SPARSITY": "lots"}, "TRTLLM_GEN_TARGET_SPARSITY='lots'"),
    (["--trtllm-gen-target-sparsity", "2"], {}, r"skip_softmax.target_sparsity=2.0"),
])
def test_contradictory_or_invalid_cli_settings_raise(argv, env, match):
    with pytest.raises(AttentionConfigError, match=match):
        parse(argv, env)

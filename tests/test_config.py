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
    (dict(dtype_qk="int8", q_block_size=16.0), "quant.q_block_size", "16.0"),  # a float is not a block size
    (dict(dtype_qk="int8", k_block_size=16.0), "quant.k_block_size", "16.0"),
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


WAN_SITES = [(component, f"blocks.{i}.attn{n}", role, category)
             for component in ("transformer", "transformer_2") for i in range(3)
             for n, role, category in ((1, "self_attn", "self"), (2, "cross_attn", "cross"))]


@pytest.mark.parametrize("key", ["joint", "joint_attn", "transformer_3", "transformer.joint", "blocks.7.attn1"])
def test_check_keys_refuses_what_the_model_lacks_and_names_what_it_has(key):
    config = AttentionConfig.from_dict({"per_role": {key: {"backend": "TORCH_SDPA"}}})
    with pytest.raises(AttentionConfigError) as err:
        config.resolve_sites(WAN_SITES)
    message = str(err.value)
    assert repr(key) in message
    assert "['cross', 'self']" in message and "['cross_attn', 'self_attn']" in message
    assert "['transformer', 'transformer_2']" in message


def test_an_exact_layer_name_beats_every_glob():
    """The README's promise: with a glob inserted first, the exact name still wins (the old code took the glob)."""
    config = AttentionConfig.from_dict({"per_role": {"transformer.blocks.*": {"backend": "TORCH_SDPA"},
                                                     "transformer.blocks.1.attn1": {"backend": "TORCH_REFERENCE"},
                                                     "blocks.2.attn1": {"backend": "TRTLLM_ATTN"}}})
    resolved = config.resolve_sites(WAN_SITES)
    assert resolved[("transformer", "blocks.1.attn1", "self_attn", "self")][0] == "transformer.blocks.1.attn1"
    assert resolved[("transformer", "blocks.2.attn1", "self_attn", "self")][0] == "blocks.2.attn1"
    assert resolved[("transformer", "blocks.0.attn1", "self_attn", "self")][0] == "transformer.blocks.*"
    assert config.resolve("transformer", "blocks.1.attn1", "self_attn", "self")[1].backend == "TORCH_REFERENCE"


@pytest.mark.parametrize("order", [1, -1])
def test_the_glob_matching_fewer_layers_wins_whatever_the_order(order):
    keys = [("blocks.*", "TORCH_SDPA"), ("transformer_2.blocks.1.*", "TORCH_REFERENCE"), ("*.attn2", "TRTLLM_ATTN")]
    config = AttentionConfig.from_dict({"per_role": {k: {"backend": b} for k, b in keys[::order]}})
    resolved = config.resolve_sites([s for s in WAN_SITES if s[1] != "blocks.1.attn2"])
    assert resolved[("transformer_2", "blocks.1.attn1", "self_attn", "self")][0] == "transformer_2.blocks.1.*"
    assert resolved[("transformer", "blocks.1.attn1", "self_attn", "self")][0] == "blocks.*"
    assert resolved[("transformer", "blocks.0.attn2", "cross_attn", "cross")][0] == "*.attn2"
    # resolve() given the model's sites ranks the same way
    assert config.resolve("transformer_2", "blocks.1.attn1", "self_attn", "self", sites=WAN_SITES)[0] == \
        "transformer_2.blocks.1.*"


@pytest.mark.parametrize("first,second", [
    ("blocks.1.*", "*.attn1"),               # overlap on blocks.1.attn1, neither contains the other
    ("transformer.blocks.*", "blocks.*"),    # the same layers on a one-component model
])
def test_globs_of_equal_rank_matching_one_layer_raise_naming_both(first, second):
    sites = [s for s in WAN_SITES if s[0] == "transformer"]
    config = AttentionConfig.from_dict({"per_role": {first: {}, second: {"backend": "TORCH_SDPA"}}})
    with pytest.raises(AttentionConfigError, match=r"both match transformer.blocks.[01].attn1") as err:
        config.resolve_sites(sites)
    assert repr(first) in str(err.value) and repr(second) in str(err.value)
    with pytest.raises(AttentionConfigError, match="neither is more specific"):
        config.resolve("transformer", "blocks.1.attn1", "self_attn", "self")  # this site alone: tied


def test_role_and_category_keys_follow_globs_in_the_documented_order():
    spec = {"backend": "TORCH_SDPA"}
    keys = ["transformer", "self", "self_attn", "transformer.self", "transformer.self_attn"]
    site = ("transformer", "blocks.0.attn1", "self_attn", "self")
    for n in range(len(keys), 0, -1):
        config = AttentionConfig.from_dict({"per_role": {k: spec for k in keys[:n]}})
        assert config.resolve_sites(WAN_SITES)[site][0] == keys[n - 1]


def parse(argv, environ=None):
    args = add_attention_args(argparse.ArgumentParser()).parse_args(argv)
    return config_from_args(args, environ or {})


def test_cli_flags_build_the_design_document_configs():
    assert parse([]) == AttentionConfig()
    assert parse(["--diffusion-attention-backend", "trtllm-gen"]).default == AttentionSpec("TRTLLM_ATTN")
    sage_skip = parse(["--diffusion-attention-backend", "trtllm-gen", "--trtllm-gen-sage",
                       "--trtllm-gen-target-sparsity", "0.5", "--trtllm-gen-disabled-until-timestep", "0.6"]).default
    assert sage_skip.quant == AttnQuantSpec("fp8_e4m3")  # blocks unset: the GPU's fastest kernel
    # A config's FP8 SAGE with block sizes refines the flag.
    assert parse(["--diffusion-attention-config", GUIDE_SAGE_JSON, "--trtllm-gen-sage"]).default.quant == \
        AttnQuantSpec("fp8_e4m3", 1, 16)
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


def test_install_applies_precedence_and_refuses_ties_and_missing_keys():
    """Through enable_trtllm_attention on the tiny Wan 2.2 pipeline: the exact layer beats the glob inserted
    before it, nested globs rank by the layers they match, and ties or keys the model lacks raise at install."""
    import torch

    from diffusers_trtllm import enable_trtllm_attention
    from diffusers_trtllm.tiny_pipelines import tiny_wan22_pipeline

    pipe = tiny_wan22_pipeline()
    pipe.set_progress_bar_config(disable=True)
    config = {"default": {"backend": "TORCH_SDPA"}, "per_role": {
        "transformer.blocks.*": {"backend": "TORCH_REFERENCE"},
        "transformer.blocks.1.attn1": {"backend": "TORCH_SDPA"},
        "blocks.*": {"backend": "TORCH_SDPA"},  # matches both experts' layers: less specific than the first glob
    }}
    with enable_trtllm_attention(pipe, config) as handle:
        pipe("a fox", height=96, width=160, num_frames=5, num_inference_steps=2,
             generator=torch.Generator().manual_seed(0), output_type="latent")
    seen = {layer: rec.backend for (_, layer, *_), rec in handle.stats.records.items()}
    assert seen["transformer.blocks.1.attn1"] == "TORCH_SDPA"
    assert seen["transformer.blocks.0.attn1"] == seen["transformer.blocks.1.attn2"] == "TORCH_REFERENCE"
    assert seen["transformer_2.blocks.0.attn1"] == "TORCH_SDPA"
    for per_role, message in (({"*.attn1": {}, "transformer.blocks.1.*": {}}, "neither is more specific"),
                              ({"joint": {}}, r"'joint' matches no attention layer.*categories \['cross', 'self'\]")):
        with pytest.raises(AttentionConfigError, match=message):
            enable_trtllm_attention(pipe, {"per_role": per_role})

"""Config validation at its edges: range ends are accepted, one step past them refused, numbers come back as
floats, and every refusal names the field, the value and what is valid."""

import math
import re
import warnings

import pytest

from diffusers_trtllm import AttentionConfig, AttentionConfigError, AttentionSpec, AttnQuantSpec, SkipSoftmaxSpec
from diffusers_trtllm.config import BACKEND_NAMES, FEATURE_BACKENDS, AccuracySpec, finite_number


@pytest.mark.parametrize("field,value", [("target_sparsity", 0), ("target_sparsity", 1), ("threshold", 0),
                                         ("disabled_until_timestep", 0), ("disabled_until_timestep", 1)])
def test_range_ends_are_accepted_and_stored_as_floats(field, value):
    spec = SkipSoftmaxSpec(**{field: value})
    stored = getattr(spec, field)
    assert stored == value and type(stored) is float


@pytest.mark.parametrize("field,value,valid", [
    ("target_sparsity", 1.0000001, "a finite number in [0, 1]"),
    ("target_sparsity", -1e-9, "a finite number in [0, 1]"),
    ("threshold", -1e-9, "a finite number >= 0"),
    ("threshold", math.inf, "a finite number >= 0"),
    ("threshold", True, "a finite number >= 0"),
    ("disabled_until_timestep", 1.5, "a finite number in [0, 1]"),
    ("disabled_until_timestep", math.nan, "a finite number in [0, 1]"),
])
def test_values_past_the_range_are_refused_naming_field_value_and_range(field, value, valid):
    with pytest.raises(AttentionConfigError) as err:
        SkipSoftmaxSpec(**{field: value})
    assert str(err.value) == f"skip_softmax.{field}={float(value)!r} is invalid: expected {valid}" or \
        str(err.value) == f"skip_softmax.{field}={value!r} is invalid: expected {valid}"


def test_dicts_and_specs_are_taken_alike_and_unknown_keys_name_the_valid_ones():
    assert SkipSoftmaxSpec.from_dict({"threshold": 0.1}) == SkipSoftmaxSpec(threshold=0.1)
    assert AttnQuantSpec.from_dict({"dtype_qk": "int8", "k_block_size": 4}) == AttnQuantSpec("int8", None, 4)
    with pytest.raises(AttentionConfigError, match=re.escape(
            "skip_softmax: unknown key(s) ['treshold']; valid keys are "
            "['disabled_until_timestep', 'reuse_steps', 'reuse_test', 'target_sparsity', 'threshold']")):
        SkipSoftmaxSpec.from_dict({"treshold": 0.1})
    with pytest.raises(AttentionConfigError, match=re.escape(
            "quant: unknown key(s) ['dtype']; valid keys are ['disabled_below_timestep', 'disabled_until_timestep', "
            "'dtype_qk', 'k_block_size', 'q_block_size']")):
        AttnQuantSpec.from_dict({"dtype": "int8"})


@pytest.mark.parametrize("name,value", [("q_block_size", 2), ("k_block_size", 32), ("q_block_size", 16.0),
                                        ("k_block_size", True)])
def test_block_sizes_outside_every_kernels_name_them(name, value):
    with pytest.raises(AttentionConfigError) as err:
        AttnQuantSpec("int8", **{name: value})
    message = str(err.value)
    assert message.startswith(f"quant.{name}={value!r} is invalid: expected an int: one of [1, 4, 16] "
                              "(Triton, trtllm-gen) or ")
    assert ("64 (Hopper FMHAv2, fp8)" if name == "q_block_size" else "64, 128 (Hopper FMHAv2, fp8)") in message


@pytest.mark.parametrize("config,message", [
    ({"default": 3}, "default=3 is invalid: expected an AttentionSpec or a dict"),
    ({"per_role": [("self", {})]}, "per_role=[('self', {})] is invalid: expected a mapping of role -> spec"),
    ({"per_role": {"": {}}}, "per_role key='' is invalid: expected a non-empty string"),
    ({"per_role": {"self": {"backend": "nope"}}}, "per_role['self']: backend='nope' is invalid"),
    ({"per_role": {"self": {"skip_softmax": 3}}}, "per_role['self']: skip_softmax=3 is invalid: expected a "
                                                   "SkipSoftmaxSpec, a dict or null"),
    ({"default": {"quant": "int8"}}, "quant='int8' is invalid: expected an AttnQuantSpec, a dict or null"),
    ({"default": {"backend": "TORCH_SDPA", "quant": {"dtype_qk": "int8"}}},
     "quant is set but backend='TORCH_SDPA' runs dense attention only; quant needs one of "
     "['auto', 'TRTLLM_ATTN', 'TORCH_REFERENCE']"),
])
def test_malformed_configs_name_the_field_and_value(config, message):
    with pytest.raises(AttentionConfigError) as err:
        AttentionConfig(**config) if "default" not in config or isinstance(config["default"], int) or \
            "per_role" in config else AttentionConfig.from_dict(config)
    assert str(err.value).startswith(message)


def test_top_level_shapes_are_refused_naming_what_is_expected():
    with pytest.raises(AttentionConfigError, match=re.escape(
            "attention config=[] is invalid: expected a JSON object like {\"default\": {\"backend\": \"TRTLLM_ATTN\"}}")):
        AttentionConfig.from_dict([])
    with pytest.raises(AttentionConfigError, match=re.escape(
            "attention config: unknown key(s) ['roles']; valid keys are ['default', 'per_role']")):
        AttentionConfig.from_dict({"roles": {}})
    with pytest.raises(AttentionConfigError, match=re.escape("spec=1 is invalid: expected a mapping with keys")):
        AttentionSpec.from_dict(1)
    config = AttentionConfig.from_dict({"per_role": {"self": AttentionSpec("TORCH_SDPA"), "cross": {}}})
    assert config.per_role["self"] == AttentionSpec("TORCH_SDPA") and config.per_role["cross"] == AttentionSpec()
    assert AttentionConfig.from_json(config.to_json()) == config


@pytest.mark.parametrize("bounds,value,valid", [
    ({}, "a", "a finite number"), ({"high": 1.0}, 2, "a finite number <= 1"),
    ({"above": 0.0}, 0, "a finite number > 0"),
    ({"low": 0.5}, 0.25, "a finite number >= 0.5"), ({"high": 1.0, "above": 0.0}, 2, "a finite number <= 1 and > 0")])
def test_a_number_outside_its_bounds_is_refused_naming_every_bound(bounds, value, valid):
    with pytest.raises(AttentionConfigError) as refused:
        finite_number("x", value, **bounds)
    assert str(refused.value) == f"x={value!r} is invalid: expected {valid}"


@pytest.mark.parametrize("quant,message", [
    ({"disabled_below_timestep": 0.1},
     "quant.disabled_below_timestep=0.1 is invalid: expected 0 unless quant.dtype_qk is set (it schedules SAGE)"),
    ({"dtype_qk": "int8", "disabled_until_timestep": 0.5, "disabled_below_timestep": 0.5},
     "quant.disabled_below_timestep=0.5 is invalid: expected a value below quant.disabled_until_timestep=0.5 (SAGE "
     "runs where disabled_below_timestep <= t <= disabled_until_timestep)")])
def test_a_sage_schedule_is_refused_with_the_whole_rule(quant, message):
    with pytest.raises(AttentionConfigError) as refused:
        AttnQuantSpec.from_dict(quant)
    assert str(refused.value) == message


def test_a_sage_schedule_takes_its_range_ends_as_floats():
    spec = AttnQuantSpec.from_dict({"dtype_qk": "int8", "disabled_until_timestep": 1, "disabled_below_timestep": 0})
    assert (spec.disabled_until_timestep, spec.disabled_below_timestep) == (1.0, 0.0)
    assert type(spec.disabled_until_timestep) is float
    assert not AttnQuantSpec("int8", disabled_until_timestep=0).scheduled


def test_a_single_spec_is_taken_as_the_default():
    spec = AttentionSpec(backend="TORCH_SDPA")
    assert AttentionConfig.coerce(spec).default is spec


@pytest.mark.parametrize("threshold,warns", [(0.999, False), (1, True)])
def test_a_threshold_from_1_warns_that_it_skips_nearly_everything(threshold, warns):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        SkipSoftmaxSpec(threshold=threshold)
    assert [str(w.message) for w in caught] == (
        ["skip_softmax.threshold=1 >= 1 skips nearly every KV tile; typical values are 0.01-0.9"] if warns else [])


def test_an_unknown_backend_and_spec_key_are_refused_naming_what_is_valid():
    with pytest.raises(AttentionConfigError) as backend:
        AttentionSpec(backend="NOPE")
    assert str(backend.value) == (f"backend='NOPE' is invalid: expected one of {list(BACKEND_NAMES)} (aliases: "
                                  "['REFERENCE', 'SDPA', 'TRTLLM', 'TRTLLM-GEN', 'TRTLLM_GEN'])")
    with pytest.raises(AttentionConfigError) as key:
        AttentionSpec.from_dict({"backend": "auto", "skip": {}})
    assert str(key.value) == ("spec: unknown key(s) ['skip']; valid keys are ['accuracy', 'backend', "
                              "'dense_kernel', 'quant', 'skip_softmax']")


@pytest.mark.parametrize("name,value", [("skip_softmax", {"threshold": 0.1}), ("quant", {"dtype_qk": "int8"})])
def test_a_feature_on_a_dense_backend_is_refused_naming_the_feature(name, value):
    with pytest.raises(AttentionConfigError) as refused:
        AttentionSpec.from_dict({"backend": "TORCH_SDPA", name: value})
    assert str(refused.value) == (f"{name} is set but backend='TORCH_SDPA' runs dense attention only; {name} needs one "
                                  f"of {list(FEATURE_BACKENDS)}")


@pytest.mark.parametrize("sites,example", [
    ([("transformer_2", "blocks.3.attn2", "cross_attn", "cross")], "transformer_2.blocks.3.attn2"),
    ([], "transformer.blocks.0.attn1")])
def test_an_unknown_layer_key_is_refused_with_an_example_of_the_models_own(sites, example):
    config = AttentionConfig.from_dict({"per_role": {"transformer_2": {"backend": "TORCH_SDPA"},
                                                     "blocks.9.attn1": {"backend": "TORCH_SDPA"}}})
    with pytest.raises(AttentionConfigError) as refused:
        config.check_keys(sites + [("transformer_2", "blocks.0.attn1", "self_attn", "self")] if sites else [])
    components = "['transformer_2']" if sites else "[]"
    assert str(refused.value).startswith(f"per_role key {'blocks.9.attn1' if sites else 'transformer_2'!r} matches no")
    assert f"components {components}" in str(refused.value)
    assert str(refused.value).endswith(f"a layer name such as {example!r}, or a glob over layer names")


def test_the_accuracy_bound_is_stored_as_a_float():
    bound = AttentionSpec.from_dict({"accuracy": {"max_error": 1}}).accuracy.max_error
    assert bound == 1.0 and type(bound) is float


@pytest.mark.parametrize("backend", [None, 3])
def test_a_backend_that_is_not_a_string_is_refused_naming_the_valid_names(backend):
    with pytest.raises(AttentionConfigError) as refused:
        AttentionSpec.from_dict({"backend": backend})
    assert str(refused.value) == f"backend={backend!r} is invalid: expected one of {list(BACKEND_NAMES)}"


def test_two_tied_globs_are_refused_with_the_two_ways_out():
    config = AttentionConfig.from_dict({"per_role": {"blocks.1.*": {}, "*.attn1": {"backend": "TORCH_SDPA"}}})
    with pytest.raises(AttentionConfigError) as tied:
        config.resolve_sites([("transformer", "blocks.1.attn1", "self_attn", "self"),
                              ("transformer", "blocks.1.attn2", "cross_attn", "cross"),
                              ("transformer", "blocks.0.attn1", "self_attn", "self")])
    assert str(tied.value) == (
        "per_role keys 'blocks.1.*' and '*.attn1' both match transformer.blocks.1.attn1 and neither matches a strict "
        "subset of the other's layers, so neither is more specific; add an exact key for the layer or narrow one glob")


@pytest.mark.parametrize("accuracy", [AccuracySpec(probe_rows=8, max_error=0.1), {"probe_rows": 8, "max_error": 0.1}])
def test_with_accuracy_puts_the_probe_on_the_default_and_every_per_role_spec(accuracy):
    config = AttentionConfig.from_dict({"default": {"backend": "TORCH_REFERENCE"},
                                        "per_role": {"cross": {"backend": "TORCH_SDPA"},
                                                     "blocks.0.*": {"skip_softmax": {"threshold": 0.1}}}})
    probed = config.with_accuracy(accuracy)
    expected = AccuracySpec(probe_rows=8, max_error=0.1)
    assert probed.default == AttentionSpec("TORCH_REFERENCE", accuracy=expected)
    assert dict(probed.per_role) == {"cross": AttentionSpec("TORCH_SDPA", accuracy=expected),
                                     "blocks.0.*": AttentionSpec(skip_softmax=SkipSoftmaxSpec(threshold=0.1),
                                                                 accuracy=expected)}
    assert config.default.accuracy is None and config.per_role["cross"].accuracy is None  # the original is kept
    assert probed.with_accuracy(None) == config


def test_a_glob_using_every_wildcard_at_once_is_a_glob():
    sites = [("transformer", f"blocks.{i}.attn{n}", role, category) for i in (1, 2)
             for n, role, category in ((1, "self_attn", "self"), (2, "cross_attn", "cross"))]
    config = AttentionConfig.from_dict({"per_role": {"blocks.[1]*.attn?": {"backend": "TORCH_SDPA"}}})
    resolved = config.resolve_sites(sites)
    assert [resolved[site][0] for site in sites] == ["blocks.[1]*.attn?"] * 2 + ["default"] * 2

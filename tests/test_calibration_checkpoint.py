"""A Skip-Softmax curve and its checkpoint at their edges, without running a model: what ``SkipCalibration``
accepts and refuses, which layers a curve bound to a transformer keeps dense, and what is written into and read
from ``config.json`` and its sidecar."""

import json
import logging
from types import SimpleNamespace

import pytest
import torch
from diffusers import WanTransformer3DModel

from diffusers_trtllm import AttentionConfigError
from diffusers_trtllm.calibration import (SkipCalibration, calibrations_from_pretrained, calibrations_from_transformers,
                                          load_calibration, parse_sparse_attention_config, sparse_attention_config,
                                          write_calibration)
from diffusers_trtllm.tiny_pipelines import tiny_wan_transformer
from diffusers_trtllm.version import __version__

WAN_LAYERS = {"blocks.0.attn1", "blocks.0.attn2", "blocks.1.attn1", "blocks.1.attn2"}


@pytest.mark.parametrize("fields", [
    {"a": 0.5, "b": 0.5}, {"a": 1e-9, "b": 1e-9},  # a and b only need to be above 0
    {"target_sparsity": 0, "disabled_until_timestep": 1}, {"target_sparsity": 1, "disabled_until_timestep": 0},
    {"sparsity_range": (0, 1)}, {"sparsity_range": [0.3, 0.3]}])
def test_a_curve_takes_its_range_ends_and_stores_numbers_as_floats_and_lists_as_tuples(fields):
    curve = SkipCalibration(**{"a": 2.0, "b": 3.0, **fields}, ignore=["blocks.0.*"], targets=["WanAttention"])
    for name, value in fields.items():
        stored = getattr(curve, name)
        if name == "sparsity_range":
            assert stored == tuple(value) and all(type(x) is float for x in stored)
        else:
            assert stored == value
    assert (curve.ignore, curve.targets) == (("blocks.0.*",), ("WanAttention",))


@pytest.mark.parametrize("fields,message", [
    ({"a": 0}, "calibration.a=0 is invalid: expected a finite number > 0 (factor = a * exp(b * s))"),
    ({"b": -1.0}, "calibration.b=-1.0 is invalid: expected a finite number > 0 (factor = a * exp(b * s))"),
    ({"target_sparsity": 1.5},
     "calibration.target_sparsity=1.5 is invalid: expected a finite number in [0, 1] or None"),
    ({"disabled_until_timestep": -0.1},
     "calibration.disabled_until_timestep=-0.1 is invalid: expected a finite number in [0, 1] or None"),
    *[({"sparsity_range": value}, f"calibration.sparsity_range={value!r} is invalid: expected (low, high) with "
                                  "0 <= low <= high <= 1")
      for value in [(0.5, 0.4), (-0.1, 0.5), (0.2, 1.01), (0.1,), (0.1, 0.2, 0.3), (0.1, float("nan")), ("0", 0.5)]],
])
def test_a_curve_outside_its_ranges_is_refused_naming_the_field_and_value(fields, message):
    with pytest.raises(AttentionConfigError) as refused:
        SkipCalibration(**{"a": 2.0, "b": 3.0, **fields})
    assert str(refused.value) == message


def test_a_curve_bound_to_a_transformer_keeps_the_layers_of_other_classes_dense():
    transformer = tiny_wan_transformer()
    other_class = SkipCalibration(2.0, 3.0, targets=("LlamaAttention",))
    assert other_class.bind(transformer).dense_layers == WAN_LAYERS
    assert SkipCalibration(2.0, 3.0, targets=("WanAttention",)).bind(transformer).dense_layers == frozenset()
    # no targets: the curve is for any class; a model without attention processors has no layer to keep dense
    assert SkipCalibration(2.0, 3.0).bind(transformer).dense_layers == frozenset()
    assert other_class.bind(torch.nn.Linear(2, 2)).dense_layers == frozenset()
    bound = calibrations_from_transformers({"transformer": transformer}, {"transformer": other_class})["transformer"]
    assert all(bound.keeps_dense(layer) for layer in WAN_LAYERS) and not bound.keeps_dense("blocks.2.attn1")


def test_a_layer_is_kept_dense_by_an_ignore_pattern_or_by_its_class_alone():
    curve = SkipCalibration(2.0, 3.0, ignore=("blocks.1.*",), dense_layers=frozenset({"blocks.0.attn2"}))
    assert [curve.keeps_dense(layer) for layer in ("blocks.0.attn1", "blocks.0.attn2", "blocks.1.attn1")] == \
        [False, True, True]


def test_the_checkpoint_entry_is_modelopts_schema_with_this_package_as_producer():
    curve = SkipCalibration(7.93, 8.61, targets=("WanAttention",), ignore=("blocks.0.attn2",), target_sparsity=0.5,
                            disabled_until_timestep=0.9)
    group = {"algorithm": "skip_softmax", "targets": ["WanAttention"], "ignore": ["blocks.0.attn2"],
             "threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)", "prefill": {"a": 7.93, "b": 8.61}},
             "target_sparsity": {"prefill": 0.5}, "disabled_until_timestep": 0.9}
    assert sparse_attention_config(curve) == {"config_groups": {"group_0": group},
                                              "producer": {"name": "diffusers_trtllm", "version": __version__}}
    producer = {"name": "modelopt", "version": "0.47.0"}
    assert sparse_attention_config(curve, producer=producer)["producer"] == producer
    # nothing to say: no ignore, target or gate keys
    assert sparse_attention_config(SkipCalibration(2.0, 3.0))["config_groups"]["group_0"] == {
        "algorithm": "skip_softmax", "targets": [],
        "threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)", "prefill": {"a": 2.0, "b": 3.0}}}


def test_writing_keeps_diffusers_json_layout_and_needs_the_config_first(tmp_path):
    curve = SkipCalibration(2.0, 3.0)
    with pytest.raises(FileNotFoundError) as missing:
        write_calibration(tmp_path, curve)
    assert str(missing.value) == (f"{tmp_path / 'config.json'} does not exist: save the transformer (or "
                                  "transformer.save_config) there before writing its calibration")
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "WanTransformer3DModel"}))
    write_calibration(tmp_path, curve, {"observed_sparsity": [0.1, 0.4]})
    for name in ("config.json", "sparse_attention_calibration.json"):  # indented like diffusers' own config.json
        text = (tmp_path / name).read_text()
        assert text == json.dumps(json.loads(text), indent=2) + "\n"
    assert load_calibration(tmp_path).sparsity_range == (0.1, 0.4)


@pytest.mark.parametrize("extra,warned", [({}, False), ({"foo": 1}, True)])
def test_loading_drops_diffusers_unused_key_warning_only_when_the_calibration_is_the_only_key(tmp_path, caplog,
                                                                                             extra, warned):
    """diffusers keeps the calibration key in model.config (this package reads it there) yet warns that it is
    ignored; the warning stays for any other key. The entry's producer holds the warning's own words."""
    tiny_wan_transformer().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    entry = sparse_attention_config(SkipCalibration(2.0, 3.0), producer={"name": "values were passed to here"})
    (tmp_path / "config.json").write_text(json.dumps({**config, "sparse_attention_config": entry, **extra}))
    caplog.clear()
    model = WanTransformer3DModel.from_pretrained(tmp_path)
    assert model.config["sparse_attention_config"] == entry
    assert ("The config attributes" in caplog.text) == warned


@pytest.mark.parametrize("message", [
    "The config attributes were all read",
    "Some other attributes {'sparse_attention_config': 1} were passed to WanTransformer3DModel",  # same length
    "The config attributes {not a dict} were passed to WanTransformer3DModel"])
def test_other_diffusers_config_messages_are_kept(caplog, message):
    logging.getLogger("diffusers.configuration_utils").warning(message)
    assert [record.getMessage() for record in caplog.records] == [message]


def skip_group(**fields):
    return {"algorithm": "skip_softmax", "coefficients": {"a": 2.0, "b": 3.0}, **fields}


TSF_NOTE = '{"formula": "a * exp(b * target_sparsity)", "prefill": {"a": .., "b": ..}}'


@pytest.mark.parametrize("data,message", [
    ([1], "w=[1] is invalid: expected a JSON object with 'config_groups'"),
    ({"config_groups": {}}, 'w.config_groups={} is invalid: expected a non-empty object of groups like '
                            '{"group_0": {"algorithm": "skip_softmax", ...}}'),
    ({"config_groups": {"g": 3}}, "w.config_groups.g=3 is invalid: expected a JSON object with 'algorithm'"),
    ({"config_groups": {"g": {"algorithm": "top_k"}}},
     "w.config_groups.g.algorithm='top_k' is invalid: expected one of ['skip_softmax', 'softmax_skip'] (or "
     "['sparse_softmax', 'triton_sparse_softmax'], which are ignored)"),
    ({"config_groups": {"g": skip_group(), "h": {"sparse_algo": "softmax_skip", "coefficients": {"a": 1, "b": 1}}}},
     "w: 2 skip_softmax groups (['w.config_groups.g', 'w.config_groups.h']); one curve per component is supported"),
    ({"config_groups": {"g": skip_group(threshold_scale_factor=3)}},
     f"w.config_groups.g.threshold_scale_factor=3 is invalid: expected an object like {TSF_NOTE}"),
    ({"config_groups": {"g": skip_group(threshold_scale_factor={"decode": {"a": 1, "b": 1}})}},
     "w.config_groups.g.threshold_scale_factor={'decode': {'a': 1, 'b': 1}} has no 'prefill' coefficients "
     '{"a": .., "b": ..} (diffusion attention is prefill only; \'decode\' is not used)'),
    # a formula is named where it is: in the factor, else beside it in the group
    ({"config_groups": {"g": skip_group(threshold_scale_factor={"formula": "a*b", "prefill": {"a": 1, "b": 1}})}},
     "w.config_groups.g.threshold_scale_factor.formula='a*b' is invalid: expected 'a * exp(b * target_sparsity)' "
     "(whitespace ignored)"),
    ({"config_groups": {"g": skip_group(formula="a*b", threshold_scale_factor={"prefill": {"a": 1, "b": 1}})}},
     "w.config_groups.g.formula='a*b' is invalid: expected 'a * exp(b * target_sparsity)' (whitespace ignored)"),
    ({"config_groups": {"g": skip_group(formula=3)}},
     "w.config_groups.g.formula=3 is invalid: expected 'a * exp(b * target_sparsity)' (whitespace ignored)"),
    ({"config_groups": {"g": {"algorithm": "skip_softmax"}}},
     "w.config_groups.g has no coefficients: expected 'w.config_groups.g.threshold_scale_factor.prefill' (ModelOpt "
     "0.45+), 'w.threshold_scale_factor.prefill' (ModelOpt 0.44) or 'w.config_groups.g.coefficients', each "
     '{"a": .., "b": ..}'),
    *[({"config_groups": {"g": skip_group(coefficients=value)}},
       f'w.config_groups.g.coefficients={value!r} is invalid: expected {{"a": <number > 0>, "b": <number > 0>}}')
      for value in ([1, 2], {"b": 1.0}, {"a": 1.0})],
    *[({"config_groups": {"g": skip_group(coefficients={"a": 1.0, "b": 1.0, name: 0})}},
       f"w.config_groups.g.coefficients.{name}=0 is invalid: expected a finite number > 0 (factor = a * exp(b * "
       "target_sparsity) must be positive and grow with the target sparsity)") for name in "ab"],
    ({"config_groups": {"g": skip_group(ignore=("blocks.0.*", 3))}},
     "w.config_groups.g.ignore=('blocks.0.*', 3) is invalid: expected a list of strings"),
    ({"config_groups": {"g": skip_group(targets=["WanAttention", None])}},
     "w.config_groups.g.targets=['WanAttention', None] is invalid: expected a list of strings"),
    ({"config_groups": {"g": skip_group(target_sparsity={"prefill": 2})}},
     "w.config_groups.g.target_sparsity.prefill=2 is invalid: expected a finite number in [0, 1]"),
    ({"config_groups": {"g": skip_group(disabled_until_timestep=1.5)}},
     "w.config_groups.g.disabled_until_timestep=1.5 is invalid: expected a finite number in [0, 1]"),
])
def test_a_malformed_entry_is_refused_with_the_whole_message(data, message):
    with pytest.raises(AttentionConfigError) as refused:
        parse_sparse_attention_config(data, where="w")
    assert str(refused.value) == message


SIDECAR_FIELD = "w sidecar sparse_attention_calibration.json: observed_sparsity"


@pytest.mark.parametrize("sidecar,expected", [
    (None, None), ({}, None), ({"observed_sparsity": None}, None), ({"observed_sparsity": (0, 1)}, (0.0, 1.0)),
    ({"observed_sparsity": [0.1]}, f"{SIDECAR_FIELD}=[0.1] is invalid: expected [low, high]"),
    ({"observed_sparsity": "0.1, 0.4"}, f"{SIDECAR_FIELD}='0.1, 0.4' is invalid: expected [low, high]"),
    ({"observed_sparsity": [-0.1, 0.4]}, f"{SIDECAR_FIELD}[0]=-0.1 is invalid: expected a finite number in [0, 1]"),
    ({"observed_sparsity": [0.1, 2]}, f"{SIDECAR_FIELD}[1]=2 is invalid: expected a finite number in [0, 1]"),
])
def test_the_sidecars_observed_range_is_read_or_refused_naming_the_sidecar(sidecar, expected):
    data = {"config_groups": {"g": skip_group()}}
    if expected is None or isinstance(expected, tuple):
        assert parse_sparse_attention_config(data, where="w", sidecar=sidecar).sparsity_range == expected
        return
    with pytest.raises(AttentionConfigError) as refused:
        parse_sparse_attention_config(data, where="w", sidecar=sidecar)
    assert str(refused.value) == expected


def test_where_the_coefficients_are_read_from_when_several_are_given():
    """The group's factor before the top level's (0.44), 'prefill' before 'coefficients' inside a factor; a bare
    ``coefficients`` only without a factor; 'algorithm' before 'sparse_algo'."""
    factor = {"prefill": {"a": 1.0, "b": 2.0}, "coefficients": {"a": 3.0, "b": 4.0}}
    group = skip_group(threshold_scale_factor=factor, coefficients={"a": 5.0, "b": 6.0})
    top = {"prefill": {"a": 7.0, "b": 8.0}}
    curve = parse_sparse_attention_config({"config_groups": {"g": group}, "threshold_scale_factor": top})
    assert (curve.a, curve.b) == (1.0, 2.0)
    group["threshold_scale_factor"] = {"coefficients": {"a": 3.0, "b": 4.0}}
    assert parse_sparse_attention_config({"config_groups": {"g": group}}).a == 3.0
    del group["threshold_scale_factor"]
    assert parse_sparse_attention_config({"config_groups": {"g": group}, "threshold_scale_factor": top}).a == 7.0
    assert parse_sparse_attention_config({"config_groups": {"g": group}}).a == 5.0
    assert parse_sparse_attention_config({"config_groups": {"g": {**group, "sparse_algo": "top_k"}}}).a == 5.0


def test_groups_of_other_modelopt_algorithms_are_ignored_by_name_beside_the_skip_group(caplog):
    data = {"config_groups": {"n_m": {"sparse_algo": "triton_sparse_softmax"}, "g": skip_group()}}
    assert parse_sparse_attention_config(data, where="w").a == 2.0
    assert [record.getMessage() for record in caplog.records] == [
        "w.config_groups.n_m.sparse_algo='triton_sparse_softmax': diffusers_trtllm runs Skip-Softmax only; this "
        "group is ignored"]


def test_a_bare_group_has_no_ignore_targets_target_or_gate():
    curve = parse_sparse_attention_config({"config_groups": {"g": skip_group(target_sparsity={"decode": 0.5})}})
    assert (curve.ignore, curve.targets, curve.target_sparsity, curve.disabled_until_timestep, curve.source) == \
        ((), (), None, None, "sparse_attention_config")


def write_checkpoint(folder, entry, sidecar=None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"_class_name": "WanTransformer3DModel",
                                                    **({} if entry is None else {"sparse_attention_config": entry})}))
    if sidecar is not None:
        (folder / "sparse_attention_calibration.json").write_text(sidecar)


def test_a_pipeline_folder_gives_the_curves_of_the_components_that_have_one(tmp_path):
    write_checkpoint(tmp_path / "transformer", sparse_attention_config(SkipCalibration(2.0, 3.0)),
                     json.dumps({"observed_sparsity": [0.1, 0.4]}))
    write_checkpoint(tmp_path / "transformer_2", None)  # a config without a curve
    (tmp_path / "vae").mkdir()
    found = calibrations_from_pretrained(tmp_path)
    assert list(found) == ["transformer"] and (found["transformer"].a, found["transformer"].sparsity_range) == \
        (2.0, (0.1, 0.4))
    assert found["transformer"].source == f"{tmp_path / 'transformer' / 'config.json'}: sparse_attention_config"
    assert calibrations_from_pretrained(tmp_path, components=("transformer_2",)) == {}
    assert load_calibration(tmp_path / "transformer_2") is None


@pytest.mark.parametrize("name,text", [("config.json", "{'a': 1}"), ("sparse_attention_calibration.json", "[0.1,")])
def test_a_file_that_is_not_json_is_refused_naming_it(tmp_path, name, text):
    write_checkpoint(tmp_path, sparse_attention_config(SkipCalibration(2.0, 3.0)), "{}")
    (tmp_path / name).write_text(text)
    with pytest.raises(AttentionConfigError) as refused:
        load_calibration(tmp_path)
    assert str(refused.value).startswith(f"{tmp_path / name} is not valid JSON: ")


def test_an_error_in_a_checkpoint_names_the_file_or_the_component():
    entry = {"config_groups": {"g": {"algorithm": "skip_softmax", "coefficients": {"a": -1.0, "b": 1.0}}}}
    with pytest.raises(AttentionConfigError, match=r"^transformer_2\.config\.sparse_attention_config\.config_groups"
                                                   r"\.g\.coefficients\.a=-1\.0 is invalid"):
        calibrations_from_transformers({"transformer_2": SimpleNamespace(config={"sparse_attention_config": entry})})


def test_loaded_transformers_give_their_curves_read_from_their_config_and_folder(tmp_path):
    """A model without a config or without the key has no curve (and does not stop the search); a loaded one's
    sidecar is read from the folder it was loaded from; an explicit curve replaces the one read, and one for a
    component that is not loaded is kept as given."""
    entry = sparse_attention_config(SkipCalibration(2.0, 3.0))
    write_checkpoint(tmp_path, entry, json.dumps({"observed_sparsity": [0.1, 0.4]}))
    loaded = SimpleNamespace(config={"sparse_attention_config": entry, "_name_or_path": str(tmp_path)})
    in_memory = SimpleNamespace(config={"sparse_attention_config": entry})  # no folder: no sidecar
    hub = SimpleNamespace(config={"sparse_attention_config": entry, "_name_or_path": "Wan-AI/Wan2.2-T2V-A14B"})
    found = calibrations_from_transformers({"plain": torch.nn.Linear(2, 2), "bare": SimpleNamespace(config=None),
                                            "other": SimpleNamespace(config={"foo": 1}), "transformer": loaded,
                                            "transformer_2": in_memory, "hub": hub})
    assert list(found) == ["transformer", "transformer_2", "hub"]
    assert [found[c].sparsity_range for c in found] == [(0.1, 0.4), None, None]
    explicit = {"transformer_2": SkipCalibration(5.0, 6.0), "transformer_3": SkipCalibration(7.0, 8.0, targets=("X",))}
    found = calibrations_from_transformers({"transformer": loaded, "transformer_2": in_memory}, explicit)
    assert {c: cal.a for c, cal in found.items()} == {"transformer": 2.0, "transformer_2": 5.0, "transformer_3": 7.0}
    assert found["transformer_3"] is explicit["transformer_3"]


def test_coefficients_below_1_are_read_as_given():
    curve = parse_sparse_attention_config({"config_groups": {"g": skip_group(coefficients={"a": 0.05, "b": 0.5})}})
    assert (curve.a, curve.b) == (0.05, 0.5)

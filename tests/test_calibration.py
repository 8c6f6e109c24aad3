"""Reading Skip-Softmax calibrations (three checkpoint shapes, malformed files), applying them (ignore, targets,
checkpoint defaults, install-time and plan-time errors and warnings), and the multi-λ skip counter."""

import copy
import json
import math
import warnings

import pytest
import torch

from diffusers_trtllm import AttentionConfig, AttentionConfigError, enable_trtllm_attention
from diffusers_trtllm.backends.reference import reference_attention
from diffusers_trtllm.calibration import (SkipCalibration, calibrations_from_pretrained, calibrations_from_transformers,
                                          count_skips, load_calibration, parse_sparse_attention_config, skip_gaps,
                                          sparse_attention_config, write_calibration)
from diffusers_trtllm.plan import CallPlanner, CallSite, HeadLayout, RoleTraits
from diffusers_trtllm.tiny_pipelines import tiny_wan22_pipeline, tiny_wan_transformer

MODELOPT_047 = {
    "config_groups": {"group_0": {
        "algorithm": "skip_softmax", "targets": ["WanAttention"], "ignore": ["blocks.0.attn2", "blocks.*.attn2"],
        "threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)", "prefill": {"a": 7.93, "b": 8.61},
                                   "decode": {"a": 0.12, "b": 9.85}},
        "target_sparsity": {"prefill": 0.5}}},
    "producer": {"name": "modelopt", "version": "0.47.0"}}
NVIDIA_WAN22 = {
    "config_groups": {"group_0": {
        "algorithm": "skip_softmax", "targets": ["WanAttention"], "coefficients": {"a": 2822.62, "b": 4.388},
        "target_sparsity": 0.75, "disabled_until_timestep": 0.86}},
    "producer": {"name": "modelopt", "version": "0.45.0"}}
MODELOPT_044 = {
    "config_groups": {"group_0": {"sparse_algo": "softmax_skip", "targets": ["WanAttention"]}},
    "threshold_scale_factor": {"formula": "a*exp( b*target_sparsity )", "prefill": {"a": 3.0, "b": 5.0}},
    "producer": {"name": "modelopt", "version": "0.44.0"}}
WAN_720P_TOKENS = 75_600


def test_modelopt_schema_loads():
    cal = parse_sparse_attention_config(MODELOPT_047)
    assert (cal.a, cal.b, cal.target_sparsity, cal.disabled_until_timestep) == (7.93, 8.61, 0.5, None)
    assert cal.targets == ("WanAttention",)
    assert cal.keeps_dense("blocks.7.attn2") and not cal.keeps_dense("blocks.7.attn1")


def test_nvidia_wan22_checkpoint_loads_and_matches_the_published_curve():
    cal = parse_sparse_attention_config(NVIDIA_WAN22)
    assert (cal.a, cal.b, cal.target_sparsity, cal.disabled_until_timestep) == (2822.62, 4.388, 0.75, 0.86)
    # published at 720p×81f: λ = 0.65 at s = 0.65 and 1.0 at s = 0.75
    assert cal.factor(0.65) / WAN_720P_TOKENS == pytest.approx(0.65, abs=0.01)
    assert cal.factor(0.75) / WAN_720P_TOKENS == pytest.approx(1.0, abs=0.01)


def test_modelopt_044_top_level_factor_loads():
    cal = parse_sparse_attention_config(MODELOPT_044)
    assert (cal.a, cal.b, cal.target_sparsity) == (3.0, 5.0, None)


def _with(data, path, value):
    """A deep copy of ``data`` with the dotted ``path`` set to ``value`` (deleted when value is ...)."""
    data = copy.deepcopy(data)
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node[key]
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return data


GROUP = "config_groups.group_0"
TSF = f"{GROUP}.threshold_scale_factor"


@pytest.mark.parametrize("data, field, value", [
    (_with(MODELOPT_047, f"{TSF}.formula", "a * b * target_sparsity"), f"{TSF}.formula", "a * b * target_sparsity"),
    (_with(MODELOPT_047, f"{TSF}.prefill.a", -3.0), f"{TSF}.prefill.a", "-3.0"),
    (_with(MODELOPT_047, f"{TSF}.prefill.b", -1.5), f"{TSF}.prefill.b", "-1.5"),
    (_with(MODELOPT_047, f"{TSF}.prefill.b", "8.6"), f"{TSF}.prefill.b", "'8.6'"),
    (_with(MODELOPT_047, f"{TSF}.prefill", ...), TSF, "no 'prefill' coefficients"),
    (_with(MODELOPT_047, f"{GROUP}.threshold_scale_factor", ...), GROUP, "has no coefficients"),
    (_with(NVIDIA_WAN22, f"{GROUP}.coefficients", {"a": 2822.62}), f"{GROUP}.coefficients", "{'a': 2822.62}"),
    (_with(NVIDIA_WAN22, f"{GROUP}.coefficients.a", -2822.62), f"{GROUP}.coefficients.a", "-2822.62"),
    (_with(MODELOPT_047, f"{GROUP}.algorithm", "top_k"), f"{GROUP}.algorithm", "'top_k'"),
    (_with(MODELOPT_044, "config_groups.group_0.sparse_algo", "skip"), f"{GROUP}.sparse_algo", "'skip'"),
    (_with(MODELOPT_044, "threshold_scale_factor.formula", "a*exp(-b*target_sparsity)"),
     "threshold_scale_factor.formula", "a*exp(-b*target_sparsity)"),
    (_with(NVIDIA_WAN22, f"{GROUP}.target_sparsity", 1.5), f"{GROUP}.target_sparsity", "1.5"),
    (_with(NVIDIA_WAN22, f"{GROUP}.disabled_until_timestep", -0.1), f"{GROUP}.disabled_until_timestep", "-0.1"),
    (_with(MODELOPT_047, f"{GROUP}.ignore", "blocks.0.attn2"), f"{GROUP}.ignore", "'blocks.0.attn2'"),
    ({"producer": {}}, "config_groups", "None"),
])
def test_malformed_checkpoints_name_field_and_value(data, field, value):
    with pytest.raises(AttentionConfigError) as info:
        parse_sparse_attention_config(data, where="transformer/config.json: sparse_attention_config")
    message = str(info.value)
    assert f"transformer/config.json: sparse_attention_config.{field}" in message
    assert value in message


def test_other_modelopt_algorithms_are_ignored_with_a_warning(caplog):
    data = {"config_groups": {"group_0": {"algorithm": "sparse_softmax", "sparsity_n": 2, "sparsity_m": 4}}}
    assert parse_sparse_attention_config(data) is None
    assert "sparse_softmax" in caplog.text


def test_write_then_read_round_trip(tmp_path):
    cal = SkipCalibration(a=0.05, b=19.0, ignore=("blocks.0.attn2",), targets=("WanAttention",),
                          target_sparsity=0.3, disabled_until_timestep=0.9, reuse_steps=2)
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "WanTransformer3DModel"}))
    write_calibration(tmp_path, cal, {"observed_sparsity": [0.1, 0.45]})
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["_class_name"] == "WanTransformer3DModel"
    group = config["sparse_attention_config"]["config_groups"]["group_0"]
    assert group["threshold_scale_factor"] == {"formula": "a * exp(b * target_sparsity)",
                                               "prefill": {"a": 0.05, "b": 19.0}}
    loaded = load_calibration(tmp_path)
    assert (loaded.a, loaded.b, loaded.ignore, loaded.targets) == (cal.a, cal.b, cal.ignore, cal.targets)
    assert (loaded.target_sparsity, loaded.disabled_until_timestep, loaded.reuse_steps) == (0.3, 0.9, 2)
    assert loaded.sparsity_range == (0.1, 0.45)
    assert group["reuse_steps"] == 2


def test_loaded_pipeline_carries_the_curve_into_the_session(tmp_path):
    """diffusers keeps the unknown config key in transformer.config; enable_trtllm_attention picks it up."""
    from diffusers import WanTransformer3DModel

    tiny_wan_transformer().save_pretrained(tmp_path / "transformer")
    path = tmp_path / "transformer" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "sparse_attention_config": MODELOPT_047}))
    assert set(calibrations_from_pretrained(tmp_path)) == {"transformer"}
    pipe = tiny_wan22_pipeline(two_experts=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe.transformer = WanTransformer3DModel.from_pretrained(tmp_path / "transformer")
    with enable_trtllm_attention(pipe, {"default": {"skip_softmax": {"target_sparsity": 0.5}}}) as handle:
        cal = handle.planner.calibrations["transformer"]
    assert (cal.a, cal.b) == (7.93, 8.61)


def _planned_self_attention(config, calibrations, layers=("blocks.0.attn1",)):
    """The calls a planner makes for self-attention layers of head_dim 8 on the CPU (no timestep gate)."""
    planner = CallPlanner(AttentionConfig.coerce(config), calibrations)
    sites = [CallSite("transformer", layer, "self_attn", "self") for layer in layers]
    for site in sites:
        planner.add_site(site, RoleTraits("self"), HeadLayout(1, 1, 8))
    planner.choose_backends(torch.device("cpu"), torch.float32)
    return [planner.calls[site] for site in sites]


def test_ignore_and_targets_keep_layers_dense():
    config = {"default": {"backend": "TORCH_REFERENCE", "skip_softmax": {"target_sparsity": 0.5}}}
    cal = SkipCalibration(a=100.0, b=2.0, ignore=("blocks.1.*",))
    kept, ignored = _planned_self_attention(config, {"transformer": cal}, ("blocks.0.attn1", "blocks.1.attn1"))
    assert float(kept.skip_value) == pytest.approx(cal.factor(0.5))
    assert float(ignored.skip_value) == 0.0
    # targets name attention classes; bound to a transformer, layers of other classes stay dense
    transformer = tiny_wan_transformer()
    other = SkipCalibration(a=100.0, b=2.0, targets=("LlamaAttention",))
    bound = calibrations_from_transformers({"transformer": transformer}, {"transformer": other})["transformer"]
    assert bound.dense_layers == {"blocks.0.attn1", "blocks.0.attn2", "blocks.1.attn1", "blocks.1.attn2"}
    (call,) = _planned_self_attention(config, {"transformer": bound})
    assert float(call.skip_value) == 0.0


def test_target_sparsity_without_calibration_fails_at_install():
    pipe = tiny_wan22_pipeline()
    config = {"default": {"skip_softmax": {"target_sparsity": 0.5}}}
    with pytest.raises(AttentionConfigError, match="no Skip-Softmax calibration.*calibrate.*threshold"):
        enable_trtllm_attention(pipe, config)
    # with a curve for one expert only, the other is still refused, by name
    with pytest.raises(AttentionConfigError, match="'transformer_2' has no Skip-Softmax calibration"):
        enable_trtllm_attention(pipe, config, calibrations={"transformer": SkipCalibration(a=1.0, b=1.0)})


def test_install_warns_for_extrapolation():
    cal = SkipCalibration(a=100.0, b=10.0, sparsity_range=(0.2, 0.5))
    config = {"default": {"backend": "TORCH_REFERENCE", "skip_softmax": {"target_sparsity": 0.7}}}
    with pytest.warns(UserWarning, match=r"target_sparsity=0.7 lies outside the sparsity range \[0.20, 0.50\]"):
        (call,) = _planned_self_attention(config, {"transformer": cal})
    assert float(call.skip_value) == pytest.approx(cal.factor(0.7))


def test_sparse_attention_config_is_modelopt_schema():
    data = sparse_attention_config(SkipCalibration(a=2.0, b=3.0, targets=("WanAttention",)))
    group = data["config_groups"]["group_0"]
    assert group["algorithm"] == "skip_softmax" and group["targets"] == ["WanAttention"]
    assert parse_sparse_attention_config(data).factor(0.5) == pytest.approx(2.0 * math.exp(1.5))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tile,kv_step", [((128, 128), None), ((64, 128), None), ((64, 128), 256), ((32, 64), 256)])
def test_one_pass_counts_equal_the_reference_for_every_lambda(causal, tile, kv_step):
    s, h, d = 600, 2, 32
    pos = torch.arange(s, dtype=torch.float64)[:, None] * torch.logspace(-3, -0.5, d // 2, dtype=torch.float64)
    base = torch.cat([pos.sin(), pos.cos()], 1)[:, None].expand(s, h, d)
    q, k = ((base + 0.3 * torch.randn(s, h, d, dtype=torch.float64)) * 3 for _ in range(2))
    v = torch.randn(s, h, d, dtype=torch.float64)
    lambdas = [1e-4, 1e-2, 0.1, 0.5, 1.0]
    gaps = skip_gaps(q, k, d ** -0.5, tile=tile, kv_step=kv_step, causal=causal, kv_chunk=256)
    counts = count_skips(gaps, lambdas).tolist()
    expected = [reference_attention(q, k, v, d ** -0.5, causal=causal, skip_lambda=lam, tile=tile, kv_step=kv_step)[1]
                for lam in lambdas]
    assert counts == expected
    assert causal or counts[-1] > counts[0]  # causal: only the masked tiles, for any λ


def test_summary_gives_lambda_only_inside_the_observed_sparsity():
    """Points measured up to s = 0.45 on an exact curve with λ(0.7) = 46: the old summary printed 46 for s = 0.7;
    now the cell says 'not observed' and threshold_at refuses, naming the target and the range."""
    from diffusers_trtllm import CalibrationError, CalibrationResult
    from diffusers_trtllm.calibration import ComponentFit, fit_curve

    kv_len, b = 1344, 20.0
    a = 46 * kv_len / math.exp(0.7 * b)
    points = [{"prompt": 0, "kv_len": kv_len, "lambda": a * math.exp(b * s) / kv_len, "factor": a * math.exp(b * s),
               "sparsity": s, "tiles": 100} for s in (0.1, 0.2, 0.3, 0.45)]
    fit_a, fit_b, r_squared, marked = fit_curve(points)
    assert (fit_a, fit_b) == (pytest.approx(a), pytest.approx(b)) and r_squared == pytest.approx(1.0)
    fit = ComponentFit(SkipCalibration(fit_a, fit_b, sparsity_range=(0.1, 0.45)), marked, r_squared,
                       ("blocks.0.attn1",), "transformer")
    assert fit.threshold_at(0.3) == pytest.approx(a * math.exp(0.3 * b) / kv_len)
    with pytest.raises(CalibrationError, match=r"target_sparsity=0.7 lies outside .*\[0.100, 0.450\]"):
        fit.threshold_at(0.7)
    table = CalibrationResult({"transformer": fit}).summary(targets=(0.3, 0.7))
    row = next(line for line in table.splitlines() if line.startswith("| transformer"))
    assert row.endswith(f"| {fit.threshold_at(0.3):.3g} | not observed |")
    assert "46" not in table and "outside the sparsity this component reached" in table

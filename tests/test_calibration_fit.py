"""Fitting a Skip-Softmax curve and what a calibration hands back (``fit_curve``, ``ComponentFit``,
``CalibrationResult``) without a model: the fit range's ends, the fewest points, degenerate fits, R² against a
float64 reference, the summary table, and the checkpoint and sidecar that ``save`` writes."""

import json
import math
import re
from types import SimpleNamespace

import numpy as np
import pytest

from diffusers_trtllm import CalibrationError, CalibrationResult
from diffusers_trtllm.calibration import ComponentFit, SkipCalibration, fit_curve, load_calibration
from diffusers_trtllm.tiny_pipelines import tiny_wan_transformer


def point(sparsity, factor, kv_len=1000):
    return {"prompt": 0, "kv_len": kv_len, "lambda": factor / kv_len, "factor": factor, "sparsity": sparsity,
            "tiles": 100}


def curve_points(a, b, sparsities, kv_len=1000):
    return [point(s, a * math.exp(b * s), kv_len) for s in sparsities]


@pytest.mark.parametrize("a,b", [(0.05, 0.5), (3000.0, 12.0)])  # a and b below 1 are curves too
def test_points_on_a_curve_give_back_its_a_and_b(a, b):
    fit_a, fit_b, r_squared, _ = fit_curve(curve_points(a, b, (0.15, 0.3, 0.5, 0.85)))
    assert (fit_a, fit_b, r_squared) == (pytest.approx(a, rel=1e-9), pytest.approx(b, rel=1e-9), pytest.approx(1.0))
    assert type(fit_a) is float and type(fit_b) is float


def test_the_fit_range_takes_its_ends_and_three_distinct_sparsities_are_enough():
    points = curve_points(2.0, 5.0, (0.0999, 0.1, 0.5, 0.5, 0.9, 0.9001))
    a, b, _, marked = fit_curve(points)
    assert [p["used"] for p in marked] == [False, True, True, True, True, False]
    assert [{k: v for k, v in p.items() if k != "used"} for p in marked] == points
    assert (a, b) == (pytest.approx(2.0), pytest.approx(5.0))


@pytest.mark.parametrize("component,points,message", [
    ("", curve_points(2.0, 5.0, (0.05, 0.2, 0.2, 0.4)),
     "calibration: 3 calibration points with sparsity in [0.1, 0.9] (observed range (0.05, 0.4)); need 3 distinct "
     "sparsities."),
    ("transformer_2", [], "transformer_2: 0 calibration points with sparsity in [0.1, 0.9] (observed range None)"),
])
def test_fewer_than_three_distinct_sparsities_are_refused_saying_what_was_observed(component, points, message):
    with pytest.raises(CalibrationError) as refused:
        fit_curve(points, component=component)
    assert str(refused.value).startswith(message)
    assert str(refused.value).endswith(
        "Widen the λ grid (larger λ gives more sparsity), calibrate at more frames or a higher resolution (longer "
        "sequences skip more), or move disabled_until_timestep so more steps are counted")


DEGENERATE_SPARSITIES = (0.123456, 0.173456, 0.223456, 0.273456, 0.323456, 0.373456, 0.423456, 0.473456, 0.523456,
                         0.573456)


@pytest.mark.parametrize("factors,distinct", [
    ([1000.0 * math.exp(-3.0 * s) for s in DEGENERATE_SPARSITIES], 10),  # the factor falls as sparsity grows
    ([1234.5] * 10, 1),  # one factor for every sparsity: np.polyfit's b is +-1e-15, not a curve
])
def test_a_degenerate_fit_is_refused_naming_its_points(factors, distinct):
    points = [point(s, f) for s, f in zip(DEGENERATE_SPARSITIES, factors)]
    with pytest.raises(CalibrationError) as refused:
        fit_curve(points, component="transformer")
    message = str(refused.value)
    assert re.match(r"transformer: the fit a=\S+, b=\S+ is degenerate \(both must be > 0: the factor must grow "
                    r"with sparsity\); achieved sparsity barely depends on λ over the 10 points in \[0.1, 0.9\] ",
                    message)
    assert (f"(distinct factors λ·kv_len: {distinct}; sparsities [0.1235, 0.1735, 0.2235, 0.2735, 0.3235, 0.3735, "
            "0.4235, 0.4735]). Attention this peaky or this flat has no useful curve: use skip_softmax.threshold (λ) "
            "directly") in message


def test_a_fit_whose_a_underflows_to_zero_is_refused():
    """log a = -780 (b = 200 through factors e^-700 .. e^-660): exp gives 0.0, which is no curve."""
    points = [point(s, math.exp(log_f)) for s, log_f in ((0.4, -700.0), (0.5, -680.0), (0.6, -660.0))]
    with pytest.raises(CalibrationError, match=r"^calibration: the fit a=0, b=200 is degenerate"):
        fit_curve(points)  # no component given: the message names the calibration


def test_r_squared_is_measured_in_log_space_against_a_float64_reference():
    rng = np.random.default_rng(0)
    sparsities = np.linspace(0.12, 0.88, 12)
    log_factors = np.log(3.0) + 7.0 * sparsities + rng.normal(0.0, 0.3, sparsities.size)
    points = [point(float(s), float(math.exp(f))) for s, f in zip(sparsities, log_factors)]
    _, _, r_squared, _ = fit_curve(points)
    reference = np.corrcoef(sparsities, log_factors)[0, 1] ** 2  # R² of a least-squares line
    assert 0.8 < reference < 0.99 and r_squared == pytest.approx(reference, rel=1e-12)


def component_fit(component="transformer", sparsity_range=(0.2, 0.6)):
    """A fit on points at kv_len 100 and 400 (λ defaults to the longest), one of them outside the fit range."""
    points = [{**point(s, 2.0 * math.exp(10.0 * s), kv_len), "used": used}
              for s, kv_len, used in ((0.05, 100, False), (0.2, 100, True), (0.4, 400, True), (0.6, 400, True))]
    return ComponentFit(SkipCalibration(2.0, 10.0, sparsity_range=sparsity_range), points, 0.987654,
                        ("blocks.0.attn1", "blocks.1.attn1"), component)


def test_lambda_at_a_target_is_the_factor_over_the_longest_kv_len_unless_one_is_given():
    fit = component_fit()
    assert fit.threshold_at(0.3) == pytest.approx(2.0 * math.exp(3.0) / 400, rel=1e-12)
    assert fit.threshold_at(0.3, kv_len=100) == pytest.approx(2.0 * math.exp(3.0) / 100, rel=1e-12)


@pytest.mark.parametrize("target,inside", [(0.2, True), (0.6, True), (0.1999, False), (0.6001, False)])
def test_lambda_is_given_over_the_observed_range_ends_included_and_refused_past_them(target, inside):
    fit = component_fit(component="")
    if inside:
        assert fit.threshold_at(target) == pytest.approx(2.0 * math.exp(10.0 * target) / 400, rel=1e-12)
        return
    with pytest.raises(CalibrationError) as refused:
        fit.threshold_at(target)
    assert str(refused.value) == (
        f"calibration: target_sparsity={target} lies outside the sparsity range [0.200, 0.600] observed when "
        "calibrating; the curve says nothing there. Choose a target inside it, or calibrate so that it is observed "
        "(a λ grid reaching 1, longer sequences, more frames or a higher resolution)")


def test_the_summary_is_one_row_per_component_and_explains_a_refused_lambda():
    result = CalibrationResult({"transformer": component_fit(),
                                "transformer_2": component_fit("transformer_2", sparsity_range=(0.2, 0.75))})
    assert result.summary(targets=(0.3, 0.7)) == (
        "| component | a | b | R² (log) | observed sparsity | kv_len | λ at s=0.3 | λ at s=0.7 |\n"
        "|---|---:|---:|---:|---|---:|---:|---:|\n"
        "| transformer | 2 | 10 | 0.988 | 0.200–0.600 | 400 | 0.1 | not observed |\n"
        "| transformer_2 | 2 | 10 | 0.988 | 0.200–0.750 | 400 | 0.1 | 5.48 |\n"
        "\n'not observed': the target lies outside the sparsity this component reached while calibrating, where the "
        "curve is an extrapolation; no λ is given. Calibrate with a λ grid reaching 1, longer sequences or more "
        "frames to measure it.")
    # every target observed: no note
    assert result.summary(targets=(0.3,)).splitlines()[-1] == \
        "| transformer_2 | 2 | 10 | 0.988 | 0.200–0.750 | 400 | 0.1 |"


def test_save_writes_the_curve_into_each_components_config_and_what_modelopt_drops_into_the_sidecar(tmp_path):
    fits = {"transformer": component_fit(), "transformer_2": component_fit("transformer_2", (0.2, 0.5))}
    result = CalibrationResult(fits, settings={"lambdas": [0.01, 1.0], "prompts": 2})
    for component in fits:
        (tmp_path / component).mkdir()
        (tmp_path / component / "config.json").write_text(json.dumps({"_class_name": "WanTransformer3DModel"}))
    assert result.save(tmp_path) == [tmp_path / "transformer", tmp_path / "transformer_2"]
    for component, sparsity_range in (("transformer", (0.2, 0.6)), ("transformer_2", (0.2, 0.5))):
        loaded = load_calibration(tmp_path / component)
        assert (loaded.a, loaded.b, loaded.sparsity_range) == (2.0, 10.0, sparsity_range)
        assert json.loads((tmp_path / component / "config.json").read_text())["_class_name"] == "WanTransformer3DModel"
    sidecar = json.loads((tmp_path / "transformer_2" / "sparse_attention_calibration.json").read_text())
    assert sidecar == {
        "format": "diffusers_trtllm.skip_softmax_calibration/1",
        "observed_sparsity": [0.2, 0.5],
        "observed_sparsity_all_points": [0.05, 0.6],
        "fit": {"a": 2.0, "b": 10.0, "space": "log", "r_squared": 0.987654, "points_used": 3, "points_total": 4},
        "kv_len": [100, 400],
        "layers": ["blocks.0.attn1", "blocks.1.attn1"],
        "lambdas": [0.01, 1.0], "prompts": 2,
        "points": fits["transformer_2"].points}


def test_save_without_a_config_writes_the_pipelines_own_or_says_what_to_pass(tmp_path):
    result = CalibrationResult({"transformer": component_fit()})
    with pytest.raises(FileNotFoundError) as missing:
        result.save(tmp_path)
    assert str(missing.value) == (f"{tmp_path / 'transformer' / 'config.json'} does not exist; pass pipe= to write "
                                  "pipe.transformer's config there, or save the pipeline first")
    pipe = SimpleNamespace(transformer=tiny_wan_transformer())
    assert result.save(tmp_path, pipe) == [tmp_path / "transformer"]
    config = json.loads((tmp_path / "transformer" / "config.json").read_text())
    assert config["_class_name"] == "WanTransformer3DModel" and "sparse_attention_config" in config
    assert load_calibration(tmp_path / "transformer").sparsity_range == (0.2, 0.6)

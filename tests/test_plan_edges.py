"""The call planner at its edges (diffusers_trtllm.plan): an ``auto`` dispatcher call chooses its backend at the
call, a warning keyed once is given once even when Python's own filter would repeat it, and the mode names the
statistics and logs report."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.attention_dispatch import attention_backend, dispatch_attention_fn

from diffusers_trtllm import (BACKEND_NAME, AttentionConfigError, BackendUnavailableError, enable_trtllm_attention,
                              set_dispatch_config)
from diffusers_trtllm.backends import base as backend_base
from diffusers_trtllm.backends import trtllm as trtllm_backend
from diffusers_trtllm.backends.base import TRTLLM_ON_REFERENCE_ENV, KernelPlan, VarlenQKV, get_backend
from diffusers_trtllm.calibration.curve import SkipCalibration
from diffusers_trtllm.config import TORCH_REFERENCE, TRTLLM_ATTN, AccuracySpec, AttentionConfig, AttnQuantSpec
from diffusers_trtllm.run_state import PROBE, Run
from diffusers_trtllm import errors as errors_module
from diffusers_trtllm.plan import AttentionCall, CallPlanner, CallSite
from diffusers_trtllm.tiny_pipelines import tiny_cosmos3_transformer, tiny_wan22_pipeline

from helpers import cosmos3_transformer_call, tiny_wan, wan_inputs


@pytest.fixture
def dispatch_config():
    yield set_dispatch_config
    set_dispatch_config(None)


def test_an_auto_dispatch_call_chooses_its_backend_at_the_call(dispatch_config):
    """``auto`` is no kernel route: the dispatcher's call, planned at no install, picks one when it runs."""
    dispatch_config({"default": {"backend": "auto"}})
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    with attention_backend(BACKEND_NAME):
        out = dispatch_attention_fn(q, k, v)
    expected = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2)
    assert torch.allclose(out, expected, atol=1e-6)


def test_a_warning_per_role_is_given_once_over_all_layers_of_the_role(monkeypatch):
    """Every causal layer of Cosmos 3 falls back the same way; one warning says so, even with every warning shown."""
    monkeypatch.setenv(TRTLLM_ON_REFERENCE_ENV, "1")
    model, _ = cosmos3_transformer_call()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = enable_trtllm_attention(model, {"default": {"backend": "TRTLLM_ATTN"}})
    causal_sites = [site for site in handle.planner.calls if site.role == "und_causal"]
    handle.restore()
    assert len(causal_sites) > 1
    assert len([w for w in caught if "'und_causal' attention is causal" in str(w.message)]) == 1


SITE = CallSite("transformer", "blocks.0.attn1", "self", "self")
INT8 = AttnQuantSpec("int8")


@pytest.mark.parametrize("quant,skipping,quantized,mode", [
    (INT8, True, None, "sage-int8+skip"), (INT8, False, None, "sage-int8"), (INT8, True, False, "skip"),
    (INT8, False, False, "dense"), (INT8, False, True, "sage-int8"), (None, False, True, "dense"),
    (None, True, None, "skip"), (None, False, None, "dense")])
def test_the_mode_names_what_runs(quant, skipping, quantized, mode):
    """``quantized`` None: SAGE runs whenever the call has it; False: the step schedule holds it off."""
    call = AttentionCall(SITE, "TORCH_REFERENCE", False, quant, None)
    assert call.mode(skipping, quantized) == mode


def test_an_unplanned_call_keeps_its_site_and_is_checked_at_the_call():
    call = AttentionCall.unplanned(SITE, "TORCH_REFERENCE", False, None, None)
    assert call.site is SITE and call.planned is False


def test_the_triton_rule_note_names_the_roles_that_skip_with_sage_wherever_they_come():
    """The first layer (self-attention) runs dense; the cross-attention layers after it run SAGE + Skip-Softmax."""
    sage_skip = {"backend": "TORCH_REFERENCE", "skip_softmax": {"threshold": 0.1}, "quant": {"dtype_qk": "int8"}}
    errors_module._SAID.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # said once per process, however many installs
            enable_trtllm_attention(tiny_wan(), {"default": sage_skip,
                                                 "per_role": {"self_attn": {"backend": "TORCH_REFERENCE"}}}).restore()
    notes = [str(w.message) for w in caught if "Triton SAGE kernel" in str(w.message)]
    assert notes == [  # on a CPU: the reference follows the GPU kernel's rule
        "diffusers_trtllm: ['cross_attn'] SAGE + Skip-Softmax follows the Triton SAGE kernel's rule: a head skips "
        "only where a sample of its query tiles skipped >= 30% of its KV tiles (dense elsewhere); handle.stats counts "
        "what was skipped"]


def test_on_hopper_the_note_names_the_fp8_roles_the_triton_kernel_serves_and_not_those_fmha_v2_serves(monkeypatch):
    """FMHAv2 SAGE takes no more queries than keys: Wan's self-attention runs there (no sampled rule), its
    cross-attention (video queries on text keys) on the Triton kernel, whose rule the note states."""
    monkeypatch.setattr(trtllm_backend, "gpu_arch", lambda device: "sm_90")
    sage_skip = {"backend": "TORCH_REFERENCE", "skip_softmax": {"threshold": 0.1}, "quant": {"dtype_qk": "fp8_e4m3"}}
    errors_module._SAID.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        enable_trtllm_attention(tiny_wan(), {"default": sage_skip}).restore()
    notes = [str(w.message) for w in caught if "Triton SAGE kernel" in str(w.message)]
    assert len(notes) == 1 and notes[0].startswith("diffusers_trtllm: ['cross_attn'] SAGE + Skip-Softmax follows ")


def test_the_skip_value_reaches_the_op_at_full_precision():
    """λ = 0.1 is no float32 number: the per-step value the op reads keeps it in float64."""
    handle = enable_trtllm_attention(tiny_wan(), {"default": {"backend": "TORCH_REFERENCE",
                                                              "skip_softmax": {"threshold": 0.1}}})
    values = {call.skip_value.item() for call in handle.planner.calls.values()}
    handle.restore()
    assert values == {0.1}


NEEDS_A_PIPELINE = ("attention: {what} needs the pipeline's steps and statistics, which a processor or the 'trtllm' "
                    "dispatcher backend alone does not see: install with "
                    "diffusers_trtllm.enable_trtllm_attention(pipe, config), or remove it")
SCHEDULE = "quant.disabled_until_timestep / disabled_below_timestep (the SAGE step schedule)"


@pytest.mark.parametrize("spec,what", [
    ({"accuracy": {}}, "accuracy (the probe and guard)"),
    ({"quant": {"dtype_qk": "int8", "disabled_until_timestep": 0.5}}, SCHEDULE),
    ({"accuracy": {}, "quant": {"dtype_qk": "int8", "disabled_until_timestep": 0.5}}, "accuracy (the probe and guard)"),
], ids=["accuracy", "schedule", "both"])
def test_the_dispatcher_refuses_what_needs_a_pipeline_naming_it(spec, what, dispatch_config):
    with pytest.raises(AttentionConfigError) as refused:
        dispatch_config({"default": {"backend": "TORCH_REFERENCE", **spec}})
    assert str(refused.value) == NEEDS_A_PIPELINE.format(what=what)


def probed_call(layer: str, max_error: float | None) -> AttentionCall:
    return AttentionCall(CallSite("transformer", layer, "self", "self"), "TORCH_REFERENCE", False, INT8, None,
                         accuracy=AccuracySpec(max_error=max_error), counting=True)


def planned_run(*calls: AttentionCall, step: int = 0) -> Run:
    """A run of ``calls`` planned at ``step`` (no timestep), as a planner plans one."""
    planner = CallPlanner(AttentionConfig())
    planner.calls = {call.site: call for call in calls}
    run = planner.new_run()
    planner.plan_step(run, None, step)
    return run


@pytest.mark.parametrize("error_sq,exact_sq,trips", [(1.0, 4.0, False), (1.0, 3.99, True)],
                         ids=["at-the-bound", "past-it"])
def test_the_guard_trips_only_past_its_bound_for_every_layer_it_reads(error_sq, exact_sq, trips):
    """The bound 0.5 itself is within it; a layer within it, or without a bound, leaves the next layer guarded."""
    run = planned_run(probed_call("a", 0.5), probed_call("b", None), probed_call("c", 0.5))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        CallPlanner.guard(run, 0, {0: (0.0, 1.0), 1: (4.0, 1.0), 2: (error_sq, exact_sq)})
    assert run.guard_dropped == [set(), set(), {"sage"} if trips else set()]
    assert [str(w.message) for w in caught] == (
        ["diffusers_trtllm: transformer.c (self attention, sage-int8): probed error 0.501 at step 0 exceeds the bound "
         "accuracy.max_error=0.5; it runs without SAGE for the rest of this pipeline call"] if trips else [])


def test_the_guard_reports_a_dense_layer_above_its_bound_once():
    dense = AttentionCall(CallSite("transformer", "d", "self", "self"), "TORCH_REFERENCE", False, None, None,
                          accuracy=AccuracySpec(max_error=0.5), counting=True)
    run = planned_run(dense)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        CallPlanner.guard(run, 3, {0: (4.0, 1.0)})
        CallPlanner.guard(run, 4, {0: (4.0, 1.0)})
    assert [str(w.message) for w in caught] == [
        "diffusers_trtllm: transformer.d (self attention, dense): probed error 2 at step 3 exceeds the bound "
        "accuracy.max_error=0.5; it ran dense, so there is nothing to drop (reported once per pipeline call)"]


def test_only_a_probed_step_hands_the_op_probe_rows():
    call = AttentionCall(SITE, "TORCH_REFERENCE", False, None, None,
                         accuracy=AccuracySpec(probe_rows=4, probe_every=2), counting=True)
    rows = []
    for step in range(3):
        run = planned_run(call, step=step)
        rows.append((run.step_probed[0], run.settings[0, PROBE].item()))
    assert rows == [(True, 4.0), (False, 0.0), (True, 4.0)]


def install_with_target(target: float, calibrations: dict):
    config = {"default": {"backend": "TORCH_REFERENCE", "skip_softmax": {"target_sparsity": target}}}
    return enable_trtllm_attention(tiny_wan(), config, calibrations=calibrations)


@pytest.mark.parametrize("target,extrapolated", [(0.2, False), (0.6, False), (0.19, True), (0.61, True)])
def test_a_target_outside_the_calibrated_range_says_its_factor_is_extrapolated(target, extrapolated):
    """The observed range's ends are inside it. Every layer not ignored by the curve skips with its factor."""
    curve = SkipCalibration(2.0, 3.0, sparsity_range=(0.2, 0.6), ignore=("blocks.0.*",))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = install_with_target(target, {"transformer": curve})
    values = {site.layer: call.skip_value.item() for site, call in handle.planner.calls.items()}
    handle.restore()
    assert [str(w.message) for w in caught] == (
        [f"skip_softmax.target_sparsity={target} lies outside the sparsity range [0.20, 0.60] observed when "
         "'transformer' was calibrated; its factor is extrapolated"] if extrapolated else [])
    assert values == {"blocks.0.attn1": 0.0, "blocks.0.attn2": 0.0, "blocks.1.attn1": curve.factor(target),
                      "blocks.1.attn2": curve.factor(target)}


def test_a_target_without_a_calibration_is_refused_naming_the_fixes():
    with pytest.raises(AttentionConfigError) as refused:
        install_with_target(0.5, {"transformer_2": SkipCalibration(2.0, 3.0)})
    assert str(refused.value) == (
        "skip_softmax.target_sparsity=0.5 applies to transformer.blocks.0.attn1 but 'transformer' has no Skip-Softmax "
        "calibration: load a calibrated checkpoint (its config.json carries 'sparse_attention_config'), run "
        "diffusers_trtllm.calibrate(pipe, prompts, ...), pass calibrations={...}, or set skip_softmax.threshold (λ) "
        "instead")


def test_the_probe_without_statistics_is_refused_naming_a_layer():
    with pytest.raises(AttentionConfigError) as refused:
        enable_trtllm_attention(tiny_wan(), {"default": {"backend": "TORCH_SDPA"}, "per_role": {
            layer: {"backend": "TORCH_SDPA", "accuracy": {}} for layer in ("blocks.1.attn1", "blocks.1.attn2")}},
            collect_stats=False)
    assert str(refused.value) == (
        "accuracy (the probe) is set for 2 layers (e.g. transformer.blocks.1.attn1) but collect_stats=False: the probe "
        "reports its errors in handle.stats; install with collect_stats=True or remove accuracy")


def test_a_calibration_probe_sees_the_calls_that_would_skip_even_where_auto_dropped_skipping():
    """On a CPU ``auto`` runs SDPA and drops Skip-Softmax; the probe still counts what the spec would skip, from the
    step whose timestep reaches the gate."""
    config = {"default": {"skip_softmax": {"threshold": 0.1, "disabled_until_timestep": 0.5}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = enable_trtllm_attention(tiny_wan(), config)
    planner = handle.planner
    assert {call.skip for call in planner.calls.values()} == {None}
    probing = []
    run = planner.new_run()
    planner.set_probe(lambda *args, **kwargs: None)  # probing from the next planned step on
    for timestep in (0.5, 0.8, 0.5):
        planner.plan_step(run, timestep, 0)
        probing.append(set(run.probing))
    planner.set_probe(None)
    planner.plan_step(run, 0.5, 0)
    probing.append(set(run.probing))
    handle.restore()
    assert probing == [{True}, {False}, {True}, {False}]


def test_each_component_says_once_that_its_target_is_extrapolated():
    curve = SkipCalibration(2.0, 3.0, sparsity_range=(0.2, 0.6))
    config = {"default": {"backend": "TORCH_REFERENCE", "skip_softmax": {"target_sparsity": 0.7}}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        enable_trtllm_attention(tiny_wan22_pipeline(), config,
                                calibrations={"transformer": curve, "transformer_2": curve}).restore()
    assert sorted(str(w.message).split(" observed when ")[1] for w in caught if "extrapolated" in str(w.message)) == [
        "'transformer' was calibrated; its factor is extrapolated",
        "'transformer_2' was calibrated; its factor is extrapolated"]


def test_tile_counts_are_kept_as_integers():
    """Counts are int64 on the device: a float32 counter would stop counting exactly past 2**24 tiles."""
    config = {"default": {"backend": "TORCH_REFERENCE", "skip_softmax": {"threshold": 0.1}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_wan()
        handle = enable_trtllm_attention(model, config)
    with handle, torch.no_grad():
        model(**wan_inputs(batch=1, frames=1, height=8, width=8))
        records = handle.stats.records
    assert handle.planner.new_run().tiles.dtype == torch.int64
    fields = {type(getattr(record, name)) for record in records.values() for name in ("calls", "skipped", "total")}
    assert fields == {int}


def test_auto_says_once_per_reason_which_roles_it_runs_dense():
    """Two roles lose different features on a CPU: one warning each, every layer of the role in it."""
    config = {"default": {"skip_softmax": {"threshold": 0.1}},
              "per_role": {"cross_attn": {"quant": {"dtype_qk": "int8"}}}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        enable_trtllm_attention(tiny_wan(), config).restore()
    assert [str(w.message).split(" (")[0] for w in caught] == [
        "diffusers_trtllm: auto runs ['self_attn'] attention dense: Skip-Softmax dropped",
        "diffusers_trtllm: auto runs ['cross_attn'] attention dense: SAGE int8 dropped"]


# --- what the planner asks a backend at install --------------------------------------------------------------------

class StandInTrtllm:
    """TRTLLM_ATTN replaced in the registry by a stand-in that records what the planner asks it (the kernel plan
    and the shapes, dtype and lengths of the probe tensors standing for a site's calls) and, like the real one,
    refuses causal attention; ``dense_reason`` set: it runs SAGE but not dense attention (FlashInfer missing on
    Hopper, where SAGE runs on this package's Triton kernel)."""

    def __init__(self, monkeypatch, dense_reason: str | None = None):
        self.asked, self.dense_reason = [], dense_reason
        monkeypatch.setitem(backend_base._REGISTRY, TRTLLM_ATTN, backend_base.FunctionBackend(
            TRTLLM_ATTN, self.check, get_backend(TORCH_REFERENCE).runner, get_backend(TRTLLM_ATTN).priority))

    def check(self, plan: KernelPlan, qkv: VarlenQKV) -> str | None:
        self.asked.append((plan, [(tuple(x.shape), x.dtype) for x in (qkv.q, qkv.k, qkv.v)], tuple(qkv.seqlens_q),
                           tuple(qkv.seqlens_kv)))
        if plan.causal:
            return "it runs non-causal attention only"
        return self.dense_reason if plan.quant is None else None


def test_each_site_is_planned_with_its_heads_head_dim_dtype_causality_and_features(monkeypatch):
    """Cosmos 3 in bf16 (4 query heads on 2 key/value heads of 16 channels): the generation stream is asked with
    Skip-Softmax and SAGE; the causal text stream, which takes neither, is asked causal and dense, then (refused)
    whether it would run non-causal, then ``auto`` picks its backend; it runs on TORCH_SDPA, said once."""
    trtllm = StandInTrtllm(monkeypatch)
    config = {"default": {"backend": "TRTLLM_ATTN", "skip_softmax": {"threshold": 0.1}, "quant": {"dtype_qk": "int8"}}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = enable_trtllm_attention(tiny_cosmos3_transformer().to(torch.bfloat16), config)
    modes = {(site.role, call.backend, call.mode(call.skip is not None)) for site, call in handle.planner.calls.items()}
    handle.restore()
    assert modes == {("und_causal", "TORCH_SDPA", "dense"), ("gen_full", "TRTLLM_ATTN", "sage-int8+skip")}
    probe = ([((1, 4, 16), torch.bfloat16), ((1, 2, 16), torch.bfloat16), ((1, 2, 16), torch.bfloat16)], (1,), (1,))
    causal, non_causal = KernelPlan(TRTLLM_ATTN, 0.25, causal=True), KernelPlan(TRTLLM_ATTN, 0.25)
    sage_skip = KernelPlan(TRTLLM_ATTN, 0.25, skip_factor=1.0, quant=AttnQuantSpec("int8"))
    per_layer = [(plan, *probe) for plan in (causal, non_causal, causal, sage_skip)]  # 0.25: 16 ** -0.5
    assert trtllm.asked == per_layer * 2
    assert len([w for w in caught if "is causal and the default backend" in str(w.message)]) == 1


LAYER = "transformer.blocks.0.attn1 (self_attn attention, per_role key 'default')"


@pytest.mark.parametrize("extra,refused", [
    ({"quant": {"dtype_qk": "int8", "disabled_until_timestep": 0.5}}, True),
    ({"quant": {"dtype_qk": "int8"}, "accuracy": {"max_error": 0.1}}, True),
    ({"quant": {"dtype_qk": "int8"}, "accuracy": {}}, False),
    ({"quant": {"dtype_qk": "int8"}}, False),
], ids=["step-schedule", "guard", "probe-without-guard", "sage-always"])
def test_sage_on_a_backend_without_dense_is_refused_where_a_step_runs_without_it(extra, refused, monkeypatch):
    """The SAGE step schedule and the guard run a SAGE site dense at some steps (Skip-Softmax kept): the backend
    must run that too, which is asked at install."""
    trtllm = StandInTrtllm(monkeypatch, dense_reason="FlashInfer is not installed")
    config = {"default": {"backend": "TRTLLM_ATTN", "skip_softmax": {"threshold": 0.1}, **extra}}
    if refused:
        with pytest.raises(BackendUnavailableError) as error:
            enable_trtllm_attention(tiny_wan(), config)
        assert str(error.value) == (
            f"{LAYER}: the SAGE step schedule or accuracy guard runs it without SAGE at some steps, which "
            "TRTLLM_ATTN cannot run here: FlashInfer is not installed")
        assert trtllm.asked[-1][0] == KernelPlan(TRTLLM_ATTN, 16 ** -0.5, skip_factor=1.0)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the Triton rule's note
            enable_trtllm_attention(tiny_wan(), config).restore()
        assert {plan.quant for plan, *_ in trtllm.asked} == {AttnQuantSpec("int8")}


def test_an_explicit_backend_that_cannot_run_a_role_is_refused_with_auto_as_the_fix(monkeypatch):
    """A non-causal role: ``auto`` is the fix (a causal one is told TORCH_SDPA)."""
    StandInTrtllm(monkeypatch, dense_reason="FlashInfer is not installed")
    with pytest.raises(BackendUnavailableError) as error:
        enable_trtllm_attention(tiny_wan(), {"default": {"backend": "TRTLLM_ATTN"}})
    assert str(error.value) == (
        f"{LAYER}: backend TRTLLM_ATTN cannot run this attention: FlashInfer is not installed. Fix: give this role "
        "a backend that runs it, e.g. per_role {'self_attn': {\"backend\": \"auto\"}}")


def test_a_trtllm_site_on_hopper_runs_its_dense_steps_on_the_dense_kernel_chosen_at_install(monkeypatch):
    StandInTrtllm(monkeypatch)
    monkeypatch.setattr(trtllm_backend, "gpu_arch", lambda device: "sm_90")
    monkeypatch.setattr(trtllm_backend, "cudnn_unavailable_reason", lambda: None)
    handle = enable_trtllm_attention(tiny_wan(), {"default": {"backend": "TRTLLM_ATTN", "dense_kernel": "cudnn"}})
    routes = {(call.route, call.mode_of(call.settings)) for call in handle.planner.calls.values()}
    handle.restore()
    assert routes == {("TRTLLM_ATTN+cudnn", "dense[cudnn]")}


def test_a_dense_kernel_pinned_off_hopper_is_refused_naming_the_site(monkeypatch):
    """On a CPU (no seam: TRTLLM_ATTN's stand-in accepts the site) the pin is what cannot run."""
    StandInTrtllm(monkeypatch)
    with pytest.raises(BackendUnavailableError) as refused:
        enable_trtllm_attention(tiny_wan(), {"default": {"backend": "TRTLLM_ATTN", "dense_kernel": "cudnn"}})
    assert str(refused.value) == (
        f"{LAYER}: dense_kernel='cudnn' chooses among Hopper's (sm_90) dense kernels, and cpu is not a CUDA GPU; "
        "TRTLLM_ATTN runs dense attention there on its own kernel: leave dense_kernel 'auto'")

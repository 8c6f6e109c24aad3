"""Hopper's dense kernel under TRTLLM_ATTN: which one each call site runs, how it is stated, and the calls.

CPU: the choice per (GPU, FlashAttention-4 installed or not, cuDNN there or not, explicit ``dense_kernel``), the
refusals' wording, the kernel named in the plan and the statistics, dense steps on the chosen kernel while
Skip-Softmax steps stay on FMHAv2 and SAGE steps on the SAGE kernel, and FlashAttention-4's call bound against the
installed wheel's real signature (read from its source when its CuTe DSL cannot be imported here). GPU (``-m gpu``,
sm_90): the FlashAttention-4 and cuDNN routes against float32 attention on a ragged batch with grouped heads and
fewer queries than keys, with no host-device sync.
"""

import ast
import importlib
import importlib.util
import inspect
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from diffusers_trtllm import enable_trtllm_attention, ops, set_dispatch_config
from diffusers_trtllm.backends import run_backend, trtllm
from diffusers_trtllm.backends.base import KernelPlan, VarlenQKV
from diffusers_trtllm.config import AttentionConfig, AttentionSpec, AttnQuantSpec
from diffusers_trtllm.errors import AttentionConfigError, BackendUnavailableError
from diffusers_trtllm.kernels import flash_attn4, flashinfer_fmha

from helpers import rel_err, tiny_wan, wan_inputs

SCALE = 128 ** -0.5
NOT_INSTALLED = f"FlashAttention-4 is not installed ({flash_attn4.INSTALL})"


# ------------------------------------------------------------------------------ FlashAttention-4's real signature


def _fa4_source_dir() -> Path:
    if flash_attn4.installed_version() is None:
        pytest.skip("flash-attn-4 is not installed: `pip install --no-deps flash-attn-4==4.0.0b40` binds the call "
                    "plan on a CPU")
    spec = importlib.util.find_spec(flash_attn4.MODULE)  # imports the namespace package flash_attn only
    return Path(next(iter(spec.submodule_search_locations)))


def _interface_tree() -> ast.Module:
    return ast.parse((_fa4_source_dir() / "interface.py").read_text())


def _signature_from_source(fn: ast.FunctionDef) -> inspect.Signature:
    """The parameters of a function as written in its source: names, kinds, which ones have defaults."""
    args, P = fn.args, inspect.Parameter
    positional = args.posonlyargs + args.args
    first_default = len(positional) - len(args.defaults)
    params = [P(a.arg, P.POSITIONAL_ONLY if i < len(args.posonlyargs) else P.POSITIONAL_OR_KEYWORD,
                default=None if i >= first_default else P.empty) for i, a in enumerate(positional)]
    if args.vararg:
        params.append(P(args.vararg.arg, P.VAR_POSITIONAL))
    params += [P(a.arg, P.KEYWORD_ONLY, default=P.empty if d is None else None)
               for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        params.append(P(args.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(params)


def fa4_varlen_signature() -> inspect.Signature:
    """``flash_attn.cute.flash_attn_varlen_func``'s signature: the imported function's where FlashAttention-4
    loads, else read from the installed wheel's source."""
    try:
        module = importlib.import_module(flash_attn4.MODULE)
    except Exception:  # noqa: BLE001 - its CuTe DSL (CUDA libraries) is missing here: read the source
        module = None
    if module is not None:
        return inspect.signature(getattr(module, flash_attn4.VARLEN))
    fn = next(node for node in _interface_tree().body
              if isinstance(node, ast.FunctionDef) and node.name == flash_attn4.VARLEN)
    return _signature_from_source(fn)


def ragged_qkv(seqlens_q=(300, 517), seqlens_kv=(300, 517), heads_q=8, heads_kv=2, dtype=torch.bfloat16):
    q = torch.randn(sum(seqlens_q), heads_q, 128, dtype=dtype)
    k = torch.randn(sum(seqlens_kv), heads_kv, 128, dtype=dtype)
    v = torch.randn(sum(seqlens_kv), heads_kv, 128, dtype=dtype)
    return VarlenQKV(q, k, v, tuple(seqlens_q), tuple(seqlens_kv))


def test_the_varlen_call_binds_to_flash_attention_4s_signature():
    qkv = ragged_qkv((300, 50), (300, 80))
    call = flash_attn4.varlen_call(qkv.q, qkv.k, qkv.v, qkv.cu_seqlens("q"), qkv.cu_seqlens("kv"), 300, 300, SCALE)
    bound = fa4_varlen_signature().bind(**call.kwargs)
    assert set(call.kwargs) == set(flash_attn4.REQUIRED_PARAMETERS)
    assert bound.arguments["causal"] is False and bound.arguments["return_lse"] is False
    assert bound.arguments["softmax_scale"] == SCALE and type(bound.arguments["max_seqlen_k"]) is int


def test_flash_attention_4_exports_the_varlen_function_and_it_returns_out_and_lse():
    """The call takes ``out`` from ``(out, lse)``: the wheel's varlen function returns its autograd function's
    forward, whose last statement returns two values."""
    init = ast.parse((_fa4_source_dir() / "__init__.py").read_text())
    exported = {alias.name for node in ast.walk(init) if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert flash_attn4.VARLEN in exported
    tree = _interface_tree()
    varlen = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == flash_attn4.VARLEN)
    returned = varlen.body[-1].value
    assert isinstance(returned, ast.Call) and ast.unparse(returned.func) == "FlashAttnVarlenFunc.apply"
    autograd = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "FlashAttnVarlenFunc")
    forward = next(n for n in autograd.body if isinstance(n, ast.FunctionDef) and n.name == "forward")
    assert isinstance(forward.body[-1], ast.Return) and ast.unparse(forward.body[-1].value) == "(out, lse)"


def test_the_installed_flash_attention_4_is_recent_enough_or_refused_saying_so(monkeypatch):
    flash_attn4.unavailable_reason.cache_clear()
    monkeypatch.setattr(flash_attn4, "installed_version", lambda: "4.0.0b36")
    assert flash_attn4.unavailable_reason() == (
        f"flash-attn-4 4.0.0b36 is older than 4.0.0b40, the version this package calls ({flash_attn4.INSTALL})")
    flash_attn4.unavailable_reason.cache_clear()
    monkeypatch.setattr(flash_attn4, "installed_version", lambda: None)
    assert flash_attn4.unavailable_reason() == NOT_INSTALLED
    flash_attn4.unavailable_reason.cache_clear()


# ----------------------------------------------------------------------------------------------- the choice


@pytest.fixture
def hopper(monkeypatch):
    """An sm_90 GPU as TRTLLM_ATTN sees it; the test sets what is installed with ``installed(...)``."""
    monkeypatch.setattr(trtllm, "gpu_arch", lambda device: "sm_90")
    trtllm._log_dense_choice.cache_clear()

    def installed(fa4: bool = True, cudnn: bool = True):
        monkeypatch.setattr(flash_attn4, "unavailable_reason", lambda: None if fa4 else NOT_INSTALLED)
        monkeypatch.setattr(trtllm, "cudnn_unavailable_reason", lambda: None if cudnn else "torch 2.x has no cuDNN")
    installed()
    return installed


@pytest.mark.parametrize("fa4,cudnn,requested,kernel", [
    (True, True, "auto", "flash_attn4"), (False, True, "auto", "cudnn"), (False, False, "auto", "fmha_v2"),
    (True, True, "fmha_v2", "fmha_v2"), (True, True, "cudnn", "cudnn"), (True, False, "flash_attn4", "flash_attn4"),
    (False, True, "cudnn", "cudnn")])
def test_hopper_routes_dense_steps_to_the_kernel_chosen_at_install(hopper, fa4, cudnn, requested, kernel):
    hopper(fa4, cudnn)
    route = trtllm.dense_route("cuda", requested)
    assert route == f"TRTLLM_ATTN+{kernel}" and trtllm.dense_kernel_of(route) == kernel


def test_auto_says_once_which_kernel_runs_and_what_it_passed_over(hopper, caplog):
    hopper(fa4=False)
    with caplog.at_level(logging.WARNING, logger="diffusers_trtllm"):
        trtllm.dense_route("cuda")
        trtllm.dense_route("cuda")
    [record] = [r.getMessage() for r in caplog.records if "dense steps" in r.getMessage()]
    assert record == (f"TRTLLM_ATTN dense steps on sm_90 run cuDNN through torch SDPA (FlashAttention-2 for "
                      f"grouped-query heads) (Skip-Softmax steps: FMHAv2, SAGE steps: the SAGE kernel); not FlashAttention-4: {NOT_INSTALLED}; the spec's dense_kernel pins "
                      "one of ['fmha_v2', 'flash_attn4', 'cudnn']")


def test_an_explicit_kernel_that_cannot_run_is_refused_naming_why_and_what_can(hopper):
    hopper(fa4=False)
    with pytest.raises(BackendUnavailableError) as refused:
        trtllm.dense_route("cuda", "flash_attn4")
    assert str(refused.value) == (f"dense_kernel='flash_attn4' (FlashAttention-4) cannot run on sm_90: "
                                  f"{NOT_INSTALLED}; valid here: ['auto', 'fmha_v2', 'cudnn']")


@pytest.mark.parametrize("arch,where", [("sm_100", "is sm_100"), ("sm_103", "is sm_103"),
                                        (None, "is not a CUDA GPU")])
def test_off_hopper_dense_runs_the_backends_own_kernel_and_a_pin_is_refused(monkeypatch, arch, where):
    monkeypatch.setattr(trtllm, "gpu_arch", lambda device: arch)
    assert trtllm.dense_route("cuda") == "TRTLLM_ATTN"
    with pytest.raises(BackendUnavailableError, match=rf"dense_kernel='cudnn' chooses among Hopper's \(sm_90\) "
                                                      rf"dense kernels, and cuda {where}; .*leave dense_kernel 'auto'"):
        trtllm.dense_route("cuda", "cudnn")


@pytest.mark.parametrize("spec,message", [
    (dict(backend="TRTLLM_ATTN", dense_kernel="fa4"),
     "dense_kernel='fa4' is invalid: expected one of ['auto', 'fmha_v2', 'flash_attn4', 'cudnn'] (Hopper's dense "
     "kernel under TRTLLM_ATTN; 'auto' takes the fastest that runs)"),
    (dict(backend="TORCH_SDPA", dense_kernel="flash_attn4"),
     "dense_kernel='flash_attn4' is invalid: expected 'auto' with backend='TORCH_SDPA': it chooses TRTLLM_ATTN's "
     "dense kernel on Hopper, so set backend 'TRTLLM_ATTN' to pin one"),
    (dict(dense_kernel="cudnn"),
     "dense_kernel='cudnn' is invalid: expected 'auto' with backend='auto': it chooses TRTLLM_ATTN's dense kernel "
     "on Hopper, so set backend 'TRTLLM_ATTN' to pin one")])
def test_the_config_refuses_a_dense_kernel_naming_field_value_and_what_is_valid(spec, message):
    with pytest.raises(AttentionConfigError) as refused:
        AttentionSpec.from_dict(spec)
    assert str(refused.value) == message


def test_the_config_keeps_a_pinned_dense_kernel_through_json():
    config = AttentionConfig.from_json('{"default": {"backend": "TRTLLM_ATTN", "dense_kernel": "fmha_v2"}}')
    assert config.default.dense_kernel == "fmha_v2" and AttentionSpec().dense_kernel == "auto"
    assert AttentionConfig.from_json(config.to_json()) == config


# ------------------------------------------------------------------------------------------ the calls (CPU)


class RecordingFlashAttention4:
    """Stands in for ``flash_attn.cute``: binds every call to the real signature, records it, and answers with
    float32 attention per sequence (``exact``) or zeros, as FlashAttention-4 does: ``(out, None)``."""

    def __init__(self, exact: bool = True):
        self.exact = exact
        self.calls = []

    def flash_attn_varlen_func(self, *args, **kwargs):
        bound = fa4_varlen_signature().bind(*args, **kwargs)
        bound.apply_defaults()
        self.calls.append(bound.arguments)
        if not self.exact:
            return torch.zeros_like(kwargs["q"]), None
        qkv = VarlenQKV(kwargs["q"], kwargs["k"], kwargs["v"], *(tuple(kwargs[c].diff().tolist())
                                                              for c in ("cu_seqlens_q", "cu_seqlens_k")))
        return exact_attention(qkv, kwargs["softmax_scale"]).to(qkv.q.dtype), None


def exact_attention(qkv: VarlenQKV, scale: float) -> torch.Tensor:
    """Float32 attention of each sequence of a packed batch (grouped heads allowed)."""
    pieces = []
    for q, k, v, _ in qkv.sequences():
        q, k, v = (x.float().transpose(0, 1)[None] for x in (q, k, v))
        pieces.append(F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)[0].transpose(0, 1))
    return torch.cat(pieces)


class RecordingFMHAv2:
    def __init__(self):
        self.calls = []

    def trtllm_fmha_v2_prefill(self, **kwargs):
        self.calls.append(kwargs)
        return torch.zeros_like(kwargs["qkv"][0])


@pytest.fixture
def kernels(monkeypatch, hopper):
    fa4, fmha = RecordingFlashAttention4(), RecordingFMHAv2()
    monkeypatch.setattr(flash_attn4, "flash_attn4_module", lambda: fa4)
    monkeypatch.setattr(flashinfer_fmha, "flashinfer_prefill", lambda: fmha)
    monkeypatch.setattr(flashinfer_fmha, "_prepare_fmha_v2", lambda device, dtype, layout: None)
    monkeypatch.setattr(flashinfer_fmha, "WORKSPACE_BYTES", 1024)
    monkeypatch.setattr(flashinfer_fmha, "_workspaces", flashinfer_fmha.StreamWorkspaces(4))
    return fa4, fmha


def test_a_ragged_grouped_batch_with_fewer_queries_than_keys_is_one_flash_attention_4_call(kernels):
    fa4, fmha = kernels
    qkv = ragged_qkv((300, 50, 128), (300, 80, 64))
    result = run_backend("TRTLLM_ATTN+flash_attn4", qkv, KernelPlan("TRTLLM_ATTN+flash_attn4", SCALE))
    [call] = fa4.calls
    assert fmha.calls == []
    assert call["q"] is qkv.q and call["k"] is qkv.k and call["v"] is qkv.v
    assert call["cu_seqlens_q"].tolist() == [0, 300, 350, 478] and call["cu_seqlens_k"].tolist() == [0, 300, 380, 444]
    assert call["cu_seqlens_q"].dtype == torch.int32 and (call["max_seqlen_q"], call["max_seqlen_k"]) == (300, 300)
    assert rel_err(result.out, exact_attention(qkv, SCALE)) < 1e-2


def test_the_flash_attention_4_call_reads_nothing_back_from_the_device(kernels, monkeypatch):
    fa4, _ = kernels
    fa4.exact = False
    qkv = ragged_qkv((300, 50), (300, 80))
    qkv.cu_seqlens("q"), qkv.cu_seqlens("kv")  # built once per batch shape, before the calls
    with monkeypatch.context() as no_host_reads:
        for name in ("tolist", "item", "cpu", "numpy"):
            no_host_reads.setattr(torch.Tensor, name, lambda *a, _name=name, **kw: pytest.fail(f"host read: {_name}"))
        trtllm.run(qkv, KernelPlan("TRTLLM_ATTN+flash_attn4", SCALE))
    assert len(fa4.calls) == 1


def test_the_cudnn_route_runs_torch_sdpa_with_cudnn_first(kernels, monkeypatch):
    fa4, fmha = kernels
    seen = []
    real = F.scaled_dot_product_attention

    def sdpa(*args, **kwargs):
        cuda = torch.backends.cuda
        seen.append((cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.math_sdp_enabled()))
        return real(*args, **kwargs)
    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    qkv = ragged_qkv((300, 50), (300, 80))
    result = trtllm.run(qkv, KernelPlan("TRTLLM_ATTN+cudnn", SCALE))
    assert fa4.calls == [] and fmha.calls == []
    assert seen == [(True, True, False)] * 2  # ragged: one call per sequence, cuDNN on, no math fallback
    assert rel_err(result.out, exact_attention(qkv, SCALE)) < 1e-2


@pytest.mark.parametrize("route", ["TRTLLM_ATTN+flash_attn4", "TRTLLM_ATTN+cudnn", "TRTLLM_ATTN+fmha_v2",
                                   "TRTLLM_ATTN"])
def test_skip_softmax_steps_stay_on_fmha_v2_whatever_runs_dense(kernels, route):
    fa4, fmha = kernels
    trtllm.run(ragged_qkv(), KernelPlan(route, SCALE, skip_factor=2822.6))
    assert fa4.calls == [] and [c["skip_softmax_threshold_scale_factor"] for c in fmha.calls] == [2822.6]


def test_fmha_v2_pinned_runs_dense_steps_on_fmha_v2(kernels):
    fa4, fmha = kernels
    trtllm.run(ragged_qkv(), KernelPlan("TRTLLM_ATTN+fmha_v2", SCALE))
    assert fa4.calls == [] and [c["skip_softmax_threshold_scale_factor"] for c in fmha.calls] == [0.0]


def test_sage_steps_stay_on_the_sage_kernel_whatever_runs_dense(kernels, monkeypatch):
    fa4, fmha = kernels
    sage = []
    monkeypatch.setattr(trtllm, "_run_hopper_sage", lambda qkv, plan: sage.append(plan.backend))
    trtllm.run(ragged_qkv(), KernelPlan("TRTLLM_ATTN+flash_attn4", SCALE, quant=AttnQuantSpec("fp8_e4m3")))
    assert sage == ["TRTLLM_ATTN+flash_attn4"] and fa4.calls == [] and fmha.calls == []


def test_warmup_builds_the_routed_dense_kernel_beside_fmha_v2(kernels, monkeypatch):
    fa4, fmha = kernels
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    timings = trtllm.warmup("cpu", sage=False)
    assert list(timings) == ["sm_90 torch.bfloat16", "sm_90 torch.bfloat16 dense flash_attn4"]
    assert len(fa4.calls) == 1 and len(fmha.calls) == 1


def test_warmup_with_lse_prepares_the_fmha_v2_layout_that_saves_statistics(kernels, monkeypatch):
    fa4, fmha = kernels
    prepared, ready = [], set()

    def prepare(device, dtype, layout):  # each layout once: the build is per layout
        prepared.append(layout)
        ready.add((device, dtype, layout))

    monkeypatch.setattr(flashinfer_fmha, "_prepare_fmha_v2", prepare)
    monkeypatch.setattr(flashinfer_fmha, "_ready_fmha_v2", ready)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    timings = trtllm.warmup("cpu", sage=False, dense_kernel="fmha_v2", lse=True)
    assert list(timings) == ["sm_90 torch.bfloat16", "sm_90 torch.bfloat16 dense fmha_v2",
                             "sm_90 torch.bfloat16 lse", "sm_90 torch.bfloat16 dense fmha_v2 lse"]
    assert prepared == ["SEPARATE_Q_K_V", "CONTIGUOUS_Q_KV"]
    assert [c["input_layout"] for c in fmha.calls] == ["SEPARATE_Q_K_V"] * 2 + ["CONTIGUOUS_Q_KV"] * 2


# -------------------------------------------------------------------- stated in the plan and the statistics


def bf16_wan():
    return tiny_wan(attention_head_dim=128).to(torch.bfloat16)


def bf16_inputs():
    return {k: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v
            for k, v in wan_inputs(batch=1).items()}


def test_install_states_the_dense_kernel_per_site_and_statistics_name_it(kernels):
    fa4, _ = kernels
    model = bf16_wan()
    inputs = bf16_inputs()
    with torch.no_grad():
        default = model(**inputs)[0]
        with enable_trtllm_attention(model, {"default": {"backend": "TRTLLM_ATTN"}}) as handle:
            out = model(**inputs)[0]
    assert {call.route for call in handle.planner.calls.values()} == {"TRTLLM_ATTN+flash_attn4"}
    assert {call.dense_kernel for call in handle.planner.calls.values()} == {"flash_attn4"}
    assert handle.stats.modes() == {0: {"TRTLLM_ATTN:dense[flash_attn4]": 4}}  # 2 layers × self + cross
    assert len(fa4.calls) == 4 and rel_err(out, default) < 2e-2


def test_a_per_role_pin_states_its_own_kernel(kernels):
    model = bf16_wan()
    config = {"default": {"backend": "TRTLLM_ATTN"},
              "per_role": {"cross": {"backend": "TRTLLM_ATTN", "dense_kernel": "cudnn"}}}
    with torch.no_grad(), enable_trtllm_attention(model, config) as handle:
        model(**bf16_inputs())
    kernels_by_role = {(site.category, call.dense_kernel) for site, call in handle.planner.calls.items()}
    assert kernels_by_role == {("self", "flash_attn4"), ("cross", "cudnn")}
    assert handle.stats.modes() == {0: {"TRTLLM_ATTN:dense[flash_attn4]": 2, "TRTLLM_ATTN:dense[cudnn]": 2}}


def test_an_explicit_kernel_that_cannot_run_raises_at_install_naming_the_site(hopper):
    hopper(fa4=False)
    model = bf16_wan()
    with pytest.raises(BackendUnavailableError, match=r"^transformer\.blocks\.0\.attn1 \(self_attn attention, "
                                                      r"per_role key 'default'\): dense_kernel='flash_attn4' "
                                                      r"\(FlashAttention-4\) cannot run on sm_90: FlashAttention-4 "
                                                      r"is not installed"):
        enable_trtllm_attention(model, {"default": {"backend": "TRTLLM_ATTN", "dense_kernel": "flash_attn4"}})


def test_a_skipping_site_states_dense_steps_and_skip_steps_apart(kernels):
    """A site with Skip-Softmax runs skip on FMHAv2 and, at steps its gate keeps dense, the chosen kernel."""
    model = bf16_wan()
    config = {"default": {"backend": "TRTLLM_ATTN", "skip_softmax": {"threshold": 0.1,
                                                                      "disabled_until_timestep": 0.5}}}
    with torch.no_grad(), enable_trtllm_attention(model, config) as handle:
        [call] = [c for s, c in handle.planner.calls.items() if s.layer == "blocks.0.attn1"]
        assert call.mode(skipping=False) == "dense[flash_attn4]" and call.mode(skipping=True) == "skip"


@pytest.mark.parametrize("requested", ["TRTLLM_ATTN", "auto"])
def test_a_call_not_planned_at_install_takes_autos_dense_kernel_at_its_first_call(hopper, monkeypatch, requested):
    monkeypatch.setattr(ops, "_UNPLANNED_CHOICES", {})
    qkv = ragged_qkv()
    assert ops.unplanned_backend(requested, qkv, False, 0.0, "") == "TRTLLM_ATTN+flash_attn4"
    hopper(fa4=False)
    assert ops.unplanned_backend(requested, qkv, False, 0.0, "") == "TRTLLM_ATTN+flash_attn4"  # chosen once


def test_the_dispatcher_refuses_a_pinned_dense_kernel():
    with pytest.raises(AttentionConfigError) as refused:
        set_dispatch_config({"default": {"backend": "TRTLLM_ATTN", "dense_kernel": "cudnn"}})
    assert str(refused.value) == ("dense_kernel='cudnn' is chosen per call site at install (enable_trtllm_attention); "
                                  "set_dispatch_config takes dense_kernel 'auto' only")


# -------------------------------------------------------------------------------------------------- GPU


def _hopper_gpu():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["flash_attn4", "cudnn", "fmha_v2"])
@pytest.mark.parametrize("seqlens_q,seqlens_kv,heads_q,heads_kv", [
    ((1000, 3001), (1000, 3001), 8, 2),       # ragged self-attention, grouped heads
    ((1932, 600), (1992, 700), 32, 8),        # fewer queries than keys (Cosmos 3's generation stream), grouped
    ((4096, 4096), (512, 512), 8, 8)])        # cross-attention on a short text
def test_gpu_dense_route_matches_float32_without_a_host_sync(kernel, seqlens_q, seqlens_kv, heads_q, heads_kv):
    _hopper_gpu()
    if kernel == "flash_attn4" and flash_attn4.unavailable_reason() is not None:
        pytest.skip(flash_attn4.unavailable_reason())
    torch.manual_seed(0)
    qkv = ragged_qkv(seqlens_q, seqlens_kv, heads_q, heads_kv)
    qkv = VarlenQKV(qkv.q.cuda(), qkv.k.cuda(), qkv.v.cuda(), qkv.seqlens_q, qkv.seqlens_kv)
    route = trtllm.dense_route(qkv.q.device, kernel)
    plan = KernelPlan(route, SCALE)
    run_backend(route, qkv, plan)  # compiles / builds, and caches the ragged index
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = run_backend(route, qkv, plan).out
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    exact = exact_attention(qkv, SCALE)
    assert out.dtype == torch.bfloat16 and out.shape == qkv.q.shape
    assert rel_err(out, exact) < 5e-3, rel_err(out, exact)

"""The log-sum-exp from TRTLLM_ATTN's routes (ring attention merges partial results by it), issue 48.

CPU: the call plans bound against FlashInfer's real signatures (the installed release and, where its wheel is
found, 0.7.2.post1), the conversions from each kernel's statistics (FMHAv2's ``(max / sqrt(d), sum)``,
trtllm-gen's base 2, SAGE's smoothing shift) through the routes with stand-ins that compute those statistics
exactly, and the refusal of the Triton SAGE route. GPU (``-m gpu``, sm_90): every Hopper route's log-sum-exp against
``reference_attention(..., with_lse=True)``.
"""

import ast
import math
import os
import pathlib
import zipfile

import pytest
import torch

from diffusers_trtllm.backends import run_backend, trtllm
from diffusers_trtllm.backends.base import KernelPlan, VarlenQKV, get_backend
from diffusers_trtllm.config import AttnQuantSpec
from diffusers_trtllm.kernels import fmha_v2_sage
from diffusers_trtllm.kernels.flashinfer_calls import (FMHA_V2, TRTLLM_GEN, build_ragged_index, fmha_v2_call,
                                                       fmha_v2_stats_lse, trtllm_gen_call)
from test_flashinfer_calls import on_arch, recording  # noqa: F401 - the fixture
from test_hopper_dense_kernel import _signature_from_source
from helpers import peaky_qkv

SCALE = 0.1  # not 1 / sqrt(128): FMHAv2 stores its max divided by sqrt(d) whatever the scale
REPO = pathlib.Path(__file__).resolve().parents[1]


def _qkv(seqlens_q, seqlens_kv, heads_q=4, heads_kv=2, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(sum(seqlens_q), heads_q, 128, generator=gen, device=device)
    k = torch.randn(sum(seqlens_kv), heads_kv, 128, generator=gen, device=device) + 0.5  # a mean to smooth away
    v = torch.randn(sum(seqlens_kv), heads_kv, 128, generator=gen, device=device)
    return VarlenQKV(q.bfloat16(), k.bfloat16(), v.bfloat16(), tuple(seqlens_q), tuple(seqlens_kv))


def _scores(qkv, smooth=False, batch_mean=False):
    """Per sequence: the raw scores ``[Hq, n_q, n_kv]`` float64 (K less its mean where ``smooth``)."""
    group = qkv.q.shape[1] // qkv.k.shape[1]
    batch_k_mean = qkv.k.double().mean(0)
    for q, k, _, _ in qkv.sequences():
        k = k.double()
        if smooth:
            k = k - (batch_k_mean if batch_mean else k.mean(0))
        yield torch.einsum("qhd,khd->hqk", q.double(), k.repeat_interleave(group, dim=1))


def _exact_lse(qkv):
    return torch.cat([torch.logsumexp(s * SCALE, -1).T for s in _scores(qkv)]).float()


# ---------------------------------------------------------------- CPU: signatures


def _wheel_signatures():
    """``{function: inspect.Signature}`` of ``flashinfer.prefill`` in each FlashInfer wheel found in
    ``$FLASHINFER_WHEELS`` or the checkout's ``.whl_fi`` (the device runs 0.7.2.post1)."""
    folders = [pathlib.Path(p) for p in (os.environ.get("FLASHINFER_WHEELS"), REPO / ".whl_fi") if p]
    found = {}
    for wheel in sorted(w for folder in folders if folder.is_dir() for w in folder.glob("flashinfer_python-*.whl")):
        tree = ast.parse(zipfile.ZipFile(wheel).read("flashinfer/prefill.py"))
        found[wheel.name.split("-")[1]] = {node.name: _signature_from_source(node) for node in tree.body
                                           if isinstance(node, ast.FunctionDef) and node.name in (FMHA_V2, TRTLLM_GEN)}
    return found


def _lse_calls():
    qkv = _qkv((300, 200), (300, 512), 8, 2)
    index = build_ragged_index(qkv.seqlens_q, qkv.seqlens_kv, "cpu")
    ws = torch.zeros(16, dtype=torch.uint8)
    return [fmha_v2_call(qkv.q, qkv.k, qkv.v, ws, index, SCALE, 0.0, return_lse=True),
            trtllm_gen_call(qkv.q, qkv.k, qkv.v, ws, index, SCALE, 0.0, return_lse=True)]


def test_the_lse_calls_bind_to_the_installed_flashinfer():
    prefill = pytest.importorskip("flashinfer.prefill")
    fmha, gen = _lse_calls()
    assert fmha.bind(prefill).arguments["save_softmax_stats"] is True
    assert gen.bind(prefill).arguments["return_lse"] is True


def test_the_lse_calls_bind_to_every_flashinfer_wheel_found():
    signatures = _wheel_signatures()
    if not signatures:
        pytest.skip("no FlashInfer wheel in $FLASHINFER_WHEELS or .whl_fi (e.g. FLASHINFER_WHEELS=/work/main/.whl_fi)")
    for version, functions in signatures.items():
        for call in _lse_calls():
            functions[call.function].bind(**call.kwargs)  # TypeError: the plan does not fit this release


# ---------------------------------------------------------------- CPU: conversions through the routes


def _fmha_v2_stats(q, k, scale):
    """FMHAv2's softmax statistics of ``q [n, Hq, D]`` on ``k [m, Hkv, D]`` as its saver writes them."""
    s = torch.einsum("qhd,khd->qhk", q.double(), k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1))
    row_max = s.amax(-1)
    return torch.stack([row_max / 128 ** 0.5, torch.exp(scale * (s - row_max[..., None])).sum(-1)], -1).float()


def test_fmha_v2_stats_become_the_natural_lse():
    qkv = _qkv((70,), (70,))
    lse = fmha_v2_stats_lse(_fmha_v2_stats(qkv.q, qkv.k, SCALE), SCALE, 128)
    torch.testing.assert_close(lse, _exact_lse(qkv), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dense_kernel", ["", "+fmha_v2", "+cudnn"])
def test_sm90_dense_lse_with_fewer_queries_than_keys(monkeypatch, recording, dense_kernel):
    """The zero-padded queries' statistics are dropped with their outputs; the cuDNN route runs FMHAv2 when asked
    for the log-sum-exp (torch SDPA gives none)."""
    on_arch(monkeypatch, "sm_90")

    def fmha_v2(**kwargs):
        recording._record(FMHA_V2, kwargs)
        q, kv = kwargs["qkv"]  # statistics come only with K and V stacked
        k = kv[:, 0]
        stats = torch.cat([_fmha_v2_stats(q[a:b], k[c:d], SCALE) for a, b, c, d in zip(
            kwargs["cum_seq_lens_q"][:-1], kwargs["cum_seq_lens_q"][1:], kwargs["cum_seq_lens_kv"][:-1],
            kwargs["cum_seq_lens_kv"][1:])])
        return torch.zeros_like(q), stats

    monkeypatch.setattr(recording, "trtllm_fmha_v2_prefill", fmha_v2)
    qkv = _qkv((300, 50, 128), (300, 80, 64))
    result = trtllm.run(qkv, KernelPlan("TRTLLM_ATTN" + dense_kernel, SCALE, return_lse=True))
    [(name, kw)] = recording.calls
    assert name == FMHA_V2 and kw["save_softmax_stats"] is True and kw["max_q_len"] == 300
    assert kw["input_layout"] == "CONTIGUOUS_Q_KV" and torch.equal(kw["qkv"][1][:, 1], qkv.v)
    assert result.lse.shape == qkv.q.shape[:2] and result.lse.dtype == torch.float32
    torch.testing.assert_close(result.lse, _exact_lse(qkv), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sage", [False, True])
def test_blackwell_lse_is_base_2_and_smoothing_is_added_back(monkeypatch, recording, sage):
    on_arch(monkeypatch, "sm_100")
    qkv = _qkv((100, 37), (100, 64))

    def ragged(**kwargs):  # trtllm-gen's base-2 LSE, of the quantizer's smoothed K with SAGE
        recording._record(TRTLLM_GEN, kwargs)
        lse = torch.cat([torch.logsumexp(s * SCALE, -1).T for s in _scores(qkv, smooth=sage, batch_mean=True)])
        return torch.zeros(kwargs["query"].shape, dtype=torch.bfloat16), (lse / math.log(2)).float()

    def quantize(**kwargs):  # identity "quantization" handing back the batch-wide K mean as FlashInfer does
        return (kwargs["query"], kwargs["key"], kwargs["value"], *(torch.ones(1) for _ in range(3)),
                kwargs["key"].double().mean(0).float())

    monkeypatch.setattr(recording, "trtllm_ragged_attention_deepseek", ragged)
    monkeypatch.setattr(recording, "trtllm_sage_attention_quantize", quantize)
    plan = KernelPlan("TRTLLM_ATTN", SCALE, return_lse=True,
                      quant=AttnQuantSpec("fp8_e4m3", 1, 16) if sage else None)
    assert trtllm.unavailable_reason(plan, qkv) is None
    lse = trtllm.run(qkv, plan).lse
    assert recording.calls[-1][1]["return_lse"] is True
    torch.testing.assert_close(lse, _exact_lse(qkv), rtol=1e-5, atol=2e-5)


def test_hopper_sage_lse_adds_each_sequences_smoothing_back(monkeypatch):
    """The FMHAv2 SAGE kernel's statistics are of each sequence's smoothed K, at the keys' row layout (zero
    queries after a shorter sequence's own), its max divided by the row's Q block scale (as the H200 showed): a
    stand-in kernel writes them exactly; the call returns the lse of the unsmoothed scores at the queries' rows."""
    qkv = _qkv((40, 200), (300, 200), 8, 2)
    q_scale = torch.rand(2, 8, 5) + 0.5  # [B, Hq, 64-row blocks of the longest key sequence]
    seen = {}

    class Module:
        def sage_attention(self, qk, v_t, v_starts, out, q_scale, k_scale, v_scale, cu, counter, skip_counts,
                           stats, *ints_and_floats):
            seen["stats"], seen["args"] = stats, ints_and_floats
            start = 0
            for b, ((q, k, _, _), n) in enumerate(zip(qkv.sequences(), qkv.seqlens_kv)):
                padded = torch.cat([q, q.new_zeros(n - q.shape[0], *q.shape[1:])])
                stats[start:start + n] = _fmha_v2_stats(padded, k.double() - k.double().mean(0), SCALE)
                stats[start:start + n, :, 0] /= q_scale[b].repeat_interleave(64, 1)[:, :n].T
                start += n

    monkeypatch.setattr(fmha_v2_sage, "load_module", lambda: Module())
    monkeypatch.setattr(fmha_v2_sage, "sage_quantize_packed", lambda *a: fmha_v2_sage.PackedSage(
        torch.zeros(qkv.k.shape[0], 10, 128), None, None, q_scale, None, torch.ones(2, 2, 128), 0))
    out, lse = fmha_v2_sage.fmha_v2_sage_attention(qkv.q, qkv.k, qkv.v, qkv.cu_seqlens("kv"), qkv.seqlens_kv, SCALE,
                                                   cu_seqlens_q=qkv.cu_seqlens("q"), seqlens_q=qkv.seqlens_q,
                                                   k_block=0, return_lse=True)
    assert seen["stats"].shape == (500, 8, 2) and seen["stats"].dtype == torch.float32
    assert out.shape == qkv.q.shape
    torch.testing.assert_close(lse, _exact_lse(qkv), rtol=1e-4, atol=1e-4)


def test_kernels_with_statistics_are_separate_and_at_the_kv_step_trtllm_attn_runs():
    encode_name = pytest.importorskip("flashinfer.jit.attention.fmha_v2.utils").encode_name
    kernels = fmha_v2_sage.sage_kernels()
    with_lse = [k for k in kernels if k.lse]
    assert {(k.k_block, k.skip_softmax) for k in with_lse} == {(b, s) for b in fmha_v2_sage.K_BLOCKS
                                                               for s in (False, True)}
    assert all(k.kv_step == trtllm.FMHA_V2_KV_STEP for k in with_lse)
    for kernel in with_lse:
        spec = fmha_v2_sage.kernel_spec(kernel)
        assert spec.return_softmax_stats and "_softmax" in encode_name(spec)[0]
    q = torch.zeros(64, 1, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="kv_step=128 and return_lse has no compiled FMHAv2 SAGE kernel"):
        fmha_v2_sage.fmha_v2_sage_attention(q, q, q, torch.tensor([0, 64], dtype=torch.int32), (64,), SCALE,
                                            kv_step=128, return_lse=True)


# ---------------------------------------------------------------- CPU: every route gives it


@pytest.mark.parametrize("quant,lengths", [
    (AttnQuantSpec("int8"), ((300,), (300,))),  # the Triton kernel
    (AttnQuantSpec("fp8_e4m3", 4, 4), ((300,), (300,))),  # the Triton kernel
    (AttnQuantSpec("fp8_e4m3"), ((600,), (300,))),  # more queries than keys: the Triton kernel
    (AttnQuantSpec("fp8_e4m3"), ((200,), (300,))),  # FMHAv2 SAGE
    (None, ((600,), (300,))),  # FMHAv2
])
def test_every_hopper_route_takes_a_plan_asking_for_the_lse(monkeypatch, quant, lengths):
    on_arch(monkeypatch, "sm_90")
    monkeypatch.setattr(trtllm, "flashinfer_unavailable_reason", lambda function: None)
    monkeypatch.setattr(trtllm.triton_sage, "triton_sage_unavailable_reason", lambda *args, **kwargs: None)
    plan = KernelPlan("TRTLLM_ATTN", SCALE, quant=quant, return_lse=True)
    assert trtllm.unavailable_reason(plan, _qkv(*lengths)) is None
    assert get_backend("TRTLLM_ATTN").lse_reason() is None


# ---------------------------------------------------------------- GPU: every Hopper route against the reference


def _hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")


def _peaky(seqlens_q, seqlens_kv, heads_q, heads_kv):
    """Fresh random position-correlated inputs (so Skip-Softmax skips some tiles) with a K mean to smooth."""
    return peaky_qkv(seqlens_q, seqlens_kv, heads_q, heads_kv, seed=None, k_mean=True)


GPU_CASES = {  # route, quant, skip factor, lse tolerance (abs., nats)
    "fmha_v2-dense": ("TRTLLM_ATTN+fmha_v2", None, 0.0, 2e-3),
    "fmha_v2-skip": ("TRTLLM_ATTN", None, 300.0, 2e-3),
    "cudnn-route": ("TRTLLM_ATTN+cudnn", None, 0.0, 2e-3),
    "flash_attn4": ("TRTLLM_ATTN+flash_attn4", None, 0.0, 2e-3),
    "sage-fp8": ("TRTLLM_ATTN", AttnQuantSpec("fp8_e4m3"), 0.0, 2e-2),
    "sage-fp8-k64-skip": ("TRTLLM_ATTN", AttnQuantSpec("fp8_e4m3", 64, 64), 300.0, 2e-2),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
@pytest.mark.parametrize("lengths", [((1000, 3001), (1000, 3001)), ((600, 1000), (1700, 1000))],
                         ids=["self", "fewer-queries"])
def test_gpu_each_hopper_route_gives_the_references_lse(case, lengths):
    _hopper()
    route, quant, skip_factor, tolerance = GPU_CASES[case]
    if route.endswith("flash_attn4") and trtllm.dense_kernel_unavailable_reason("flash_attn4"):
        pytest.skip(trtllm.dense_kernel_unavailable_reason("flash_attn4"))
    qkv = _peaky(*lengths, 8, 2)  # ragged, GQA
    plan = KernelPlan(route, 128 ** -0.5, quant=quant, skip_factor=skip_factor, return_lse=True, count_skips=True)
    result = run_backend(route, qkv, plan)
    ref = run_backend("TORCH_REFERENCE", qkv, plan)  # follows the SAGE kernel's semantics and skip tile
    if skip_factor:
        assert 0.1 < ref.skipped_tiles / ref.total_tiles < 0.9
    assert result.lse.shape == qkv.q.shape[:2] and result.lse.dtype == torch.float32
    assert torch.isfinite(result.lse).all()
    err = (result.lse - ref.lse).abs().max().item()
    assert err < tolerance, err  # a skip taken differently or a lost smoothing shift moves it by far more

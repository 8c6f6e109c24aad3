"""FlashInfer call plans, bound against the installed FlashInfer's real signatures, per supported GPU (on CPU)."""

import inspect
import math
import types

import pytest
import torch

from diffusers_trtllm.backends import trtllm
from diffusers_trtllm.backends.base import KernelPlan, VarlenQKV
from diffusers_trtllm.config import AttnQuantSpec
from diffusers_trtllm.kernels import flashinfer_fmha, triton_sage
from diffusers_trtllm.kernels.flashinfer_calls import (FMHA_V2, SAGE_QUANTIZE, TRTLLM_GEN, SageScales,
                                                       build_ragged_index, fmha_v2_call, sage_quantize_call,
                                                       sage_scale_shapes, trtllm_gen_call)

SCALE = 128 ** -0.5


def ragged_qkv(seqlens_q=(300, 517), seqlens_kv=None, heads_q=4, heads_kv=4, dtype=torch.bfloat16):
    seqlens_kv = seqlens_q if seqlens_kv is None else seqlens_kv
    q = torch.randn(sum(seqlens_q), heads_q, 128, dtype=dtype)
    k = torch.randn(sum(seqlens_kv), heads_kv, 128, dtype=dtype)
    v = torch.randn(sum(seqlens_kv), heads_kv, 128, dtype=dtype)
    return VarlenQKV(q, k, v, tuple(seqlens_q), tuple(seqlens_kv))


def test_ragged_index_values():
    index = build_ragged_index((3, 5), (4, 6), "cpu")
    assert index.cum_seq_lens_q.tolist() == [0, 3, 8]
    assert index.cum_seq_lens_kv.tolist() == [0, 4, 10]
    assert index.seq_lens_kv.tolist() == [4, 6]
    assert (index.max_q_len, index.max_kv_len, index.batch_size) == (5, 6, 2)
    for t in (index.cum_seq_lens_q, index.cum_seq_lens_kv, index.seq_lens_kv):
        assert t.dtype == torch.int32 and t.is_contiguous()


def test_ragged_index_is_cached_per_layout():
    a = flashinfer_fmha.ragged_index((3, 5), (3, 5), torch.device("cpu"))
    assert flashinfer_fmha.ragged_index((3, 5), (3, 5), torch.device("cpu")) is a
    assert flashinfer_fmha.ragged_index((5, 3), (5, 3), torch.device("cpu")) is not a


def test_sage_scale_shapes_batch_padded_layout():
    shapes = sage_scale_shapes(total_q=300 + 517, total_kv=300 + 517, heads_q=8, heads_kv=2, head_dim=128, batch=2,
                               q_block_size=1, k_block_size=16)
    assert shapes == {"q_scale": (8, 817 + 1), "k_scale": (2, math.ceil(817 / 16) + 1), "v_scale": (2, 128)}


def test_required_parameters_are_passed_by_the_call_plans():
    qkv = ragged_qkv()
    index = build_ragged_index(qkv.seqlens_q, qkv.seqlens_kv, "cpu")
    ws = torch.zeros(16, dtype=torch.uint8)
    sage = SageScales(*(torch.zeros(1) for _ in range(3)), 1, 16)
    passed = {FMHA_V2: fmha_v2_call(qkv.q, qkv.k, qkv.v, ws, index, SCALE, 0.0).kwargs,
              TRTLLM_GEN: trtllm_gen_call(qkv.q, qkv.k, qkv.v, ws, index, SCALE, 0.0, sage).kwargs,
              SAGE_QUANTIZE: sage_quantize_call(qkv.q, qkv.k, qkv.v, index, "int8", 1, 16).kwargs}
    for function, required in trtllm.REQUIRED_PARAMETERS.items():
        assert set(required) <= set(passed[function]), function


class RecordingFlashInfer:
    """Stands in for ``flashinfer.prefill``: binds every call to the real signature, records it, returns zeros
    shaped like the real outputs."""

    def __init__(self, real):
        self.real = real
        self.calls = []

    def _record(self, name, kwargs):
        inspect.signature(getattr(self.real, name)).bind(**kwargs)  # TypeError if the plan does not fit
        self.calls.append((name, kwargs))

    def trtllm_fmha_v2_prefill(self, **kwargs):
        self._record(FMHA_V2, kwargs)
        q = kwargs["qkv"][0]
        return torch.zeros_like(q)

    def trtllm_ragged_attention_deepseek(self, **kwargs):
        self._record(TRTLLM_GEN, kwargs)
        q = kwargs["query"]
        return torch.zeros(q.shape, dtype=torch.bfloat16)

    def trtllm_sage_attention_quantize(self, **kwargs):
        self._record(SAGE_QUANTIZE, kwargs)
        q, k, v = kwargs["query"], kwargs["key"], kwargs["value"]
        batch = kwargs["cum_seq_lens_q"].numel() - 1
        shapes = sage_scale_shapes(q.shape[0], k.shape[0], q.shape[1], k.shape[1], q.shape[2], batch,
                                   kwargs["q_block_size"], kwargs["k_block_size"])
        qk_dtype = kwargs["qk_quant_dtype"]
        return (torch.zeros(q.shape, dtype=qk_dtype), torch.zeros(k.shape, dtype=qk_dtype),
                torch.zeros(v.shape, dtype=torch.float8_e4m3fn), torch.ones(shapes["q_scale"]),
                torch.ones(shapes["k_scale"]), torch.ones(shapes["v_scale"]), torch.zeros(k.shape[1:]))


@pytest.fixture
def recording(monkeypatch):
    real = pytest.importorskip("flashinfer.prefill")
    fake = RecordingFlashInfer(real)
    monkeypatch.setattr(flashinfer_fmha, "flashinfer_prefill", lambda: fake)
    monkeypatch.setattr(flashinfer_fmha, "_prepare_fmha_v2", lambda device, dtype, layout: None)
    monkeypatch.setattr(flashinfer_fmha, "WORKSPACE_BYTES", 1024)
    monkeypatch.setattr(flashinfer_fmha, "_workspaces", flashinfer_fmha.StreamWorkspaces(4))
    return fake


def on_arch(monkeypatch, arch):
    monkeypatch.setattr(trtllm, "gpu_arch", lambda device: arch)


@pytest.mark.parametrize("skip_factor", [0.0, 5000.0])
def test_sm90_ragged_batch_is_one_fmha_v2_call(monkeypatch, recording, skip_factor):
    on_arch(monkeypatch, "sm_90")
    qkv = ragged_qkv((300, 517), heads_q=8, heads_kv=2)
    plan = KernelPlan("TRTLLM_ATTN", SCALE, skip_factor=skip_factor)
    assert trtllm.unavailable_reason(plan, qkv) is None
    result = trtllm.run(qkv, plan)
    assert result.out.shape == qkv.q.shape and result.skipped_tiles is None
    [(name, kw)] = recording.calls
    assert name == FMHA_V2
    q, k, v = kw["qkv"]
    assert q is qkv.q and k is qkv.k and v is qkv.v  # contiguous inputs are passed without a copy
    assert kw["input_layout"] == "SEPARATE_Q_K_V" and kw["mask_mode"] == "padding"
    assert kw["bmm1_scale"] == SCALE and kw["bmm2_scale"] == 1.0
    assert kw["skip_softmax_threshold_scale_factor"] == skip_factor
    assert kw["cum_seq_lens_q"].tolist() == [0, 300, 817] and kw["cum_seq_lens_kv"].tolist() == [0, 300, 817]
    assert kw["seq_lens"].tolist() == [300, 517]
    assert (kw["max_q_len"], kw["max_kv_len"], kw["batch_size"]) == (517, 517, 2)
    assert kw["workspace_buffer"].numel() == 1024


def test_sm90_makes_strided_inputs_contiguous(monkeypatch, recording):
    on_arch(monkeypatch, "sm_90")
    bshd = torch.randn(2, 4, 256, 128, dtype=torch.bfloat16).transpose(1, 2)  # [B, S, H, D] view, not contiguous
    qkv = VarlenQKV.from_bshd(bshd, bshd, bshd)
    trtllm.run(qkv, KernelPlan("TRTLLM_ATTN", SCALE))
    [(_, kw)] = recording.calls
    assert all(t.is_contiguous() for t in kw["qkv"])
    assert torch.equal(kw["qkv"][0], qkv.q)


def test_sm90_fewer_queries_than_keys_pads_and_drops_queries_without_reading_the_device(monkeypatch, recording):
    """Cosmos 3's generation stream (fewer queries than keys): the kernel sees queries zero-padded to the key
    length, the caller gets back exactly its own rows, and no tensor is read back to the host on the way."""
    on_arch(monkeypatch, "sm_90")

    def echo_queries(**kwargs):  # each output row is its query row: the rows handed back show where they came from
        recording._record(FMHA_V2, kwargs)
        return kwargs["qkv"][0].clone()

    monkeypatch.setattr(recording, "trtllm_fmha_v2_prefill", echo_queries)
    qkv = ragged_qkv((300, 50, 128), (300, 80, 64))
    with monkeypatch.context() as no_host_reads:
        for name in ("tolist", "item", "cpu", "numpy"):
            no_host_reads.setattr(torch.Tensor, name, lambda *a, _name=name, **kw: pytest.fail(f"host read: {_name}"))
        result = trtllm.run(qkv, KernelPlan("TRTLLM_ATTN", SCALE))
    [(_, kw)] = recording.calls
    assert kw["cum_seq_lens_q"].tolist() == [0, 300, 380, 508] and kw["max_q_len"] == 300
    assert not kw["qkv"][0][350:380].any()
    assert torch.equal(result.out, qkv.q)


def test_workspace_is_allocated_once_per_device(monkeypatch, recording):
    on_arch(monkeypatch, "sm_90")
    qkv = ragged_qkv((256,))
    trtllm.run(qkv, KernelPlan("TRTLLM_ATTN", SCALE))
    trtllm.run(ragged_qkv((128, 128)), KernelPlan("TRTLLM_ATTN", SCALE, skip_factor=10.0))
    first, second = (kw["workspace_buffer"] for _, kw in recording.calls)
    assert first is second


@pytest.mark.parametrize("arch", ["sm_100", "sm_103"])
@pytest.mark.parametrize("skip_factor", [0.0, 2822.6])
def test_blackwell_dense_call(monkeypatch, recording, arch, skip_factor):
    on_arch(monkeypatch, arch)
    qkv = ragged_qkv((300, 517), (512, 512), heads_q=8, heads_kv=8)  # cross-attention shape is allowed here
    plan = KernelPlan("TRTLLM_ATTN", SCALE, skip_factor=skip_factor)
    assert trtllm.unavailable_reason(plan, qkv) is None
    trtllm.run(qkv, plan)
    [(name, kw)] = recording.calls
    assert name == TRTLLM_GEN
    assert kw["query"] is qkv.q and kw["key"] is qkv.k and kw["value"] is qkv.v
    assert kw["bmm1_scale"] == SCALE and kw["bmm2_scale"] == 1.0 and kw["o_sf_scale"] == -1.0
    assert kw["skip_softmax_threshold_scale_factor"] == (skip_factor if skip_factor else None)
    assert kw["is_causal"] is False and kw["return_lse"] is False and kw["window_left"] == -1
    assert kw["skip_all_rows_active_check"] is True
    assert kw["cum_seq_lens_q"].tolist() == [0, 300, 817] and kw["cum_seq_lens_kv"].tolist() == [0, 512, 1024]
    assert kw["seq_lens"].tolist() == [512, 512]
    assert (kw["max_q_len"], kw["max_kv_len"], kw["batch_size"]) == (517, 512, 2)
    assert "sage_attn_sfs" not in kw


@pytest.mark.parametrize("arch,dtype_qk", [("sm_100", "int8"), ("sm_100", "fp8_e4m3"), ("sm_103", "fp8_e4m3")])
@pytest.mark.parametrize("k_block", [1, 4, 16])
def test_blackwell_sage_calls(monkeypatch, recording, arch, dtype_qk, k_block):
    on_arch(monkeypatch, arch)
    qkv = ragged_qkv((300, 517), heads_q=8, heads_kv=2)
    quant = AttnQuantSpec(dtype_qk=dtype_qk, q_block_size=1, k_block_size=k_block)
    plan = KernelPlan("TRTLLM_ATTN", SCALE, skip_factor=1000.0, quant=quant)
    assert trtllm.unavailable_reason(plan, qkv) is None
    trtllm.run(qkv, plan)
    (qname, qkw), (aname, akw) = recording.calls
    assert (qname, aname) == (SAGE_QUANTIZE, TRTLLM_GEN)
    expected_dtype = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}[dtype_qk]
    assert qkw["qk_quant_dtype"] == expected_dtype and qkw["smooth_k"] is True
    assert (qkw["q_block_size"], qkw["k_block_size"]) == (1, k_block)
    assert qkw["cum_seq_lens_q"].tolist() == [0, 300, 817]
    assert akw["query"].dtype == expected_dtype and akw["value"].dtype == torch.float8_e4m3fn
    q_sf, k_sf, p_sf, v_sf = akw["sage_attn_sfs"]
    assert p_sf is None
    assert tuple(q_sf.shape) == (8, 817 + 1) and tuple(k_sf.shape) == (2, math.ceil(817 / k_block) + 1)
    assert tuple(v_sf.shape) == (2, 128)
    assert akw["num_elts_per_sage_attn_blk"] == (1, k_block, 0, 1)
    assert akw["bmm1_scale"] == SCALE and akw["bmm2_scale"] == 1.0  # dequantization is in the scale tensors
    assert akw["skip_softmax_threshold_scale_factor"] == 1000.0


@pytest.mark.parametrize("quant,lengths,kernel", [
    (AttnQuantSpec(dtype_qk="int8"), ((300, 200), (300, 200)), "triton"),
    (AttnQuantSpec(dtype_qk="fp8_e4m3", q_block_size=1, k_block_size=16), ((300, 200), (300, 200)), "triton"),
    (AttnQuantSpec(dtype_qk="fp8_e4m3"), ((300, 600), (300, 512)), "triton"),  # a sequence with more queries
    (AttnQuantSpec(dtype_qk="fp8_e4m3"), ((300, 200), (300, 512)), "fmha_v2"),  # fewer: zero-padded queries
    (AttnQuantSpec(dtype_qk="fp8_e4m3"), ((300, 200), (300, 200)), "fmha_v2"),
    (AttnQuantSpec(dtype_qk="fp8_e4m3", q_block_size=64, k_block_size=128), ((300, 200), (300, 200)), "fmha_v2")])
def test_sm90_sage_routes_by_dtype_blocks_and_lengths(monkeypatch, recording, quant, lengths, kernel):
    on_arch(monkeypatch, "sm_90")
    seen = {}

    def triton_sage_attention(q, k, v, cu_q, cu_kv, seqlens_q, seqlens_kv, scale, **kwargs):
        seen["triton"] = kwargs
        return torch.zeros_like(q), None, None

    def fmha_v2_sage_attention(q, k, v, cu, seqlens, scale, **kwargs):
        seen["fmha_v2"] = kwargs
        return torch.zeros_like(q)

    monkeypatch.setattr(trtllm, "triton_sage", types.SimpleNamespace(
        triton_sage_attention=triton_sage_attention, skip_sample_rule=triton_sage.skip_sample_rule,
        triton_sage_unavailable_reason=lambda *a, **kw: None))
    monkeypatch.setattr(trtllm.fmha_v2_sage, "fmha_v2_sage_attention", fmha_v2_sage_attention)
    plan = KernelPlan("TRTLLM_ATTN", SCALE, quant=quant)
    q = torch.zeros(sum(lengths[0]), 4, 128, dtype=torch.bfloat16)
    kv = torch.zeros(sum(lengths[1]), 4, 128, dtype=torch.bfloat16)
    qkv = VarlenQKV(q, kv, kv.clone(), *lengths)
    assert trtllm.unavailable_reason(plan, qkv) is None
    trtllm.run(qkv, plan)
    assert list(seen) == [kernel] and recording.calls == []
    if kernel == "fmha_v2":
        expected = trtllm.FMHA_V2_DEFAULT_K_BLOCK if quant.k_block_size is None else quant.k_block_size
        assert seen["fmha_v2"]["k_block"] == expected and seen["fmha_v2"]["kv_step"] == trtllm.FMHA_V2_KV_STEP
    else:
        assert (seen["triton"]["q_block"], seen["triton"]["k_block"]) == (1, 16)
        # the kernel samples as the semantics say (every other 64-row tile: 5 tiles a sequence, 8 (sequence, head)s)
        assert seen["triton"]["skip_sample"] == (2, triton_sage.SKIP_PAYS_FROM)
"""FMHAv2 SAGE on sequences with fewer queries than keys (Cosmos 3's generation stream: its queries on text +
generation keys): each sequence runs as self-attention on its keys, its queries first and zero queries after them.

CPU: the quantizer's padded layout under Triton's interpreter (in a subprocess: ``TRITON_INTERPRET=1`` must be set
before Triton is imported) against the PyTorch reference bit for bit; the reference of the padded semantics (a query
tile mixing real and zero rows never skips); which Hopper kernel serves which lengths and what a refusal says; the
rows ``fmha_v2_sage_attention`` returns. GPU (``-m gpu``, sm_90): the compiled kernel against the reference of its
semantics at a Cosmos 3-like shape.
"""

import math
import os
import sys

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from diffusers_trtllm.backends import run_backend, trtllm
from diffusers_trtllm.backends.base import KernelPlan, VarlenQKV, more_queries_than_keys
from diffusers_trtllm.backends.reference import reference_attention
from diffusers_trtllm.config import AttnQuantSpec
from diffusers_trtllm.kernels import fmha_v2_sage
from diffusers_trtllm.kernels.numerics import FP8_MAX
from diffusers_trtllm.quant import SageSemantics, quantize_sequence, scale_of
from helpers import run_script_under_triton_interpreter

SCALE = 128 ** -0.5


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _cu(lengths, device="cpu"):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


# ---------------------------------------------------------------- CPU: the quantizer under Triton's interpreter

# Sequence 0: 100 queries on 164 keys (Q block 1 mixes 36 real and 28 zero rows, block 2 is all zeros); sequence 1:
# 150 queries on 300 keys (block 2 mixed, blocks 3 and 4 all zeros). GQA: 4 query heads on 2 kv heads.
Q_LENGTHS, KV_LENGTHS, HEADS_Q, HEADS_KV = (100, 150), (164, 300), 4, 2


def _inputs():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(sum(Q_LENGTHS), HEADS_Q, 128, generator=gen)
    k = torch.randn(sum(KV_LENGTHS), HEADS_KV, 128, generator=gen) + 2 * torch.randn(1, HEADS_KV, 128, generator=gen)
    v = torch.randn(sum(KV_LENGTHS), HEADS_KV, 128, generator=gen)
    return [x.bfloat16() for x in (q, k, v)]


def _run_interpreted(results_path):
    sys.path.insert(0, os.path.dirname(__file__))
    from test_triton_sage import _fix_triton_interpreter

    _fix_triton_interpreter()
    q, k, v = _inputs()
    q_before = q.clone()
    results = {kb: fmha_v2_sage.sage_quantize_packed(q, k, v, _cu(KV_LENGTHS), max(KV_LENGTHS), kb,
                                                     _cu(Q_LENGTHS), max(Q_LENGTHS))
               for kb in fmha_v2_sage.K_BLOCKS}
    results["q_untouched"] = torch.equal(q, q_before)
    torch.save(results, results_path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    pytest.importorskip("triton")
    return run_script_under_triton_interpreter(__file__, tmp_path_factory.mktemp("sage_fewer_queries") / "packed.pt")


def _sequences():
    """Per sequence: (index, query rows of q, key rows of k/v and of the packed tensor, its zero-padded Q)."""
    q, k, v = _inputs()
    q_start = kv_start = 0
    for i, (n_q, n_kv) in enumerate(zip(Q_LENGTHS, KV_LENGTHS)):
        q_rows, kv_rows = slice(q_start, q_start + n_q), slice(kv_start, kv_start + n_kv)
        padded = torch.cat([q[q_rows].float(), q.new_zeros(n_kv - n_q, HEADS_Q, 128).float()])
        yield i, q_rows, kv_rows, padded
        q_start, kv_start = q_start + n_q, kv_start + n_kv


@pytest.mark.parametrize("k_block", fmha_v2_sage.K_BLOCKS)
def test_padded_queries_match_the_reference_bit_for_bit(interpreted, k_block):
    packed = interpreted[k_block]
    q, k, v = _inputs()
    semantics = SageSemantics("fp8_e4m3", 64, k_block, p_scale=256.0)
    assert packed.qk.shape == (sum(KV_LENGTHS), HEADS_Q + HEADS_KV, 128)
    for i, q_rows, kv_rows, padded in _sequences():
        n_q, n_kv = Q_LENGTHS[i], KV_LENGTHS[i]
        ref = quantize_sequence(padded, k[kv_rows].float(), v[kv_rows].float(), semantics)
        values = packed.qk[kv_rows, :HEADS_Q].float()
        assert torch.equal(values, ref.q)
        # real rows: what the unpadded quantization gives; zero rows: exactly zero
        unpadded = quantize_sequence(q[q_rows].float(), k[kv_rows].float(), v[kv_rows].float(), semantics)
        assert torch.equal(values[:n_q], unpadded.q)
        assert not packed.qk[kv_rows.start + n_q:kv_rows.stop, :HEADS_Q].view(torch.uint8).any()
        assert torch.equal(packed.qk[kv_rows, HEADS_Q:].float(), ref.k)
        assert torch.equal(packed.v_scale[i], ref.v_scale)
        blocks = -(-n_kv // 64)
        q_scale = packed.q_scale[i, :, :blocks].repeat_interleave(64, 1)[:, :n_kv].T[..., None]
        if k_block:
            assert torch.equal(q_scale, ref.q_scale)
            # blocks of zero rows only: the floor scale
            zero_blocks = packed.q_scale[i, :, -(-n_q // 64):blocks]
            assert zero_blocks.numel() and (zero_blocks == scale_of(torch.zeros(()), FP8_MAX)).all()
        else:  # K's one scale per sequence and head is folded into Q's scales
            folded = ref.q_scale * ref.k_scale[0, :, 0].repeat_interleave(HEADS_Q // HEADS_KV)[None, :, None]
            assert torch.allclose(q_scale, folded, rtol=1e-6, atol=0)
        assert (packed.q_scale[i, :, blocks:] == 1).all()  # past the sequence's keys: the 1 they start at


def test_quantizer_leaves_the_queries_untouched(interpreted):
    assert interpreted["q_untouched"]


# ---------------------------------------------------------------- CPU: the reference of the padded semantics


def fmha_v2_semantics(padded: bool = True, bits: int | None = None) -> SageSemantics:
    """The FMHAv2 SAGE kernel's semantics with K blocks of 64, exact sums by default (fast on a CPU)."""
    semantics = trtllm.fmha_v2_sage_semantics(64, fp8_accumulator_bits=bits)
    assert semantics.q_padded_to_kv
    return SageSemantics(**{**semantics.__dict__, "q_padded_to_kv": padded})


def mixed_tile_case(n_q=100, n_kv=512, heads=2, gap=3.0):
    """Queries whose scores on keys 0-127 exceed those on every later key by ``gap`` nats: at λ = 0.1 > e^-3 every
    real query row finds the second 256-key step negligible, while a zero query row (scores all 0) never does."""
    gen = torch.Generator().manual_seed(3)
    q = 0.05 * torch.randn(n_q, heads, 128, generator=gen)
    k = 0.05 * torch.randn(n_kv, heads, 128, generator=gen)
    v = torch.randn(n_kv, heads, 128, generator=gen)
    amplitude = math.sqrt(gap / (2 * SCALE))
    q[..., 0] = amplitude
    k[:128, :, 0], k[128:, :, 0] = amplitude, -amplitude
    v[256:] += 4.0  # what skipping the second step leaves out is far from the rest
    return q, k, v


def test_a_query_tile_mixing_real_and_zero_rows_never_skips():
    q, k, v = mixed_tile_case()
    lam = 0.1
    padded, padded_skips, padded_tiles = reference_attention(q, k, v, SCALE, skip_lambda=lam,
                                                             quant=fmha_v2_semantics(), tile=(64, 128), kv_step=256)
    plain, plain_skips, plain_tiles = reference_attention(q, k, v, SCALE, skip_lambda=lam,
                                                          quant=fmha_v2_semantics(False), tile=(64, 128), kv_step=256)
    dense, _, _ = reference_attention(q, k, v, SCALE, quant=fmha_v2_semantics(), tile=(64, 128), kv_step=256)
    # per head: unpadded, both query tiles skip the second step's two KV tiles; padded, only the all-real tile 0
    # does (the 512 padded rows make 8 query tiles of 4 KV tiles each)
    assert (int(plain_skips), plain_tiles) == (2 * 2 * 2, 2 * 4 * 2)
    assert (int(padded_skips), padded_tiles) == (1 * 2 * 2, 8 * 4 * 2)
    assert padded.shape == q.shape
    assert _rel(padded[64:], dense[64:]) < 1e-6  # the mixed tile (rows 64-99) attended every key
    assert _rel(plain[64:], dense[64:]) > 0.3 and _rel(padded[:64], dense[:64]) > 0.3
    assert _rel(padded[:64], plain[:64]) < 1e-6


@pytest.mark.parametrize("bits", [None, trtllm.SM90_FP8_ACCUMULATOR_BITS])
def test_without_a_mixed_tile_real_rows_equal_the_unpadded_result(bits):
    q, k, v = mixed_tile_case(n_q=128)  # two whole query tiles: the zero rows have tiles of their own
    semantics = fmha_v2_semantics(bits=bits)
    padded, padded_skips, _ = reference_attention(q, k, v, SCALE, skip_lambda=0.1, quant=semantics, tile=(64, 128),
                                                  kv_step=256)
    plain, plain_skips, _ = reference_attention(q, k, v, SCALE, skip_lambda=0.1, quant=fmha_v2_semantics(False, bits),
                                                tile=(64, 128), kv_step=256)
    assert _rel(padded, plain) < 1e-6 and int(padded_skips) == int(plain_skips) == 2 * 2 * 2


def test_padded_reference_is_per_sequence_through_the_reference_backend(monkeypatch):
    """TORCH_REFERENCE on an sm_90 device (the arch faked, the tensors on the CPU): each sequence padded to its own
    key length, the output packed at the queries' layout."""
    monkeypatch.setattr(trtllm, "gpu_arch", lambda device: "sm_90")
    q0, k0, v0 = mixed_tile_case(100, 512)
    q1, k1, v1 = mixed_tile_case(70, 300)
    qkv = VarlenQKV(torch.cat([q0, q1]), torch.cat([k0, k1]), torch.cat([v0, v1]), (100, 70), (512, 300))
    quant = AttnQuantSpec("fp8_e4m3", 64, 64)
    assert trtllm.sage_semantics(quant, "cuda", (100, 70), (512, 300)).q_padded_to_kv
    plan = KernelPlan("TORCH_REFERENCE", SCALE, quant=quant, skip_factor=0.1 * 512)
    result = run_backend("TORCH_REFERENCE", qkv, plan)
    semantics = trtllm.fmha_v2_sage_semantics(64)
    for (q, k, v), rows, n_kv in zip(((q0, k0, v0), (q1, k1, v1)), (slice(0, 100), slice(100, 170)), (512, 300)):
        expected, _, _ = reference_attention(q, k, v, SCALE, skip_lambda=0.1 * 512 / n_kv, quant=semantics,
                                             tile=fmha_v2_sage.SKIP_TILE, kv_step=trtllm.FMHA_V2_KV_STEP)
        assert torch.equal(result.out[rows], expected)


@pytest.mark.parametrize("n_q,causal", [(600, False), (100, True)])
def test_padded_semantics_refuse_more_queries_and_causal(n_q, causal):
    q, k, v = mixed_tile_case(n_q=n_q)
    with pytest.raises(ValueError, match=f"{n_q} queries on 512 keys, causal={causal}"):
        reference_attention(q, k, v, SCALE, causal=causal, quant=fmha_v2_semantics(), tile=(64, 128))


# ---------------------------------------------------------------- CPU: which kernel serves


@pytest.mark.parametrize("quant,lengths,kernel", [
    (AttnQuantSpec("fp8_e4m3"), ((19320,), (19920,)), "fmha_v2"),  # Cosmos 3's generation stream
    (AttnQuantSpec("fp8_e4m3"), ((100, 300), (164, 300)), "fmha_v2"),
    (AttnQuantSpec("fp8_e4m3", 64, 128), ((100,), (164,)), "fmha_v2"),
    (AttnQuantSpec("fp8_e4m3"), ((600,), (512,)), "triton"),  # more queries than keys
    (AttnQuantSpec("fp8_e4m3"), ((100, 301), (164, 300)), "triton"),  # one sequence with more is enough
    (AttnQuantSpec("int8"), ((100,), (164,)), "triton"),
    (AttnQuantSpec("fp8_e4m3", 1, 16), ((100,), (164,)), "triton"),
])
def test_hopper_kernel_by_lengths_and_dtype(monkeypatch, quant, lengths, kernel):
    monkeypatch.setattr(trtllm, "gpu_arch", lambda device: "sm_90")
    semantics = trtllm.sage_semantics(quant, "cuda", *lengths)
    assert (semantics.q_block == 64) == (kernel == "fmha_v2")
    assert semantics.q_padded_to_kv == (kernel == "fmha_v2")
    assert trtllm._sage_block_reason(quant, "sm_90", more_queries_than_keys(*lengths)) is None


def test_fmha_v2_blocks_on_more_queries_than_keys_are_refused_with_the_reason():
    reason = trtllm._sage_block_reason(AttnQuantSpec("fp8_e4m3", 64, 64), "sm_90", True)
    assert reason == ("SAGE blocks q=64, k=64 have no fp8_e4m3 kernel on sm_90; compiled: q block [1, 4, 16], k block "
                      "[1, 4, 16] (FMHAv2's q block 64 serves sequences with at most as many queries as keys: this "
                      "call has a sequence with more queries than keys); leave the block sizes unset for the fastest")
    assert trtllm._sage_block_reason(AttnQuantSpec("fp8_e4m3", 64, 64), "sm_90", False) is None


def test_the_hopper_sage_call_gets_key_lengths_and_query_lengths(monkeypatch):
    monkeypatch.setattr(trtllm, "gpu_arch", lambda device: "sm_90")
    seen = {}

    def fake(q, k, v, cu_seqlens, seqlens, scale, **kwargs):
        seen.update(cu_seqlens=cu_seqlens, seqlens=seqlens, **kwargs)
        return torch.zeros_like(q)

    monkeypatch.setattr(trtllm.fmha_v2_sage, "fmha_v2_sage_attention", fake)
    qkv = VarlenQKV(torch.zeros(250, 4, 128, dtype=torch.bfloat16), torch.zeros(464, 2, 128, dtype=torch.bfloat16),
                    torch.zeros(464, 2, 128, dtype=torch.bfloat16), (100, 150), (164, 300))
    trtllm._run_hopper_sage(qkv, KernelPlan("TRTLLM_ATTN", SCALE, quant=AttnQuantSpec("fp8_e4m3"), skip_factor=7.0))
    assert seen["seqlens"] == (164, 300) and seen["seqlens_q"] == (100, 150)
    assert seen["cu_seqlens"].tolist() == [0, 164, 464] and seen["cu_seqlens_q"].tolist() == [0, 100, 250]
    assert (seen["k_block"], seen["kv_step"], seen["skip_factor"]) == (0, 256, 7.0)


# ---------------------------------------------------------------- CPU: the rows fmha_v2_sage_attention returns


@pytest.fixture
def fake_kernel(monkeypatch):
    """The quantizer and the compiled kernel replaced: the kernel writes each output row's index into it (as
    ``row % 256`` and ``row // 256``: exact in bf16)."""
    calls = {}

    def quantize_into(q, k, v, cu_q, cu_kv, max_q, max_kv, targets, **kwargs):
        calls["quantize"] = (cu_q.tolist(), cu_kv.tolist(), max_q, max_kv, targets.q.shape, targets.q_padded_to_kv)

    class Module:
        def sage_attention(self, qk, v_t, v_starts, out, q_scale, k_scale, v_scale, cu, tile_counter, skip_counts,
                           softmax_stats, tile_map_entry, tile_map, heads_q, heads_kv, max_seqlen, *args):
            calls["kernel"] = (out, cu.tolist(), max_seqlen)
            rows = torch.arange(out.shape[0])
            out.zero_()
            out[:, 0, 0], out[:, 0, 1] = rows % 256, rows // 256

    monkeypatch.setattr(fmha_v2_sage.triton_sage, "quantize_into", quantize_into)
    monkeypatch.setattr(fmha_v2_sage, "load_module", lambda: Module())
    return calls


def _call(q_lengths, kv_lengths, **kwargs):
    q = torch.zeros(sum(q_lengths), 4, 128, dtype=torch.bfloat16)
    k = torch.zeros(sum(kv_lengths), 2, 128, dtype=torch.bfloat16)
    return fmha_v2_sage.fmha_v2_sage_attention(q, k, k, _cu(kv_lengths), tuple(kv_lengths), SCALE,
                                               cu_seqlens_q=_cu(q_lengths), seqlens_q=tuple(q_lengths), k_block=0,
                                               **kwargs)


def test_one_sequence_returns_a_view_of_the_real_rows(fake_kernel):
    out = _call((100,), (164,))
    kernel_out, cu, max_seqlen = fake_kernel["kernel"]
    assert (cu, max_seqlen) == ([0, 164], 164) and kernel_out.shape[0] == 164
    assert fake_kernel["quantize"] == ([0, 100], [0, 164], 100, 164, (164, 4, 128), True)
    assert out.shape == (100, 4, 128) and out.data_ptr() == kernel_out.data_ptr() and out.is_contiguous()


def test_several_sequences_return_their_real_rows_in_order(fake_kernel):
    out = _call((100, 150), (164, 300))
    rows = out[:, 0, 0].long() + 256 * out[:, 0, 1].long()
    assert torch.equal(rows, torch.cat([torch.arange(100), 164 + torch.arange(150)]))
    assert fake_kernel["quantize"][:4] == ([0, 100, 250], [0, 164, 464], 150, 300)


def test_equal_lengths_return_the_kernel_output_itself(fake_kernel):
    out = _call((100, 150), (100, 150))
    assert out is fake_kernel["kernel"][0]
    assert fake_kernel["quantize"][:4] == ([0, 100, 250], [0, 100, 250], 150, 150)


@pytest.mark.parametrize("q_lengths,kv_lengths,words", [
    ((165,), (164,), "seqlens_q=(165,) on seqlens=(164,): the FMHAv2 SAGE kernel takes, per sequence, at most"),
    ((100, 100), (164,), "seqlens_q=(100, 100) on seqlens=(164,)"),
])
def test_more_queries_than_keys_are_refused(fake_kernel, q_lengths, kv_lengths, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        _call(q_lengths, kv_lengths)
    assert not fake_kernel


def test_query_offsets_without_lengths_are_refused(fake_kernel):
    q = torch.zeros(100, 4, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cu_seqlens_q and seqlens_q come together"):
        fmha_v2_sage.fmha_v2_sage_attention(q, q, q, _cu((164,)), (164,), SCALE, cu_seqlens_q=_cu((100,)),
                                            k_block=0)


# ---------------------------------------------------------------- GPU: the compiled kernel


def _hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")


def cosmos_like(text, gen_lengths, heads_q=32, heads_kv=8):
    """Cosmos 3's generation stream, small: per sequence ``text`` text keys then its generation tokens, the
    generation tokens also the queries; peaky scores (nearby positions align)."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    qs, ks, vs = [], [], []
    for n in gen_lengths:
        pos = torch.arange(text + n, device="cuda", dtype=torch.float32)[:, None]
        freqs = torch.logspace(-3, -0.5, 64, device="cuda")[None, :]
        feature = torch.cat([torch.sin(pos * freqs), torch.cos(pos * freqs)], 1)[:, None]
        qs.append(2 * (feature[text:] + 0.3 * torch.randn(n, heads_q, 128, device="cuda", generator=gen)))
        ks.append(2 * (feature + 0.3 * torch.randn(text + n, heads_kv, 128, device="cuda", generator=gen)))
        vs.append(torch.randn(text + n, heads_kv, 128, device="cuda", generator=gen))
    return VarlenQKV(*(torch.cat(x).bfloat16() for x in (qs, ks, vs)), tuple(gen_lengths),
                     tuple(text + n for n in gen_lengths))


@pytest.mark.gpu
@pytest.mark.parametrize("gen_lengths", [(1880,), (1880, 1000)])
@pytest.mark.parametrize("skip_factor", [0.0, 300.0])
def test_gpu_fewer_queries_match_the_reference_of_the_kernels_semantics(gen_lengths, skip_factor):
    _hopper()
    qkv = cosmos_like(600, gen_lengths)
    plan = KernelPlan("TRTLLM_ATTN", SCALE, quant=AttnQuantSpec("fp8_e4m3"), skip_factor=skip_factor)
    assert trtllm.sage_semantics(plan.quant, "cuda", qkv.seqlens_q, qkv.seqlens_kv).q_padded_to_kv
    first = run_backend("TRTLLM_ATTN", qkv, plan).out  # builds or loads the kernels, copies the lengths once
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")  # the call plans from host lengths: no read of a device tensor
    try:
        out = run_backend("TRTLLM_ATTN", qkv, plan).out
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert torch.equal(out, first)
    ref = run_backend("TORCH_REFERENCE", qkv, plan)
    exact = run_backend("TORCH_REFERENCE", qkv, KernelPlan("TORCH_REFERENCE", SCALE))
    if skip_factor:
        assert 0.1 < ref.skipped_tiles / ref.total_tiles < 0.9
    assert torch.isfinite(out).all() and out.shape == qkv.q.shape
    # same semantics, sm_90's fp8 accumulation included: what is left is the bf16 output rounding (the bounds of the
    # self-attention test of tests/test_fmha_v2_sage.py)
    assert _rel(out, ref.out) < 5e-3
    assert _rel(out, exact.out) < 9e-2


@pytest.mark.gpu
def test_gpu_a_mixed_query_tile_is_attended_whole():
    """The kernel's zero query rows keep the tile holding the last real rows from skipping: the kernel follows the
    padded reference, far from the unpadded one (which skips that tile)."""
    _hopper()
    q, k, v = (x.cuda().bfloat16() for x in mixed_tile_case(n_q=100, n_kv=512, heads=8))
    qkv = VarlenQKV(q, k, v, (100,), (512,))
    plan = KernelPlan("TRTLLM_ATTN", SCALE, quant=AttnQuantSpec("fp8_e4m3", 64, 64), skip_factor=0.1 * 512)
    out = run_backend("TRTLLM_ATTN", qkv, plan).out
    padded = run_backend("TORCH_REFERENCE", qkv, plan).out
    semantics = trtllm.sage_semantics(plan.quant, "cuda", (100,), (512,))
    plain, _, _ = reference_attention(q, k, v, SCALE, skip_lambda=0.1,
                                      quant=SageSemantics(**{**semantics.__dict__, "q_padded_to_kv": False}),
                                      tile=fmha_v2_sage.SKIP_TILE, kv_step=semantics.kv_step)
    assert _rel(out[64:], padded[64:]) < 5e-3
    assert _rel(out[64:], plain[64:]) > 10 * _rel(out[64:], padded[64:])


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["sage-fp8", "sage-fp8+skip"])
def test_gpu_cosmos3_generation_stream_runs_fmha_v2_sage_without_a_sync(monkeypatch, config):
    """Through the Cosmos 3 processor on a tiny transformer at head_dim 128: the generation stream (fewer queries
    than keys) reaches the FMHAv2 SAGE kernel, and a block's call makes no host-device sync (the transformer's own
    forward code around the blocks syncs by itself: tests/test_gpu_compile.py's module docstring)."""
    _hopper()
    from diffusers_trtllm import enable_trtllm_attention
    from helpers import rel_err
    from test_gpu_compile import CONFIGS, TOLERANCE, block_arguments, cosmos3, output, to_gpu

    calls = []
    kernel = fmha_v2_sage.fmha_v2_sage_attention

    def recorded(q, k, v, cu_seqlens, seqlens, scale, **kwargs):
        calls.append((kwargs.get("seqlens_q"), seqlens))
        return kernel(q, k, v, cu_seqlens, seqlens, scale, **kwargs)

    monkeypatch.setattr(fmha_v2_sage, "fmha_v2_sage_attention", recorded)
    torch.manual_seed(0)
    model, blocks, inputs = cosmos3()
    model = model.to("cuda", torch.bfloat16)
    inputs = {key: to_gpu(value) for key, value in inputs.items()}
    with torch.no_grad():
        default = output(model, inputs)
        with enable_trtllm_attention(model, {"default": {"backend": "TRTLLM_ATTN", **CONFIGS[config]}}):
            arguments, eager = block_arguments(model, blocks, inputs)
            assert rel_err(eager, default) < TOLERANCE[config]
            assert calls and all(seqlens_q is not None and all(map(int.__lt__, seqlens_q, seqlens))
                                 for seqlens_q, seqlens in calls), calls
            calls.clear()
            torch.cuda.synchronize()
            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
            try:
                for block, (args, kwargs) in zip(blocks[1:], arguments[1:]):
                    block(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(previous)
    assert len(calls) == len(blocks) - 1


if __name__ == "__main__":
    _run_interpreted(sys.argv[1])

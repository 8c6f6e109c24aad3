"""The Triton SAGE kernel against the PyTorch reference (quant.py, backends/reference.py).

CPU: the kernels run under Triton's interpreter in one subprocess (``TRITON_INTERPRET=1`` must be set before
Triton is imported, and GPU tests in this process need the compiled kernels); this module is that subprocess's
script. GPU tests (``-m gpu``) run the compiled kernels on CUDA against float32 references.
"""

import dataclasses
import os
import sys

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: @triton.jit then builds interpreted kernels


import pytest
import torch

from diffusers_trtllm.backends import run_backend
from diffusers_trtllm.backends.base import KernelPlan, VarlenQKV
from diffusers_trtllm.backends.reference import reference_attention
from diffusers_trtllm.config import TORCH_REFERENCE, AttnQuantSpec
from diffusers_trtllm.kernels import fmha_v2_sage, triton_sage
from diffusers_trtllm.kernels.triton_sage import quantize as triton_quantize
from diffusers_trtllm.kernels.numerics import HEAD_DIM
from diffusers_trtllm.quant import SageSemantics, quantize_sequence

from helpers import run_cases_under_triton_interpreter

QK_DTYPES = ("int8", "fp8_e4m3")
BLOCK_PAIRS = ((1, 1), (1, 16), (4, 16), (16, 4))
SMALL_TILE = (32, 32)  # several tiles per sequence while the interpreter stays fast


def _positional_qkv(lens_q, lens_kv, heads_q, heads_kv, sharpness, dtype=torch.bfloat16, device="cpu"):
    """Packed Q, K, V whose attention is local and peaky (smooth positional features plus noise), so some KV
    tiles fall under λ and some do not; the same idea as the ``peaky`` generator of shared/probes."""
    def features(lengths, heads):
        pos = torch.cat([torch.arange(n, dtype=torch.float32) for n in lengths])[:, None]
        freqs = torch.logspace(-3, -0.5, HEAD_DIM // 2)[None, :]
        base = torch.cat([torch.sin(pos * freqs), torch.cos(pos * freqs)], dim=1)[:, None, :]
        return base.expand(-1, heads, -1) + 0.3 * torch.randn(pos.shape[0], heads, HEAD_DIM)
    q = features(lens_q, heads_q) * sharpness
    k = features(lens_kv, heads_kv) * sharpness
    v = torch.randn(sum(lens_kv), heads_kv, HEAD_DIM)
    return VarlenQKV(*(x.to(dtype).to(device) for x in (q, k, v)), tuple(lens_q), tuple(lens_kv))


def _offset_qkv(lens, periods, tile_keys, dtype=torch.bfloat16, device="cpu"):
    """Packed Q, K, V (as many heads as ``periods``) where head ``h``'s KV tiles ``j`` of ``tile_keys`` keys with
    ``j % periods[h] == periods[h] - 1`` score 8 nats below the others (one query channel constant, the matching
    key channel carrying the offset, over N(0, 0.3²) noise): at λ = 0.01 every query tile skips exactly those
    tiles, about 1 / period of them."""
    d, heads = HEAD_DIM, len(periods)
    q = 0.3 * torch.randn(sum(lens), heads, d)
    k = 0.3 * torch.randn(sum(lens), heads, d)
    q[..., 0] = 1.0
    tile = torch.cat([torch.arange(n) // tile_keys for n in lens])[:, None]
    period = torch.tensor(periods)[None, :]
    k[..., 0] = torch.where(tile % period == period - 1, -8.0, 0.0) * d ** 0.5  # score = offset at scale D^-½
    v = torch.randn(sum(lens), heads, d)
    return VarlenQKV(*(x.to(dtype).to(device) for x in (q, k, v)), tuple(lens), tuple(lens))


def _random_qkv(lens_q, lens_kv, heads_q, heads_kv, dtype=torch.bfloat16, device="cpu", k_offset=0.5):
    """Random packed Q, K, V; K has a per-channel offset so that smoothing matters."""
    d = HEAD_DIM
    q = torch.randn(sum(lens_q), heads_q, d)
    k = torch.randn(sum(lens_kv), heads_kv, d) + k_offset * torch.randn(1, heads_kv, d)
    v = torch.randn(sum(lens_kv), heads_kv, d)
    return VarlenQKV(*(x.to(dtype).to(device) for x in (q, k, v)), tuple(lens_q), tuple(lens_kv))


def _semantics(quant: AttnQuantSpec | None, skip_sample=None) -> SageSemantics | None:
    """The Triton kernel's semantics for ``quant`` (per-sequence statistics, P·448), skipping where its sampled
    query tiles found it to pay (``skip_sample``, as ``SageSemantics``) or everywhere (None)."""
    return None if quant is None else SageSemantics(quant.dtype_qk, quant.q_block_size, quant.k_block_size,
                                                    skip_sample=skip_sample)


def _reference(qkv: VarlenQKV, plan: KernelPlan, compute=torch.float32, skip_sample=None):
    """Reference output (float32) and skip counts for a packed batch, sequence by sequence."""
    outs, skipped, total = [], 0, 0
    for (q, k, v, _), kv_len in zip(qkv.sequences(), qkv.seqlens_kv):
        lam = plan.skip_factor / kv_len if plan.skips else 0.0
        o, s, t = reference_attention(q.to(compute), k.to(compute), v.to(compute), plan.scale, skip_lambda=lam,
                                      quant=_semantics(plan.quant, skip_sample), tile=plan.tile)
        outs.append(o.float())
        skipped += s
        total += t
    return torch.cat(outs), skipped, total


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _unpack_quantized(z: triton_sage.SageQuantized, qkv: VarlenQKV):
    """Per sequence: (q values, q per-token scales, k values, k per-token scales, v values, v scales) in the
    layout of quant.SageSequence, read out of the kernel's packed layouts."""
    cu_q, cu_kv = qkv.cu_seqlens("q").tolist(), qkv.cu_seqlens("kv").tolist()
    for i, (nq, nk) in enumerate(zip(qkv.seqlens_q, qkv.seqlens_kv)):
        def per_token(scales, cu, n, block):
            first = cu[i] // block + i
            return scales[:, first:first + -(-n // block)].repeat_interleave(block, 1)[:, :n].T[..., None].float()
        v_first = triton_sage.V_TOKEN_ALIGN * (-(-cu_kv[i] // triton_sage.V_TOKEN_ALIGN) + i)
        yield (z.q[cu_q[i]:cu_q[i + 1]].float(), per_token(z.q_scale, cu_q, nq, z.q_block),
               z.k[cu_kv[i]:cu_kv[i + 1]].float(), per_token(z.k_scale, cu_kv, nk, z.k_block),
               z.v_t[:, :, v_first:v_first + nk].float().permute(2, 0, 1), z.v_scale[i].float())


# ---------------------------------------------------------------- CPU: the kernels under Triton's interpreter

def _interpreter_cases():
    """Inputs for the interpreted run: (name, qkv, quant, plan, launch)."""
    cases = []
    small_launch = triton_sage.AttentionLaunch(*SMALL_TILE, num_warps=4, num_stages=1)
    ragged = _random_qkv((40, 90), (70, 100), heads_q=4, heads_kv=2)
    for dtype in QK_DTYPES:
        for q_block, k_block in BLOCK_PAIRS:
            cases.append((f"quantize-{dtype}-{q_block}-{k_block}", ragged, AttnQuantSpec(dtype, q_block, k_block),
                          None, None))
        quant = AttnQuantSpec(dtype, 4, 16)
        cases.append((f"dense-{dtype}", ragged, quant, KernelPlan("triton", 128 ** -0.5, quant=quant, tile=SMALL_TILE),
                      small_launch))
    # sequences past one K/V-statistics program (STATS_TOKENS * STATS_CHUNKS keys), the first past two
    long = _random_qkv((1100, 600), (1100, 600), heads_q=2, heads_kv=1)
    cases.append(("quantize-long", long, AttnQuantSpec("fp8_e4m3", 4, 16), None, None))
    peaky = _positional_qkv((128, 100), (160, 96), heads_q=2, heads_kv=1, sharpness=1.5)
    for dtype in QK_DTYPES:
        quant = AttnQuantSpec(dtype, 1, 16)
        plan = KernelPlan("triton", 128 ** -0.5, quant=quant, tile=SMALL_TILE, skip_factor=15.0, count_skips=True)
        for schedule, launch in _skip_schedules(small_launch).items():
            cases.append((f"skip-{dtype}{schedule}", peaky, quant, plan, launch))
        # heads skipping 1/2 and 1/6 of their tiles: the second skips less than SMALL_SAMPLING needs
        mixed = _offset_qkv((200, 100), (2, 6), SMALL_TILE[1])
        plan = dataclasses.replace(plan, skip_factor=0.01 * 200)
        for name, launch in (("every-tile", small_launch), ("dense", small_launch),
                             ("sampled", dataclasses.replace(small_launch, **SMALL_SAMPLING)), ("default", None)):
            cases.append((f"pays-{dtype}-{name}", mixed, quant,
                          dataclasses.replace(plan, skip_factor=0.0) if name == "dense" else plan, launch))
    return cases


SMALL_SAMPLING = dict(skip_sample_every=2, skip_pays_from=0.3)  # AttentionLaunch fields of the interpreted run


def _skip_schedules(launch):
    """``launch`` on each schedule the skip tests compare: every tile branching, every run branch-free, and runs
    from one tile on, each following the previous run's decisions (both schedules in one program)."""
    return {"": dataclasses.replace(launch, branch_free_below=0.0),
            "-branch-free": dataclasses.replace(launch, branch_free_below=2.0),
            "-alternating": dataclasses.replace(launch, skip_chunk=1, branch_free_below=0.5)}


def _fix_triton_interpreter():
    """Work around two bugs of Triton 3.6's CPU interpreter (compiled kernels are not affected): a loaded scalar
    (a 1-element numpy array) cannot bound ``range`` under numpy >= 2.3; and fp32 -> bf16 / fp8 e4m3 casts
    truncate or round half-up without carrying into the exponent (fp8: 125 -> 64, not 128)."""
    import triton.language as tl
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    convert_float = interpreter._convert_float
    torch_types = {tl.float8e4nv: (torch.float8_e4m3fn, torch.uint8), tl.bfloat16: (torch.bfloat16, torch.uint16)}

    def convert(values, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype in torch_types:
            dtype, bits = torch_types[output_dtype]
            return torch.from_numpy(values).to(dtype).view(bits).numpy()
        return convert_float(values, input_dtype, output_dtype, rounding_mode)

    interpreter._patch_lang_tensor = patch_lang_tensor
    interpreter._convert_float = convert


def _quantize(qkv: VarlenQKV, quant: AttnQuantSpec) -> triton_sage.SageQuantized:
    return triton_sage.sage_quantize(qkv.q, qkv.k, qkv.v, qkv.cu_seqlens("q"), qkv.cu_seqlens("kv"),
                                     qkv.max_seqlen_q, qkv.max_seqlen_kv, dtype_qk=quant.dtype_qk,
                                     q_block=quant.q_block_size, k_block=quant.k_block_size)


def _attention(qkv: VarlenQKV, plan: KernelPlan):
    """``(out, skipped, total)`` of the Triton kernel through its public function."""
    quant = plan.quant
    return triton_sage.triton_sage_attention(
        qkv.q, qkv.k, qkv.v, qkv.cu_seqlens("q"), qkv.cu_seqlens("kv"), qkv.seqlens_q, qkv.seqlens_kv, plan.scale,
        dtype_qk=quant.dtype_qk, q_block=quant.q_block_size, k_block=quant.k_block_size,
        skip_factor=plan.skip_factor, skip_tile=plan.tile, count_skips=plan.count_skips)


def _run_interpreted(cases_path, results_path):
    _fix_triton_interpreter()
    results = {}
    for name, qkv, quant, plan, launch in torch.load(cases_path, weights_only=False):
        quantized = _quantize(qkv, quant)
        if plan is None:
            results[name] = quantized
        else:
            results[name] = triton_sage.sage_attention_quantized(
                quantized, qkv.cu_seqlens("q"), qkv.cu_seqlens("kv"), qkv.seqlens_q, qkv.seqlens_kv, plan.scale,
                skip_factor=plan.skip_factor, skip_tile=plan.tile, count_skips=plan.count_skips, launch=launch)
    torch.save(results, results_path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    pytest.importorskip("triton")
    cases = _interpreter_cases()
    results = run_cases_under_triton_interpreter(__file__, cases, tmp_path_factory.mktemp("triton_sage"))
    return {name: (qkv, quant, plan) for name, qkv, quant, plan, _ in cases}, results


@pytest.mark.parametrize("dtype", QK_DTYPES)
@pytest.mark.parametrize("q_block,k_block", BLOCK_PAIRS)
def test_quantizer_matches_reference_bit_for_bit(interpreted, dtype, q_block, k_block):
    cases, results = interpreted
    qkv, quant, _ = cases[f"quantize-{dtype}-{q_block}-{k_block}"]
    z = results[f"quantize-{dtype}-{q_block}-{k_block}"]
    assert z.q.dtype == (torch.int8 if dtype == "int8" else torch.float8_e4m3fn)
    for got, (q, k, v, _) in zip(_unpack_quantized(z, qkv), qkv.sequences()):
        ref = quantize_sequence(q.float(), k.float(), v.float(), SageSemantics(dtype, q_block, k_block))
        for name, a, b in zip("q q_scale k k_scale v v_scale".split(), got,
                              (ref.q, ref.q_scale, ref.k, ref.k_scale, ref.v, ref.v_scale)):
            assert torch.equal(a, b), name


def test_k_is_smoothed_by_the_mean_over_every_statistics_program(interpreted):
    """K's mean over a sequence longer than one statistics program adds every program's sums (each program writes
    its own row, added in a fixed order so that a call repeats bit for bit: test_gpu_quantizer_is_deterministic).
    Q and V match the reference bit for bit; K within one grid step, rarely, where the two sums' orders move the
    mean by an ulp (a program's sums left out would move K by many steps)."""
    cases, results = interpreted
    qkv, quant, _ = cases["quantize-long"]
    assert max(qkv.seqlens_kv) > 2 * triton_quantize.STATS_TOKENS * triton_quantize.STATS_CHUNKS
    for got, (q, k, v, _) in zip(_unpack_quantized(results["quantize-long"], qkv), qkv.sequences()):
        ref = quantize_sequence(q.float(), k.float(), v.float(), SageSemantics("fp8_e4m3", 4, 16))
        for name, a, b in zip("q q_scale v v_scale".split(), got[:2] + got[4:], (ref.q, ref.q_scale, ref.v, ref.v_scale)):
            assert torch.equal(a, b), name
        assert ((got[3] - ref.k_scale).abs() <= 1e-6 * ref.k_scale).all()
        diff = (got[2] - ref.k).abs()
        assert (diff > 0).float().mean() < 1e-3 and (diff <= ref.k.abs().clamp_min(2 ** -6) * 2 ** -3).all()


@pytest.mark.parametrize("dtype", QK_DTYPES)
def test_dense_attention_matches_quantized_reference(interpreted, dtype):
    cases, results = interpreted
    qkv, _, plan = cases[f"dense-{dtype}"]
    ref, _, _ = _reference(qkv, plan)
    out = results[f"dense-{dtype}"][0]
    assert out.dtype == torch.bfloat16 and out.shape == qkv.q.shape
    assert _rel(out, ref) < 5e-3  # the bf16 rounding of the output (about 2e-3), nothing more


@pytest.mark.parametrize("dtype", QK_DTYPES)
def test_skip_counts_and_output_match_reference(interpreted, dtype):
    cases, results = interpreted
    case = f"skip-{dtype}"
    qkv, _, plan = cases[case]
    ref, ref_skipped, ref_total = _reference(qkv, plan)
    out, skipped, total = results[case]
    assert 0 < ref_skipped < ref_total  # the case exercises skipping and not-skipping
    assert int(skipped) == ref_skipped and int(total) == ref_total
    assert _rel(out, ref) < 5e-3


@pytest.mark.parametrize("dtype", QK_DTYPES)
@pytest.mark.parametrize("schedule", ["-branch-free", "-alternating"])
def test_skip_schedules_give_bit_identical_results(interpreted, dtype, schedule):
    """A skipped tile folded in with P = 0 (branch-free) leaves the state exactly as branching around it does."""
    _, results = interpreted
    out, skipped, _ = results[f"skip-{dtype}"]
    other_out, other_skipped, _ = results[f"skip-{dtype}{schedule}"]
    assert int(skipped) > 0 and int(other_skipped) == int(skipped)
    assert torch.equal(other_out, out)


@pytest.mark.parametrize("dtype", QK_DTYPES)
def test_skipping_only_where_it_pays_runs_the_other_heads_dense_like_the_reference(interpreted, dtype):
    """With sampling, a (sequence, head) whose sampled query tiles skipped too little attends its other query tiles
    exactly as the dense launch does; counts and output follow the reference of that rule."""
    cases, results = interpreted
    qkv, _, plan = cases[f"pays-{dtype}-sampled"]
    out, skipped, total = results[f"pays-{dtype}-sampled"]
    every_tile, every_tile_skipped, _ = results[f"pays-{dtype}-every-tile"]
    dense = results[f"pays-{dtype}-dense"][0]
    sample = (SMALL_SAMPLING["skip_sample_every"], SMALL_SAMPLING["skip_pays_from"])
    ref, ref_skipped, ref_total = _reference(qkv, plan, skip_sample=sample)
    _, ref_every_tile_skipped, _ = _reference(qkv, plan)
    assert int(every_tile_skipped) == ref_every_tile_skipped
    assert 0 < ref_skipped < ref_every_tile_skipped  # the rule keeps some heads from skipping, not all
    assert int(skipped) == ref_skipped and int(total) == ref_total
    assert _rel(out, ref) < 5e-3
    _assert_dense_where_routed(out, every_tile, dense)


@pytest.mark.parametrize("dtype", QK_DTYPES)
def test_default_skipping_launch_samples_as_the_reference_backend(interpreted, dtype):
    """Without a launch, the kernel samples by ``skip_sample_rule`` of its batch (off a GPU as on an H200: every
    other query tile here); the reference backend resolves the same rule through ``sage_semantics``, and tile
    counts and output agree."""
    cases, results = interpreted
    qkv, _, plan = cases[f"pays-{dtype}-default"]
    out, skipped, total = results[f"pays-{dtype}-default"]
    assert triton_sage.skip_sample_rule(qkv.seqlens_q, 2, SMALL_TILE[0], "cpu") == (
        2, triton_sage.SKIP_PAYS_FROM)
    ref = run_backend(TORCH_REFERENCE, qkv, plan)
    assert int(skipped) == int(ref.skipped_tiles) and int(total) == int(ref.total_tiles)
    assert 0 < int(skipped) < int(results[f"pays-{dtype}-every-tile"][1])
    assert _rel(out, ref.out) < 5e-3
    _assert_dense_where_routed(out, results[f"pays-{dtype}-every-tile"][0], results[f"pays-{dtype}-dense"][0])


def _assert_dense_where_routed(out, every_tile, dense):
    """The rows where skipping only where it pays differs from every tile skipping are the dense launch's, bit
    for bit, and there are some."""
    routed = (out != every_tile).any(dim=-1)  # [tokens, heads]
    assert routed.any()
    assert torch.equal(out[routed], dense[routed])


def test_unavailable_reasons():
    qkv = _random_qkv((64,), (64,), 2, 2)
    q, k, v = qkv.q, qkv.k, qkv.v
    reason = triton_sage.triton_sage_unavailable_reason
    assert "non-causal" in reason(q, k, v, causal=True)
    assert "head_dim 128" in reason(q[..., :64], k[..., :64], v[..., :64])
    assert "bf16 or fp16" in reason(q.float(), k.float(), v.float())
    assert "sides 16, 32, 64 or 128" in reason(q, k, v, skip_tile=(64, 256))


# ---------------------------------------------------------------- GPU: compiled kernels against float32 references

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", QK_DTYPES)
@pytest.mark.parametrize("q_block,k_block", BLOCK_PAIRS)
def test_gpu_quantizer_matches_reference(dtype, q_block, k_block):
    qkv = _random_qkv((1000, 3001), (777, 4100), 8, 2, device="cuda")
    z = _quantize(qkv, AttnQuantSpec(dtype, q_block, k_block))
    for got, (q, k, v, _) in zip(_unpack_quantized(z, qkv), qkv.sequences()):
        ref = quantize_sequence(q.float(), k.float(), v.float(), SageSemantics(dtype, q_block, k_block))
        # On CUDA, PyTorch divides by a Python scalar (amax / 127) as a multiplication by its reciprocal, so the
        # reference's scales can sit one float32 ulp from the kernel's exact division (bit-exact against the CPU
        # reference: the interpreter tests); K's mean is also summed in another order (per program). A value then
        # lands at most one grid step away, rarely (0.12% of fp8 Q values with one scale per token on the H200).
        for name, values, scales, ref_values, ref_scales in (("q", got[0], got[1], ref.q, ref.q_scale),
                                                             ("k", got[2], got[3], ref.k, ref.k_scale),
                                                             ("v", got[4], got[5], ref.v, ref.v_scale)):
            assert ((scales - ref_scales).abs() <= 1e-6 * ref_scales).all(), name
            step = 1.0 if dtype == "int8" and name != "v" else ref_values.abs().clamp_min(2 ** -6) * 2 ** -3
            diff = (values - ref_values).abs()
            assert (diff > 0).float().mean() < 1e-2 and (diff <= step).all(), name


@pytest.mark.gpu
@pytest.mark.parametrize("k_block", [0, 16])
def test_gpu_quantizer_is_deterministic(k_block):
    """Sequences of many statistics programs quantize to the same bits at every call: K's sums are added in a fixed
    order (float atomics added them in the order the programs finished, so K, and the FMHAv2 SAGE kernel's output,
    changed in their last bits from call to call: benchmarks/RESULTS.md, 2026-12-06)."""
    qkv = _random_qkv((5000, 3001), (5000, 3001), 8, 2, device="cuda")

    def tensors():  # the Triton kernel's layouts (K blocks of 16), or FMHAv2's (one K scale per sequence: 0)
        if k_block:
            out = _quantize(qkv, AttnQuantSpec("fp8_e4m3", 4, k_block))
        else:
            out = fmha_v2_sage.sage_quantize_packed(qkv.q, qkv.k, qkv.v, qkv.cu_seqlens("kv"), qkv.max_seqlen_kv, 0)
        return [x for x in out if isinstance(x, torch.Tensor)]

    first = tensors()
    for _ in range(20):
        assert all(torch.equal(a, b) for a, b in zip(tensors(), first, strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", QK_DTYPES)
def test_gpu_dense_attention(dtype):
    qkv = _random_qkv((1000, 3001), (777, 4100), 8, 2, device="cuda")
    quant = AttnQuantSpec(dtype, 1, 16)
    plan = KernelPlan("triton", 128 ** -0.5, quant=quant)
    out, _, _ = _attention(qkv, plan)
    ref_quant, _, _ = _reference(qkv, plan)
    ref_exact, _, _ = _reference(qkv, KernelPlan("exact", plan.scale))
    assert torch.isfinite(out).all()
    # Same semantics: int8 differs by the bf16 output rounding (2.5e-3 measured); fp8 Q·Kᵀ also by sm_90's
    # reduced-precision fp8 tensor-core accumulation (8.7e-3 measured on an H200).
    assert _rel(out, ref_quant) < (5e-3 if dtype == "int8" else 1.5e-2)
    assert _rel(out, ref_exact) < 6e-2  # what SAGE itself costs on random N(0, 1) data (fp8 V alone ~2.4e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [(128, 128), (64, 128)])
def test_gpu_skip_counts_match_reference(tile):
    qkv = _positional_qkv((4096, 1500), (4096, 1500), 4, 2, sharpness=2.0, device="cuda")
    quant = AttnQuantSpec("int8", 1, 16)
    plan = KernelPlan("triton", 128 ** -0.5, quant=quant, skip_factor=400.0, tile=tile, count_skips=True)
    out, skipped, total = _attention(qkv, plan)
    sample = triton_sage.skip_sample_rule(qkv.seqlens_q, 4, tile[0], "cuda")
    ref, ref_skipped, ref_total = _reference(qkv, plan, skip_sample=sample)
    assert int(total) == ref_total
    assert 0.05 * ref_total < ref_skipped < 0.95 * ref_total
    # Scores agree to float32 rounding; a decision exactly at the threshold may go either way.
    assert abs(int(skipped) - ref_skipped) <= max(2, ref_total // 1000)
    assert _rel(out, ref) < 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", QK_DTYPES)
def test_gpu_skip_schedules_give_bit_identical_results(dtype):
    """On the GPU the branch-free schedule of 64 × 128 tiles takes its decision with a barrier reduction (not the
    interpreter's path): every schedule still skips the same tiles and gives the same bits."""
    qkv = _positional_qkv((4096, 1500), (4096, 1500), 4, 2, sharpness=2.0, device="cuda")
    quantized = _quantize(qkv, AttnQuantSpec(dtype, 1, 16))
    runs = [triton_sage.sage_attention_quantized(
        quantized, qkv.cu_seqlens("q"), qkv.cu_seqlens("kv"), qkv.seqlens_q, qkv.seqlens_kv, 128 ** -0.5,
        skip_factor=400.0, skip_tile=(64, 128), count_skips=True, launch=launch)
        for launch in _skip_schedules(triton_sage.skip_launch((64, 128), (4, 0.25))).values()]
    (out, skipped, total), others = runs[0], runs[1:]
    assert 0.05 * total < int(skipped) < 0.95 * total
    for other_out, other_skipped, _ in others:
        assert int(other_skipped) == int(skipped)
        assert torch.equal(other_out, out)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", QK_DTYPES)
def test_gpu_skipping_only_where_it_pays(dtype):
    """The default skipping launch (``skip_sample_rule``): heads whose sampled query tiles skip under
    ``SKIP_PAYS_FROM`` of the KV tiles attend dense, bit for bit as the dense launch; the others skip as every
    tile would; counts as the reference."""
    qkv = _offset_qkv((4096, 1500), (2, 8, 3, 20), 128, device="cuda")  # 50 %, 12.5 %, 33 %, 5 % skippable
    quantized = _quantize(qkv, AttnQuantSpec(dtype, 1, 16))
    factor = 0.01 * 4096

    def attend(launch, skip_factor=factor):
        return triton_sage.sage_attention_quantized(
            quantized, qkv.cu_seqlens("q"), qkv.cu_seqlens("kv"), qkv.seqlens_q, qkv.seqlens_kv, 128 ** -0.5,
            skip_factor=skip_factor, skip_tile=(64, 128), count_skips=True, launch=launch)

    out, skipped, total = attend(None)
    sample = triton_sage.skip_sample_rule(qkv.seqlens_q, 4, 64, "cuda")
    every_tile, every_tile_skipped, _ = attend(dataclasses.replace(triton_sage.skip_launch((64, 128), sample),
                                                                   skip_sample_every=0))
    dense = attend(triton_sage.DENSE_LAUNCH, 0.0)[0]
    plan = KernelPlan("triton", 128 ** -0.5, quant=AttnQuantSpec(dtype, 1, 16), skip_factor=factor, tile=(64, 128))
    ref, ref_skipped, ref_total = _reference(qkv, plan, skip_sample=sample)
    assert int(total) == ref_total and int(skipped) == ref_skipped
    assert 0 < int(skipped) < int(every_tile_skipped)
    _assert_dense_where_routed(out, every_tile, dense)
    sampled = torch.cat([torch.arange(n, device="cuda") // 64 % sample[0] == 0
                         for n in qkv.seqlens_q])
    heads_skipping = ((out != dense).any(dim=-1) & ~sampled[:, None]).any(dim=0)
    assert heads_skipping.tolist() == [True, False, True, False]
    assert _rel(out, ref) < (5e-3 if dtype == "int8" else 1.5e-2)


@pytest.mark.gpu
def test_gpu_heads_that_do_not_pay_run_the_dense_launchs_binary():
    """A sampling launch compiles its sample pass and its skipping pass; its dense programs reuse the dense
    launch's kernel (compiled apart, the same loop ran measurably faster or slower)."""
    qkv = _offset_qkv((4096,), (2, 20), 128, device="cuda")  # one head pays, one does not
    quantized = _quantize(qkv, AttnQuantSpec("int8", 1, 16))
    compiled = triton_sage.attention._sage_attention_kernel.device_caches[torch.cuda.current_device()][0]
    # a setting no other test launches with, so that every binary here is compiled here
    dense_launch = dataclasses.replace(triton_sage.DENSE_LAUNCH, fp8_qk_chunk=64)
    sampling = dataclasses.replace(triton_sage.skip_launch((64, 128), (4, 0.25)), fp8_qk_chunk=64)
    counts = [len(compiled)]
    for launch, factor in ((dense_launch, 0.0), (sampling, 0.01 * 4096)):
        triton_sage.sage_attention_quantized(quantized, qkv.cu_seqlens("q"), qkv.cu_seqlens("kv"), qkv.seqlens_q,
                                             qkv.seqlens_kv, 128 ** -0.5, skip_factor=factor, skip_tile=(64, 128),
                                             launch=launch)
        counts.append(len(compiled))
    assert [after - before for before, after in zip(counts, counts[1:])] == [1, 2]


@pytest.mark.gpu
def test_gpu_hopper_int8_skip_through_the_backend_decides_per_its_own_tile_like_the_reference():
    """TRTLLM_ATTN's int8 SAGE with Skip-Softmax on Hopper runs this kernel with 64 × 128 decisions (its fastest
    tile) whatever the plan's tile; the reference backend, following the same semantics, skips the same tiles."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    from diffusers_trtllm.backends import run_backend

    qkv = _positional_qkv((4096, 1500), (4096, 1500), 4, 2, sharpness=2.0, device="cuda")
    plan = KernelPlan("TRTLLM_ATTN", 128 ** -0.5, quant=AttnQuantSpec("int8"), skip_factor=400.0, count_skips=True)
    kernel, ref = run_backend("TRTLLM_ATTN", qkv, plan), run_backend("TORCH_REFERENCE", qkv, plan)
    # 64 × 128 tiles: heads · (64 · 32 + 24 · 12); the plan's 128 × 128 would give 4 · (32 · 32 + 12 · 12)
    assert int(kernel.total_tiles) == ref.total_tiles == 4 * (64 * 32 + 24 * 12)
    assert 0.05 * ref.total_tiles < ref.skipped_tiles < 0.95 * ref.total_tiles
    assert abs(int(kernel.skipped_tiles) - ref.skipped_tiles) <= max(2, ref.total_tiles // 1000)
    assert _rel(kernel.out, ref.out) < 5e-3


if __name__ == "__main__":
    _run_interpreted(sys.argv[1], sys.argv[2])

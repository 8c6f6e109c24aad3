"""TRT-LLM FMHAv2's SAGE kernel on Hopper (kernels/fmha_v2_sage.py) and its routing in TRTLLM_ATTN.

CPU: kernel generation against the installed FlashInfer's own generator, the host binding's argument list, the
quantizer under Triton's interpreter against the PyTorch reference (in a subprocess: ``TRITON_INTERPRET=1`` must be
set before Triton is imported), and every refusal. GPU (``-m gpu``, sm_90): the compiled kernels through
``TRTLLM_ATTN`` against ``TORCH_REFERENCE`` of the same semantics and against exact float32 attention.
"""

import dataclasses
import hashlib
import os
import re
import sys
from operator import itemgetter
from types import SimpleNamespace

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from diffusers_trtllm.backends import run_backend, trtllm
from diffusers_trtllm.backends.base import KernelPlan, VarlenQKV
from diffusers_trtllm.backends.reference import fp8_gmma_matmul, reference_attention
from diffusers_trtllm.config import AttnQuantSpec
from diffusers_trtllm.errors import AttentionConfigError
from diffusers_trtllm.kernels import fmha_v2_sage
from diffusers_trtllm.quant import SageSemantics, quantize_sequence, scale_of
from helpers import run_script_under_triton_interpreter

fmha_library = pytest.importorskip("flashinfer.jit.attention.fmha_v2.fmha_library")

SCALE = 128 ** -0.5


# ---------------------------------------------------------------- CPU: generation and binding


def test_specs_are_flashinfers_validated_sage_spec_with_our_blocks_and_steps():
    for kernel in fmha_v2_sage.sage_kernels():
        spec = fmha_v2_sage.kernel_spec(kernel)
        assert spec.sage_block_sizes == (64, kernel.k_block, 0) and spec.kv_loop_step == kernel.kv_step
        assert spec.kv_tile_buffers == (3 if kernel.kv_step == 256 else 2)
        assert spec.enable_skip_softmax == kernel.skip_softmax and spec.output_dtype == "bf16"
        # FlashInfer validates SAGE on sm_90 for blocks (64, 64, 256) at its own KV step; every other field is that.
        import dataclasses
        validated = dataclasses.replace(spec, sage_block_sizes=(64, 64, 256), kv_loop_step=256)
        assert fmha_library.is_kernel_spec_valid(validated)
        assert spec.sm == 90 and spec.warp_specialization and spec.dtype == "e4m3" and spec.head_size == 128


def test_generated_sources_hold_one_padding_mask_sage_kernel_each():
    sources = fmha_v2_sage.kernel_sources()
    kernels = fmha_v2_sage.sage_kernels()
    cu_files = [name for name in sources if name.endswith(".cu")]
    assert len(cu_files) == len(kernels) == len(set(cu_files))
    for name in cu_files:
        code = sources[name]
        assert code.count("__global__") == 1 and "qkv_128_causal" not in code and "qkv_128_custom_mask" not in code and "qkv_128_sliding" not in code
        traits = code[code.index("using Ktraits ="):code.index(">;")]
        k_block = int(re.search(r"sage_64_(\d+)_0", name).group(1))
        traits = traits.replace(" ", "").replace("\n", "")
        assert traits.endswith(f"fmha::bf16_t,64,{k_block},0")
        # <STEP_Q, STEP_KV, D, DV, Q buffers, K/V buffers, ...>
        step_kv, q_buffers, kv_buffers = (int(x) for x in itemgetter(1, 4, 5)(traits.split("<")[1].split(",")))
        assert (q_buffers, kv_buffers) == (1, fmha_v2_sage.KV_BUFFERS[step_kv])
    header = sources["sage_kernels.h"]
    for kernel in kernels:
        assert (f"k_block == {kernel.k_block} && kv_step == {kernel.kv_step} && skip == "
                f"{str(kernel.skip_softmax).lower()} && lse == {str(kernel.lse).lower()}") in header


def test_sources_carry_every_header_patch_and_the_build_reads_them_first():
    sources = fmha_v2_sage.kernel_sources()
    patches = fmha_v2_sage.header_patch_files()
    assert sum(len(fmha_v2_sage.read_patch(patch)) for patch in patches) == 68
    # each hunk's text is in the headers once its patch is applied (a later patch may rewrite it: the tile-map
    # patch rewrites lines of the skip patches), and the build reads the headers with every patch applied
    for applied in range(1, len(patches) + 1):
        headers = fmha_v2_sage.patched_headers(patches[:applied])
        for path, old, new in fmha_v2_sage.read_patch(patches[applied - 1]):
            assert headers[path].count(new) == 1 and (old in new or old not in headers[path])
    assert all(sources[path] == text for path, text in headers.items())
    assert "DMA_GROUP_TRANSPOSE_V = 0" in sources["fmha/warpspec/kernel_traits.h"]
    # half-step skips: both halves voted, the exps and the BMM2 K group of a skipped half left out
    epilogue, compute = sources["fmha/warpspec/epilogue.h"], sources["fmha/warpspec/compute.h"]
    assert "uint32_t(skip) | (uint32_t(skip_second) << 1)" in epilogue
    assert epilogue.count("DIFFUSERS_TRTLLM_EXP_CORES(") == 3  # the macro and the two half-step calls
    assert "*skip_softmax_vote = 3u;" in compute and compute.count("softmax.skipped_half_ != ") == 2
    # V's per-channel scales applied with 1 / row sum in the e4m3 epilogue
    assert epilogue.count("__ldg(v_scales + channel") == 2 and "tile_o_epilogue.scale_channels(" in compute
    assert "static_cast<int64_t>(sage_scale_row) * params.sage.v.max_nblock" in compute
    # one mutex turn for P·V and the next Q·Kᵀ in the dense 256-key-step kernels only; every wait in a kernel
    # with that turn is matched by one arrive: per step, one before BMM2 and one after BMM1, plus one per KV loop
    turn = "MUTEX_TURN_SPANS_BMM2"
    assert (f"{turn} = ENABLE_MUTEX && Kernel_traits::STEP_KV == 256 &&\n"
            "         !Kernel_traits::ENABLE_SKIP_SOFTMAX") in compute
    # (the tile-map kernels' empty turn adds one of each, or where the turn spans, ends the one held and takes the
    # next, a first step's taking one first: tests/test_fmha_v2_reuse.py)
    assert compute.count(f"if constexpr ({turn})") == 3 and f"if (IS_FIRST_COL || !{turn})" in compute
    assert compute.count("mutex.wait();") == 5 and compute.count("mutex.arrive();") == 3
    assert compute.count("mutex_accessor.arrive();") == 2  # WG1's bootstrap and the end of the last turn
    # skip counts: every KV step of a warpgroup adds its tiles; one add per warpgroup at its end, none without
    # the caller's pointer, and the build defines the flag that gives the params struct that pointer
    # (the tiles the test skipped: a tile-map kernel's reused ones take an empty turn, counting nothing)
    assert ("  count_skipped_tiles(&shared->skipped_tiles[warpgroup_id], tidx, valid_run,                    \\\n"
            "                      softmax.skipped_step_ | softmax.skipped_half_, "
            "actual_kv_seqlen - kv_step_idx * STEP_KV);") in compute
    assert "if (tidx == 0 && params.skip_softmax_skipped_blocks != nullptr) {" in compute
    assert "softmax.total_blocks" not in compute and epilogue.count("this->skipped_step_ = ") == 2
    flags = fmha_v2_sage.nvcc_flags(fmha_v2_sage.pathlib.Path("/generated"))
    assert "-DSKIP_SOFTMAX_STAT" in flags
    includes = [flag for flag in flags if flag.startswith("-I")]
    assert includes[0] == "-I/generated" and any(flag.endswith("fmha_v2") for flag in includes[1:])


def test_fp8_kernels_leave_the_output_unscaled_only_where_no_row_of_the_warp_has_a_new_max():
    # FMHAv2's Softmax classes each scale the output accumulators by every row's correction before P·V; the fp8
    # one (every SAGE kernel's) skips that where the warp's every row kept its max (each correction exactly 1):
    # the vote covers all of the thread's rows, guards both products of every accumulator, and the fp16/bf16
    # classes keep FlashInfer's unconditional products
    epilogue = fmha_v2_sage.patched_headers()["fmha/warpspec/epilogue.h"]
    corrections = epilogue.split("// Correct accumulators to current max.")
    assert len(corrections) == 5
    vote = ("      // diffusers_trtllm (lazy_rescale.patch): where no row of the warp has a new max, each correction "
            "is 1\n      // and the products equal the accumulators: the warp leaves them (the same bits, 64 "
            "multiplies fewer)\n      bool rescale = false;\n#pragma unroll\n      for (int mi = 0; mi < "
            "Mma_tile_o::CORES_M; mi++) {\n        rescale |= this->correction_[mi] != 1.f;\n      }\n"
            "      if (__any_sync(0xffffffffu, rescale)) {\n")
    assert epilogue.count(vote) == 1
    fp8 = epilogue.index("struct Softmax<Hopper_qgmma_e4m3_fp32_traits, Kernel_traits>")
    guarded = next(i for i, text in enumerate(corrections) if text.endswith(vote))
    assert epilogue.index(vote) > fp8  # the fp8 class's pack, not another class's
    products = corrections[guarded + 1].split("} else {", 1)[0]
    assert products.count('asm volatile("mul.f32 %0, %0, %1;\\n"') == 2
    assert products.endswith("        }\n      }\n      }\n    ")  # the vote's block closes after every product
    assert all("__any_sync" not in text[-200:] for i, text in enumerate(corrections[:-1]) if i != guarded)


# sha256 over (path, NUL, text, NUL) of every patched header, sorted by path, per FlashInfer release of the
# [flashinfer] range (their headers differ; every one patches). A deliberate change of a patch changes them
# (tile_map_reuse.patch last did, with the DMA warp's step words: checked against every release here, every SAGE
# kernel compiled for sm_90a with 0.6.18.post1's and 0.7.4's headers); an accidental one, or a release whose
# headers were never checked, fails here.
PATCHED_HEADERS_SHA256 = {
    **dict.fromkeys(("0.6.18.post1", "0.7.0", "0.7.0.post1", "0.7.1"),
                    "c809d668487d039fc0a785f165379ec755fdb19f44ab50930c2026477b4ec271"),
    **dict.fromkeys(("0.7.2", "0.7.2.post1"), "fb12c44fa34836ed1357ef47e5b355187efa2978201bee5d638612e5fb6ef744"),
    "0.7.4": "421d1062488702c851a32bad5cbc7d6b6f0e2a0a7e3415b15e3c813a1637c91a",
}


def test_patch_files_produce_the_recorded_headers():
    import flashinfer

    assert flashinfer.__version__ in PATCHED_HEADERS_SHA256, (
        f"FlashInfer {flashinfer.__version__}'s headers were never checked against the patches: apply them "
        "(fmha_v2_sage.patched_headers), compile the SAGE kernels (benchmarks/sage_kernel_static.py) and record "
        "its digest here")
    headers = fmha_v2_sage.patched_headers()
    digest = hashlib.sha256()
    for path in sorted(headers):
        digest.update(path.encode() + b"\0" + headers[path].encode() + b"\0")
    assert sorted(headers) == ["fmha/warpspec/compute.h", "fmha/warpspec/dma.h", "fmha/warpspec/epilogue.h",
                               "fmha/warpspec/kernel_traits.h", "fused_multihead_attention.h"]
    assert digest.hexdigest() == PATCHED_HEADERS_SHA256[flashinfer.__version__]


def test_header_patches_refuse_a_changed_header(tmp_path):
    patch = tmp_path / "changed.patch"
    patch.write_text("a hunk whose text FlashInfer no longer has\n\n--- a/fmha/warpspec/dma.h\n"
                     "+++ b/fmha/warpspec/dma.h\n@@ -1,2 +1,2 @@\n text FlashInfer\n-no longer has\n+x\n")
    assert fmha_v2_sage.read_patch(patch) == (
        fmha_v2_sage.HeaderPatch("fmha/warpspec/dma.h", "text FlashInfer\nno longer has\n", "text FlashInfer\nx\n"),)
    with pytest.raises(RuntimeError, match="dma.h changed: a text changed.patch patches was found 0 times"):
        fmha_v2_sage.patched_headers((patch,))


@pytest.mark.parametrize("hunk", ["@@ -1,3 +1,2 @@\n context\n-old\n+new\n", "@@ -one +1 @@\n-old\n+new\n",
                                  "@@ -1 +1 @@\n-old\n*new\n"])
def test_malformed_patches_are_refused(tmp_path, hunk):
    patch = tmp_path / "bad.patch"
    patch.write_text(f"--- a/fmha/x.h\n+++ b/fmha/x.h\n{hunk}")
    with pytest.raises(ValueError, match="bad.patch, line"):
        fmha_v2_sage.read_patch(patch)


def test_every_build_source_ships_with_the_package():
    """setup.cfg's package_data names every file under kernels/csrc (a wheel carries nothing else there)."""
    import configparser
    import pathlib

    root = pathlib.Path(fmha_v2_sage.__file__).parents[1]
    config = configparser.ConfigParser()
    config.read(root.parent / "setup.cfg")
    patterns = [p.strip() for p in config["options.package_data"]["diffusers_trtllm"].split(",")]
    shipped = {path for pattern in patterns for path in root.glob(pattern)}
    on_disk = {path for path in (root / "kernels" / "csrc").rglob("*") if path.is_file()}
    assert fmha_v2_sage.BINDING_SOURCE in shipped and set(fmha_v2_sage.header_patch_files()) <= shipped
    assert on_disk == shipped


def test_padding_mask_only_refuses_a_changed_template():
    with pytest.raises(RuntimeError, match="template changed"):
        fmha_v2_sage.padding_mask_only("a\n // causal_mask\nkernel\n")


def test_binding_arguments_match_the_python_call(monkeypatch):
    source = fmha_v2_sage.BINDING_SOURCE.read_text()
    signature = re.search(r"void sage_attention\((.*?)\) \{", source, re.S).group(1)
    kinds = [("tensor" if "TensorView" in arg else "int" if "int64_t" in arg else "float")
             for arg in signature.split(",")]
    seen = []

    class Module:
        def sage_attention(self, *args):
            seen.extend(args)

    monkeypatch.setattr(fmha_v2_sage, "load_module", lambda: Module())
    batch, tokens, heads_q, heads_kv = 2, 300, 4, 2
    packed = fmha_v2_sage.PackedSage(torch.zeros(tokens, heads_q + heads_kv, 128, dtype=torch.float8_e4m3fn),
                                     torch.zeros(heads_kv, 128, 336, dtype=torch.float8_e4m3fn),
                                     torch.tensor([0, 112, 336], dtype=torch.int32),
                                     torch.ones(batch, heads_q, 3), torch.ones(batch, heads_q, 3),
                                     torch.full((batch, heads_kv, 128), 2.0), 64)
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    out = fmha_v2_sage.sage_attention_packed(packed, cu, (100, 200), heads_q, SCALE, 5.0, 256)
    got = ["tensor" if isinstance(a, torch.Tensor) else "int" if isinstance(a, int) else "float" for a in seen]
    assert got == kinds
    assert seen[13:] == [heads_q, heads_kv, 200, 64, 64, 256, SCALE, 5.0]
    assert seen[9].dtype == torch.int32 and seen[9].shape == (0,)  # no counts asked: the kernel gets none
    assert seen[10].dtype == torch.float32 and seen[10].shape == (0,)  # no statistics asked: the plain kernel
    assert all(m.dtype == torch.int32 and m.shape == (0,) for m in seen[11:13])  # no map: the kernel without one
    # V's per-channel scales go to the kernel's epilogue per query head (GQA: each KV head's repeated)
    v_scale = seen[6]
    assert v_scale.shape == (batch, heads_q, 128) and v_scale.is_contiguous()
    assert torch.equal(v_scale, packed.v_scale.repeat_interleave(heads_q // heads_kv, dim=1))
    assert out.shape == (tokens, heads_q, 128) and out.dtype == torch.bfloat16


def test_unbuilt_kernel_is_refused():
    q = torch.zeros(64, 1, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="no compiled FMHAv2 SAGE kernel"):
        fmha_v2_sage.fmha_v2_sage_attention(q, q, q, torch.tensor([0, 64], dtype=torch.int32), (64,), SCALE,
                                            k_block=16)


# ---------------------------------------------------------------- CPU: refusals and semantics


@pytest.mark.parametrize("value", [16.0, 2, 32, True, "64"])
def test_block_sizes_without_any_kernel_are_invalid(value):
    with pytest.raises(AttentionConfigError, match="q_block_size"):
        AttnQuantSpec(dtype_qk="fp8_e4m3", q_block_size=value)


def test_default_spec_and_dict_still_work():
    assert AttnQuantSpec(dtype_qk="int8").q_block_size is None
    spec = AttnQuantSpec.from_dict({"dtype_qk": "fp8_e4m3", "q_block_size": 64, "k_block_size": 128})
    assert (spec.q_block_size, spec.k_block_size) == (64, 128)


@pytest.mark.parametrize("quant,more_queries,words", [
    (AttnQuantSpec("int8", 64, 64), False, ["no int8 kernel on sm_90", "[1, 4, 16]"]),
    (AttnQuantSpec("fp8_e4m3", 64, 16), False, ["mix two sm_90 kernels", "q 64 with k [64, 128]"]),
    (AttnQuantSpec("fp8_e4m3", 64, 64), True, ["at most as many queries as keys", "more queries than keys"]),
])
def test_hopper_refusals_name_what_the_gpu_offers(quant, more_queries, words):
    reason = trtllm._sage_block_reason(quant, "sm_90", more_queries)
    assert all(word in reason for word in words), reason


@pytest.mark.parametrize("arch", ["sm_100", "sm_103"])
def test_blackwell_refuses_fmha_v2_blocks(arch):
    reason = trtllm._sage_block_reason(AttnQuantSpec("fp8_e4m3", 64, 64), arch, False)
    assert "q block [1]" in reason and arch in reason


def test_semantics_by_gpu(monkeypatch):
    monkeypatch.setattr(trtllm, "gpu_arch", lambda device: "sm_90")
    fp8 = AttnQuantSpec("fp8_e4m3")
    fmha_v2 = SageSemantics("fp8_e4m3", 64, trtllm.FMHA_V2_DEFAULT_K_BLOCK, p_scale=256.0, kv_step=256,
                            fp8_accumulator_bits=14, skip_tile=(64, 128), q_padded_to_kv=True)
    assert trtllm.sage_semantics(fp8, "cuda", (10, 20), (10, 20)) == fmha_v2
    assert trtllm.sage_semantics(fp8, "cuda", (10, 20), (20, 20)) == fmha_v2  # fewer queries: zero-padded
    # Skip-Softmax reuse: a reusing step two gathered tiles per KV step; a fresh map's step the Skip-Softmax kernel's
    assert trtllm.sage_semantics(fp8, "cuda", (10, 20), (10, 20), reuse=True) == dataclasses.replace(
        fmha_v2, paired_tiles=True)
    assert trtllm.sage_semantics(fp8, "cuda", (10, 20), (10, 20), reuse=True, fresh_map=True) == fmha_v2
    # more queries than keys, the Triton kernel: skip decisions per its dense launch's tile, in the heads where its
    # sample finds they pay;
    # the sample: every other query tile of a short sequence, and at Wan's shape (75,600 tokens, 40 heads, 1,182
    # tiles of 64 rows) 13 tiles per head, 520 programs, two waves of an H200's 132 SMs × 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    assert trtllm.sage_semantics(fp8, "cuda", (20,), (10,)) == SageSemantics(
        "fp8_e4m3", 1, 16, skip_tile=(64, 128), skip_sample=(2, 0.30))
    assert trtllm.sage_semantics(AttnQuantSpec("int8"), "cuda", (75600,), (75600,), heads=40) == SageSemantics(
        "int8", 1, 16, skip_tile=(64, 128), skip_sample=(91, 0.30))
    # a GPU of half the SMs: half the sample (6 tiles per head, 240 programs, 1.8 waves of its 132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=66))
    assert trtllm.sage_semantics(AttnQuantSpec("int8"), "cuda", (75600,), (75600,), heads=40).skip_sample == (197, 0.30)
    monkeypatch.setattr(trtllm, "gpu_arch", lambda device: "sm_100")
    blackwell = trtllm.sage_semantics(fp8, "cuda")
    assert blackwell.batch_stats and blackwell.skip_tile is None and blackwell.skip_sample is None
    monkeypatch.setattr(trtllm, "gpu_arch", lambda device: None)
    # on a CPU, the rule as on an H200, per the plan's tile
    assert trtllm.sage_semantics(AttnQuantSpec("fp8_e4m3", 4, 4), "cpu", (75600,), (75600,), heads=40,
                                 tile=(128, 128)) == SageSemantics("fp8_e4m3", 4, 4, skip_sample=(46, 0.30))


# ---------------------------------------------------------------- CPU: the quantizer under Triton's interpreter


LENGTHS, HEADS_Q, HEADS_KV = (100, 200), 4, 2


def _inputs(device="cpu"):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(sum(LENGTHS), HEADS_Q, 128, generator=gen)
    k = torch.randn(sum(LENGTHS), HEADS_KV, 128, generator=gen) + 2 * torch.randn(1, HEADS_KV, 128, generator=gen)
    v = torch.randn(sum(LENGTHS), HEADS_KV, 128, generator=gen)
    return [x.bfloat16().to(device) for x in (q, k, v)]


def _run_interpreted(results_path):
    sys.path.insert(0, os.path.dirname(__file__))
    from test_triton_sage import _fix_triton_interpreter

    _fix_triton_interpreter()
    q, k, v = _inputs()
    cu = torch.tensor([0, LENGTHS[0], sum(LENGTHS)], dtype=torch.int32)
    torch.save({kb: fmha_v2_sage.sage_quantize_packed(q, k, v, cu, max(LENGTHS), kb) for kb in fmha_v2_sage.K_BLOCKS},
               results_path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    pytest.importorskip("triton")
    return run_script_under_triton_interpreter(__file__, tmp_path_factory.mktemp("fmha_v2_sage") / "packed.pt")


def _v_columns(start, n):
    """V^T columns of keys 0..n-1 of a sequence starting at column ``start``: within each 16-key group, key
    ``2a + b`` (b < 2) sits at column ``4a + b`` and key ``8 + 2a + b`` at ``4a + 2 + b``, as FMHAv2's fp8
    softmax packs P (accumulator columns 2a, 2a+1, 2a+8, 2a+9 into one 4-byte MMA operand register)."""
    order = [4 * a + b + 2 * high for key in range(16) for high, a, b in [(key // 8, (key % 8) // 2, key % 2)]]
    return torch.tensor([start + j - j % 16 + order[j % 16] for j in range(n)])


# V^T row of each channel: FMHAv2's transposer stores even channels of each 16 in rows 0-7, odd ones in rows 8-15.
V_ROWS = torch.tensor([16 * (d // 16) + (d % 16) // 2 + 8 * (d % 2) for d in range(128)])


def test_v_orders_permute_each_group_of_16():
    columns = _v_columns(0, 32)
    assert sorted(columns.tolist()) == list(range(32)) and sorted(V_ROWS.tolist()) == list(range(128))
    assert columns[:16].tolist() == [0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15]
    assert V_ROWS[:16].tolist() == [0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15]


def test_v_t_outside_the_sequences_holds_zeros(interpreted):
    packed = interpreted[64]
    covered = torch.zeros(packed.v_t.shape[2], dtype=torch.bool)
    for i, n in enumerate(LENGTHS):
        covered[_v_columns(packed.v_starts[i].item(), n)] = True
    assert packed.v_starts.tolist() == [0, 16 * (-(-LENGTHS[0] // 16) + 1), 16 * (-(-sum(LENGTHS) // 16) + 2)]
    assert not packed.v_t[:, :, ~covered].float().any() and packed.v_t[:, :, covered].float().any()


@pytest.mark.parametrize("k_block", fmha_v2_sage.K_BLOCKS)
def test_packed_quantizer_matches_reference_bit_for_bit(interpreted, k_block):
    packed = interpreted[k_block]
    q, k, v = _inputs()
    semantics = SageSemantics("fp8_e4m3", 64, k_block, p_scale=256.0)
    start = 0
    for i, n in enumerate(LENGTHS):
        rows = slice(start, start + n)
        start += n
        ref = quantize_sequence(q[rows].float(), k[rows].float(), v[rows].float(), semantics)
        assert torch.equal(packed.qk[rows, :HEADS_Q].float(), ref.q)
        assert torch.equal(packed.qk[rows, HEADS_Q:].float(), ref.k)
        columns = _v_columns(packed.v_starts[i].item(), n)
        assert torch.equal(packed.v_t[:, V_ROWS][:, :, columns].permute(2, 0, 1).float(), ref.v)
        assert torch.equal(packed.v_scale[i], ref.v_scale)
        q_scale = packed.q_scale[i].repeat_interleave(64, 1)[:, :n].T[..., None]
        if k_block:
            k_scale = packed.k_scale[i, ::HEADS_Q // HEADS_KV].repeat_interleave(k_block, 1)[:, :n].T[..., None]
            assert torch.equal(q_scale, ref.q_scale) and torch.equal(k_scale, ref.k_scale)
        else:  # K's one scale per sequence and head is folded into Q's scales
            folded = ref.q_scale * ref.k_scale[0, :, 0].repeat_interleave(HEADS_Q // HEADS_KV)[None, :, None]
            assert torch.allclose(q_scale, folded, rtol=1e-6, atol=0)


# ---------------------------------------------------------------- GPU: through TRTLLM_ATTN


def _hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")


def _peaky(lengths, heads_q, heads_kv):
    gen = torch.Generator(device="cuda").manual_seed(1)
    pos = torch.cat([torch.arange(n, device="cuda", dtype=torch.float32) for n in lengths])[:, None]
    freqs = torch.logspace(-3, -0.5, 64, device="cuda")[None, :]
    feature = torch.cat([torch.sin(pos * freqs), torch.cos(pos * freqs)], 1)[:, None]
    q = (feature + 0.3 * torch.randn(pos.shape[0], heads_q, 128, device="cuda", generator=gen)) * 2
    k = (feature + 0.3 * torch.randn(pos.shape[0], heads_kv, 128, device="cuda", generator=gen)) * 2
    v = torch.randn(pos.shape[0], heads_kv, 128, device="cuda", generator=gen)
    return VarlenQKV(q.bfloat16(), k.bfloat16(), v.bfloat16(), tuple(lengths), tuple(lengths))


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("k_block", [None, 64, 128])
@pytest.mark.parametrize("skip_factor", [0.0, 300.0])
def test_gpu_fmha_v2_sage_matches_reference_of_its_semantics(k_block, skip_factor):
    _hopper()
    qkv = _peaky((1000, 3001), 8, 2)
    quant = AttnQuantSpec("fp8_e4m3", None if k_block is None else 64, k_block)
    # the plan's tile is the default 128 × 128: the reference follows the kernel's own (SageSemantics.skip_tile)
    plan = KernelPlan("TRTLLM_ATTN", SCALE, quant=quant, skip_factor=skip_factor)
    out = run_backend("TRTLLM_ATTN", qkv, plan).out
    ref = run_backend("TORCH_REFERENCE", qkv, plan)
    exact = run_backend("TORCH_REFERENCE", qkv, KernelPlan("TORCH_REFERENCE", SCALE))
    if skip_factor:
        assert 0.2 < ref.skipped_tiles / ref.total_tiles < 0.8
    assert torch.isfinite(out).all() and out.shape == qkv.q.shape
    # Same semantics, sm_90's fp8 accumulation included: what is left is the bf16 output rounding; a skip decision
    # the kernel took differently from the reference would add far more.
    assert _rel(out, ref.out) < 5e-3  # 2.5e-3 to 3.9e-3 measured on an H200
    assert _rel(out, exact.out) < 9e-2  # what SAGE costs here (6.7e-2 measured)


@pytest.mark.gpu
def test_gpu_fp8_accumulation_emulation_matches_cublas_fast_accumulation():
    """The reference's model of sm_90's fp8 tensor-core sums against cuBLAS's fp8 GEMM without promotion to
    float32 (``use_fast_accum``): it accounts for nearly all of the difference from exact sums."""
    _hopper()
    gen = torch.Generator(device="cuda").manual_seed(5)
    a, b = ((torch.randn(256, 4096, device="cuda", generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
            for _ in range(2))
    one = torch.ones((), device="cuda")
    fast = torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=True)
    exact = a.double() @ b.double().t()
    emulated = fp8_gmma_matmul(a.float(), b.float().t(), trtllm.SM90_FP8_ACCUMULATOR_BITS)
    assert _rel(emulated, fast) < 0.1 * _rel(exact, fast)


@pytest.mark.gpu
def test_gpu_reference_scales_are_correctly_rounded_quotients():
    """On CUDA, PyTorch divides by a Python number as a multiplication by its rounded reciprocal; the kernels'
    quantizers divide exactly, and so must the reference's block scales."""
    _hopper()
    amax = torch.rand(1 << 20, device="cuda") * 8
    assert torch.equal(scale_of(amax, 448.0), (amax.double() / 448.0).float())


@pytest.mark.gpu
def test_gpu_quantizer_matches_reference_bit_for_bit():
    """The compiled quantizer against the reference's on bf16 data, whose quotients by a block scale often land
    exactly between two fp8 values: Q and V bit for bit; K up to its mean's summation order (float atomics)."""
    _hopper()
    qkv = _peaky((1000, 3001), 8, 2)
    cu = qkv.cu_seqlens("q")
    packed = fmha_v2_sage.sage_quantize_packed(qkv.q, qkv.k, qkv.v, cu, 3001, 64)
    semantics = SageSemantics("fp8_e4m3", 64, 64, p_scale=256.0)
    start = 0
    for i, n in enumerate(qkv.seqlens_q):
        rows = slice(start, start + n)
        start += n
        ref = quantize_sequence(qkv.q[rows].float(), qkv.k[rows].float(), qkv.v[rows].float(), semantics)
        assert torch.equal(packed.qk[rows, :8].float(), ref.q)
        assert (packed.qk[rows, 8:].float() != ref.k).float().mean() < 1e-4
        columns = _v_columns(packed.v_starts[i].item(), n)
        assert torch.equal(packed.v_t[:, V_ROWS.cuda()][:, :, columns].permute(2, 0, 1).float(), ref.v)


@pytest.mark.gpu
def test_gpu_v_channel_scales_reach_their_channels():
    """V's per-channel scales are applied inside the kernel, to accumulator columns that hold permuted channels:
    with channel magnitudes spread over four decades, a scale applied to the wrong channel is off by up to 10^4."""
    _hopper()
    qkv = _peaky((640, 1344), 8, 2)
    spread = torch.logspace(-2, 2, 128, device="cuda")[torch.randperm(128, device="cuda")]
    qkv = VarlenQKV(qkv.q, qkv.k, (qkv.v.float() * spread).bfloat16(), qkv.seqlens_q, qkv.seqlens_kv)
    plan = KernelPlan("TRTLLM_ATTN", SCALE, quant=AttnQuantSpec("fp8_e4m3"), tile=fmha_v2_sage.SKIP_TILE)
    out = run_backend("TRTLLM_ATTN", qkv, plan).out
    ref = run_backend("TORCH_REFERENCE", qkv, plan).out
    per_channel = ((out.float() - ref.float()).norm(dim=(0, 1)) / ref.float().norm(dim=(0, 1)))
    assert per_channel.max() < 3e-2, per_channel.topk(4)


def _offset_tiles(length, heads, tile=128):
    """Scores ≈ one offset per (head, ``tile`` keys): a quarter of the tiles at 0, the rest at -3 nats, over small
    noise; at λ = 0.1 every -3 tile is negligible yet carries e^-3 of a 0 tile's weight, so a skip the kernel
    took or missed against the reference moves the output by far more than the fp8 rounding."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    q = 0.3 * torch.randn(length, heads, 128, device="cuda", generator=gen)
    k = 0.3 * torch.randn(length, heads, 128, device="cuda", generator=gen)
    v = torch.randn(length, heads, 128, device="cuda", generator=gen)
    tiles = -(-length // tile)
    offsets = torch.where(torch.rand(heads, tiles, device="cuda", generator=gen) < 0.25, 0.0, -3.0)
    q[..., 0] = 1.0
    k[..., 0] = offsets.repeat_interleave(tile, dim=1)[:, :length].T * 128 ** 0.5
    return VarlenQKV(q.bfloat16(), k.bfloat16(), v.bfloat16(), (length,), (length,))


@pytest.mark.gpu
def test_gpu_skips_halves_of_a_kv_step_where_only_one_half_is_negligible():
    _hopper()
    qkv = _offset_tiles(4096, 4)
    length = qkv.seqlens_q[0]
    plan = KernelPlan("TRTLLM_ATTN", SCALE, quant=AttnQuantSpec("fp8_e4m3"), skip_factor=0.1 * length,
                      tile=fmha_v2_sage.SKIP_TILE)
    out = run_backend("TRTLLM_ATTN", qkv, plan).out
    ref = run_backend("TORCH_REFERENCE", qkv, plan)
    semantics = trtllm.sage_semantics(plan.quant, qkv.q.device, qkv.seqlens_q, qkv.seqlens_kv)
    whole_steps, skipped_steps, steps = reference_attention(qkv.q.float(), qkv.k.float(), qkv.v.float(), SCALE,
                                                            skip_lambda=0.1, quant=semantics, tile=(64, 256))
    dense = run_backend("TRTLLM_ATTN", qkv, KernelPlan("TRTLLM_ATTN", SCALE, quant=plan.quant)).out
    # half-step decisions skip far more than whole steps would on this data (0.59 vs 0.42 in the reference on
    # a CPU's draw of it), and the kernel follows them, not whole-step decisions or none
    assert ref.skipped_tiles / ref.total_tiles > skipped_steps / steps + 0.1
    assert _rel(out, ref.out) < 1.6e-2
    assert _rel(out, whole_steps) > 2 * _rel(out, ref.out) and _rel(out, dense) > 2 * _rel(out, ref.out)


@pytest.mark.gpu
def test_gpu_more_queries_than_keys_run_on_the_triton_kernel():
    _hopper()
    q = torch.randn(512, 4, 128, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(300, 4, 128, device="cuda", dtype=torch.bfloat16)
    qkv = VarlenQKV(q, kv, kv.clone(), (512,), (300,))
    plan = KernelPlan("TRTLLM_ATTN", SCALE, quant=AttnQuantSpec("fp8_e4m3"))
    assert trtllm.sage_semantics(plan.quant, q.device, (512,), (300,)).q_block == 1
    out = run_backend("TRTLLM_ATTN", qkv, plan).out
    ref = run_backend("TORCH_REFERENCE", qkv, plan).out
    assert _rel(out, ref) < 1.6e-2


if __name__ == "__main__":
    _run_interpreted(sys.argv[1])

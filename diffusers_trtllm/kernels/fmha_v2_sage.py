"""SAGE attention on Hopper (sm_90) with TRT-LLM FMHAv2's warp-specialized FP8 kernels.

FlashInfer ships FMHAv2's sources with SageAttention support (kernel traits ``SAGE_BLOCK_SIZE_Q/K/V``, kernel
parameters ``sage.{q,k,v}``) and the generator that instantiates them, but its Python API never fills the SAGE
parameters. This module generates the SAGE variants with FlashInfer's own generator
(``flashinfer.jit.attention.fmha_v2.fmha_library``), compiles them with this package's host binding
(``csrc/fmha_v2_sage.cu``) through FlashInfer's JIT (once per machine, cached), and quantizes Q, K and V for
them with one fused Triton pass.

Semantics (what :func:`fmha_v2_sage_attention` computes; the reference's ``fmha_v2`` semantics model them):

- K smoothed by its per-sequence mean; Q per block of 64 tokens and K per block of ``k_block`` tokens (64 or
  128; 0 = one scale per sequence and head, multiplied into Q's scales so the kernel does no per-key scaling)
  quantized to fp8 e4m3 (scale = block amax / 448), blocks from each sequence's start;
- V per (sequence, head, channel) to fp8 e4m3. The kernel's own V block scales are loaded but never applied
  (``compute.h``'s ``APPLY_SCALE_V`` only records them, in FlashInfer 0.7.2 as in TRT-LLM), so the kernels have
  no V blocks and their epilogue multiplies the output by V's per-channel scales (:data:`V_SCALE_EPILOGUE_PATCHES`);
- P quantized to fp8 as ``P · 256`` (FMHAv2's ``Softmax_fp_quant_scale<e4m3>``); row sums from unquantized P;
- Skip-Softmax in the same kernel: each warpgroup (64 query rows) skips 128 keys (:data:`SKIP_TILE`) when every
  row's ``exp(tile_max - running_max) < skip_factor / kv_len``, with ``running_max`` the one at the start of the
  KV step (``kv_step`` keys: 256, the generator's choice for e4m3, whose halves are decided apart by
  :data:`HALF_STEP_SKIP_PATCHES`, or 128); the first KV step is never skipped.

The kernel reads Q and K from one packed ``[tokens, Hq + Hkv, 128]`` e4m3 tensor (``PACKED_QKV``), so every
sequence has as many queries as keys (self-attention), and V already transposed (:data:`V_LAYOUT_PATCHES`).
GPUs: sm_90 only (wgmma, TMA, setmaxnreg).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import pathlib
import time
from typing import NamedTuple

import torch

from . import triton_sage
from .numerics import HEAD_DIM

logger = logging.getLogger("diffusers_trtllm")

Q_BLOCK = 64  # the kernel's query step per warpgroup: Q scale blocks must be a multiple of it
K_BLOCKS = (0, 64, 128)  # compiled K scale blocks (0: one scale per sequence and head, folded into Q's)
KV_STEPS = (256, 128)  # keys per KV step: FlashInfer's choice for e4m3, and a finer one for Skip-Softmax
# K/V tiles the DMA warp keeps in flight, per KV step. V arrives transposed (:data:`V_LAYOUT_PATCHES`), so shared
# memory needs no transpose scratch and holds three 256-key buffers (3 · 64 KiB + Q's 16 KiB) where FlashInfer's
# e4m3 choice is two: about 1 % faster at Wan's shape on an H200 (benchmarks/RESULTS.md; two Q buffers on top were
# slower). 128-key steps keep FlashInfer's two.
KV_BUFFERS = {256: 3, 128: 2}
P_SCALE = 256.0  # P enters P·V as fp8(P * 256)
BINDING_SOURCE = pathlib.Path(__file__).with_name("csrc") / "fmha_v2_sage.cu"


@dataclasses.dataclass(frozen=True)
class SageKernel:
    """One generated kernel: its K scale block, keys per KV step and whether it has the Skip-Softmax code path."""

    k_block: int
    kv_step: int
    skip_softmax: bool


def sage_kernels() -> tuple[SageKernel, ...]:
    """Every kernel the module builds: each compiled K block and KV step, with and without Skip-Softmax (K block
    128 at KV step 256 only: it exists for the block-size sweep)."""
    return tuple(SageKernel(k_block, kv_step, skip) for kv_step in KV_STEPS for k_block in K_BLOCKS
                 for skip in (False, True) if not (k_block == 128 and kv_step != 256))


SKIP_TILE = (Q_BLOCK, 128)  # (query rows, keys) per skip decision: one warpgroup's rows, half a 256-key step


def kernel_spec(kernel: SageKernel):
    """FlashInfer's ``FMHAv2KernelSpec`` for ``kernel``: sm_90, e4m3 in, bf16 out, head_dim 128, PACKED_QKV,
    warp-specialized, no ALiBi or softcapping, SAGE blocks ``(64, k_block, 0)`` (V block 0: no V scales),
    ``kv_loop_step`` = ``kv_step``, :data:`KV_BUFFERS` K/V buffers."""
    from flashinfer.jit.attention.fmha_v2.fmha_library import generate_kernel_spec
    from flashinfer.jit.attention.fmha_v2.utils import InputLayout

    spec = generate_kernel_spec(sm=90, head_size=HEAD_DIM, dtype="e4m3", enable_skip_softmax=kernel.skip_softmax,
                                return_softmax=False, enable_attn_logit_softcapping=False, alibi=False,
                                input_layout=InputLayout.PACKED_QKV, output_dtype="bf16")
    return dataclasses.replace(spec, sage_block_sizes=(Q_BLOCK, kernel.k_block, 0), kv_loop_step=kernel.kv_step,
                               kv_tile_buffers=KV_BUFFERS[kernel.kv_step])


# FlashInfer 0.7.2's template emits a kernel per mask type (its "0"/"1" mask flags are strings, truthy either
# way), and the non-padding ones drop the SAGE block sizes. Each section sits between two marker comments;
# everything but the padding-mask kernel is cut, which also divides the build time by four.
UNUSED_MASK_SECTIONS = (("// causal_mask", ("// causal mask", "// causal_mask")),
                        ("// sliding_or_chunked_causal_mask", ("// sliding_or_chunked_causal_mask",)),
                        ("// custom_mask", ("// custom mask", "// custom_mask")))


def padding_mask_only(code: str) -> str:
    """``code`` with the sections of :data:`UNUSED_MASK_SECTIONS` emptied (their marker lines kept)."""
    lines, kept, open_section = code.splitlines(), [], None
    for line in lines:
        text = line.strip()
        if open_section is None:
            kept.append(line)
            open_section = next((ends for start, ends in UNUSED_MASK_SECTIONS if text == start), None)
        elif text in open_section:
            kept.append(line)
            open_section = None
    if open_section is not None:
        raise RuntimeError("FlashInfer's FMHAv2 template changed: a mask section's closing marker is missing")
    return "\n".join(kept) + "\n"


# Hopper's fp8 MMA reads its B operand K-major, so FMHAv2 transposes every fp8 V tile in shared memory with its
# whole DMA warpgroup, in series with that tile's TMA load, and the compute warpgroups wait for it even on tiles
# Skip-Softmax skips: with every tile skipped the kernel still ran at 83 % of its dense time. These kernels read
# V^T from global memory instead, as the quantizer writes it (`V^T layout` below): the DMA warp only issues TMA
# loads. Each entry: header (relative to FlashInfer's fmha_v2 folder), text found exactly once, replacement.
V_LAYOUT_PATCHES = (
    ("fmha/warpspec/kernel_traits.h",
     "  enum {\n    DMA_GROUP_TRANSPOSE_V = (std::is_same<Element_data_type, fmha::e4m3_t>::value ||\n"
     "                             std::is_same<Element_data_type, fmha::e5m2_t>::value)\n  };\n",
     "  enum { DMA_GROUP_TRANSPOSE_V = 0 };  // diffusers_trtllm: V arrives transposed\n"),
    ("fmha/warpspec/dma.h",
     "    // The sum_s for kv.\n    int sum_s_kv_;\n",
     "    // The sum_s for kv.\n    int sum_s_kv_;\n"
     "    // diffusers_trtllm: the sequence's first column in V^T (params.cu_kv_seqlens carries them).\n"
     "    int sum_s_v_;\n"),
    ("fmha/warpspec/dma.h",
     "        sum_s_kv_ = sum_s_q_;\n",
     "        sum_s_kv_ = sum_s_q_;\n        sum_s_v_ = params.cu_kv_seqlens[bidb];\n"),
    ("fmha/warpspec/dma.h",
     "      for (int di = 0; di < Kernel_traits::DV_GROUPS; ++di) {\n"
     "        const int32_t v_coords[3] = {di * Kernel_traits::D_PER_GROUP, bidh_kv,\n"
     "                                     sum_s_kv_ + kv_tile_start_offset};\n\n"
     "        fmha::utmaldg<3, fmha::cudaTmaDescType::TILED, false>(\n"
     "            desc_v,\n"
     "            __cvta_generic_to_shared(\n"
     "                &v_smem[v_barrier_id * TILE_SIZE_V + di * TILE_SIZE_V_PER_D_GROUP]),\n",
     "      for (int kg = 0; kg < Kernel_traits::BMM2_K_GROUPS; ++kg) {\n"
     "        // diffusers_trtllm: one load per 128-key group of V^T, all DV channels, where the transposer\n"
     "        // would have written it.\n"
     "        const int32_t v_coords[3] = {\n"
     "            sum_s_v_ + kv_tile_start_offset + kg * Kernel_traits::BMM2_K_PER_GROUP, 0, bidh_kv};\n\n"
     "        fmha::utmaldg<3, fmha::cudaTmaDescType::TILED, false>(\n"
     "            desc_v,\n"
     "            __cvta_generic_to_shared(&v_smem[v_barrier_id * TILE_SIZE_V +\n"
     "                                             kg * Kernel_traits::BMM2_K_PER_GROUP * Kernel_traits::DV]),\n"),
    ("fmha/warpspec/dma.h",
     "        // V\n        kv_tma_descriptor.set_tma_desctriptor(\n"
     "            v_ptr, desc_format, fmha::cudaTmaDescInterleave::INTERLEAVE_DISABLED, swizzle_mode,\n"
     "            fmha::cudaTmaDescPromotion::PROMOTION_DISABLED, tensor_size_v, tensor_stride_v,\n"
     "            traversal_stride, box_size_kv, oob_fill, fp32_to_tf32, &params.tma_desc_v);\n",
     "        // diffusers_trtllm: V^T [h_kv, dv, columns] at params.v_ptr, v_stride_in_bytes = columns.\n"
     "        (void)v_ptr;\n"
     "        uint32_t tensor_size_v_t[3] = {uint32_t(params.v_stride_in_bytes), dv, h_kv};\n"
     "        uint64_t tensor_stride_v_t[2] = {uint64_t(params.v_stride_in_bytes),\n"
     "                                         uint64_t(params.v_stride_in_bytes) * dv};\n"
     "        uint32_t box_size_v_t[3] = {Kernel_traits::BMM2_K_PER_GROUP, dv, 1};\n"
     "        kv_tma_descriptor.set_tma_desctriptor(\n"
     "            params.v_ptr, desc_format, fmha::cudaTmaDescInterleave::INTERLEAVE_DISABLED, swizzle_mode,\n"
     "            fmha::cudaTmaDescPromotion::PROMOTION_DISABLED, tensor_size_v_t, tensor_stride_v_t,\n"
     "            traversal_stride, box_size_v_t, oob_fill, fp32_to_tf32, &params.tma_desc_v);\n"),
)


# Skip-Softmax at half a KV step. FlashInfer's kernel decides skips per 64 rows × one KV step (256 keys at e4m3),
# coarser than the 128 × 128 tiles sparsity is calibrated on: where the negligible keys come in runs of 128, only
# the steps whose two halves are both negligible are skipped. With these patches each warpgroup decides per
# 128-key half (both halves against the running max at the step's start) and skips a half's exps and its BMM2 K
# group (one group of 128 keys per half at e4m3); a step with both halves negligible is skipped as before. The
# kept path runs FlashInfer's code; the branch around the GMMAs is on a warp-uniform value (shuffled from lane 0),
# which ptxas needs to keep them pipelined. 128-key-step kernels keep whole-step decisions.
_HALF_STEPS = "Kernel_traits::STEP_KV == 256"  # one BMM2 K group per 128-key half (fp8: 128 bytes per group)
HALF_STEP_SKIP_PATCHES = (
    ("fmha/warpspec/epilogue.h",
     "  float skip_softmax_threshold;\n",
     "  float skip_softmax_threshold;\n"
     "  // diffusers_trtllm: the 128-key half of this KV step the warpgroup skips (0: none, 1: first, 2: second).\n"
     "  int skipped_half_;\n"),
    ("fmha/warpspec/epilogue.h",
     "      float pmax[4] = {elt_[mi][0], elt_[mi][1], elt_[mi][2], elt_[mi][3]};\n"
     "#pragma unroll\n"
     "      for (int ni = 4; ni < Mma_tile_p::CORES_N * 2; ni++) {\n"
     "        pmax[ni & 3] = fmaxf(pmax[ni & 3], elt_[mi][ni]);\n"
     "      }\n"
     "      local_max_[mi] = fmaxf(fmaxf(pmax[0], pmax[1]), fmaxf(pmax[2], pmax[3]));\n"
     "      local_max_[mi] = fmaxf(__shfl_xor_sync(uint32_t(-1), local_max_[mi], 1), local_max_[mi]);\n"
     "      local_max_[mi] = fmaxf(__shfl_xor_sync(uint32_t(-1), local_max_[mi], 2), local_max_[mi]);\n"
     "      if constexpr (may_skip) {\n"
     "        if constexpr (!EXP2F_OPTIMIZATION) {\n"
     "          skip &= expf(local_max_[mi] - global_max[mi]) < this->skip_softmax_threshold;\n"
     "        } else {\n"
     "          skip &= exp2f((local_max_[mi] - global_max[mi]) * scale) < this->skip_softmax_threshold;\n"
     "        }\n"
     "      }\n",
     "      // diffusers_trtllm: the same four chains, two per 128-key half (elements [0, CORES_N) are the first\n"
     "      // half's columns); decisions on each thread's partial maxima, which the warp vote ANDs anyway.\n"
     "      constexpr int HALF = Mma_tile_p::CORES_N;\n"
     "      float pmax[4] = {elt_[mi][0], elt_[mi][1], elt_[mi][HALF], elt_[mi][HALF + 1]};\n"
     "#pragma unroll\n"
     "      for (int ni = 2; ni < HALF; ni++) {\n"
     "        pmax[ni & 1] = fmaxf(pmax[ni & 1], elt_[mi][ni]);\n"
     "        pmax[2 + (ni & 1)] = fmaxf(pmax[2 + (ni & 1)], elt_[mi][HALF + ni]);\n"
     "      }\n"
     "      float const max_first = fmaxf(pmax[0], pmax[1]);\n"
     "      float const max_second = fmaxf(pmax[2], pmax[3]);\n"
     "      if constexpr (may_skip) {\n"
     "        static_assert(EXP2F_OPTIMIZATION, \"diffusers_trtllm's half-step skips patch the exp2f path\");\n"
     "        skip &= exp2f((max_first - global_max[mi]) * scale) < this->skip_softmax_threshold;\n"
     "        skip_second &= exp2f((max_second - global_max[mi]) * scale) < this->skip_softmax_threshold;\n"
     "      }\n"
     "      local_max_[mi] = fmaxf(max_first, max_second);\n"
     "      local_max_[mi] = fmaxf(__shfl_xor_sync(uint32_t(-1), local_max_[mi], 1), local_max_[mi]);\n"
     "      local_max_[mi] = fmaxf(__shfl_xor_sync(uint32_t(-1), local_max_[mi], 2), local_max_[mi]);\n"),
    ("fmha/warpspec/epilogue.h",
     "    float(&elt_)[Mma_tile_p::CORES_M][Mma_tile_p::CORES_N * 2] = this->elt_;\n\n"
     "    // whether this warpgroup skips the softmax\n"
     "    constexpr bool may_skip = Kernel_traits::ENABLE_SKIP_SOFTMAX && !IS_FIRST_COL;\n"
     "    bool skip = may_skip;\n",
     "    float(&elt_)[Mma_tile_p::CORES_M][Mma_tile_p::CORES_N * 2] = this->elt_;\n\n"
     "    // whether this warpgroup skips the softmax\n"
     "    constexpr bool may_skip = Kernel_traits::ENABLE_SKIP_SOFTMAX && !IS_FIRST_COL;\n"
     "    bool skip = may_skip;  // diffusers_trtllm: the first half of the step, then the whole step\n"
     "    bool skip_second = may_skip;\n"
     "    this->skipped_half_ = 0;\n"),
    ("fmha/warpspec/epilogue.h",
     "        skip = __all_sync(0xffffffff, skip);\n"
     "        if (threadIdx.x % 32 == 0) {\n"
     "          // The leader of each warp votes.\n"
     "          atomicAnd(skip_softmax_vote, uint32_t(skip));\n"
     "        }\n"
     "        // WG0 uses 0x3 barrier, WG1 uses 0x4 barrier\n"
     "        named_barrier_wait(Base::SKIP_SOFTMAX_BARRIER + threadIdx.x / 128, 128);\n"
     "        skip = *((uint32_t volatile*)skip_softmax_vote);\n"
     "        if (skip) {\n",
     "        skip = __all_sync(0xffffffff, skip);\n"
     "        skip_second = __all_sync(0xffffffff, skip_second);\n"
     f"        if constexpr (!({_HALF_STEPS})) {{\n"
     "          skip = skip_second = skip && skip_second;\n"
     "        }\n"
     "        if (threadIdx.x % 32 == 0) {\n"
     "          // diffusers_trtllm: each warp's leader votes for both halves (bit 0: first, bit 1: second).\n"
     "          atomicAnd(skip_softmax_vote, uint32_t(skip) | (uint32_t(skip_second) << 1));\n"
     "        }\n"
     "        // WG0 uses 0x3 barrier, WG1 uses 0x4 barrier\n"
     "        named_barrier_wait(Base::SKIP_SOFTMAX_BARRIER + threadIdx.x / 128, 128);\n"
     "        int const vote = __shfl_sync(0xffffffff, int(*((uint32_t volatile*)skip_softmax_vote)), 0);\n"
     f"        this->skipped_half_ = ({_HALF_STEPS}) && vote != 3 ? vote : 0;\n"
     "        if (vote == 3) {\n"),
    ("fmha/warpspec/epilogue.h",
     "#pragma unroll\n"
     "      for (int ni = 0; ni < Mma_tile_p::CORES_N; ni++) {\n"
     "        // Exp all rows for this ni\n",
     "      // diffusers_trtllm: the exps of the cores [NI_BEGIN, NI_END) (FlashInfer's loop, parameterized).\n"
     "#define DIFFUSERS_TRTLLM_EXP_CORES(NI_BEGIN, NI_END)                                \\\n"
     "  _Pragma(\"unroll\") for (int ni = NI_BEGIN; ni < NI_END; ni++) {                     \\\n"
     "    _Pragma(\"unroll\") for (int mi = 0; mi < Mma_tile_p::CORES_M; mi++) {             \\\n"
     "      elt_[mi][2 * ni + 0] = custom_exp2f(elt_[mi][2 * ni + 0], scale, masked_max[mi]); \\\n"
     "      elt_[mi][2 * ni + 1] = custom_exp2f(elt_[mi][2 * ni + 1], scale, masked_max[mi]); \\\n"
     "    }                                                                                \\\n"
     "    _Pragma(\"unroll\") for (int mi = 0; mi < Mma_tile_p::CORES_M; mi++) {             \\\n"
     "      psum[mi][(2 * ni + 0) & 3] += elt_[mi][2 * ni + 0];                            \\\n"
     "      psum[mi][(2 * ni + 1) & 3] += elt_[mi][2 * ni + 1];                            \\\n"
     "    }                                                                                \\\n"
     "  }\n"
     "      if (this->skipped_half_ == 1) {\n"
     "        DIFFUSERS_TRTLLM_EXP_CORES(Mma_tile_p::CORES_N / 2, Mma_tile_p::CORES_N)\n"
     "      } else if (this->skipped_half_ == 2) {\n"
     "        DIFFUSERS_TRTLLM_EXP_CORES(0, Mma_tile_p::CORES_N / 2)\n"
     "      } else\n"
     "#undef DIFFUSERS_TRTLLM_EXP_CORES\n"
     "#pragma unroll\n"
     "      for (int ni = 0; ni < Mma_tile_p::CORES_N; ni++) {\n"
     "        // Exp all rows for this ni\n"),
    ("fmha/warpspec/compute.h",
     "        *skip_softmax_vote = 1;\n",
     "        *skip_softmax_vote = 3u;  // diffusers_trtllm: bit 0 skips the step's first 128 keys, bit 1 the rest\n"),
    ("fmha/warpspec/compute.h",
     "// BMM2 (S * V).\n"
     "#pragma unroll\n"
     "    for (int kbi = 0; kbi < BMM2_MMAS_K_GROUPS - 1; kbi++) {\n",
     f"    if constexpr (Kernel_traits::ENABLE_SKIP_SOFTMAX && {_HALF_STEPS}) {{\n"
     "      // diffusers_trtllm: a skipped half issues no GMMA; descriptors advance as the full BMM2 leaves them.\n"
     "      static_assert(BMM2_MMAS_K_GROUPS == 2 && SAGE_BLOCK_SIZE_V < 0, \"one K group per half, no V blocks\");\n"
     "      if (softmax.skipped_half_ != 1) {\n"
     "#pragma unroll\n"
     "        for (int ki = 0; ki < BMM2_MMAS_K_PER_GROUP; ++ki) {\n"
     "          ctile_o.fill_frag_a(frag_p[ki]);\n"
     "          ctile_o.compute(ki, false, ki == BMM2_MMAS_K_PER_GROUP - 1);\n"
     "        }\n"
     "      }\n"
     "      ctile_o.increment_gmma_desc_group();\n"
     "      if (softmax.skipped_half_ != 2) {\n"
     "#pragma unroll\n"
     "        for (int ki = 0; ki < BMM2_MMAS_K_PER_GROUP - 1; ++ki) {\n"
     "          ctile_o.fill_frag_a(frag_p[BMM2_MMAS_K_PER_GROUP + ki]);\n"
     "          ctile_o.compute(ki);\n"
     "        }\n"
     "        ctile_o.fill_frag_a(frag_p[Mma_tile_o::MMAS_K - 1]);\n"
     "        ctile_o.compute(Mma_tile_o::MMAS_K - 1, true, true);\n"
     "      }\n"
     "      warpgroup_commit();\n"
     "      warpgroup_wait<0>();\n"
     "      return;\n"
     "    }\n"
     "// BMM2 (S * V).\n"
     "#pragma unroll\n"
     "    for (int kbi = 0; kbi < BMM2_MMAS_K_GROUPS - 1; kbi++) {\n"),
)


# The two softmax warpgroups take turns on the tensor cores through an ordered mutex. FlashInfer's turn covers Q·Kᵀ
# only, so a warpgroup's P·V runs outside it: the groups' GMMAs collide on the tensor cores and their softmaxes on
# the SFU, and neither hides the other (ncu: tensor and XU pipes each about half busy). In the dense 256-key-step
# kernels one turn covers P·V of step j and Q·Kᵀ of step j + 1 (FA3's ping-pong): while one group runs both GMMAs,
# the other runs its softmax. The first step's Q·Kᵀ takes its own turn; the turn taken before the last P·V ends after
# it. Outputs are bit-identical; at Wan's shape on an H200 the dense kernels ran 3 % (K one scale) and 12 % (K blocks
# of 64) faster, while the skipping kernels ran 1-2 % slower and the 128-key-step ones (two K/V buffers) 35 % slower
# (benchmarks/RESULTS.md), so those keep FlashInfer's turns.
_TURN_SPANS_BMM2 = "MUTEX_TURN_SPANS_BMM2"
MUTEX_TURN_PATCHES = (
    ("fmha/warpspec/compute.h",
     "  enum { ENABLE_MUTEX = Kernel_traits::ENABLE_MUTEX };\n",
     "  enum { ENABLE_MUTEX = Kernel_traits::ENABLE_MUTEX };\n"
     "  // diffusers_trtllm: one mutex turn for P·V of a step and Q·Kᵀ of the next (fmha_v2_sage.py)\n"
     f"  enum {{ {_TURN_SPANS_BMM2} = ENABLE_MUTEX && Kernel_traits::STEP_KV == 256 &&\n"
     "         !Kernel_traits::ENABLE_SKIP_SOFTMAX };\n"),
    ("fmha/warpspec/compute.h",
     "    if constexpr (ENABLE_MUTEX) {\n      mutex.wait();\n    }\n",
     "    if constexpr (ENABLE_MUTEX) {\n"
     f"      if (IS_FIRST_COL || !{_TURN_SPANS_BMM2}) {{  // diffusers_trtllm: else taken before the last P·V\n"
     "        mutex.wait();\n"
     "      }\n"
     "    }\n"),
    ("fmha/warpspec/compute.h",
     "    warpgroup_arrive();\n\n    float last_scale_v;\n",
     f"    if constexpr ({_TURN_SPANS_BMM2}) {{\n"
     "      mutex.wait();  // diffusers_trtllm: one turn for this P·V and the next step's Q·Kᵀ\n"
     "    }\n"
     "    warpgroup_arrive();\n\n    float last_scale_v;\n"),
    ("fmha/warpspec/compute.h",
     "        if (valid_run) {\n          // Final step's update.\n",
     f"        if constexpr ({_TURN_SPANS_BMM2}) {{\n"
     "          mutex_accessor.arrive();  // diffusers_trtllm: ends the turn taken before the last P·V\n"
     "        }\n"
     "        if (valid_run) {\n          // Final step's update.\n"),
)

# V's per-channel scales multiply the output in the kernel's epilogue, after the 1 / row sum, before the bf16
# store, instead of a separate pass over the bf16 output (1.74 ms at Wan's shape) that rounded it a second time.
# On an H200 the kernel with this epilogue runs as fast as the kernel without it plus that pass
# (benchmarks/RESULTS.md): one rounding fewer, no time gained. The scales' row is ``sage_scale_row``, which the
# kernel already holds for Q's scales (ptxas spills fewer bytes than with the row formed from ``head_info``).
# The binding passes the scales through ``params.sage.v`` (``[B, Hq, 128]``, ``max_nblock`` = 128 channels),
# unused otherwise by kernels without V blocks.
# O's accumulator columns hold V^T's rows, whose channels the quantizer permuted
# (:class:`~.triton_sage.QuantizeTargets` ``v_fmha_v2_order``): in each 16-column group, the thread with
# ``lane % 4 == c`` holds in core ``ni`` the channels ``4·c + ni % 2`` and ``+ 2`` (FMHAv2's e4m3 O store puts
# them back in order).
V_SCALE_EPILOGUE_PATCHES = (
    ("fmha/warpspec/epilogue.h",
     "  // Scale_bmm2.\n  uint32_t scale_bmm2_;\n",
     "  // diffusers_trtllm: O's columns times V's per-channel scales (``v_scales``: this head's, by channel).\n"
     "  inline __device__ void scale_channels(Compute_tile_o& ctile_o, float const* v_scales) {\n"
     "#pragma unroll\n"
     "    for (int mma_ni = 0; mma_ni < Mma_tile_o::MMAS_N; mma_ni++) {\n"
     "#pragma unroll\n"
     "      for (int ni = 0; ni < Mma_tile_o::CORES_N; ni++) {\n"
     "        int const channel = mma_ni * Mma_tile_o::N_PER_MMA + 16 * (ni / 2) + 4 * (threadIdx.x % 4) + ni % 2;\n"
     "        float const scale0 = __ldg(v_scales + channel);\n"
     "        float const scale1 = __ldg(v_scales + channel + 2);\n"
     "#pragma unroll\n"
     "        for (int mi = 0; mi < Mma_tile_o::CORES_M; mi++) {\n"
     "          ctile_o.acc_[0][mma_ni].elt(2 * ni * Mma_tile_o::CORES_M + 2 * mi) *= scale0;\n"
     "          ctile_o.acc_[0][mma_ni].elt(2 * ni * Mma_tile_o::CORES_M + 2 * mi + 1) *= scale1;\n"
     "        }\n"
     "      }\n"
     "    }\n"
     "  }\n"
     "\n"
     "  // Scale_bmm2.\n  uint32_t scale_bmm2_;\n"),
    ("fmha/warpspec/compute.h",
     "          tile_o_epilogue.scale(ctile_o, p_max, p_sum);\n",
     "          tile_o_epilogue.scale(ctile_o, p_max, p_sum);\n"
     "          tile_o_epilogue.scale_channels(  // diffusers_trtllm: V's per-channel scales\n"
     "              ctile_o, params.sage.v.scales + static_cast<int64_t>(sage_scale_row) * params.sage.v.max_nblock);\n"),
)


def patched_headers() -> dict[str, str]:
    """FMHAv2 headers with :data:`V_LAYOUT_PATCHES`, :data:`HALF_STEP_SKIP_PATCHES`,
    :data:`V_SCALE_EPILOGUE_PATCHES` and :data:`MUTEX_TURN_PATCHES` applied, by path relative to the fmha_v2 folder;
    the build puts them ahead of FlashInfer's. Raises if a patched text is not found exactly once (FlashInfer
    changed)."""
    from flashinfer.jit import env as jit_env

    headers = {}
    for path, old, new in (*V_LAYOUT_PATCHES, *HALF_STEP_SKIP_PATCHES, *V_SCALE_EPILOGUE_PATCHES,
                           *MUTEX_TURN_PATCHES):
        text = headers.get(path) or (jit_env.FLASHINFER_CSRC_DIR / "fmha_v2" / path).read_text()
        if text.count(old) != 1:
            raise RuntimeError(f"FlashInfer's FMHAv2 {path} changed: a text this package patches was found "
                               f"{text.count(old)} times, expected once:\n{old}")
        headers[path] = text.replace(old, new)
    return headers


def kernel_sources() -> dict[str, str]:
    """File name -> CUDA source of every generated kernel, ``sage_kernels.h`` (the launchers' declarations and
    ``launch_sage_kernel``, which dispatches on q block, k block, KV step and skip-softmax) and the patched FMHAv2
    headers (:func:`patched_headers`)."""
    from flashinfer.jit.attention.fmha_v2.fmha_library import get_kernel_code
    from flashinfer.jit.attention.fmha_v2.utils import encode_name

    sources, declarations, branches = {}, [], []
    for kernel in sage_kernels():
        spec = kernel_spec(kernel)
        file_name, launcher, kernel_name = encode_name(spec)
        sources[file_name] = padding_mask_only(get_kernel_code(spec, kernel_name, launcher))
        declarations.append(f"void {launcher}(Params& params, const Launch_params& launch, cudaStream_t stream);")
        branches.append(f"  if (q_block == {Q_BLOCK} && k_block == {kernel.k_block} && kv_step == {kernel.kv_step} "
                        f"&& skip == {str(kernel.skip_softmax).lower()}) {{\n"
                        f"    {launcher}(params, launch, stream);\n    return true;\n  }}")
    sources["sage_kernels.h"] = "\n".join([
        "// Generated by diffusers_trtllm/kernels/fmha_v2_sage.py.",
        "#pragma once",
        "#include <fused_multihead_attention.h>",
        "using Params = bert::Fused_multihead_attention_params_v2;",
        "using Launch_params = bert::Fused_multihead_attention_launch_params;",
        *declarations,
        "inline bool launch_sage_kernel(int q_block, int k_block, int kv_step, bool skip, Params& params,",
        "                               const Launch_params& launch, cudaStream_t stream) {",
        *branches,
        "  return false;",
        "}",
        ""])
    return {**sources, **patched_headers()}


def include_dirs() -> list[pathlib.Path]:
    """Header folders the build needs: FMHAv2's sources, FlashInfer's csrc (tvm_ffi_utils.h) and include."""
    from flashinfer.jit import env as jit_env

    return [jit_env.FLASHINFER_CSRC_DIR / "fmha_v2", jit_env.FLASHINFER_CSRC_DIR, jit_env.FLASHINFER_INCLUDE_DIR]


def _module_name(sources: dict[str, str]) -> str:
    digest = hashlib.sha256()
    for name in sorted(sources):
        digest.update(name.encode() + sources[name].encode())
    digest.update(BINDING_SOURCE.read_bytes())
    return f"diffusers_trtllm_fmha_v2_sage_{digest.hexdigest()[:12]}"


def jit_spec():
    """FlashInfer ``JitSpec`` of the module: generated kernels and the binding written under FlashInfer's
    generated-source folder, compiled for sm_90a. The name carries a hash of the sources, so a changed
    generator or binding builds anew instead of loading a stale module."""
    from flashinfer.jit import env as jit_env
    from flashinfer.jit.core import gen_jit_spec
    from flashinfer.jit.utils import write_if_different

    sources = kernel_sources()
    name = _module_name(sources)
    folder = jit_env.FLASHINFER_GEN_SRC_DIR / name
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for file_name, code in {**sources, BINDING_SOURCE.name: BINDING_SOURCE.read_text()}.items():
        (folder / file_name).parent.mkdir(parents=True, exist_ok=True)
        write_if_different(folder / file_name, code)
        if file_name.endswith(".cu"):
            paths.append(folder / file_name)
    return gen_jit_spec(name, paths, extra_cuda_cflags=nvcc_flags(folder))


def nvcc_flags(generated: pathlib.Path) -> list[str]:
    """nvcc flags of the build: sm_90a (wgmma and setmaxnreg need the arch-specific target) and the include
    folders (``generated`` holds ``sage_kernels.h`` and the patched headers, so it comes first)."""
    return ["-gencode=arch=compute_90a,code=sm_90a", f"-I{generated}", *(f"-I{d}" for d in include_dirs()),
            "-Wno-deprecated-gpu-targets"]


@functools.lru_cache(maxsize=None)
def load_module():
    """Build (first use on a machine: minutes) or load the compiled module, and say which."""
    spec = jit_spec()
    if spec.is_compiled:
        logger.info("loading the FMHAv2 SAGE kernels from FlashInfer's JIT cache (%s)", spec.name)
    else:
        logger.warning("building %d TRT-LLM FMHAv2 SAGE kernels (sm_90; K blocks %s, KV steps %s, with and without "
                       "skip-softmax) with nvcc as %s: a few minutes on 16 cores (MAX_JOBS=%s), once per machine",
                       len(sage_kernels()), list(K_BLOCKS), list(KV_STEPS), spec.name,
                       os.environ.get("MAX_JOBS", "unset"))
    start = time.perf_counter()
    module = spec.build_and_load()
    if not spec.is_compiled:
        logger.warning("FMHAv2 SAGE kernels ready after %.1f s", time.perf_counter() - start)
    return module


class PackedSage(NamedTuple):
    """Q, K, V quantized for the kernel.

    ``qk``: ``[T, Hq + Hkv, 128]`` float8_e4m3fn (Q heads, then K heads, per token); ``v_t``: ``[Hkv, 128,
    columns]`` float8_e4m3fn, V transposed in :func:`~diffusers_trtllm.kernels.triton_sage.quantize_into`'s
    ``v_fmha_v2_order`` (sequence ``i`` from column ``v_starts[i]``, zeros between sequences); ``v_starts``:
    ``[B + 1]`` int32; ``q_scale``: ``[B, Hq, ceil(max_len / 64)]`` float32 (times K's scale when ``k_block`` is
    0); ``k_scale``: ``[B, Hq, ceil(max_len / k_block)]`` float32 per query head (empty when ``k_block`` is 0);
    ``v_scale``: ``[B, Hkv, 128]`` float32.
    """

    qk: torch.Tensor
    v_t: torch.Tensor
    v_starts: torch.Tensor
    q_scale: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    k_block: int


def sage_quantize_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                         max_seqlen: int, k_block: int) -> PackedSage:
    """Quantize a packed self-attention batch for :func:`sage_attention_packed` (one Triton reduction, one
    Triton pass writing Q and K packed, V transposed, and the scales).

    ``q`` ``[T, Hq, 128]``, ``k``/``v`` ``[T, Hkv, 128]`` bf16/fp16, channels contiguous; ``cu_seqlens``
    ``[B + 1]`` int32 (queries and keys of sequence ``i`` are rows ``cu_seqlens[i]:cu_seqlens[i + 1]``).
    """
    tokens, heads_q, heads_kv = q.shape[0], q.shape[1], k.shape[1]
    batch = cu_seqlens.shape[0] - 1
    device = q.device
    qk = torch.empty(tokens, heads_q + heads_kv, HEAD_DIM, dtype=torch.float8_e4m3fn, device=device)
    # The kernel's V tiles run past a sequence's last key into the next one or the gap before it: zeros there
    # keep P·V finite (P is 0 for those keys, and 0 · NaN is not).
    v_t = torch.zeros(heads_kv, HEAD_DIM, triton_sage.v_columns(tokens, batch), dtype=torch.float8_e4m3fn,
                      device=device)
    align = triton_sage.V_TOKEN_ALIGN
    v_starts = (align * ((cu_seqlens + align - 1) // align
                         + torch.arange(batch + 1, dtype=torch.int32, device=device))).to(torch.int32)
    # Blocks past a shorter sequence's end are read by the kernel (and masked): scale 1 keeps them finite.
    q_scale = torch.ones(batch, heads_q, -(-max_seqlen // Q_BLOCK), dtype=torch.float32, device=device)
    k_scale = torch.ones(batch, heads_kv, -(-max_seqlen // k_block) if k_block else 0, dtype=torch.float32,
                         device=device)
    v_scale = torch.empty(batch, heads_kv, HEAD_DIM, dtype=torch.float32, device=device)
    targets = triton_sage.QuantizeTargets(qk[:, :heads_q], q_scale, qk[:, heads_q:], k_scale, v_t, v_scale,
                                          scales_by_sequence=True, v_transposed=True, v_fmha_v2_order=True)
    triton_sage.quantize_into(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, targets,
                              dtype_qk="fp8_e4m3", q_block=Q_BLOCK, k_block=k_block)
    if heads_q != heads_kv and k_block:  # the kernel indexes K scales by query head
        k_scale = k_scale.repeat_interleave(heads_q // heads_kv, dim=1)
    return PackedSage(qk, v_t, v_starts, q_scale, k_scale, v_scale, k_block)


def sage_attention_packed(packed: PackedSage, cu_seqlens: torch.Tensor, seqlens: tuple[int, ...], heads_q: int,
                          scale: float, skip_factor: float = 0.0, kv_step: int = 256) -> torch.Tensor:
    """FMHAv2 SAGE attention on :func:`sage_quantize_packed`'s output. Returns ``[T, Hq, 128]`` bf16 with V's
    per-channel scales applied. ``skip_factor`` > 0 enables Skip-Softmax (λ_i = skip_factor / len_i)."""
    heads_kv = packed.qk.shape[1] - heads_q
    out = torch.empty(packed.qk.shape[0], heads_q, HEAD_DIM, dtype=torch.bfloat16, device=packed.qk.device)
    tile_counter = torch.empty(1, dtype=torch.int32, device=packed.qk.device)  # per call: streams never share it
    # the kernel reads V's scales per query head
    v_scale = packed.v_scale.repeat_interleave(heads_q // heads_kv, dim=1) if heads_q != heads_kv else packed.v_scale
    load_module().sage_attention(packed.qk, packed.v_t, packed.v_starts, out, packed.q_scale, packed.k_scale,
                                 v_scale, cu_seqlens, tile_counter, heads_q, heads_kv, max(seqlens), Q_BLOCK,
                                 packed.k_block, kv_step, float(scale), float(skip_factor))
    return out


def fmha_v2_sage_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                           seqlens: tuple[int, ...], scale: float, *, k_block: int = 64, kv_step: int = 256,
                           skip_factor: float = 0.0) -> torch.Tensor:
    """SAGE attention (FP8 e4m3 Q/K/V, per-block Q/K scales, per-channel V) with optional Skip-Softmax on
    Hopper through TRT-LLM FMHAv2's warp-specialized kernel; quantization included.

    ``q``: ``[T, Hq, 128]``, ``k``/``v``: ``[T, Hkv, 128]`` bf16 (fp16 accepted), ragged self-attention: sequence
    ``i`` owns rows ``cu_seqlens[i]:cu_seqlens[i + 1]`` of all three (``cu_seqlens`` ``[B + 1]`` int32 on the
    tensors' device; ``seqlens`` the same lengths as host ints). ``Hq % Hkv == 0``. ``scale``: softmax scale.
    ``k_block`` / ``kv_step``: a pair of :func:`sage_kernels`; skip decisions are per :data:`SKIP_TILE`.
    Returns ``[T, Hq, 128]`` bf16. GPUs: sm_90 (H100/H200); the first call on a machine compiles the kernels
    (see :func:`load_module`).
    """
    if not any(k.k_block == k_block and k.kv_step == kv_step for k in sage_kernels()):
        raise ValueError(f"k_block={k_block!r} with kv_step={kv_step!r} has no compiled FMHAv2 SAGE kernel; "
                         f"compiled: {sorted({(k.k_block, k.kv_step) for k in sage_kernels()})}")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    packed = sage_quantize_packed(q, k, v, cu_seqlens, max(seqlens), k_block)
    return sage_attention_packed(packed, cu_seqlens, seqlens, q.shape[1], scale, skip_factor, kv_step)

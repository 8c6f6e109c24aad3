"""SAGE attention on Hopper (sm_90) with TRT-LLM FMHAv2's warp-specialized FP8 kernels.

FlashInfer ships FMHAv2's sources with SageAttention support (kernel traits ``SAGE_BLOCK_SIZE_Q/K/V``, kernel
parameters ``sage.{q,k,v}``) and the generator that instantiates them, but its Python API never fills the SAGE
parameters. This module generates the SAGE variants with FlashInfer's own generator
(``flashinfer.jit.attention.fmha_v2.fmha_library``), patches FMHAv2's headers (``csrc/fmha_v2_patches/``,
:data:`HEADER_PATCHES`), compiles them with this package's host binding (``csrc/fmha_v2_sage.cu``) through
FlashInfer's JIT (once per machine, cached), and quantizes Q, K and V for them with one fused Triton pass.

Semantics (what :func:`fmha_v2_sage_attention` computes; the reference's ``fmha_v2`` semantics model them):

- K smoothed by its per-sequence mean; Q per block of 64 tokens and K per block of ``k_block`` tokens (64 or
  128; 0 = one scale per sequence and head, multiplied into Q's scales so the kernel does no per-key scaling)
  quantized to fp8 e4m3 (scale = block amax / 448), blocks from each sequence's start;
- V per (sequence, head, channel) to fp8 e4m3. The kernel's own V block scales are loaded but never applied
  (``compute.h``'s ``APPLY_SCALE_V`` only records them, in FlashInfer 0.7.2 as in TRT-LLM), so the kernels have
  no V blocks and their epilogue multiplies the output by V's per-channel scales (``v_scale_epilogue.patch``);
- P quantized to fp8 as ``P · 256`` (FMHAv2's ``Softmax_fp_quant_scale<e4m3>``); row sums from unquantized P;
- Skip-Softmax in the same kernel: each warpgroup (64 query rows) skips 128 keys (:data:`SKIP_TILE`) when every
  row's ``exp(tile_max - running_max) < skip_factor / kv_len``, with ``running_max`` the one at the start of the
  KV step (``kv_step`` keys: 256, the generator's choice for e4m3, whose halves are decided apart
  (``half_step_skip.patch``), or 128); the first KV step is never skipped;
- Skip-Softmax reuse with a tile map (the tiles an earlier call skipped, :func:`tile_map_shape`), in a separate
  kernel (``tile_map_reuse.patch``) at :data:`REUSE_KV_STEP` keys per step, each step two gathered 128-key tiles
  (the next two that either warpgroup of a CTA computes; a tile both reuse is never loaded): the map's tiles are
  skipped untested, the others tested as above, each against the running max at its step's start, and the
  tiles the test skipped are added to the map; at ``skip_factor`` 0 a second tile-map kernel without the test
  computes the others and leaves the map as it was. A zeroed map (a reuse window's first step: every tile
  tested, ``fresh_map``) runs on the Skip-Softmax kernel that also writes the tiles it skips into the map.

The kernel reads Q and K from one packed ``[tokens, Hq + Hkv, 128]`` e4m3 tensor (``PACKED_QKV``), so it runs
every sequence with as many queries as keys, and V already transposed (``v_layout.patch``). A sequence with fewer
queries than keys (Cosmos 3's generation stream: its queries on text + generation keys) runs with its queries
at the start of its key rows and zero queries after them (the quantizer writes them in place): the zero rows'
scores are all 0, never below their running max, so a 64-row tile holding any of them never skips, and their
output rows are dropped. The reference models this with ``SageSemantics.q_padded_to_kv``.
GPUs: sm_90 only (wgmma, TMA, setmaxnreg).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import pathlib
import re
import time
from typing import NamedTuple

import torch

from . import triton_sage
from .flashinfer_calls import fmha_v2_stats_lse
from .flashinfer_fmha import drop_padded_queries
from .numerics import HEAD_DIM, bits_set, smoothing_lse_shift, tile_map_shape as numerics_tile_map_shape

logger = logging.getLogger("diffusers_trtllm")

Q_BLOCK = 64  # the kernel's query step per warpgroup: Q scale blocks must be a multiple of it
K_BLOCKS = (0, 64, 128)  # compiled K scale blocks (0: one scale per sequence and head, folded into Q's)
KV_STEPS = (256, 128)  # keys per KV step: FlashInfer's choice for e4m3, and a finer one for Skip-Softmax
# K/V tiles the DMA warp keeps in flight, per KV step. V arrives transposed (``v_layout.patch``), so shared memory
# needs no transpose scratch and holds three 256-key buffers (3 · 64 KiB + Q's 16 KiB) where FlashInfer's e4m3
# choice is two, which was the faster (benchmarks/RESULTS.md). 128-key steps keep FlashInfer's two.
KV_BUFFERS = {256: 3, 128: 2}
P_SCALE = 256.0  # P enters P·V as fp8(P * 256)
BINDING_SOURCE = pathlib.Path(__file__).with_name("csrc") / "fmha_v2_sage.cu"


@dataclasses.dataclass(frozen=True)
class SageKernel:
    """One generated kernel: its K scale block, keys per KV step, whether it has the Skip-Softmax code path,
    whether it writes each row's softmax statistics (FMHAv2's ``RETURN_SOFTMAX_STATS``: the log-sum-exp),
    whether it reuses a tile map (``tile_map_reuse.patch``: compiled with ``DIFFUSERS_TRTLLM_TILE_MAP``), and
    whether it writes the tiles it skips into a zeroed one (compiled with ``DIFFUSERS_TRTLLM_TILE_MAP_OUT``)."""

    k_block: int
    kv_step: int
    skip_softmax: bool
    lse: bool = False
    reuse: bool = False
    map_out: bool = False

    @property
    def tile_map(self) -> bool:
        """Whether the kernel takes a tile map (reads it, or writes a zeroed one)."""
        return self.reuse or self.map_out


# KV step of the kernels that write softmax statistics: the one TRTLLM_ATTN runs (128-key steps serve benchmarks)
LSE_KV_STEP = 256


# The tile-map kernels: K block 0 (the route's default) at steps of two gathered 128-key tiles, which ran their
# computed tiles 7-8 % faster than steps of one tile (benchmarks/RESULTS.md, 2026-12-06). A zeroed map (every
# tile tested, the map written: ``fresh_map``) runs on the Skip-Softmax kernel of the same step, built again to
# write the map: from a zeroed map it was faster than the tile-map kernel, which runs a half the test skips as
# zeros where that kernel leaves its P·V out (benchmarks/RESULTS.md)
REUSE_K_BLOCK, REUSE_KV_STEP = 0, 256
MAX_MAP_TILES = 0xFFFF  # KV tiles of a sequence with a tile map: the DMA warp's step word names a tile in 16 bits


def sage_kernels() -> tuple[SageKernel, ...]:
    """Every kernel the module builds: each compiled K block and KV step, with and without Skip-Softmax (K block
    128 at KV step 256 only: it exists for the block-size sweep), at :data:`LSE_KV_STEP` each of those again
    writing the softmax statistics (a separate kernel: the others stay as they were), and the kernels at
    :data:`REUSE_K_BLOCK` and :data:`REUSE_KV_STEP`, with and without Skip-Softmax, again reusing a tile map (the
    one without runs a map at ``skip_factor`` 0: it skips the map's tiles and tests nothing), and the Skip-Softmax
    kernel there again writing the tiles it skips into a zeroed map."""
    plain = tuple(SageKernel(k_block, kv_step, skip) for kv_step in KV_STEPS for k_block in K_BLOCKS
                  for skip in (False, True) if not (k_block == 128 and kv_step != 256))
    return (plain + tuple(dataclasses.replace(k, lse=True) for k in plain if k.kv_step == LSE_KV_STEP)
            + tuple(SageKernel(REUSE_K_BLOCK, REUSE_KV_STEP, skip, reuse=True) for skip in (True, False))
            + (SageKernel(REUSE_K_BLOCK, REUSE_KV_STEP, True, map_out=True),))


SKIP_TILE = (Q_BLOCK, 128)  # (query rows, keys) per skip decision: one warpgroup's rows, half a 256-key step


def kernel_spec(kernel: SageKernel):
    """FlashInfer's ``FMHAv2KernelSpec`` for ``kernel``: sm_90, e4m3 in, bf16 out, head_dim 128, PACKED_QKV,
    warp-specialized, no ALiBi or softcapping, softmax statistics where ``kernel.lse``, SAGE blocks ``(64, k_block, 0)`` (V block 0: no V scales),
    ``kv_loop_step`` = ``kv_step``, :data:`KV_BUFFERS` K/V buffers."""
    from flashinfer.jit.attention.fmha_v2.fmha_library import generate_kernel_spec
    from flashinfer.jit.attention.fmha_v2.utils import InputLayout

    spec = generate_kernel_spec(sm=90, head_size=HEAD_DIM, dtype="e4m3", enable_skip_softmax=kernel.skip_softmax,
                                return_softmax=kernel.lse, enable_attn_logit_softcapping=False, alibi=False,
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


# FMHAv2 header patches, applied in this order at build time (csrc/fmha_v2_patches/<name>.patch; each file says
# what it changes and why).
HEADER_PATCHES = ("v_layout", "half_step_skip", "v_scale_epilogue", "lazy_rescale", "mutex_turn", "skip_counts",
                  "tile_map_reuse")
PATCH_FOLDER = pathlib.Path(__file__).with_name("csrc") / "fmha_v2_patches"
_HUNK_HEADER = re.compile(r"@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")


class HeaderPatch(NamedTuple):
    """One hunk of a header patch: the header (relative to FlashInfer's fmha_v2 folder), the text it replaces
    and the replacement."""

    path: str
    old: str
    new: str


def header_patch_files() -> tuple[pathlib.Path, ...]:
    """The patch files of :data:`HEADER_PATCHES`, in the order they are applied."""
    return tuple(PATCH_FOLDER / f"{name}.patch" for name in HEADER_PATCHES)


def read_patch(patch_file: pathlib.Path) -> tuple[HeaderPatch, ...]:
    """The hunks of a unified diff whose paths are ``a/<header>`` / ``b/<header>``. Text before the first file
    header is the patch's description; hunk line numbers are not used (:func:`patched_headers` finds each hunk's
    text)."""
    lines = patch_file.read_text(encoding="utf-8").splitlines(keepends=True)
    hunks, header, i = [], None, 0
    while i < len(lines):
        line, i = lines[i], i + 1
        if line.startswith("+++ b/"):
            header = line[len("+++ b/"):].rstrip("\n")
        elif line.startswith("@@") and header is not None:
            counts = _HUNK_HEADER.match(line)
            if counts is None:
                raise ValueError(f"{patch_file.name}, line {i}: malformed hunk header {line!r}")
            old_count, new_count = (int(n) if n is not None else 1 for n in counts.groups())
            old, new = [], []
            while len(old) < old_count or len(new) < new_count:
                if i == len(lines) or lines[i][:1] not in (" ", "-", "+", "\n"):
                    raise ValueError(f"{patch_file.name}, line {i + 1}: hunk ends before its {old_count} old and "
                                     f"{new_count} new lines")
                tag, text, i = lines[i][:1], lines[i][1:] or "\n", i + 1  # "\n": a context line's space stripped
                old += [text] if tag != "+" else []
                new += [text] if tag != "-" else []
            hunks.append(HeaderPatch(header, "".join(old), "".join(new)))
    return tuple(hunks)


def patched_headers(patch_files: tuple[pathlib.Path, ...] | None = None) -> dict[str, str]:
    """FMHAv2 headers with ``patch_files`` (default :func:`header_patch_files`) applied, by path relative to the
    fmha_v2 folder; the build puts them ahead of FlashInfer's. Raises if a hunk's text is not found exactly once
    (FlashInfer changed)."""
    from flashinfer.jit import env as jit_env

    headers = {}
    for patch_file in header_patch_files() if patch_files is None else patch_files:
        for path, old, new in read_patch(patch_file):
            text = headers.get(path) or (jit_env.FLASHINFER_CSRC_DIR / "fmha_v2" / path).read_text()
            if text.count(old) != 1:
                raise RuntimeError(f"FlashInfer's FMHAv2 {path} changed: a text {patch_file.name} patches was "
                                   f"found {text.count(old)} times, expected once:\n{old}")
            headers[path] = text.replace(old, new)
    return headers


# A tile-map kernel's names (file, launcher, kernel): FlashInfer's for its spec with this after "skipSoftmax"
# (the kernel with the test) or before "sage" (the one without); the map-writing kernel's with the second
TILE_MAP_NAME, MAP_OUT_NAME = "_tileMap", "_tileMapOut"


def kernel_names(kernel: SageKernel) -> tuple[str, str, str]:
    """(source file, launcher, kernel) names of ``kernel``: FlashInfer's for its spec, :data:`TILE_MAP_NAME`
    added to a tile-map kernel's (its spec is the plain kernel's, with or without Skip-Softmax) and
    :data:`MAP_OUT_NAME` to the map-writing kernel's."""
    from flashinfer.jit.attention.fmha_v2.utils import encode_name

    names = encode_name(kernel_spec(kernel))
    if not kernel.tile_map:
        return names
    added = MAP_OUT_NAME if kernel.map_out else TILE_MAP_NAME
    mark, marked = ("skipSoftmax", "skipSoftmax" + added) if kernel.skip_softmax else ("_sage_", added + "_sage_")
    if any(name.count(mark) != 1 for name in names):
        raise RuntimeError(f"FlashInfer's FMHAv2 kernel names changed: expected {mark!r} once in {names}")
    return tuple(name.replace(mark, marked) for name in names)


def kernel_sources() -> dict[str, str]:
    """File name -> CUDA source of every generated kernel (a tile-map kernel's defines
    ``DIFFUSERS_TRTLLM_TILE_MAP`` ahead of FMHAv2's headers, the map-writing kernel's
    ``DIFFUSERS_TRTLLM_TILE_MAP_OUT``), ``sage_kernels.h`` (the launchers' declarations
    and ``launch_sage_kernel``, which dispatches on q block, k block, KV step, skip-softmax, softmax statistics,
    tile map and whether the map is read) and the patched FMHAv2 headers (:func:`patched_headers`)."""
    from flashinfer.jit.attention.fmha_v2.fmha_library import get_kernel_code

    sources, declarations, branches = {}, [], []
    for kernel in sage_kernels():
        file_name, launcher, kernel_name = kernel_names(kernel)
        code = padding_mask_only(get_kernel_code(kernel_spec(kernel), kernel_name, launcher))
        define = ("DIFFUSERS_TRTLLM_TILE_MAP_OUT" if kernel.map_out else "DIFFUSERS_TRTLLM_TILE_MAP"
                  if kernel.reuse else None)
        sources[file_name] = f"#define {define} 1  // tile_map_reuse.patch\n" + code if define else code
        declarations.append(f"void {launcher}(Params& params, const Launch_params& launch, cudaStream_t stream);")
        branches.append(f"  if (q_block == {Q_BLOCK} && k_block == {kernel.k_block} && kv_step == {kernel.kv_step} "
                        f"&& skip == {str(kernel.skip_softmax).lower()} && lse == {str(kernel.lse).lower()} "
                        f"&& tile_map == {str(kernel.tile_map).lower()} && reads_map == {str(kernel.reuse).lower()}) "
                        "{\n"
                        f"    {launcher}(params, launch, stream);\n    return true;\n  }}")
    sources["sage_kernels.h"] = "\n".join([
        "// Generated by diffusers_trtllm/kernels/fmha_v2_sage.py.",
        "#pragma once",
        "#include <fused_multihead_attention.h>",
        "using Params = bert::Fused_multihead_attention_params_v2;",
        "using Launch_params = bert::Fused_multihead_attention_launch_params;",
        *declarations,
        "inline bool launch_sage_kernel(int q_block, int k_block, int kv_step, bool skip, bool lse, bool tile_map,",
        "                               bool reads_map,",
        "                               Params& params, const Launch_params& launch, cudaStream_t stream) {",
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
    """nvcc flags of the build: sm_90a (wgmma and setmaxnreg need the arch-specific target), the skip count's
    pointer in the params struct (``skip_counts.patch``) and the include folders (``generated`` holds
    ``sage_kernels.h`` and the patched headers, so it comes first)."""
    return ["-gencode=arch=compute_90a,code=sm_90a", "-DSKIP_SOFTMAX_STAT", f"-I{generated}",
            *(f"-I{d}" for d in include_dirs()), "-Wno-deprecated-gpu-targets"]


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

    ``qk``: ``[T, Hq + Hkv, 128]`` float8_e4m3fn (Q heads, then K heads, per key token; sequence ``i``'s queries
    from its first key row, zero rows after them up to its key length); ``v_t``: ``[Hkv, 128,
    columns]`` float8_e4m3fn, V transposed in :func:`~diffusers_trtllm.kernels.triton_sage.quantize_into`'s
    ``v_fmha_v2_order`` (sequence ``i`` from column ``v_starts[i]``, zeros between sequences); ``v_starts``:
    ``[B + 1]`` int32; ``q_scale``: ``[B, Hq, ceil(max_len / 64)]`` float32 (times K's scale when ``k_block`` is
    0); ``k_scale``: ``[B, Hq, ceil(max_len / k_block)]`` float32 per query head (empty when ``k_block`` is 0);
    ``v_scale``: ``[B, Hkv, 128]`` float32. ``max_len``: the longest key sequence.
    """

    qk: torch.Tensor
    v_t: torch.Tensor
    v_starts: torch.Tensor
    q_scale: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    k_block: int


def sage_quantize_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                         max_seqlen: int, k_block: int, cu_seqlens_q: torch.Tensor | None = None,
                         max_seqlen_q: int | None = None) -> PackedSage:
    """Quantize a packed batch for :func:`sage_attention_packed` (one Triton reduction, one Triton pass writing
    Q and K packed, V transposed, and the scales).

    ``q`` ``[Tq, Hq, 128]``, ``k``/``v`` ``[T, Hkv, 128]`` bf16/fp16, channels contiguous; ``cu_seqlens``
    ``[B + 1]`` int32: sequence ``i``'s keys are rows ``cu_seqlens[i]:cu_seqlens[i + 1]`` (``max_seqlen`` the
    longest); its queries the same rows of ``q``, or with ``cu_seqlens_q`` / ``max_seqlen_q`` rows
    ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]``, at most as many as its keys (the caller checks), which land at the
    start of its key rows in ``qk`` with zero rows after them.
    """
    tokens, heads_q, heads_kv = k.shape[0], q.shape[1], k.shape[1]
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
                                          scales_by_sequence=True, v_transposed=True, v_fmha_v2_order=True,
                                          q_padded_to_kv=True)
    if cu_seqlens_q is None:
        cu_seqlens_q, max_seqlen_q = cu_seqlens, max_seqlen
    triton_sage.quantize_into(q, k, v, cu_seqlens_q, cu_seqlens, max_seqlen_q, max_seqlen, targets,
                              dtype_qk="fp8_e4m3", q_block=Q_BLOCK, k_block=k_block)
    if heads_q != heads_kv and k_block:  # the kernel indexes K scales by query head
        k_scale = k_scale.repeat_interleave(heads_q // heads_kv, dim=1)
    return PackedSage(qk, v_t, v_starts, q_scale, k_scale, v_scale, k_block)


def skip_tiles(seqlens: tuple[int, ...], heads_q: int) -> int:
    """The :data:`SKIP_TILE` tiles a skipping kernel visits for key lengths ``seqlens`` (host ints) and ``heads_q``
    query heads: each sequence's query tiles at its key length (zero query rows included, as
    :class:`~diffusers_trtllm.quant.SageSemantics` ``q_padded_to_kv`` counts them) times its key tiles."""
    rows, keys = SKIP_TILE
    return heads_q * sum(-(-n // rows) * -(-n // keys) for n in seqlens)


def sage_attention_packed(packed: PackedSage, cu_seqlens: torch.Tensor, seqlens: tuple[int, ...], heads_q: int,
                          scale: float, skip_factor: float = 0.0, kv_step: int = 256,
                          skip_counts: torch.Tensor | None = None,
                          softmax_stats: torch.Tensor | None = None,
                          tile_map: torch.Tensor | None = None, fresh_map: bool = False) -> torch.Tensor:
    """FMHAv2 SAGE attention on :func:`sage_quantize_packed`'s output, ``cu_seqlens`` / ``seqlens`` its key
    lengths. Returns ``[T, Hq, 128]`` bf16 at the keys' layout (the rows of zero queries included) with V's
    per-channel scales applied. ``skip_factor`` > 0 enables Skip-Softmax (λ_i = skip_factor / len_i);
    ``skip_counts`` (an int32 ``[1]`` view, :func:`fmha_v2_sage_attention`) receives the tiles its test skipped;
    ``softmax_stats`` (``[T, Hq, 2]`` float32, at :data:`LSE_KV_STEP`) each row's statistics
    (:func:`~.flashinfer_calls.fmha_v2_stats_lse`); ``tile_map`` (:func:`fmha_v2_sage_attention`, checked there)
    runs the tile-map kernel, which reads a copy of it taken here and updates it in place, or with ``fresh_map``
    the map-writing kernel, which reads none of it."""
    device = packed.qk.device
    heads_kv = packed.qk.shape[1] - heads_q
    out = torch.empty(packed.qk.shape[0], heads_q, HEAD_DIM, dtype=torch.bfloat16, device=device)
    tile_counter = torch.empty(1, dtype=torch.int32, device=device)  # per call: streams never share it
    if skip_counts is None:
        skip_counts = torch.empty(0, dtype=torch.int32, device=device)  # empty: the kernel counts nothing
    if softmax_stats is None:
        softmax_stats = torch.empty(0, dtype=torch.float32, device=device)  # empty: the kernel without statistics
    # The kernel decides from the map as it was on entry while it ORs skipped tiles into the map: a warpgroup
    # running ahead must not change the words its partner and the DMA warp still read. Empty: no map, or the
    # map-writing kernel's, which reads none.
    reads_map = tile_map is not None and not fresh_map
    tile_map_entry = tile_map.clone() if reads_map else torch.empty(0, dtype=torch.int32, device=device)
    tile_map = tile_map_entry if tile_map is None else tile_map
    # the kernel reads V's scales per query head
    v_scale = packed.v_scale.repeat_interleave(heads_q // heads_kv, dim=1) if heads_q != heads_kv else packed.v_scale
    load_module().sage_attention(packed.qk, packed.v_t, packed.v_starts, out, packed.q_scale, packed.k_scale,
                                 v_scale, cu_seqlens, tile_counter, skip_counts, softmax_stats, tile_map_entry,
                                 tile_map, heads_q, heads_kv,
                                 max(seqlens),
                                 Q_BLOCK, packed.k_block, kv_step, float(scale), float(skip_factor))
    return out


def fmha_v2_sage_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                           seqlens: tuple[int, ...], scale: float, *, cu_seqlens_q: torch.Tensor | None = None,
                           seqlens_q: tuple[int, ...] | None = None, k_block: int = 64, kv_step: int = 256,
                           skip_factor: float = 0.0, skip_counts: torch.Tensor | None = None,
                           return_lse: bool = False, tile_map: torch.Tensor | None = None,
                           fresh_map: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """SAGE attention (FP8 e4m3 Q/K/V, per-block Q/K scales, per-channel V) with optional Skip-Softmax on
    Hopper through TRT-LLM FMHAv2's warp-specialized kernel; quantization included.

    ``k``/``v``: ``[T, Hkv, 128]`` bf16 (fp16 accepted), ragged: sequence ``i``'s keys are rows
    ``cu_seqlens[i]:cu_seqlens[i + 1]`` (``cu_seqlens`` ``[B + 1]`` int32 on the tensors' device; ``seqlens`` the
    same lengths as host ints). ``q``: ``[T, Hq, 128]`` with the same rows (self-attention), or, given
    ``cu_seqlens_q`` / ``seqlens_q`` (likewise), ``[Tq, Hq, 128]`` with at most as many queries per sequence as
    keys; the kernel then runs each sequence on its key length with zero queries after the real ones (module
    docstring). ``Hq % Hkv == 0``. ``scale``: softmax scale. ``k_block`` / ``kv_step``: a pair of
    :func:`sage_kernels`; skip decisions are per :data:`SKIP_TILE`. ``skip_counts``: with Skip-Softmax, an int32
    ``[1]`` tensor on the device (zeros) to which the kernel adds its skipped tiles, of the :func:`skip_tiles` it
    visits; no host read. Returns ``[Tq, Hq, 128]`` bf16 (one sequence: a view of the kernel's output; several
    with fewer queries: one gather of their rows). ``return_lse`` (``kv_step`` :data:`LSE_KV_STEP`): returns
    ``(out, lse)``, ``lse`` ``[Tq, Hq]`` float32, each row's natural log-sum-exp of its scaled scores over the keys
    it kept, with the smoothing's shift ``scale · q · mean(K)`` (K's mean over its sequence) added back.

    ``tile_map``: Skip-Softmax reuse, int32 ``[B, Hq, ceil(max(seqlens_q) / 64), ceil(ceil(max(seqlens) / 128) /
    32)]`` contiguous on the tensors' device (:func:`tile_map_shape`): bit ``j % 32`` of word ``[b, h, i, j //
    32]`` set = KV tile ``j`` (keys ``[128 j, 128 j + 128)``) skipped for query tile ``i`` (rows ``[64 i, 64 i +
    64)``) of head ``h`` of sequence ``b``; bits past a sequence's tiles 0. The kernel skips the set tiles untested
    (no Q·Kᵀ, exps or P·V for the query tile, no K/V load where both query tiles of a pair ``2k``, ``2k + 1``
    reuse the tile), tests the others, each against the running max at the start of its step (the tiles either
    query tile of the pair computes, two to a step in key order: ``SageSemantics.paired_tiles``), and sets the
    bits of the tiles its test skipped (updated in place). Needs ``k_block`` :data:`REUSE_K_BLOCK`, ``kv_step``
    :data:`REUSE_KV_STEP`, no ``return_lse``; ``skip_factor`` 0 skips the map's tiles only. With ``fresh_map``
    (``skip_factor`` > 0) the map must be zeroed (a reuse window's first step): the Skip-Softmax kernel tests
    every tile, reads none of the map and sets the bits of the tiles it skipped, each 128-key half of a step
    decided against the running max at the step's start as without a map.
    ``skip_counts`` is then int32 ``[2]``: (tiles the test skipped, tiles reused: the bits set on entry, 0 for a
    zeroed map). GPUs: sm_90 (H100/H200); the first call on a machine compiles the kernels (see
    :func:`load_module`).
    """
    if tile_map is not None:
        _check_tile_map(tile_map, q, seqlens, seqlens_q, k_block, kv_step, return_lse, skip_factor, fresh_map)
    elif fresh_map:
        raise ValueError("fresh_map=True writes a tile map: pass the zeroed map as tile_map")
    if not any(k.k_block == k_block and k.kv_step == kv_step and k.lse == return_lse for k in sage_kernels()):
        raise ValueError(f"k_block={k_block!r} with kv_step={kv_step!r}{' and return_lse' if return_lse else ''} "
                         "has no compiled FMHAv2 SAGE kernel; compiled (k_block, kv_step, return_lse): "
                         f"{sorted({(k.k_block, k.kv_step, k.lse) for k in sage_kernels()})}")
    if (cu_seqlens_q is None) != (seqlens_q is None):
        raise ValueError("cu_seqlens_q and seqlens_q come together (fewer queries than keys) or not at all "
                         f"(self-attention); got cu_seqlens_q={'None' if cu_seqlens_q is None else 'a tensor'}, "
                         f"seqlens_q={seqlens_q!r}")
    counts = 1 if tile_map is None else 2
    if skip_counts is not None and not (skip_counts.shape == (counts,) and skip_counts.dtype == torch.int32
                                        and skip_counts.device == q.device):
        raise ValueError(f"skip_counts must be an int32 [{counts}] tensor on {q.device}"
                         f"{' (with a tile map: tested, reused)' if tile_map is not None else ''}; got "
                         f"{skip_counts.dtype} {tuple(skip_counts.shape)} on {skip_counts.device}")
    seqlens_q = tuple(seqlens) if seqlens_q is None else tuple(seqlens_q)
    if len(seqlens_q) != len(seqlens) or any(n_q > n_kv for n_q, n_kv in zip(seqlens_q, seqlens)):
        raise ValueError(f"seqlens_q={seqlens_q} on seqlens={tuple(seqlens)}: the FMHAv2 SAGE kernel takes, per "
                         "sequence, at most as many queries as keys")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    padded = seqlens_q != tuple(seqlens)
    packed = sage_quantize_packed(q, k, v, cu_seqlens, max(seqlens), k_block,
                                  cu_seqlens_q if padded else None, max(seqlens_q) if padded else None)
    stats = torch.empty(k.shape[0], q.shape[1], 2, dtype=torch.float32, device=q.device) if return_lse else None
    if skip_counts is not None and tile_map is not None and not fresh_map:
        skip_counts[1:].add_(bits_set(tile_map).sum().to(torch.int32))  # reused: the bits set on entry
    out = sage_attention_packed(packed, cu_seqlens, seqlens, q.shape[1], scale, skip_factor, kv_step,
                                None if skip_counts is None else skip_counts[:1], stats, tile_map, fresh_map)
    out = drop_padded_queries(out, seqlens_q, tuple(seqlens)) if padded else out
    if not return_lse:
        return out
    stats[..., 0] *= row_q_scales(packed.q_scale, tuple(seqlens))  # the kernel stores the max without it
    lse = fmha_v2_stats_lse(stats, scale, HEAD_DIM)
    lse = drop_padded_queries(lse, seqlens_q, tuple(seqlens)) if padded else lse
    return out, lse + smoothing_shift(q, k, seqlens_q, seqlens, scale)


def row_q_scales(q_scale: torch.Tensor, seqlens: tuple[int, ...]) -> torch.Tensor:
    """``[T, Hq]`` float32: the Q block scale of each row of the keys' layout (``q_scale`` ``[B, Hq, blocks]`` of
    :class:`PackedSage`, ``seqlens`` the key lengths), by which the kernel's saved row max is short."""
    batch, heads, blocks = q_scale.shape
    rows = torch.cat([torch.arange(n, device=q_scale.device) // Q_BLOCK + b * blocks for b, n in enumerate(seqlens)])
    return q_scale.transpose(1, 2).reshape(batch * blocks, heads)[rows]


def tile_map_shape(seqlens_q: tuple[int, ...], seqlens_kv: tuple[int, ...], heads_q: int) -> tuple[int, ...]:
    """``[B, Hq, query tiles, words]`` of the tile map of a batch with these lengths: one bit per :data:`SKIP_TILE`
    tile (:func:`~.numerics.tile_map_shape`)."""
    return numerics_tile_map_shape(seqlens_q, seqlens_kv, heads_q, SKIP_TILE)


def _check_tile_map(tile_map: torch.Tensor, q: torch.Tensor, seqlens: tuple[int, ...],
                    seqlens_q: tuple[int, ...] | None, k_block: int, kv_step: int, return_lse: bool,
                    skip_factor: float, fresh_map: bool = False) -> None:
    """Raise ValueError unless ``tile_map`` fits :func:`fmha_v2_sage_attention`'s call (its docstring)."""
    shape = tile_map_shape(tuple(seqlens if seqlens_q is None else seqlens_q), tuple(seqlens), q.shape[1])
    if tile_map.dtype != torch.int32 or tuple(tile_map.shape) != shape or not tile_map.is_contiguous():
        raise ValueError(f"tile_map must be a contiguous int32 {list(shape)} tensor (batch, query heads, 64-row "
                         f"query tiles, 32-tile words); got {'a contiguous' if tile_map.is_contiguous() else 'a'} "
                         f"{tile_map.dtype} {list(tile_map.shape)}")
    if tile_map.device != q.device:
        raise ValueError(f"tile_map must be on {q.device}, the tensors' device; got {tile_map.device}")
    if tile_map.numel() >= 2 ** 31:
        raise ValueError(f"tile_map has {tile_map.numel()} words; the kernel addresses its rows with 32-bit offsets "
                         f"(fewer than 2^31 words): split the batch or its heads into several calls")
    if -(-max(seqlens) // SKIP_TILE[1]) > MAX_MAP_TILES:
        raise ValueError(f"a tile map's sequences have at most {MAX_MAP_TILES * SKIP_TILE[1]} keys (the kernel names "
                         f"a step's tiles in 16 bits); got {max(seqlens)}")
    if k_block != REUSE_K_BLOCK or kv_step != REUSE_KV_STEP or return_lse or (fresh_map and skip_factor <= 0):
        raise ValueError(f"a tile map runs on the kernels with k_block={REUSE_K_BLOCK}, kv_step={REUSE_KV_STEP} "
                         "and no return_lse (fresh_map, a zeroed map written: with skip_factor > 0); got "
                         f"k_block={k_block}, kv_step={kv_step}, skip_factor={skip_factor}, "
                         f"return_lse={return_lse}, fresh_map={fresh_map}")


def smoothing_shift(q: torch.Tensor, k: torch.Tensor, seqlens_q: tuple[int, ...], seqlens_kv: tuple[int, ...],
                    scale: float) -> torch.Tensor:
    """``[Tq, Hq]`` float32: each query row's ``scale · q · mean(K)``, K's mean over the row's own sequence (the
    quantizer smooths K per sequence), which smoothing took off the kernel's log-sum-exp. ``q`` ``[Tq, Hq, D]``
    and ``k`` ``[T, Hkv, D]`` ragged by the host lengths ``seqlens_q`` / ``seqlens_kv``; one pass over each."""
    shifts, start_q, start_kv = [], 0, 0
    for n_q, n_kv in zip(seqlens_q, seqlens_kv):
        k_mean = k[start_kv:start_kv + n_kv].sum(0, dtype=torch.float32) / n_kv
        shifts.append(smoothing_lse_shift(q[start_q:start_q + n_q], k_mean, scale))
        start_q, start_kv = start_q + n_q, start_kv + n_kv
    return shifts[0] if len(shifts) == 1 else torch.cat(shifts)

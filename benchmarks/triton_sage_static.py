"""The Triton SAGE attention kernel compiled for sm_90a on a machine without a GPU: ptxas's registers and spills,
and how many asynchronous global-to-shared copies Triton's software pipeliner placed (a loop whose loads it did
not pipeline has none), per kernel variant (dense / skipping, with or without a tile map).

Triton compiles to a cubin without a driver (its bundled ptxas); the launch's specializations are given as a GPU
launch would give them (pointers and the Q/K/V/out strides divisible by 16). Timing still needs the GPU.

    python benchmarks/triton_sage_static.py          # one line per variant
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from diffusers_trtllm.kernels.triton_sage import DENSE_LAUNCH, skip_launch  # noqa: E402
from diffusers_trtllm.kernels.triton_sage.attention import _sage_attention_kernel  # noqa: E402

POINTER_TYPES = {"q_ptr": "*i8", "k_ptr": "*i8", "v_t_ptr": "*fp8e4nv", "out_ptr": "*bf16", "skipped_ptr": "*i32",
                 "sample_counts_ptr": "*i32", "cu_q_ptr": "*i32", "cu_kv_ptr": "*i32", "tile_map_ptr": "*i32",
                 "reused_ptr": "*i32"}  # the rest float32; Q/K int8 (fp8 compiles alike)
DIVISIBLE = {"stride_qt", "stride_qh", "stride_kt", "stride_kh", "v_t_head_stride", "v_t_dim_stride", "stride_ot",
             "stride_oh"}


def compile_variant(skip: bool, reuse: bool, lse: bool = False):
    """The compiled kernel of the sm_90 skip tile (64 × 128, one warpgroup, the barrier vote)."""
    launch = skip_launch((DENSE_LAUNCH.block_m, DENSE_LAUNCH.block_n), (0, 0.0)) if skip else DENSE_LAUNCH
    constants = dict(QK_INT8=True, HEAD_DIM=128, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n,
                     FP8_QK_CHUNK=launch.fp8_qk_chunk, SKIP=skip, COUNT_SKIPS=skip,
                     SKIP_CHUNK=launch.skip_chunk if skip else 0,
                     BRANCH_FREE_PERCENT=round(launch.branch_free_below * 100) if skip else 0, SAMPLE_PASS=False,
                     REUSE=reuse, COUNT_REUSED=reuse, RETURN_LSE=lse, BARRIER_VOTE=True)
    names = _sage_attention_kernel.arg_names
    signature = {n: "constexpr" if n in constants else POINTER_TYPES.get(n, "*fp32") if n.endswith("_ptr")
                 else "fp32" if n in ("score_scale", "skip_factor") else "i32" for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n.endswith("_ptr") or n in DIVISIBLE}
    source = ASTSource(_sage_attention_kernel, signature, {(names.index(n),): v for n, v in constants.items()}, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=launch.num_warps, num_stages=launch.num_stages))


def ptxas_report(ptx: str) -> str:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        text = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True,
                              text=True, check=True).stderr
    registers = re.search(r"Used (\d+) registers", text).group(1)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text).groups()
    return f"{registers} registers, spills {spills[0]} B stored / {spills[1]} B loaded"


def main() -> None:
    for skip in (False, True):
        for reuse in (False, True):
            kernel = compile_variant(skip, reuse)
            copies = kernel.asm["ttgir"].count("async_copy_global_to_local")
            print(f"{'skip' if skip else 'dense':5} {'map' if reuse else 'no map':6}: {ptxas_report(kernel.asm['ptx'])}, "
                  f"{copies} async copies", flush=True)


if __name__ == "__main__":
    main()

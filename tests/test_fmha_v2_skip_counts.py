"""Skipped tiles counted by Hopper's FMHAv2 SAGE kernel (csrc/fmha_v2_patches/skip_counts.patch).

The kernel adds its skipped (64 query rows x 128 keys) tiles to a device counter; the tiles it visits follow from
the key lengths (``fmha_v2_sage.skip_tiles``). Both are the reference's counts of the kernel's semantics: on the
CPU the visited tiles at every length boundary and the call's plumbing, on an H200 the skipped tiles themselves.
"""

import os
import shutil
import subprocess
import sys

import pytest
import torch

from diffusers_trtllm.backends import run_backend, trtllm
from diffusers_trtllm.backends.base import KernelPlan, VarlenQKV
from diffusers_trtllm.backends.reference import reference_attention
from diffusers_trtllm.config import AttnQuantSpec
from diffusers_trtllm.kernels import fmha_v2_sage
from helpers import load_script, peaky_qkv

SCALE = 128 ** -0.5
FP8 = AttnQuantSpec("fp8_e4m3")


def _qkv(seqlens_q, seqlens_kv, heads_q, heads_kv, device="cpu"):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(sum(seqlens_q), heads_q, 128, generator=gen)
    k, v = (torch.randn(sum(seqlens_kv), heads_kv, 128, generator=gen) for _ in range(2))
    return VarlenQKV(*(x.bfloat16().to(device) for x in (q, k, v)), tuple(seqlens_q), tuple(seqlens_kv))


@pytest.mark.parametrize("seqlens_q,seqlens_kv", [
    ((1, 63, 64, 65, 128, 129), (1, 63, 64, 65, 128, 129)),   # one KV step, query tiles at their edges
    ((256, 257, 384, 385), (256, 257, 384, 385)),              # a last step of 1 and of 128 keys, and of 129
    ((40, 200, 1), (300, 200, 64)),                              # fewer queries than keys: zero rows count too
], ids=["one-step", "step-edges", "fewer-queries"])
def test_the_tiles_a_skipping_kernel_visits_are_the_references(monkeypatch, seqlens_q, seqlens_kv):
    """The host's tile count for the kernel equals the reference's count of the kernel's semantics (queries padded
    to the keys, 256-key steps of two 128-key tiles, a partial tile counted once)."""
    monkeypatch.setattr(trtllm, "gpu_arch", lambda device: "sm_90")
    qkv = _qkv(seqlens_q, seqlens_kv, 4, 2)
    plan = KernelPlan("TORCH_REFERENCE", SCALE, quant=FP8, skip_factor=1.0, tile=fmha_v2_sage.SKIP_TILE,
                      count_skips=True)
    assert trtllm.sage_semantics(FP8, "cpu", seqlens_q, seqlens_kv).q_padded_to_kv
    assert run_backend("TORCH_REFERENCE", qkv, plan).total_tiles == fmha_v2_sage.skip_tiles(seqlens_kv, 4)


def test_skip_tiles_at_its_edges():
    # 64 rows x 128 keys: 1 key -> 1 tile; 65 -> 2 x 1; 129 -> 3 x 2; 257 -> 5 x 3; two heads, two sequences
    assert [fmha_v2_sage.skip_tiles((n,), 1) for n in (1, 64, 65, 128, 129, 256, 257)] == [1, 1, 2, 2, 6, 8, 15]
    assert fmha_v2_sage.skip_tiles((129, 257), 2) == 2 * (6 + 15)


def _fake_kernel(monkeypatch, skipped):
    seen = {}

    def fake(q, k, v, cu_seqlens, seqlens, scale, skip_counts=None, **kwargs):
        seen["skip_counts"] = skip_counts
        if skip_counts is not None:
            skip_counts += skipped
        return torch.zeros_like(q)

    monkeypatch.setattr(trtllm, "gpu_arch", lambda device: "sm_90")
    monkeypatch.setattr(trtllm.fmha_v2_sage, "fmha_v2_sage_attention", fake)
    return seen


@pytest.mark.parametrize("skip_factor,count_skips,counted", [(7.0, True, True), (7.0, False, False),
                                                              (0.0, True, False)],
                         ids=["asked", "not-asked", "not-skipping"])
def test_the_hopper_sage_call_reports_the_kernels_count_only_when_it_skips_and_was_asked(
        monkeypatch, skip_factor, count_skips, counted):
    seen = _fake_kernel(monkeypatch, skipped=5)
    qkv = _qkv((100, 150), (164, 300), 4, 2)
    result = trtllm._run_hopper_sage(qkv, KernelPlan("TRTLLM_ATTN", SCALE, quant=FP8, skip_factor=skip_factor,
                                                     count_skips=count_skips))
    if counted:
        assert seen["skip_counts"].dtype == torch.int32 and seen["skip_counts"].shape == (1,)
        assert int(result.skipped_tiles) == 5 and result.total_tiles == fmha_v2_sage.skip_tiles((164, 300), 4)
    else:
        assert seen["skip_counts"] is None and result.skipped_tiles is None and result.total_tiles is None


@pytest.mark.parametrize("counts", [torch.zeros(2, dtype=torch.int32), torch.zeros(1, dtype=torch.int64),
                                    torch.zeros((), dtype=torch.int32)], ids=["two", "int64", "0-dim"])
def test_skip_counts_of_another_shape_or_dtype_are_refused_before_any_work(counts):
    q = torch.zeros(64, 1, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"skip_counts must be an int32 \[1\] tensor on cpu; got torch\."):
        fmha_v2_sage.fmha_v2_sage_attention(q, q, q, torch.tensor([0, 64], dtype=torch.int32), (64,), SCALE,
                                            skip_factor=1.0, skip_counts=counts)


# ---------------------------------------------------------------- GPU: the kernel's count




@pytest.mark.gpu
@pytest.mark.parametrize("k_block,kv_step", [(0, 256), (64, 256), (0, 128)])
@pytest.mark.parametrize("seqlens_q,seqlens_kv", [
    ((1100, 300, 2112, 200), (1100, 300, 2112, 200)),   # last steps of 76, 44, 64 (+ 256 x 8) and 200 keys
    ((600, 1000), (1700, 1000)),                          # fewer queries than keys
], ids=["self", "fewer-queries"])
def test_gpu_the_kernels_skipped_tiles_are_the_references(k_block, kv_step, seqlens_q, seqlens_kv):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    qkv = peaky_qkv(seqlens_q, seqlens_kv, 8, 2)
    skip_factor = 300.0
    counts = torch.zeros(1, dtype=torch.int32, device="cuda")
    fmha_v2_sage.fmha_v2_sage_attention(qkv.q, qkv.k, qkv.v, qkv.cu_seqlens("kv"), seqlens_kv, SCALE,
                                        cu_seqlens_q=qkv.cu_seqlens("q"), seqlens_q=seqlens_q, k_block=k_block,
                                        kv_step=kv_step, skip_factor=skip_factor, skip_counts=counts)
    semantics = trtllm.fmha_v2_sage_semantics(k_block, kv_step)
    skipped = total = 0
    for (q, k, v, _), n_kv in zip(qkv.sequences(), seqlens_kv):
        _, s, t = reference_attention(q, k, v, SCALE, skip_lambda=skip_factor / n_kv, quant=semantics,
                                      tile=fmha_v2_sage.SKIP_TILE, kv_step=kv_step)
        skipped, total = skipped + int(s), total + t
    assert total == fmha_v2_sage.skip_tiles(seqlens_kv, 8)
    assert 0.1 < skipped / total < 0.9  # the data skips some tiles and keeps others
    # the reference emulates sm_90's fp8 sums, so every decision is the kernel's: the counts agree exactly
    assert int(counts.item()) == skipped


# ---------------------------------------------------------------- CPU: the kernels' static report


def test_the_static_report_compiles_each_kernel_as_the_build_does_with_ptxas_reporting(monkeypatch):
    if shutil.which("ninja") is None:
        pytest.skip("ninja is not installed")
    if shutil.which("nvcc") is None and not os.path.exists("/usr/local/cuda"):
        pytest.skip("no CUDA toolkit: FlashInfer writes its build file from nvcc's version")
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    commands = load_script("benchmarks/sage_kernel_static.py").compile_commands(fmha_v2_sage.jit_spec())
    assert len(commands) == len(fmha_v2_sage.sage_kernels())
    for kernel, argv in commands:
        assert argv[-2:] == ["-Xptxas", "-v"] and "-gencode=arch=compute_90a,code=sm_90a" in argv
        assert "-DSKIP_SOFTMAX_STAT" in argv and "-Xfatbin=-compress-all" not in argv
        assert argv[argv.index("-c") + 1].endswith(f"{kernel}.cu") and argv[argv.index("-o") + 1].endswith(".o")


def test_the_static_report_without_nvcc_says_so_in_one_line(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "benchmarks/sage_kernel_static.py"], capture_output=True, text=True,
                          env=env)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("sage_kernel_static: nvcc, ninja not found on PATH")

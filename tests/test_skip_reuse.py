"""Skip decisions reused across steps (issue 47): the plumbing, on the CPU.

TRTLLM_ATTN runs a plan with a map on its FMHAv2 SAGE kernel only (tests/test_fmha_v2_reuse.py); any other plan
is refused, naming what runs reuse. The benchmark's arguments are checked without a GPU.
"""

import subprocess
import sys

import pytest
import torch

from diffusers_trtllm.backends import trtllm
from diffusers_trtllm.backends.base import KernelPlan, KernelResult, VarlenQKV
from diffusers_trtllm.errors import BackendUnavailableError
from helpers import load_script


def test_a_bf16_plan_with_a_tile_map_is_refused_naming_what_reuses_maps(monkeypatch):
    monkeypatch.setattr(trtllm, "gpu_arch", lambda device: "sm_90")
    qkv = VarlenQKV(*(torch.zeros(256, 2, 128, dtype=torch.bfloat16) for _ in range(3)), (256,), (256,))
    plan = KernelPlan("TRTLLM_ATTN", 0.1, skip_factor=5.0, reuse=True)
    assert "FMHAv2 SAGE kernel only" in trtllm.unavailable_reason(plan, qkv)
    with pytest.raises(BackendUnavailableError, match="reuse_steps"):
        trtllm.run(qkv, plan)
    assert KernelResult(torch.zeros(1)).reused_tiles is None


def test_the_benchmark_checks_its_arguments_without_a_gpu():
    proc = subprocess.run([sys.executable, "benchmarks/skip_reuse.py", "--seq", "16384", "--dry-run"],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and "16384 tokens × 40 heads × 128, 1310720 tiles" in proc.stdout, proc.stderr
    bench = load_script("benchmarks/skip_reuse.py")
    with pytest.raises(SystemExit):
        bench.parse(["--sparsity", "1.5"])
    assert bench.tiles(75_600, 40) == 40 * 1182 * 591
    assert abs(bench.zero_fraction(75_600) - 0.25) < 0.01  # DESIGN.md §7: a quarter of the tiles at 0

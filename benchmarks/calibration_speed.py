"""Calibrated Skip-Softmax at the Wan 2.2 720p shape: predicted sparsity (reference) vs kernel speed vs dense.

Peaky synthetic attention (tokens on a line with smooth positional features, as in the H200 probes) at
75,600 tokens × 40 heads × head_dim 128. A curve factor = a·exp(b·s) is calibrated with the reference counting
(``diffusers_trtllm.calibration.skip_gaps``, 128 × 128 tiles, exact for λ <= 1) on a subset of heads and
evenly spread query tiles (rows are independent, so a tile subset is counted exactly; the KV side is complete).
Synthetic attention local along one axis caps near 50% sparsity (KV tiles before the diagonal never fall
below the running max), so targets above the observed range are marked extrapolated. Then for each target sparsity: factor -> λ = factor / kv_len, the reference's predicted sparsity at that λ (on the
subset), and the time of ``run_backend(backend, qkv, plan)`` with that factor against the same backend dense,
with the output's relative error to dense. One table is printed; everything goes to ``$OUT/calibration_speed.json``.

GPU (H100/H200 run FMHAv2, JIT-built on first use, ~90 s; B200/B300 trtllm-gen)::

    python benchmarks/calibration_speed.py

CPU check at a tiny shape (TORCH_REFERENCE stands in for the kernel; its "speed" is not a kernel's)::

    python benchmarks/calibration_speed.py --tiny
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch

from diffusers_trtllm.backends import run_backend
from diffusers_trtllm.backends.base import KernelPlan, VarlenQKV
from diffusers_trtllm.calibration import count_skips, fit_curve, skip_gaps

TILE = (128, 128)


def peaky(tokens: int, heads: int, head_dim: int, sharp: float, device: str, dtype: torch.dtype, seed: int):
    """q, k, v ``[tokens, heads, head_dim]``: smooth positional features plus noise, so each query attends to
    its neighbourhood (sharper with ``sharp``)."""
    gen = torch.Generator(device).manual_seed(seed)
    pos = torch.arange(tokens, device=device, dtype=torch.float32)[:, None]
    freqs = torch.logspace(-4, -0.5, head_dim // 2, device=device)[None, :]
    base = torch.cat([torch.sin(pos * freqs), torch.cos(pos * freqs)], dim=1)[:, None, :].expand(tokens, heads,
                                                                                                 head_dim)

    def noise():
        return torch.randn(tokens, heads, head_dim, device=device, generator=gen) * 0.3

    q = (base + noise()) * sharp
    k = (base + noise()) * sharp
    v = torch.randn(tokens, heads, head_dim, device=device, generator=gen)
    return [t.to(dtype).contiguous() for t in (q, k, v)]


def calibration_gaps(q, k, scale: float, heads: int, query_tiles: int) -> torch.Tensor:
    """Reference gaps on the first ``heads`` heads and ``query_tiles`` evenly spread query tiles."""
    n_tiles = -(-q.shape[0] // TILE[0])
    picked = np.unique(np.linspace(0, n_tiles - 1, min(query_tiles, n_tiles)).round().astype(int))
    rows = torch.cat([torch.arange(t * TILE[0], min((t + 1) * TILE[0], q.shape[0]), device=q.device)
                      for t in picked])
    return skip_gaps(q[rows, :heads], k[:, :heads], scale, tile=TILE)


def timed(backend: str, qkv: VarlenQKV, plan: KernelPlan, repeats: int) -> tuple[float, torch.Tensor]:
    """Median seconds of ``repeats`` calls after one warm-up call, and the output."""
    out = run_backend(backend, qkv, plan).out
    times = []
    for _ in range(repeats):
        if qkv.q.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = run_backend(backend, qkv, plan).out
        if qkv.q.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return float(np.median(times)), out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU check: 2,048 tokens, 2 heads, TORCH_REFERENCE")
    parser.add_argument("--tokens", type=int, default=75_600)
    parser.add_argument("--heads", type=int, default=40)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--sharp", type=float, default=1.5, help="peakiness of the synthetic attention")
    parser.add_argument("--calib-heads", type=int, default=4)
    parser.add_argument("--calib-query-tiles", type=int, default=64)
    parser.add_argument("--targets", type=float, nargs="+", default=[0.2, 0.3, 0.4, 0.5, 0.6])
    parser.add_argument("--backend", default="TRTLLM_ATTN")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    args = parser.parse_args(argv)
    if args.tiny:
        args.tokens, args.heads, args.backend, args.repeats = 2048, 2, "TORCH_REFERENCE", 1
        args.calib_heads = min(args.calib_heads, args.heads)
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32

    q, k, v = peaky(args.tokens, args.heads, args.head_dim, args.sharp, device, dtype, args.seed)
    scale = args.head_dim ** -0.5
    kv_len = args.tokens
    start = time.perf_counter()
    gaps = calibration_gaps(q, k, scale, args.calib_heads, args.calib_query_tiles)
    lambdas = np.geomspace(1e-6, 1.0, 49)
    sparsity = (count_skips(gaps, lambdas).double() / gaps.numel()).tolist()
    points = [{"lambda": float(lam), "kv_len": kv_len, "factor": float(lam) * kv_len, "sparsity": s}
              for lam, s in zip(lambdas, sparsity)]
    a, b, r_squared, points = fit_curve(points, component="synthetic")
    calibration_s = time.perf_counter() - start
    used = [p["sparsity"] for p in points if p["used"]]

    qkv = VarlenQKV.from_bshd(q[None], k[None], v[None])
    dense_s, dense_out = timed(args.backend, qkv, KernelPlan(backend=args.backend, scale=scale), args.repeats)
    rows = []
    for target in args.targets:
        factor = a * math.exp(b * target)
        lam = factor / kv_len
        # λ > 1 is counted at λ = 1 (the one-pass count is exact up to 1): a lower bound there
        predicted = int(count_skips(gaps, [min(lam, 1.0)])[0]) / gaps.numel()
        seconds, out = timed(args.backend, qkv, KernelPlan(backend=args.backend, scale=scale, skip_factor=factor),
                             args.repeats)
        rel_err = ((out.float() - dense_out.float()).norm() / dense_out.float().norm()).item()
        rows.append({"target_sparsity": target, "factor": factor, "lambda": lam, "predicted_sparsity": predicted,
                     "extrapolated": not min(used) <= target <= max(used), "ms": seconds * 1e3,
                     "dense_ms": dense_s * 1e3, "speedup": dense_s / seconds, "rel_err_vs_dense": rel_err})

    print(f"{args.tokens} tokens × {args.heads} heads × hd{args.head_dim}, {dtype}, {args.backend} on "
          f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}; calibrated on {args.calib_heads} heads × "
          f"{gaps.shape[1]} query tiles in {calibration_s:.1f} s: a={a:.4g}, b={b:.4g}, R²={r_squared:.3f}, "
          f"observed sparsity {min(used):.3f}–{max(used):.3f}; dense {dense_s * 1e3:.2f} ms")
    print("| target | factor | λ | predicted sparsity (reference) | ms | dense ms | speedup | rel. err vs dense |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        flag = (" (extrapolated)" if r["extrapolated"] else "") + (" (λ ≥ 1)" if r["lambda"] >= 1 else "")
        print(f"| {r['target_sparsity']:.2f}{flag} | {r['factor']:.4g} | {r['lambda']:.3g} | "
              f"{r['predicted_sparsity']:.3f} | {r['ms']:.2f} | {r['dense_ms']:.2f} | {r['speedup']:.2f}× | "
              f"{r['rel_err_vs_dense']:.2e} |")
    report = {"shape": {"tokens": args.tokens, "heads": args.heads, "head_dim": args.head_dim, "dtype": str(dtype),
                        "sharp": args.sharp}, "backend": args.backend, "device": device,
              "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
              "fit": {"a": a, "b": b, "r_squared": r_squared, "observed_sparsity": [min(used), max(used)],
                      "calib_heads": args.calib_heads, "calib_query_tiles": int(gaps.shape[1]),
                      "seconds": calibration_s},
              "points": points, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "calibration_speed.json").write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()

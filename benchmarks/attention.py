"""Attention kernels at the video shapes on one GPU, one process: speed, error, and the reference's sparsity.

Rows, per shape and data set (``benchmarks/data.py`` says how the data is made):

- cuDNN SDPA and SDPA flash (PyTorch's ``scaled_dot_product_attention`` with the backend forced);
- TRTLLM_ATTN Skip-Softmax at each λ (factor = λ × kv_len), through this package's backend, and its λ = 0 row
  (the plain ``TRTLLM_ATTN`` route: FMHAv2 bf16 on Hopper, the skip rows' kernel; a planned dense site on
  Hopper runs the install-time dense kernel instead, which ``hopper_sage.py --sections table,shapes`` times);
- with each skip row, the sparsity the reference backend (``TORCH_REFERENCE``, 128 × 128 tiles) achieves at the
  same λ, computed on the GPU for a subset (``--ref-heads`` heads × ``--ref-rows`` query rows from the middle of
  the sequence, against all keys), and the kernel's difference from the reference on that subset;
- TRTLLM_ATTN SAGE (int8, fp8) when ``diffusers_trtllm.kernels.triton_sage`` exists, and SageAttention 1.0.6
  when ``sageattention`` is importable;
- "shape proofs": FMHAv2 called directly on the shapes TRTLLM_ATTN refuses on Hopper (queries ≠ keys), against
  cuDNN, to show what the refusal rests on.

TFLOP/s counts the dense work, 4·Sq·Skv·D·H, for every row (so skip rows show effective throughput).

    python benchmarks/attention.py                       # Wan 2.2 and HunyuanVideo 1.5 shapes, random + peaky
    python benchmarks/attention.py --qkv wan_attn1.pt    # replay q/k/v saved by benchmarks/data.save_qkv

Prints a markdown table and writes JSON to ``--json`` (default ``$OUT/attention.json`` or ``./attention.json``).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import logging
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.data import load_qkv, peaky_qkv, random_qkv  # noqa: E402
from diffusers_trtllm.backends import trtllm  # noqa: E402
from diffusers_trtllm.backends.base import KernelPlan, VarlenQKV  # noqa: E402
from diffusers_trtllm.backends.reference import reference_attention  # noqa: E402
from diffusers_trtllm.config import TRTLLM_ATTN, AttnQuantSpec  # noqa: E402
from diffusers_trtllm.kernels import flashinfer_fmha  # noqa: E402
from diffusers_trtllm.kernels.flashinfer_calls import fmha_v2_call  # noqa: E402
from diffusers_trtllm.platform import flashinfer_version  # noqa: E402

SHAPES = {"wan": (75600, 40), "hunyuan": (77585, 16)}  # Wan 2.2 720p/81 f self-attention; HunyuanVideo 1.5 joint
DEFAULT_LAMBDAS = (1e-6, 1e-3, 0.01, 0.066, 0.2, 0.65)
HEAD_DIM = 128
SCALE = HEAD_DIM ** -0.5
# (queries, keys, query heads, key heads): Cosmos 3's generation stream and its variants, and cross-attention
PROOF_SHAPES = ((19320, 19920, 32, 8), (19320, 19920, 32, 32), (19920, 19920, 32, 8), (4096, 4696, 8, 8),
                (75600, 512, 40, 40))


def bench_ms(fn, rep_ms: int) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def sdpa(q, k, v, backend: SDPBackend) -> torch.Tensor:
    """``[S, H, D]`` in and out; GQA by repeating k/v heads (cuDNN's own GQA support varies by version)."""
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                             scale=SCALE)
    return out[0].transpose(0, 1)


def reference_subset(q, k, v, lam: float, kernel_out: torch.Tensor, heads: int, rows: int) -> tuple[float, float]:
    """(achieved sparsity, kernel vs reference rel. err.) on ``heads`` heads × ``rows`` query rows.

    The rows start at a multiple of 128 so the reference's query tiles are the kernel's; every KV tile is visited
    in order, so the skip decisions for those tiles are exactly the full problem's."""
    s, h = q.shape[:2]
    head_idx = torch.linspace(0, h - 1, heads, device=q.device).round().long().unique()
    start = (s // 2) // 128 * 128
    rows = min(rows, s - start)
    sl = slice(start, start + rows)
    out, skipped, total = reference_attention(q[sl][:, head_idx], k[:, head_idx], v[:, head_idx], SCALE,
                                              skip_lambda=lam, tile=(128, 128))
    return skipped / total, rel_err(kernel_out[sl][:, head_idx], out)


def kernel_rows(name: str, q, k, v, args, table: list, env: dict) -> None:
    s, h = q.shape[:2]
    flops = 4 * s * s * HEAD_DIM * h
    qkv = VarlenQKV(q, k, v, (s,), (s,))

    def add(kernel, ms, out, lam=None, **extra):
        row = dict(case=name, tokens=s, heads=h, kernel=kernel, lam=lam, factor=None if lam is None else lam * s,
                   ms=ms, tflops=flops / ms / 1e9, rel_err_vs_cudnn=rel_err(out, cudnn_out) if out is not None else None,
                   **extra)
        table.append(row)
        print(json.dumps(row), flush=True)

    cudnn_out = sdpa(q, k, v, SDPBackend.CUDNN_ATTENTION)
    cudnn_ms = bench_ms(lambda: sdpa(q, k, v, SDPBackend.CUDNN_ATTENTION), args.rep_ms)
    add("cuDNN SDPA", cudnn_ms, cudnn_out)
    flash = sdpa(q, k, v, SDPBackend.FLASH_ATTENTION)
    add("SDPA flash", bench_ms(lambda: sdpa(q, k, v, SDPBackend.FLASH_ATTENTION), args.rep_ms), flash)
    del flash

    dense_plan = KernelPlan(TRTLLM_ATTN, SCALE)
    reason = trtllm.unavailable_reason(dense_plan, qkv)
    if reason:
        env.setdefault("refused", []).append(f"{name} dense: {reason}")
        return
    dense_out = trtllm.run(qkv, dense_plan).out
    dense_ms = bench_ms(lambda: trtllm.run(qkv, dense_plan), args.rep_ms)
    # cuDNN once more after the TRTLLM rows' neighbour, so the dense comparison is not one measurement's luck
    cudnn_again = bench_ms(lambda: sdpa(q, k, v, SDPBackend.CUDNN_ATTENTION), args.rep_ms)
    sparsity, parity = reference_subset(q, k, v, 0.0, dense_out, args.ref_heads, args.ref_rows)
    add("TRTLLM_ATTN skip, λ = 0", dense_ms, dense_out, ref_sparsity=sparsity, kernel_vs_ref=parity,
        cudnn_ms_again=cudnn_again, speed_vs_cudnn=(cudnn_ms + cudnn_again) / 2 / dense_ms)

    for lam in args.lambdas:
        plan = KernelPlan(TRTLLM_ATTN, SCALE, skip_factor=lam * s)
        out = trtllm.run(qkv, plan).out
        ms = bench_ms(lambda: trtllm.run(qkv, plan), args.rep_ms)
        sparsity, parity = reference_subset(q, k, v, lam, out, args.ref_heads, args.ref_rows)
        add("TRTLLM_ATTN skip", ms, out, lam=lam, rel_err_vs_dense=rel_err(out, dense_out), ref_sparsity=sparsity, kernel_vs_ref=parity)
        del out

    for dtype_qk in ("int8", "fp8_e4m3"):
        plan = KernelPlan(TRTLLM_ATTN, SCALE, quant=AttnQuantSpec(dtype_qk=dtype_qk))
        reason = trtllm.unavailable_reason(plan, qkv)
        if reason:
            env.setdefault("refused", []).append(f"{name} sage {dtype_qk}: {reason}")
            continue
        try:  # the Triton SAGE kernel is another issue's work in progress: record its failure, keep going
            out = trtllm.run(qkv, plan).out
            add(f"TRTLLM_ATTN SAGE {dtype_qk}", bench_ms(lambda: trtllm.run(qkv, plan), args.rep_ms), out,
                rel_err_vs_dense=rel_err(out, dense_out))
            del out
        except Exception as exc:  # noqa: BLE001
            env.setdefault("errors", []).append(f"{name} TRTLLM_ATTN SAGE {dtype_qk}: {exc!r}")

    if importlib.util.find_spec("sageattention") is not None:
        try:  # a third-party comparison: its failure is a finding, not a reason to lose the other rows
            from sageattention import sageattn

            def sage1():
                return sageattn(q[None], k[None], v[None], tensor_layout="NHD", is_causal=False, sm_scale=SCALE)[0]

            out = sage1()
            add("SageAttention 1.0.6", bench_ms(sage1, args.rep_ms), out, rel_err_vs_dense=rel_err(out, dense_out))
            del out
        except Exception as exc:  # noqa: BLE001
            env.setdefault("errors", []).append(f"{name} SageAttention 1.0.6: {exc!r}")
    for row in table:
        if row["case"] == name:
            row["speedup_vs_dense"] = dense_ms / row["ms"]


def shape_proofs(table: list) -> None:
    """FMHAv2 directly (bypassing the backend's refusal) on shapes with unequal query and key lengths."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    for sq, skv, hq, hkv in PROOF_SHAPES:
        q = torch.randn(sq, hq, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(skv, hkv, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in "kv")
        index = flashinfer_fmha.ragged_index((sq,), (skv,), torch.device("cuda", torch.cuda.current_device()))
        call = fmha_v2_call(q, k, v, flashinfer_fmha.workspace(q.device), index, SCALE, 0.0)
        out = call(flashinfer_fmha.flashinfer_prefill())
        ref = sdpa(q, k, v, SDPBackend.CUDNN_ATTENTION)
        row = dict(queries=sq, keys=skv, heads_q=hq, heads_kv=hkv, fmha_v2_rel_err_vs_cudnn=rel_err(out, ref),
                   fmha_v2_ms=bench_ms(lambda: call(flashinfer_fmha.flashinfer_prefill()), 300),
                   cudnn_ms=bench_ms(lambda: sdpa(q, k, v, SDPBackend.CUDNN_ATTENTION), 300),
                   trtllm_attn_check=trtllm.unavailable_reason(KernelPlan(TRTLLM_ATTN, SCALE),
                                                               VarlenQKV(q, k, v, (sq,), (skv,))))
        table.append(row)
        print(json.dumps(row), flush=True)


def markdown(rows: list) -> str:
    head = ("| case | kernel | λ | ms | TFLOP/s | speed ÷ TRTLLM λ = 0 | rel. err. vs cuDNN "
            "| rel. err. vs TRTLLM λ = 0 | reference sparsity | kernel vs reference |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def f(x, fmt):
        return "" if x is None else format(x, fmt)

    for r in rows:
        lines.append(f"| {r['case']} | {r['kernel']} | {f(r['lam'], 'g')} | {r['ms']:.2f} | {r['tflops']:.0f} | "
                     f"{f(r.get('speedup_vs_dense'), '.3f')} | {f(r['rel_err_vs_cudnn'], '.1e')} | "
                     f"{f(r.get('rel_err_vs_dense'), '.1e')} | {f(r.get('ref_sparsity'), '.3f')} | "
                     f"{f(r.get('kernel_vs_ref'), '.1e')} |")
    return "\n".join(lines)


def proofs_markdown(rows: list) -> str:
    lines = ["| queries | keys | heads q/kv | FMHAv2 rel. err. vs cuDNN | FMHAv2 ms | cuDNN ms | TRTLLM_ATTN check |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['queries']} | {r['keys']} | {r['heads_q']}/{r['heads_kv']} | "
                     f"{r['fmha_v2_rel_err_vs_cudnn']:.1e} | {r['fmha_v2_ms']:.2f} | {r['cudnn_ms']:.2f} | "
                     f"{'accepted' if r['trtllm_attn_check'] is None else 'refused'} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="wan,hunyuan", help=f"comma-separated of {list(SHAPES)}")
    parser.add_argument("--data", default="random,peaky", help="comma-separated of random, peaky")
    parser.add_argument("--sharpness", type=float, default=3.0, help="peaky data's sharpness")
    parser.add_argument("--lambdas", type=lambda s: [float(x) for x in s.split(",")], default=list(DEFAULT_LAMBDAS))
    parser.add_argument("--qkv", help="replay q/k/v saved with benchmarks.data.save_qkv (adds a 'replay' case)")
    parser.add_argument("--rep-ms", type=int, default=1500, help="do_bench repetition time per row")
    parser.add_argument("--ref-heads", type=int, default=2)
    parser.add_argument("--ref-rows", type=int, default=2048)
    parser.add_argument("--no-proofs", action="store_true", help="skip the FMHAv2 shape proofs")
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "attention.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    env = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               cuda=torch.version.cuda, flashinfer=flashinfer_version(), python=platform.python_version(),
               command=" ".join(["python"] + sys.argv), sharpness=args.sharpness)
    start = time.perf_counter()
    env["warmup_s"] = trtllm.warmup()
    table: list = []
    proofs: list = []

    def write():  # after every case, so a crash keeps what was measured
        with open(args.json, "w") as fh:
            json.dump(dict(env=env, rows=table, shape_proofs=proofs), fh, indent=1)

    cases = []
    for shape in args.shapes.split(","):
        tokens, heads = SHAPES[shape]
        for data in args.data.split(","):
            cases.append((f"{shape} {data}", shape, data, tokens, heads))
    if args.qkv:
        cases.append((f"replay {os.path.basename(args.qkv)}", None, "replay", None, None))
    for name, shape, data, tokens, heads in cases:
        if data == "random":
            q, k, v = random_qkv(tokens, heads)
        elif data == "peaky":
            q, k, v = peaky_qkv(tokens, heads, sharpness=args.sharpness)
        else:
            q, k, v = load_qkv(args.qkv)
        kernel_rows(name, q, k, v, args, table, env)
        del q, k, v
        torch.cuda.empty_cache()
        write()
    if not args.no_proofs:
        shape_proofs(proofs)
    env["seconds"] = time.perf_counter() - start
    write()
    print(json.dumps(env, indent=1))
    print(markdown(table))
    if proofs:
        print()
        print(proofs_markdown(proofs))


if __name__ == "__main__":
    main()

"""The Triton SAGE kernel (``diffusers_trtllm.kernels.triton_sage``) on one GPU, in one process.

1. Tile-shape sweep of the attention kernel (dense, fp8, S = 16,384 × 40 heads).
2. Speed at Wan 2.2's self-attention shape (75,600 tokens, 40 heads, hd 128, batch 1, bf16 in and out):
   cuDNN SDPA, SDPA flash, SageAttention 1.0.6 (when importable) and this kernel in int8 and fp8, with the time
   split into the quantization launches and the attention launch. TFLOP/s counts 4·S²·D·H.
3. Skip-Softmax inside SAGE on peaky data at the Wan shape: speed-up over the same kernel without skipping
   against the sparsity the kernel counted, at several λ, with 128 × 128 skip tiles (the calibrated shape) and
   64 × 128 (the fastest dense kernel shape).
4. Accuracy at S = 8,192 × 8 heads on random and peaky data, every dtype × Q block × K block: relative error
   against a float32 reference of exact attention, and against the float32 PyTorch reference of the same SAGE
   semantics (backends/reference.py), which the kernel should match to the bf16 output rounding.

    python benchmarks/sage.py          # writes $OUT/sage.json and $OUT/sage.md (or ./ without $OUT)
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.data import peaky_qkv, random_qkv  # noqa: E402
from diffusers_trtllm.backends.base import KernelPlan, VarlenQKV  # noqa: E402
from diffusers_trtllm.backends.reference import reference_attention  # noqa: E402
from diffusers_trtllm.config import AttnQuantSpec  # noqa: E402
from diffusers_trtllm.kernels import triton_sage as ts  # noqa: E402
from diffusers_trtllm.quant import SageSemantics  # noqa: E402

OUT = os.environ.get("OUT", ".")
WAN = (75600, 40)  # (tokens, heads)
SWEEP_SHAPE = (16384, 40)
ACCURACY_SHAPE = (8192, 8)
SCALE = 128 ** -0.5
SWEEP = [ts.AttentionLaunch(128, 128, 8, 3), ts.AttentionLaunch(64, 128, 4, 2), ts.AttentionLaunch(64, 128, 4, 3),
         ts.AttentionLaunch(64, 128, 4, 4), ts.AttentionLaunch(64, 64, 4, 3),
         ts.AttentionLaunch(64, 128, 4, 3, fp8_qk_chunk=64), ts.AttentionLaunch(64, 128, 4, 3, fp8_qk_chunk=32)]
SKIP_TILES = ((128, 128), (64, 128))
SKIP_LAMBDAS = (0.001, 0.01, 0.03, 0.1, 0.3)
PEAKY_SHARPNESS = 3.0
BLOCKS = [(qb, kb) for qb in (1, 4, 16) for kb in (1, 4, 16)]
results: dict = {"rows": []}


def quantize(qkv: VarlenQKV, quant: AttnQuantSpec) -> ts.SageQuantized:
    return ts.sage_quantize(qkv.q, qkv.k, qkv.v, qkv.cu_seqlens("q"), qkv.cu_seqlens("kv"), qkv.max_seqlen_q,
                            qkv.max_seqlen_kv, dtype_qk=quant.dtype_qk, q_block=quant.q_block_size,
                            k_block=quant.k_block_size)


def attend(qkv: VarlenQKV, z: ts.SageQuantized, plan: KernelPlan, launch=None):
    """``(out, skipped, total)`` of the attention launch on already-quantized inputs."""
    return ts.sage_attention_quantized(z, qkv.cu_seqlens("q"), qkv.cu_seqlens("kv"), qkv.seqlens_q, qkv.seqlens_kv,
                                       plan.scale, skip_factor=plan.skip_factor, skip_tile=plan.tile,
                                       count_skips=plan.count_skips, launch=launch)


def semantics(quant: AttnQuantSpec) -> SageSemantics:
    return SageSemantics(quant.dtype_qk, quant.q_block_size, quant.k_block_size)


def log(section: str, **row) -> None:
    row["section"] = section
    results["rows"].append(row)
    print(json.dumps(row), flush=True)
    with open(os.path.join(OUT, "sage.json"), "w") as f:  # rewritten each row: a timeout keeps what was measured
        json.dump(results, f, indent=1)


def bench_ms(fn, rep_ms: int = 1500) -> float:
    return triton.testing.do_bench(fn, warmup=300, rep=rep_ms, return_mode="median")


def tflops(seq: int, heads: int, ms: float) -> float:
    return 4 * seq * seq * 128 * heads / ms / 1e9


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def sdpa(q, k, v, backend: SDPBackend) -> torch.Tensor:
    """``[S, H, D]`` in and out."""
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(*(x.transpose(0, 1)[None] for x in (q, k, v)), scale=SCALE)
    return out[0].transpose(0, 1)


def sage_plan(dtype: str, q_block: int = 1, k_block: int = 16, skip_factor: float = 0.0, count: bool = False,
              tile: tuple[int, int] = (128, 128)):
    return KernelPlan("triton_sage", SCALE, quant=AttnQuantSpec(dtype, q_block, k_block), skip_factor=skip_factor,
                      count_skips=count, tile=tile)


def sweep() -> dict:
    seq, heads = SWEEP_SHAPE
    qkv = VarlenQKV.from_bshd(*(x[None] for x in random_qkv(seq, heads)))
    best = {}
    for dtype in ("fp8_e4m3", "int8"):
        plan = sage_plan(dtype)
        z = quantize(qkv, plan.quant)
        for launch in SWEEP if dtype == "fp8_e4m3" else [best["fp8_e4m3"][1]]:
            try:
                ms = bench_ms(lambda: attend(qkv, z, plan, launch), 800)
            except Exception as e:  # a shape that does not compile (shared memory, registers) is reported, not fatal
                log("sweep", dtype=dtype, launch=launch.__dict__, error=repr(e)[:300])
                continue
            log("sweep", dtype=dtype, seq=seq, heads=heads, launch=launch.__dict__, ms=ms,
                tflops=tflops(seq, heads, ms))
            if launch.fp8_qk_chunk == ts.DENSE_LAUNCH.fp8_qk_chunk and (dtype not in best or ms < best[dtype][0]):
                best[dtype] = (ms, launch)
    return {dtype: launch for dtype, (_, launch) in best.items()}


def wan_speed(best: dict) -> None:
    seq, heads = WAN
    q, k, v = random_qkv(seq, heads)
    qkv = VarlenQKV(q, k, v, (seq,), (seq,))
    cudnn = sdpa(q, k, v, SDPBackend.CUDNN_ATTENTION)

    def row(kernel, ms, out, **extra):
        log("wan", kernel=kernel, ms=ms, tflops=tflops(seq, heads, ms), rel_err_vs_cudnn=rel_err(out, cudnn), **extra)

    row("cuDNN SDPA", bench_ms(lambda: sdpa(q, k, v, SDPBackend.CUDNN_ATTENTION)), cudnn)
    row("SDPA flash", bench_ms(lambda: sdpa(q, k, v, SDPBackend.FLASH_ATTENTION)),
        sdpa(q, k, v, SDPBackend.FLASH_ATTENTION))
    try:
        from sageattention import sageattn
        hnd = [x.transpose(0, 1)[None] for x in (q, k, v)]
        run = lambda: sageattn(*hnd, tensor_layout="HND", is_causal=False)  # noqa: E731
        row("SageAttention 1.0.6 (Triton, int8 QK, fp16 PV)", bench_ms(run), run()[0].transpose(0, 1))
    except Exception as e:
        log("wan", kernel="SageAttention 1.0.6", error=repr(e)[:300])
    for dtype in ("int8", "fp8_e4m3"):
        plan = sage_plan(dtype)
        launch = best.get(dtype, ts.DENSE_LAUNCH)
        z = quantize(qkv, plan.quant)
        quant_ms = bench_ms(lambda: quantize(qkv, plan.quant))
        attn_ms = bench_ms(lambda: attend(qkv, z, plan, launch))
        out = attend(qkv, z, plan, launch)[0]
        total_ms = bench_ms(lambda: attend(qkv, quantize(qkv, plan.quant), plan, launch))
        row(f"Triton SAGE {dtype} q1/k16 (quantize + attention)", total_ms, out, quantize_ms=quant_ms,
            attention_ms=attn_ms, attention_tflops=tflops(seq, heads, attn_ms), launch=launch.__dict__)
    del q, k, v, cudnn


def skip_table(best: dict) -> None:
    seq, heads = WAN
    q, k, v = peaky_qkv(seq, heads, sharpness=PEAKY_SHARPNESS)
    qkv = VarlenQKV(q, k, v, (seq,), (seq,))
    cudnn = sdpa(q, k, v, SDPBackend.CUDNN_ATTENTION)
    cudnn_ms = bench_ms(lambda: sdpa(q, k, v, SDPBackend.CUDNN_ATTENTION))
    for dtype in ("int8", "fp8_e4m3"):
        dense_plan = sage_plan(dtype)
        z = quantize(qkv, dense_plan.quant)
        dense_launch = best.get(dtype, ts.DENSE_LAUNCH)
        dense_ms = bench_ms(lambda: attend(qkv, z, dense_plan, dense_launch))
        dense_out = attend(qkv, z, dense_plan, dense_launch)[0]
        log("skip", dtype=dtype, lam=0.0, tile=None, ms=dense_ms, sparsity=0.0, speedup_vs_sage_dense=1.0,
            speedup_vs_cudnn=cudnn_ms / dense_ms, rel_err_vs_cudnn=rel_err(dense_out, cudnn), cudnn_ms=cudnn_ms)
        for tile in SKIP_TILES:
            for lam in SKIP_LAMBDAS:
                plan = sage_plan(dtype, skip_factor=lam * seq, count=True, tile=tile)
                result = attend(qkv, z, plan)
                sparsity = int(result[1]) / int(result[2])
                ms = bench_ms(lambda: attend(qkv, z, plan))
                log("skip", dtype=dtype, lam=lam, tile=list(tile), ms=ms, sparsity=sparsity,
                    speedup_vs_sage_dense=dense_ms / ms, speedup_vs_cudnn=cudnn_ms / ms,
                    rel_err_vs_cudnn=rel_err(result[0], cudnn), rel_err_vs_sage_dense=rel_err(result[0], dense_out))


def accuracy(best: dict) -> None:
    seq, heads = ACCURACY_SHAPE
    for data, make in (("random", random_qkv), ("peaky", lambda s, h: peaky_qkv(s, h, sharpness=PEAKY_SHARPNESS))):
        q, k, v = make(seq, heads)
        qkv = VarlenQKV(q, k, v, (seq,), (seq,))
        exact, _, _ = reference_attention(q.float(), k.float(), v.float(), SCALE)
        try:
            from sageattention import sageattn
            out = sageattn(*(x.transpose(0, 1)[None] for x in (q, k, v)), tensor_layout="HND", is_causal=False)
            log("accuracy", data=data, kernel="SageAttention 1.0.6", rel_err_vs_exact=rel_err(out[0].transpose(0, 1),
                                                                                                exact))
        except Exception as e:
            log("accuracy", data=data, kernel="SageAttention 1.0.6", error=repr(e)[:300])
        for dtype in ("int8", "fp8_e4m3"):
            for q_block, k_block in BLOCKS:
                plan = sage_plan(dtype, q_block, k_block)
                out = attend(qkv, quantize(qkv, plan.quant), plan)[0]
                same_semantics, _, _ = reference_attention(q.float(), k.float(), v.float(), SCALE, quant=semantics(plan.quant))
                log("accuracy", data=data, kernel="Triton SAGE", dtype=dtype, q_block=q_block, k_block=k_block,
                    fp8_qk_chunk=ts.DENSE_LAUNCH.fp8_qk_chunk, rel_err_vs_exact=rel_err(out, exact),
                    rel_err_vs_sage_reference=rel_err(out, same_semantics),
                    sage_reference_vs_exact=rel_err(same_semantics, exact))
        plan = sage_plan("fp8_e4m3")
        same_semantics, _, _ = reference_attention(q.float(), k.float(), v.float(), SCALE, quant=semantics(plan.quant))
        for chunk in (64, 32):  # fp32 adds every `chunk` channels of Q·Kᵀ (sm_90 fp8 accumulation)
            launch = dataclasses.replace(ts.DENSE_LAUNCH, fp8_qk_chunk=chunk)
            out = attend(qkv, quantize(qkv, plan.quant), plan, launch)[0]
            log("accuracy", data=data, kernel="Triton SAGE", dtype="fp8_e4m3", q_block=1, k_block=16,
                fp8_qk_chunk=chunk, rel_err_vs_exact=rel_err(out, exact),
                rel_err_vs_sage_reference=rel_err(out, same_semantics),
                sage_reference_vs_exact=rel_err(same_semantics, exact))


def markdown() -> str:
    rows = results["rows"]
    env = results["env"]
    lines = [f"GPU {env['gpu']}, torch {env['torch']}, triton {env['triton']}, {env['date']}", ""]
    lines += [f"Tile sweep (dense, S = {SWEEP_SHAPE[0]:,} × {SWEEP_SHAPE[1]} heads, attention launch only):", "",
              "| dtype | BLOCK_M × BLOCK_N | warps | stages | fp8 Q·Kᵀ chunk | ms | TFLOP/s |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["section"] == "sweep" and "ms" in r:
            lc = r["launch"]
            lines.append(f"| {r['dtype']} | {lc['block_m']} × {lc['block_n']} | {lc['num_warps']} | "
                         f"{lc['num_stages']} | {lc['fp8_qk_chunk']} | {r['ms']:.2f} | {r['tflops']:.0f} |")
    lines += ["", f"Wan 2.2 shape ({WAN[0]:,} tokens × {WAN[1]} heads, hd 128, bf16, random N(0,1)):", "",
              "| kernel | ms | TFLOP/s | vs cuDNN | rel. err vs cuDNN | quantize ms | attention ms (TFLOP/s) |",
              "|---|---|---|---|---|---|---|"]
    wan = [r for r in rows if r["section"] == "wan" and "ms" in r]
    cudnn_ms = next((r["ms"] for r in wan if r["kernel"] == "cuDNN SDPA"), None)
    for r in wan:
        split = (f"{r['quantize_ms']:.2f} | {r['attention_ms']:.1f} ({r['attention_tflops']:.0f})"
                 if "quantize_ms" in r else "— | —")
        lines.append(f"| {r['kernel']} | {r['ms']:.1f} | {r['tflops']:.0f} | {cudnn_ms / r['ms']:.2f}× | "
                     f"{r['rel_err_vs_cudnn']:.1e} | {split} |")
    lines += ["", f"Skip-Softmax in SAGE, Wan shape, peaky data (sharpness {PEAKY_SHARPNESS}), q1/k16, "
              "attention launch only (skip counting on); λ = 0 is the dense kernel:", "",
              "| dtype | skip tile | λ | counted sparsity | ms | vs SAGE dense | vs cuDNN | rel. err vs cuDNN "
              "| rel. err vs SAGE dense |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["section"] == "skip":
            tile = "—" if r["tile"] is None else f"{r['tile'][0]} × {r['tile'][1]}"
            lines.append(f"| {r['dtype']} | {tile} | {r['lam']:g} | {r['sparsity']:.3f} | {r['ms']:.1f} | "
                         f"{r['speedup_vs_sage_dense']:.2f}× | {r['speedup_vs_cudnn']:.2f}× | "
                         f"{r['rel_err_vs_cudnn']:.1e} | {r.get('rel_err_vs_sage_dense', 0.0):.1e} |")
    seq, heads = ACCURACY_SHAPE
    lines += ["", f"Accuracy, S = {seq:,} × {heads} heads (rel. err = ‖out − ref‖ / ‖ref‖; "
              "exact = float32 attention; SAGE ref = float32 PyTorch reference of the same quantization):", "",
              "| data | dtype | q block | k block | fp8 Q·Kᵀ chunk | vs exact | vs SAGE ref | SAGE ref vs exact |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["section"] == "accuracy" and "rel_err_vs_sage_reference" in r:
            chunk = r["fp8_qk_chunk"] if r["dtype"] == "fp8_e4m3" else "—"
            lines.append(f"| {r['data']} | {r['dtype']} | {r['q_block']} | {r['k_block']} | {chunk} | "
                         f"{r['rel_err_vs_exact']:.2e} | {r['rel_err_vs_sage_reference']:.2e} | "
                         f"{r['sage_reference_vs_exact']:.2e} |")
        elif r["section"] == "accuracy" and "rel_err_vs_exact" in r:
            lines.append(f"| {r['data']} | {r['kernel']} | | | | {r['rel_err_vs_exact']:.2e} | | |")
    return "\n".join(lines)


def main() -> None:
    results["env"] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                      "date": datetime.date.today().isoformat(), "command": "python benchmarks/sage.py"}
    start = time.time()
    try:
        best = sweep()
    except Exception:
        log("sweep", error=traceback.format_exc()[-1500:])
        best = {}
    for section in (wan_speed, skip_table, accuracy):  # one failing section must not cost the others' numbers
        try:
            section(best)
        except Exception:
            log(section.__name__, error=traceback.format_exc()[-1500:])
        torch.cuda.empty_cache()
    results["env"]["seconds"] = time.time() - start
    text = markdown()
    with open(os.path.join(OUT, "sage.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(OUT, "sage.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(text)


if __name__ == "__main__":
    main()

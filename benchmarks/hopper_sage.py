"""Hopper SAGE at FP8 speed (issue 11): TRT-LLM FMHAv2's warp-specialized SAGE kernel against cuDNN SDPA, FMHAv2
bf16 and this package's Triton SAGE kernel, in one process on one H200.

1. Build: the FMHAv2 SAGE module (``kernels.fmha_v2_sage``) and FlashInfer's FMHAv2 bf16 module, concurrently.
2. ``accumulator``: the reference's model of sm_90's fp8 tensor-core sums against cuBLAS's unpromoted fp8 GEMM.
   ``accuracy`` at small shapes (ragged batch, GQA): every compiled (K block, KV step) against the reference of its
   semantics (``backends.reference`` with FMHAv2's blocks, P·256, 64 × 128 skip tiles in kv_step steps, fp8
   tensor-core sums; and with exact sums) and exact float32 attention, dense and with Skip-Softmax.
3. Speed at Wan 2.2's self-attention shape (75,600 tokens × 40 heads × 128, batch 1, random N(0, 1) data),
   quantization included: cuDNN SDPA, FMHAv2 bf16, FMHAv2 SAGE fp8 for each kernel, Triton SAGE fp8 / int8, and
   FlashAttention-4 when importable. TFLOP/s counts 4·S²·D·H. Error vs float32 exact attention on two heads.
4. Skip-Softmax on data that follows NVIDIA's published Wan 2.2 curve (benchmarks/data.py ``published_curve``)
   at s = 0.3, 0.5, 0.65, 0.75: the reference's sparsity (128 × 128; 64 × 128, the Triton kernel's tile on sm_90;
   FMHAv2 SAGE's 64 × 128 decisions in 256-key steps; whole 64 × 256 steps as FlashInfer's kernel decides them),
   time and ×cuDNN of FMHAv2 bf16 + skip, Triton SAGE + skip (also int8 at 128 × 128 tiles) and FMHAv2 SAGE +
   skip, error vs each one's own dense output;
   ``curve256``: the same with one offset per 256 keys (structure as coarse as the kernel's KV step);
   ``curvepairs``: cuDNN, FMHAv2 bf16 + skip and Triton SAGE + skip timed alternately, per-round ratios.
5. ``floor``: each skipping kernel with every tile after the first skipped (what a skipped tile still costs).
6. ``ratio``: cuDNN SDPA and the default FMHAv2 SAGE kernel timed alternately (which goes first alternates between
   rounds), the per-round ratio's median/range.
7. ``table``: issue 35's kernel table in one run, through TRTLLM_ATTN's own entry point where the package runs it:
   cuDNN SDPA; TRTLLM_ATTN dense as routed at install (FlashAttention-4 where installed, else cuDNN) and with
   FMHAv2 pinned; FlashAttention-4 bf16 called directly; TRTLLM_ATTN SAGE fp8 and int8 and SageAttention 2
   (``sageattn`` as diffusers' ``sage`` backend calls it, where ``sageattention`` >= 2 imports) on random data; on
   published-curve data TRTLLM_ATTN SAGE fp8 + skip and bf16 + skip at each s. Each row: ms, × cuDNN, TFLOP/s,
   error vs float32; a roofline line from measured matmul peaks (fp8 e4m3 ``torch._scaled_mm`` with fast
   accumulation and bf16 ``torch.mm``, 8192³) and each row's fraction of its peak; a markdown table at the end;
   cuDNN, dense as routed and FlashAttention-4 also in alternating rounds (per-round ratios).
8. ``shapes``: the dense kernels TRTLLM_ATTN routes to on Hopper (cuDNN, FMHAv2, FlashAttention-4) against torch
   SDPA as diffusers' default calls it at Wan's cross-attention, Cosmos 3's generation stream (fewer queries than
   keys, GQA) and a ragged HunyuanVideo 1.5 CFG pair, and which one ``auto`` picks.
9. ``profile`` (only when named): the default FMHAv2 SAGE fp8 kernel alone, five calls at the shape, for a
   profiler to wrap, skipping the first two: ``ncu --kernel-name regex:fmha_v2_flash --launch-skip 2 --launch-count 1
   --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats python3
   benchmarks/hopper_sage.py --sections profile`` (where the time goes: tensor pipe, L2 traffic, stalls).

    python benchmarks/hopper_sage.py                  # writes $OUT/hopper_sage.json (or ./ without $OUT)
    python benchmarks/hopper_sage.py --quick          # small shapes only (a check of the script)
    python benchmarks/hopper_sage.py --dry-run        # the table and shapes sections on a CPU, every kernel
                                                      # replaced by TORCH_REFERENCE at tiny shapes (a check of
                                                      # the plumbing)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.data import published_curve_qkv, random_qkv, skip_factor  # noqa: E402
from diffusers_trtllm.backends import run_backend, trtllm  # noqa: E402
from diffusers_trtllm.backends.base import KernelPlan, VarlenQKV  # noqa: E402
from diffusers_trtllm.config import FLASH_ATTN4, AttnQuantSpec  # noqa: E402
from diffusers_trtllm.kernels import flash_attn4  # noqa: E402
from diffusers_trtllm.backends.reference import fp8_gmma_matmul, reference_attention  # noqa: E402
from diffusers_trtllm.kernels import fmha_v2_sage, flashinfer_fmha, triton_sage  # noqa: E402
from diffusers_trtllm.quant import SageSemantics  # noqa: E402

OUT = os.environ.get("OUT", ".")
SCALE = 128 ** -0.5
SPARSITIES = (0.3, 0.5, 0.65, 0.75)
ERROR_HEADS = 2  # heads compared against float32 attention at the Wan shape
PEAK_GEMM = 8192  # square GEMM size of the matmul peaks
results: dict = {"rows": []}
dry_run = False  # --dry-run: the table on a CPU with TORCH_REFERENCE, timed on the host clock


def log(section: str, **row) -> None:
    row["section"] = section
    results["rows"].append(row)
    print(json.dumps(row), flush=True)
    with open(os.path.join(OUT, "hopper_sage.json"), "w") as f:  # rewritten each row: a timeout keeps the rest
        json.dump(results, f, indent=1)


def bench_ms(fn, iters: int = 5) -> float:
    """Median of ``iters`` timed calls after two warm-up calls (one Wan-shape call is 100-200 ms)."""
    fn()
    fn()
    times = [time_ms(fn) for _ in range(iters)]
    return sorted(times)[len(times) // 2]


def time_ms(fn) -> float:
    """One call of ``fn``, timed with CUDA events (with ``--dry-run``: the host clock)."""
    if dry_run:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def alternating_times(runs: dict, rounds: int) -> dict:
    """Each of ``runs`` (name -> function) timed once per round after two warm-up calls, the order reversed every
    other round: clock and thermal drift hit all alike, and none always runs right after another (a kernel timed
    right after cuDNN ran 1.5-2 % slower on an H200). Returns name -> the rounds' times in ms."""
    for fn in runs.values():
        fn(), fn()
    times = {name: [] for name in runs}
    for round_ in range(rounds):
        for name in list(runs)[::-1 if round_ % 2 else 1]:
            times[name].append(time_ms(runs[name]))
    return times


def tflops(seq: int, heads: int, ms: float) -> float:
    return 4 * seq * seq * 128 * heads / ms / 1e9


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def sdpa(q, k, v, backend=SDPBackend.CUDNN_ATTENTION) -> torch.Tensor:
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(*(x.transpose(0, 1)[None] for x in (q, k, v)), scale=SCALE)
    return out[0].transpose(0, 1)


def exact(q, k, v) -> torch.Tensor:
    """Float32 attention (``[S, H, D]``), head by head."""
    backend = SDPBackend.MATH if q.device.type == "cpu" else SDPBackend.EFFICIENT_ATTENTION
    return torch.cat([sdpa(q[:, h:h + 1].float(), k[:, h:h + 1].float(), v[:, h:h + 1].float(), backend)
                      for h in range(q.shape[1])], dim=1)


def fmha_semantics(kernel, accumulator_bits: int | None = trtllm.SM90_FP8_ACCUMULATOR_BITS) -> SageSemantics:
    return trtllm.fmha_v2_sage_semantics(kernel.k_block, kernel.kv_step, accumulator_bits)


def cu(lengths, device="cuda") -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


# what TRTLLM_ATTN runs for SAGE fp8 with unset blocks on Hopper (dense steps)
DEFAULT_SAGE_KERNEL = fmha_v2_sage.SageKernel(trtllm.FMHA_V2_DEFAULT_K_BLOCK, trtllm.FMHA_V2_KV_STEP, False)


def fmha_sage(q, k, v, lengths, kernel, factor=0.0):
    return fmha_v2_sage.fmha_v2_sage_attention(q, k, v, cu(lengths), tuple(lengths), SCALE, k_block=kernel.k_block,
                                               kv_step=kernel.kv_step, skip_factor=factor)


def sage_name(kernel) -> str:
    return f"FMHAv2 SAGE fp8 k{kernel.k_block} step{kernel.kv_step}"


def flash_attention_4():
    """FlashAttention-4's bf16 forward (flash-attn-4, CuTe DSL), or None when it is not installed."""
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError:
        return None

    def run(q, k, v):
        result = flash_attn_func(q[None], k[None], v[None], softmax_scale=SCALE)
        return (result[0] if isinstance(result, tuple) else result)[0]
    return run


SAGE_ATTENTION_2_MISSING = ("sageattention >= 2 (SageAttention 2's CUDA kernels, built from its source: PyPI has "
                            "only 1.0.6) is not importable")


def sage_attention_2():
    """SageAttention 2 as diffusers' ``sage`` backend calls it (``sageattn``: on sm_90 its int8 Q·Kᵀ, fp8 P·V
    kernel), or None when ``sageattention`` >= 2 is not importable."""
    try:
        import sageattention
    except ImportError:
        return None
    if not hasattr(sageattention, "sageattn_qk_int8_pv_fp8_cuda"):  # 1.0.6, the Triton kernel
        return None

    def run(q, k, v):
        return sageattention.sageattn(q[None], k[None], v[None], tensor_layout="NHD", sm_scale=SCALE)[0]
    return run


def triton(q, k, v, dtype_qk, factor=0.0, tile=trtllm.TRITON_SKIP_TILE_SM90):
    """The Triton SAGE kernel; with ``factor`` > 0 skipping per ``tile`` (default: what TRTLLM_ATTN runs on sm_90)."""
    s = q.shape[0]
    out, _, _ = triton_sage.triton_sage_attention(q, k, v, cu([s]), cu([s]), (s,), (s,), SCALE, dtype_qk=dtype_qk,
                                                  skip_factor=factor, skip_tile=tile)
    return out


def fmha_bf16(q, k, v, factor=0.0):
    s = q.shape[0]
    return flashinfer_fmha.fmha_v2_attention(q, k, v, (s,), (s,), SCALE, factor)


def build(bf16: bool = True) -> None:
    timings, errors = {}, {}

    def timed(name, fn):
        start = time.perf_counter()
        try:
            fn()
        except Exception:  # noqa: BLE001 - reported, the rest of the run goes on
            errors[name] = traceback.format_exc()[-3000:]
        timings[name] = round(time.perf_counter() - start, 1)

    threads = [threading.Thread(target=timed, args=("fmha_v2_sage", fmha_v2_sage.load_module))]
    if bf16:
        threads.append(threading.Thread(target=timed, args=(
            "fmha_v2_bf16", lambda: flashinfer_fmha.flashinfer_prefill().get_trtllm_fmha_v2_module(
                "SEPARATE_Q_K_V", torch.bfloat16))))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log("build", seconds=timings, errors=errors, kernels=len(fmha_v2_sage.sage_kernels()),
        module=fmha_v2_sage.jit_spec().name)
    if "fmha_v2_sage" in errors:
        raise SystemExit("the FMHAv2 SAGE module did not build")


def accuracy() -> None:
    torch.manual_seed(0)
    lengths, heads_q, heads_kv = (1000, 3001), 8, 2
    q = torch.randn(sum(lengths), heads_q, 128, device="cuda").bfloat16()
    k = (torch.randn(sum(lengths), heads_kv, 128, device="cuda") + torch.randn(1, heads_kv, 128, device="cuda"))
    k = k.bfloat16()
    v = torch.randn(sum(lengths), heads_kv, 128, device="cuda").bfloat16()
    peaky = [x.clone() for x in (q, k, v)]
    pos = torch.arange(sum(lengths), device="cuda", dtype=torch.float32)[:, None]
    freqs = torch.logspace(-3, -0.5, 64, device="cuda")[None, :]
    feature = torch.cat([torch.sin(pos * freqs), torch.cos(pos * freqs)], 1)[:, None]
    peaky[0] = ((feature + 0.3 * torch.randn(sum(lengths), heads_q, 128, device="cuda")) * 2).bfloat16()
    peaky[1] = ((feature + 0.3 * torch.randn(sum(lengths), heads_kv, 128, device="cuda")) * 2).bfloat16()
    starts = cu(lengths).tolist()
    for kernel in fmha_v2_sage.sage_kernels():
        for name, (qq, kk, vv), factor in (("random", (q, k, v), 0.0), ("peaky", peaky, 0.0),
                                           ("peaky", peaky, 300.0)):
            if kernel.skip_softmax != (factor > 0):
                continue
            out = fmha_sage(qq, kk, vv, lengths, kernel, factor)
            refs, exact_sums, exacts, skipped, total = [], [], [], 0, 0
            for i, n in enumerate(lengths):
                rows = slice(starts[i], starts[i] + n)
                seq = (qq[rows].float(), kk[rows].float(), vv[rows].float(), SCALE)
                same = dict(skip_lambda=factor / n, tile=fmha_v2_sage.SKIP_TILE, kv_step=kernel.kv_step)
                ref, s, t = reference_attention(*seq, quant=fmha_semantics(kernel), **same)
                refs.append(ref)
                exact_sums.append(reference_attention(*seq, quant=fmha_semantics(kernel, None), query_chunk=4096,
                                                      **same)[0])
                exacts.append(reference_attention(*seq, query_chunk=4096)[0])
                skipped, total = skipped + s, total + t
            log("accuracy", data=name, kernel=sage_name(kernel), k_block=kernel.k_block, kv_step=kernel.kv_step,
                skip_factor=factor,
                finite=bool(torch.isfinite(out).all()), err_vs_same_semantics=rel_err(out, torch.cat(refs)),
                err_vs_same_semantics_exact_sums=rel_err(out, torch.cat(exact_sums)),
                err_vs_exact=rel_err(out, torch.cat(exacts)), ref_sparsity=float(skipped) / float(total) if factor else 0.0)


def accumulator() -> None:
    """sm_90's fp8 tensor-core sums: cuBLAS's fp8 GEMM without promotion to float32 (``use_fast_accum``) against
    exact sums and the reference's model (:func:`~diffusers_trtllm.backends.reference.fp8_gmma_matmul`) at several
    grid widths; the reference uses ``trtllm.SM90_FP8_ACCUMULATOR_BITS``."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    one = torch.ones((), device="cuda")
    for depth in (128, 4096):
        a, b = ((torch.randn(256, depth, device="cuda", generator=gen) * 40).clamp(-448, 448)
                .to(torch.float8_e4m3fn) for _ in range(2))
        fast = torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=True)
        row = {"exact": rel_err(a.double() @ b.double().t(), fast)}
        for bits in (12, 13, 14, 15, 16):
            emulated = fp8_gmma_matmul(a.float(), b.float().t(), bits)
            row[f"{bits} bits"] = {"rel_diff": rel_err(emulated, fast),
                                   "bit_exact": float((emulated == fast).float().mean())}
        log("accumulator", depth=depth, vs_cublas_fast_accumulation=row)


def wan_speed(tokens: int, heads: int) -> dict:
    q, k, v = random_qkv(tokens, heads)
    ref = exact(q[:, :ERROR_HEADS], k[:, :ERROR_HEADS], v[:, :ERROR_HEADS])
    err = lambda out: rel_err(out[:, :ERROR_HEADS], ref)  # noqa: E731
    times = {}

    def row(name, fn, **extra):
        try:
            ms = bench_ms(fn)
            times[name] = ms
            log("wan", kernel=name, ms=ms, tflops=tflops(tokens, heads, ms), x_cudnn=times["cuDNN SDPA"] / ms,
                err_vs_fp32=err(fn()), **extra)
        except Exception:  # noqa: BLE001
            log("wan", kernel=name, error=traceback.format_exc()[-2000:])

    row("cuDNN SDPA", lambda: sdpa(q, k, v))
    fa4 = flash_attention_4()
    if fa4 is None:
        log("wan", kernel="FlashAttention-4 bf16", error="flash_attn.cute is not importable")
    else:
        row("FlashAttention-4 bf16", lambda: fa4(q, k, v))
    row("FMHAv2 bf16", lambda: fmha_bf16(q, k, v))
    kernels = {}
    for kernel in fmha_v2_sage.sage_kernels():
        if not kernel.skip_softmax:
            kernels[sage_name(kernel)] = kernel
            row(sage_name(kernel), lambda: fmha_sage(q, k, v, (tokens,), kernel), k_block=kernel.k_block,
                kv_step=kernel.kv_step)
    best = min((n for n in times if n in kernels), key=times.get)
    kernel = kernels[best]
    packed = fmha_v2_sage.sage_quantize_packed(q, k, v, cu([tokens]), tokens, kernel.k_block)
    log("wan", kernel=f"{best}: quantization only", ms=bench_ms(
        lambda: fmha_v2_sage.sage_quantize_packed(q, k, v, cu([tokens]), tokens, kernel.k_block)))
    log("wan", kernel=f"{best}: attention only", ms=bench_ms(lambda: fmha_v2_sage.sage_attention_packed(
        packed, cu([tokens]), (tokens,), heads, SCALE, 0.0, kernel.kv_step)))
    for dtype in ("fp8_e4m3", "int8"):
        row(f"Triton SAGE {dtype}", lambda: triton(q, k, v, dtype))
    return times


def skip_curve(tokens: int, heads: int, cudnn_ms: float, data_tile: int = 128) -> None:
    """``data_tile``: keys per logit offset of the curve data (128: the calibration tile; 256: structure as coarse
    as the 256-key KV step, both reproduce the curve at 128 × 128)."""
    section = "curve" if data_tile == 128 else f"curve{data_tile}"
    q, k, v = published_curve_qkv(tokens, heads, tile=data_tile)
    skip_kernels = [kr for kr in fmha_v2_sage.sage_kernels() if kr.skip_softmax and kr.k_block in (0, 64)]
    dense = {"FMHAv2 bf16": fmha_bf16(q, k, v)[:, :ERROR_HEADS].float(),
             "Triton SAGE int8": triton(q, k, v, "int8")[:, :ERROR_HEADS].float(),
             "Triton SAGE fp8": triton(q, k, v, "fp8_e4m3")[:, :ERROR_HEADS].float(),
             "FMHAv2 SAGE fp8": fmha_sage(q, k, v, (tokens,), skip_kernels[0])[:, :ERROR_HEADS].float()}
    for kr in skip_kernels:
        dense_kernel = fmha_v2_sage.SageKernel(kr.k_block, kr.kv_step, False)
        log(section, kernel=f"{sage_name(kr)} dense (this data)",
            ms=bench_ms(lambda kr=dense_kernel: fmha_sage(q, k, v, (tokens,), kr)))
    cudnn_here = bench_ms(lambda: sdpa(q, k, v))
    log(section, kernel="cuDNN SDPA (this data)", ms=cudnn_here)
    for s in SPARSITIES:
        factor = skip_factor(s)
        sparsity = {}
        for name, tile, kv_step in (("128x128", (128, 128), None), ("64x128", (64, 128), None),
                                    ("64x128 in 256-key steps", (64, 128), 256),
                                    ("64x256", (64, 256), None)):
            _, skipped, total = reference_attention(q[:, :ERROR_HEADS].float(), k[:, :ERROR_HEADS].float(),
                                                    v[:, :ERROR_HEADS].float(), SCALE, skip_lambda=factor / tokens,
                                                    tile=tile, kv_step=kv_step, query_chunk=8192)
            sparsity[name] = float(skipped) / float(total)
        log(section, s=s, factor=factor, reference_sparsity=sparsity)
        runs = [("FMHAv2 bf16 + skip", "FMHAv2 bf16", lambda: fmha_bf16(q, k, v, factor)),
                ("Triton SAGE int8 + skip", "Triton SAGE int8", lambda: triton(q, k, v, "int8", factor)),
                ("Triton SAGE int8 + skip, 128 x 128 tiles", "Triton SAGE int8",
                 lambda: triton(q, k, v, "int8", factor, (128, 128))),
                ("Triton SAGE fp8 + skip", "Triton SAGE fp8", lambda: triton(q, k, v, "fp8_e4m3", factor))]
        runs += [(f"{sage_name(kr)} + skip", "FMHAv2 SAGE fp8",
                  lambda kr=kr: fmha_sage(q, k, v, (tokens,), kr, factor)) for kr in skip_kernels]
        if data_tile != 128:  # the Triton rows are the 128-key data's
            runs = [r for r in runs if not r[0].startswith("Triton")]
        for name, dense_name, fn in runs:
            try:
                ms = bench_ms(fn)
                log(section, s=s, kernel=name, ms=ms, x_cudnn=cudnn_ms / ms, x_cudnn_this_data=cudnn_here / ms,
                    err_vs_own_dense=rel_err(fn()[:, :ERROR_HEADS], dense[dense_name]))
            except Exception:  # noqa: BLE001
                log(section, s=s, kernel=name, error=traceback.format_exc()[-2000:])


def skip_floor(tokens: int, heads: int, cudnn_ms: float) -> None:
    """Each skipping kernel with every KV tile after the first skipped (factor 1e9: λ ≥ 1 makes every later tile
    negligible): what a skipped tile still costs (Q·Kᵀ, the tile max and vote, loading K and V), the bound on any
    Skip-Softmax speed-up."""
    q, k, v = random_qkv(tokens, heads)
    runs = [("FMHAv2 bf16", lambda f: fmha_bf16(q, k, v, f)),
            ("Triton SAGE int8", lambda f: triton(q, k, v, "int8", f))]
    runs += [(sage_name(kr), lambda f, kr=kr: fmha_sage(q, k, v, (tokens,), kr, f))
             for kr in fmha_v2_sage.sage_kernels() if kr.skip_softmax and kr.k_block == 0]
    for name, fn in runs:
        dense_ms, floor_ms = bench_ms(lambda: fn(0.0)), bench_ms(lambda: fn(1e9))
        log("floor", kernel=name, dense_ms=dense_ms, all_skipped_ms=floor_ms, x_cudnn_at_floor=cudnn_ms / floor_ms)


def paired_ratio(tokens: int, heads: int, rounds: int = 16) -> None:
    """cuDNN SDPA and the default FMHAv2 SAGE fp8 kernel timed alternately, one call each per round after warm-up
    (clock and thermal drift hit both alike), which goes first alternating between rounds (a kernel timed right
    after cuDNN ran 1.5-2 % slower on an H200): the median and range of the per-round ratio."""
    q, k, v = random_qkv(tokens, heads)
    times = alternating_times({"cuDNN SDPA": lambda: sdpa(q, k, v),
                               "FMHAv2 SAGE fp8": lambda: fmha_sage(q, k, v, (tokens,), DEFAULT_SAGE_KERNEL)}, rounds)
    log("ratio", rounds=rounds, median_ms=median_times(times), **round_ratios(times, "cuDNN SDPA", "FMHAv2 SAGE fp8"))


def median_times(times: dict) -> dict:
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def round_ratios(times: dict, baseline: str, candidate: str) -> dict:
    """Median and range over rounds of ``baseline``'s time / ``candidate``'s (above 1: the candidate is faster)."""
    ratios = sorted(b / c for b, c in zip(times[baseline], times[candidate]))
    return dict(ratio_median=ratios[len(ratios) // 2], ratio_min=ratios[0], ratio_max=ratios[-1])


def skip_curve_pairs(tokens: int, heads: int, rounds: int = 30) -> None:
    """The Triton kernel + skip against FMHAv2 bf16 + skip on the published-curve data, timed alternately with cuDNN
    SDPA at each s: differences of 1 % that separate medians (``curve``) do not resolve."""
    q, k, v = published_curve_qkv(tokens, heads)
    for s in SPARSITIES:
        factor = skip_factor(s)
        times = alternating_times({"cuDNN SDPA": lambda: sdpa(q, k, v),
                                   "FMHAv2 bf16 + skip": lambda: fmha_bf16(q, k, v, factor),
                                   "Triton SAGE int8 + skip": lambda: triton(q, k, v, "int8", factor),
                                   "Triton SAGE fp8 + skip": lambda: triton(q, k, v, "fp8_e4m3", factor)}, rounds)
        for name in ("FMHAv2 bf16 + skip", "Triton SAGE int8 + skip", "Triton SAGE fp8 + skip"):
            log("curvepairs", s=s, kernel=name, rounds=rounds, x_cudnn=round_ratios(times, "cuDNN SDPA", name))
        for name in ("Triton SAGE int8 + skip", "Triton SAGE fp8 + skip"):
            log("curvepairs", s=s, kernel=name, x_fmha_v2_bf16_skip=round_ratios(times, "FMHAv2 bf16 + skip", name))
        log("curvepairs", s=s, median_ms=median_times(times))


# ------------------------------------------------------------------------------------------------ issue 35's table


def matmul_peak_tflops(kind: str, n: int, device: str) -> float:
    """TFLOP/s of an ``n``³ GEMM: ``fp8`` e4m3 through ``torch._scaled_mm`` with fast accumulation (how FMHAv2's
    fp8 MMAs sum), ``bf16`` through ``torch.mm``; 20 back-to-back calls per timing."""
    gen = torch.Generator(device=device).manual_seed(3)
    a, b = (torch.randn(n, n, device=device, generator=gen) for _ in range(2))
    if kind == "fp8":
        a, b = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # b column-major, as _scaled_mm wants
        one = torch.ones((), device=device)
        gemm = lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,  # noqa: E731
                                        use_fast_accum=True)
    else:
        a, b = a.bfloat16(), b.bfloat16()
        gemm = lambda: a @ b  # noqa: E731
    calls = 20
    ms = bench_ms(lambda: [gemm() for _ in range(calls)]) / calls
    return 2 * n ** 3 / ms / 1e9


def routed(route: str, tokens: int, quant: AttnQuantSpec | None = None, factor: float = 0.0):
    """Attention through the backend entry point the package's op calls, on a planned ``route`` (with
    ``--dry-run``: TORCH_REFERENCE with the same plan)."""
    route = "TORCH_REFERENCE" if dry_run else route
    plan = KernelPlan(route, SCALE, skip_factor=factor, quant=quant)
    return lambda q, k, v: run_backend(route, VarlenQKV(q, k, v, (tokens,), (tokens,)), plan).out


def kernel_table(tokens: int, heads: int) -> None:
    device = "cpu" if dry_run else "cuda"
    fp8_peak = matmul_peak_tflops("fp8", 256 if dry_run else PEAK_GEMM, device)
    bf16_peak = matmul_peak_tflops("bf16", 256 if dry_run else PEAK_GEMM, device)
    flops = 4 * tokens * tokens * 128 * heads
    log("table", roofline=dict(fp8_matmul_tflops=fp8_peak, bf16_matmul_tflops=bf16_peak,
                               gemm=f"{PEAK_GEMM}^3" if not dry_run else "256^3", shape_tflop=flops / 1e12,
                               ms_at_fp8_peak=flops / fp8_peak / 1e9, ms_at_bf16_peak=flops / bf16_peak / 1e9))
    route = "TORCH_REFERENCE" if dry_run else trtllm.dense_route(device)
    fa4 = None if dry_run else flash_attention_4()
    fa4_name = f"FlashAttention-4 bf16 (flash-attn-4 {flash_attn4.installed_version() or 'not installed'})"
    sage2_name = "SageAttention 2 (sageattn: int8 Q·Kᵀ, fp8 P·V)"
    missing = {fa4_name: flash_attn4.unavailable_reason() or "dry run", sage2_name: SAGE_ATTENTION_2_MISSING}
    random_rows = [
        ("cuDNN SDPA", "bf16", lambda q, k, v: sdpa(q, k, v, SDPBackend.MATH if dry_run else
                                                    SDPBackend.CUDNN_ATTENTION)),
        (f"TRTLLM_ATTN dense, as routed ({trtllm.dense_kernel_of(route) or route})", "bf16", routed(route, tokens)),
        ("TRTLLM_ATTN dense, FMHAv2 pinned", "bf16", routed("TRTLLM_ATTN+fmha_v2", tokens)),
        (fa4_name, "bf16", fa4),
        ("TRTLLM_ATTN SAGE fp8 (FMHAv2, default blocks)", "fp8", routed("TRTLLM_ATTN", tokens,
                                                                       AttnQuantSpec("fp8_e4m3"))),
        ("TRTLLM_ATTN SAGE int8 (Triton)", "int8", routed("TRTLLM_ATTN", tokens, AttnQuantSpec("int8"))),
        (sage2_name, "int8", None if dry_run else sage_attention_2())]
    table = []

    def row(name, kind, fn, data, reference, cudnn_ms=None, **extra):
        if fn is None:
            log("table", kernel=name, error="not available: " + missing.get(name, "dry run"))
            return None
        try:
            ms = bench_ms(lambda: fn(*data))
            err = rel_err(fn(*data)[:, :ERROR_HEADS], reference)
        except Exception:  # noqa: BLE001 - reported, the rest of the table goes on
            log("table", kernel=name, error=traceback.format_exc()[-2000:])
            return None
        peak = bf16_peak if kind == "bf16" else fp8_peak
        entry = dict(kernel=name, ms=ms, x_cudnn=(cudnn_ms or ms) / ms, tflops=flops / ms / 1e9,
                     err_vs_fp32=err, peak="bf16 matmul" if kind == "bf16" else "fp8 matmul",
                     fraction_of_peak=flops / ms / 1e9 / peak, **extra)
        log("table", **entry)
        table.append(entry)
        return ms

    data = random_qkv(tokens, heads, device=device)
    reference = exact(*(x[:, :ERROR_HEADS] for x in data))
    cudnn_ms = row(*random_rows[0], data, reference, dataset="random N(0, 1)")
    if cudnn_ms is None:
        raise SystemExit("cuDNN SDPA did not run: no baseline for the table")
    for name, kind, fn in random_rows[1:]:
        row(name, kind, fn, data, reference, cudnn_ms, dataset="random N(0, 1)")
    dense_pair_rounds(random_rows, data)
    del data, reference
    data = published_curve_qkv(tokens, heads, device=device)
    reference = exact(*(x[:, :ERROR_HEADS] for x in data))
    row("cuDNN SDPA (published-curve data)", "bf16", random_rows[0][2], data, reference, cudnn_ms,
        dataset="published curve")
    for s in SPARSITIES:
        factor = skip_factor(s)
        for name, kind, quant in (("TRTLLM_ATTN SAGE fp8 + skip (FMHAv2)", "fp8", AttnQuantSpec("fp8_e4m3")),
                                  ("TRTLLM_ATTN bf16 + skip (FMHAv2)", "bf16", None)):
            row(f"{name}, s = {s}", kind, routed("TRTLLM_ATTN", tokens, quant, factor), data, reference, cudnn_ms,
                dataset="published curve", s=s, skip_factor=factor)
    print(table_markdown(table, fp8_peak, bf16_peak, flops), flush=True)


# Dense shapes beside Wan's self-attention (name: query lengths, key lengths, query heads, key/value heads); with
# --dry-run the same kinds of shape, tiny.
DENSE_SHAPES = {
    "Wan 2.2 cross-attention, 75,600 queries on 512 text keys": ((75600,), (512,), 40, 40),
    "Cosmos 3 generation stream, 19,320 queries on 600 text + 19,320 keys, GQA 32/8": ((19320,), (19920,), 32, 8),
    "HunyuanVideo 1.5 joint, CFG pair of 77,585 and 77,335 tokens (ragged)": ((77585, 77335), (77585, 77335), 16, 16),
}
DRY_RUN_SHAPES = {"cross": ((512,), (16,), 4, 4), "fewer queries than keys, GQA": ((200,), (230,), 8, 2),
                  "ragged": ((300, 250), (300, 250), 2, 2)}


def exact_varlen(qkv: VarlenQKV, heads: int) -> torch.Tensor:
    """Float32 attention of the first ``heads`` query heads of every sequence (each on its own key/value head)."""
    group = qkv.q.shape[1] // qkv.k.shape[1]
    pieces = []
    for q, k, v, _ in qkv.sequences():
        pieces.append(torch.cat([exact(q[:, h:h + 1], k[:, h // group:h // group + 1], v[:, h // group:h // group + 1])
                                 for h in range(heads)], dim=1))
    return torch.cat(pieces)


def dense_shapes() -> None:
    """Each dense kernel TRTLLM_ATTN can route to on Hopper against torch SDPA as diffusers' default calls it, at
    the other shapes the video models run: which one ``auto`` picks, and whether it is the fastest."""
    device = "cpu" if dry_run else "cuda"
    auto = None if dry_run else trtllm.dense_route(device)
    kernels = {"torch SDPA (diffusers' default)": "TORCH_SDPA"}
    kernels.update({f"TRTLLM_ATTN dense on {kernel}": f"TRTLLM_ATTN+{kernel}"
                    for kernel in ("cudnn", "fmha_v2", "flash_attn4")})
    for shape, (seqlens_q, seqlens_kv, heads_q, heads_kv) in (DRY_RUN_SHAPES if dry_run else DENSE_SHAPES).items():
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(sum(lens), heads, 128, device=device, generator=gen, dtype=torch.bfloat16)
                   for lens, heads in ((seqlens_q, heads_q), (seqlens_kv, heads_kv), (seqlens_kv, heads_kv)))
        qkv = VarlenQKV(q, k, v, seqlens_q, seqlens_kv)
        reference = exact_varlen(qkv, ERROR_HEADS)
        flops = sum(4 * nq * nkv * 128 * heads_q for nq, nkv in zip(seqlens_q, seqlens_kv))
        baseline = None
        for name, route in kernels.items():
            if route.endswith(FLASH_ATTN4) and flash_attn4.unavailable_reason() is not None:
                log("shapes", shape=shape, kernel=name, error=flash_attn4.unavailable_reason())
                continue
            runs = "TORCH_REFERENCE" if dry_run and route != "TORCH_SDPA" else route
            plan = KernelPlan(runs, SCALE)
            try:
                ms = bench_ms(lambda: run_backend(runs, qkv, plan))
                err = rel_err(run_backend(runs, qkv, plan).out[:, :ERROR_HEADS], reference)
            except Exception:  # noqa: BLE001 - reported, the rest goes on
                log("shapes", shape=shape, kernel=name, error=traceback.format_exc()[-2000:])
                continue
            baseline = baseline or ms
            log("shapes", shape=shape, kernel=name, ms=ms, x_default=baseline / ms, tflops=flops / ms / 1e9,
                err_vs_fp32=err, auto_picks=route == auto)


def dense_pair_rounds(random_rows: list, data, rounds: int = 10) -> None:
    """cuDNN SDPA, TRTLLM_ATTN dense as routed and FlashAttention-4 called directly, timed in alternating rounds:
    per-round ratios resolve the percent or two that separate medians of separate runs."""
    runs = {name: (lambda fn=fn: fn(*data)) for name, _, fn in random_rows[:2] + random_rows[3:4] if fn is not None}
    times = alternating_times(runs, rounds)
    names = list(runs)
    log("table", rounds=rounds, median_ms=median_times(times),
        **{f"{names[0]} / {name}": round_ratios(times, names[0], name) for name in names[1:]},
        **({f"{names[2]} / {names[1]}": round_ratios(times, names[2], names[1])} if len(names) == 3 else {}))


def table_markdown(table: list[dict], fp8_peak: float, bf16_peak: float, flops: float) -> str:
    lines = [f"Roofline: fp8 e4m3 matmul {fp8_peak:,.0f} TFLOP/s, bf16 matmul {bf16_peak:,.0f} TFLOP/s (measured); "
             f"this shape's {flops:.3g} FLOPs need >= {flops / fp8_peak / 1e9:.1f} ms at the fp8 peak, "
             f"{flops / bf16_peak / 1e9:.1f} ms at the bf16 peak.", "",
             "| kernel | ms | × cuDNN | TFLOP/s | rel. err. vs fp32 | of the matmul peak |",
             "|---|---:|---:|---:|---:|---:|"]
    for e in table:
        lines.append(f"| {e['kernel']} | {e['ms']:.1f} | {e['x_cudnn']:.3f} | {e['tflops']:.0f} | "
                     f"{e['err_vs_fp32']:.2e} | {e['fraction_of_peak']:.0%} ({e['peak']}) |")
    return "\n".join(lines)


def profile_calls(tokens: int, heads: int, calls: int = 5) -> None:
    """The default FMHAv2 SAGE fp8 kernel ``calls`` times on random data (a profiler skips the first two)."""
    q, k, v = random_qkv(tokens, heads)
    for _ in range(calls):
        fmha_sage(q, k, v, (tokens,), DEFAULT_SAGE_KERNEL)
    torch.cuda.synchronize()
    log("profile", kernel=sage_name(DEFAULT_SAGE_KERNEL), calls=calls, shape=[tokens, heads, 128])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes only")
    parser.add_argument("--dry-run", action="store_true",
                        help="the table section on a CPU at a tiny shape, every kernel replaced by TORCH_REFERENCE")
    valid = ("accumulator", "accuracy", "wan", "curve", "curve256", "curvepairs", "floor", "ratio", "table", "shapes",
             "profile")
    parser.add_argument("--sections", default=None, help=f"comma-separated: {', '.join(valid)} (default: all; "
                                                          "with --dry-run: table, shapes)")
    args = parser.parse_args()
    everything = tuple(section for section in valid if section != "profile")  # profile runs alone, under a profiler
    sections = set(args.sections.split(",")) if args.sections else set(("table", "shapes") if args.dry_run
                                                                         else everything)
    unknown = sections - set(valid)
    if unknown:
        parser.error(f"--sections: unknown section(s) {sorted(unknown)}; valid: {', '.join(valid)}")
    if args.dry_run and not sections <= {"table", "shapes"}:
        parser.error(f"--dry-run runs the table and shapes sections only; got --sections {args.sections}")
    tokens, heads = (8192, 8) if args.quick else (75600, 40)
    if args.dry_run:
        global dry_run
        dry_run = True
        results["meta"] = dict(dry_run=True, torch=torch.__version__, shape=[512, 2, 128])
        if "table" in sections:
            kernel_table(512, 2)
        if "shapes" in sections:
            dense_shapes()
        return
    import flashinfer

    results["meta"] = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                           flashinfer=flashinfer.__version__, flash_attn_4=flash_attn4.installed_version(),
                           date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), shape=[tokens, heads, 128])
    build(bf16=bool(sections & {"wan", "curve", "curve256", "curvepairs", "floor", "table", "shapes"}))
    if "profile" in sections:
        profile_calls(tokens, heads)
    if "accumulator" in sections:
        accumulator()
    if "accuracy" in sections:
        accuracy()
    if "ratio" in sections:
        paired_ratio(tokens, heads)
    if "wan" in sections:
        cudnn_ms = wan_speed(tokens, heads)["cuDNN SDPA"]
    elif sections & {"curve", "curve256", "floor"}:
        q, k, v = random_qkv(tokens, heads)
        cudnn_ms = bench_ms(lambda: sdpa(q, k, v))
        del q, k, v
    if "curve" in sections:
        skip_curve(tokens, heads, cudnn_ms)
    if "curve256" in sections:
        skip_curve(tokens, heads, cudnn_ms, data_tile=256)
    if "curvepairs" in sections:
        skip_curve_pairs(tokens, heads)
    if "floor" in sections:
        skip_floor(tokens, heads, cudnn_ms)
    if "table" in sections:
        kernel_table(tokens, heads)
    if "shapes" in sections:
        dense_shapes()


if __name__ == "__main__":
    main()

"""One real-size attention layer of HunyuanVideo 1.5 and of Cosmos 3 (random bf16 weights): this package's
processors against diffusers' default processors, at the 720p shapes.

- HunyuanVideo 1.5 (``transformer_blocks.N.attn``, 16 heads of 128): 75,600 video tokens (720p, 81 frames) +
  1,985 text tokens (1,000 MLLM + 256 ByT5 + 729 image) = 77,585 joint tokens, of which ``--valid-text`` MLLM
  tokens are valid (text-to-video: no glyph text, no image). diffusers' processor builds the dense
  ``[1, 1, 77585, 77585]`` mask; this package's packs the valid tokens (no mask). Rows: TORCH_SDPA, the feature
  backend and ``auto``, each processor made from its config alone.
- Cosmos 3 (``layers.0.self_attn`` of a one-layer ``Cosmos3OmniTransformer``, processors installed with
  ``enable_trtllm_attention`` as users install them, so each call runs as planned): ``cosmos-super`` is
  Cosmos3-Super's layer (hidden 5,120, 64 query / 8 key-value heads of 128) at the pipeline's default video
  (720p, 189 frames: 44,160 generation tokens) after 600 causal text tokens; ``cosmos-nano`` is Cosmos3-Nano's
  (hidden 4,096, 32/8 heads) at 720p, 81 frames (600 + 19,320 tokens). Rows: TORCH_SDPA, the feature backend
  dense (the causal text stream on TORCH_SDPA, as the plan routes it), SAGE fp8, SAGE fp8 + Skip-Softmax λ.
  Random weights make near-uniform attention, so the skip row here is the cost floor of skipping. A second
  table times the generation stream's attention alone (``gen_full``: 44,160 queries on 44,760 keys) on data
  whose 128 × 128 Skip-Softmax sparsity follows NVIDIA's published Wan 2.2 curve (``benchmarks/data.py``), where
  skipping skips what it would in a trained model: diffusers' default (SDPA with grouped-query heads, which
  torch runs on FlashAttention-2), SDPA with the key/value heads repeated (cuDNN takes no grouped heads), and the
  planned ``gen_full`` calls of the layer rows, each also against a float32 reference.

Each row: median of ``--repeats`` calls timed with CUDA events after ``--warmup`` calls (the first TRTLLM_ATTN
call on a Hopper machine JIT-builds FMHAv2 before timing starts), relative error ``||out - ref|| / ||ref||`` over
the outputs the model uses (HunyuanVideo: video tokens and valid text tokens) against diffusers' default and the
1e-2 bf16 tolerance, what the plan ran (``role: backend:mode``) and, on a GPU, the kernel that took the most time
in one call (torch's SDPA takes FlashAttention-2 for grouped heads, which cuDNN does not take). A configuration
that cannot run is a row with the reason. ``--tiny``: tiny shapes on the CPU with TORCH_REFERENCE as the feature
backend (a smoke test).

    PYTHONPATH=. python benchmarks/models_attention.py             # CUDA; JSON to $OUT/models_attention.json
    PYTHONPATH=. python benchmarks/models_attention.py --models cosmos-super cosmos-nano --repeats 5
    PYTHONPATH=. python benchmarks/models_attention.py --tiny      # CPU, tiny shapes, seconds (a smoke test)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import diffusers
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_hunyuan_video15 import (HunyuanVideo15AttnProcessor2_0,
                                                                       HunyuanVideo15RotaryPosEmbed,
                                                                       HunyuanVideo15TransformerBlock)

from diffusers_trtllm import HunyuanVideo15TrtllmAttnProcessor, enable_trtllm_attention
from diffusers_trtllm.config import AUTO, TORCH_REFERENCE, TORCH_SDPA, TRTLLM_ATTN
from diffusers_trtllm.dispatch import run_attention
from diffusers_trtllm.platform import flashinfer_version, gpu_arch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks' shared data generators
from data import WAN22_720P_CURVE, published_curve_qkv  # noqa: E402

TOLERANCE = 1e-2  # bf16
DEFAULT_LABEL = "diffusers default"
SDPA_REPEATED_LABEL = "SDPA, K/V heads repeated (cuDNN)"
DEFAULT_LAMBDA = 0.5


@dataclass(frozen=True)
class Cosmos3Layer:
    """A Cosmos 3 model's attention layer and the stream lengths it runs at."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    text_tokens: int
    gen_tokens: int
    video: str


# The generation tokens: latent frames × 23 × 40 patches at 720p (Wan 2.2's VAE: 16× spatial, 4× temporal; 2 × 2
# patches, the latent padded to whole patches).
COSMOS3_LAYERS = {
    "cosmos-super": Cosmos3Layer("Cosmos3-Super", 5120, 64, 8, 600, 48 * 23 * 40, "720p, 189 frames (the default)"),
    "cosmos-nano": Cosmos3Layer("Cosmos3-Nano", 4096, 32, 8, 600, 21 * 23 * 40, "720p, 81 frames"),
}
TINY_COSMOS3 = Cosmos3Layer("Cosmos 3 (tiny)", 512, 4, 2, 40, 200, "tiny")


@dataclass
class Case:
    """One attention layer, its inputs, which of its outputs the model uses, and its configurations (label ->
    config); with ``transformer`` they are installed on it (planned per call site), else each becomes an
    unbound processor of ``processor_class``."""

    model: str
    shape: str
    attn: torch.nn.Module
    inputs: dict  # keyword arguments of the layer's forward
    default_processor: object
    configs: dict
    used_outputs: Callable[[tuple], list[torch.Tensor]]
    processor_class: type | None = None
    transformer: torch.nn.Module | None = None
    layer: Cosmos3Layer | None = None


@dataclass
class Row:
    model: str
    shape: str
    config: str
    ms: float | None = None
    rel_err: float | None = None
    rel_err_fp32: float | None = None
    within_tolerance: bool | None = None
    ran: str = ""
    kernel: str = ""  # the GPU kernel that took the most time in one call (what torch or the plan really ran)
    compared_to: str | None = None  # the reference row's config
    error: str = ""
    calls_ms: list = field(default_factory=list)


def hunyuan_video15_case(tiny: bool, device: torch.device, dtype: torch.dtype, valid_text: int | None,
                         feature_backend: str) -> Case:
    heads, head_dim, rope_axes = 2 if tiny else 16, 128, (16, 56, 56)
    latent_grid = (4, 8, 8) if tiny else (21, 45, 80)  # 720p, 81 frames: 21 × 45 × 80 latent patches
    text_len = 64 if tiny else 1000 + 256 + 729
    valid_text = min(text_len, valid_text or (20 if tiny else 256))
    with torch.device(device):
        attn = HunyuanVideo15TransformerBlock(heads, head_dim, mlp_ratio=4.0).attn.to(dtype).eval()
        rotary = HunyuanVideo15RotaryPosEmbed(1, 1, list(rope_axes))(torch.empty(1, 1, *latent_grid))
        video_len, hidden = latent_grid[0] * latent_grid[1] * latent_grid[2], heads * head_dim
        video = torch.randn(1, video_len, hidden, dtype=dtype)
        text = torch.randn(1, text_len, hidden, dtype=dtype)
        mask = (torch.arange(text_len) < valid_text)[None].long()

    def used_outputs(outputs):
        video_out, text_out = outputs
        return [video_out, text_out[:, :valid_text]]

    configs = {label: {"default": {"backend": backend}} for label, backend in
               (("TORCH_SDPA", TORCH_SDPA), (feature_backend, feature_backend), ("auto", AUTO))}
    return Case("HunyuanVideo 1.5", f"{video_len:,} video + {text_len:,} text ({valid_text:,} valid), {heads} heads × "
                f"{head_dim}", attn, dict(hidden_states=video, encoder_hidden_states=text, attention_mask=mask,
                                       image_rotary_emb=rotary), HunyuanVideo15AttnProcessor2_0(), configs,
                used_outputs, processor_class=HunyuanVideo15TrtllmAttnProcessor)


def cosmos3_configs(feature_backend: str, lam: float) -> dict[str, dict]:
    fp8 = {"dtype_qk": "fp8_e4m3"}
    return {"TORCH_SDPA": {"default": {"backend": TORCH_SDPA}},
            f"{feature_backend} dense": {"default": {"backend": feature_backend}},
            f"{feature_backend} SAGE fp8": {"default": {"backend": feature_backend, "quant": fp8}},
            f"{feature_backend} SAGE fp8 + skip λ={lam:g}": {"default": {"backend": feature_backend, "quant": fp8,
                                                                         "skip_softmax": {"threshold": lam}}}}


def cosmos3_case(layer: Cosmos3Layer, device: torch.device, dtype: torch.dtype, feature_backend: str,
                 lam: float) -> Case:
    from diffusers import Cosmos3OmniTransformer

    head_dim, total = 128, layer.text_tokens + layer.gen_tokens
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):  # one layer; a small vocabulary (the embedding is not called)
            transformer = Cosmos3OmniTransformer(hidden_size=layer.hidden, num_attention_heads=layer.heads,
                                                 num_key_value_heads=layer.kv_heads, head_dim=head_dim,
                                                 intermediate_size=128, num_hidden_layers=1, vocab_size=256,
                                                 rope_theta=5e6).eval()
    finally:
        torch.set_default_dtype(previous)
    attn = transformer.layers[0].self_attn
    with torch.device(device):
        positions = torch.arange(total)[None, None].expand(3, 1, -1)
        cos, sin = (x.squeeze(0) for x in transformer.rotary_emb(positions, device, dtype))
        und = torch.randn(layer.text_tokens, layer.hidden, dtype=dtype)
        gen = torch.randn(layer.gen_tokens, layer.hidden, dtype=dtype)
    rotary = (cos[:layer.text_tokens], sin[:layer.text_tokens], cos[layer.text_tokens:], sin[layer.text_tokens:])
    shape = (f"{layer.name} layer, {layer.video}: {layer.text_tokens:,} causal text + {layer.gen_tokens:,} "
             f"generation queries on {total:,} keys, {layer.heads}/{layer.kv_heads} heads × {head_dim}")
    return Case("Cosmos 3", shape, attn, dict(und_seq=und, gen_seq=gen, rotary_emb=rotary),
                attn.processor, cosmos3_configs(feature_backend, lam), list, transformer=transformer, layer=layer)


def timed_calls(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> list[float]:
    """Milliseconds per call: CUDA events on a GPU, wall clock elsewhere."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
    return times


def rel_err(outputs: list[torch.Tensor], references: list[torch.Tensor]) -> float:
    diff = sum(float((o.double() - r.double()).square().sum()) for o, r in zip(outputs, references))
    norm = sum(float(r.double().square().sum()) for r in references)
    return (diff / norm) ** 0.5


def installed(case: Case, config) -> tuple[contextlib.AbstractContextManager, Callable[[], str]]:
    """Install ``config`` on the case's layer; returns the context to run in and what the plan runs."""
    if case.transformer is not None:
        handle = enable_trtllm_attention(case.transformer, config, collect_stats=False)
        return handle, lambda: ", ".join(f"{role}: {call.backend}:{call.mode_of(call.settings)}"
                                         for role, call in case.attn.processor.calls.items())
    processor = case.processor_class(config)
    case.attn.set_processor(processor)
    restore = contextlib.ExitStack()
    restore.callback(case.attn.set_processor, case.default_processor)
    return restore, lambda: ", ".join(f"{role}: {call.backend}:{call.mode(bool(call.skip_value))}"
                                      for role, call in processor.calls.items())


def measure(row: Row, fn: Callable[[], list[torch.Tensor]], reference: list[torch.Tensor] | None,
            fp32_reference: list[torch.Tensor] | None, device: torch.device, warmup: int, repeats: int) -> list:
    """Fill ``row``'s errors and times from ``fn``; returns its outputs when it is the reference."""
    outputs = fn()
    if fp32_reference is not None:
        row.rel_err_fp32 = rel_err(outputs, fp32_reference)
    if reference is None:
        reference = [t.clone() for t in outputs]
    else:
        row.rel_err = rel_err(outputs, reference)
        row.within_tolerance = row.rel_err <= TOLERANCE
    del outputs
    row.calls_ms = timed_calls(fn, device, warmup, repeats)
    row.ms = statistics.median(row.calls_ms)
    if device.type == "cuda":
        row.kernel = longest_kernel(fn)
    return reference


def longest_kernel(fn: Callable[[], object]) -> str:
    """The name of the GPU kernel with the most time in one call of ``fn`` (e.g. whether torch's SDPA took cuDNN
    or FlashAttention-2)."""
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_time_total > 0]
    except Exception as exc:  # noqa: BLE001 - the row keeps its times; the column says why it has no kernel
        return f"profiler failed: {type(exc).__name__}: {exc}"[:120]
    return max(events, key=lambda e: e.device_time_total).key[:80] if events else "no GPU kernel recorded"


def progress(row: Row) -> None:
    print(f"[{row.shape}] {row.config} ...", file=sys.stderr, flush=True)


def failed(row: Row, exc: Exception, device: torch.device) -> None:
    row.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400]
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_case(case: Case, device: torch.device, warmup: int, repeats: int) -> list[Row]:
    """One row per configuration after diffusers' default (the reference; should it fail, the first that runs)."""
    rows, reference, reference_label = [], None, None

    def call():
        with torch.no_grad():
            return case.used_outputs(case.attn(**case.inputs))

    for label, config in {DEFAULT_LABEL: None, **case.configs}.items():
        row = Row(case.model, case.shape, label)
        progress(row)
        try:
            context, what_ran = installed(case, config) if config is not None else (contextlib.nullcontext(),
                                                                                   lambda: "diffusers")
            with context:
                row.ran = what_ran()
                reference = measure(row, call, reference, None, device, warmup, repeats)
            reference_label = reference_label or label
            row.compared_to = reference_label
        except Exception as exc:  # noqa: BLE001 - a configuration that cannot run is a row with its reason
            failed(row, exc, device)
        rows.append(row)
    return rows


def gen_full_inputs(layer: Cosmos3Layer, device: torch.device):
    """``gen_full``'s q ``[1, gen, Hq, 128]`` and k, v ``[1, text + gen, Hkv, 128]`` whose Skip-Softmax sparsity
    follows the published curve over the whole key sequence (q from a draw with the query heads, k and v from one
    with the key-value heads: the keys carry each tile's offset, the queries a constant channel)."""
    total = layer.text_tokens + layer.gen_tokens
    q = published_curve_qkv(total, layer.heads, device=device, seed=1)[0][layer.text_tokens:]
    _, k, v = published_curve_qkv(total, layer.kv_heads, device=device, seed=2)
    return q[None], k[None], v[None]


def float32_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Exact attention in float32, the key/value heads repeated (SDPA's memory-efficient kernel takes float32 but
    no grouped heads; its math kernel would hold every score)."""
    groups = q.shape[2] // k.shape[2]
    q32, k32, v32 = (x.float().transpose(1, 2) for x in (q, k, v))
    k32, v32 = (x.repeat_interleave(groups, dim=1) for x in (k32, v32))
    return F.scaled_dot_product_attention(q32, k32, v32).transpose(1, 2)


def bench_gen_full(case: Case, device: torch.device, warmup: int, repeats: int, lam: float) -> list[Row]:
    """The generation stream's attention alone on published-curve data, per planned ``gen_full`` call."""
    layer = case.layer
    total = layer.text_tokens + layer.gen_tokens
    a, b = WAN22_720P_CURVE
    sparsity = math.log(lam * total / a) / b
    shape = (f"{layer.name} gen_full, {layer.video}: {layer.gen_tokens:,} queries on {total:,} keys, published-curve "
             f"data (λ = {lam:g} is s = {sparsity:.2f} on the curve)")
    q, k, v = gen_full_inputs(layer, device)
    with torch.no_grad():
        fp32_reference = [float32_attention(q, k, v)]

    def default():
        return [dispatch_attention_fn(q, k, v, is_causal=False, enable_gqa=True)]

    def repeated_heads():
        groups = q.shape[2] // k.shape[2]
        k_all, v_all = (x.repeat_interleave(groups, dim=2).transpose(1, 2) for x in (k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION) if device.type == "cuda" else contextlib.nullcontext():
            return [F.scaled_dot_product_attention(q.transpose(1, 2), k_all, v_all).transpose(1, 2)]

    rows, reference = [], None
    unplanned = [(DEFAULT_LABEL, default, "diffusers"), (SDPA_REPEATED_LABEL, repeated_heads, "TORCH_SDPA:dense")]
    planned = [(label, config) for label, config in case.configs.items() if label != "TORCH_SDPA"]
    for label, fn_or_config, ran in unplanned + [(label, config, None) for label, config in planned]:
        row = Row(case.model, shape, label, compared_to=DEFAULT_LABEL)
        progress(row)
        try:
            context = contextlib.nullcontext() if ran else installed(case, fn_or_config)[0]
            with context, torch.no_grad():
                fn = fn_or_config
                if not ran:  # the layer's planned gen_full call, as its processor hands it to the op
                    call = case.attn.processor.calls["gen_full"]
                    ran = f"gen_full: {call.backend}:{call.mode_of(call.settings)}"
                    fn = lambda call=call: [run_attention(call, q, k, v)]  # noqa: E731
                row.ran = ran
                reference = measure(row, fn, reference, fp32_reference, device, warmup, repeats)
        except Exception as exc:  # noqa: BLE001 - a configuration that cannot run is a row with its reason
            failed(row, exc, device)
        rows.append(row)
    return rows


def markdown(rows: list[Row]) -> str:
    lines = ["| model | shape | config | ms (median) | × default | rel. err vs default | ≤ 1e-2 | rel. err vs "
             "float32 | ran | longest GPU kernel |", "|---|---|---|---:|---:|---:|:-:|---:|---|---|"]
    reference_ms = {(r.shape, r.config): r.ms for r in rows}
    for r in rows:
        if r.error:
            lines.append(f"| {r.model} | {r.shape} | {r.config} | – | – | – | – | – | not run: {r.error} | |")
            continue
        speedup = reference_ms.get((r.shape, r.compared_to))
        speedup = f"{speedup / r.ms:.2f}×" if speedup else "–"
        err = "reference" if r.rel_err is None else f"{r.rel_err:.2e}"
        ok = "" if r.within_tolerance is None else ("yes" if r.within_tolerance else "**no**")
        fp32 = "–" if r.rel_err_fp32 is None else f"{r.rel_err_fp32:.2e}"
        lines.append(f"| {r.model} | {r.shape} | {r.config} | {r.ms:.2f} | {speedup} | {err} | {ok} | {fp32} | "
                     f"{r.ran} | {r.kernel} |")
    return "\n".join(lines)


def environment(device: torch.device) -> dict:
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "arch": gpu_arch(device), "torch": torch.__version__, "diffusers": diffusers.__version__,
            "flashinfer": flashinfer_version(), "python": platform.python_version()}


def main(argv=None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke test of this script)")
    models = ("hunyuan", *COSMOS3_LAYERS)
    parser.add_argument("--models", nargs="+", choices=models, default=models)
    parser.add_argument("--valid-text", type=int, default=None,
                        help="valid text tokens of HunyuanVideo 1.5 (default 256; 20 of 64 with --tiny)")
    parser.add_argument("--lam", type=float, default=DEFAULT_LAMBDA, help="Skip-Softmax λ of the skip rows")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output", type=Path, default=None,
                        help="JSON path (default: $OUT/models_attention.json, else ./models_attention.json)")
    args = parser.parse_args(argv)
    if not 0 < args.lam < 1:
        parser.error(f"--lam {args.lam} is invalid: expected 0 < λ < 1 (λ ≥ 1 skips nearly every tile)")

    device, dtype = torch.device(args.device), torch.bfloat16
    feature_backend = TORCH_REFERENCE if args.tiny else TRTLLM_ATTN
    torch.manual_seed(0)
    rows = []
    for model in args.models:
        if model == "hunyuan":
            case = hunyuan_video15_case(args.tiny, device, dtype, args.valid_text, feature_backend)
            rows += bench_case(case, device, args.warmup, args.repeats)
        else:
            layer = TINY_COSMOS3 if args.tiny else COSMOS3_LAYERS[model]
            case = cosmos3_case(layer, device, dtype, feature_backend, args.lam)
            rows += bench_case(case, device, args.warmup, args.repeats)
            rows += bench_gen_full(case, device, args.warmup, args.repeats, args.lam)
        del case
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(markdown(rows))
    output = args.output or Path(os.environ.get("OUT", ".")) / "models_attention.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"environment": environment(device), "tiny": args.tiny, "tolerance": TOLERANCE,
                                  "lambda": args.lam, "rows": [asdict(r) for r in rows]}, indent=2))
    print(f"wrote {output}")
    return rows


if __name__ == "__main__":
    main()

"""One real-size attention layer of HunyuanVideo 1.5 and of Cosmos 3 (random bf16 weights): this package's
processors against diffusers' default processors, at the 720p shapes.

- HunyuanVideo 1.5 (``transformer_blocks.N.attn``, 16 heads of 128): 75,600 video tokens (720p, 81 frames) +
  1,985 text tokens (1,000 MLLM + 256 ByT5 + 729 image) = 77,585 joint tokens, of which ``--valid-text`` MLLM
  tokens are valid (text-to-video: no glyph text, no image). diffusers' processor builds the dense
  ``[1, 1, 77585, 77585]`` mask; this package's packs the valid tokens (no mask).
- Cosmos 3 (``layers.N.self_attn``, 32 query / 8 key-value heads of 128, hidden 4,096): 600 text tokens in the
  causal stream, 19,320 generation tokens attending to 19,920 keys.

Rows per model: diffusers' default processor (the reference; should it fail, e.g. for memory of its dense mask,
the first row that runs is), then this package's processor with ``TORCH_SDPA``,
``TRTLLM_ATTN`` (Cosmos 3's causal stream on ``auto``: TRTLLM_ATTN runs non-causal attention only) and ``auto``.
Each row: median of ``--repeats`` layer calls timed with CUDA events after ``--warmup`` calls (the first
TRTLLM_ATTN call on a Hopper machine JIT-builds FMHAv2, ~90 s, before timing starts), relative error
``||out - ref|| / ||ref||`` over the outputs the model uses (HunyuanVideo: video tokens and valid text tokens)
against the 1e-2 bf16 tolerance, and what ran (``backend:mode`` per attention call). A configuration that cannot
run is a row with the reason (TRTLLM_ATTN refuses Cosmos 3's generation stream on Hopper: FMHAv2 was wrong for
fewer queries than keys).

    PYTHONPATH=. python benchmarks/models_attention.py             # CUDA; JSON to $OUT/models_attention.json
    PYTHONPATH=. python benchmarks/models_attention.py --tiny      # CPU, tiny shapes, seconds (a smoke test)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import diffusers
import torch
from diffusers.models.transformers.transformer_cosmos3 import (Cosmos3AttnProcessor, Cosmos3PackedMoTAttention,
                                                               Cosmos3VLTextRotaryEmbedding)
from diffusers.models.transformers.transformer_hunyuan_video15 import (HunyuanVideo15AttnProcessor2_0,
                                                                       HunyuanVideo15RotaryPosEmbed,
                                                                       HunyuanVideo15TransformerBlock)

from diffusers_trtllm import Cosmos3TrtllmAttnProcessor, HunyuanVideo15TrtllmAttnProcessor
from diffusers_trtllm.platform import flashinfer_version, gpu_arch

TOLERANCE = 1e-2  # bf16
DEFAULT_LABEL = "diffusers default"


@dataclass
class Case:
    """One attention layer, its inputs, and which of its outputs the model uses."""

    model: str
    shape: str
    attn: torch.nn.Module
    inputs: dict  # keyword arguments of the layer's forward
    default_processor: object
    processor_class: type
    used_outputs: Callable[[tuple], list[torch.Tensor]]
    causal_role: str | None = None  # a role TRTLLM_ATTN cannot run (sent to auto in the TRTLLM_ATTN row)


@dataclass
class Row:
    model: str
    shape: str
    config: str
    ms: float | None = None
    rel_err: float | None = None
    within_tolerance: bool | None = None
    ran: str = ""
    compared_to: str | None = None  # the reference row's config
    error: str = ""
    calls_ms: list = field(default_factory=list)


def hunyuan_video15_case(tiny: bool, device: torch.device, dtype: torch.dtype, valid_text: int | None) -> Case:
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

    return Case("HunyuanVideo 1.5", f"{video_len:,} video + {text_len:,} text ({valid_text:,} valid), {heads} heads × "
                f"{head_dim}", attn, dict(hidden_states=video, encoder_hidden_states=text, attention_mask=mask,
                                       image_rotary_emb=rotary), HunyuanVideo15AttnProcessor2_0(),
                HunyuanVideo15TrtllmAttnProcessor, used_outputs)


def cosmos3_case(tiny: bool, device: torch.device, dtype: torch.dtype) -> Case:
    # Cosmos3OmniTransformer's defaults: hidden 4,096, 32 query / 8 key-value heads of 128, mRoPE sections 24/20/20
    heads, kv_heads, head_dim, hidden, rope_axes = (4, 2, 128, 512, (24, 20, 20)) if tiny else \
        (32, 8, 128, 4096, (24, 20, 20))
    und_len, gen_len = (40, 200) if tiny else (600, 19_320)
    with torch.device(device):
        attn = Cosmos3PackedMoTAttention(hidden_size=hidden, head_dim=head_dim, num_attention_heads=heads,
                                         num_key_value_heads=kv_heads, attention_bias=False,
                                         rms_norm_eps=1e-6).to(dtype).eval()
        rope = Cosmos3VLTextRotaryEmbedding(head_dim=head_dim, rope_theta=5e6, rope_axes_dim=rope_axes)
        positions = torch.arange(und_len + gen_len)[None, None].expand(3, 1, -1)
        cos, sin = (x.squeeze(0) for x in rope(positions, device, dtype))
        und = torch.randn(und_len, hidden, dtype=dtype)
        gen = torch.randn(gen_len, hidden, dtype=dtype)
    rotary = (cos[:und_len], sin[:und_len], cos[und_len:], sin[und_len:])
    return Case("Cosmos 3", f"{und_len:,} causal text + {gen_len:,} generation queries on {und_len + gen_len:,} "
                f"keys, {heads}/{kv_heads} heads × {head_dim}", attn,
                dict(und_seq=und, gen_seq=gen, rotary_emb=rotary), Cosmos3AttnProcessor(), Cosmos3TrtllmAttnProcessor,
                list, causal_role="und_causal")


def configs(case: Case) -> dict[str, dict]:
    trtllm = {"default": {"backend": "TRTLLM_ATTN"}}
    if case.causal_role is not None:
        trtllm["per_role"] = {case.causal_role: {"backend": "auto"}}
    return {"TORCH_SDPA": {"default": {"backend": "TORCH_SDPA"}}, "TRTLLM_ATTN": trtllm,
            "auto": {"default": {"backend": "auto"}}}


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


def bench_case(case: Case, device: torch.device, warmup: int, repeats: int) -> list[Row]:
    """One row per processor. The first that runs (diffusers' default unless it fails) is the reference."""
    processors = {DEFAULT_LABEL: case.default_processor,
                  **{label: case.processor_class(config) for label, config in configs(case).items()}}
    rows, reference, reference_label = [], None, None

    def call():
        with torch.no_grad():
            return case.attn(**case.inputs)

    for label, processor in processors.items():
        row = Row(case.model, case.shape, label)
        try:
            case.attn.set_processor(processor)
            outputs = case.used_outputs(call())
            if reference is None:
                reference, reference_label = [t.clone() for t in outputs], label
            else:
                row.rel_err = rel_err(outputs, reference)
                row.within_tolerance = row.rel_err <= TOLERANCE
            row.compared_to = reference_label
            del outputs
            row.calls_ms = timed_calls(call, device, warmup, repeats)
            row.ms = statistics.median(row.calls_ms)
            calls = getattr(processor, "calls", None)
            row.ran = "diffusers" if calls is None else ", ".join(
                f"{role}: {call.backend}:{call.mode(bool(call.skip_value))}" for role, call in calls.items())
        except Exception as exc:  # noqa: BLE001 - a configuration that cannot run is a row with its reason
            row.error = f"{type(exc).__name__}: {exc}"
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
    case.attn.set_processor(case.default_processor)
    return rows


def markdown(rows: list[Row]) -> str:
    lines = ["| model | shape | config | ms (median) | speed vs reference | rel. err | ≤ 1e-2 | ran |",
             "|---|---|---|---:|---:|---:|:-:|---|"]
    reference_ms = {(r.model, r.config): r.ms for r in rows}
    for r in rows:
        if r.error:
            lines.append(f"| {r.model} | {r.shape} | {r.config} | – | – | – | – | not run: {r.error} |")
            continue
        speedup = f"{reference_ms[r.model, r.compared_to] / r.ms:.2f}×"
        err = "reference" if r.rel_err is None else f"{r.rel_err:.2e} (vs {r.compared_to})"
        ok = "" if r.within_tolerance is None else ("yes" if r.within_tolerance else "**no**")
        lines.append(f"| {r.model} | {r.shape} | {r.config} | {r.ms:.2f} | {speedup} | {err} | {ok} | {r.ran} |")
    return "\n".join(lines)


def environment(device: torch.device) -> dict:
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "arch": gpu_arch(device), "torch": torch.__version__, "diffusers": diffusers.__version__,
            "flashinfer": flashinfer_version(), "python": platform.python_version()}


def main(argv=None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke test of this script)")
    parser.add_argument("--models", nargs="+", choices=("hunyuan", "cosmos"), default=("hunyuan", "cosmos"))
    parser.add_argument("--valid-text", type=int, default=None,
                        help="valid text tokens of HunyuanVideo 1.5 (default 256; 20 of 64 with --tiny)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output", type=Path, default=None,
                        help="JSON path (default: $OUT/models_attention.json, else ./models_attention.json)")
    args = parser.parse_args(argv)

    device, dtype = torch.device(args.device), torch.bfloat16
    torch.manual_seed(0)
    rows = []
    for model in args.models:
        case = hunyuan_video15_case(args.tiny, device, dtype, args.valid_text) if model == "hunyuan" else \
            cosmos3_case(args.tiny, device, dtype)
        rows += bench_case(case, device, args.warmup, args.repeats)
        del case
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(markdown(rows))
    output = args.output or Path(os.environ.get("OUT", ".")) / "models_attention.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"environment": environment(device), "tiny": args.tiny, "tolerance": TOLERANCE,
                                  "rows": [asdict(r) for r in rows]}, indent=2))
    print(f"wrote {output}")
    return rows


if __name__ == "__main__":
    main()

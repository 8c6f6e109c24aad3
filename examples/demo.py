"""Generate one video per attention configuration and compare them: time, achieved sparsity, difference to dense.

Default: a tiny randomly initialised Wan 2.2 A14B-shaped pipeline (two experts, UniPC) on the CPU, no downloads::

    python examples/demo.py

On a GPU with a real model (same configurations, TRT-LLM kernels)::

    python examples/demo.py --model Wan-AI/Wan2.2-T2V-A14B-Diffusers --height 720 --width 1280 --frames 81 \\
        --steps 40 --backend TRTLLM_ATTN --output-dir outputs
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch

from diffusers_trtllm import AttentionConfig, enable_trtllm_attention
from evaluation import VideoShape, export_frames, find_model, generate_frames, load_pipeline

REFERENCE_LABEL = "dense (TORCH_SDPA)"


def demo_configs(backend: str, threshold: float, gate: float) -> dict[str, AttentionConfig]:
    """The configurations compared, by label; the first is the reference."""
    skip = {"threshold": threshold, "disabled_until_timestep": gate}
    specs = {
        REFERENCE_LABEL: {"backend": "TORCH_SDPA"},
        f"dense ({backend})": {"backend": backend},
        f"skip λ={threshold:g}, D={gate:g}": {"backend": backend, "skip_softmax": skip},
        "SAGE int8": {"backend": backend, "quant": {"dtype_qk": "int8"}},
        "SAGE fp8": {"backend": backend, "quant": {"dtype_qk": "fp8_e4m3"}},
        "SAGE fp8 + skip": {"backend": backend, "quant": {"dtype_qk": "fp8_e4m3"}, "skip_softmax": skip},
    }
    return {label: AttentionConfig.from_dict({"default": spec}) for label, spec in specs.items()}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="Wan 2.2, HunyuanVideo 1.5 or Cosmos 3 model id, alias or path (default: tiny Wan 2.2)")
    parser.add_argument("--prompt", default="A red fox runs through fresh snow at dawn, cinematic")
    parser.add_argument("--height", type=int, default=192)
    parser.add_argument("--width", type=int, default=320)
    parser.add_argument("--frames", type=int, default=9)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="auto", help="backend for the non-reference configs")
    parser.add_argument("--threshold", type=float, default=0.5, help="Skip-Softmax λ")
    parser.add_argument("--gate", type=float, default=0.9, help="disabled_until_timestep D")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output-dir", type=Path, default=None, help="write one MP4 per configuration here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    entry = find_model(args.model or "wan")
    pipe = load_pipeline(entry, tiny=args.model is None, device=args.device, dtype=dtype, source=args.model)
    pipe.set_progress_bar_config(desc="denoising", leave=False)
    shape = VideoShape(args.height, args.width, args.frames, args.steps)
    rows, reference = [], None
    for label, config in demo_configs(args.backend, args.threshold, args.gate).items():
        with enable_trtllm_attention(pipe, config) as handle:
            start = time.perf_counter()
            video = generate_frames(pipe, entry, args.prompt, shape, args.seed)
            seconds = time.perf_counter() - start
        summary = handle.stats.summary()
        if reference is None:
            reference = video
        rel = ((video - reference).norm() / reference.norm()).item()
        backends = sorted({mode.split(":")[0] for modes in summary["modes"].values() for mode in modes})
        rows.append(dict(config=label, backends=",".join(backends), seconds=seconds, rel_diff=rel,
                         sparsity=summary["sparsity"], per_step=summary["per_step"]))
        if args.output_dir is not None:
            args.output_dir.mkdir(parents=True, exist_ok=True)
            name = "".join(ch if ch.isascii() and ch.isalnum() else "_" for ch in label).strip("_")
            export_frames(video, str(args.output_dir / f"{name}.mp4"), fps=entry.fps)
    print(format_table(rows))
    return rows


def format_table(rows: list[dict]) -> str:
    def fmt(x):
        return "n/a" if x is None else f"{x:.3f}"

    lines = ["| config | ran on | time (s) | rel. diff to dense | sparsity | sparsity per step |",
             "|---|---|---:|---:|---:|---|"]
    for r in rows:
        steps = " ".join(fmt(v) for _, v in sorted(r["per_step"].items()))
        lines.append(f"| {r['config']} | {r['backends']} | {r['seconds']:.2f} | {r['rel_diff']:.2e} | "
                     f"{fmt(r['sparsity'])} | {steps} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

"""Generate one video per attention configuration and compare them: time, achieved sparsity, difference to dense.

Default: a tiny randomly initialised Wan 2.2 A14B-shaped pipeline (two experts, UniPC) on the CPU, no downloads::

    python examples/demo.py

On a GPU with a real model (same configurations, TRT-LLM kernels)::

    python examples/demo.py --model Wan-AI/Wan2.2-T2V-A14B-Diffusers --height 720 --width 1280 --frames 81 \\
        --steps 40 --backend TRTLLM_ATTN --output-dir outputs

``--probe-rows N`` switches the accuracy probe on in every configuration: a column with the relative error of
what ran against exact attention on N query rows per call, at every step.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch

from diffusers_trtllm import AttentionConfig, enable_trtllm_attention
from diffusers_trtllm.config import AccuracySpec
from diffusers_trtllm.backends.trtllm import device_unavailable_reason
from diffusers_trtllm.config import TORCH_REFERENCE, TRTLLM_ATTN
from diffusers_trtllm.kernels.triton_sage import SKIP_PAYS_FROM
from evaluation import (VideoShape, describe_config, export_frames, generate_frames, load_model, open_gate,
                        resolve_model)
from evaluation.cli import (ArgumentParser, check_backends, check_device, check_installs, check_output, check_shape,
                            default_device, plain_warnings, positive_int, require_packages, user_errors)

REFERENCE_LABEL = "dense (TORCH_SDPA)"
WARMUP_STEPS = 1


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


def parse_args(argv=None) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="Wan 2.2, HunyuanVideo 1.5 or Cosmos 3 model id, alias or path (default: tiny Wan 2.2)")
    parser.add_argument("--prompt", default="A red fox runs through fresh snow at dawn, cinematic")
    parser.add_argument("--height", type=positive_int, default=192)
    parser.add_argument("--width", type=positive_int, default=320)
    parser.add_argument("--frames", type=positive_int, default=9)
    parser.add_argument("--steps", type=positive_int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default=None,
                        help="backend for the non-reference configs (default: TRTLLM_ATTN on a GPU with its kernels, "
                             "else TORCH_REFERENCE; auto never picks TORCH_REFERENCE, so on a CPU it runs Skip-Softmax "
                             "and SAGE configs dense)")
    parser.add_argument("--threshold", type=float, default=0.5, help="Skip-Softmax λ")
    parser.add_argument("--gate", type=float, default=0.9, help="disabled_until_timestep D")
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--output-dir", type=Path, default=None, help="write one MP4 per configuration here")
    parser.add_argument("--probe-rows", type=positive_int, default=None,
                        help="accuracy probe: query rows per attention call checked against exact attention")
    return parser.parse_args(argv), parser


def main(argv=None) -> list[dict]:
    plain_warnings()
    args, parser = parse_args(argv)
    device = check_device(parser, args.device)
    backend = args.backend or (TRTLLM_ATTN if device_unavailable_reason(device) is None else TORCH_REFERENCE)
    with user_errors(parser):  # a bad backend, λ, D or model stops here, before any video
        configs = demo_configs(backend, args.threshold, args.gate)
        entry, folder = resolve_model(args.model)
    shape = VideoShape(args.height, args.width, args.frames, args.steps)
    check_shape(parser, entry, shape)
    check_backends(parser, list(configs.values()), device)
    if args.output_dir is not None:
        require_packages(parser, "--output-dir (MP4 export)", "imageio", "imageio_ffmpeg")
        check_output(parser, "--output-dir", args.output_dir, folder=True)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with user_errors(parser):
        pipe = load_model(entry, folder, tiny=args.model is None, device=args.device, dtype=dtype)
    check_installs(parser, pipe, list(configs.values()))
    pipe.set_progress_bar_config(desc="denoising", leave=False)
    model_name = entry.name + (" (tiny, random weights)" if args.model is None else "")
    print(f"{model_name}: {shape.height}×{shape.width}, {shape.frames} frames, {shape.steps} steps, seed "
          f"{args.seed}, {device}; {len(configs)} attention configurations, each timed after an untimed "
          f"{WARMUP_STEPS}-step warm-up with its timestep gate open (every kernel it uses runs once)", flush=True)
    rows, reference = [], None
    for i, (label, config) in enumerate(configs.items(), 1):
        print(f"[{i}/{len(configs)}] {label}: {describe_config(config)}", flush=True)
        with user_errors(parser):
            with enable_trtllm_attention(pipe, open_gate(config), collect_stats=False):
                generate_frames(pipe, entry, args.prompt, shape, args.seed, steps=WARMUP_STEPS)  # VAE decode too
            probed = config.with_accuracy(AccuracySpec(probe_rows=args.probe_rows)) if args.probe_rows else config
            with enable_trtllm_attention(pipe, probed) as handle:
                start = time.perf_counter()
                video = generate_frames(pipe, entry, args.prompt, shape, args.seed)
                seconds = time.perf_counter() - start
        summary = handle.stats.summary()
        if reference is None:
            reference = video
        rel = ((video - reference).norm() / reference.norm()).item()
        backends = sorted({mode.split(":")[0] for modes in summary["modes"].values() for mode in modes})
        rows.append(dict(config=label, backends=",".join(backends), seconds=seconds, rel_diff=rel,
                         skips=config.default.skip_softmax is not None, sparsity=summary["sparsity"],
                         per_step=summary["per_step"], skipping=handle.stats.skipping(), error=summary["error"]))
        if args.output_dir is not None:
            args.output_dir.mkdir(parents=True, exist_ok=True)
            name = "".join(ch if ch.isascii() and ch.isalnum() else "_" for ch in label).strip("_")
            export_frames(video, str(args.output_dir / f"{name}.mp4"), fps=entry.fps)
    print("\n" + explanation(rows, tiny=args.model is None, threshold=args.threshold, gate=args.gate,
                              on_gpu=device.type == "cuda"))
    print(format_table(rows))
    return rows


def explanation(rows: list[dict], *, tiny: bool, threshold: float, gate: float, on_gpu: bool) -> str:
    """The header lines: what each column means and what the numbers can and cannot say here."""
    lines = [
        "Columns:",
        "- ran on: the backends that ran the attention calls",
        "- time: the whole generation (text encoder, denoising, VAE decode), after the warm-up",
        "- rel. diff to dense: ||video - dense video|| / ||dense video|| over all pixels (0: identical video)",
        "- sparsity: skipped / all KV tiles (128x128; 64x128 for SAGE on Hopper) where Skip-Softmax ran and the "
        "backend counts them (TORCH_REFERENCE and the SAGE kernels do, FlashInfer's bf16 ones do not: n/a); "
        "'-': the configuration does not skip",
        f"- sparsity per step: the same per denoising step; 'off': the step ran no Skip-Softmax (the timestep gate "
        f"keeps steps with t > D = {gate:g} dense; t is the step's noise level sigma, timestep/1000)",
    ]
    if not on_gpu:
        lines.append(f"- SAGE + skip on a CPU follows the Triton SAGE kernel's rule (a head skips only where a "
                     f"sample of its query tiles skips at least {SKIP_PAYS_FROM:.0%} of the KV tiles, else attends "
                     "dense), so with little to skip it skips less than skip alone")
    if tiny:
        lines.append(f"- random weights give nearly uniform attention, so λ = {threshold:g} finds few KV tiles "
                     "whose contribution is negligible (the tiny model is made slightly local so that some are); "
                     "trained video models attend locally and skip far more at the same λ")
    if not on_gpu or any("TORCH_REFERENCE" in r["backends"] for r in rows):
        lines.append("- TORCH_REFERENCE is a PyTorch model of the kernels' arithmetic (exact Skip-Softmax rule, "
                     "SAGE quantization): its times, and any time on a CPU, say nothing about GPU speed "
                     "(H200 numbers: benchmarks/RESULTS.md)")
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    def fmt(x):
        return "n/a" if x is None else f"{x:.3f}"

    probed = any(r.get("error") is not None for r in rows)
    lines = ["| config | ran on | time (s) | rel. diff to dense | sparsity | sparsity per step |"
             + (" probed error |" if probed else ""), "|---|---|---:|---:|---:|---|" + ("---:|" if probed else "")]
    for r in rows:
        if r["skips"]:
            overall = fmt(r["sparsity"])
            steps = " ".join(fmt(v) if step in r["skipping"] else "off" for step, v in sorted(r["per_step"].items()))
        else:
            overall, steps = "-", "-"
        error = (" n/a |" if r["error"] is None else f" {r['error']:.2e} |") if probed else ""
        lines.append(f"| {r['config']} | {r['backends']} | {r['seconds']:.2f} | {r['rel_diff']:.2e} | "
                     f"{overall} | {steps} |{error}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

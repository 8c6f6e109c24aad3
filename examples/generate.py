"""Generate a video with Wan 2.2 A14B, HunyuanVideo 1.5 or Cosmos 3 with TRT-LLM attention, configured by the
vLLM-Omni flags, their environment variables or a JSON config; print what ran per step and layer.

Offline (no --model, or --tiny): the model's tiny randomly initialised pipeline, on the CPU in seconds::

    python examples/generate.py --output fox.mp4 --diffusion-attention-backend TORCH_REFERENCE

A target sparsity needs a calibrated curve: a pipeline folder written by ``examples/calibrate.py`` (its curves
are read from the transformers' ``config.json``; the shape defaults to the one it was calibrated at). Its last
line prints this command with a target inside the sparsity it observed (0.3 for its defaults)::

    python examples/calibrate.py
    python examples/generate.py --model calibrated_tiny --diffusion-attention-backend TORCH_REFERENCE \\
        --trtllm-gen-target-sparsity 0.3

The accuracy probe (this package's extension of the config: a spec's ``"accuracy": {"probe_rows": 16}``, with
``"max_error"`` for the guard) adds a per-layer table of the relative error of what ran against exact attention.

A real model on a GPU: FP8 SAGE, dense while t > 0.86 and Skip-Softmax by λ after, cross-attention on cuDNN::

    DIFFUSION_ATTENTION_CONFIG='{"default": {"backend": "TRTLLM_ATTN", "skip_softmax": {"threshold": 0.3}},
        "per_role": {"cross": {"backend": "TORCH_SDPA"}}}' python examples/generate.py --model wan \\
        --output fox.mp4 --trtllm-gen-sage --trtllm-gen-disabled-until-timestep 0.86
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from diffusers_trtllm import add_attention_args, config_from_args, enable_trtllm_attention
from diffusers_trtllm.calibration import calibrations_from_pretrained
from diffusers_trtllm.calibration.checkpoint import SIDECAR_NAME
from diffusers_trtllm.config import TRANSFORMER_COMPONENTS
from evaluation import (MODELS, TransformerTimer, VideoShape, describe_attention_plan, describe_config,
                        export_frames, format_number, generate_frames, load_model, resolve_model, synchronize)
from evaluation.cli import (ArgumentParser, check_backends, check_device, check_installs, check_output, check_shape,
                            default_device, plain_warnings, positive_int, require_packages, user_errors)


def parse_args(argv=None) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help=f"model id or alias: {[e.model_id for e in MODELS.values()]}, or a local pipeline "
                             "folder (default: tiny Wan 2.2)")
    parser.add_argument("--tiny", action="store_true",
                        help="the model's tiny random pipeline (the default when --model is not given)")
    parser.add_argument("--prompt", default="A red fox runs through fresh snow at dawn, cinematic")
    parser.add_argument("--height", type=positive_int, default=None)
    parser.add_argument("--width", type=positive_int, default=None)
    parser.add_argument("--frames", type=positive_int, default=None)
    parser.add_argument("--steps", type=positive_int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--output", type=Path, default=Path("output.mp4"), help="MP4 to write")
    add_attention_args(parser)
    return parser.parse_args(argv), parser


def calibrated_shape(folder: Path) -> VideoShape | None:
    """The deployment shape a folder written by calibrate.py was calibrated at (from its sidecars), or None."""
    for component in TRANSFORMER_COMPONENTS:
        sidecar = folder / component / SIDECAR_NAME
        if sidecar.is_file():
            shape = json.loads(sidecar.read_text()).get("deployment")
            if shape:
                return VideoShape(shape["height"], shape["width"], shape["num_frames"], shape["num_inference_steps"])
    return None


def describe_calibrations(folder: Path, shape: VideoShape | None) -> str:
    """What enable_trtllm_attention will read from ``folder``: the curve of each calibrated component."""
    curves = calibrations_from_pretrained(folder)
    if not curves:
        return f"no Skip-Softmax calibration in {folder} (target_sparsity needs one; λ via a config's threshold works)"
    lines = [f"Skip-Softmax calibration loaded from {folder}"
             + (f" (calibrated at {shape.height}×{shape.width}, {shape.frames} frames, {shape.steps} steps)"
                if shape else "") + ":"]
    for component, curve in curves.items():
        observed = (f", observed sparsity {curve.sparsity_range[0]:.2f}–{curve.sparsity_range[1]:.2f}"
                    if curve.sparsity_range else "")
        suggested = (f", suggests target_sparsity {curve.target_sparsity:g}" if curve.target_sparsity is not None
                     else "")
        lines.append(f"  {component}: factor = a·exp(b·s), a = {curve.a:.4g}, b = {curve.b:.4g}{observed}{suggested}")
    lines.append("  used where the config sets target_sparsity (--trtllm-gen-target-sparsity S)")
    return "\n".join(lines)


def main(argv=None) -> dict:
    plain_warnings()
    args, parser = parse_args(argv)
    device = check_device(parser, args.device)
    with user_errors(parser):  # flags, environment variables and the model: a mistake stops here, before loading
        config = config_from_args(args)
        entry, folder = resolve_model(args.model)
    if args.tiny and folder is not None:
        parser.error(f"--tiny builds a random pipeline and --model {args.model} is a pipeline folder: give one")
    args.tiny = args.tiny or args.model is None
    checkpoint_shape = calibrated_shape(folder) if folder is not None else None
    default = checkpoint_shape or (entry.tiny_shape if args.tiny else entry.shape)
    shape = VideoShape(args.height or default.height, args.width or default.width, args.frames or default.frames,
                       args.steps or default.steps)
    check_shape(parser, entry, shape)
    check_output(parser, "--output", args.output, folder=False)
    check_backends(parser, [config], device)
    require_packages(parser, "writing the MP4", "imageio", "imageio_ffmpeg")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with user_errors(parser):
        pipe = load_model(entry, folder, tiny=args.tiny, device=args.device, dtype=dtype)
    check_installs(parser, pipe, [config])
    source = "tiny, random weights" if args.tiny else str(folder or entry.model_id)
    print(f"{entry.name} ({source}): {shape.height}×{shape.width}, {shape.frames} frames, {shape.steps} steps, "
          f"seed {args.seed}, {device}")
    if folder is not None:
        print(describe_calibrations(folder, checkpoint_shape))
    print(f"attention config: {describe_config(config)}", flush=True)
    pipe.set_progress_bar_config(desc="denoising")
    with user_errors(parser):
        with enable_trtllm_attention(pipe, config) as handle, TransformerTimer.for_pipeline(pipe) as timer:
            synchronize(device)
            start = time.perf_counter()
            frames = generate_frames(pipe, entry, args.prompt, shape, args.seed)
            synchronize(device)
            seconds = time.perf_counter() - start
    summary = handle.stats.summary()
    plan = describe_attention_plan(handle.stats)
    print("\nattention plan (what ran per step and layer; sparsity where Skip-Softmax ran and was counted):\n"
          + plan)
    skipping = handle.stats.skipping()
    if skipping:
        per_step = ", ".join(f"{step}: {format_number(value, 3) if step in skipping else 'off'}"
                             for step, value in summary["per_step"].items())
        print("\nachieved sparsity per step, over the layers that ran Skip-Softmax in it (off: none did, e.g. the "
              f"timestep gate kept the step dense; n/a: the backend does not count): {per_step}")
        print("overall sparsity, over the calls that ran Skip-Softmax (dense layers and steps not averaged in): "
              f"{format_number(summary['sparsity'], 3)}")
    ran = {mode for modes in summary["modes"].values() for mode in modes}
    if ran <= {"TORCH_SDPA:dense"}:
        print("\nnote: every attention call ran dense on TORCH_SDPA, as diffusers' own attention does: no feature of "
              "diffusers_trtllm ran (auto found no TRT-LLM kernel here). On a CPU, --diffusion-attention-backend "
              "TORCH_REFERENCE with --trtllm-gen-sage or a skip setting runs the kernels' semantics")
    if summary["error"] is not None:
        print("\naccuracy probe (relative error of what ran against exact float64 attention on the probed rows, "
              f"over its probed steps; all layers: {summary['error']:.2e}):\n" + handle.stats.error_table())
    print(f"run {seconds:.2f} s, of which transformer {timer.total:.2f} s in {len(timer.seconds())} calls"
          + ("" if device.type == "cuda" else " (CPU times say nothing about GPU speed)"))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    export_frames(frames, str(args.output), entry.fps)
    print(f"wrote {args.output}")
    return {"frames": frames, "summary": summary, "seconds": seconds, "transformer_seconds": timer.total,
            "plan": plan, "output": args.output, "shape": shape}


if __name__ == "__main__":
    main()

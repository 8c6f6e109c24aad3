"""Generate a video with Wan 2.2 A14B, HunyuanVideo 1.5 or Cosmos 3 with TRT-LLM attention, configured by the
vLLM-Omni flags, their environment variables or a JSON config; print what ran per step and layer.

Offline (no --model, or --tiny): the model's tiny randomly initialised pipeline, on the CPU in seconds::

    python examples/generate.py --output fox.mp4 --diffusion-attention-backend TORCH_REFERENCE

A real model on a GPU::

    python examples/generate.py --model Wan-AI/Wan2.2-T2V-A14B-Diffusers --output fox.mp4 \\
        --diffusion-attention-backend trtllm-gen --trtllm-gen-sage \\
        --trtllm-gen-target-sparsity 0.5 --trtllm-gen-disabled-until-timestep 0.86
    DIFFUSION_ATTENTION_CONFIG='{"default": {"backend": "TRTLLM_ATTN", "skip_softmax": {"threshold": 0.3}},
        "per_role": {"cross": {"backend": "TORCH_SDPA"}}}' python examples/generate.py --model wan --output fox.mp4
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch

from diffusers_trtllm import add_attention_args, config_from_args, enable_trtllm_attention
from evaluation import (MODELS, TransformerTimer, VideoShape, describe_attention_plan,
                                         entry_for_pipeline, export_frames, find_model, format_number,
                                         generate_frames, load_pipeline, synchronize)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help=f"model id or alias: {[e.model_id for e in MODELS.values()]}, or a local pipeline "
                             "folder (default: tiny Wan 2.2)")
    parser.add_argument("--tiny", action="store_true",
                        help="the model's tiny random pipeline (the default when --model is not given)")
    parser.add_argument("--prompt", default="A red fox runs through fresh snow at dawn, cinematic")
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--frames", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output", type=Path, default=Path("output.mp4"), help="MP4 to write")
    add_attention_args(parser)
    args = parser.parse_args(argv)
    args.tiny = args.tiny or args.model is None
    return args


def load(args, dtype: torch.dtype):
    """``(entry, pipeline)`` for ``--model``: a known id or alias, or a local folder of one of their pipelines."""
    if args.model is not None and Path(args.model).is_dir():
        import diffusers

        pipe = diffusers.DiffusionPipeline.from_pretrained(args.model, torch_dtype=dtype).to(args.device)
        return entry_for_pipeline(pipe), pipe
    entry = find_model(args.model) if args.model else next(iter(MODELS.values()))
    return entry, load_pipeline(entry, tiny=args.tiny, device=args.device, dtype=dtype)


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config = config_from_args(args)  # flags and environment variables; a contradiction stops here, before loading
    dtype = torch.bfloat16 if torch.device(args.device).type == "cuda" else torch.float32
    entry, pipe = load(args, dtype)
    default = entry.tiny_shape if args.tiny else entry.shape
    shape = VideoShape(args.height or default.height, args.width or default.width, args.frames or default.frames,
                       args.steps or default.steps)
    print(f"{entry.name}{' (tiny, random weights)' if args.tiny else ''}: {shape.height}×{shape.width}, "
          f"{shape.frames} frames, {shape.steps} steps, seed {args.seed}, {args.device}")
    print(f"attention config: {config.to_json()}")
    pipe.set_progress_bar_config(desc="denoising")
    with enable_trtllm_attention(pipe, config) as handle, TransformerTimer.for_pipeline(pipe) as timer:
        synchronize(args.device)
        start = time.perf_counter()
        frames = generate_frames(pipe, entry, args.prompt, shape, args.seed)
        synchronize(args.device)
        seconds = time.perf_counter() - start
    summary = handle.stats.summary()
    print("\nattention plan (what ran per step and layer):\n" + describe_attention_plan(handle.stats))
    per_step = ", ".join(f"{step}: {format_number(value, 3)}" for step, value in summary["per_step"].items())
    print(f"\nachieved sparsity per step (n/a: the backend does not count): {per_step}")
    print(f"overall sparsity: {format_number(summary['sparsity'], 3)}; run {seconds:.2f} s, of which transformer "
          f"{timer.total:.2f} s in {len(timer.seconds())} calls")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    export_frames(frames, str(args.output), entry.fps)
    print(f"wrote {args.output}")
    return {"frames": frames, "summary": summary, "seconds": seconds, "transformer_seconds": timer.total,
            "plan": describe_attention_plan(handle.stats), "output": args.output}


if __name__ == "__main__":
    main()

"""Context parallelism: one pipeline call split over N processes (ring attention, Ulysses, or both), with this
package's attention, through diffusers' own ``enable_parallelism`` and :func:`diffusers_trtllm.context_parallel_plan`.

Offline (no --model-id): the model's tiny randomly initialised pipeline on the CPU (gloo); rank 0 also runs the
same call in one process and prints the largest relative difference (float32 rounding for dense attention)::

    torchrun --nproc-per-node 2 examples/context_parallel.py --model hunyuan --ring 2
    torchrun --nproc-per-node 4 examples/context_parallel.py --model cosmos --ring 2 --ulysses 2

A real model on N GPUs (NCCL), rank 0 writing the video. Ring attention needs the log-sum-exp, which only
``TORCH_REFERENCE`` returns today; Ulysses runs on every backend::

    torchrun --nproc-per-node 2 examples/context_parallel.py --model wan \\
        --model-id Wan-AI/Wan2.2-T2V-A14B-Diffusers --ulysses 2 \\
        --config '{"default": {"backend": "TRTLLM_ATTN", "skip_softmax": {"threshold": 0.3}}}' --output fox.mp4
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from diffusers import ContextParallelConfig
from evaluation.cli import ArgumentParser, positive_int

from diffusers_trtllm import context_parallel_plan, enable_trtllm_attention
from diffusers_trtllm.install import pipeline_transformers
from diffusers_trtllm.tiny_pipelines import (tiny_cosmos3_pipeline, tiny_hunyuan_video15_pipeline,
                                             tiny_wan22_pipeline)

TINY = {"wan": tiny_wan22_pipeline, "hunyuan": tiny_hunyuan_video15_pipeline, "cosmos": tiny_cosmos3_pipeline}
#: tiny shapes whose video tokens divide by 2 and 4 ranks
TINY_CALL = {"wan": dict(height=32, width=32, num_frames=5), "hunyuan": dict(height=64, width=64, num_frames=5),
             "cosmos": dict(height=32, width=48, num_frames=1)}


def parse_args(argv=None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(TINY), default="wan")
    parser.add_argument("--model-id", help="a diffusers pipeline (hub id or folder); default: the tiny pipeline")
    parser.add_argument("--ring", type=positive_int, default=1, help="ring_degree")
    parser.add_argument("--ulysses", type=positive_int, default=1, help="ulysses_degree")
    parser.add_argument("--config", default='{"default": {"backend": "TORCH_REFERENCE"}}',
                        help="this package's attention config (JSON)")
    parser.add_argument("--prompt", default="a red fox running through fresh snow")
    parser.add_argument("--steps", type=positive_int, default=2)
    parser.add_argument("--output", help="an MP4 rank 0 writes (a real model)")
    args = parser.parse_args(argv)
    if args.ring * args.ulysses < 2:
        parser.error(f"--ring {args.ring} × --ulysses {args.ulysses} splits the call over one process: give a degree "
                     "of 2 or more and as many processes, e.g. torchrun --nproc-per-node 2 "
                     "examples/context_parallel.py --model hunyuan --ring 2")
    if args.ring * args.ulysses != int(os.environ.get("WORLD_SIZE", "1")):
        parser.error(f"--ring {args.ring} × --ulysses {args.ulysses} must equal the processes torchrun starts "
                     f"(WORLD_SIZE={os.environ.get('WORLD_SIZE', 'unset')})")
    return args


def load(args, device: torch.device):
    if args.model_id is None:
        return TINY[args.model]()
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.from_pretrained(args.model_id, torch_dtype=torch.bfloat16).to(device)


def generate(pipe, args, seed: int = 0):
    """The call's video (latents for a tiny pipeline, else frames as an array), batch dimension dropped."""
    call = TINY_CALL[args.model] if args.model_id is None else {}
    out = pipe(args.prompt, num_inference_steps=args.steps, output_type="latent" if args.model_id is None else "np",
               generator=torch.Generator().manual_seed(seed), **call)
    video = out.video if hasattr(out, "video") else out.frames[0]  # Cosmos 3 returns one video, named so
    return video[0] if isinstance(video, list) else video


def main(argv=None) -> None:
    args = parse_args(argv)
    gpu = torch.cuda.is_available() and args.model_id is not None
    dist.init_process_group("nccl" if gpu else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    else:
        torch.accelerator.device_count = lambda: 1  # diffusers picks rank % accelerators as the device: the CPU
    pipe = load(args, device)
    pipe.set_progress_bar_config(disable=True)
    handle = enable_trtllm_attention(pipe, args.config)
    for transformer in pipeline_transformers(pipe).values():
        transformer.enable_parallelism(config=ContextParallelConfig(ring_degree=args.ring, ulysses_degree=args.ulysses),
                                       cp_plan=context_parallel_plan(transformer))
    with torch.no_grad():
        video = generate(pipe, args)
    if rank == 0:
        modes = sorted({record.mode for record in handle.stats.records.values()})
        print(f"{args.model}: ring {args.ring} × Ulysses {args.ulysses}, attention modes {modes}")
        if args.model_id is None:
            single = TINY[args.model]()
            single.set_progress_bar_config(disable=True)
            with enable_trtllm_attention(single, args.config), torch.no_grad():
                expected = generate(single, args)
            print(f"largest relative difference to one process: "
                  f"{((video - expected).abs().max() / expected.abs().max()).item():.2e}")
        elif args.output:
            from diffusers.utils import export_to_video

            export_to_video(video, args.output, fps=16)
            print(f"wrote {args.output}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

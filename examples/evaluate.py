"""Fill the test plan's tables for one model: every attention configuration at one shape and seed, compared with
TORCH_SDPA dense (the reference) for quality (LPIPS, or PSNR/SSIM where LPIPS cannot load), speed-up of the
transformer calls and of the whole run, and achieved sparsity.

Offline (the default, or ``--tiny``): the model's tiny randomly initialised pipeline on the CPU, with the
TRT-LLM configurations on TORCH_REFERENCE (same Skip-Softmax and SAGE semantics, counted sparsity). Its rows are
named after the backend and dtype that ran (``TORCH_REFERENCE FP32 dense``, not ``trtllm-gen BF16 dense``) and show
no speed-up: TORCH_REFERENCE's time is not a kernel's::

    python examples/evaluate.py                     # writes evaluation_out/

A real model on a GPU (TRTLLM_ATTN), Skip-Softmax by λ; ``--source FOLDER --target-sparsity S`` instead
evaluates a pipeline folder that ``examples/calibrate.py`` calibrated, at the target S it printed::

    python examples/evaluate.py --model Wan-AI/Wan2.2-T2V-A14B-Diffusers --threshold 0.3 --output-dir eval_wan

Writes ``tables.md`` (the plan's Steps 1-4 and what ran per step and layer), ``results.json``,
``quality_vs_speedup.png``, ``sparsity.png`` (when any configuration counted skipped tiles) and, with
``--save-videos``, one MP4 per configuration.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from diffusers_trtllm import enable_trtllm_attention
from diffusers_trtllm.config import TORCH_REFERENCE, TRTLLM_ATTN, AccuracySpec, AttnQuantSpec, canonical_backend
from evaluation import (MODELS, PLAN_GATES, EvalConfig, LpipsScorer, ModelEntry, ModelLoadError, RunRecord,
                        TransformerTimer, VideoShape, backend_label, describe_attention_plan, export_frames,
                        find_model, generate_frames, load_pipeline, plan_tables, plot_quality_vs_speedup,
                        plot_sparsity, psnr, resolve_model, sageattention_peer, sageattention_unavailable_reason,
                        skip_settings, sparsity_grid, ssim, synchronize, test_plan_configs)
from evaluation.cli import (ArgumentParser, check_backends, check_device, check_installs, check_output, check_shape,
                            default_device, plain_warnings, positive_int, require_packages, user_errors)
from evaluation.models import looks_like_a_path

DEFAULT_PROMPT = "A red fox runs through fresh snow at dawn, cinematic"
DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float32: "FP32"}
NO_SPEEDUP_NOTE = ("TORCH_REFERENCE is a PyTorch model of the kernels' arithmetic, so its time is not a speed of "
                   "the kernels")


def parse_args(argv=None) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help=f"model id or alias, one of {[e.model_id for e in MODELS.values()]} "
                             "(default: the model --source holds, else tiny Wan 2.2)")
    parser.add_argument("--source", default=None,
                        help="pipeline folder (or Hub id) to load the model from (default: --model's id)")
    parser.add_argument("--tiny", action="store_true", help="the model's tiny random pipeline (the default "
                        "when --model is not given)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--height", type=positive_int, default=None)
    parser.add_argument("--width", type=positive_int, default=None)
    parser.add_argument("--frames", type=positive_int, default=None)
    parser.add_argument("--steps", type=positive_int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default=None,
                        help="backend of the TRT-LLM configurations (default: TRTLLM_ATTN on CUDA, else "
                             "TORCH_REFERENCE)")
    amount = parser.add_mutually_exclusive_group()
    amount.add_argument("--threshold", type=float, default=None, help="Skip-Softmax λ (default 0.5)")
    amount.add_argument("--target-sparsity", type=float, default=None,
                        help="Skip-Softmax target on the checkpoint's calibrated curve")
    parser.add_argument("--gates", type=float, nargs="+", default=list(PLAN_GATES),
                        help="disabled_until_timestep values D to sweep")
    parser.add_argument("--sage-dtype", choices=("fp8_e4m3", "int8"), default="fp8_e4m3")
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--warmup-steps", type=positive_int, default=1,
                        help="untimed denoising steps before each timed run (kernel builds, first-call costs)")
    parser.add_argument("--output-dir", type=Path, default=Path("evaluation_out"))
    parser.add_argument("--save-videos", action="store_true", help="write one MP4 per configuration")
    parser.add_argument("--probe-rows", type=positive_int, default=None,
                        help="accuracy probe: query rows per attention call checked against exact attention; its "
                             "per-layer table joins each configuration's 'what ran'")
    args = parser.parse_args(argv)
    if args.tiny and args.source is not None:
        parser.error(f"--tiny builds a random pipeline and --source {args.source} loads one: give one of them")
    args.tiny = args.tiny or (args.model is None and args.source is None)
    if args.threshold is None and args.target_sparsity is None:
        args.threshold = 0.5
    return args, parser


def model_entry(model: str | None, source: str | None) -> ModelEntry:
    """The model evaluated: ``--model``'s, or the one ``--source`` holds (a pipeline folder's class, or a known
    id); both given must agree where the folder tells."""
    named = find_model(model) if model is not None else None
    if source is None:
        return named or next(iter(MODELS.values()))
    try:
        held, _ = resolve_model(source, "--source")
    except ModelLoadError:
        if named is None or looks_like_a_path(source) or Path(source).expanduser().exists():
            raise
        return named  # a Hub id that --model says which model it is
    if named is not None and held is not named:
        raise ModelLoadError(f"--source {source} holds {held.name} but --model {model} is {named.name}")
    return held


def run_shape(entry: ModelEntry, args) -> VideoShape:
    default = entry.tiny_shape if args.tiny else entry.shape
    return VideoShape(args.height or default.height, args.width or default.width, args.frames or default.frames,
                      args.steps or default.steps)


def run_config(pipe, entry: ModelEntry, config: EvalConfig, shape: VideoShape, args):
    """Generate once with ``config``; return its record (times, sparsity, what ran), frames and sparsity grid."""
    record = RunRecord(config.label, config.table, config.gate)
    peer = contextlib.nullcontext()
    if config.peer is not None:
        reason = sageattention_unavailable_reason(args.device)
        if reason is not None:
            record.note = f"not run: {reason}"
            return record, None, None, ""
        peer = sageattention_peer()
    try:
        with peer:
            with enable_trtllm_attention(pipe, config.warmup, collect_stats=False):
                generate_frames(pipe, entry, args.prompt, shape, args.seed, steps=args.warmup_steps)  # + decode
            probed = (config.config.with_accuracy(AccuracySpec(probe_rows=args.probe_rows)) if args.probe_rows
                      else config.config)
            with enable_trtllm_attention(pipe, probed) as handle, TransformerTimer.for_pipeline(pipe) as timer:
                synchronize(args.device)
                start = time.perf_counter()
                frames = generate_frames(pipe, entry, args.prompt, shape, args.seed)
                synchronize(args.device)
                record.run_s = time.perf_counter() - start
            calls = timer.seconds()
    except Exception as e:  # noqa: BLE001  (one configuration failing must not lose the others' results)
        record.note = f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return record, None, None, ""
    record.transformer_s, record.transformer_calls = sum(calls), len(calls)
    summary = handle.stats.summary()
    record.sparsity, record.per_step = summary["sparsity"], summary["per_step"]
    record.skipped = bool(handle.stats.skipping())
    backends = sorted({mode.split(":")[0] for modes in summary["modes"].values() for mode in modes})
    record.ran_on = "sageattention (via TORCH_SDPA calls)" if config.peer else ", ".join(backends)
    plan = describe_attention_plan(handle.stats)
    if summary["error"] is not None:
        plan += ("\n\naccuracy probe (relative error against exact float64 attention on the probed rows):\n\n"
                 + handle.stats.error_table())
    return record, frames, sparsity_grid(handle.stats), plan


def main(argv=None) -> dict:
    plain_warnings()
    args, parser = parse_args(argv)
    device = check_device(parser, args.device)
    on_cuda = device.type == "cuda"
    dtype = torch.bfloat16 if on_cuda else torch.float32
    with user_errors(parser):  # model, backend, λ / target and gates are checked before any video
        entry = model_entry(args.model, args.source)
        backend = canonical_backend(args.backend) if args.backend else (TRTLLM_ATTN if on_cuda else TORCH_REFERENCE)
        skip = skip_settings(args.threshold, args.target_sparsity)
        configs = test_plan_configs(backend, skip, gates=args.gates, sage=AttnQuantSpec(dtype_qk=args.sage_dtype),
                                    sdpa_roles=entry.sdpa_roles, dtype_name=DTYPE_NAMES[dtype])
    shape = run_shape(entry, args)
    check_shape(parser, entry, shape)
    check_backends(parser, [c.config for c in configs], device)
    require_packages(parser, "the plots", "matplotlib")
    check_output(parser, "--output-dir", args.output_dir, folder=True)
    if args.save_videos:
        require_packages(parser, "--save-videos (MP4 export)", "imageio", "imageio_ffmpeg")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    model_name = entry.name + (" (tiny, random weights)" if args.tiny else "")
    with user_errors(parser):
        pipe = load_pipeline(entry, tiny=args.tiny, device=args.device, dtype=dtype, source=args.source)
    check_installs(parser, pipe, [c.config for c in configs])  # e.g. a target sparsity without a calibration
    pipe.set_progress_bar_config(leave=False, desc="denoising")
    lpips = LpipsScorer(args.device)

    args.output_dir.mkdir(parents=True, exist_ok=True)

    records, grids, plans, reference = [], {}, {}, None
    for config in tqdm(configs, desc=f"{entry.name} configurations"):
        record, frames, grid, plan = run_config(pipe, entry, config, shape, args)
        records.append(record)
        if frames is None:
            if reference is None:
                raise RuntimeError(f"the reference configuration failed: {record.note}")
            continue
        reference = frames if reference is None else reference
        ref = records[0]
        record.lpips, record.psnr, record.ssim = (lpips.score(frames, reference), psnr(frames, reference),
                                                  ssim(frames, reference))
        if TORCH_REFERENCE in record.ran_on:
            record.note = "no speed-up: ran on TORCH_REFERENCE (see the header)"
        else:
            record.speedup_transformer = ref.transformer_s / record.transformer_s
            record.speedup_run = ref.run_s / record.run_s
        plans[config.label] = plan
        if grid and any(v for v in grid.values()):
            grids[config.label] = grid
        if args.save_videos:
            export_frames(frames, str(args.output_dir / f"{_file_name(config.label)}.mp4"), entry.fps)

    skip_text = (f"λ = {skip['threshold']:g}" if "threshold" in skip
                 else f"target_sparsity = {skip['target_sparsity']:g}")
    quality = "LPIPS (AlexNet)" if lpips.unavailable is None else f"PSNR / SSIM — {lpips.unavailable}"
    header = [f"# Attention evaluation: {model_name}", "",
              f"- shape: {shape.height}×{shape.width}, {shape.frames} frames, {shape.steps} steps; seed {args.seed}; "
              f"{args.device}; prompt: {args.prompt!r}",
              f"- TRT-LLM configurations on {backend} in {str(dtype).removeprefix('torch.')} (rows named "
              f"'{backend_label(backend)} ...'); Skip-Softmax {skip_text}; SAGE {args.sage_dtype} "
              "(block sizes unset: the GPU's fastest kernel); roles kept on TORCH_SDPA: "
              f"{list(entry.sdpa_roles) or 'none'}",
              f"- quality: {quality}; speed-ups are reference time / configuration time, shown only for rows that "
              f"ran real kernels ({NO_SPEEDUP_NOTE}); sparsity = skipped / all KV tiles where the backend counts "
              "them (n/a: not counted, e.g. FlashInfer's kernels)",
              f"- times exclude an untimed warm-up of {args.warmup_steps} step(s) per configuration (timestep gate "
              "open, so every kernel it uses runs)"]
    if not on_cuda:
        header.append(f"- on {device}: times say nothing about GPU speed (H200 numbers: benchmarks/RESULTS.md)")
    what_ran = [f"### {label}\n\n{plan}" for label, plan in plans.items()]
    tables_md = "\n\n".join(["\n".join(header), plan_tables(model_name, records), "## What ran per step and layer",
                              *what_ran]) + "\n"
    paths = {"tables": args.output_dir / "tables.md", "results": args.output_dir / "results.json",
             "quality_plot": args.output_dir / "quality_vs_speedup.png"}
    paths["tables"].write_text(tables_md)
    measured = [r for r in records if r.run_s is not None]
    if lpips.unavailable is None:
        points, ylabel = [(r.label, r.speedup_transformer, r.lpips) for r in measured], "LPIPS vs reference ↓"
    else:  # the reference's own PSNR is infinite: it has no point on the plot
        points = [(r.label, r.speedup_transformer, r.psnr) for r in measured if r.psnr != float("inf")]
        ylabel = "PSNR vs reference (dB) ↑"
    untimed = [label for label, speedup, _ in points if speedup is None]
    if untimed and len(untimed) < len(points):  # mixed: the plot keeps the timed ones, the table has the rest
        points = [point for point in points if point[1] is not None]
    note = f"no speed-up axis: {NO_SPEEDUP_NOTE}" if untimed and all(p[1] is None for p in points) else ""
    plot_quality_vs_speedup(points, ylabel, str(paths["quality_plot"]), model_name, note)
    if grids:
        paths["sparsity_plot"] = args.output_dir / "sparsity.png"
        plot_sparsity(grids, str(paths["sparsity_plot"]), f"{model_name}: achieved sparsity")
    paths["results"].write_text(json.dumps({
        "model": entry.model_id, "tiny": args.tiny, "shape": vars(shape), "seed": args.seed, "device": args.device,
        "backend": backend, "skip": skip, "quality_metric": "lpips" if lpips.unavailable is None else "psnr_ssim",
        "lpips_unavailable": lpips.unavailable, "results": [r.to_json() for r in records]}, indent=1))
    print(tables_md)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return {"records": records, "paths": paths, "lpips_unavailable": lpips.unavailable, "model_name": model_name}


def _file_name(label: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in label).strip("_")


if __name__ == "__main__":
    main()

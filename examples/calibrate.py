"""Calibrate Skip-Softmax for a pipeline, write the curve into its checkpoint, and plot it.

Default: the tiny Wan 2.2 A14B-shaped pipeline on the CPU (experts rebuilt with head_dim 32 so that a useful
sparsity range exists; see tests/test_calibration_pipeline.py), no downloads. Its last line is the generate.py
command that uses the curve, at the calibrated shape, with a target inside the sparsity every calibrated expert
reached (the curve is an extrapolation outside it); with these defaults::

    python examples/calibrate.py                    # writes calibrated_tiny/
    python examples/generate.py --model calibrated_tiny --diffusion-attention-backend TORCH_REFERENCE \\
        --trtllm-gen-target-sparsity 0.3

On a GPU with a real model, at the deployment resolution, frames and steps (the curve depends on all three)::

    python examples/calibrate.py --model Wan-AI/Wan2.2-T2V-A14B-Diffusers --height 720 --width 1280 \\
        --frames 81 --steps 40 --gate 0.86 --prompts prompts.txt --output-dir Wan2.2-T2V-A14B-skip

The output folder holds the pipeline's component folders with ``sparse_attention_config`` in each calibrated
transformer's ``config.json`` (ModelOpt's schema) and ``sparse_attention_calibration.json`` beside it, plus
``calibration.png`` (achieved sparsity against λ, with the fitted curve). The checkpoint suggests the target
printed (``--target-sparsity`` chooses another). With ``--model`` only the transformer configs are written (put
them in a copy of the pipeline folder, or load the model and pass the calibrations explicitly).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path

import numpy as np
import torch

from diffusers_trtllm import CalibrationResult, SkipSoftmaxSpec, calibrate
from diffusers_trtllm.skip_calibration import checked_tiles
from evaluation import MODELS, ModelEntry, VideoShape, from_pretrained, resolve_model
from evaluation.cli import (ArgumentParser, check_device, check_output, check_shape, default_device, plain_warnings,
                            positive_int, require_packages, user_errors)

DEFAULT_PROMPTS = ["A red fox runs through fresh snow at dawn, cinematic",
                   "Waves break on black volcanic rocks under a stormy sky",
                   "A busy night market in the rain, neon reflections on wet streets"]


def load_pipeline(entry: ModelEntry, source: str | None, device: str, dtype: torch.dtype):
    """The pipeline of ``entry`` from ``source`` (a folder or Hub id), or with no source the tiny Wan 2.2."""
    if source is None:
        from diffusers_trtllm.tiny_pipelines import tiny_wan22_pipeline, tiny_wan_transformer

        pipe = tiny_wan22_pipeline(qk_gain=3.0)
        pipe.transformer = tiny_wan_transformer(0, qk_gain=3.0, attention_head_dim=32)
        pipe.transformer_2 = tiny_wan_transformer(1, qk_gain=3.0, attention_head_dim=32)
        return pipe.to(device)
    return from_pretrained(entry.pipeline_class, source, dtype).to(device)


def suggested_target(result: CalibrationResult) -> float | None:
    """A target inside every calibrated component's observed sparsity (the curve is measured only there): the
    middle of their common range, with the fewest decimals that keep it inside; None when they share none."""
    ranges = [fit.observed_range for fit in result.fits.values()]
    if not ranges:
        return None
    low, high = max(r[0] for r in ranges), min(r[1] for r in ranges)
    if low > high:
        return None
    middle = (low + high) / 2
    return next(t for t in (round(middle, digits) for digits in (1, 2, 3, 6)) if low <= t <= high)


def with_suggested_target(result: CalibrationResult, target: float) -> CalibrationResult:
    """``result`` whose checkpoint suggests ``target`` in every component."""
    fits = {component: dataclasses.replace(fit, calibration=dataclasses.replace(fit.calibration,
                                                                                  target_sparsity=target))
            for component, fit in result.fits.items()}
    return dataclasses.replace(result, fits=fits)


def plot(result: CalibrationResult, path: Path, target: float | None) -> None:
    """Achieved sparsity against λ per component (points per prompt) with the fitted curve
    s = log(λ·kv_len / a) / b, and the target the checkpoint suggests."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5), layout="constrained")
    highest = 0.0
    for (component, fit), color in zip(result.fits.items(), ("tab:blue", "tab:orange", "tab:green")):
        cal = fit.calibration
        lam = np.array([p["lambda"] for p in fit.points])
        sparsity = np.array([p["sparsity"] for p in fit.points])
        used = np.array([p["used"] for p in fit.points])
        ax.scatter(lam[used], sparsity[used], s=12, color=color, label=f"{component}: points in the fit range")
        if (~used).any():
            ax.scatter(lam[~used], sparsity[~used], s=12, facecolors="none", edgecolors=color,
                       label=f"{component}: points outside it (not fitted)")
        kv_len = fit.points[0]["kv_len"]
        grid = np.geomspace(lam.min(), lam.max(), 200)
        curve = np.log(grid * kv_len / cal.a) / cal.b
        ax.plot(grid, curve, color=color,
                label=f"{component}: a={cal.a:.3g}, b={cal.b:.3g}, R²={fit.r_squared:.3f} (kv_len {kv_len})")
        highest = max(highest, sparsity.max(), curve.max())
    if target is not None:
        ax.axhline(target, color="grey", ls=":", label=f"target sparsity the checkpoint suggests: {target:g}")
        highest = max(highest, target)
    ax.set_xscale("log")
    # the axis fits what was measured and fitted (a tiny model reaches about 0.45, a trained one more); the
    # curve's negative part at small λ means "skips nothing" and is left out
    ax.set_ylim(0, min(1.0, highest * 1.1) if highest > 0 else 1.0)
    ax.set_xlabel("λ = factor / kv_len")
    rows, cols = result.settings["calibration"]["tile"]
    ax.set_ylabel(f"achieved sparsity (skipped {rows}×{cols} tiles)")
    ax.set_title("Skip-Softmax calibration: factor = a·exp(b·s)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> CalibrationResult:
    plain_warnings()
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help=f"model id or alias: {[e.model_id for e in MODELS.values()]}, or a local pipeline "
                             "folder (default: tiny built-in Wan 2.2 pipeline)")
    parser.add_argument("--prompts", type=Path, default=None, help="text file, one prompt per line")
    parser.add_argument("--height", type=positive_int, default=256)
    parser.add_argument("--width", type=positive_int, default=448)
    parser.add_argument("--frames", type=positive_int, default=9)
    parser.add_argument("--steps", type=positive_int, default=4)
    parser.add_argument("--gate", type=float, default=0.0, help="disabled_until_timestep D of the deployment")
    parser.add_argument("--lambda-min", type=float, default=1e-6)
    parser.add_argument("--lambda-max", type=float, default=1.0)
    parser.add_argument("--lambda-points", type=positive_int, default=31)
    parser.add_argument("--tile", type=positive_int, nargs=2, default=(128, 128), metavar=("ROWS", "COLS"),
                        help="skip tile counted: 128 128 (Hopper FMHAv2 bf16), 64 128 (Hopper SAGE: FMHAv2, Triton)")
    parser.add_argument("--kv-step", type=positive_int, default=None,
                        help="keys per online-softmax step whose tiles are decided against the running max at its "
                             "start: 256 for Hopper FMHAv2 SAGE (default: each tile is a step)")
    parser.add_argument("--reuse-steps", type=int, default=0,
                        help="calibrate Skip-Softmax reuse (skip_softmax.reuse_steps of the deployment; default 0: "
                             "without reuse)")
    parser.add_argument("--target-sparsity", type=float, default=None,
                        help="target to suggest in the checkpoint (default: the middle of the observed sparsity)")
    parser.add_argument("--fit-range", type=float, nargs=2, default=(0.10, 0.90))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--output-dir", type=Path, default=None,
                        help="pipeline folder to write (default: calibrated_tiny, or calibrated_<model name>)")
    args = parser.parse_args(argv)
    device = check_device(parser, args.device)
    with user_errors(parser):
        entry, folder = resolve_model(args.model)
    check_shape(parser, entry, VideoShape(args.height, args.width, args.frames))
    require_packages(parser, "the calibration plot", "matplotlib")
    if not 0.0 < args.lambda_min < args.lambda_max <= 1.0:
        parser.error(f"--lambda-min {args.lambda_min:g} / --lambda-max {args.lambda_max:g} are invalid: expected "
                     "0 < min < max <= 1")
    with user_errors(parser):  # the suggested target and the gate are checked as the checkpoint will check them
        SkipSoftmaxSpec(target_sparsity=args.target_sparsity, disabled_until_timestep=args.gate)
        checked_tiles(tuple(args.tile), args.kv_step)
    if args.reuse_steps < 0:
        parser.error(f"--reuse-steps {args.reuse_steps} is invalid: expected an int >= 0")
    if not 0.0 <= args.fit_range[0] < args.fit_range[1] <= 1.0:
        parser.error(f"--fit-range {args.fit_range[0]:g} {args.fit_range[1]:g} is invalid: expected 0 <= low < high "
                     "<= 1")
    if args.prompts is not None and not args.prompts.is_file():
        parser.error(f"--prompts {args.prompts}: no such file")
    output_dir = args.output_dir or Path("calibrated_" + (Path(args.model).name if args.model else "tiny"))
    check_output(parser, "--output-dir", output_dir, folder=True)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    prompts = [line.strip() for line in args.prompts.read_text().splitlines() if line.strip()] \
        if args.prompts else DEFAULT_PROMPTS
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with user_errors(parser):
        pipe = load_pipeline(entry, None if args.model is None else str(folder or entry.model_id), args.device, dtype)
        pipe.set_progress_bar_config(desc="denoising", leave=False)
        result = calibrate(pipe, prompts, height=args.height, width=args.width, num_frames=args.frames,
                           num_inference_steps=args.steps, disabled_until_timestep=args.gate,
                           lambdas=np.geomspace(args.lambda_min, args.lambda_max, args.lambda_points),
                           target_sparsity=args.target_sparsity, fit_range=tuple(args.fit_range), seed=args.seed,
                           tile=tuple(args.tile), kv_step=args.kv_step, reuse_steps=args.reuse_steps)
    target = args.target_sparsity if args.target_sparsity is not None else suggested_target(result)
    if args.target_sparsity is None and target is not None:
        result = with_suggested_target(result, target)
    output_dir.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        pipe.save_pretrained(output_dir)
    result.save(output_dir, pipe)
    plot(result, output_dir / "calibration.png", target)
    print(result.summary())
    print(f"wrote {output_dir} (config.json + {len(result.fits)} sidecar(s)) and calibration.png")
    if target is None:
        ranges = ", ".join(f"{c} {lo:.2f}–{hi:.2f}" for c, (lo, hi) in
                           ((c, fit.observed_range) for c, fit in result.fits.items()))
        print(f"no target sparsity lies inside every component's observed sparsity ({ranges}); calibrate with a "
              "λ grid reaching further, or more frames")
        return result
    # the tiny model's head_dim (32) and a CPU have no TRT-LLM kernel, and auto never picks the reference
    backend = " --diffusion-attention-backend TORCH_REFERENCE" if args.model is None or device.type != "cuda" else ""
    pipeline = output_dir
    if not (output_dir / "model_index.json").is_file():
        pipeline = "COPY"
        print(f"only the transformer configs were written: put {output_dir}'s component folders over a copy of "
              f"{folder or entry.model_id}'s pipeline folder (COPY below)")
    print(f"python examples/generate.py --model {pipeline}{backend} --trtllm-gen-target-sparsity {target:g}")
    return result


if __name__ == "__main__":
    main()

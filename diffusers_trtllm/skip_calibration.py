"""Produce a Skip-Softmax curve: run the pipeline, count what many λ would skip, fit factor = a·exp(b·s).

:func:`calibrate` runs the real pipeline at the deployment resolution, frame count and step count (the fit depends
on all three) with this package's processors installed and a probe on the planner: every attention call that
would run sparse under the calibration config (the roles in ``sparse_roles``, minus ``ignore``, with the timestep
gate ``disabled_until_timestep`` respected) is handed to the probe, which counts in one pass how many tiles each λ
of the grid would skip (``calibration/counting.py``; exact for λ <= 1), and the call then runs dense, as in
ModelOpt's calibration. The points are fitted by :func:`~diffusers_trtllm.calibration.fit.fit_curve`.

This module sits above ``install`` and ``calibration`` (it uses both), so that neither imports it.
"""

from __future__ import annotations

import platform
import warnings
from collections import defaultdict
from typing import Sequence

import numpy as np
import torch

from .backends.base import DEFAULT_TILE
from .calibration.counting import count_skips, skip_gaps
from .calibration.curve import SkipCalibration
from .calibration.fit import DEFAULT_FIT_RANGE, CalibrationResult, ComponentFit, fit_curve
from .errors import CalibrationError, invalid, warn_user
from .install import enable_trtllm_attention, pipeline_transformers
from .processors import (Cosmos3TrtllmAttnProcessor, HunyuanVideo15TrtllmAttnProcessor, WanTrtllmAttnProcessor,
                         processor_class_for)
from .version import __version__

# λ grid: 25 points log-spaced over 1e-4..1 (ModelOpt's default trials span 1e-6..0.99). Counting is exact up to 1.
DEFAULT_LAMBDAS = tuple(float(x) for x in np.geomspace(1e-4, 1.0, 25))
# Any λ > 0 marks a call as sparse so the plan hands it to the probe; the probe counts the whole grid and the
# call runs dense, so this value never affects a result.
PROBE_THRESHOLD = 0.5
# The roles calibrated sparse by default, per model family: the long attention over video tokens. Text
# cross-attention (Wan) and Cosmos 3's causal text stream (which never skips) stay dense.
DEFAULT_SPARSE_ROLES = {WanTrtllmAttnProcessor: ("self_attn",), HunyuanVideo15TrtllmAttnProcessor: ("joint_attn",),
                        Cosmos3TrtllmAttnProcessor: ("gen_full",)}


class _SkipProbe:
    """Called for every call that would skip: per (component, prompt, kv_len), tiles each λ skips and tiles in all.

    Counts on the calibration's ``tile`` and ``kv_step``, the skip decisions of the kernel the curve is for (the
    plan's own tile, passed in by the planner, is not used). With ``reuse_steps`` (Skip-Softmax reuse), a tile
    counts as skipped at a step when some step of its reuse window (the step that tested every tile and the
    ``reuse_steps`` after it, per site and pass) skipped it: the window's smallest gap is below log λ.
    """

    def __init__(self, lambdas: Sequence[float], tile: tuple[int, int], kv_step: int | None = None,
                 reuse_steps: int = 0):
        self.lambdas = tuple(lambdas)
        self.tile = tile
        self.kv_step = kv_step
        self.reuse_steps = reuse_steps
        # per (site, pass): the step its window started at and each sequence's smallest gaps (float16) since
        self.windows: dict = {}
        self.passes: dict = defaultdict(int)
        self.prompt = 0
        self.skipped: dict = {}
        self.total: dict = defaultdict(int)
        self.layers: dict[str, set[str]] = defaultdict(set)
        self.calls = 0

    def __call__(self, site, qkv, *, scale: float, causal: bool, tile: tuple[int, int], step: int | None = None
                 ) -> None:
        self.calls += 1
        self.layers[site.component].add(site.layer)
        window = self._window(site, step)
        for index, ((q, k, _, _), kv_len) in enumerate(zip(qkv.sequences(), qkv.seqlens_kv)):
            gaps = skip_gaps(q, k, scale, tile=self.tile, kv_step=self.kv_step, causal=causal)
            if window is not None:
                kept = window.get(index)
                if kept is not None and kept.shape == gaps.shape:
                    gaps = torch.minimum(gaps, kept.to(gaps.dtype))
                window[index] = gaps.to(torch.float16)
            key = (site.component, self.prompt, kv_len)
            counts = count_skips(gaps, self.lambdas)  # stays on the device until the fit
            self.skipped[key] = counts if key not in self.skipped else self.skipped[key] + counts
            self.total[key] += gaps.numel()

    def _window(self, site, step: int | None) -> dict | None:
        """This call's reuse window, ``{sequence: smallest gaps}`` (made afresh at its first step), or None."""
        if not self.reuse_steps or step is None:
            return None
        this_step = (site, self.prompt, step)
        key = (site, self.passes[this_step])  # the site's n-th call in a step is pass n
        self.passes[this_step] += 1
        window = self.windows.get(key)  # (prompt, start step, gaps)
        if window is None or window[0] != self.prompt or not 0 <= step - window[1] <= self.reuse_steps:
            window = self.windows[key] = (self.prompt, step, {})
        return window[2]

    def points(self, component: str) -> list[dict]:
        out = []
        for (comp, prompt, kv_len), skipped in self.skipped.items():
            if comp != component:
                continue
            total = self.total[(comp, prompt, kv_len)]
            for lam, count in zip(self.lambdas, skipped.tolist()):
                out.append({"prompt": prompt, "kv_len": kv_len, "lambda": lam, "factor": lam * kv_len,
                            "sparsity": count / total, "tiles": total})
        return out


def default_sparse_roles(pipe) -> tuple[str, ...]:
    """The roles :func:`calibrate` runs sparse when none are given: per model family, :data:`DEFAULT_SPARSE_ROLES`."""
    roles = []
    for transformer in pipeline_transformers(pipe).values():
        cls = processor_class_for(transformer)
        roles += DEFAULT_SPARSE_ROLES.get(cls, ())  # no processor: enable_trtllm_attention names the supported ones
    return tuple(dict.fromkeys(roles))


def calibrate(pipe, prompts: str | Sequence[str], *, height: int, width: int, num_frames: int,
              num_inference_steps: int, lambdas: Sequence[float] = DEFAULT_LAMBDAS,
              disabled_until_timestep: float = 0.0, sparse_roles: Sequence[str] | None = None,
              ignore: Sequence[str] = (), target_sparsity: float | None = None,
              fit_range: tuple[float, float] = DEFAULT_FIT_RANGE, backend: str = "auto",
              tile: tuple[int, int] = DEFAULT_TILE, kv_step: int | None = None, reuse_steps: int = 0, seed: int = 0,
              progress: bool = True,
              **pipe_kwargs) -> CalibrationResult:
    """Calibrate ``pipe``'s transformers for Skip-Softmax at the deployment shape; see the module docstring.

    Args:
        prompts: one or more prompts; each is generated once (seed ``seed + i``), latents only (no VAE decode).
        height, width, num_frames, num_inference_steps: the deployment settings (the curve depends on them).
        lambdas: the λ grid (each in (0, 1]).
        disabled_until_timestep: the gate D of the deployment; steps with t > D run dense and are not counted
            (a component that never runs below D gets no curve).
        sparse_roles: ``per_role`` keys (roles, categories, components, layer globs) that run sparse; default
            per model family (:data:`DEFAULT_SPARSE_ROLES`: Wan ``self_attn``, HunyuanVideo 1.5 ``joint_attn``,
            Cosmos 3 ``gen_full``). Other layers are dense and written to the checkpoint's ``ignore`` list.
        ignore: more layers kept dense, as names or fnmatch patterns (``"blocks.0.*"``).
        target_sparsity: the target to suggest in the checkpoint (optional; warns when outside the sparsity
            observed, where the curve is an extrapolation).
        fit_range: sparsities kept for the fit.
        backend: the backend of the dense calls (``auto``: the best available).
        tile: ``(query rows, key columns)`` per skip decision, counted: the tile of the kernel the curve is for
            (128 × 128: FMHAv2 bf16 on Hopper; 64 × 128: Hopper's SAGE kernels, FMHAv2's and the Triton one).
        kv_step: keys per online-softmax step of that kernel, whose tiles are all decided against the running
            max at the step's start (256 for Hopper's FMHAv2 SAGE kernel; default: each tile is a step).
        reuse_steps: the curve of Skip-Softmax reuse (``skip_softmax.reuse_steps``, 0: without reuse): a tile
            counts as skipped where some step of its reuse window skipped it; deploy with the same value.
        pipe_kwargs: passed to the pipeline (``guidance_scale``...).

    Raises:
        CalibrationError: no attention call ran sparse (the message names the pipeline's roles), or a component
            that ran sparse has too few points to fit.
    """
    lambdas = tuple(float(lam) for lam in lambdas)
    bad = [lam for lam in lambdas if not 0.0 < lam <= 1.0]
    if not lambdas or bad:
        raise ValueError(f"lambdas={bad or list(lambdas)} is invalid: expected a non-empty list of λ in (0, 1] "
                         "(λ > 1 skips nearly everything and cannot be counted exactly in one pass)")
    tile = checked_tiles(tile, kv_step)
    if type(reuse_steps) is not int or reuse_steps < 0:
        raise invalid("reuse_steps", reuse_steps, "an int >= 0 (0: the curve without Skip-Softmax reuse)")
    sparse_roles = default_sparse_roles(pipe) if sparse_roles is None else tuple(sparse_roles)
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    sparse = {"backend": backend, "skip_softmax": {"threshold": PROBE_THRESHOLD,
                                                   "disabled_until_timestep": disabled_until_timestep}}
    dense = {"backend": backend}
    config = {"default": dense,
              "per_role": {**{role: sparse for role in sparse_roles}, **{name: dense for name in ignore}}}
    probe = _SkipProbe(lambdas, tile, kv_step, reuse_steps)
    with warnings.catch_warnings():
        # Probed calls run dense anyway: auto dropping Skip-Softmax on this machine changes nothing here.
        warnings.filterwarnings("ignore", message="diffusers_trtllm: auto runs")
        handle = enable_trtllm_attention(pipe, config, collect_stats=False)
    with handle:
        served = {component: tuple(sorted({site.layer for site in handle.planner.calls if site.component == component}))
                  for component in handle.components}
        handle.planner.set_probe(probe)
        bar = _progress(prompts, progress)
        for i, prompt in enumerate(bar):
            probe.prompt = i
            pipe(prompt, height=height, width=width, num_frames=num_frames, num_inference_steps=num_inference_steps,
                 generator=torch.Generator().manual_seed(seed + i), output_type="latent", **pipe_kwargs)
            if hasattr(bar, "set_postfix"):
                bar.set_postfix(calls_counted=probe.calls)
    if probe.calls == 0:
        raise _nothing_counted(pipe, served, sparse_roles, disabled_until_timestep)
    fits = {}
    for component, layers in served.items():
        points = probe.points(component)
        if not points:
            continue  # never ran sparse (gated off, or no sparse role here): no curve, stays dense
        a, b, r_squared, marked = fit_curve(points, fit_range, component=component)
        used = [p["sparsity"] for p in marked if p["used"]]
        modules = dict(getattr(pipe, component).named_modules())
        sparse_layers = probe.layers[component]
        calibration = SkipCalibration(
            a=a, b=b, sparsity_range=(min(used), max(used)), source=f"calibrate({type(pipe).__name__}.{component})",
            ignore=tuple(layer for layer in layers if layer not in sparse_layers),
            targets=tuple(sorted({type(modules[layer]).__name__ for layer in sparse_layers})),
            target_sparsity=target_sparsity,
            disabled_until_timestep=disabled_until_timestep or None, reuse_steps=reuse_steps or None)
        fits[component] = ComponentFit(calibration, marked, r_squared, tuple(sorted(sparse_layers)), component)
        if target_sparsity is not None and not min(used) <= target_sparsity <= max(used):
            warn_user(f"{component}: the checkpoint will suggest target_sparsity={target_sparsity}, outside the "
                      f"sparsity [{min(used):.3f}, {max(used):.3f}] observed while calibrating; its λ is an "
                      "extrapolation. Suggest a target inside the range, or calibrate to reach it")
    settings = {"deployment": {"height": height, "width": width, "num_frames": num_frames,
                               "num_inference_steps": num_inference_steps,
                               "disabled_until_timestep": disabled_until_timestep},
                "calibration": {"prompts": len(prompts), "seed": seed, "lambdas": list(lambdas),
                                "fit_range": list(fit_range), "tile": list(tile), "kv_step": kv_step,
                                "reuse_steps": reuse_steps,
                                "sparse_roles": list(sparse_roles),
                                "ignore": list(ignore), "counting": "dense running max (exact for λ <= 1)"},
                "versions": _versions()}
    return CalibrationResult(fits, settings)


def checked_tiles(tile, kv_step: int | None) -> tuple[int, int]:
    """``tile`` as a tuple, after checking it and ``kv_step`` as :func:`calibrate` takes them (a script checks
    them before loading a model)."""
    if not (isinstance(tile, (tuple, list)) and len(tile) == 2
            and all(type(side) is int and side > 0 for side in tile)):
        raise invalid("tile", tile, "(query rows, key columns), two positive ints such as (128, 128)")
    if kv_step is not None and not (type(kv_step) is int and kv_step > 0 and kv_step % tile[1] == 0):
        raise invalid("kv_step", kv_step, f"a positive multiple of the tile's {tile[1]} key columns, or None")
    return tuple(tile)


def _nothing_counted(pipe, served: dict, sparse_roles, gate: float) -> CalibrationError:
    has = "; ".join(f"{component}: " + ", ".join(f"{role} ({traits.category})" for role, traits in
                                                  processor_class_for(getattr(pipe, component)).ROLES.items())
                    for component in served)
    gated = (f", or every step had t > disabled_until_timestep={gate} (the gate keeps them dense)"
             if gate > 0 else "")
    return CalibrationError(
        f"calibration counted no attention call: sparse_roles={list(sparse_roles)} ran Skip-Softmax on no call of "
        f"this {type(pipe).__name__} (they name no role that takes Skip-Softmax{gated}). Its roles: {has}. "
        f"Pass sparse_roles naming the video self/joint attention, or leave it unset for the model's default")


def _progress(prompts: list[str], enabled: bool):
    if not enabled:
        return prompts
    from tqdm.auto import tqdm

    return tqdm(prompts, desc="calibrating Skip-Softmax", unit="prompt")


def _versions() -> dict[str, str]:
    import diffusers

    versions = {"diffusers_trtllm": __version__, "diffusers": diffusers.__version__, "torch": torch.__version__,
                "python": platform.python_version()}
    if torch.cuda.is_available():
        versions["gpu"] = torch.cuda.get_device_name()
    return versions

"""Produce a Skip-Softmax curve: run the pipeline, count what many λ would skip, fit factor = a·exp(b·s).

:func:`calibrate` runs the real pipeline at the deployment resolution, frame count and step count (the fit depends
on all three) with this package's processors installed and a probe on the session: every attention call that
would run sparse under the calibration config (the roles in ``sparse_roles``, minus ``ignore``, with the timestep
gate ``disabled_until_timestep`` respected) is handed to the probe, which counts in one pass how many 128 × 128
tiles each λ of the grid would skip (``counting.py``; exact for λ <= 1), and the call then runs dense, as in
ModelOpt's calibration. Per component, prompt and λ the counts over all counted calls give one point
(factor = λ·kv_len, achieved sparsity); points with sparsity inside ``fit_range`` are fitted in log space,
log(factor) = log(a) + b·s, like ModelOpt's ``fit_logspace`` (recommended for diffusion, where factors span
orders of magnitude).
"""

from __future__ import annotations

import math
import platform
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ..backends.base import DEFAULT_TILE
from .checkpoint import write_calibration
from .counting import count_skips, skip_gaps
from .curve import SkipCalibration

# λ grid: 25 points log-spaced over 1e-4..1 (ModelOpt's default trials span 1e-6..0.99). Counting is exact up to 1.
DEFAULT_LAMBDAS = tuple(float(x) for x in np.geomspace(1e-4, 1.0, 25))
DEFAULT_FIT_RANGE = (0.10, 0.90)  # ModelOpt's filter: sparsities near 0 or 1 are unreliable to fit
# Any λ > 0 marks a call as sparse so the plan hands it to the probe; the probe counts the whole grid and the
# call runs dense, so this value never affects a result.
PROBE_THRESHOLD = 0.5
SIDECAR_FORMAT = "diffusers_trtllm.skip_softmax_calibration/1"


class CalibrationError(RuntimeError):
    """Calibration produced too little to fit a curve; the message says what was observed and what to change."""


@dataclass
class ComponentFit:
    """One component's calibration: the fitted curve, every point measured and how well the fit explains them.

    ``points``: dicts with ``prompt``, ``kv_len``, ``lambda``, ``factor`` (λ·kv_len) and ``sparsity`` (skipped /
    all tiles over the prompt's counted calls); ``used`` marks those inside the fit range. ``r_squared`` is
    measured in log space, where the fit is made.
    """

    calibration: SkipCalibration
    points: list[dict]
    r_squared: float
    layers: tuple[str, ...]

    def sparsity_at(self, lam: float) -> float:
        """Mean achieved sparsity over the prompts at the grid λ nearest to ``lam`` (for plots and reports)."""
        nearest = min({p["lambda"] for p in self.points}, key=lambda x: abs(math.log(x / lam)))
        values = [p["sparsity"] for p in self.points if p["lambda"] == nearest]
        return sum(values) / len(values)


@dataclass
class CalibrationResult:
    """What :func:`calibrate` returns: a fit per component that ran sparse, and the settings it ran at."""

    fits: dict[str, ComponentFit]
    settings: dict = field(default_factory=dict)

    @property
    def calibrations(self) -> dict[str, SkipCalibration]:
        """Curves by component, ready for ``enable_trtllm_attention(pipe, config, calibrations=...)``."""
        return {component: fit.calibration for component, fit in self.fits.items()}

    def sidecar(self, component: str) -> dict:
        """What ModelOpt's schema drops, for ``sparse_attention_calibration.json``."""
        fit = self.fits[component]
        used = [p for p in fit.points if p["used"]]
        return {
            "format": SIDECAR_FORMAT,
            "observed_sparsity": list(fit.calibration.sparsity_range),
            "observed_sparsity_all_points": [min(p["sparsity"] for p in fit.points),
                                             max(p["sparsity"] for p in fit.points)],
            "fit": {"a": fit.calibration.a, "b": fit.calibration.b, "space": "log", "r_squared": fit.r_squared,
                    "points_used": len(used), "points_total": len(fit.points)},
            "kv_len": sorted({p["kv_len"] for p in fit.points}),
            "layers": list(fit.layers),
            **self.settings,
            "points": fit.points,
        }

    def save(self, pipeline_dir: str | Path, pipe=None) -> list[Path]:
        """Write each fitted component's curve into ``pipeline_dir/<component>/config.json`` (ModelOpt schema) and
        its sidecar. A component folder without ``config.json`` gets ``pipe.<component>``'s config first.
        Returns the component folders written."""
        written = []
        for component, fit in self.fits.items():
            folder = Path(pipeline_dir) / component
            if not (folder / "config.json").is_file():
                if pipe is None:
                    raise FileNotFoundError(f"{folder / 'config.json'} does not exist; pass pipe= to write "
                                            f"pipe.{component}'s config there, or save the pipeline first")
                getattr(pipe, component).save_config(folder)
            write_calibration(folder, fit.calibration, self.sidecar(component))
            written.append(folder)
        return written


class _SkipProbe:
    """The planner's probe: per (component, prompt, kv_len), tiles each λ skips and tiles in all."""

    def __init__(self, lambdas: Sequence[float]):
        self.lambdas = tuple(lambdas)
        self.prompt = 0
        self.skipped: dict = {}
        self.total: dict = defaultdict(int)
        self.layers: dict[str, set[str]] = defaultdict(set)
        self.calls = 0

    def __call__(self, site, qkv, *, scale: float, causal: bool, tile: tuple[int, int]) -> None:
        self.calls += 1
        self.layers[site.component].add(site.layer)
        for (q, k, _, _), kv_len in zip(qkv.sequences(), qkv.seqlens_kv):
            gaps = skip_gaps(q, k, scale, tile=tile, causal=causal)
            key = (site.component, self.prompt, kv_len)
            counts = count_skips(gaps, self.lambdas)  # stays on the device until the fit
            self.skipped[key] = counts if key not in self.skipped else self.skipped[key] + counts
            self.total[key] += gaps.numel()

    def points(self, component: str) -> list[dict]:
        out = []
        for (comp, prompt, kv_len), skipped in self.skipped.items():
            if comp != component:
                continue
            total = self.total[(comp, prompt, kv_len)]
            for lam, count in zip(self.lambdas, skipped.tolist()):
                out.append({"prompt": prompt, "kv_len": kv_len, "lambda": lam, "factor": lam * kv_len,
                            "sparsity": count / total})
        return out


def fit_curve(points: list[dict], fit_range: tuple[float, float] = DEFAULT_FIT_RANGE, *, component: str = ""
              ) -> tuple[float, float, float, list[dict]]:
    """Least squares of log(factor) = log(a) + b·s over the points with s in ``fit_range``.

    Returns ``(a, b, r_squared in log space, points with "used" set)``; raises :class:`CalibrationError` when
    fewer than 3 distinct sparsities fall in the range or the fitted b is not positive.
    """
    lo, hi = fit_range
    marked = [{**p, "used": lo <= p["sparsity"] <= hi} for p in points]
    used = [p for p in marked if p["used"]]
    observed = (min(p["sparsity"] for p in points), max(p["sparsity"] for p in points)) if points else None
    if len({round(p["sparsity"], 9) for p in used}) < 3:
        raise CalibrationError(
            f"{component}: {len(used)} calibration points with sparsity in [{lo}, {hi}] "
            f"(observed range {observed}); need 3 distinct sparsities. Widen the λ grid (larger λ gives more "
            "sparsity), calibrate at more frames or a higher resolution (longer sequences skip more), or move "
            "disabled_until_timestep so more steps are counted")
    s = np.array([p["sparsity"] for p in used])
    log_factor = np.log([p["factor"] for p in used])
    b, log_a = np.polyfit(s, log_factor, 1)
    residual = log_factor - (log_a + b * s)
    spread = log_factor - log_factor.mean()
    r_squared = 1.0 - float(residual @ residual) / float(spread @ spread) if spread.any() else 1.0
    a = math.exp(log_a)
    if not (b > 0 and 0 < a < math.inf):
        raise CalibrationError(
            f"{component}: the fit a={a:.4g}, b={b:.4g} is degenerate (both must be finite and > 0: the factor "
            f"must grow with sparsity); achieved sparsity barely depends on λ over the {len(used)} points in "
            f"[{lo}, {hi}] (sparsities {sorted({round(p['sparsity'], 4) for p in used})[:8]}). Attention this "
            "peaky or this flat has no useful curve: use skip_softmax.threshold (λ) directly")
    return float(a), float(b), r_squared, marked


def calibrate(pipe, prompts: str | Sequence[str], *, height: int, width: int, num_frames: int,
              num_inference_steps: int, lambdas: Sequence[float] = DEFAULT_LAMBDAS,
              disabled_until_timestep: float = 0.0, sparse_roles: Sequence[str] = ("self",),
              ignore: Sequence[str] = (), target_sparsity: float | None = None,
              fit_range: tuple[float, float] = DEFAULT_FIT_RANGE, backend: str = "auto",
              tile: tuple[int, int] = DEFAULT_TILE, seed: int = 0, progress: bool = True,
              **pipe_kwargs) -> CalibrationResult:
    """Calibrate ``pipe``'s transformers for Skip-Softmax at the deployment shape; see the module docstring.

    Args:
        prompts: one or more prompts; each is generated once (seed ``seed + i``), latents only (no VAE decode).
        height, width, num_frames, num_inference_steps: the deployment settings (the curve depends on them).
        lambdas: the λ grid (each in (0, 1]).
        disabled_until_timestep: the gate D of the deployment; steps with t > D run dense and are not counted
            (a component that never runs below D gets no curve).
        sparse_roles: roles or categories that run sparse (``"self"``: Wan's ``attn1``); other layers are dense
            and written to the checkpoint's ``ignore`` list.
        ignore: more layers kept dense, as names or fnmatch patterns (``"blocks.0.*"``).
        target_sparsity: the target to suggest in the checkpoint (optional).
        fit_range: sparsities kept for the fit.
        backend: the backend of the dense calls (``auto``: the best available).
        pipe_kwargs: passed to the pipeline (``guidance_scale``...).
    """
    from ..install import enable_trtllm_attention  # here: install imports this package (curves)

    lambdas = tuple(float(lam) for lam in lambdas)
    bad = [lam for lam in lambdas if not 0.0 < lam <= 1.0]
    if not lambdas or bad:
        raise ValueError(f"lambdas={bad or list(lambdas)} is invalid: expected a non-empty list of λ in (0, 1] "
                         "(λ > 1 skips nearly everything and cannot be counted exactly in one pass)")
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    sparse = {"backend": backend, "skip_softmax": {"threshold": PROBE_THRESHOLD,
                                                   "disabled_until_timestep": disabled_until_timestep}}
    config = {"default": {"backend": backend},
              "per_role": {**{role: sparse for role in sparse_roles}, **{name: {"backend": backend} for name in ignore}}}
    probe = _SkipProbe(lambdas)
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
    fits = {}
    for component, layers in served.items():
        points = probe.points(component)
        if not points:
            continue  # never ran sparse (gated off, or no sparse role): no curve, stays dense
        a, b, r_squared, marked = fit_curve(points, fit_range, component=component)
        used = [p["sparsity"] for p in marked if p["used"]]
        modules = dict(getattr(pipe, component).named_modules())
        sparse_layers = probe.layers[component]
        calibration = SkipCalibration(
            a=a, b=b, sparsity_range=(min(used), max(used)), source=f"calibrate({type(pipe).__name__}.{component})",
            ignore=tuple(layer for layer in layers if layer not in sparse_layers),
            targets=tuple(sorted({type(modules[layer]).__name__ for layer in sparse_layers})),
            target_sparsity=target_sparsity,
            disabled_until_timestep=disabled_until_timestep or None)
        fits[component] = ComponentFit(calibration, marked, r_squared, tuple(sorted(sparse_layers)))
    settings = {"deployment": {"height": height, "width": width, "num_frames": num_frames,
                               "num_inference_steps": num_inference_steps,
                               "disabled_until_timestep": disabled_until_timestep},
                "calibration": {"prompts": len(prompts), "seed": seed, "lambdas": list(lambdas),
                                "fit_range": list(fit_range), "tile": list(tile), "sparse_roles": list(sparse_roles),
                                "ignore": list(ignore), "counting": "dense running max (exact for λ <= 1)"},
                "versions": _versions()}
    return CalibrationResult(fits, settings)


def _progress(prompts: list[str], enabled: bool):
    if not enabled:
        return prompts
    from tqdm.auto import tqdm

    return tqdm(prompts, desc="calibrating Skip-Softmax", unit="prompt")


def _versions() -> dict[str, str]:
    import diffusers

    from .. import __version__

    versions = {"diffusers_trtllm": __version__, "diffusers": diffusers.__version__, "torch": torch.__version__,
                "python": platform.python_version()}
    if torch.cuda.is_available():
        versions["gpu"] = torch.cuda.get_device_name()
    return versions

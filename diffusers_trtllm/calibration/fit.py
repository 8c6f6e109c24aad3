"""Fit a Skip-Softmax curve factor = a·exp(b·s) to counted points, and the result of a calibration run.

Per component, prompt and λ the counts over all counted calls give one point (factor = λ·kv_len, achieved
sparsity); points with sparsity inside ``fit_range`` are fitted in log space, log(factor) = log(a) + b·s, like
ModelOpt's ``fit_logspace`` (recommended for diffusion, where factors span orders of magnitude). The run that
produces the points is :func:`diffusers_trtllm.calibrate` (``skip_calibration.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import CalibrationError
from .checkpoint import write_calibration
from .curve import SkipCalibration

DEFAULT_FIT_RANGE = (0.10, 0.90)  # ModelOpt's filter: sparsities near 0 or 1 are unreliable to fit
SIDECAR_FORMAT = "diffusers_trtllm.skip_softmax_calibration/1"
SUMMARY_TARGETS = (0.3, 0.5, 0.7)


@dataclass
class ComponentFit:
    """One component's calibration: the fitted curve, every point measured and how well the fit explains them.

    ``points``: dicts with ``prompt``, ``kv_len``, ``lambda``, ``factor`` (λ·kv_len), ``sparsity`` (skipped /
    all tiles over the prompt's counted calls) and ``tiles`` (all tiles counted); ``used`` marks those inside the
    fit range. ``r_squared`` is measured in log space, where the fit is made.
    """

    calibration: SkipCalibration
    points: list[dict]
    r_squared: float
    layers: tuple[str, ...]
    component: str = ""

    @property
    def observed_range(self) -> tuple[float, float]:
        """The achieved sparsities the fit was made on (the curve is measured only there)."""
        if self.calibration.sparsity_range is not None:
            return self.calibration.sparsity_range
        used = [p["sparsity"] for p in self.points if p.get("used", True)]
        return min(used), max(used)

    def threshold_at(self, target_sparsity: float, kv_len: int | None = None) -> float:
        """λ = a·exp(b·s) / kv_len for ``target_sparsity``; ``kv_len`` defaults to the calibration's longest.

        Raises :class:`CalibrationError` when the target lies outside :attr:`observed_range`: the curve was not
        measured there, and extrapolating an exponential gives λ far from what the kernels achieve.
        """
        lo, hi = self.observed_range
        if not lo <= target_sparsity <= hi:
            raise CalibrationError(
                f"{self.component or 'calibration'}: target_sparsity={target_sparsity} lies outside the sparsity "
                f"range [{lo:.3f}, {hi:.3f}] observed when calibrating; the curve says nothing there. Choose a target "
                "inside it, or calibrate so that it is observed (a λ grid reaching 1, longer sequences, more "
                "frames or a higher resolution)")
        if kv_len is None:
            kv_len = max(p["kv_len"] for p in self.points)
        return self.calibration.factor(target_sparsity) / kv_len


@dataclass
class CalibrationResult:
    """What :func:`diffusers_trtllm.calibrate` returns: a fit per component that ran sparse, and its settings."""

    fits: dict[str, ComponentFit]
    settings: dict = field(default_factory=dict)

    @property
    def calibrations(self) -> dict[str, SkipCalibration]:
        """Curves by component, ready for ``enable_trtllm_attention(pipe, config, calibrations=...)``."""
        return {component: fit.calibration for component, fit in self.fits.items()}

    def summary(self, targets: Sequence[float] = SUMMARY_TARGETS) -> str:
        """A Markdown table per component: the fit and λ at each target sparsity (at the longest kv_len).

        λ is refused (the cell says so, and a note under the table says why) for a target outside the sparsity
        range the component was calibrated over: the curve was never measured there.
        """
        header = ["component", "a", "b", "R² (log)", "observed sparsity", "kv_len"]
        header += [f"λ at s={s:g}" for s in targets]
        lines = ["| " + " | ".join(header) + " |", "|---|---:|---:|---:|---|---:|" + "---:|" * len(targets)]
        refused = False
        for component, fit in self.fits.items():
            cal, (lo, hi) = fit.calibration, fit.observed_range
            kv_len = max(p["kv_len"] for p in fit.points)
            cells = []
            for s in targets:
                try:
                    cells.append(f"{fit.threshold_at(s, kv_len):.3g}")
                except CalibrationError:  # outside the observed range: threshold_at refuses it
                    refused = True
                    cells.append("not observed")
            lines.append(f"| {component} | {cal.a:.4g} | {cal.b:.4g} | {fit.r_squared:.3f} | {lo:.3f}–{hi:.3f} | "
                         f"{kv_len} | " + " | ".join(cells) + " |")
        if refused:
            lines.append("\n'not observed': the target lies outside the sparsity this component reached while "
                         "calibrating, where the curve is an extrapolation; no λ is given. Calibrate with a λ grid "
                         "reaching 1, longer sequences or more frames to measure it.")
        return "\n".join(lines)

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


def fit_curve(points: list[dict], fit_range: tuple[float, float] = DEFAULT_FIT_RANGE, *, component: str = ""
              ) -> tuple[float, float, float, list[dict]]:
    """Least squares of log(factor) = log(a) + b·s over the points with s in ``fit_range``.

    Returns ``(a, b, r_squared in log space, points with "used" set)``; raises :class:`CalibrationError` when
    fewer than 3 distinct sparsities fall in the range, or the fit is degenerate: every point used has one factor,
    or the fitted b is not positive, or a underflows to 0.
    """
    lo, hi = fit_range
    name = component or "calibration"
    marked = [{**p, "used": lo <= p["sparsity"] <= hi} for p in points]
    used = [p for p in marked if p["used"]]
    observed = (min(p["sparsity"] for p in points), max(p["sparsity"] for p in points)) if points else None
    if len({round(p["sparsity"], 9) for p in used}) < 3:
        raise CalibrationError(
            f"{name}: {len(used)} calibration points with sparsity in [{lo}, {hi}] "
            f"(observed range {observed}); need 3 distinct sparsities. Widen the λ grid (larger λ gives more "
            "sparsity), calibrate at more frames or a higher resolution (longer sequences skip more), or move "
            "disabled_until_timestep so more steps are counted")
    s = np.array([p["sparsity"] for p in used])
    log_factor = np.log([p["factor"] for p in used])
    b, log_a = np.polyfit(s, log_factor, 1)
    a = math.exp(log_a)
    spread = log_factor - log_factor.mean()
    # every point at one factor: b is rounding noise of either sign, and there is no curve
    if not (spread.any() and b > 0 and a > 0):
        raise CalibrationError(
            f"{name}: the fit a={a:.4g}, b={b:.4g} is degenerate (both must be > 0: the factor must grow with "
            f"sparsity); achieved sparsity barely depends on λ over the {len(used)} points in [{lo}, {hi}] "
            f"(distinct factors λ·kv_len: {len(set(log_factor.tolist()))}; sparsities "
            f"{sorted({round(p['sparsity'], 4) for p in used})[:8]}). Attention this peaky or this flat has no "
            "useful curve: use skip_softmax.threshold (λ) directly")
    residual = log_factor - (log_a + b * s)
    r_squared = 1.0 - float(residual @ residual) / float(spread @ spread)
    return float(a), float(b), r_squared, marked

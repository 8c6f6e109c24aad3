"""The calibrated Skip-Softmax curve: threshold scale factor = a · exp(b · target_sparsity)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import invalid


@dataclass(frozen=True)
class SkipCalibration:
    """One component's fit. ``sparsity_range`` is the achieved sparsity observed during calibration, when known;
    targets outside it are extrapolations."""

    a: float
    b: float
    sparsity_range: tuple[float, float] | None = None
    source: str = ""

    def __post_init__(self):
        for name in ("a", "b"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise invalid(f"calibration.{name}", value, "a finite number > 0 (factor = a * exp(b * s))")

    def factor(self, target_sparsity: float) -> float:
        """The threshold scale factor for ``target_sparsity``; λ for one call is factor / kv_len."""
        return self.a * math.exp(self.b * target_sparsity)

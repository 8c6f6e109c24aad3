"""The calibrated Skip-Softmax curve: threshold scale factor = a · exp(b · target_sparsity)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase

from ..config import finite_number, is_finite_number
from ..errors import invalid


@dataclass(frozen=True)
class SkipCalibration:
    """One component's fit, and what its checkpoint says about where it applies.

    ``sparsity_range`` is the achieved sparsity observed during calibration, when known; targets outside it are
    extrapolations. ``ignore`` holds fnmatch patterns over the component's attention module names
    (``blocks.0.attn2``) that stay dense when ``target_sparsity`` is used; ``targets`` the attention class names
    the curve was calibrated on (empty: any). ``target_sparsity`` / ``disabled_until_timestep`` are the
    checkpoint's suggested settings, read and written with it; the user's attention config decides what runs.
    ``reuse_steps``: the Skip-Softmax reuse the curve was measured with (None or 0: without reuse).
    ``dense_layers`` is filled by :meth:`bind`: the layers of one transformer whose class is not a target.
    """

    a: float
    b: float
    sparsity_range: tuple[float, float] | None = None
    source: str = ""
    ignore: tuple[str, ...] = ()
    targets: tuple[str, ...] = ()
    target_sparsity: float | None = None
    disabled_until_timestep: float | None = None
    reuse_steps: int | None = None
    dense_layers: frozenset[str] = field(default=frozenset(), repr=False)

    def __post_init__(self):
        for name in ("a", "b"):
            finite_number(f"calibration.{name}", getattr(self, name), above=0.0,
                          valid="a finite number > 0 (factor = a * exp(b * s))")
        for name in ("target_sparsity", "disabled_until_timestep"):
            value = getattr(self, name)
            if value is not None:
                finite_number(f"calibration.{name}", value, 0.0, 1.0, valid="a finite number in [0, 1] or None")
        if self.reuse_steps is not None and (type(self.reuse_steps) is not int or self.reuse_steps < 0):
            raise invalid("calibration.reuse_steps", self.reuse_steps, "an int >= 0 or None")
        if self.sparsity_range is not None:
            lo_hi = tuple(self.sparsity_range)
            if len(lo_hi) != 2 or not all(map(is_finite_number, lo_hi)) or not 0.0 <= lo_hi[0] <= lo_hi[1] <= 1.0:
                raise invalid("calibration.sparsity_range", self.sparsity_range, "(low, high) with 0 <= low <= high <= 1")
            object.__setattr__(self, "sparsity_range", (float(lo_hi[0]), float(lo_hi[1])))
        object.__setattr__(self, "ignore", tuple(self.ignore))
        object.__setattr__(self, "targets", tuple(self.targets))

    def factor(self, target_sparsity: float) -> float:
        """The threshold scale factor for ``target_sparsity``; λ for one call is factor / kv_len."""
        return self.a * math.exp(self.b * target_sparsity)

    def keeps_dense(self, layer: str) -> bool:
        """Whether the attention module ``layer`` stays dense under this curve (ignored, or not a target)."""
        return layer in self.dense_layers or any(fnmatchcase(layer, pattern) for pattern in self.ignore)

    def bind(self, transformer) -> "SkipCalibration":
        """This curve with ``dense_layers`` set to ``transformer``'s attention modules whose class is not one of
        ``targets`` (attention modules are those with a processor)."""
        if not self.targets:
            return self
        modules = dict(transformer.named_modules())
        layers = (key.removesuffix(".processor") for key in getattr(transformer, "attn_processors", {}))
        return replace(self, dense_layers=frozenset(
            layer for layer in layers if type(modules[layer]).__name__ not in self.targets))

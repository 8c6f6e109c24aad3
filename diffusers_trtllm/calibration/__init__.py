"""Skip-Softmax calibration data: the curve factor = a·exp(b·target_sparsity) (``curve``), read from and written to
checkpoints (``checkpoint``), counted (``counting``) and fitted (``fit``). The run that produces a curve,
:func:`diffusers_trtllm.calibrate`, lives above this package (``skip_calibration.py``): it installs processors."""

from ..errors import CalibrationError
from .checkpoint import (calibrations_from_pretrained, calibrations_from_transformers, load_calibration,
                         parse_sparse_attention_config, sparse_attention_config, write_calibration)
from .counting import count_skips, skip_gaps
from .curve import SkipCalibration
from .fit import CalibrationResult, ComponentFit, fit_curve

__all__ = [
    "CalibrationError", "CalibrationResult", "ComponentFit", "SkipCalibration", "calibrations_from_pretrained",
    "calibrations_from_transformers", "count_skips", "fit_curve", "load_calibration", "parse_sparse_attention_config",
    "skip_gaps", "sparse_attention_config", "write_calibration",
]

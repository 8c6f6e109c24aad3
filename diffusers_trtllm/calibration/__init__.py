"""Skip-Softmax calibration: the curve factor = a·exp(b·target_sparsity), read from and written to checkpoints
(``checkpoint``), and produced by running a pipeline (``calibrate``)."""

from .calibrate import CalibrationError, CalibrationResult, ComponentFit, calibrate, fit_curve
from .checkpoint import (calibrations_from_pretrained, calibrations_from_transformers, checkpoint_attention_config,
                         load_calibration, parse_sparse_attention_config, sparse_attention_config, write_calibration)
from .counting import count_skips, skip_gaps
from .curve import SkipCalibration

__all__ = [
    "CalibrationError", "CalibrationResult", "ComponentFit", "SkipCalibration", "calibrate",
    "calibrations_from_pretrained", "calibrations_from_transformers", "checkpoint_attention_config", "count_skips",
    "fit_curve", "load_calibration", "parse_sparse_attention_config", "skip_gaps", "sparse_attention_config",
    "write_calibration",
]

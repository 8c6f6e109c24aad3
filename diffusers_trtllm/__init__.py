"""TRT-LLM attention (dense BF16, Skip-Softmax, SAGE) for diffusers video transformers.

Layout: ``config`` (what the user asked) -> ``plan`` (what runs for this layer, step and GPU) -> ``backends`` /
``kernels`` (how it runs). ``processors`` adapt each model family; ``install`` puts them on a pipeline;
``session`` holds a pipeline's timestep and statistics; ``calibration`` reads, writes and fits Skip-Softmax curves;
``skip_calibration`` (:func:`calibrate`) runs a pipeline to make them.
"""

from .calibration.curve import SkipCalibration
from .calibration.fit import CalibrationResult
from .cli import add_attention_args, config_from_args
from .config import AttentionConfig, AttentionSpec, AttnQuantSpec, SkipSoftmaxSpec
from .errors import AttentionConfigError, BackendUnavailableError, CalibrationError
from .install import TrtllmAttentionHandle, enable_trtllm_attention
from .processors import (Cosmos3TrtllmAttnProcessor, HunyuanVideo15TrtllmAttnProcessor, TrtllmAttnProcessor,
                         WanTrtllmAttnProcessor)
from .session import AttentionSession
from .skip_calibration import calibrate
from .version import __version__

__all__ = [
    "AttentionConfig", "AttentionConfigError", "AttentionSession", "AttentionSpec", "AttnQuantSpec",
    "BackendUnavailableError", "CalibrationError", "CalibrationResult", "Cosmos3TrtllmAttnProcessor",
    "HunyuanVideo15TrtllmAttnProcessor", "SkipCalibration", "SkipSoftmaxSpec", "TrtllmAttentionHandle",
    "TrtllmAttnProcessor", "WanTrtllmAttnProcessor", "__version__", "add_attention_args", "calibrate",
    "config_from_args", "enable_trtllm_attention",
]

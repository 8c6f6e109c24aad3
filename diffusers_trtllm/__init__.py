"""TRT-LLM attention (dense BF16, Skip-Softmax, SAGE) for diffusers video transformers.

Layout: ``config`` (what the user asked) -> ``plan`` (what runs for each call site and step) -> ``ops`` (one
opaque op for ``torch.compile``) -> ``backends`` -> ``kernels`` (plain-tensor kernel functions, importing nothing
above them). ``processors`` subclass diffusers' processors and hand each attention call, with its role's planned
call, to ``dispatch`` (which is also the ``"trtllm"`` backend of diffusers' attention dispatcher); ``install``
plans and installs them on a pipeline; ``run_state`` holds each call's run (per thread or task) and ``steps`` finds
runs and steps from what the pipeline publishes;
``stats`` keeps what ran; ``calibration`` reads, writes and fits Skip-Softmax curves; ``skip_calibration``
(:func:`calibrate`) runs a pipeline to make them.
"""

from .calibration.curve import SkipCalibration
from .calibration.fit import CalibrationResult
from .cli import add_attention_args, config_from_args
from .config import AttentionConfig, AttentionSpec, AttnQuantSpec, SkipSoftmaxSpec
from .errors import AttentionConfigError, BackendUnavailableError, CalibrationError
from .install import TrtllmAttentionHandle, context_parallel_plan, enable_trtllm_attention
from .processors import (Cosmos3TrtllmAttnProcessor, HunyuanVideo15TrtllmAttnProcessor, TrtllmAttnProcessor,
                         WanTrtllmAttnProcessor)
from .dispatch import BACKEND_NAME, set_dispatch_config
from .skip_calibration import calibrate
from .version import __version__

__all__ = [
    "AttentionConfig", "AttentionConfigError", "AttentionSpec", "AttnQuantSpec", "BACKEND_NAME",
    "BackendUnavailableError", "CalibrationError", "CalibrationResult", "Cosmos3TrtllmAttnProcessor",
    "HunyuanVideo15TrtllmAttnProcessor", "SkipCalibration", "SkipSoftmaxSpec", "TrtllmAttentionHandle",
    "TrtllmAttnProcessor", "WanTrtllmAttnProcessor", "__version__", "add_attention_args", "calibrate",
    "config_from_args", "context_parallel_plan", "enable_trtllm_attention", "set_dispatch_config",
]

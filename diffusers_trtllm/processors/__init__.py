"""Attention processors, one module per model family; ``PROCESSORS`` lists them for ``enable_trtllm_attention``."""

from .base import TrtllmAttnProcessor
from .cosmos3 import Cosmos3TrtllmAttnProcessor
from .hunyuan_video15 import HunyuanVideo15TrtllmAttnProcessor
from .wan import WanTrtllmAttnProcessor

PROCESSORS: tuple[type[TrtllmAttnProcessor], ...] = (
    WanTrtllmAttnProcessor, HunyuanVideo15TrtllmAttnProcessor, Cosmos3TrtllmAttnProcessor)


def processor_class_for(transformer) -> type[TrtllmAttnProcessor] | None:
    """The processor made for ``transformer``'s class, or None."""
    name = type(transformer).__name__
    return next((cls for cls in PROCESSORS if name in cls.TRANSFORMER_CLASSES), None)


__all__ = ["PROCESSORS", "Cosmos3TrtllmAttnProcessor", "HunyuanVideo15TrtllmAttnProcessor", "TrtllmAttnProcessor",
           "WanTrtllmAttnProcessor", "processor_class_for"]

"""Attention processors, one module per model family; ``PROCESSORS`` lists them for ``enable_trtllm_attention``."""

from .base import TrtllmAttnProcessor
from .wan import WanTrtllmAttnProcessor

PROCESSORS: tuple[type[TrtllmAttnProcessor], ...] = (WanTrtllmAttnProcessor,)


def processor_class_for(transformer) -> type[TrtllmAttnProcessor] | None:
    """The processor made for ``transformer``'s class, or None."""
    name = type(transformer).__name__
    return next((cls for cls in PROCESSORS if name in cls.TRANSFORMER_CLASSES), None)


__all__ = ["PROCESSORS", "TrtllmAttnProcessor", "WanTrtllmAttnProcessor", "processor_class_for"]

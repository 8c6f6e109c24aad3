"""diffusers has no TorchCompileTesterMixin tests for HunyuanVideo 1.5; this pairs diffusers' own test config with
its own compile mixin. run_upstream.py copies it into each test tree as
tests/models/transformers/test_trtllm_hunyuan_video15_compile.py (the relative imports need it there); its name
here lacks "test_" so this package's own suite does not collect it."""

from ..testing_utils import TorchCompileTesterMixin
from .test_models_transformer_hunyuan_1_5 import HunyuanVideo15TransformerTesterConfig


class TestHunyuanVideo15TransformerCompile(HunyuanVideo15TransformerTesterConfig, TorchCompileTesterMixin):
    pass

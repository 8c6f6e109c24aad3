"""This package's config extensions (the accuracy probe, the SAGE step schedule) on vLLM-Omni's path: its own
parser refuses them, naming the key, before the plugin runs; this package's parser of the same flags takes them."""

import json

import pytest

from diffusers_trtllm import AttnQuantSpec, config_from_args
from diffusers_trtllm.config import AccuracySpec

ACCURACY = {"backend": "TRTLLM_ATTN", "accuracy": {"probe_rows": 16, "max_error": 0.1}}
SCHEDULE = {"backend": "TRTLLM_ATTN", "quant": {"dtype_qk": "fp8_e4m3", "disabled_until_timestep": 0.9}}


@pytest.mark.parametrize("spec, key", [(ACCURACY, "accuracy"), (SCHEDULE, "disabled_until_timestep")])
def test_vllm_omni_refuses_the_extension_keys_and_this_package_takes_them(spec, key):
    from vllm_omni.diffusion.data import AttentionConfig as OmniAttentionConfig

    with pytest.raises(TypeError, match=f"unexpected keyword argument '{key}'"):
        OmniAttentionConfig(default=spec)
    with pytest.raises((TypeError, ValueError), match=f"'{key}'|role 'self'"):
        OmniAttentionConfig(default={"backend": "TRTLLM_ATTN"}, per_role={"self": spec})
    default = config_from_args(environ={"DIFFUSION_ATTENTION_CONFIG": json.dumps({"default": spec})}).default
    if key == "accuracy":
        assert default.accuracy == AccuracySpec(probe_rows=16, max_error=0.1)
    else:
        assert default.quant == AttnQuantSpec(dtype_qk="fp8_e4m3", disabled_until_timestep=0.9)

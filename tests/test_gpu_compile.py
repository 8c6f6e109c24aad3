"""On an H100/H200/B200: every TRTLLM_ATTN configuration on a small Wan transformer with head_dim 128 runs the real
kernels eager and with every block compiled (``fullgraph=True``), compiled equals eager, and a call makes no
host-device sync (``torch.cuda.set_sync_debug_mode("error")``)."""

import pytest
import torch

from diffusers_trtllm import enable_trtllm_attention
from diffusers_trtllm.platform import gpu_arch

from helpers import rel_err, tiny_wan, wan_inputs

pytestmark = pytest.mark.gpu

CONFIGS = {
    "dense": {},
    "skip": {"skip_softmax": {"threshold": 0.05}},
    "sage-int8": {"quant": {"dtype_qk": "int8"}},
    "sage-fp8": {"quant": {"dtype_qk": "fp8_e4m3"}},
    "sage-fp8+skip": {"quant": {"dtype_qk": "fp8_e4m3"}, "skip_softmax": {"threshold": 0.05}},
    # on Hopper the Triton kernel's sampled skipping: three launches, plain (unspecialized) sampling arguments
    "sage-int8+skip": {"quant": {"dtype_qk": "int8"}, "skip_softmax": {"threshold": 0.05}},
}
# bf16 kernels against diffusers' default in bf16; SAGE's quantization error is that of its semantics (README)
TOLERANCE = {"dense": 2e-2, "skip": 5e-2, "sage-int8": 8e-2, "sage-fp8": 1e-1, "sage-fp8+skip": 1e-1,
             "sage-int8+skip": 8e-2}


def gpu_supported() -> bool:
    return torch.cuda.is_available() and gpu_arch(torch.device("cuda")) in ("sm_90", "sm_100", "sm_103")


@pytest.mark.skipif(not torch.cuda.is_available() or not gpu_supported(),
                    reason="needs an sm_90/sm_100/sm_103 GPU")
@pytest.mark.parametrize("name", list(CONFIGS))
def test_trtllm_configs_compile_match_eager_and_never_sync(name):
    torch.manual_seed(0)
    model = tiny_wan(num_attention_heads=2, attention_head_dim=128, qk_gain=4.0).to("cuda", torch.bfloat16)
    inputs = {k: v.to("cuda", torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else
              (v.to("cuda") if torch.is_tensor(v) else v)
              for k, v in wan_inputs(batch=2, frames=2, height=32, width=32).items()}  # 512 video tokens
    with torch.no_grad():
        default = model(**inputs)[0]
        config = {"default": {"backend": "TRTLLM_ATTN", **CONFIGS[name]},
                  "per_role": {"cross_attn": {"backend": "TORCH_SDPA"}}}
        with enable_trtllm_attention(model, config) as handle:
            eager = model(**inputs)[0]
            assert rel_err(eager, default) < TOLERANCE[name]
            for block in model.blocks:
                block.compile(fullgraph=True)
            try:
                compiled = model(**inputs)[0]  # compiles
                torch.cuda.synchronize()
                previous = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    again = model(**inputs)[0]
                finally:
                    torch.cuda.set_sync_debug_mode(previous)
            finally:
                for block in model.blocks:
                    block._compiled_call_impl = None
                torch._dynamo.reset()
            modes = {mode for step in handle.stats.modes().values() for mode in step}
    assert rel_err(compiled, eager) < 1e-2 and torch.equal(again, compiled)
    expected = "TRTLLM_ATTN:" + {"dense": "dense", "skip": "skip", "sage-int8": "sage-int8", "sage-fp8": "sage-fp8_e4m3",
                                 "sage-fp8+skip": "sage-fp8_e4m3+skip",
                                 "sage-int8+skip": "sage-int8+skip"}[name]
    assert expected in modes, modes

"""On an H100/H200/B200: every TRTLLM_ATTN configuration on small Wan 2.2, HunyuanVideo 1.5 and Cosmos 3
transformers with head_dim 128 runs the real kernels eager and with every block compiled (``fullgraph=True``),
compiled equals eager, and the compiled blocks make no host-device sync (``torch.cuda.set_sync_debug_mode("error")``).

The blocks are called one by one with the arguments the transformer gave them: the transformers' own forward code
around the blocks syncs by itself in HunyuanVideo 1.5 and Cosmos 3 (boolean-mask indexing, a data-dependent
branch), which is diffusers' code, not this package's. The first block is left out of the sync check: its pre-hook
is HunyuanVideo 1.5's one documented host read of the text mask per transformer call.
"""

import pytest
import torch

from diffusers_trtllm import enable_trtllm_attention
from diffusers_trtllm.platform import gpu_arch
from diffusers_trtllm.tiny_pipelines import tiny_cosmos3_transformer, tiny_hunyuan_video15_transformer

from helpers import cosmos3_transformer_call, rel_err, tiny_wan, wan_inputs
from test_hunyuan_video15 import transformer_inputs as hunyuan_inputs

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
MODES = {"dense": "dense", "skip": "skip", "sage-int8": "sage-int8", "sage-fp8": "sage-fp8_e4m3",
         "sage-fp8+skip": "sage-fp8_e4m3+skip", "sage-int8+skip": "sage-int8+skip"}
# bf16 kernels against diffusers' default in bf16; SAGE's quantization error is that of its semantics (README)
TOLERANCE = {"dense": 2e-2, "skip": 5e-2, "sage-int8": 8e-2, "sage-fp8": 1e-1, "sage-fp8+skip": 1e-1,
             "sage-int8+skip": 8e-2}


def gpu_supported() -> bool:
    return torch.cuda.is_available() and gpu_arch(torch.device("cuda")) in ("sm_90", "sm_100", "sm_103")


def to_gpu(value):
    if torch.is_tensor(value):
        return value.to("cuda", torch.bfloat16) if value.is_floating_point() else value.to("cuda")
    if isinstance(value, list):
        return [to_gpu(v) for v in value]
    return value


def wan():
    model = tiny_wan(num_attention_heads=2, attention_head_dim=128, qk_gain=4.0)
    return model, model.blocks, wan_inputs(batch=2, frames=2, height=32, width=32)  # 512 video tokens


def hunyuan():
    model = tiny_hunyuan_video15_transformer(qk_gain=4.0, attention_head_dim=128, rope_axes_dim=(16, 56, 56))
    return model, model.transformer_blocks, hunyuan_inputs(frames=2, height=32, width=32)  # padded text


def cosmos3():
    _, kwargs = cosmos3_transformer_call()  # the packed inputs of the tiny pipeline (4 gen tokens on 44 text)
    model = tiny_cosmos3_transformer(qk_gain=4.0, head_dim=128, hidden_size=256, num_attention_heads=2,
                                     num_key_value_heads=1, rope_axes_dim=(32, 16, 16))
    return model, model.layers, kwargs


MODELS = {"wan": wan, "hunyuan": hunyuan, "cosmos3": cosmos3}
# Wan's cross-attention (512 queries on 16 text keys) is faster on cuDNN; Cosmos 3's causal text stream runs
# dense on a causal kernel by itself.
PER_ROLE = {"wan": {"cross_attn": {"backend": "TORCH_SDPA"}}, "hunyuan": {}, "cosmos3": {}}


def output(model, inputs) -> torch.Tensor:
    """The transformer's denoised output as one tensor (Cosmos 3 returns a list, one per vision input)."""
    out = model(**inputs)[0]
    return torch.cat([x.flatten() for x in out]) if isinstance(out, list) else out


def block_arguments(model, blocks, inputs):
    """Each block's (args, kwargs) in one eager transformer call, and that call's output."""
    captured = []
    hooks = [b.register_forward_pre_hook(lambda m, a, kw: captured.append((a, kw)), with_kwargs=True)
             for b in blocks]
    try:
        out = output(model, inputs)
    finally:
        for h in hooks:
            h.remove()
    return captured, out


@pytest.mark.skipif(not gpu_supported(), reason="needs an sm_90/sm_100/sm_103 GPU")
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_trtllm_configs_compile_match_eager_and_never_sync(model_name, name):
    torch.manual_seed(0)
    model, blocks, inputs = MODELS[model_name]()
    model = model.to("cuda", torch.bfloat16)
    inputs = {k: to_gpu(v) for k, v in inputs.items()}
    config = {"default": {"backend": "TRTLLM_ATTN", **CONFIGS[name]}, "per_role": PER_ROLE[model_name]}
    with torch.no_grad():
        default = output(model, inputs)
        with enable_trtllm_attention(model, config) as handle:
            arguments, eager = block_arguments(model, blocks, inputs)
            assert rel_err(eager, default) < TOLERANCE[name]
            eager_blocks = [block(*a, **kw) for block, (a, kw) in zip(blocks, arguments)]
            for block in blocks:
                block.compile(fullgraph=True)
            try:
                compiled = output(model, inputs)  # compiles
                torch.cuda.synchronize()
                previous = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    again = [block(*a, **kw) for block, (a, kw) in zip(blocks[1:], arguments[1:])]
                finally:
                    torch.cuda.set_sync_debug_mode(previous)
            finally:
                for block in blocks:
                    block._compiled_call_impl = None
                torch._dynamo.reset()
            modes = {mode for step in handle.stats.modes().values() for mode in step}
    assert rel_err(compiled, eager) < 1e-2
    for got, want in zip(again, eager_blocks[1:]):
        for g, w in zip(*(x if isinstance(x, tuple) else (x,) for x in (got, want))):
            assert rel_err(g, w) < 1e-2
    # a dense step on Hopper names its kernel: "dense[flash_attn4]"
    assert f"TRTLLM_ATTN:{MODES[name]}" in {mode.split("[")[0] for mode in modes}, modes

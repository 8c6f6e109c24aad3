"""The package under the diffusers speed stack: caches (FirstBlockCache, MagCache, TaylorSeer), model CPU offload,
group offloading, LoRA adapters and ``compile_repeated_blocks``, on the tiny Wan 2.2 pipeline.

Each composition, installed with the dense ``TORCH_SDPA`` config, generates what diffusers' own processors generate
under the same hook (the tolerance is the processors' parity bound, ``test_wan``); SAGE + Skip-Softmax on
``TORCH_REFERENCE`` runs under it and reports every step it ran.
"""

import pytest
import torch
from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

from diffusers_trtllm import enable_trtllm_attention
from diffusers_trtllm.tiny_pipelines import tiny_wan22_pipeline

from helpers import max_rel_err

STEPS = 4
DENSE = {"default": {"backend": "TORCH_SDPA"}}
SAGE_SKIP = {"default": {"backend": "TORCH_REFERENCE", "skip_softmax": {"threshold": 0.3},
                         "quant": {"dtype_qk": "int8"}}}


def generate(pipe):
    return pipe("a fox in snow", negative_prompt="blur", height=32, width=32, num_frames=5,
                num_inference_steps=STEPS, generator=torch.Generator().manual_seed(0), output_type="latent").frames


def enable_lora(pipe):
    from peft import LoraConfig

    for transformer in (pipe.transformer, pipe.transformer_2):
        transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights=False,
                                           target_modules=["to_q", "to_k", "to_v", "to_out.0"]), adapter_name="fox")
    pipe.set_adapters("fox", adapter_weights=0.7)


def transformers(pipe):
    return (pipe.transformer, pipe.transformer_2)


STACKS = {
    "first-block-cache": lambda pipe: [t.enable_cache(FirstBlockCacheConfig(threshold=0.2)) for t in transformers(pipe)],
    "mag-cache": lambda pipe: [t.enable_cache(MagCacheConfig(threshold=0.5, num_inference_steps=STEPS,
                                                             mag_ratios=[1.0] + [0.98] * (STEPS - 1)))
                               for t in transformers(pipe)],
    "taylorseer": lambda pipe: [t.enable_cache(TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1,
                                                                     taylor_factors_dtype=torch.float32))
                                for t in transformers(pipe)],
    "model-cpu-offload": lambda pipe: pipe.enable_model_cpu_offload(device="cpu"),
    "group-offload": lambda pipe: [t.enable_group_offload(torch.device("cpu"), offload_type="block_level",
                                                          num_blocks_per_group=1) for t in transformers(pipe)],
    "lora": enable_lora,
    "compile-repeated-blocks": lambda pipe: [t.compile_repeated_blocks(fullgraph=True, backend="eager")
                                             for t in transformers(pipe)],
}


def stacked(name, config=None):
    """A fresh tiny pipeline with ``config`` installed (None: diffusers' processors), then the stack applied."""
    pipe = tiny_wan22_pipeline(0)
    pipe.set_progress_bar_config(disable=True)
    handle = enable_trtllm_attention(pipe, config) if config is not None else None
    STACKS[name](pipe)
    return pipe, handle


@pytest.mark.parametrize("name", list(STACKS))
def test_dense_install_equals_diffusers_processors_under_the_stack(name):
    torch._dynamo.reset()
    expected = generate(stacked(name)[0])
    pipe, handle = stacked(name, DENSE)
    got = generate(pipe)
    assert max_rel_err(got, expected) <= 1e-5
    assert set(handle.stats.modes()) <= set(range(STEPS)) and handle.stats.modes()


@pytest.mark.parametrize("name", list(STACKS))
def test_sage_and_skip_run_and_report_under_the_stack(name):
    torch._dynamo.reset()
    pipe, handle = stacked(name, SAGE_SKIP)
    out = generate(pipe)
    assert torch.isfinite(out).all()
    modes = handle.stats.modes()
    assert modes and set(modes) <= set(range(STEPS))
    assert {mode for step in modes.values() for mode in step} == {"TORCH_REFERENCE:sage-int8+skip"}
    assert handle.stats.summary()["sparsity"] is not None

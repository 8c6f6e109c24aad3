"""HunyuanVideo 1.5: the processor reproduces diffusers' default, packs masked text, gates, skips, installs."""

import copy
import inspect

import pytest
import torch
from diffusers.models.attention_processor import AttnProcessor2_0
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0
from helpers import max_rel_err, predicted_gate_modes

from diffusers_trtllm import HunyuanVideo15TrtllmAttnProcessor, enable_trtllm_attention
from diffusers_trtllm.tiny_pipelines import tiny_hunyuan_video15_pipeline, tiny_hunyuan_video15_transformer

DENSE_SDPA = {"default": {"backend": "TORCH_SDPA"}}
DENSE_REFERENCE = {"default": {"backend": "TORCH_REFERENCE"}}
TEXT_LEN, GLYPH_LEN, IMAGE_TOKENS = 24, 8, 4


def prefix_mask(lengths, total):
    return (torch.arange(total)[None, :] < torch.tensor(lengths)[:, None]).long()


def transformer_inputs(text_lengths=(24, 9), glyph_lengths=(0, 5), frames=2, height=8, width=8, timestep=700.0):
    """Two samples whose MLLM and ByT5 texts have different valid lengths (the second sample's padding shows
    up as padded text tokens in every joint attention)."""
    batch = len(text_lengths)
    return dict(hidden_states=torch.randn(batch, 9, frames, height, width),
                timestep=torch.full((batch,), timestep),
                encoder_hidden_states=torch.randn(batch, TEXT_LEN, 32),
                encoder_attention_mask=prefix_mask(text_lengths, TEXT_LEN),
                encoder_hidden_states_2=torch.randn(batch, GLYPH_LEN, 16),
                encoder_attention_mask_2=prefix_mask(glyph_lengths, GLYPH_LEN),
                image_embeds=torch.zeros(batch, IMAGE_TOKENS, 8), return_dict=False)


def run(transformer, inputs):
    with torch.no_grad():
        return transformer(**inputs)[0]


def test_signature_keeps_every_argument_diffusers_passes():
    # Attention.forward drops the kwargs a processor's signature does not name (image_rotary_emb among them).
    default = inspect.signature(HunyuanVideo15AttnProcessor2_0.__call__).parameters
    ours = inspect.signature(HunyuanVideo15TrtllmAttnProcessor.__call__).parameters
    assert list(ours) == list(default)


@pytest.mark.parametrize("config", [DENSE_SDPA, DENSE_REFERENCE], ids=["sdpa", "reference"])
def test_joint_attention_matches_default_with_unequal_text_lengths(config):
    """One joint attention layer, batch of two with 20 and 7 valid text tokens of 20. Video outputs and valid
    text outputs are what the model uses; padded text rows attend to nothing, where PyTorch's SDPA returns 0 and
    so does this processor, so after ``to_add_out`` they match too (both are its bias)."""
    transformer = tiny_hunyuan_video15_transformer()
    attn = transformer.transformer_blocks[0].attn
    video_shape = torch.zeros(2, 9, 2, 4, 6)
    rotary = transformer.rope(video_shape)
    video, text = torch.randn(2, 48, 32), torch.randn(2, 20, 32)
    mask = prefix_mask((20, 7), 20)
    with torch.no_grad():
        ref_video, ref_text = HunyuanVideo15AttnProcessor2_0()(attn, video, text, mask, rotary)
        out_video, out_text = HunyuanVideo15TrtllmAttnProcessor(config)(attn, video, text, mask, rotary)
    valid = mask.bool()
    assert max_rel_err(out_video, ref_video) <= 1e-5
    assert max_rel_err(out_text[valid], ref_text[valid]) <= 1e-5
    assert max_rel_err(out_text[~valid], ref_text[~valid]) <= 1e-5


@pytest.mark.parametrize("config", [DENSE_SDPA, DENSE_REFERENCE], ids=["sdpa", "reference"])
def test_transformer_matches_default_processors(config):
    transformer = tiny_hunyuan_video15_transformer()
    inputs = transformer_inputs()
    reference = run(transformer, inputs)
    originals = transformer.attn_processors
    transformer.set_attn_processor(HunyuanVideo15TrtllmAttnProcessor(config))
    assert max_rel_err(run(transformer, inputs), reference) <= 1e-5
    transformer.set_attn_processor(originals)
    assert torch.equal(run(transformer, inputs), reference)


def test_set_attn_processor_hands_text_refiner_to_diffusers():
    """``set_attn_processor(proc)`` replaces the refiner's processors too; refiner calls run diffusers' own
    AttnProcessor2_0 math, so the plan only sees joint attention."""
    transformer = tiny_hunyuan_video15_transformer()
    inputs = transformer_inputs()
    reference = run(transformer, inputs)
    processor = HunyuanVideo15TrtllmAttnProcessor(DENSE_REFERENCE)
    transformer.set_attn_processor(processor)
    refiner = transformer.context_embedder.token_refiner.refiner_blocks[0].attn
    assert refiner.processor is processor and not processor.serves(refiner)
    assert max_rel_err(run(transformer, inputs), reference) <= 1e-5


def test_enable_installs_on_joint_blocks_only_and_restores():
    transformer = tiny_hunyuan_video15_transformer()
    originals = transformer.attn_processors
    inputs = transformer_inputs()
    reference = run(transformer, inputs)
    with enable_trtllm_attention(transformer, DENSE_REFERENCE) as handle:
        installed = transformer.attn_processors
        for key, original in originals.items():
            is_joint = key.startswith("transformer_blocks.")
            assert isinstance(installed[key], HunyuanVideo15TrtllmAttnProcessor) == is_joint
            assert is_joint or isinstance(installed[key], AttnProcessor2_0) and installed[key] is original
        assert max_rel_err(run(transformer, inputs), reference) <= 1e-5
        assert handle.stats.modes() == {0: {"TORCH_REFERENCE:dense": 2}}
    assert all(transformer.attn_processors[key] is proc for key, proc in originals.items())


@pytest.mark.parametrize("quant", [None, {"dtype_qk": "int8"}, {"dtype_qk": "fp8_e4m3"}], ids=["skip", "int8", "fp8"])
def test_skip_and_sage_on_reference_backend(quant):
    """Local, peaky attention (qk_gain 4), 2 frames of 12 × 12 latents: 288 video + up to 36 text tokens per sample."""
    transformer = tiny_hunyuan_video15_transformer(qk_gain=4.0)
    inputs = transformer_inputs(height=12, width=12)
    reference = run(transformer, inputs)
    spec = {"backend": "TORCH_REFERENCE", "skip_softmax": {"threshold": 0.2}} if quant is None else \
        {"backend": "TORCH_REFERENCE", "quant": quant}
    with enable_trtllm_attention(transformer, {"default": spec}) as handle:
        out = run(transformer, inputs)
    summary = handle.stats.summary()
    mode = "skip" if quant is None else f"sage-{quant['dtype_qk']}"
    assert summary["modes"] == {0: {f"TORCH_REFERENCE:{mode}": 2}}
    if quant is None:
        assert 0.2 < summary["sparsity"] < 1.0, summary["sparsity"]
    assert max_rel_err(out, reference) < 0.1


def test_gate_switches_at_predicted_step():
    """Flow-matching Euler with shift 7 over 4 steps (t = 1, 0.955, 0.875, 0.7): skipping starts at the first step
    whose timestep / 1000 is at most D; the two CFG calls of a step count as one step."""
    pipe = tiny_hunyuan_video15_pipeline()
    pipe.set_progress_bar_config(disable=True)
    steps, gate = 4, 0.9
    scheduler = copy.deepcopy(pipe.scheduler)
    scheduler.set_timesteps(sigmas=[1.0 - i / steps for i in range(steps)])
    expected = predicted_gate_modes(scheduler, gate, from_sigmas=False)
    assert "dense" in expected.values() and "skip" in expected.values()
    config = {"default": {"backend": "TORCH_REFERENCE",
                          "skip_softmax": {"threshold": 0.2, "disabled_until_timestep": gate}}}
    with enable_trtllm_attention(pipe, config) as handle:
        pipe("a fox runs through snow", negative_prompt="blurry", height=128, width=192, num_frames=5,
             num_inference_steps=steps, output_type="latent", generator=torch.Generator().manual_seed(0))
    layers = len(pipe.transformer.transformer_blocks)
    assert handle.stats.modes() == {i: {f"TORCH_REFERENCE:{mode}": layers} for i, mode in expected.items()}
    assert all((i in handle.stats.skipping()) == (mode == "skip") for i, mode in expected.items())
    assert all(handle.stats.per_step()[i] > 0 for i in handle.stats.skipping())

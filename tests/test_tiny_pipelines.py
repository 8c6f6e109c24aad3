"""The tiny pipelines saved with ``save_pretrained`` and loaded by path (as vLLM-Omni's diffusers adapter loads
them) are the pipelines that were built: the same weights bit for bit, the same transformer inputs, shape for
shape, and the same output up to float32 rounding."""

import pytest
import torch
from diffusers import DiffusionPipeline

from diffusers_trtllm.tiny_pipelines import tiny_cosmos3_pipeline, tiny_hunyuan_video15_pipeline, tiny_wan22_pipeline

from helpers import rel_err

PROMPT = "a red fox in snow"
BUILDERS = {"wan22": tiny_wan22_pipeline, "hunyuan_video15": tiny_hunyuan_video15_pipeline,
            "cosmos3": tiny_cosmos3_pipeline}


def transformer_inputs_and_output(pipe):
    """The shapes of every tensor argument of each transformer call, and the latents of a 2-step run."""
    shapes = []

    def record(module, args, kwargs):
        shapes.append({name: tuple(value.shape) for name, value in kwargs.items() if isinstance(value, torch.Tensor)})

    hooks = [getattr(pipe, name).register_forward_pre_hook(record, with_kwargs=True)
             for name in ("transformer", "transformer_2") if getattr(pipe, name, None) is not None]
    pipe.set_progress_bar_config(disable=True)
    try:
        out = pipe(PROMPT, height=32, width=32, num_frames=5, num_inference_steps=2, output_type="latent",
                   generator=torch.Generator().manual_seed(0))
    finally:
        for hook in hooks:
            hook.remove()
    latents = out.frames if hasattr(out, "frames") else out.video
    return shapes, latents


@pytest.mark.parametrize("name", list(BUILDERS))
def test_saved_and_loaded_by_path_runs_as_built(name, tmp_path):
    built = BUILDERS[name](0)
    built.save_pretrained(tmp_path)
    loaded = DiffusionPipeline.from_pretrained(tmp_path, torch_dtype=torch.float32)
    assert type(loaded) is type(built)

    for component, module in built.components.items():  # what was saved is what is loaded, bit for bit
        if isinstance(module, torch.nn.Module):
            loaded_state = getattr(loaded, component).state_dict()
            assert all(torch.equal(tensor, loaded_state[key]) for key, tensor in module.state_dict().items()), component
    built_shapes, built_latents = transformer_inputs_and_output(built)
    loaded_shapes, loaded_latents = transformer_inputs_and_output(loaded)
    assert built_shapes and loaded_shapes == built_shapes
    # the same weights and inputs: equal up to float32 rounding (a CPU's BLAS may pick its kernel by where the
    # weights lie in memory, which loading from a file changes)
    assert rel_err(loaded_latents, built_latents) < 1e-5


def test_hunyuan_video15_attention_sees_only_the_prompt_of_its_full_length_text_path():
    """The pipeline's own text lengths (they are not saved, so the tiny pipeline keeps them); the chat template's
    system turn is exactly what the pipeline crops, so the valid MLLM tokens are the prompt's characters and a
    newline, as the real tokenizer leaves the prompt's tokens."""
    pipe = tiny_hunyuan_video15_pipeline()
    embeds, mask, glyph_embeds, glyph_mask = pipe.encode_prompt(PROMPT, device=torch.device("cpu"))
    assert (embeds.shape[1], glyph_embeds.shape[1], pipe.vision_num_semantic_tokens) == (1000, 256, 729)
    assert mask.sum().item() == len(PROMPT) + 1 and glyph_mask.sum().item() == 0

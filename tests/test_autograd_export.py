"""The attention op trains and exports: its backward is dense attention's (exact for dense backends,
straight-through for Skip-Softmax and SAGE), and ``torch.export`` takes a transformer with the processors."""

import pytest
import torch

from diffusers_trtllm import enable_trtllm_attention

from helpers import rel_err, tiny_wan, wan_inputs

CONFIGS = {"reference-dense": {"backend": "TORCH_REFERENCE"},
           "reference-sage": {"backend": "TORCH_REFERENCE", "quant": {"dtype_qk": "int8"}}}


def weight_gradient(model, inputs) -> torch.Tensor:
    model.zero_grad()
    model(**inputs)[0].square().mean().backward()
    return model.blocks[0].attn1.to_q.weight.grad.clone()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gradients_through_the_op_match_diffusers(name):
    model, inputs = tiny_wan(), wan_inputs()
    expected = weight_gradient(model, inputs)
    with enable_trtllm_attention(model, {"default": CONFIGS[name]}):
        got = weight_gradient(model, inputs)
    # dense: the same math (float32 rounding); SAGE: the forward is quantized, the backward dense
    assert rel_err(got, expected) < (1e-5 if name == "reference-dense" else 1e-2)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_export_takes_the_processors(name):
    model, inputs = tiny_wan(), wan_inputs()
    with enable_trtllm_attention(model, {"default": CONFIGS[name]}) as handle, torch.no_grad():
        eager = model(**inputs)[0]
        exported = torch.export.export(model, (), kwargs=inputs)
        assert rel_err(exported.module()(**inputs)[0], eager) < 1e-6
        assert handle.stats.modes()  # statistics of the eager call; exporting records none

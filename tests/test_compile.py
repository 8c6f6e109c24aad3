"""``torch.compile`` through this package's processors: no graph breaks, fullgraph per block and whole model, no
recompiles when the timestep gate switches or a pipeline is called again, compiled output equal to eager.

Compile backends: ``eager`` (fast: Dynamo's tracing and guards, where graph breaks and recompiles show) and,
marked slow, ``inductor`` (what users run: AOTAutograd functionalizes the op's in-place ``counts`` argument and
inductor lowers the graph around the op).

Tolerances: the attention op is opaque to the compiler, so compiled and eager run the same attention; inductor
only fuses and reorders the float32 arithmetic around it (norms, modulation, projections), which moves outputs by
a few float32 rounding steps (observed ~1e-6 relative; the eager compile backend is exact). 1e-4 relative leaves
room for that. The tiny shapes fit in one 128 × 128 skip tile, so Skip-Softmax changes no output here: these tests
are about what the compiler sees (the skip value as a tensor input), not about skipping.
"""

import pytest
import torch
import torch._dynamo.utils as dynamo_utils

from diffusers_trtllm import enable_trtllm_attention
from diffusers_trtllm.tiny_pipelines import tiny_hunyuan_video15_transformer, tiny_wan22_pipeline

from helpers import cosmos3_transformer_call, max_rel_err, tiny_wan, wan_inputs
from test_hunyuan_video15 import transformer_inputs as hunyuan_inputs

COMPILE_TOLERANCE = 1e-4
BACKENDS = ["eager", pytest.param("inductor", marks=pytest.mark.slow)]
CONFIGS = {
    "sdpa": {"default": {"backend": "TORCH_SDPA"}},
    "reference": {"default": {"backend": "TORCH_REFERENCE"}},
    "reference-skip": {"default": {"backend": "TORCH_REFERENCE", "skip_softmax": {"threshold": 0.3}}},
    "reference-sage-int8": {"default": {"backend": "TORCH_REFERENCE", "quant": {"dtype_qk": "int8"}}},
}


@pytest.fixture(scope="module")
def cosmos3_call():
    return cosmos3_transformer_call()


def model_call(name, cosmos3_call):
    """(transformer, inputs, its repeated blocks) at the smallest shapes that still exercise every role."""
    if name == "wan":
        model = tiny_wan()
        return model, wan_inputs(batch=1, frames=1, height=8, width=8), model.blocks
    if name == "cosmos3":
        model, inputs = cosmos3_call
        return model, inputs, model.layers
    model = tiny_hunyuan_video15_transformer()
    # two samples with different valid text lengths: every joint attention sees padded text
    return model, hunyuan_inputs(frames=1, height=4, width=4), model.transformer_blocks


def first_output(out):
    out = out[0]
    return out[0] if isinstance(out, list) else out  # Cosmos 3 returns per-modality lists


def run(model, inputs):
    with torch.no_grad():
        return first_output(model(**inputs))


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("name", ["wan", "cosmos3"])
def test_whole_model_traces_as_one_graph(name, config, cosmos3_call):
    model, inputs, _ = model_call(name, cosmos3_call)
    with enable_trtllm_attention(model, CONFIGS[config]), torch.no_grad():
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(model)(**inputs)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons


@pytest.mark.parametrize("config", ["reference-skip"])
def test_hunyuan_graph_breaks_are_diffusers_own(config, cosmos3_call):
    """diffusers' HunyuanVideo 1.5 transformer itself breaks the graph (``if torch.all(image_embeds == 0)`` and
    the boolean-mask reordering of text tokens), so it cannot be compiled whole with ``fullgraph=True``; this
    package's processors add no break of their own (the block-0 pre-hook that reads the text lengths runs as a
    frame of its own when the transformer's forward falls back to eager, which is not a break)."""
    model, inputs, _ = model_call("hunyuan", cosmos3_call)

    def break_sites():
        torch._dynamo.reset()
        with torch.no_grad():
            reasons = torch._dynamo.explain(model)(**inputs).break_reasons
        return {(frame.filename, frame.lineno) for reason in reasons for frame in reason.user_stack[-1:]}

    native = break_sites()
    with enable_trtllm_attention(model, CONFIGS[config]):
        ours = break_sites()
    assert native and all(filename.endswith("transformer_hunyuan_video15.py") for filename, _ in native)
    assert ours == native


# inductor: the SDPA path and one op path (the reference configs differ only in the op's arguments)
BLOCK_CASES = [(config, "eager") for config in CONFIGS] + [
    pytest.param(config, "inductor", marks=pytest.mark.slow) for config in ("sdpa", "reference-sage-int8")]


@pytest.mark.parametrize("config, backend", BLOCK_CASES)
@pytest.mark.parametrize("name", ["wan", "hunyuan", "cosmos3"])
def test_blocks_compile_fullgraph_and_match_eager(name, config, backend, cosmos3_call):
    model, inputs, blocks = model_call(name, cosmos3_call)
    with enable_trtllm_attention(model, CONFIGS[config]):
        eager = run(model, inputs)
        torch._dynamo.reset()
        for block in blocks:
            block.compile(fullgraph=True, backend=backend)
        try:
            compiled = run(model, inputs)
        finally:
            for block in blocks:
                block._compiled_call_impl = None  # the Cosmos 3 transformer is shared by the module's tests
    assert max_rel_err(compiled, eager) <= COMPILE_TOLERANCE


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["wan", "cosmos3"])
def test_whole_model_compiles_fullgraph_and_matches_eager(name, backend, cosmos3_call):
    """The run tracker's timestep pre-hook steps aside while compiling: the whole model is one graph."""
    model, inputs, _ = model_call(name, cosmos3_call)
    config = {"default": {"backend": "TORCH_REFERENCE", "skip_softmax": {"threshold": 0.3}}}
    with enable_trtllm_attention(model, config):
        eager = run(model, inputs)
        torch._dynamo.reset()
        compiled = run(torch.compile(model, fullgraph=True, backend=backend), inputs)
    assert max_rel_err(compiled, eager) <= COMPILE_TOLERANCE


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_expert_pipeline_compiles_one_graph_for_every_block(backend):
    """Wan 2.2 with both experts' blocks compiled (fullgraph), a gate that switches Skip-Softmax on mid-run, its
    tile maps reused at the step after, and two pipeline calls: exactly one graph. Why one: every block of both experts has the same structure and
    shapes, and what differs between blocks (weights, the planned calls) or between steps (the skip value, filled
    in place by the planner) reaches the graph as tensor inputs, never as a guarded Python constant; a second
    call changes nothing either."""
    pipe = tiny_wan22_pipeline()
    pipe.set_progress_bar_config(disable=True)
    gate = 0.8  # 4 steps from t = 1: dense while t > 0.8, then skipping; the experts switch at t = 0.875
    config = {"default": {"backend": "TORCH_REFERENCE",
                          "skip_softmax": {"threshold": 0.3, "disabled_until_timestep": gate, "reuse_steps": 1}}}

    def generate():
        return pipe("a fox", height=32, width=32, num_frames=1, num_inference_steps=4, output_type="latent",
                    generator=torch.Generator().manual_seed(0)).frames

    with enable_trtllm_attention(pipe, config) as handle:
        eager = generate()
        modes = {step: set(m) for step, m in handle.stats.modes().items()}
        assert modes[0] == {"TORCH_REFERENCE:dense"} and modes[2] == {"TORCH_REFERENCE:skip"}  # the gate switched
        assert modes[3] == {"TORCH_REFERENCE:skip+reuse"}  # and the maps of step 2 were reused
        torch._dynamo.reset()
        dynamo_utils.counters.clear()
        for transformer in (pipe.transformer, pipe.transformer_2):
            for block in transformer.blocks:
                block.compile(fullgraph=True, backend=backend)
        first = generate()
        second = generate()
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 1
    assert max_rel_err(first, eager) <= COMPILE_TOLERANCE
    assert torch.equal(second, first)

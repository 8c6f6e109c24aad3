"""Cosmos 3: the processor reproduces diffusers' default, keeps the causal stream dense, gates, skips, installs."""

import copy
import inspect
from collections import Counter

import pytest
import torch
from diffusers.models.transformers.transformer_cosmos3 import Cosmos3AttnProcessor, _rotate_half
from helpers import load_script, max_rel_err, predicted_gate_modes
from torch.utils._python_dispatch import TorchDispatchMode

from diffusers_trtllm import Cosmos3TrtllmAttnProcessor, enable_trtllm_attention
from diffusers_trtllm.dispatch import BACKEND, set_dispatch_config
from diffusers_trtllm.steps import read_timestep_arguments
from diffusers_trtllm.tiny_pipelines import tiny_cosmos3_pipeline, tiny_cosmos3_transformer

DENSE_SDPA = {"default": {"backend": "TORCH_SDPA"}}
DENSE_REFERENCE = {"default": {"backend": "TORCH_REFERENCE"}}
PROMPT = "a red fox runs through fresh snow"


def stream_inputs(attn, und_len=37, gen_len=150):
    """Hidden states of both streams and their rotary tables (positions continue from text into generation)."""
    positions = torch.arange(und_len + gen_len, dtype=torch.float32)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, attn.head_dim, 2, dtype=torch.float32) / attn.head_dim))
    angles = torch.outer(positions, inv_freq).repeat(1, 2)
    cos, sin = angles.cos(), angles.sin()
    rotary = (cos[:und_len], sin[:und_len], cos[und_len:], sin[und_len:])
    return torch.randn(und_len, attn.hidden_size), torch.randn(gen_len, attn.hidden_size), rotary


def generate(pipe, steps, height=128, width=192):
    """Latents after ``steps`` steps; at 128 × 192 × 5 frames the generation stream has 192 tokens."""
    pipe.set_progress_bar_config(disable=True)
    return pipe(PROMPT, height=height, width=width, num_frames=5, num_inference_steps=steps, output_type="latent",
                generator=torch.Generator().manual_seed(0)).video


def test_signature_matches_default():
    default = inspect.signature(Cosmos3AttnProcessor.__call__).parameters
    assert list(inspect.signature(Cosmos3TrtllmAttnProcessor.__call__).parameters) == list(default)


@pytest.mark.parametrize("variant", [{}, {"qk_norm_for_text": False, "use_und_k_norm_for_gen": True}],
                         ids=["qk-norm", "und-k-norm-for-gen"])
@pytest.mark.parametrize("config", [DENSE_SDPA, DENSE_REFERENCE], ids=["sdpa", "reference"])
def test_attention_layer_matches_default(config, variant):
    attn = tiny_cosmos3_transformer(**variant).layers[0].self_attn
    und, gen, rotary = stream_inputs(attn)
    with torch.no_grad():
        ref_und, ref_gen = Cosmos3AttnProcessor()(attn, und, gen, rotary)
        out_und, out_gen = Cosmos3TrtllmAttnProcessor(config)(attn, und, gen, rotary)
    assert max_rel_err(out_und, ref_und) <= 1e-5
    assert max_rel_err(out_gen, ref_gen) <= 1e-5


def test_pipeline_matches_default_processors_and_restores():
    pipe = tiny_cosmos3_pipeline()
    small = dict(steps=2, height=64, width=96)
    reference = generate(pipe, **small)
    originals = pipe.transformer.attn_processors
    with enable_trtllm_attention(pipe, DENSE_REFERENCE) as handle:
        assert all(isinstance(p, Cosmos3TrtllmAttnProcessor) for p in pipe.transformer.attn_processors.values())
        assert max_rel_err(generate(pipe, **small), reference) <= 1e-5
    assert handle.stats.modes() == {step: {"TORCH_REFERENCE:dense": 2} for step in range(2)}
    assert all(pipe.transformer.attn_processors[key] is proc for key, proc in originals.items())

    pipe.transformer.set_attn_processor(Cosmos3TrtllmAttnProcessor(DENSE_SDPA))
    assert max_rel_err(generate(pipe, **small), reference) <= 1e-5
    pipe.transformer.set_attn_processor(originals)
    assert torch.equal(generate(pipe, **small), reference)


@pytest.mark.parametrize("spec, gen_mode", [
    ({"skip_softmax": {"threshold": 0.2}}, "skip"),
    ({"quant": {"dtype_qk": "int8"}}, "sage-int8"),
    ({"quant": {"dtype_qk": "fp8_e4m3"}, "skip_softmax": {"threshold": 0.2}}, "sage-fp8_e4m3+skip")],
    ids=["skip", "sage-int8", "sage-fp8+skip"])
def test_skip_and_sage_apply_to_generation_stream_only(spec, gen_mode):
    """The causal text stream stays dense and unquantized whatever the config says; the plan says so."""
    pipe = tiny_cosmos3_pipeline()
    reference = generate(pipe, steps=1)
    with enable_trtllm_attention(pipe, {"default": {"backend": "TORCH_REFERENCE", **spec}}) as handle:
        out = generate(pipe, steps=1)
        calls = {site.role: call for site, call in handle.planner.calls.items()}
    assert handle.stats.modes() == {0: {"TORCH_REFERENCE:dense": 2, f"TORCH_REFERENCE:{gen_mode}": 2}}
    causal = calls["und_causal"]
    assert causal.causal and causal.skip is None and causal.quant is None
    if "skip_softmax" in spec:
        assert handle.stats.summary()["sparsity"] > 0.1
    assert max_rel_err(out, reference) < 0.1


def test_gate_switches_at_predicted_step():
    """UniPC with flow shift 3 over 4 steps (t = 0.999, 0.9, 0.75, 0.5) and D = 0.8: the generation stream skips
    from the first step with t <= D on; the causal stream is dense throughout (``modes`` counts layers per mode)."""
    pipe = tiny_cosmos3_pipeline()
    steps, gate = 4, 0.8
    scheduler = copy.deepcopy(pipe.scheduler)
    scheduler.set_timesteps(steps)
    expected = predicted_gate_modes(scheduler, gate)
    assert "dense" in expected.values() and "skip" in expected.values()
    config = {"default": {"backend": "TORCH_REFERENCE",
                          "skip_softmax": {"threshold": 0.2, "disabled_until_timestep": gate}}}
    with enable_trtllm_attention(pipe, config) as handle:
        generate(pipe, steps=steps)
    layers = len(pipe.transformer.layers)
    assert handle.stats.modes() == {
        i: {"TORCH_REFERENCE:dense": layers} if mode == "dense" else
        {"TORCH_REFERENCE:dense": layers, "TORCH_REFERENCE:skip": layers} for i, mode in expected.items()}
    assert all((i in handle.stats.skipping()) == (mode == "skip") for i, mode in expected.items())
    assert all(handle.stats.per_step()[i] > 0 for i in handle.stats.skipping())


def test_timestep_reader_takes_every_noisy_modality():
    names = Cosmos3TrtllmAttnProcessor.TIMESTEP_ARGUMENTS
    bound = {"vision_timesteps": torch.full((6,), 750.0), "sound_timesteps": torch.empty(0),
             "action_timesteps": torch.full((2,), 900.0)}
    assert read_timestep_arguments(bound, names).max() == 900.0
    assert read_timestep_arguments({"vision_timesteps": torch.empty(0)}, names) is None


class AtenOps(TorchDispatchMode):
    """Counts the ATen (and this package's) ops a block of code dispatches that make a tensor: every copy, cat and
    kernel shows; views (free, and spelled differently: ``[0]`` or ``squeeze(0)``) do not."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def traced_ops(fn, *args) -> Counter:
    with torch.no_grad(), AtenOps() as mode:
        fn(*args)
    return mode.ops


@pytest.mark.parametrize("variant", [{}, {"qk_norm_for_text": False, "use_und_k_norm_for_gen": True}],
                         ids=["qk-norm", "und-k-norm-for-gen"])
@pytest.mark.parametrize("backend", ["TORCH_SDPA", "TORCH_REFERENCE"], ids=["planned-sdpa", "through-the-op"])
def test_processor_adds_no_op_to_diffusers(variant, backend):
    """One processor call dispatches diffusers' own ops, none more: no copy, cat, head repeat or reshape of its own
    around the attention. Where the text keys have no norm of their own for the generation stream, it rotates them
    once where diffusers rotates them twice (one rotary's ops fewer). Through the op, diffusers' processor runs on
    the same op (its dispatcher backend), so both sides' attention is one op call per stream."""
    transformer = tiny_cosmos3_transformer(**variant)
    attn = transformer.layers[0].self_attn
    und, gen, rotary = stream_inputs(attn)
    default = Cosmos3AttnProcessor()
    if backend != "TORCH_SDPA":
        default._attention_backend = BACKEND
        set_dispatch_config({"default": {"backend": backend}})
    try:
        expected = traced_ops(default, attn, und, gen, rotary)
    finally:
        set_dispatch_config(None)
    with enable_trtllm_attention(transformer, {"default": {"backend": backend}}, collect_stats=False):
        ours = traced_ops(attn.processor, attn, und, gen, rotary)
    if attn.k_norm_und_for_gen is None:
        cos, sin = (x.unsqueeze(1) for x in rotary[:2])
        k_und = torch.randn(und.shape[0], attn.num_key_value_heads, attn.head_dim)
        expected -= traced_ops(lambda: k_und * cos + _rotate_half(k_und) * sin)
    assert ours == expected
    # what is left: projections, norms, rotaries (a cat each: q and k of both streams, the generation stream's own
    # text keys where they have a norm), the K/V cat, attention; no copy, clone or head repeat
    rotated = 4 + (attn.k_norm_und_for_gen is not None)
    assert ours["aten.cat"] == rotated + 2
    assert not [op for op in ours if any(word in op for word in ("copy", "clone", "repeat"))]
    assert backend == "TORCH_SDPA" or ours["diffusers_trtllm.attention"] == 2


def test_layer_benchmark_runs_every_row_planned(tmp_path):
    """benchmarks/models_attention.py, tiny: diffusers' default, then the planned rows (TORCH_SDPA bit-identical to
    the default; the causal stream dense whatever the config), then gen_full alone on published-curve data, every
    row also against float32."""
    rows = load_script("benchmarks/models_attention.py").main(
        ["--tiny", "--models", "cosmos-nano", "--warmup", "0", "--repeats", "1", "--output", str(tmp_path / "m.json")])
    assert not [r.error for r in rows if r.error]
    layer = {r.config: r for r in rows if "gen_full" not in r.shape}
    attention = {r.config: r for r in rows if "gen_full" in r.shape}
    assert list(layer) == ["diffusers default", "TORCH_SDPA", "TORCH_REFERENCE dense", "TORCH_REFERENCE SAGE fp8",
                           "TORCH_REFERENCE SAGE fp8 + skip λ=0.5"]
    assert layer["TORCH_SDPA"].rel_err == 0.0
    assert layer["TORCH_REFERENCE SAGE fp8 + skip λ=0.5"].ran == (
        "und_causal: TORCH_REFERENCE:dense, gen_full: TORCH_REFERENCE:sage-fp8_e4m3+skip")
    assert list(attention) == ["diffusers default", "SDPA, K/V heads repeated (cuDNN)", *list(layer)[2:]]
    assert attention["SDPA, K/V heads repeated (cuDNN)"].rel_err <= 1e-2
    assert all(r.rel_err_fp32 is not None and r.ms > 0 for r in attention.values())
    assert attention["TORCH_REFERENCE SAGE fp8 + skip λ=0.5"].ran == "gen_full: TORCH_REFERENCE:sage-fp8_e4m3+skip"


def test_transformer_step_runs_cosmos3_compiled_and_eager(tmp_path):
    """benchmarks/transformer_step.py, tiny Cosmos 3: the eager default row is not compiled beside compiled rows,
    and each row says what its plan ran per role."""
    result = load_script("benchmarks/transformer_step.py").main(
        ["--tiny", "--models", "cosmos", "--compile", "blocks", "--configs", "diffusers_eager", "sage_skip",
         "--sage-dtypes", "fp8_e4m3", "--lambdas", "0.5", "--layers", "1", "--output", str(tmp_path / "s.json")])
    (res,) = result["results"]
    rows = {row["label"]: row for row in res["rows"]}
    assert res["layers"] == "1 of 2 blocks" and res["video_tokens"] == 48
    eager, sage = rows["diffusers default processors, eager"], rows["TORCH_REFERENCE SAGE fp8_e4m3 + skip λ=0.5"]
    assert eager["compile_s"] is None and eager["ran"] == "diffusers" and eager["ms"] > 0
    assert sage["compile_s"] > 0 and sage["ran"] == ("und_causal: TORCH_REFERENCE:dense in 1 layer, "
                                                     "gen_full: TORCH_REFERENCE:sage-fp8_e4m3+skip in 1 layer")

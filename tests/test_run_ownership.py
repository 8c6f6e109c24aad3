"""A run belongs to the call that makes it, and install changes only what diffusers' extension points provide for.

Through the public API on the tiny Wan 2.2 pipeline (CPU, ``TORCH_REFERENCE``), as users meet it:

- diffusers' serving pattern (``examples/server-async``'s ``RequestScopedPipeline``: per request ``copy.copy(pipe)``
  with a deep-copied scheduler, requests in threads) and a ``from_pipe`` twin sharing the transformer, each run at
  the same time as another, bit-identical to the same request run alone, statistics too;
- the pipeline keeps its class; pickle and deepcopy work while installed and the copy generates the same output;
- two handles restored in either order leave every object exactly as before; a third-party patch of the
  pipeline class stays theirs; nothing of the package keeps a transformer or pipeline alive after restore.
"""

import copy
import gc
import pickle
import weakref

import pytest
import torch
from diffusers import WanPipeline

from diffusers_trtllm import AttentionConfig, enable_trtllm_attention
from diffusers_trtllm.tiny_pipelines import tiny_wan22_pipeline, tiny_wan_transformer

from helpers import run_together

# The case: SAGE int8 switched on by the step schedule, Skip-Softmax behind its timestep gate.
GATED = {"default": {"backend": "TORCH_REFERENCE",
                     "skip_softmax": {"threshold": 0.3, "disabled_until_timestep": 0.8},
                     "quant": {"dtype_qk": "int8", "disabled_until_timestep": 0.8}}}
TRIALS = 3


def tiny_pipe(seed=0, two_experts=True):
    pipe = tiny_wan22_pipeline(seed, two_experts=two_experts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def request(pipe, steps, prompt="a fox in snow"):
    return pipe(prompt, negative_prompt="blur", height=96, width=160, num_frames=5, num_inference_steps=steps,
                generator=torch.Generator().manual_seed(steps), output_type="latent").frames


def scoped(pipe):
    """diffusers' ``RequestScopedPipeline``: a shallow copy of the pipeline with a scheduler of its own."""
    local = copy.copy(pipe)
    local.scheduler = copy.deepcopy(pipe.scheduler)
    return local


def test_requests_on_shallow_copies_in_threads_each_run_their_own_plan():
    """Two requests of 8 and 3 steps at the same time on request-scoped copies: each bit-identical to the same
    request run alone, and each thread's statistics are its own request's."""
    pipe = tiny_pipe()
    with enable_trtllm_attention(pipe, GATED) as handle:
        alone = {steps: (request(scoped(pipe), steps), handle.stats.summary()) for steps in (8, 3)}
        assert alone[8][1] != alone[3][1]
        for _ in range(TRIALS):
            together = run_together({steps: lambda steps=steps: (request(scoped(pipe), steps),
                                                                 handle.stats.summary()) for steps in (8, 3)})
            for steps, (out, summary) in together.items():
                assert torch.equal(out, alone[steps][0]), steps
                assert summary == alone[steps][1], steps


def test_a_from_pipe_twin_sharing_the_transformer_runs_its_own_plan():
    """``from_pipe`` shares the installed transformers; the twin and the original, at the same time, each give
    what they give alone."""
    pipe = tiny_pipe()
    with enable_trtllm_attention(pipe, GATED):
        twin = WanPipeline.from_pipe(pipe, scheduler=copy.deepcopy(pipe.scheduler))
        twin.set_progress_bar_config(disable=True)
        assert twin.transformer is pipe.transformer
        alone = {"pipe": request(pipe, 8), "twin": request(twin, 3)}
        for _ in range(TRIALS):
            together = run_together({"pipe": lambda: request(pipe, 8), "twin": lambda: request(twin, 3)})
            for name, out in together.items():
                assert torch.equal(out, alone[name]), name


def test_installed_pipeline_keeps_its_class_and_pickles_and_deep_copies():
    pipe = tiny_pipe()
    handle = enable_trtllm_attention(pipe, GATED)
    try:
        assert type(pipe) is WanPipeline
        expected = request(pipe, 4)
        for copied in (pickle.loads(pickle.dumps(pipe)), copy.deepcopy(pipe)):
            assert type(copied) is WanPipeline
            copied.set_progress_bar_config(disable=True)
            assert torch.equal(request(copied, 4), expected)
        # the copy runs its own plan, not the original's runs
        transformer = copy.deepcopy(pipe.transformer)
        own = {call.owner.value for p in transformer.attn_processors.values() for call in p.calls.values()}
        assert own.isdisjoint({handle.planner.run_key.value})
        assert torch.equal(request(pipe, 4), expected)  # the original is unchanged by being copied
    finally:
        handle.restore()


def test_attention_config_pickles_and_round_trips():
    config = AttentionConfig.coerce({**GATED, "per_role": {"cross": {"backend": "TORCH_SDPA"}}})
    for copied in (pickle.loads(pickle.dumps(config)), copy.deepcopy(config)):
        assert copied == config and copied.to_json() == config.to_json()


def snapshot(obj) -> dict:
    """What install may not change: the type, the attribute names, and for a module its hooks and processors'
    types."""
    state = {"type": type(obj), "attributes": sorted(vars(obj))}
    if isinstance(obj, torch.nn.Module):
        state["pre_hooks"] = list(obj._forward_pre_hooks.values())
        state["forward"] = vars(obj).get("forward")
        state["processors"] = {k: type(p) for k, p in obj.attn_processors.items()}
        registry = vars(obj).get("_diffusers_hook")
        state["hooks"] = list(registry.hooks) if registry is not None else None
    return state


@pytest.mark.parametrize("order", ["first-installed-first", "last-installed-first"])
def test_two_handles_restored_in_either_order_leave_every_object_as_before(order):
    """A handle on the pipeline, the transformer swapped, a second handle: restored in either order, the
    pipeline and both transformers are exactly as before install."""
    pipe = tiny_pipe(two_experts=False)
    first_transformer, second_transformer = pipe.transformer, tiny_wan_transformer(seed=1)
    before = {name: snapshot(obj) for name, obj in
              (("pipe", pipe), ("first", first_transformer), ("second", second_transformer))}
    h1 = enable_trtllm_attention(pipe, GATED)
    pipe.transformer = second_transformer
    h2 = enable_trtllm_attention(pipe, GATED)
    assert type(type(pipe).from_pipe(pipe)) is WanPipeline
    for handle in ((h1, h2) if order == "first-installed-first" else (h2, h1)):
        handle.restore()
    pipe.transformer = first_transformer
    after = {name: snapshot(obj) for name, obj in
             (("pipe", pipe), ("first", first_transformer), ("second", second_transformer))}
    assert after == before


def test_a_third_party_patch_of_the_pipeline_class_stays_theirs():
    """A library that patches ``type(pipe).__call__`` after install (ParaAttention's cache does) keeps its patch
    after restore; it is on the class the library patched, never on a class of this package's."""
    pipe = tiny_pipe()
    original_call = WanPipeline.__call__
    calls = []

    def patched(self, *args, **kwargs):
        calls.append(1)
        return original_call(self, *args, **kwargs)

    handle = enable_trtllm_attention(pipe, GATED)
    type(pipe).__call__ = patched
    try:
        assert type(pipe) is WanPipeline
        request(pipe, 2)
        handle.restore()
        assert WanPipeline.__call__ is patched
        request(pipe, 2)
        assert len(calls) == 2
        other = tiny_pipe(seed=1)  # installed later: no class of this package's could carry anyone's patch
        with enable_trtllm_attention(other, GATED):
            assert type(other) is WanPipeline
    finally:
        WanPipeline.__call__ = original_call


def test_nothing_keeps_the_pipeline_or_transformer_alive_after_restore():
    pipe = tiny_pipe()
    handle = enable_trtllm_attention(pipe, GATED)
    request(pipe, 3)
    handle.stats.summary()
    refs = [weakref.ref(pipe), weakref.ref(pipe.transformer), weakref.ref(pipe.transformer_2)]
    handle.restore()
    del pipe
    gc.collect()
    assert [ref() for ref in refs] == [None] * 3
    assert sorted(handle.stats.per_step()) == [0, 1, 2]  # the last run's statistics outlive the objects


def test_a_run_started_inside_inference_mode_is_read_outside_it():
    """vLLM-Omni calls pipelines under ``torch.inference_mode()``; the run's counters are ordinary tensors, so the
    statistics are read (and their counters zeroed) outside it."""
    pipe = tiny_pipe()
    with enable_trtllm_attention(pipe, GATED) as handle:
        with torch.inference_mode():
            request(pipe, 3)
            pipe.transformer(**pipe_inputs(pipe))  # a direct call: a run opened inside the transformer call
        assert sorted(handle.stats.per_step()) == [0]
        with torch.inference_mode():
            request(pipe, 3)
        assert sorted(handle.stats.per_step()) == [0, 1, 2]


def pipe_inputs(pipe):
    config = pipe.transformer.config
    return dict(hidden_states=torch.randn(1, config.in_channels, 1, 8, 8), timestep=torch.tensor([500]),
                encoder_hidden_states=torch.randn(1, 8, config.text_dim), return_dict=False)


def test_hunyuan_video15_calls_in_two_threads_keep_their_own_text_lengths():
    """HunyuanVideo 1.5's valid text lengths are read once per transformer call; two calls with different padding
    at the same time each attend among their own valid tokens."""
    from diffusers_trtllm.tiny_pipelines import tiny_hunyuan_video15_transformer

    from test_hunyuan_video15 import transformer_inputs

    model = tiny_hunyuan_video15_transformer()
    inputs = {"short": transformer_inputs(text_lengths=(3, 9), glyph_lengths=(0, 5), frames=1, height=4, width=4),
              "long": transformer_inputs(text_lengths=(24, 20), glyph_lengths=(7, 0), frames=1, height=4, width=4)}

    def call(name):
        with torch.no_grad():
            return model(**inputs[name])[0]

    with enable_trtllm_attention(model, {"default": {"backend": "TORCH_REFERENCE"}}):
        alone = {name: call(name) for name in inputs}
        for _ in range(TRIALS):
            together = run_together({name: lambda name=name: call(name) for name in inputs})
            for name, out in together.items():
                assert torch.equal(out, alone[name]), name


def test_runs_do_not_pile_up_over_many_requests():
    """Memory stays flat: a finished thread's runs go with it; the handle keeps the last run that ended anywhere,
    this thread its own last run."""
    from diffusers_trtllm.run_state import Run

    pipe = tiny_pipe()
    with enable_trtllm_attention(pipe, GATED) as handle:
        for _ in range(3):
            run_together({name: lambda: request(scoped(pipe), 2) for name in ("a", "b")})
        request(pipe, 2)
        gc.collect()
        key = handle.planner.run_key.value
        assert len([obj for obj in gc.get_objects() if isinstance(obj, Run) and obj.key == key]) <= 2

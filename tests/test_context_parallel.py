"""Context parallelism through diffusers' own machinery: two and four processes on the CPU (gloo), the tiny Wan,
HunyuanVideo 1.5 and Cosmos 3 transformers split over their sequence with diffusers_trtllm.context_parallel_plan.
Ulysses, ring (partial results over key chunks merged by their log-sum-exp) and ring × Ulysses each give one
process's output; HunyuanVideo 1.5 with prompts of different valid text lengths (its text whole on every rank,
padded text never attended, valid text once) and Cosmos 3 with its generation stream padded to the ranks
(grouped-query heads, the causal text stream whole on every rank). A backend without the log-sum-exp is refused
under ring, naming one that has it.

Tolerance: Ulysses runs the same attention on all tokens of a head (after the all-to-all), so only the float32
summation order of the projections differs between the split and unsplit runs: 1e-5 relative. Ring merges two
exact partial softmaxes, equal to one up to float32 rounding (1e-5); a merge without the log-sum-exp, a key chunk
taken for another rank's, or padding attended is off by far more (1e-2 and up on these models). Under ring, SAGE
quantizes each key chunk with its own K mean and scales (and with key masks, the kept keys in their shards' order):
its output differs from one process's by about SAGE's own error (2e-2).
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from diffusers import ContextParallelConfig

from diffusers_trtllm import AttentionConfigError, context_parallel_plan, enable_trtllm_attention
from diffusers_trtllm.tiny_pipelines import tiny_cosmos3_transformer, tiny_hunyuan_video15_transformer

from helpers import cosmos3_transformer_call, max_rel_err, rel_err, tiny_wan, wan_inputs
from test_hunyuan_video15 import transformer_inputs as hunyuan_inputs

WORLD_SIZE = 2
TOLERANCE = 1e-5
CONFIG = {"default": {"backend": "TORCH_REFERENCE", "skip_softmax": {"threshold": 0.3}}}
SAGE = {"default": {"backend": "TORCH_REFERENCE", "quant": {"dtype_qk": "int8"}}}
DENSE = {"default": {"backend": "TORCH_REFERENCE"}}
SAGE_RING_TOLERANCE = 2e-2
SDPA = {"default": {"backend": "TORCH_SDPA"}}
# cross-attention stays out of context parallelism: any backend serves it under ring
CROSS_ON_SDPA = {**CONFIG, "per_role": {"cross": {"backend": "TORCH_SDPA"}}}


#: (name, when this package's processors are installed, ContextParallelConfig arguments, config); all run in one
#: spawn (starting two Python processes that import diffusers dominates the time)
SCENARIOS = [("ulysses-before", "before", {"ulysses_degree": 2}, CONFIG),
             ("ulysses-after", "after", {"ulysses_degree": 2}, CONFIG),
             ("ring-before", "before", {"ring_degree": 2}, CONFIG),
             ("ring-after", "after", {"ring_degree": 2}, CONFIG),
             ("ring-sage", "before", {"ring_degree": 2}, SAGE),
             ("ring-sdpa", "before", {"ring_degree": 2}, SDPA),
             ("ring-sdpa-after", "after", {"ring_degree": 2}, SDPA),
             ("ring-cross-sdpa", "after", {"ring_degree": 2}, CROSS_ON_SDPA)]


def _build(model: str, inputs: dict):
    if model == "hunyuan":
        return tiny_hunyuan_video15_transformer()
    if model == "cosmos":
        return tiny_cosmos3_transformer(vocab_size=inputs["cosmos_vocab"])
    return tiny_wan()


def _output(model: str, out):
    return out[0] if model == "cosmos" else out  # Cosmos 3 returns one prediction per vision item


def _run_scenario(order: str, cp: dict, config: dict, inputs: dict, model_name: str = "wan"):
    """Install this package's processors before or after ``enable_parallelism`` and run: (output, modes that
    ran), or (error type, message)."""
    model = _build(model_name, inputs)
    plan = context_parallel_plan(model)
    try:
        if order == "before":
            handle = enable_trtllm_attention(model, config)
            model.enable_parallelism(config=ContextParallelConfig(**cp), cp_plan=plan)
        else:
            model.enable_parallelism(config=ContextParallelConfig(**cp), cp_plan=plan)
            handle = enable_trtllm_attention(model, config)
        with torch.no_grad():
            result = _output(model_name, model(**inputs[model_name])[0])
        return result, {rec.mode for rec in handle.stats.records.values()}
    except Exception as e:  # reported to the test, which checks the error
        return type(e).__name__, str(e)


#: HunyuanVideo 1.5 and Cosmos 3 under every degree with every kind of attention (the degree is the scenario's
#: name: "ring", "ulysses" or "ring-ulysses")
MODEL_CONFIGS = {"dense": DENSE, "skip": CONFIG, "sage": SAGE}
MODES = {"dense": "dense", "skip": "skip", "sage": "sage-int8"}
DEGREES = {"ring": {"ring_degree": 2}, "ulysses": {"ulysses_degree": 2},
           "ring-ulysses": {"ring_degree": 2, "ulysses_degree": 2}}


def model_scenarios(degrees):
    return [(f"{model}-{degree}-{kind}", "before" if kind != "dense" else "after", DEGREES[degree], config, model)
            for model in ("hunyuan", "cosmos") for degree in degrees for kind, config in MODEL_CONFIGS.items()]


SCENARIOS += model_scenarios(("ring", "ulysses"))


#: four processes: Ulysses × ring (diffusers' unified attention)
FOUR_RANK_SCENARIOS = [("ring-ulysses", "before", {"ring_degree": 2, "ulysses_degree": 2}, CONFIG),
                       ("ring-ulysses-sage", "after", {"ring_degree": 2, "ulysses_degree": 2}, SAGE),
                       *model_scenarios(("ring-ulysses",))]


def _rank_main(rank: int, world_size: int, scenarios, port: int, inputs_path: str, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # diffusers picks the rank's device as rank % accelerator count, which is 0 on a CPU-only machine
    torch.accelerator.device_count = lambda: 1
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        inputs = torch.load(inputs_path, weights_only=False)
        results = {name: _run_scenario(order, cp, config, inputs, *model)
                   for name, order, cp, config, *model in scenarios}
        if rank == 0:
            torch.save(results, out_path)
    finally:
        dist.destroy_process_group()


def spawn(scenarios, world_size: int, inputs, folder) -> dict:
    inputs_path, out_path = str(folder / "inputs.pt"), str(folder / "out.pt")
    torch.save(inputs, inputs_path)
    port = 29500 + (os.getpid() + world_size * 7) % 2000
    mp.spawn(_rank_main, args=(world_size, scenarios, port, inputs_path, out_path), nprocs=world_size, join=True)
    return torch.load(out_path, weights_only=False)


@pytest.fixture(scope="module")
def all_inputs():
    torch.manual_seed(0)
    wan = wan_inputs(batch=1, frames=2, height=8, width=8)  # 32 video tokens: 16 per rank
    # two prompts with 24 + 0 and 9 + 5 valid text tokens of 36 (MLLM + ByT5 + image); 128 video tokens
    hunyuan = hunyuan_inputs()
    # 44 causal text tokens, 6 generation tokens: padded to 8 on four ranks (the last shard is padding only)
    cosmos_model, cosmos = cosmos3_transformer_call(width=48)
    return {"wan": wan, "hunyuan": hunyuan, "cosmos": cosmos, "cosmos_vocab": cosmos_model.config.vocab_size}


@pytest.fixture(scope="module")
def inputs(all_inputs):
    return all_inputs["wan"]


@pytest.fixture(scope="module")
def two_rank_results(all_inputs, tmp_path_factory):
    return spawn(SCENARIOS, WORLD_SIZE, all_inputs, tmp_path_factory.mktemp("context_parallel"))


@pytest.fixture(scope="module")
def four_rank_results(all_inputs, tmp_path_factory):
    return spawn(FOUR_RANK_SCENARIOS, 4, all_inputs, tmp_path_factory.mktemp("context_parallel_4"))


@pytest.mark.parametrize("order", ["before", "after"])
def test_ulysses_matches_one_process(order, inputs, two_rank_results):
    model = tiny_wan()
    with enable_trtllm_attention(model, CONFIG), torch.no_grad():
        expected = model(**inputs)[0]
    result, modes = two_rank_results[f"ulysses-{order}"]
    assert torch.is_tensor(result), (result, modes)
    assert max_rel_err(result, expected) <= TOLERANCE
    assert modes == {"skip"}  # the processors' plan ran on each rank, not a bare dispatcher call


def one_process(config, inputs):
    model = tiny_wan()
    with enable_trtllm_attention(model, config), torch.no_grad():
        return model(**inputs)[0]


@pytest.mark.parametrize("order", ["before", "after"])
def test_ring_attention_merges_to_one_process(order, inputs, two_rank_results):
    result, modes = two_rank_results[f"ring-{order}"]
    assert torch.is_tensor(result), (result, modes)
    assert max_rel_err(result, one_process(CONFIG, inputs)) <= TOLERANCE
    assert modes == {"skip"}


def test_ring_attention_with_sage_runs_each_key_chunk_as_sage_does(inputs, two_rank_results):
    """Each chunk is quantized with its own K mean and scales, so the output differs from one process's by about
    SAGE's own error (test_reference's merge test shows the log-sum-exp's smoothing term makes chunks merge as
    well as one SAGE call)."""
    result, modes = two_rank_results["ring-sage"]
    assert torch.is_tensor(result), (result, modes)
    assert modes == {"sage-int8"}
    assert rel_err(result, one_process(SAGE, inputs)) <= SAGE_RING_TOLERANCE


def test_ring_attention_on_a_backend_without_the_log_sum_exp_is_refused_naming_one(two_rank_results):
    """At install when context parallelism is already on, else at the call."""
    name, message = two_rank_results["ring-sdpa-after"]
    assert name == "BackendUnavailableError" and message == (
        "transformer.blocks.0.attn1 (self_attn attention) runs on TORCH_SDPA, which does not return the log-sum-exp "
        "that ring attention (ring_degree=2) merges partial results by; give it TRTLLM_ATTN or TORCH_REFERENCE, or use "
        "Ulysses "
        "(ulysses_degree) alone"), (name, message)
    name, message = two_rank_results["ring-sdpa"]
    assert name == "BackendUnavailableError" and message == (
        "TORCH_SDPA does not return the log-sum-exp that ring attention merges partial results by; TORCH_REFERENCE "
        "and TRTLLM_ATTN do"), (name, message)


def test_cross_attention_stays_out_of_ring_attention_on_any_backend(inputs, two_rank_results):
    result, modes = two_rank_results["ring-cross-sdpa"]
    assert torch.is_tensor(result), (result, modes)
    assert max_rel_err(result, one_process(CROSS_ON_SDPA, inputs)) <= TOLERANCE and modes == {"skip", "dense"}


def test_ulysses_times_ring_on_four_processes_gives_one_process_output(inputs, four_rank_results):
    result, modes = four_rank_results["ring-ulysses"]
    assert torch.is_tensor(result), (result, modes)
    assert max_rel_err(result, one_process(CONFIG, inputs)) <= TOLERANCE and modes == {"skip"}
    result, modes = four_rank_results["ring-ulysses-sage"]
    assert torch.is_tensor(result), (result, modes)
    assert rel_err(result, one_process(SAGE, inputs)) <= SAGE_RING_TOLERANCE and modes == {"sage-int8"}


def one_model_process(model: str, config: dict, all_inputs) -> torch.Tensor:
    transformer = _build(model, all_inputs)
    with enable_trtllm_attention(transformer, config), torch.no_grad():
        return _output(model, transformer(**all_inputs[model])[0])


@pytest.mark.parametrize("model", ["hunyuan", "cosmos"])
@pytest.mark.parametrize("degree", ["ring", "ulysses", "ring-ulysses"])
@pytest.mark.parametrize("kind", ["dense", "skip", "sage"])
def test_models_under_every_degree_give_one_process_output(model, degree, kind, all_inputs, two_rank_results,
                                                           four_rank_results):
    """HunyuanVideo 1.5 with prompts of different valid text lengths and Cosmos 3 (grouped-query heads, padded
    generation stream, causal text stream whole on every rank); dense and Skip-Softmax as exact as one process,
    SAGE within its own error."""
    results = four_rank_results if degree == "ring-ulysses" else two_rank_results
    result, modes = results[f"{model}-{degree}-{kind}"]
    assert torch.is_tensor(result), (result, modes)
    expected = one_model_process(model, MODEL_CONFIGS[kind], all_inputs)
    if kind == "sage":
        assert rel_err(result, expected) <= SAGE_RING_TOLERANCE
    else:
        assert max_rel_err(result, expected) <= TOLERANCE
    # Cosmos 3's causal text stream always runs dense
    assert modes == {MODES[kind]} | ({"dense"} if model == "cosmos" else set())


def test_context_parallel_plan_is_diffusers_own_for_wan_and_refuses_a_model_without_processors():
    assert context_parallel_plan(tiny_wan()) is type(tiny_wan())._cp_plan
    with pytest.raises(AttentionConfigError, match=r"transformer is a Linear; diffusers_trtllm has processors for "
                                                   r"\['Cosmos3OmniTransformer', 'HunyuanVideo15Transformer3DModel', "
                                                   r"'WanTransformer3DModel'\]"):
        context_parallel_plan(torch.nn.Linear(2, 2))


def _gpu_rank_main(rank: int, world_size: int, port: int, out_path: str) -> None:
    """Each model under Ulysses 2 on TRTLLM_ATTN (auto) and ring 2 on TORCH_REFERENCE, bf16, NCCL."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        cosmos_model, cosmos = cosmos3_transformer_call(width=48)
        inputs = {"wan": wan_inputs(batch=1, frames=2, height=8, width=8), "hunyuan": hunyuan_inputs(),
                  "cosmos": cosmos, "cosmos_vocab": cosmos_model.config.vocab_size}
        inputs = {k: _to(v, f"cuda:{rank}") for k, v in inputs.items()}
        results = {}
        for model in ("wan", "hunyuan", "cosmos"):
            for degree, config in (("ulysses", {"default": {"backend": "auto"}}), ("ring", DENSE)):
                one = _build(model, inputs).to(f"cuda:{rank}", torch.bfloat16)
                split = _build(model, inputs).to(f"cuda:{rank}", torch.bfloat16)
                with enable_trtllm_attention(one, config), torch.no_grad():
                    expected = _output(model, one(**inputs[model])[0])
                enable_trtllm_attention(split, config)
                split.enable_parallelism(config=ContextParallelConfig(**DEGREES[degree]),
                                         cp_plan=context_parallel_plan(split))
                with torch.no_grad():
                    result = _output(model, split(**inputs[model])[0])
                results[f"{model}-{degree}"] = rel_err(result.float(), expected.float())
        if rank == 0:
            torch.save(results, out_path)
    finally:
        dist.destroy_process_group()


def _to(value, device):
    """Tensors (also in lists) to the device in bf16 where floating; other values as they are."""
    if torch.is_tensor(value):
        return value.to(device, torch.bfloat16 if value.is_floating_point() else None)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    return value


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_every_model_on_two_gpus_gives_one_gpu_output(tmp_path):
    """bf16 on two GPUs (NCCL): the split run differs from one GPU's by bf16 rounding only (1e-2)."""
    out_path = str(tmp_path / "gpu.pt")
    port = 29500 + (os.getpid() + 11) % 2000
    mp.spawn(_gpu_rank_main, args=(2, port, out_path), nprocs=2, join=True)
    errors = torch.load(out_path)
    assert errors and all(error <= 1e-2 for error in errors.values()), errors

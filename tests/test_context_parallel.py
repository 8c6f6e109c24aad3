"""Context parallelism through diffusers' own machinery: two processes on the CPU (gloo), a tiny Wan transformer
split over its sequence. Ulysses and ring attention (partial results over key chunks merged by their log-sum-exp)
each give one process's output; a backend without the log-sum-exp is refused under ring, naming one that has it.

Tolerance: Ulysses runs the same attention on all tokens of a head (after the all-to-all), so only the float32
summation order of the projections differs between the split and unsplit runs: 1e-5 relative. Ring merges two
exact partial softmaxes, equal to one up to float32 rounding (1e-5). Under ring, SAGE quantizes each key chunk
with its own K mean and scales: its output differs from one process's by about SAGE's own error (2e-2).
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from diffusers import ContextParallelConfig

from diffusers_trtllm import enable_trtllm_attention

from helpers import max_rel_err, rel_err, tiny_wan, wan_inputs

WORLD_SIZE = 2
TOLERANCE = 1e-5
CONFIG = {"default": {"backend": "TORCH_REFERENCE", "skip_softmax": {"threshold": 0.3}}}
SAGE = {"default": {"backend": "TORCH_REFERENCE", "quant": {"dtype_qk": "int8"}}}
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


def _run_scenario(order: str, cp: dict, config: dict, inputs: dict):
    """Install this package's processors before or after ``enable_parallelism`` and run: (output, modes that
    ran), or (error type, message)."""
    model = tiny_wan()
    try:
        if order == "before":
            handle = enable_trtllm_attention(model, config)
            model.enable_parallelism(config=ContextParallelConfig(**cp))
        else:
            model.enable_parallelism(config=ContextParallelConfig(**cp))
            handle = enable_trtllm_attention(model, config)
        with torch.no_grad():
            result = model(**inputs)[0]
        return result, {rec.mode for rec in handle.stats.records.values()}
    except Exception as e:  # reported to the test, which checks the error
        return type(e).__name__, str(e)


#: four processes: Ulysses × ring (diffusers' unified attention)
FOUR_RANK_SCENARIOS = [("ring-ulysses", "before", {"ring_degree": 2, "ulysses_degree": 2}, CONFIG),
                       ("ring-ulysses-sage", "after", {"ring_degree": 2, "ulysses_degree": 2}, SAGE)]


def _rank_main(rank: int, world_size: int, scenarios, port: int, inputs_path: str, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # diffusers picks the rank's device as rank % accelerator count, which is 0 on a CPU-only machine
    torch.accelerator.device_count = lambda: 1
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        inputs = torch.load(inputs_path)
        results = {name: _run_scenario(order, cp, config, inputs) for name, order, cp, config in scenarios}
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
def inputs():
    torch.manual_seed(0)
    return wan_inputs(batch=1, frames=2, height=8, width=8)  # 32 video tokens: 16 per rank


@pytest.fixture(scope="module")
def two_rank_results(inputs, tmp_path_factory):
    return spawn(SCENARIOS, WORLD_SIZE, inputs, tmp_path_factory.mktemp("context_parallel"))


@pytest.fixture(scope="module")
def four_rank_results(inputs, tmp_path_factory):
    return spawn(FOUR_RANK_SCENARIOS, 4, inputs, tmp_path_factory.mktemp("context_parallel_4"))


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
        "that ring attention (ring_degree=2) merges partial results by; give it TORCH_REFERENCE, or use Ulysses "
        "(ulysses_degree) alone"), (name, message)
    name, message = two_rank_results["ring-sdpa"]
    assert name == "BackendUnavailableError" and message == (
        "TORCH_SDPA does not return the log-sum-exp that ring attention merges partial results by; TORCH_REFERENCE, "
        "TRTLLM_ATTN does"), (name, message)


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

"""Ulysses context parallelism through the ``"trtllm"`` backend: two processes on the CPU (gloo), a tiny Wan
transformer split over its sequence, output equal to one process's; ring attention refused.

Tolerance: each rank runs the same attention on all tokens of its head (after the all-to-all), so only the
float32 summation order of the projections differs between the split and unsplit runs: 1e-5 relative.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from diffusers import ContextParallelConfig

from diffusers_trtllm import enable_trtllm_attention

from helpers import max_rel_err, tiny_wan, wan_inputs

WORLD_SIZE = 2
TOLERANCE = 1e-5
CONFIG = {"default": {"backend": "TORCH_REFERENCE", "skip_softmax": {"threshold": 0.3}}}


#: (name, when this package's processors are installed, ContextParallelConfig arguments); all run in one spawn
#: (starting two Python processes that import diffusers dominates the time)
SCENARIOS = [("ulysses-before", "before", {"ulysses_degree": 2}),
             ("ulysses-after", "after", {"ulysses_degree": 2}),
             ("ring", "before", {"ring_degree": 2})]


def _run_scenario(order: str, cp: dict, inputs: dict):
    """Install this package's processors before or after ``enable_parallelism`` and run: (output, modes that
    ran), or (error type, message)."""
    model = tiny_wan()
    try:
        if order == "before":
            handle = enable_trtllm_attention(model, CONFIG)
            model.enable_parallelism(config=ContextParallelConfig(**cp))
        else:
            model.enable_parallelism(config=ContextParallelConfig(**cp))
            handle = enable_trtllm_attention(model, CONFIG)
        with torch.no_grad():
            result = model(**inputs)[0]
        return result, {rec.mode for rec in handle.stats.records.values()}
    except Exception as e:  # reported to the test, which checks the error
        return type(e).__name__, str(e)


def _rank_main(rank: int, port: int, inputs_path: str, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # diffusers picks the rank's device as rank % accelerator count, which is 0 on a CPU-only machine
    torch.accelerator.device_count = lambda: 1
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        inputs = torch.load(inputs_path)
        results = {name: _run_scenario(order, cp, inputs) for name, order, cp in SCENARIOS}
        if rank == 0:
            torch.save(results, out_path)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def inputs():
    torch.manual_seed(0)
    return wan_inputs(batch=1, frames=2, height=8, width=8)  # 32 video tokens: 16 per rank


@pytest.fixture(scope="module")
def two_rank_results(inputs, tmp_path_factory):
    folder = tmp_path_factory.mktemp("context_parallel")
    inputs_path, out_path = str(folder / "inputs.pt"), str(folder / "out.pt")
    torch.save(inputs, inputs_path)
    port = 29500 + os.getpid() % 2000
    mp.spawn(_rank_main, args=(port, inputs_path, out_path), nprocs=WORLD_SIZE, join=True)
    return torch.load(out_path, weights_only=False)


@pytest.mark.parametrize("order", ["before", "after"])
def test_ulysses_matches_one_process(order, inputs, two_rank_results):
    model = tiny_wan()
    with enable_trtllm_attention(model, CONFIG), torch.no_grad():
        expected = model(**inputs)[0]
    result, modes = two_rank_results[f"ulysses-{order}"]
    assert torch.is_tensor(result), (result, modes)
    assert max_rel_err(result, expected) <= TOLERANCE
    assert modes == {"skip"}  # the processors' plan ran on each rank, not a bare dispatcher call


def test_ring_attention_raises(two_rank_results):
    name, message = two_rank_results["ring"]
    assert name == "NotImplementedError" and "Ulysses context parallelism only" in message, (name, message)

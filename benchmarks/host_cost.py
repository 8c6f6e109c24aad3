"""Host cost of one attention call: this package's per-call path against diffusers' own, on the CPU.

At shapes this small the arithmetic takes a few microseconds, so what is timed is the Python and dispatcher work
around it — what a GPU run pays on the host for every attention call while its kernels queue up. Rows:

- whole attention module call (a Wan ``attn1``: projections, norms, RoPE, attention, output projection) with
  diffusers' ``WanAttnProcessor`` + its dispatcher (``native`` backend), and with this package's processor: alone
  (every call through the opaque op, as ``TRTLLM_ATTN`` calls go), and installed on ``TORCH_SDPA`` (the planned
  call runs SDPA directly; statistics off and on);
- the attention function alone: ``dispatch_attention_fn`` (``native``), this package's ``run_attention`` on a
  planned ``TORCH_SDPA`` call (statistics off / on), and the opaque op every other backend runs through
  (``torch.ops.diffusers_trtllm.attention`` with ``TORCH_SDPA`` inside; statistics on: counting in an open run),
  which is what a ``TRTLLM_ATTN`` call pays beyond its kernel.

Each row is the median over ``--repeats`` rounds of ``--calls`` calls, rounds of all rows interleaved.

    python benchmarks/host_cost.py [--calls 2000] [--repeats 9] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn  # noqa: E402
from diffusers.models.transformers.transformer_wan import WanAttnProcessor  # noqa: E402

from diffusers_trtllm import WanTrtllmAttnProcessor, enable_trtllm_attention  # noqa: E402
from diffusers_trtllm.dispatch import run_attention  # noqa: E402
from diffusers_trtllm.config import AttentionConfig  # noqa: E402
from diffusers_trtllm.plan import AttentionCall, CallPlanner, CallSite, HeadLayout  # noqa: E402
from diffusers_trtllm.run_state import set_run_here  # noqa: E402
from diffusers_trtllm.steps import TRANSFORMER  # noqa: E402
from diffusers_trtllm.tiny_pipelines import tiny_wan_transformer  # noqa: E402

TOKENS, HEADS, HEAD_DIM = 16, 2, 16


def module_cases():
    """Wan attn1 of the tiny transformer: diffusers' processor, then this package's (statistics off, on)."""
    model = tiny_wan_transformer()
    attn = model.blocks[0].attn1
    hidden = torch.randn(1, TOKENS, attn.inner_dim)
    rotary = model.rope(torch.randn(1, 16, 1, 8, 8))  # 16 tokens after the 2 × 2 patch
    call = lambda: attn(hidden, None, None, rotary)  # noqa: E731

    def installed(collect_stats: bool):
        def setup():
            handle = enable_trtllm_attention(model, {"default": {"backend": "TORCH_SDPA"}},
                                             collect_stats=collect_stats)
            handle.tracker.begin(TRANSFORMER)  # the module's calls count in a run, as inside a transformer call
            return handle
        return setup

    def unbound():
        # the processor alone (unplanned calls): every call goes through the opaque op, as TRTLLM_ATTN's do
        attn.set_processor(WanTrtllmAttnProcessor({"default": {"backend": "TORCH_SDPA"}}))
        return _Undo(lambda: attn.set_processor(WanAttnProcessor()))

    attn.set_processor(WanAttnProcessor())
    return [("module: diffusers WanAttnProcessor (native)", None, call),
            ("module: WanTrtllmAttnProcessor alone, through the op (TORCH_SDPA inside)", unbound, call),
            ("module: WanTrtllmAttnProcessor TORCH_SDPA, statistics off", installed(False), call),
            ("module: WanTrtllmAttnProcessor TORCH_SDPA, statistics on", installed(True), call)]


class _Undo:
    def __init__(self, undo):
        self.restore = undo


def function_cases():
    q, k, v = (torch.randn(1, TOKENS, HEADS, HEAD_DIM) for _ in range(3))
    site = CallSite("transformer", "blocks.0.attn1", "self_attn", "self")
    planner = CallPlanner(AttentionConfig({"backend": "TORCH_SDPA"}), collect_stats=True)
    planner.add_site(site, WanTrtllmAttnProcessor.ROLES["self_attn"], HeadLayout(HEADS, HEADS, HEAD_DIM))
    planner.choose_backends(torch.device("cpu"), torch.float32)
    counted = planner.calls[site]
    set_run_here(planner.run_key.value, planner.new_run())  # statistics on: calls count in an open run
    planned = {False: AttentionCall(site, "TORCH_SDPA", False, None, None), True: counted}
    op_args = (q, k, v, None, planned[False].settings, "TORCH_SDPA", HEAD_DIM ** -0.5, False, "", False, 128, 128,
               True)
    counted_args = (*op_args[:4], counted.settings, *op_args[5:])
    return [
        ("function: dispatch_attention_fn (native)",
         None, lambda: dispatch_attention_fn(q, k, v, backend=AttentionBackendName.NATIVE)),
        ("function: run_attention, planned TORCH_SDPA, statistics off", None, lambda: run_attention(planned[False], q, k, v)),
        ("function: run_attention, planned TORCH_SDPA, statistics on", None, lambda: run_attention(planned[True], q, k, v)),
        ("function: the opaque op (TORCH_SDPA inside), statistics off",
         None, lambda: torch.ops.diffusers_trtllm.attention(*op_args)),
        ("function: the opaque op (TORCH_SDPA inside), statistics on",
         None, lambda: torch.ops.diffusers_trtllm.attention(*counted_args)),
    ]


def time_calls(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def measure(calls: int, repeats: int) -> list[dict]:
    cases = module_cases() + function_cases()
    samples: dict[str, list[float]] = {name: [] for name, *_ in cases}
    with torch.no_grad():
        for _ in tqdm(range(repeats), desc="rounds", unit="round"):
            for name, setup, fn in cases:
                handle = setup() if setup else None
                try:
                    fn()  # warm-up: first-call choices, caches
                    samples[name].append(time_calls(fn, calls))
                finally:
                    if handle is not None:
                        handle.restore()
    baselines = {kind: next(name for name, *_ in cases if name.startswith(kind)) for kind in ("module", "function")}
    rows = []
    for name, *_ in cases:
        us = statistics.median(samples[name])
        base = statistics.median(samples[baselines[name.split(":")[0]]])
        rows.append({"case": name, "us_per_call": us, "vs_diffusers": us / base})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| case | µs per call | × diffusers' path |", "|---|---:|---:|"]
    lines += [f"| {r['case']} | {r['us_per_call']:.1f} | {r['vs_diffusers']:.2f}× |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per round (default 2000)")
    parser.add_argument("--repeats", type=int, default=9, help="interleaved rounds (default 9)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    for flag in ("calls", "repeats", "threads"):
        if getattr(args, flag) < 1:
            parser.exit(2, f"host_cost.py: --{flag} must be at least 1 (got {getattr(args, flag)})\n")
    torch.set_num_threads(args.threads)
    rows = measure(args.calls, args.repeats)
    print(f"torch {torch.__version__}, {args.threads} thread(s), q/k/v [1, {TOKENS}, {HEADS}, {HEAD_DIM}]")
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()

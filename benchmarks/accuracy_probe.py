"""The accuracy probe on the Wan 2.2 A14B transformer (random bf16 weights, 720p, 81 frames): its cost, and the
per-layer error table it reports for SAGE fp8, SAGE int8 and SAGE fp8 + Skip-Softmax.

Model: ``transformer_step.py``'s full-size builder, with its first ``--layers`` blocks (all 40 by default; fewer
keep the run short: the probe's cost and each layer's error are per layer, so the ratio to the step holds).

1. Cost, every block compiled with ``fullgraph=True`` (``--compile blocks``): one SAGE fp8 call per row, after an
   untimed call that compiles, timed with CUDA events over ``--repeats`` calls: probe off; probe on at a step it
   does not probe (``probe_every`` 2, an odd step: what every other step costs); probe on at a probed step. The
   probe on a probed step computes ``--probe-rows`` query rows of exact attention per call in float64. The two
   probe-on rows share one compiled graph (the step switches through a tensor): the graph count is reported.
2. Errors: the same transformer made QK-normed-like (each self-attention's K projection set to its Q projection, so
   a token's query meets its own key and, through RoPE, its neighbours' most; the Q/K RMS-norm weights set to
   per-channel gains ``exp(N(0, 0.3²))`` as learned weights are: the attention of Wan, HunyuanVideo 1.5 and
   Cosmos 3, after QK-norm), one eager call per configuration with the probe on; the table is
   ``handle.stats.error_table()`` (cross-attention runs on TORCH_SDPA, as the models' configurations keep it).

    PYTHONPATH=. python benchmarks/accuracy_probe.py --layers 8        # on the GPU; JSON to $OUT (or --output)
    PYTHONPATH=. python benchmarks/accuracy_probe.py --tiny            # CPU, tiny model, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch._dynamo.utils as dynamo_utils

from diffusers_trtllm import enable_trtllm_attention
from diffusers_trtllm.config import TORCH_REFERENCE, TRTLLM_ATTN, AccuracySpec, AttnQuantSpec
from diffusers_trtllm.run_state import open_run

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transformer_step import build_transformer, compiled_blocks, first_block_only  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # the examples' shared helpers
from evaluation import TransformerTimer, attention_config, find_model, format_number, markdown_table  # noqa: E402

DEFAULT_LAMBDA = 0.5
NORM_GAIN_SPREAD = 0.3  # log-normal spread of the QK-norm weights


def error_configs(backend: str, sdpa_roles, lam: float) -> dict:
    fp8, int8 = AttnQuantSpec(dtype_qk="fp8_e4m3"), AttnQuantSpec(dtype_qk="int8")
    return {"SAGE fp8_e4m3": attention_config(backend, sdpa_roles=sdpa_roles, quant=fp8),
            "SAGE int8": attention_config(backend, sdpa_roles=sdpa_roles, quant=int8),
            f"SAGE fp8_e4m3 + skip λ={lam:g}": attention_config(backend, sdpa_roles=sdpa_roles, quant=fp8,
                                                                skip={"threshold": lam})}


def keep_layers(model, blocks_attr: str, layers: int | None) -> None:
    if layers is not None:
        setattr(model, blocks_attr, getattr(model, blocks_attr)[:layers])


def qk_normed_like(model, blocks_attr: str, seed: int = 0) -> None:
    """Self-attention as trained video models have it after QK-norm (module docstring, part 2)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in getattr(model, blocks_attr):
            attn = block.attn1
            attn.to_k.weight.copy_(attn.to_q.weight)
            attn.to_k.bias.copy_(attn.to_q.bias)
            gains = torch.exp(NORM_GAIN_SPREAD * torch.randn(attn.norm_q.weight.shape, generator=gen))
            attn.norm_q.weight.copy_(gains)
            attn.norm_k.weight.copy_(gains)


def timed_calls(model, inputs, repeats: int) -> list[float]:
    with TransformerTimer({"transformer": model}) as timer:
        for _ in range(repeats):
            model(**inputs)
    return [s * 1e3 for s in timer.seconds()]


def cost_rows(model, run, inputs, config, args) -> dict:
    """Median call time (ms) with the probe off, on at a step it skips, on at a probed step; graphs compiled."""
    probe = AccuracySpec(probe_rows=args.probe_rows, probe_every=2)
    rows, graphs = {}, {}
    for label, accuracy in (("probe off", None), ("probe on", probe)):
        with enable_trtllm_attention(model, config.with_accuracy(accuracy)) as handle, torch.no_grad(), \
                compiled_blocks(model, run.blocks_attr, args.compile == "blocks"):
            dynamo_utils.counters.clear()
            with first_block_only(model, run.blocks_attr):
                model(**inputs)  # compiles the one graph every block shares
            steps = ({"probe off": 0} if accuracy is None else
                     {"probe on, step not probed": 1, "probe on, probed step": 0})
            for name, step in steps.items():
                model(**inputs)  # untimed: first-use costs of every block's shapes; opens the call's run
                attention_run = open_run(handle.planner.run_key.value)
                handle.planner.plan_step(attention_run, attention_run.timestep, step)  # the same timestep keeps it
                rows[name] = statistics.median(timed_calls(model, inputs, args.repeats))
            graphs[label] = dynamo_utils.counters["stats"]["unique_graphs"]
            if accuracy is not None:
                rows["probed error (all layers)"] = handle.stats.summary()["error"]
    return {"ms": rows, "graphs": graphs}


def error_tables(model, inputs, configs: dict, probe_rows: int) -> dict:
    """Per configuration, one eager call with the probe on: the per-layer error table and its numbers."""
    tables = {}
    for label, config in configs.items():
        with enable_trtllm_attention(model, config.with_accuracy(AccuracySpec(probe_rows=probe_rows))) as handle, \
                torch.no_grad():
            model(**inputs)
            stats = handle.stats
            tables[label] = {"markdown": stats.error_table(), "per_layer": stats.error_per_layer(),
                             "error": stats.summary()["error"], "sparsity": stats.summary()["sparsity"]}
    return tables


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny Wan on the CPU with TORCH_REFERENCE (a smoke test)")
    parser.add_argument("--layers", type=int, default=None, help="first N blocks only (default: all)")
    parser.add_argument("--probe-rows", type=int, default=16, help="probe rows per call for the cost rows")
    parser.add_argument("--error-probe-rows", type=int, default=64, help="probe rows per call for the error table")
    parser.add_argument("--lam", type=float, default=DEFAULT_LAMBDA, help="Skip-Softmax λ of the SAGE + skip row")
    parser.add_argument("--compile", choices=("none", "blocks"), default="blocks")
    parser.add_argument("--repeats", type=int, default=2, help="timed calls per cost row (median)")
    parser.add_argument("--parts", nargs="+", choices=("cost", "errors"), default=["cost", "errors"])
    parser.add_argument("--output", type=Path, default=None,
                        help="JSON file (default: $OUT/accuracy_probe.json, or ./accuracy_probe.json)")
    args = parser.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers {args.layers}: expected a positive number of blocks")
    start = time.perf_counter()
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    backend = TORCH_REFERENCE if args.tiny else TRTLLM_ATTN
    entry = find_model("wan")
    run = entry.tiny_speed if args.tiny else entry.speed
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
            "cpu", "tiny": args.tiny, "layers": args.layers, "probe_rows": args.probe_rows,
            "error_probe_rows": args.error_probe_rows, "lambda": args.lam, "compile": args.compile,
            "video_tokens": run.video_tokens}
    model = build_transformer(entry, run, device, dtype)
    keep_layers(model, run.blocks_attr, args.layers)
    meta["blocks"] = len(getattr(model, run.blocks_attr))
    inputs = run.inputs(run, device, dtype)
    configs = error_configs(backend, entry.sdpa_roles, args.lam)
    result = {"meta": meta}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # install notes (e.g. the Triton kernel's skip rule) are not results
        if "cost" in args.parts:
            result["cost"] = cost_rows(model, run, inputs, configs["SAGE fp8_e4m3"], args)
        if "errors" in args.parts:
            qk_normed_like(model, run.blocks_attr)
            result["errors"] = error_tables(model, inputs, configs, args.error_probe_rows)
    meta["total_s"] = time.perf_counter() - start
    text = report(result)
    print(text)
    output = args.output or Path(os.environ.get("OUT", ".")) / "accuracy_probe.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {output} ({meta['total_s']:.0f} s)")
    return {**result, "markdown": text, "output": output}


def report(result: dict) -> str:
    meta = result["meta"]
    lines = [f"### Accuracy probe: Wan 2.2 A14B, {meta['blocks']} blocks, {meta['video_tokens']:,} video tokens, "
             f"{meta['device']}", ""]
    if "cost" in result:
        ms = result["cost"]["ms"]
        off = ms["probe off"]
        rows = [(name, format_number(value, 1), format_number(value / off, 4, "×"))
                for name, value in ms.items() if name != "probed error (all layers)"]
        lines += [f"SAGE fp8_e4m3, blocks compiled: {meta['compile']}; probe rows per call: {meta['probe_rows']}", "",
                  markdown_table(("row", "call (ms)", "vs probe off"), rows, "lrr"), "",
                  f"graphs compiled: {result['cost']['graphs']}; probed error over all layers: "
                  f"{format_number(ms.get('probed error (all layers)'), 4)}", ""]
    for label, table in result.get("errors", {}).items():
        lines += [f"#### {label} (QK-normed-like weights; probe rows per call: {meta['error_probe_rows']}): error "
                  f"{format_number(table['error'], 4)}, sparsity {format_number(table['sparsity'], 3)}", "",
                  table["markdown"], ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

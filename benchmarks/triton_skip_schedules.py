"""The Triton SAGE kernel's Skip-Softmax schedules against its dense launch, at Wan 2.2's self-attention shape
(75,600 tokens × 40 heads × 128) on one GPU, attention only (Q, K, V quantized once per data set).

Schedules (``triton_sage.AttentionLaunch``, 64 × 128 skip tiles), every query tile skipping: ``branching`` (a
skipped tile's exps, V load and P·V not run; Triton does not pipeline the loads inside the branch),
``branch-free`` (every tile's work issued, a skipped tile's P zeroed; loads pipelined), ``alternating t`` (runs of
tiles on either: branch-free after a run that skipped fewer than a fraction t of its tiles); and ``skip_launch``,
what the kernel runs by default: alternating by ``triton_sage.BRANCH_FREE_BELOW``, skipping only in the heads
whose sampled query tiles (``triton_sage.skip_sample_rule``) skipped at least ``triton_sage.SKIP_PAYS_FROM`` of
their tiles (the others dense). Data:
random N(0, 1) (nothing to skip) and ``published_curve`` data at the published Wan 2.2 curve's s
(benchmarks/data.py). Every every-tile schedule's output and skip count are checked bit-identical to
``branching``'s; ``skip_launch``'s achieved sparsity and its difference to ``branching`` and to dense are reported,
and its ratio to dense once more from back-to-back timings in alternating order.
The last lines give each schedule's worst ratio to dense over the data.

    python benchmarks/triton_skip_schedules.py                       # writes $OUT/triton_skip_schedules.json
    python benchmarks/triton_skip_schedules.py --sparsities 0.3,0.65 --dtypes int8
    python benchmarks/triton_skip_schedules.py --sparsities 0.25 --rounds 40    # a finer paired ratio
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.data import published_curve_qkv, random_qkv, skip_factor  # noqa: E402
from benchmarks.hopper_sage import SCALE, alternating_times, bench_ms, cu, rel_err, round_ratios  # noqa: E402
from diffusers_trtllm.kernels import triton_sage  # noqa: E402

TILE = (64, 128)
RANDOM_DATA_S = 0.3  # the factor used on random data, where nothing is skipped at any published s
ROUNDS = 10


def paired_ratio(baseline, candidate, rounds: int = ROUNDS) -> float:
    """The median over ``rounds`` of ``baseline``'s time / ``candidate``'s, timed back to back in alternating order
    (a ratio that drift between two separate medians does not move)."""
    times = alternating_times({"baseline": baseline, "candidate": candidate}, rounds)
    return round_ratios(times, "baseline", "candidate")["ratio_median"]


def schedules(thresholds: list[float], sample: tuple[int, float]) -> dict[str, triton_sage.AttentionLaunch]:
    """Every query tile skipping on each schedule, then ``skip_launch`` with ``sample`` (last)."""
    shipped = triton_sage.skip_launch(TILE, sample)
    every_tile = dataclasses.replace(shipped, skip_sample_every=0)
    return {"branching": dataclasses.replace(every_tile, branch_free_below=0.0),
            "branch-free": dataclasses.replace(every_tile, branch_free_below=2.0),
            **{f"alternating {t:g}": dataclasses.replace(every_tile, branch_free_below=t) for t in thresholds},
            "skip_launch": shipped}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sparsities", default="0.05,0.15,0.2,0.25,0.3,0.5,0.65,0.75",
                        help="published-curve s values")
    default_thresholds = [triton_sage.BRANCH_FREE_BELOW]
    parser.add_argument("--thresholds", default=",".join(f"{t:g}" for t in default_thresholds),
                        help="branch_free_below values of the alternating schedules")
    parser.add_argument("--dtypes", default="fp8_e4m3,int8", help="Q/K dtypes: fp8_e4m3, int8")
    parser.add_argument("--tokens", type=int, default=75600)
    parser.add_argument("--heads", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=ROUNDS,
                        help="alternating pairs behind the paired ratio (more resolve smaller differences)")
    args = parser.parse_args()
    lists = {}
    for name in ("sparsities", "thresholds"):
        text = getattr(args, name)
        try:
            lists[name] = [float(value) for value in text.split(",")]
        except ValueError:
            parser.error(f"--{name}: {text!r} is not a comma-separated list of numbers")
    sparsities, thresholds = lists["sparsities"], lists["thresholds"]
    dtypes = args.dtypes.split(",")
    if not set(dtypes) <= {"fp8_e4m3", "int8"}:
        parser.error(f"--dtypes: {args.dtypes!r}; valid: fp8_e4m3, int8")
    tokens, heads = args.tokens, args.heads
    if args.rounds < 1:
        parser.error(f"--rounds: {args.rounds}; valid: a positive number of pairs")
    out_path = os.path.join(os.environ.get("OUT", "."), "triton_skip_schedules.json")
    results = {"meta": dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), shape=[tokens, heads, 128],
                            tile=TILE), "rows": []}
    cases = [("random", RANDOM_DATA_S)] + [("curve", s) for s in sparsities]
    lengths = cu([tokens])
    for dtype in dtypes:
        for data, s in tqdm(cases, desc=dtype):
            q, k, v = random_qkv(tokens, heads) if data == "random" else published_curve_qkv(tokens, heads)
            quantized = triton_sage.sage_quantize(q, k, v, lengths, lengths, tokens, tokens, dtype_qk=dtype,
                                                  q_block=1, k_block=16)
            del q, k, v

            def run(launch, factor, count=False):
                return triton_sage.sage_attention_quantized(
                    quantized, lengths, lengths, (tokens,), (tokens,), SCALE, skip_factor=factor, skip_tile=TILE,
                    count_skips=count, launch=launch)

            factor = skip_factor(s)
            sample = triton_sage.skip_sample_rule((tokens,), heads, TILE[0], "cuda")
            row = dict(dtype=dtype, data=data, s=s, factor=factor, sample=sample,
                       dense_ms=bench_ms(lambda: run(triton_sage.DENSE_LAUNCH, 0.0)))
            reference = None
            launches = schedules(thresholds, sample)
            for name, launch in launches.items():
                out, skipped, total = run(launch, factor, count=True)
                if reference is None:
                    reference = out, int(skipped)
                    row["sparsity"] = int(skipped) / total
                if name == "skip_launch":
                    dense_out = run(triton_sage.DENSE_LAUNCH, 0.0)[0]
                    row.update({"skip_launch sparsity": int(skipped) / total,
                                "skip_launch vs branching": rel_err(out, reference[0]),
                                "skip_launch vs dense": rel_err(out, dense_out),
                                "branching vs dense": rel_err(reference[0], dense_out)})
                    del dense_out
                else:
                    row[f"{name} identical"] = bool(torch.equal(out, reference[0])) and int(skipped) == reference[1]
                row[f"{name} ms"] = bench_ms(lambda: run(launch, factor))
                row[f"{name} x dense"] = row["dense_ms"] / row[f"{name} ms"]
            row["skip_launch x dense, paired"] = paired_ratio(lambda: run(triton_sage.DENSE_LAUNCH, 0.0),
                                                             lambda: run(launches["skip_launch"], factor),
                                                             args.rounds)
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
            with open(out_path, "w") as f:
                json.dump(results, f, indent=1)
            del quantized
    for dtype in dtypes:
        rows = [row for row in results["rows"] if row["dtype"] == dtype]
        worst = {name: min(row[f"{name} x dense"] for row in rows) for name in schedules(thresholds, rows[0]["sample"])}
        worst["skip_launch, paired"] = min(row["skip_launch x dense, paired"] for row in rows)
        print(f"{dtype}: worst x dense " + ", ".join(f"{name} {value:.3f}" for name, value in worst.items()))


if __name__ == "__main__":
    main()

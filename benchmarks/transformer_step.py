"""One denoising call of a full-size video transformer with random bf16 weights, per attention configuration.

Models: the Wan 2.2 A14B expert (14.3 B parameters; 720p, 81 frames: 75,600 tokens), HunyuanVideo 1.5 720p t2v
(8.3 B; 720p, 81 frames: 75,600 video + 1,985 context tokens) and Cosmos3-Super (64.0 B, 119 GiB in bf16; the
pipeline's 720p, 189 frames: 44,160 vision tokens after 600 causal text tokens). Their configurations come from
``examples/evaluation``'s ``MODELS``; ``--layers`` keeps the first N transformer blocks of a model (built with N,
for one that does not fit the GPU whole). Each configuration is warmed up with the
model's first block only (every kernel and shape of the step, at a fraction of its cost), then timed over whole
calls with CUDA events. Reported per model: step time, ratio to TORCH_SDPA (what torch picks, cuDNN on an H200)
and to cuDNN SDPA forced, and attention's share of the step (1 - no-attention time / reference time). Every
configuration runs in its own try/except: a failure is a row with the error, not a lost run.

Random weights give near-Gaussian attention scores, far less peaked than a trained model's: the tiles skipped at
a given λ differ from a real run's, so skip rows measure the kernel at this data, not a model's speed-up. Each
skip row reports the share of tiles skipped (reused, in brackets) at the second of two untimed eager calls of one
run with statistics on, where its kernel counts (the SAGE kernels and TORCH_REFERENCE; FlashInfer's bf16 kernels
do not: "n/a").

With ``--compile blocks`` every transformer block is compiled with ``block.compile(fullgraph=True)`` (what
diffusers' ``compile_repeated_blocks(fullgraph=True)`` does) after the processors are installed, and each row
reports its compile time: the warm-up call's time, which compiles the one graph all blocks share. Dynamo's
caches are reset between configurations, so every row compiles from scratch. The ``diffusers_eager`` row runs
diffusers' default processors uncompiled beside the compiled rows. Each row says what the plan ran per role
(backend and mode at install, e.g. Cosmos 3's causal text stream on TORCH_SDPA under a TRTLLM_ATTN default).

    PYTHONPATH=. python benchmarks/transformer_step.py            # on the GPU; JSON to $OUT (or --output)
    PYTHONPATH=. python benchmarks/transformer_step.py --tiny     # CPU, tiny configurations, seconds
    PYTHONPATH=. python benchmarks/transformer_step.py --compile blocks --configs diffusers dense sage
    PYTHONPATH=. python benchmarks/transformer_step.py --models cosmos --compile blocks \
        --configs diffusers diffusers_eager dense sage sage_skip --sage-dtypes fp8_e4m3
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from diffusers_trtllm import enable_trtllm_attention
from diffusers_trtllm.config import TORCH_REFERENCE, TORCH_SDPA, TRTLLM_ATTN, AttnQuantSpec
from diffusers_trtllm.processors import PROCESSORS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # the examples' shared helpers
from evaluation import (MODELS, ModelEntry, SpeedRun, TransformerTimer, VideoShape, attention_config,  # noqa: E402
                        find_model, format_number, markdown_table, no_attention, synchronize)

SDPA_LABEL = "TORCH_SDPA"
CUDNN_LABEL = "TORCH_SDPA cuDNN"
NO_ATTENTION_LABEL = "attention removed"
DIFFUSERS_LABEL = "diffusers default processors"
DIFFUSERS_EAGER_LABEL = "diffusers default processors, eager"
DEFAULT_LAMBDAS = (0.066, 0.5)  # factor 5,000 at 75,600 keys (DESIGN.md's Hopper probe), and a large one
GROUPS = ("sdpa", "cudnn", "dense", "skip", "sage", "sage_skip", "sage_reuse", "sage_reuse_untested", "none",
          "diffusers", "diffusers_eager")
SAGE_DTYPES = ("int8", "fp8_e4m3")
REUSE_STEPS = 1_000  # the sage_reuse row: tile maps reused by every call after the one that made them
DEFAULT_GROUPS = ("sdpa", "cudnn", "dense", "skip", "sage", "sage_skip", "none")


@dataclass
class BenchConfig:
    """A row: an attention config installed with ``enable_trtllm_attention`` (None: diffusers' own processors)
    and a context around the timed calls (forced SDPA kernel, attention removed); ``eager``: never compiled;
    ``skips``: the config runs Skip-Softmax (the row reports the tiles skipped, counted apart from the timing)."""

    label: str
    config: object | None
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    unavailable: str | None = None
    eager: bool = False
    skips: bool = False


@dataclass
class Row:
    model: str
    label: str
    ms: float | None = None
    calls_ms: list = field(default_factory=list)
    peak_gb: float | None = None
    compile_s: float | None = None
    vs_sdpa: float | None = None
    vs_cudnn: float | None = None
    vs_diffusers: float | None = None
    sparsity: float | None = None
    reused: float | None = None
    ran: str = ""
    error: str = ""


def bench_configs(entry: ModelEntry, groups, lambdas, feature_backend: str, on_cuda: bool,
                  sage_dtypes=SAGE_DTYPES) -> list[BenchConfig]:
    """The configurations to time, in order (TORCH_SDPA first: the others' ratios refer to it)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def trt(**kw):
        return attention_config(feature_backend, sdpa_roles=entry.sdpa_roles, **kw)

    sdpa = attention_config(TORCH_SDPA)
    configs = []
    if "sdpa" in groups:
        configs.append(BenchConfig(SDPA_LABEL, sdpa))
    if "cudnn" in groups:
        configs.append(BenchConfig(CUDNN_LABEL, sdpa, lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION),
                                   None if on_cuda else "cuDNN SDPA needs a CUDA GPU"))
    if "diffusers" in groups:
        configs.append(BenchConfig(DIFFUSERS_LABEL, None))
    if "diffusers_eager" in groups:
        configs.append(BenchConfig(DIFFUSERS_EAGER_LABEL, None, eager=True))
    if "dense" in groups:
        configs.append(BenchConfig(f"{feature_backend} dense", trt()))
    if "skip" in groups:
        configs += [BenchConfig(f"{feature_backend} skip λ={lam:g}", trt(skip={"threshold": lam}), skips=True)
                    for lam in lambdas]
    if "sage" in groups:
        configs += [BenchConfig(f"{feature_backend} SAGE {dtype}", trt(quant=AttnQuantSpec(dtype_qk=dtype)))
                    for dtype in sage_dtypes]
    if "sage_skip" in groups:
        configs.append(BenchConfig(f"{feature_backend} SAGE fp8_e4m3 + skip λ={lambdas[-1]:g}",
                                   trt(skip={"threshold": lambdas[-1]}, quant=AttnQuantSpec(dtype_qk="fp8_e4m3")),
                                   skips=True))
    # every timed call a reusing step: the calls are successive steps of one run ("untested": reuse_test false)
    for group, reuse_test, suffix in (("sage_reuse", True, ""), ("sage_reuse_untested", False, " untested")):
        if group in groups:
            configs.append(BenchConfig(
                f"{feature_backend} SAGE fp8_e4m3 + skip λ={lambdas[-1]:g} + reuse{suffix}",
                trt(skip={"threshold": lambdas[-1], "reuse_steps": REUSE_STEPS, "reuse_test": reuse_test},
                    quant=AttnQuantSpec(dtype_qk="fp8_e4m3")), skips=True))
    if "none" in groups:
        configs.append(BenchConfig(NO_ATTENTION_LABEL, sdpa, no_attention))
    return configs


def build_transformer(entry: ModelEntry, run: SpeedRun, device: torch.device, dtype: torch.dtype):
    """The transformer at ``run``'s configuration with random weights, built directly on ``device``."""
    import diffusers

    cls = getattr(diffusers, entry.transformer_class)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = cls(**run.transformer_config).eval()
    finally:
        torch.set_default_dtype(previous)
    return model


@contextlib.contextmanager
def first_block_only(model: torch.nn.Module, blocks_attr: str):
    """The model with its first transformer block only: runs every kernel and shape of a step, at a fraction of
    its cost (a warm-up for JIT builds, cuDNN plans and Triton compilation)."""
    blocks = getattr(model, blocks_attr)
    setattr(model, blocks_attr, blocks[:1])
    try:
        yield
    finally:
        setattr(model, blocks_attr, blocks)


@contextlib.contextmanager
def compiled_blocks(model: torch.nn.Module, blocks_attr: str, enabled: bool):
    """Every block compiled with ``fullgraph=True`` while inside (undone after, dynamo's caches reset)."""
    blocks = list(getattr(model, blocks_attr)) if enabled else []
    for block in blocks:
        block.compile(fullgraph=True)
    try:
        yield
    finally:
        for block in blocks:
            block._compiled_call_impl = None
        if enabled:
            torch._dynamo.reset()


def time_config(model, run: SpeedRun, inputs: dict, bench: BenchConfig, repeats: int, device,
                compile_blocks: bool = False) -> Row:
    # no statistics: counting skipped tiles is extra work that the speed of a step should not include
    installed = (enable_trtllm_attention(model, bench.config, collect_stats=False) if bench.config is not None
                 else contextlib.nullcontext())
    compile_blocks = compile_blocks and not bench.eager
    row = Row("", bench.label)
    with installed as handle, bench.context(), torch.no_grad(), \
            compiled_blocks(model, run.blocks_attr, compile_blocks):
        row.ran = what_ran(handle)
        start = time.perf_counter()
        with first_block_only(model, run.blocks_attr), step_of_one_run(model):
            model(**inputs)
        synchronize(device)
        if compile_blocks:
            row.compile_s = time.perf_counter() - start
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with TransformerTimer({"transformer": model}) as timer:
            for _ in range(repeats):
                with step_of_one_run(model):
                    model(**inputs)
        row.calls_ms = [s * 1e3 for s in timer.seconds()]
    row.ms = statistics.median(row.calls_ms)
    if device.type == "cuda":
        row.peak_gb = torch.cuda.max_memory_allocated(device) / 1e9
    return row


def tiles_skipped(model, inputs: dict, bench: BenchConfig) -> tuple[float | None, float | None]:
    """``(sparsity, reused share)`` at the second of two eager calls, steps of one run with statistics on (the
    reuse row's second step reuses the first's maps): what the timed calls skipped, counted apart from them.
    None where the kernel does not count (FlashInfer's own)."""
    with enable_trtllm_attention(model, bench.config) as handle, torch.no_grad():
        for _ in range(2):
            with step_of_one_run(model):
                model(**inputs)
        per_step = handle.stats.per_step()
        last = max(per_step, default=None)
        return per_step.get(last), handle.stats.reused_per_step().get(last)


def step_of_one_run(model):
    """Each call a step of one run, as a pipeline's denoising loop makes them (the name-only ``cache_context``
    channel: the name seen again is the next step), so Skip-Softmax reuse reuses the last call's tile maps."""
    return model.cache_context("cond") if hasattr(model, "cache_context") else contextlib.nullcontext()


def what_ran(handle) -> str:
    """The plan's backend and mode per role (with its number of layers), or diffusers' own processors."""
    if handle is None:
        return "diffusers"
    per_role = Counter(f"{site.role}: {call.backend}:{call.mode_of(call.settings)}"
                       for site, call in handle.planner.calls.items())
    return ", ".join(f"{what} in {n} layer{'s' * (n != 1)}" for what, n in per_role.items())


def block_count_key(run: SpeedRun) -> str:
    """The transformer argument that sets its number of blocks."""
    return next(k for k in ("num_layers", "num_hidden_layers") if k in run.transformer_config)


def with_layers(run: SpeedRun, layers: int | None) -> SpeedRun:
    """``run`` with its transformer built with ``layers`` blocks (None: as configured)."""
    if layers is None:
        return run
    return dataclasses.replace(run, transformer_config={**run.transformer_config, block_count_key(run): layers})


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_model(entry: ModelEntry, run: SpeedRun, configs, args, device, dtype, deadline: float,
                full_layers: int) -> dict:
    result = {"model": entry.name, "model_id": entry.model_id, "config": dict(run.transformer_config),
              "shape": vars(run.shape), "video_tokens": run.video_tokens, "context_tokens": run.context_tokens,
              "rows": []}
    if not any(entry.transformer_class in p.TRANSFORMER_CLASSES for p in PROCESSORS):
        result["skipped"] = f"diffusers_trtllm has no processor for {entry.transformer_class} (yet)"
        return result
    start = time.perf_counter()
    model = build_transformer(entry, run, device, dtype)
    result["params"] = sum(p.numel() for p in model.parameters())
    result["layers"] = f"{len(getattr(model, run.blocks_attr))} of {full_layers} blocks"
    result["build_s"] = time.perf_counter() - start
    inputs = run.inputs(run, device, dtype)
    rows = result["rows"]
    try:
        for bench in configs:
            if bench.unavailable or time.perf_counter() > deadline:
                rows.append(Row(entry.name, bench.label, error=f"not run: {bench.unavailable or 'time budget spent'}"))
                continue
            print(f"[{entry.name}] {bench.label} ...", file=sys.stderr, flush=True)
            try:
                row = time_config(model, run, inputs, bench, args.repeats, device, args.compile == "blocks")
                row.model = entry.name
                if bench.skips:
                    row.sparsity, row.reused = tiles_skipped(model, inputs, bench)
            except Exception as e:  # noqa: BLE001  (record and go on: one failure must not lose the run)
                message = str(e).splitlines()[0] if str(e) else ""
                row = Row(entry.name, bench.label, error=f"{type(e).__name__}: {message}"[:300])
            if row.error:  # after the except block, which kept the failed call's tensors alive (an OOM's)
                free(device)
            rows.append(row)
    finally:
        del model, inputs
        free(device)
    by_label = {r.label: r.ms for r in rows if r.ms is not None}
    for row in rows:
        if row.ms is not None:
            row.vs_sdpa = by_label[SDPA_LABEL] / row.ms if SDPA_LABEL in by_label else None
            row.vs_cudnn = by_label[CUDNN_LABEL] / row.ms if CUDNN_LABEL in by_label else None
            row.vs_diffusers = by_label[DIFFUSERS_LABEL] / row.ms if DIFFUSERS_LABEL in by_label else None
    if NO_ATTENTION_LABEL in by_label:
        for label, key in ((SDPA_LABEL, "attention_share_sdpa"), (CUDNN_LABEL, "attention_share_cudnn")):
            if label in by_label:
                result[key] = 1 - by_label[NO_ATTENTION_LABEL] / by_label[label]
    result["rows"] = [vars(r) for r in rows]
    return result


def report(results: list[dict]) -> str:
    lines = []
    for res in results:
        title = f"### {res['model']}: {res['shape']['height']}×{res['shape']['width']}, {res['shape']['frames']} " \
                f"frames ({res['video_tokens']:,} video tokens + {sum(res['context_tokens']):,} context)"
        if "skipped" in res:
            lines += [title, "", f"skipped: {res['skipped']}", ""]
            continue
        table = markdown_table(
            ("configuration", "step (ms)", "× vs TORCH_SDPA", "× vs cuDNN", "× vs diffusers", "compile (s)",
             "peak GB", "skipped (reused)", "ran", "notes"),
            [(r["label"], format_number(r["ms"], 1), format_number(r["vs_sdpa"], 3, "×"),
              format_number(r["vs_cudnn"], 3, "×"), format_number(r["vs_diffusers"], 3, "×"),
              format_number(r["compile_s"], 1), format_number(r["peak_gb"], 1), skipped_cell(r), r["ran"],
              r["error"])
             for r in res["rows"]], "lrrrrrrrll")
        share = ", ".join(f"{format_number(res[k], 3)} of the {name} step" for k, name in
                          (("attention_share_sdpa", "TORCH_SDPA"), ("attention_share_cudnn", "cuDNN")) if k in res)
        lines += [title, "", f"{res['params'] / 1e9:.3g} B parameters ({res['layers']}), built in "
                  f"{res['build_s']:.1f} s", "",
                  table, "", f"attention share: {share or 'n/a'}", ""]
    return "\n".join(lines)


def skipped_cell(row: dict) -> str:
    """A row's share of tiles skipped, with the share reused in brackets ("n/a": not counted or no skipping)."""
    if row["sparsity"] is None:
        return "n/a"
    return f"{row['sparsity']:.3f}" + (f" ({row['reused']:.3f})" if row["reused"] else "")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny configurations on the CPU (a smoke test)")
    parser.add_argument("--models", nargs="+", default=None,
                        help="model ids or aliases (default: every model with a speed configuration)")
    parser.add_argument("--configs", nargs="+", choices=GROUPS, default=list(DEFAULT_GROUPS))
    parser.add_argument("--lambdas", type=float, nargs="+", default=list(DEFAULT_LAMBDAS),
                        help="Skip-Softmax λ values; the last one also runs with SAGE")
    parser.add_argument("--frames", type=int, default=None, help="override every model's frame count (4k + 1)")
    parser.add_argument("--layers", type=int, default=None,
                        help="build every model with its first N transformer blocks only (one too large for the GPU)")
    parser.add_argument("--sage-dtypes", nargs="+", choices=SAGE_DTYPES, default=list(SAGE_DTYPES),
                        help="Q/K dtypes of the sage rows")
    parser.add_argument("--compile", choices=("none", "blocks"), default="none",
                        help="blocks: compile every transformer block with fullgraph=True (after installing)")
    parser.add_argument("--repeats", type=int, default=1, help="timed calls per configuration (median)")
    parser.add_argument("--time-budget", type=float, default=400.0,
                        help="seconds after which remaining configurations are recorded as not run")
    parser.add_argument("--output", type=Path, default=None,
                        help="JSON file (default: $OUT/transformer_step.json, or ./transformer_step.json)")
    args = parser.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers {args.layers} is invalid: expected a positive number of blocks")
    start = time.perf_counter()
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    feature_backend = TORCH_REFERENCE if args.tiny else TRTLLM_ATTN
    entries = ([find_model(name) for name in args.models] if args.models
               else [e for e in MODELS.values() if e.speed is not None])
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
            else "cpu", "tiny": args.tiny, "lambdas": args.lambdas, "repeats": args.repeats,
            "compile": args.compile}
    if device.type == "cuda" and any(g in args.configs for g in ("dense", "skip", "sage", "sage_skip")):
        meta["trtllm_warmup_s"] = trtllm_warmup(device)
    results = []
    for entry in entries:
        run = entry.tiny_speed if args.tiny else entry.speed
        if args.frames:
            run = dataclasses.replace(run, shape=VideoShape(run.shape.height, run.shape.width, args.frames))
        full_layers = run.transformer_config[block_count_key(run)]
        configs = bench_configs(entry, args.configs, args.lambdas, feature_backend, device.type == "cuda",
                                args.sage_dtypes)
        results.append(bench_model(entry, with_layers(run, args.layers), configs, args, device, dtype,
                                   start + args.time_budget, full_layers))
    meta["total_s"] = time.perf_counter() - start
    text = report(results)
    print(text)
    output = args.output or Path(os.environ.get("OUT", ".")) / "transformer_step.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=str))
    print(f"wrote {output} ({meta['total_s']:.0f} s)")
    return {"meta": meta, "results": results, "markdown": text, "output": output}


def trtllm_warmup(device: torch.device) -> dict | str:
    """Build FlashInfer's kernels once before timing (FMHAv2's JIT build takes ~90 s the first time)."""
    try:
        from diffusers_trtllm.backends.trtllm import warmup

        return warmup(device)
    except Exception as e:  # noqa: BLE001  (the TRTLLM rows will then carry the error themselves)
        return f"{type(e).__name__}: {e}"


if __name__ == "__main__":
    main()

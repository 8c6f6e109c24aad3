"""Throwaway probe: code variants of the routed launch against the dense launch (kernel times by pass)."""
import dataclasses, json, sys, os, statistics, importlib
import torch
from torch.profiler import profile, ProfilerActivity
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "probe_variants"))
from benchmarks.data import published_curve_qkv, skip_factor
from benchmarks.hopper_sage import SCALE, cu
T, H = 75600, 40
L = cu([T])
q, k, v = published_curve_qkv(T, H)
mods = {name: importlib.import_module(name) for name in sys.argv[1].split(",")}
for dtype in ("fp8_e4m3", "int8"):
    base = next(iter(mods.values()))
    z = base.sage_quantize(q, k, v, L, L, T, T, dtype_qk=dtype, q_block=1, k_block=16)
    f = skip_factor(0.15)
    variants = {}
    for mname, ts in mods.items():
        shipped = ts.skip_launch((64, 128))
        if mname == "v_old":
            variants[f"{mname} dense"] = (ts, ts.DENSE_LAUNCH, 0.0)
        for n in ((100000,) if mname == "v_old" else (32, 100000)):
            variants[f"{mname} every {n}"] = (ts, dataclasses.replace(shipped, skip_sample_every=n), f)
    def run(ts, launch, factor):
        return ts.sage_attention_quantized(ts.SageQuantized(*z), L, L, (T,), (T,), SCALE, skip_factor=factor, skip_tile=(64, 128), launch=launch)
    for ts, launch, factor in variants.values():
        run(ts, launch, factor)
    times = {n: [] for n in variants}
    for rnd in range(3):
        for name, (ts, launch, factor) in variants.items():
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    run(ts, launch, factor)
                torch.cuda.synchronize()
            kern = [e.device_time / 1000 for e in prof.events() if e.device_type.name == "CUDA" and "sage_attention" in e.name]
            n = len(kern) // 3
            times[name] += [kern[i:i + n] for i in range(0, len(kern), n)]
    summary = {name: dict(passes_ms=[round(statistics.median(p), 2) for p in zip(*calls)],
                          total_ms=round(statistics.median([sum(c) for c in calls]), 2)) for name, calls in times.items()}
    print(dtype, json.dumps(summary), flush=True)
    del z

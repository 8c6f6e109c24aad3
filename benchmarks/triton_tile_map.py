"""The Triton SAGE attention launch reusing a tile map (skip decisions carried from one step to the next), timed
against the same launch without one, at given map sparsities, on one GPU (tuned for an H200).

A map of sparsity s has each (head, query tile, KV tile) set with probability s (a query tile's first KV tile
never: it keeps a key), in the kernel's skip tile (64 × 128 on sm_90). Mapped tiles cost no K/V load and no
Q·Kᵀ, so the ideal time is ``(1 - s)`` of dense; what the walk over the map's words costs shows at s = 0 (a zeroed
map against no map) and as the gap to that ideal. Without ``--skip-factor`` nothing else is skipped (the map is
only read); with it, the other tiles are also tested as Skip-Softmax does, and the map is restored before each
call (a copy of a few MB, inside the timing).

Data: q, k, v ~ N(0, 1) bf16 at Wan 2.2's self-attention shape by default (75,600 tokens, 40 heads, hd 128);
speed depends on the map, not on the values. Times are medians of ``triton.testing.do_bench``, attention launch
only (quantization excluded).

    python benchmarks/triton_tile_map.py                    # writes $OUT/triton_tile_map.json (or ./)
    python benchmarks/triton_tile_map.py --sparsities 0,0.5,0.9 --dtypes int8 --skip-factor 20000
    python benchmarks/triton_tile_map.py --dry-run          # CPU, Triton's interpreter, a tiny shape: checks
                                                            # the arguments and that every case runs
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

DRY_RUN = "--dry-run" in sys.argv
if DRY_RUN:
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from diffusers_trtllm.kernels import triton_sage  # noqa: E402
from diffusers_trtllm.kernels.numerics import TILE_MAP_BITS  # noqa: E402

SCALE = 128 ** -0.5
TILE = (triton_sage.DENSE_LAUNCH.block_m, triton_sage.DENSE_LAUNCH.block_n)  # sm_90's skip tile
DRY_SHAPE = (300, 2)  # tokens, heads of the dry run


def random_tile_map(seqlens_q: tuple[int, ...], seqlens_kv: tuple[int, ...], heads: int, tile: tuple[int, int],
                    sparsity: float, device, seed: int = 0) -> torch.Tensor:
    """A tile map (``triton_sage.tile_map_shape``) with each of a sequence's (head, query tile, KV tile) set with
    probability ``sparsity``, KV tile 0 never; bits past a sequence's tiles 0."""
    batch, _, q_tiles, words = triton_sage.tile_map_shape(seqlens_q, seqlens_kv, heads, tile)
    bits = TILE_MAP_BITS
    gen = torch.Generator().manual_seed(seed)
    chosen = torch.rand(batch, heads, q_tiles, words * bits, generator=gen) < sparsity
    chosen[..., 0] = False
    for b, (n_q, n_kv) in enumerate(zip(seqlens_q, seqlens_kv)):
        chosen[b, :, -(-n_q // tile[0]):] = False
        chosen[b, :, :, -(-n_kv // tile[1]):] = False
    weights = torch.tensor([1 << i for i in range(bits)], dtype=torch.int64)
    words_u32 = (chosen.view(batch, heads, q_tiles, words, bits).to(torch.int64) * weights).sum(-1)
    return (words_u32 - (words_u32 >= 2 ** 31).to(torch.int64) * 2 ** 32).to(torch.int32).to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=75600)
    parser.add_argument("--heads", type=int, default=40)
    parser.add_argument("--dtypes", default="int8,fp8_e4m3")
    parser.add_argument("--sparsities", default="0,0.25,0.5,0.75,0.9")
    parser.add_argument("--skip-factor", type=float, default=0.0,
                        help="also test the unmapped tiles with this Skip-Softmax factor (λ = factor / tokens)")
    parser.add_argument("--rep-ms", type=int, default=1500)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    try:
        sparsities = [float(x) for x in args.sparsities.split(",")]
    except ValueError:
        parser.error(f"--sparsities: {args.sparsities!r} is not a comma-separated list of numbers")
    if not all(0.0 <= s < 1.0 for s in sparsities):
        parser.error(f"--sparsities: {sparsities}; valid: fractions in [0, 1)")
    dtypes = args.dtypes.split(",")
    if not set(dtypes) <= {"int8", "fp8_e4m3"}:
        parser.error(f"--dtypes: {args.dtypes!r}; valid: int8, fp8_e4m3")
    if args.skip_factor < 0:
        parser.error(f"--skip-factor: {args.skip_factor}; valid: 0 (reuse only) or a positive factor")
    if args.dry_run:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
        from test_triton_sage import _fix_triton_interpreter
        _fix_triton_interpreter()
        tokens, heads, device = *DRY_SHAPE, "cpu"
    else:
        tokens, heads, device = args.tokens, args.heads, "cuda"

    import triton

    def bench_ms(fn) -> float:
        if args.dry_run:  # one call: the interpreter has no CUDA events
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        return triton.testing.do_bench(fn, warmup=300, rep=args.rep_ms, return_mode="median")

    out_path = os.path.join(os.environ.get("OUT", "."), "triton_tile_map.json")
    results = {"meta": dict(gpu=torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
                            torch=torch.__version__, triton=triton.__version__, shape=[tokens, heads, 128], tile=TILE,
                            skip_factor=args.skip_factor, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())),
               "rows": []}
    lengths = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    seqlens = (tokens,)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(tokens, heads, 128, generator=gen, device=device, dtype=torch.bfloat16) for _ in range(3))
    launch = triton_sage.skip_launch(TILE, triton_sage.skip_sample_rule(seqlens, heads, TILE[0], device))
    for dtype in dtypes:
        quantized = triton_sage.sage_quantize(q, k, v, lengths, lengths, tokens, tokens, dtype_qk=dtype, q_block=1,
                                              k_block=16)

        def attend(tile_map=None, skip_factor=0.0, count=False):
            return triton_sage.sage_attention_quantized(
                quantized, lengths, lengths, seqlens, seqlens, SCALE, skip_factor=skip_factor, skip_tile=TILE,
                count_skips=count, launch=launch if skip_factor else None, tile_map=tile_map)

        dense_ms = bench_ms(lambda: attend())
        for s in sparsities:
            saved = random_tile_map(seqlens, seqlens, heads, TILE, s, device)
            tile_map = saved.clone()
            if args.skip_factor:
                def run():
                    tile_map.copy_(saved)  # the test adds to the map: every call starts from the same one
                    return attend(tile_map, args.skip_factor)
            else:
                def run():
                    return attend(tile_map)
            reused = torch.zeros((), dtype=torch.int32, device=device)
            tile_map.copy_(saved)
            _, skipped, total = triton_sage.sage_attention_quantized(
                quantized, lengths, lengths, seqlens, seqlens, SCALE, skip_factor=args.skip_factor, skip_tile=TILE,
                count_skips=True, launch=launch if args.skip_factor else None, tile_map=tile_map, reused=reused)
            ms = bench_ms(run)
            row = dict(dtype=dtype, map_sparsity=s, reused=int(reused) / total, tested_skipped=int(skipped) / total,
                       dense_ms=dense_ms, ms=ms, speedup=dense_ms / ms,
                       ideal_speedup=1.0 / (1.0 - int(reused) / total - int(skipped) / total))
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
            with open(out_path, "w") as f:  # rewritten each row: a timeout keeps what was measured
                json.dump(results, f, indent=1)
        del quantized
    print(f"{'dtype':9} {'map s':>6} {'reused':>7} {'tested':>7} {'dense ms':>9} {'ms':>8} {'x dense':>8} {'ideal':>6}")
    for r in results["rows"]:
        print(f"{r['dtype']:9} {r['map_sparsity']:6.2f} {r['reused']:7.3f} {r['tested_skipped']:7.3f} "
              f"{r['dense_ms']:9.2f} {r['ms']:8.2f} {r['speedup']:8.3f} {r['ideal_speedup']:6.2f}")


if __name__ == "__main__":
    main()

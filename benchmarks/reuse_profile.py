"""The FMHAv2 SAGE fp8 calls that Skip-Softmax reuse is measured against, one by one, for a profiler: at Wan 2.2's
75,600 × 40 × 128 on skip_reuse.py's published-curve data (one sm_90 GPU).

Cases, in this order: ``dense256`` and ``dense128`` (the SAGE kernel at 256- and 128-key steps, no skip), ``fresh``
(the tile-map kernel from a zeroed map: every tile tested, in aligned pairs as Skip-Softmax at 256-key steps),
``fresh untested`` (the tile-map kernel without the test from a zeroed map: every tile computed, as ``dense256``
does, so the two differ by what the map's machinery costs), ``fresh256`` (the Skip-Softmax kernel of 256-key steps
writing a zeroed map: what a reuse window's first step runs), ``reuse`` (from the map ``fresh256`` left), ``walk``
(from a map holding every tile: each query tile's first KV step computed, the rest walked past), ``reuse
untested`` (that map at factor 0: the tile-map kernel without Skip-Softmax's test, which computes every tile the
map does not hold). Each call includes its quantization, timed alone as ``quantize``.

Without ``--once`` it times cuDNN SDPA and each case (mean of ``--iters`` calls after one warm-up) and prints ms,
the ratio to cuDNN and the TFLOP/s of the tiles computed. A GPU runs hotter as a sequence of cases goes on, so the
later cases of one pass read slower (by several per cent at Wan's size on an H100); ``--rounds N`` times every case
in each of N rounds, the order reversed every other round, and prints each case's median with its range.
``--kv-buffers N`` builds and runs a module whose 128-key kernels (``dense128``) keep N K/V buffers in flight
instead of ``fmha_v2_sage.KV_BUFFERS``' choice (an experiment: the module is built on first use). ``--tile-map-patch FILE``
builds the module with FILE in place of the package's ``tile_map_reuse.patch`` (the other patches as they are), for
an A/B of a kernel change in one device call, one process per build (two modules with the same kernel names in one
process could call each other's):

    git show c9ba52e:diffusers_trtllm/kernels/csrc/fmha_v2_patches/tile_map_reuse.patch > ab/before.patch
    python benchmarks/reuse_profile.py --iters 5
    python benchmarks/reuse_profile.py --iters 5 --tile-map-patch ab/before.patch

With ``--once`` it calls each case once, untimed, for Nsight Compute:

    ncu --clock-control none -k regex:fmha_v2 --section SpeedOfLight ... python benchmarks/reuse_profile.py --once
"""

import argparse
import math
import pathlib
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import skip_reuse  # noqa: E402  (the data model and the timer)


def use_tile_map_patch(patch: pathlib.Path) -> None:
    """Build the FMHAv2 SAGE module with ``patch`` as ``tile_map_reuse.patch``: ``fmha_v2_sage`` reads its
    patches from a copy of its folder holding it (the module's name follows its sources, so it builds apart)."""
    from diffusers_trtllm.kernels import fmha_v2_sage

    folder = pathlib.Path(tempfile.mkdtemp(prefix="fmha_v2_patches_"))
    for patch_file in fmha_v2_sage.header_patch_files():
        shutil.copy(patch_file, folder)
    shutil.copy(patch, folder / "tile_map_reuse.patch")
    fmha_v2_sage.PATCH_FOLDER = folder
    fmha_v2_sage.load_module.cache_clear()


def round_orders(cases: list[str], rounds: int) -> list[list[str]]:
    """The order of ``cases`` in each of ``rounds`` rounds: as given, then reversed, alternately."""
    return [cases if r % 2 == 0 else cases[::-1] for r in range(rounds)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sparsity", type=float, default=0.65, help="target sparsity s (factor a·exp(b·s))")
    parser.add_argument("--iters", type=int, default=3, help="timed calls per case (per round)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds of every case, the order reversed every other round (medians)")
    parser.add_argument("--once", action="store_true", help="one untimed call per case (for a profiler)")
    parser.add_argument("--kv-buffers", type=int, choices=(2, 3, 4), help="K/V buffers of the 128-key kernels")
    parser.add_argument("--tile-map-patch", type=pathlib.Path,
                        help="build with this file as tile_map_reuse.patch (an A/B of a kernel change)")
    args = parser.parse_args(argv)
    if not 0.0 < args.sparsity < 1.0 or args.iters < 1 or args.rounds < 1:
        parser.error(f"--sparsity must lie in (0, 1) and --iters and --rounds be >= 1; got {args.sparsity}, "
                     f"{args.iters}, {args.rounds}")
    if args.tile_map_patch is not None and not args.tile_map_patch.is_file():
        parser.error(f"--tile-map-patch {args.tile_map_patch}: no such file")
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        sys.exit("reuse_profile: needs an sm_90 GPU (H100/H200)")
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from diffusers_trtllm.backends.base import pack_tile_map
    from diffusers_trtllm.kernels import fmha_v2_sage

    if args.tile_map_patch is not None:
        use_tile_map_patch(args.tile_map_patch)
    if args.kv_buffers:
        fmha_v2_sage.KV_BUFFERS[128] = args.kv_buffers
    seq, heads, d = 75_600, 40, skip_reuse.HEAD_DIM
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = skip_reuse.data(seq, heads, skip_reuse.draw_offsets(seq, heads, gen), gen)
    cu = torch.tensor([0, seq], dtype=torch.int32, device="cuda")
    factor = skip_reuse.A * math.exp(skip_reuse.B * args.sparsity)
    shape = fmha_v2_sage.tile_map_shape((seq,), (seq,), heads)
    kv_tiles = -(-seq // 128)
    every_tile = pack_tile_map(torch.ones(shape[:3] + (kv_tiles,), dtype=torch.bool, device="cuda"), shape[-1])
    tile_map, counts = torch.zeros(shape, dtype=torch.int32, device="cuda"), torch.zeros(2, dtype=torch.int32,
                                                                                         device="cuda")

    def dense(kv_step):
        return lambda: fmha_v2_sage.fmha_v2_sage_attention(q, k, v, cu, (seq,), d ** -0.5, k_block=0,
                                                           kv_step=kv_step)

    def mapped(entry, test=True, fresh=False):
        def call():
            tile_map.copy_(entry)
            counts.zero_()
            fmha_v2_sage.fmha_v2_sage_attention(q, k, v, cu, (seq,), d ** -0.5, k_block=0,
                                                kv_step=fmha_v2_sage.REUSE_KV_STEP,
                                                skip_factor=factor if test else 0.0, skip_counts=counts,
                                                tile_map=tile_map, fresh_map=fresh)
        return call

    mapped(torch.zeros_like(tile_map), fresh=True)()
    fresh_map = tile_map.clone()
    calls = {"dense256": dense(256), "dense128": dense(128), "fresh": mapped(torch.zeros_like(tile_map)),
             "fresh untested": mapped(torch.zeros_like(tile_map), test=False),
             "fresh256": mapped(torch.zeros_like(tile_map), fresh=True),
             "reuse": mapped(fresh_map), "walk": mapped(every_tile), "reuse untested": mapped(fresh_map, test=False)}
    total = heads * -(-seq // 64) * kv_tiles
    gemm_flops = 2 * 64 * 128 * d
    quantize_ms = skip_reuse.timed(lambda: fmha_v2_sage.sage_quantize_packed(q, k, v, cu, seq, 0), args.iters)
    cudnn_ms = None
    if not args.once:
        cudnn_ms = skip_reuse.time_cudnn(q, k, v, d ** -0.5, args.iters)
    print(f"reuse_profile: s = {args.sparsity}, {total} tiles, 128-key kernels with "
          f"{fmha_v2_sage.KV_BUFFERS[128]} K/V buffers, module {fmha_v2_sage.jit_spec().name} (tile-map patch "
          f"{args.tile_map_patch or 'of the package'}); quantize {quantize_ms:.2f} ms, cuDNN {cudnn_ms} ms")
    if args.once:
        for name, call in calls.items():
            call()
            torch.cuda.synchronize()
            print(f"{name}: called", flush=True)
        return
    times, skipped = {name: [] for name in calls}, {}

    def report(name):
        ms = statistics.median(times[name])
        test, reused = skipped[name]
        gemm_tiles = 2 * total - 2 * reused - test
        spread = (f" (median of {len(times[name])} rounds, {min(times[name]):.2f} to {max(times[name]):.2f})"
                  if len(times[name]) > 1 else "")
        print(f"{name}: {ms:.2f} ms{spread} ({cudnn_ms / ms:.2f}x cuDNN; kernel {ms - quantize_ms:.2f}), skipped by "
              f"test {test / total:.3f}, by reuse {reused / total:.3f}, "
              f"{gemm_tiles * gemm_flops / (ms - quantize_ms) / 1e9:.0f} TFLOP/s computed (kernel time)", flush=True)

    for order in round_orders(list(calls), args.rounds):
        for name in order:
            times[name].append(skip_reuse.timed(calls[name], args.iters))
            if name not in skipped:  # the same tiles every call: read once
                skipped[name] = (0, 0) if name in ("dense256", "dense128") else tuple(int(x) for x in counts)
            if args.rounds == 1:
                report(name)
    if args.rounds > 1:
        for name in calls:
            report(name)


if __name__ == "__main__":
    main()

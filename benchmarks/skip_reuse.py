"""Kernel time against sparsity at Wan 2.2's self-attention shape (default 75,600 tokens × 40 heads × 128), one
H100/H200 (sm_90): cuDNN SDPA against the SAGE fp8 kernels that TRTLLM_ATTN runs (``--kernels``: FMHAv2's,
Triton's), each dense, with Skip-Softmax (every tile tested) and with reuse (issue 47: the previous step's tile map
skips tiles before they are loaded). Each SAGE time includes its kernel's quantization of
Q, K and V.

Data: the published-curve model of DESIGN.md §7 (each (head, 128-key tile) one logit offset: a fraction
1 − ln(S/a)/b at 0, the rest uniform in [−ln(S/a), 0] nats, over N(0, 0.3²) q and k; one query channel carries the
offset), so that the factor a·exp(b·s) of NVIDIA's Wan 2.2 fit skips about a fraction s of the tiles.

FMHAv2 runs its dense and Skip-Softmax rows at the route's 256-key steps and its reuse rows on the tile-map kernel
(256-key steps of two gathered 128-key tiles). Reuse (``fmha_v2_sage.fmha_v2_sage_attention(..., tile_map=...)``,
``triton_sage.triton_sage_attention(..., tile_map=...)`` at q/k blocks 1/16): a call with a zeroed map
(every tile tested: "sage+reuse first step", FMHAv2's on the 256-key Skip-Softmax kernel that writes the map, as
the route runs a reuse window's first step) leaves the map of the tiles it skipped; "sage+reuse" runs from that
map on the same data,
"sage+reuse drift" ``--steps`` steps of a drift model: before each step a fraction ``--drift`` of the map's set bits
is cleared and as many unset bits are set (decisions that moved between denoising steps), from the map the
previous step left. Each timed call starts from its step's map (a copy: the kernel updates it in place).
"sage+reuse of every tile" runs from a map holding every tile: the kernel computes each query tile's first KV
step only and walks past the rest, so its time less the quantization is what walking the map costs.
"sage+reuse untested" runs from the same map as "sage+reuse" at factor 0, as a reusing step with
``skip_softmax.reuse_test: false`` does: the map's tiles skipped, the others computed with no test (FMHAv2: the
tile-map kernel without Skip-Softmax's test).

"sage+reuse window" and "sage+reuse untested window" are no measurement of their own: the mean step of a reuse
window of ``--window`` reusing steps after its first (``skip_softmax.reuse_steps``), from the first-step row and
the reuse (untested) row, what a pipeline's denoising steps average.

Prints a markdown table (with each kernel's quantization time alone, part of its rows' times), each row as its
case finishes (a line names each case as it starts, so a stalled kernel shows where): ms, speedup vs cuDNN, tiles
skipped (test / reuse) and TFLOP/s of the tiles computed (Q·Kᵀ on the tiles not skipped by reuse, P·V on the
tiles kept).
``--dry-run`` checks the arguments and prints the plan on any machine (no GPU, no FlashInfer build).

    python benchmarks/skip_reuse.py                      # a few minutes on an H200 after the kernels are built
    python benchmarks/skip_reuse.py --seq 16384 --dry-run
"""

import argparse
import math
import pathlib
import sys

A, B = 2822.62, 4.388  # NVIDIA's Wan 2.2 fit: factor = a · exp(b · s)
HEAD_DIM = 128
CASES = ("cudnn", "sage", "sage+reuse of every tile", "sage+skip", "sage+reuse first step", "sage+reuse",
         "sage+reuse untested", "sage+reuse window", "sage+reuse untested window", "sage+reuse drift")
KERNELS = ("fmha_v2", "triton")  # the SAGE fp8 kernels with tile maps, each timed with its own quantization


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=75_600, help="tokens (queries = keys), default Wan 2.2 720p/81f")
    parser.add_argument("--heads", type=int, default=40)
    parser.add_argument("--sparsity", type=float, nargs="+", default=[0.5, 0.65, 0.75],
                        help="target sparsities s (factor a·exp(b·s))")
    parser.add_argument("--drift", type=float, default=0.05,
                        help="fraction of the map's set bits moved to unset ones per step of the drift case")
    parser.add_argument("--steps", type=int, default=3, help="steps of the drift case (>= 1)")
    parser.add_argument("--iters", type=int, default=3, help="timed calls per case and step")
    parser.add_argument("--window", type=int, default=2,
                        help="reusing steps after a window's first for the window rows (skip_softmax.reuse_steps)")
    parser.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS),
                        help="the FMHAv2 SAGE kernels (reuse: tile_map_reuse.patch) and/or the Triton SAGE kernel")
    parser.add_argument("--dry-run", action="store_true", help="check the arguments, print the plan, run nothing")
    args = parser.parse_args(argv)
    if args.seq < 256 or args.heads < 1:
        parser.error(f"--seq must be >= 256 and --heads >= 1; got {args.seq}, {args.heads}")
    if not all(0.0 < s < 1.0 for s in args.sparsity):
        parser.error(f"--sparsity values must lie in (0, 1); got {args.sparsity}")
    if not 0.0 <= args.drift <= 1.0 or args.steps < 1 or args.iters < 1 or args.window < 1:
        parser.error(f"--drift in [0, 1], --steps >= 1, --iters >= 1, --window >= 1; got {args.drift}, {args.steps}, "
                     f"{args.iters}, {args.window}")
    if math.log(args.seq / A) <= 0:
        parser.error(f"--seq {args.seq} is below the fit's a = {A}: the data model needs S > a")
    return args


def zero_fraction(seq: int) -> float:
    """Fraction of tiles at offset 0 in the data model (DESIGN.md §7)."""
    return max(0.0, 1.0 - math.log(seq / A) / B)


def tiles(seq: int, heads: int) -> int:
    """(64 query rows × 128 keys) tiles of one call, the FMHAv2 SAGE kernel's skip tile."""
    return heads * -(-seq // 64) * -(-seq // 128)


def data(seq, heads, offsets, gen):
    """q, k, v ``[seq, heads, 128]`` bf16 on the GPU with ``offsets`` ``[heads, tiles]`` (nats) carried by channel 0."""
    import torch

    q = 0.3 * torch.randn(seq, heads, HEAD_DIM, device="cuda", generator=gen)
    k = 0.3 * torch.randn(seq, heads, HEAD_DIM, device="cuda", generator=gen)
    v = torch.randn(seq, heads, HEAD_DIM, device="cuda", generator=gen)
    q[..., 0] = 1.0
    k[..., 0] = offsets.repeat_interleave(128, dim=1)[:, :seq].T * HEAD_DIM ** 0.5
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def draw_offsets(seq, heads, gen):
    """Offsets per (head, tile) of the data model."""
    import torch

    n = -(-seq // 128)
    return torch.where(torch.rand(heads, n, device="cuda", generator=gen) < zero_fraction(seq), 0.0,
                       -math.log(seq / A) * torch.rand(heads, n, device="cuda", generator=gen))


def drift_map(tile_map, kv_tiles, drift, gen, movable=None):
    """``tile_map`` (int32 words of ``kv_tiles`` tiles) with a fraction ``drift`` of its set bits cleared and as
    many unset bits set, drawn uniformly (with ``gen``, on the map's device) among the tiles ``movable`` (bool, as
    the unpacked map; default all)."""
    import torch

    from diffusers_trtllm.backends.base import pack_tile_map, unpack_tile_map

    tiles = unpack_tile_map(tile_map, kv_tiles).flatten()
    movable = torch.ones_like(tiles) if movable is None else movable.flatten()
    set_at, unset_at = (tiles & movable).nonzero()[:, 0], (~tiles & movable).nonzero()[:, 0]
    moved = min(round(drift * set_at.numel()), unset_at.numel())
    pick = lambda at: at[torch.randperm(at.numel(), device=at.device, generator=gen)[:moved]]
    tiles[pick(set_at)] = False
    tiles[pick(unset_at)] = True
    return pack_tile_map(tiles.view(*tile_map.shape[:-1], kv_tiles), tile_map.shape[-1])


def window_mean(first: tuple, reusing: tuple, steps: int) -> tuple:
    """The mean step (ms, tiles skipped by test, by reuse, tiles of GEMM work) of a reuse window: its first step,
    then ``steps`` reusing steps, each tuple as a row measured them."""
    return tuple((a + steps * b) / (steps + 1) for a, b in zip(first, reusing))


def timed(fn, iters):
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def time_cudnn(q, k, v, scale, iters):
    """Mean ms of cuDNN SDPA (torch's) on packed ``[seq, heads, 128]`` q, k, v: the peer every row is compared with."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        bhsd = [x.transpose(0, 1)[None] for x in (q, k, v)]
        return timed(lambda: torch.nn.functional.scaled_dot_product_attention(*bhsd, scale=scale), iters)


def main(argv=None) -> None:
    args = parse(argv)
    total = tiles(args.seq, args.heads)
    print(f"skip_reuse: {args.seq} tokens × {args.heads} heads × {HEAD_DIM}, {total} tiles of 64 × 128; sparsity "
          f"{args.sparsity} (factors {[round(A * math.exp(B * s)) for s in args.sparsity]}), drift {args.drift} per "
          f"step, {args.steps} steps, {args.iters} timed calls, windows of 1 + {args.window} steps; kernels "
          f"{args.kernels}, cases {list(CASES)}")
    if args.dry_run:
        return
    import torch

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from diffusers_trtllm.backends.base import pack_tile_map
    from diffusers_trtllm.backends.trtllm import FMHA_V2_KV_STEP
    from diffusers_trtllm.kernels import fmha_v2_sage, triton_sage

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        sys.exit("skip_reuse: needs an sm_90 GPU (H100/H200)")
    scale, seq, heads = HEAD_DIM ** -0.5, args.seq, args.heads
    cu = torch.tensor([0, seq], dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    offsets = draw_offsets(seq, heads, gen)
    q, k, v = data(seq, heads, offsets, gen)
    flops_per_tile = 2 * 64 * 128 * HEAD_DIM  # one GEMM of one tile
    shape = fmha_v2_sage.tile_map_shape((seq,), (seq,), heads)
    kv_tiles = -(-seq // 128)
    every_tile = pack_tile_map(torch.ones(shape[:3] + (kv_tiles,), dtype=torch.bool, device="cuda"), shape[-1])

    def starting(case, s="-"):
        print(f"  running {case} at s = {s} ...", file=sys.stderr, flush=True)

    def row(case, s, ms, test, reused, gemm_tiles):
        tflops = gemm_tiles * flops_per_tile / ms / 1e9
        print(f"| {case} | {s} | {ms:.1f} | {cudnn_ms / ms:.2f} | {test / total:.2f} | {reused / total:.2f} | "
              f"{tflops:.0f} |", flush=True)

    def attend(kernel, factor=0.0, tile_map=None, fresh=False):
        """One call of ``kernel`` (quantization included); returns device counts (tested, reused) where it skips
        or reuses, else None. ``fresh``: ``tile_map`` is zeroed (a reuse window's first step)."""
        counting = bool(factor) or tile_map is not None
        if kernel == "fmha_v2":
            counts = torch.zeros(2 if tile_map is not None else 1, dtype=torch.int32, device="cuda")
            # as the route runs them: a map on the tile-map kernel, a zeroed one on the map-writing kernel
            kv_step = FMHA_V2_KV_STEP if tile_map is None else fmha_v2_sage.REUSE_KV_STEP
            fmha_v2_sage.fmha_v2_sage_attention(q, k, v, cu, (seq,), scale, k_block=0, kv_step=kv_step,
                                                skip_factor=factor, skip_counts=counts if counting else None,
                                                tile_map=tile_map, fresh_map=fresh)
            return counts if counting else None
        reused = torch.zeros((), dtype=torch.int32, device="cuda")
        _, tested, _ = triton_sage.triton_sage_attention(
            q, k, v, cu, cu, (seq,), (seq,), scale, dtype_qk="fp8_e4m3", skip_factor=factor, skip_tile=(64, 128),
            count_skips=counting, tile_map=tile_map, reused=reused if tile_map is not None else None)
        return torch.stack([tested.to(torch.int32), reused]) if counting else None

    def quantize(kernel):
        """One quantization of Q, K and V as ``kernel``'s call makes it (part of every SAGE row's time)."""
        if kernel == "fmha_v2":
            fmha_v2_sage.sage_quantize_packed(q, k, v, cu, seq, 0)
        else:
            triton_sage.sage_quantize(q, k, v, cu, cu, seq, seq, dtype_qk="fp8_e4m3", q_block=1, k_block=16)

    def reuse(kernel, factor, entry, fresh=False):
        """(ms, tiles skipped by test, by reuse, the map a call leaves) of calls each from a copy of ``entry``
        (``fresh``: a zeroed one)."""
        tile_map = torch.empty_like(entry)
        counts = []

        def call():
            tile_map.copy_(entry)
            counts.append(attend(kernel, factor, tile_map, fresh))

        ms = timed(call, args.iters)
        return ms, int(counts[-1][0]), int(counts[-1][1]), tile_map.clone()

    starting("cudnn")
    cudnn_ms = time_cudnn(q, k, v, scale, args.iters)
    print("| case | s | ms | × cuDNN | skipped by test | skipped by reuse | TFLOP/s (computed tiles) |")
    print("|---|---|---|---|---|---|---|")
    row("cudnn", "-", cudnn_ms, 0, 0, 2 * total)
    entries = {}  # (kernel, s): the map a reuse step left, where the drift rows start
    for kernel in args.kernels:
        starting(f"{kernel} quantization")
        print(f"| {kernel} quantization (in every row below) | - | {timed(lambda: quantize(kernel), args.iters):.1f} "
              "| - | - | - | - |", flush=True)
        starting(f"{kernel} sage")
        row(f"{kernel} sage", "-", timed(lambda: attend(kernel), args.iters), 0, 0, 2 * total)
        starting(f"{kernel} sage+reuse of every tile")
        ms, test, reused, _ = reuse(kernel, A * math.exp(B * args.sparsity[0]), every_tile)
        row(f"{kernel} sage+reuse of every tile", "-", ms, test, reused, 2 * total - 2 * reused - test)
        for s in args.sparsity:
            factor = A * math.exp(B * s)
            starting(f"{kernel} sage+skip", s)
            counts = []
            ms = timed(lambda: counts.append(attend(kernel, factor)), args.iters)
            skipped = int(counts[-1][0])
            row(f"{kernel} sage+skip", s, ms, skipped, 0, total + (total - skipped))
            # the previous step on the same data: a zeroed map tests every tile and leaves the ones it skipped
            measured = {}
            starting(f"{kernel} sage+reuse first step", s)
            ms, test, reused, entry = reuse(kernel, factor, torch.zeros(shape, dtype=torch.int32, device="cuda"),
                                            fresh=True)
            measured["first step"] = ms, test, reused, 2 * total - 2 * reused - test
            row(f"{kernel} sage+reuse first step", s, *measured["first step"])
            starting(f"{kernel} sage+reuse", s)
            ms, test, reused, entries[kernel, s] = reuse(kernel, factor, entry)
            measured[""] = ms, test, reused, 2 * total - 2 * reused - test
            row(f"{kernel} sage+reuse", s, *measured[""])
            starting(f"{kernel} sage+reuse untested", s)
            ms, test, reused, _ = reuse(kernel, 0.0, entry)
            measured[" untested"] = ms, test, reused, 2 * total - 2 * reused - test
            row(f"{kernel} sage+reuse untested", s, *measured[" untested"])
            for mode in ("", " untested"):
                row(f"{kernel} sage+reuse{mode} window (first + {args.window})", s,
                    *window_mean(measured["first step"], measured[mode], args.window))
    # the drift rows last: a kernel stalling on a drifted map (as a 256-key FMHAv2 one did: RESULTS.md) shows there
    for (kernel, s), entry in entries.items():
        factor, drifted = A * math.exp(B * s), []
        for step in range(args.steps):
            starting(f"{kernel} sage+reuse drift step {step + 1}/{args.steps}", s)
            ms, test, reused, entry = reuse(kernel, factor, drift_map(entry, kv_tiles, args.drift, gen))
            drifted.append((ms, test, reused))
        ms, test, reused = (sum(x) / args.steps for x in zip(*drifted))
        row(f"{kernel} sage+reuse drift {args.drift}", s, ms, test, reused, 2 * total - 2 * reused - test)

if __name__ == "__main__":
    main()

"""Kernel time against sparsity at Wan 2.2's self-attention shape (default 75,600 tokens × 40 heads × 128), one
H100/H200 (sm_90): cuDNN SDPA, FMHAv2 SAGE fp8 dense, SAGE + Skip-Softmax (every tile tested), and SAGE + reuse
(issue 47: the previous step's tile map skips tiles before they are loaded).

Data: the published-curve model of DESIGN.md §7 (each (head, 128-key tile) one logit offset: a fraction
1 − ln(S/a)/b at 0, the rest uniform in [−ln(S/a), 0] nats, over N(0, 0.3²) q and k; one query channel carries the
offset), so that the factor a·exp(b·s) of NVIDIA's Wan 2.2 fit skips about a fraction s of the tiles.

Reuse (the tile-map kernel, ``fmha_v2_sage.fmha_v2_sage_attention(..., tile_map=...)``): a call with a zeroed map
(every tile tested) leaves the map of the tiles it skipped; "sage+reuse" runs from that map on the same data,
"sage+reuse drift" ``--steps`` steps of a drift model: before each step a fraction ``--drift`` of the map's set bits
is cleared and as many unset bits are set (decisions that moved between denoising steps), from the map the
previous step left. Each timed call starts from its step's map (a copy: the kernel updates it in place).

Prints a markdown table: ms, speedup vs cuDNN, tiles skipped (test / reuse) and TFLOP/s of the tiles computed
(Q·Kᵀ on the tiles not skipped by reuse, P·V on the tiles kept; a reused half of a step whose other half a
warpgroup computes still goes through its Q·Kᵀ, so reuse rows count slightly fewer GEMMs than run). ``--dry-run``
checks the arguments and prints the plan on any machine (no GPU, no FlashInfer build).

    python benchmarks/skip_reuse.py                      # < 2 min on an H200 after the SAGE kernels are built
    python benchmarks/skip_reuse.py --seq 16384 --dry-run
"""

import argparse
import math
import pathlib
import sys

A, B = 2822.62, 4.388  # NVIDIA's Wan 2.2 fit: factor = a · exp(b · s)
HEAD_DIM = 128
CASES = ("cudnn", "sage", "sage+skip", "sage+reuse", "sage+reuse drift")


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
    parser.add_argument("--dry-run", action="store_true", help="check the arguments, print the plan, run nothing")
    args = parser.parse_args(argv)
    if args.seq < 256 or args.heads < 1:
        parser.error(f"--seq must be >= 256 and --heads >= 1; got {args.seq}, {args.heads}")
    if not all(0.0 < s < 1.0 for s in args.sparsity):
        parser.error(f"--sparsity values must lie in (0, 1); got {args.sparsity}")
    if not 0.0 <= args.drift <= 1.0 or args.steps < 1 or args.iters < 1:
        parser.error(f"--drift in [0, 1], --steps >= 1, --iters >= 1; got {args.drift}, {args.steps}, {args.iters}")
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


def drift_map(tile_map, kv_tiles, drift, gen):
    """``tile_map`` (int32 words, one sequence's tiles) with a fraction ``drift`` of its set bits cleared and as
    many unset bits set, drawn uniformly."""
    import torch

    from diffusers_trtllm.backends.base import pack_tile_map, unpack_tile_map

    tiles = unpack_tile_map(tile_map, kv_tiles).flatten()
    set_at, unset_at = tiles.nonzero()[:, 0], (~tiles).nonzero()[:, 0]
    moved = min(round(drift * set_at.numel()), unset_at.numel())
    pick = lambda at: at[torch.randperm(at.numel(), device=at.device, generator=gen)[:moved]]
    tiles[pick(set_at)] = False
    tiles[pick(unset_at)] = True
    return pack_tile_map(tiles.view(*tile_map.shape[:-1], kv_tiles), tile_map.shape[-1])


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


def main(argv=None) -> None:
    args = parse(argv)
    total = tiles(args.seq, args.heads)
    print(f"skip_reuse: {args.seq} tokens × {args.heads} heads × {HEAD_DIM}, {total} tiles of 64 × 128; sparsity "
          f"{args.sparsity} (factors {[round(A * math.exp(B * s)) for s in args.sparsity]}), drift {args.drift} per "
          f"step, {args.steps} steps, {args.iters} timed calls; cases {list(CASES)}")
    if args.dry_run:
        return
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from tqdm import tqdm

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from diffusers_trtllm.backends import trtllm
    from diffusers_trtllm.backends.base import KernelPlan, VarlenQKV
    from diffusers_trtllm.config import AttnQuantSpec
    from diffusers_trtllm.kernels import fmha_v2_sage

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        sys.exit("skip_reuse: needs an sm_90 GPU (H100/H200)")
    scale, seq, heads = HEAD_DIM ** -0.5, args.seq, args.heads
    cu = torch.tensor([0, seq], dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    offsets = draw_offsets(seq, heads, gen)
    q, k, v = data(seq, heads, offsets, gen)
    flops_per_tile = 2 * 64 * 128 * HEAD_DIM  # one GEMM of one tile
    rows = []

    def sage(skip_factor=0.0, counts=None, tile_map=None):
        return fmha_v2_sage.fmha_v2_sage_attention(q, k, v, cu, (seq,), scale, k_block=0, skip_factor=skip_factor,
                                                   skip_counts=counts, tile_map=tile_map)

    def reuse(factor, entry):
        """(ms, tiles skipped by test, by reuse, the map a call leaves) of calls each from a copy of ``entry``."""
        counts = torch.zeros(2, dtype=torch.int32, device="cuda")
        tile_map = torch.empty_like(entry)

        def call():
            counts.zero_()
            tile_map.copy_(entry)
            sage(factor, counts, tile_map)

        ms = timed(call, args.iters)
        return ms, int(counts[0]), int(counts[1]), tile_map.clone()

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        bhsd = [x.transpose(0, 1)[None] for x in (q, k, v)]
        cudnn_ms = timed(lambda: torch.nn.functional.scaled_dot_product_attention(*bhsd, scale=scale), args.iters)
    rows.append(("cudnn", "-", cudnn_ms, 0, 0, 2 * total))
    sage_ms = timed(sage, args.iters)
    rows.append(("sage", "-", sage_ms, 0, 0, 2 * total))
    reuse_reason = trtllm.reuse_unavailable_reason(
        KernelPlan("TRTLLM_ATTN", scale, skip_factor=1.0, quant=AttnQuantSpec("fp8_e4m3"), reuse=True),
        VarlenQKV(q, k, v, (seq,), (seq,)))
    shape = fmha_v2_sage.tile_map_shape((seq,), (seq,), heads)
    for s in tqdm(args.sparsity, desc="sparsity", unit="s"):
        factor = A * math.exp(B * s)
        counts = torch.zeros(1, dtype=torch.int32, device="cuda")
        ms = timed(lambda: sage(factor, counts), args.iters)
        skipped = int(counts.item()) // (args.iters + 1)
        rows.append(("sage+skip", s, ms, skipped, 0, total + (total - skipped)))
        if reuse_reason is not None:
            continue
        # the previous step on the same data: a zeroed map tests every tile and leaves the ones it skipped
        _, _, _, entry = reuse(factor, torch.zeros(shape, dtype=torch.int32, device="cuda"))
        ms, test, reused, _ = reuse(factor, entry)
        rows.append(("sage+reuse", s, ms, test, reused, 2 * total - 2 * reused - test))
        drifted = []
        for _ in range(args.steps):
            ms, test, reused, entry = reuse(factor, drift_map(entry, -(-seq // 128), args.drift, gen))
            drifted.append((ms, test, reused))
        ms, test, reused = (sum(x) / args.steps for x in zip(*drifted))
        rows.append((f"sage+reuse drift {args.drift}", s, ms, test, reused, 2 * total - 2 * reused - test))
    print()
    if reuse_reason is not None:
        print(f"sage+reuse not run: {reuse_reason}\n")
    print("| case | s | ms | × cuDNN | skipped by test | skipped by reuse | TFLOP/s (computed tiles) |")
    print("|---|---|---|---|---|---|---|")
    for case, s, ms, test, reuse, gemm_tiles in rows:
        tflops = gemm_tiles * flops_per_tile / ms / 1e9 if ms == ms else float("nan")
        print(f"| {case} | {s} | {ms:.1f} | {cudnn_ms / ms:.2f} | {test / total:.2f} | {reuse / total:.2f} | "
              f"{tflops:.0f} |")


if __name__ == "__main__":
    main()

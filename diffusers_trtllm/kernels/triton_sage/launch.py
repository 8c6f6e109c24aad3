"""How the Triton SAGE attention kernel is launched: tile shape, skip schedules, and where skipping pays.

Skipping runs one of two schedules per run of KV tiles, with bit-identical results: *branching* (a skipped tile's
exps, V load and P·V are not run, but Triton cannot software-pipeline loads inside the branch, so with little to
skip it is the slower one) and *branch-free* (every tile's work issued, a skipped tile's P zeroed, the tile vote
one ``bar.red`` on sm_90: a fixed cost over dense whatever the sparsity). A run after one that skipped few of its
tiles is branch-free, else branching (:func:`skip_launch`). Even branch-free, the vote costs time a head that skips
few of its tiles does not earn back; so by default each head skips only where it pays: a sample of its query
tiles (:func:`skip_sample_rule`) attends first, skipping, in a launch of its own, and the head's other query tiles
skip only if the sample skipped at least :data:`SKIP_PAYS_FROM` of its KV tiles, else they run the dense
launch's code. The reference follows the same rule (``SageSemantics.skip_sample``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionLaunch:
    """Tile shape and schedule of the attention kernel.

    With skipping on, ``block_m × block_n`` is the skip-decision tile and must equal ``plan.tile``; dense runs
    may use any shape (see :data:`DENSE_LAUNCH`).
    """

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3
    # Q·Kᵀ channels (of 128) that sm_90's reduced-precision fp8 accumulator sums before an fp32 add; 128 is the
    # fastest (the default), 32 the closest to fp32 accumulation but it spills registers. int8 accumulates exactly
    # in int32 regardless.
    fp8_qk_chunk: int = 128
    # Skipping visits KV tiles in runs, each on one of two schedules with identical results: branch-free (every
    # tile's exps and P·V issued, a skipped tile's P zeroed; Triton keeps its loads pipelined) after a run that
    # skipped fewer than ``branch_free_below`` of its tiles, else branching (a skipped tile's exps, V load and P·V
    # not run). 0 keeps every run branching, above 1 every run branch-free. Runs start at ``skip_chunk`` tiles and
    # double while the schedule stays.
    skip_chunk: int = 8
    branch_free_below: float = 0.0
    # Skipping only where it pays: every ``skip_sample_every``-th query tile of each (sequence, head) attends first,
    # in a launch of its own, with skipping; the head's other query tiles skip only if those skipped at least
    # ``skip_pays_from`` of their KV tiles, and otherwise attend on the dense kernel (no vote: dense speed, dense
    # results). 0 skips everywhere.
    skip_sample_every: int = 0
    skip_pays_from: float = 0.0


# AttentionLaunch.branch_free_below of skipping (:func:`skip_launch`): a run that skipped little is followed by a
# branch-free one. Of the thresholds timed, this one had the best worst case over sparsities, for fp8 and int8
# (benchmarks/triton_skip_schedules.py, benchmarks/RESULTS.md).
BRANCH_FREE_BELOW = 0.1
# AttentionLaunch.skip_pays_from of skipping, fp8 and int8 alike: a head whose sample skipped less of its tiles
# does not earn back the vote and the launch split in two (timed in alternating pairs, benchmarks/RESULTS.md).
SKIP_PAYS_FROM = 0.30
# The sample launch holds about this many waves of programs (each program a whole query tile against all keys):
# a launch of whole waves costs its share of the work, a last partial wave leaves SMs idle for up to a program's
# time, and a small sample keeps the launch split's cost small when nothing is skipped.
SKIP_SAMPLE_WAVES = 2
# Programs of the 64 × 128 tile an SM holds at once (their shared memory), and the SMs of an H200: without a GPU,
# the reference of the kernel's rule samples as on an H200.
PROGRAMS_PER_SM = 2
H200_SMS = 132

# The fastest dense shape (benchmarks/sage.py): 64 × 128 with one warpgroup per program; 128 × 128 with two needs
# all 255 registers per thread and runs slower.
DENSE_LAUNCH = AttentionLaunch(64, 128, num_warps=4, num_stages=3)


def skip_sample_rule(seqlens_q: tuple[int, ...], heads: int, tile_rows: int,
                     device: torch.device | str) -> tuple[int, float]:
    """``(every, pays_from)`` of the sampled skipping rule for a batch: every ``every``-th query tile of
    ``tile_rows`` rows of each (sequence, head) is the sample, as many per (sequence, head) as fill
    :data:`SKIP_SAMPLE_WAVES` waves of ``device``'s programs (one in two at most); ``pays_from`` is
    :data:`SKIP_PAYS_FROM`."""
    device = torch.device(device)
    on_gpu = device.type == "cuda" and torch.cuda.is_available()
    sms = torch.cuda.get_device_properties(device).multi_processor_count if on_gpu else H200_SMS
    per_head = max(1, SKIP_SAMPLE_WAVES * PROGRAMS_PER_SM * sms // (len(seqlens_q) * heads))
    query_tiles = -(-max(seqlens_q) // tile_rows)
    return max(2, -(-query_tiles // per_head)), SKIP_PAYS_FROM


def skip_launch(tile: tuple[int, int], sample: tuple[int, float]) -> AttentionLaunch:
    """The launch for a skipping plan: the kernel tile is the skip tile, with one warp per 16 query rows (a
    warpgroup per 64), alternating schedules by :data:`BRANCH_FREE_BELOW`, skipping in the heads where it pays
    by ``sample`` (:func:`skip_sample_rule`)."""
    every, pays_from = sample
    return AttentionLaunch(tile[0], tile[1], num_warps=max(1, tile[0] // 16), branch_free_below=BRANCH_FREE_BELOW,
                           skip_sample_every=every, skip_pays_from=pays_from)

"""A model of the FMHAv2 tile-map kernels' synchronization (``tile_map_reuse.patch``), which found the gathered-pair
kernels' stall: one DMA warp, two compute warpgroups of four warps, query tiles of one to four loaded steps, a Q
buffer per warpgroup and K/V slots whose full and empty mbarriers are waited on by parity, the ordered mutex (its
barriers count the four warps), the vote barrier and each GMMA as a four-warp rendezvous, and only warp 0 releasing
a buffer. Random schedules (any warp may lag any time); prints how many of N seeds deadlock, without and with a
warpgroup barrier after the V wait on the steps with no GMMA after it (``fix``), an empty last step releasing Q
before or after that barrier (``q_after_barrier``), with FlashInfer's turns and with the spanning turn. Any
interleaving is allowed, so it finds hazards whatever their odds on a GPU: it flags FlashInfer's own skipped-step
path too.

    python benchmarks/sync_model.py 300

Each warp is a generator of actions; an action is ('wait', predicate) or ('do', effect)."""
import random, sys

class Barrier:  # mbarrier: phase counter, arrivals per phase
    def __init__(self, count): self.count, self.arrived, self.phase = count, 0, 0
    def arrive(self):
        self.arrived += 1
        if self.arrived == self.count: self.arrived, self.phase = 0, self.phase + 1
    def passed(self, parity):  # try_wait.parity: the phase of this parity is complete
        return self.phase % 2 != parity

class Rendezvous:  # bar.sync / GMMA: all n arrive, then all pass; generation counted
    def __init__(self, n): self.n, self.waiting, self.gen = n, 0, 0
    def arrive(self):
        self.waiting += 1
        if self.waiting == self.n: self.waiting, self.gen = 0, self.gen + 1

def simulate(seed, tiles=12, slots=3, fix=False, q_after_barrier=False, spanning=False, p_reuse=0.5, p_vote3=0.3):
    """One random schedule of `tiles` query-tile pairs (1 to 4 loaded steps each, a step's kind drawn per group);
    True where every actor finished. `fix`: a warpgroup barrier after the V wait on GMMA-free steps;
    `q_after_barrier`: an empty turn releases the Q buffer after that barrier (else before its V wait)."""
    rng = random.Random(seed)
    full = [Barrier(1) for _ in range(slots)]      # completes when the TMA lands
    empty = [Barrier(2) for _ in range(slots)]     # thread 0 of each group
    q_full, q_empty = [Barrier(1), Barrier(1)], [Barrier(1), Barrier(1)]  # one Q buffer per group, thread 0 frees it
    mutex = [Barrier(4), Barrier(4)]               # each group's warps arrive
    # per tile pair, its loaded steps' kinds per group: 'reuse' (empty turn), 'skip' (vote skips whole), 'compute';
    # a tile's first step tests nothing
    plan = []
    for _ in range(tiles):
        n = rng.randint(1, 4)
        kinds = [[rng.choices(['reuse', 'skip', 'compute'], [p_reuse, p_vote3, 1 - p_reuse - p_vote3])[0]
                  for _ in range(n)] for _ in range(2)]
        for g in range(2):
            kinds[g][0] = 'compute' if kinds[g][0] == 'skip' else kinds[g][0]
        plan.append(kinds)
    rv = {}  # (group, name) -> Rendezvous
    def rendezvous(g, name):
        return rv.setdefault((g, name), Rendezvous(4))
    landing = []  # barriers whose TMA is in flight
    def dma():
        s = 0
        for t, kinds in enumerate(plan):
            for g in range(2):
                if t > 0:
                    yield ('wait', lambda g=g, t=t: q_empty[g].passed((t - 1) % 2))
                yield ('do', lambda g=g: landing.append(q_full[g]))
            for _ in kinds[0]:
                slot, use = s % slots, s // slots
                if use > 0:
                    yield ('wait', lambda slot=slot, use=use: empty[slot].passed((use - 1) % 2))
                yield ('do', lambda slot=slot: landing.append(full[slot]))
                s += 1
    def warp(g, w):
        other = 1 - g
        mphase = 0  # per-thread mutex phase (waits on the other group's barrier)
        if g == 1:  # WG1 pre-arrives
            yield ('do', lambda: mutex[1].arrive())
        def mwait():
            nonlocal mphase
            p = mphase
            mphase ^= 1
            return ('wait', lambda p=p: mutex[other].passed(p))
        def meet(name):
            r = rendezvous(g, name); gen = r.gen
            yield ('do', r.arrive); yield ('wait', lambda: r.gen > gen)
        def release_q():
            if w == 0:
                yield ('do', lambda: q_empty[g].arrive())
        s = 0
        for t, kinds in enumerate(plan):
            yield ('wait', lambda t=t: q_full[g].passed(t % 2))  # Q wait
            for i, kind in enumerate(kinds[g]):
                slot, use, first, last = s % slots, s // slots, i == 0, i == len(kinds[g]) - 1
                yield ('wait', lambda slot=slot, use=use: full[slot].passed(use % 2))  # K wait (K and V land together here)
                if kind == 'reuse':
                    if spanning:
                        if first: yield mwait()
                        yield ('do', lambda: mutex[g].arrive()); yield mwait()
                    else:
                        yield mwait(); yield ('do', lambda: mutex[g].arrive())
                    if last and not q_after_barrier: yield from release_q()
                    yield ('wait', lambda slot=slot, use=use: full[slot].passed(use % 2))  # V wait
                    if fix: yield from meet(('fix', s))
                    if last and q_after_barrier: yield from release_q()
                else:
                    if not spanning or first: yield mwait()
                    yield from meet(('bmm1', s))
                    if last: yield from release_q()
                    yield ('do', lambda: mutex[g].arrive())
                    if not spanning:
                        yield from meet(('vote', s))
                    yield ('wait', lambda slot=slot, use=use: full[slot].passed(use % 2))  # V wait
                    if kind == 'skip' and not spanning:
                        if fix: yield from meet(('fix', s))
                    else:
                        if spanning: yield mwait()
                        yield from meet(('pv', s))
                if w == 0:
                    yield ('do', lambda slot=slot: empty[slot].arrive())
                s += 1
            if spanning:
                yield ('do', lambda: mutex[g].arrive())
    actors = [dma()] + [warp(g, w) for g in range(2) for w in range(4)]
    pending = [next(a) for a in actors]
    done = [False] * len(actors)
    while True:
        runnable = [i for i, a in enumerate(pending) if not done[i] and (a[0] == 'do' or a[1]())]
        if landing and rng.random() < 0.3 or (not runnable and landing):
            landing.pop(rng.randrange(len(landing))).arrive(); continue
        if not runnable:
            return all(done), plan
        i = rng.choice(runnable)
        kind, f = pending[i]
        if kind == 'do': f()
        try: pending[i] = next(actors[i])
        except StopIteration: done[i] = True

if __name__ == "__main__":
    for label, kw in (("FlashInfer turns", {}), ("FlashInfer turns + fix", {"fix": True}),
                      ("FlashInfer turns + fix + Q after it", {"fix": True, "q_after_barrier": True}),
                      ("spanning turns (no vote)", {"spanning": True}),
                      ("spanning turns + fix + Q after it", {"spanning": True, "fix": True, "q_after_barrier": True})):
        stalls = sum(not simulate(seed, **kw)[0] for seed in range(int(sys.argv[1]) if len(sys.argv) > 1 else 300))
        print(label, "stalled", stalls)

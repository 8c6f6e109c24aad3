"""The contract between plans and kernels: packed inputs, the per-call kernel plan, results, the registry.

Every backend takes one :class:`VarlenQKV` (sequences packed along the token axis, FlashInfer's ragged layout)
and one :class:`KernelPlan`, and returns a :class:`KernelResult`. Backends declare what they support, so that
an explicit choice that cannot run raises with the reason and ``auto`` can pick the best one that can.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from ..config import AttnQuantSpec, env_switch
from ..kernels.numerics import TILE_MAP_BITS, tile_map_shape

DEFAULT_TILE = (128, 128)  # (query rows, key columns) per skip decision: FMHAv2's granularity on Hopper


@functools.lru_cache(maxsize=256)
def device_cu_seqlens(lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``[0, l0, l0 + l1, ...]`` int32 on ``device``, cached per (lengths, device)."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def more_queries_than_keys(seqlens_q, seqlens_kv) -> bool:
    """Some sequence of a batch with these lengths has more queries than keys."""
    return any(n_q > n_kv for n_q, n_kv in zip(seqlens_q, seqlens_kv))


@dataclass
class VarlenQKV:
    """A batch of attention problems packed along the token axis.

    q: ``[total_q, heads_q, head_dim]``; k, v: ``[total_kv, heads_kv, head_dim]`` with ``heads_q % heads_kv == 0``
    (grouped-query attention when they differ). Sequence ``i`` owns rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` of
    q and ``cu_seqlens_kv[i]:cu_seqlens_kv[i+1]`` of k and v. ``seqlens_q`` / ``seqlens_kv`` are the same lengths
    on the host, so planning never waits for the GPU.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    seqlens_q: tuple[int, ...]
    seqlens_kv: tuple[int, ...]

    def __post_init__(self):
        if self.q.dim() != 3 or self.k.dim() != 3 or self.v.dim() != 3:
            raise ValueError(f"q, k, v must be [tokens, heads, head_dim]; got {tuple(self.q.shape)}, "
                             f"{tuple(self.k.shape)}, {tuple(self.v.shape)}")
        if len(self.seqlens_q) != len(self.seqlens_kv):
            raise ValueError(f"{len(self.seqlens_q)} query lengths but {len(self.seqlens_kv)} key lengths")
        if sum(self.seqlens_q) != self.q.shape[0] or sum(self.seqlens_kv) != self.k.shape[0]:
            raise ValueError(f"lengths {self.seqlens_q}/{self.seqlens_kv} do not add up to "
                             f"{self.q.shape[0]}/{self.k.shape[0]} tokens")
        if self.q.shape[1] % self.k.shape[1]:
            raise ValueError(f"query heads {self.q.shape[1]} not a multiple of key heads {self.k.shape[1]}")

    @classmethod
    def from_bshd(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> "VarlenQKV":
        """Pack equal-length ``[batch, seq, heads, head_dim]`` tensors (a view when they are contiguous)."""
        b, sq = q.shape[:2]
        skv = k.shape[1]
        return cls(q.reshape(b * sq, *q.shape[2:]), k.reshape(b * skv, *k.shape[2:]),
                   v.reshape(b * skv, *v.shape[2:]), (sq,) * b, (skv,) * b)

    @property
    def batch_size(self) -> int:
        return len(self.seqlens_q)

    @property
    def max_seqlen_q(self) -> int:
        return max(self.seqlens_q)

    @property
    def max_seqlen_kv(self) -> int:
        return max(self.seqlens_kv)

    @property
    def head_dim(self) -> int:
        return self.q.shape[-1]

    @property
    def has_empty_sequence(self) -> bool:
        """Some sequence has no query or no key."""
        return min(self.seqlens_q + self.seqlens_kv) == 0

    @property
    def more_queries_than_keys(self) -> bool:
        """Some sequence has more queries than keys (:func:`more_queries_than_keys`)."""
        return more_queries_than_keys(self.seqlens_q, self.seqlens_kv)

    @property
    def uniform(self) -> bool:
        """All sequences have the same query length and the same key length."""
        return len(set(self.seqlens_q)) == 1 and len(set(self.seqlens_kv)) == 1

    def cu_seqlens(self, which: str) -> torch.Tensor:
        """Cumulative lengths ``[batch + 1]`` int32 on the tensors' device (``which`` is ``"q"`` or ``"kv"``),
        copied to the device once per distinct batch shape (a copy per call would stall the host)."""
        return device_cu_seqlens(self.seqlens_q if which == "q" else self.seqlens_kv, self.q.device)

    def sequences(self):
        """Yield ``(q_i, k_i, v_i, q_slice)`` per sequence, views into the packed tensors."""
        oq = okv = 0
        for nq, nkv in zip(self.seqlens_q, self.seqlens_kv):
            yield (self.q[oq:oq + nq], self.k[okv:okv + nkv], self.v[okv:okv + nkv], slice(oq, oq + nq))
            oq += nq
            okv += nkv


@dataclass(frozen=True)
class KernelPlan:
    """How one attention call runs: backend, softmax scale, causality, skip factor, SAGE quantization.

    ``skip_factor`` is FlashInfer's ``skip_softmax_threshold_scale_factor``: sequence ``i`` skips with
    λ_i = skip_factor / kv_len_i; 0 disables skipping. ``tile`` is ``(query rows, key columns)`` per skip decision.
    ``count_skips`` asks the backend to count skipped tiles (when it can). ``return_lse`` asks for each query row's
    log-sum-exp (ring attention merges partial results by it); a backend that cannot give it refuses the plan.
    ``reuse`` / ``tile_map``: Skip-Softmax decisions reused across steps (:func:`tile_map_for`).
    """

    backend: str
    scale: float
    causal: bool = False
    skip_factor: float = 0.0
    quant: AttnQuantSpec | None = None
    tile: tuple[int, int] = DEFAULT_TILE
    count_skips: bool = False
    return_lse: bool = False
    #: Skip-Softmax reuse (:func:`tile_map_for`): the backend runs with a tile map, ``tile_map`` when it fits the
    #: call (skipped there without being computed), else a zeroed one (every tile tested)
    reuse: bool = False
    tile_map: torch.Tensor | None = None
    #: ``tile_map`` is zeroed (a reuse window's first step): a backend may test every tile as Skip-Softmax does
    #: without a map and only write it (:attr:`fresh_map`)
    map_zeroed: bool = False

    @property
    def skips(self) -> bool:
        return self.skip_factor > 0.0

    @property
    def fresh_map(self) -> bool:
        """Whether a reuse plan's map holds no tile: zeroed by the caller, or none given (:func:`tile_map_for`
        makes a zeroed one)."""
        return self.reuse and (self.map_zeroed or self.tile_map is None)


@dataclass
class KernelResult:
    """``out`` has q's shape and dtype. ``skipped_tiles`` / ``total_tiles`` count KV tiles (summed over heads and
    query tiles) when the backend counted them, as ints or 0-dim tensors (left on the device to avoid a sync);
    ``None`` when it did not."""

    out: torch.Tensor
    skipped_tiles: int | torch.Tensor | None = None
    total_tiles: int | torch.Tensor | None = None
    #: with ``KernelPlan.return_lse``: float32 ``[total_q, heads_q]``, natural log of each row's sum of
    #: exp(scale · scores) over the keys it kept (``-inf`` for a row that sees no key)
    lse: torch.Tensor | None = None
    #: with ``KernelPlan.reuse``: the tile map the call ran with, updated in place to every tile it skipped, and
    #: the tiles it skipped by reuse (``skipped_tiles`` then counts those skipped by the test only)
    tile_map: torch.Tensor | None = None
    reused_tiles: int | torch.Tensor | None = None


def tile_map_for(plan: KernelPlan, qkv: VarlenQKV, tile: tuple[int, int]) -> torch.Tensor | None:
    """The tile map a backend deciding skips per ``tile`` runs ``plan`` with: None without ``plan.reuse``;
    ``plan.tile_map`` where it has this call's geometry; else a zeroed map (a branch's first step, or a call
    whose kernel tile changed). Layout: bit ``j % 32`` of int32 word ``[b, h, i, j // 32]`` set means KV tile
    ``j`` is skipped for query tile ``i`` of query head ``h`` of sequence ``b`` (tiles counted from each
    sequence's own first row; bits past its tiles are 0). A kernel skips the set tiles without loading or
    multiplying them, tests the others as Skip-Softmax does, and leaves set every tile it skipped."""
    if not plan.reuse:
        return None
    shape = tile_map_shape(qkv.seqlens_q, qkv.seqlens_kv, qkv.q.shape[1], tile)
    given = plan.tile_map
    if given is not None and tuple(given.shape) == shape and given.device == qkv.q.device:
        return given
    return torch.zeros(shape, dtype=torch.int32, device=qkv.q.device)


def unpack_tile_map(words: torch.Tensor, kv_tiles: int) -> torch.Tensor:
    """bool ``[..., kv_tiles]`` of int32 words ``[..., words]`` (:func:`tile_map_for`'s layout)."""
    bits = torch.arange(TILE_MAP_BITS, device=words.device, dtype=torch.int32)
    unpacked = (words[..., None] >> bits) & 1
    return unpacked.flatten(-2)[..., :kv_tiles].bool()


def pack_tile_map(skipped: torch.Tensor, words: int) -> torch.Tensor:
    """int32 words ``[..., words]`` of bool ``[..., kv_tiles]`` (:func:`tile_map_for`'s layout)."""
    padded = torch.nn.functional.pad(skipped.long(), (0, words * TILE_MAP_BITS - skipped.shape[-1]))
    weights = torch.ones(TILE_MAP_BITS, dtype=torch.long, device=skipped.device) << torch.arange(
        TILE_MAP_BITS, device=skipped.device)
    packed = (padded.view(*skipped.shape[:-1], words, TILE_MAP_BITS) * weights).sum(-1)
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)  # bit 31 is the sign bit


class Backend(Protocol):
    """A backend: a name, its capability check and its run function."""

    name: str

    def unavailable_reason(self, plan: KernelPlan, qkv: VarlenQKV) -> str | None:
        """``None`` when this backend can run ``plan`` on ``qkv`` here, else a sentence saying why not."""

    def run(self, qkv: VarlenQKV, plan: KernelPlan) -> KernelResult:
        """Run attention. Shapes and layout: see :class:`VarlenQKV`."""


@dataclass(frozen=True)
class FunctionBackend:
    """A backend made of two functions, registered with :func:`register_backend`."""

    name: str
    check: Callable[[KernelPlan, VarlenQKV], str | None]
    runner: Callable[[VarlenQKV, KernelPlan], KernelResult]
    priority: int = 0  # higher is preferred by ``auto``
    returns_lse: bool = False

    def unavailable_reason(self, plan: KernelPlan, qkv: VarlenQKV) -> str | None:
        return (self.lse_reason() if plan.return_lse else None) or self.check(plan, qkv)

    def lse_reason(self) -> str | None:
        """Why this backend cannot give the log-sum-exp, naming those that can; None when it can."""
        if self.returns_lse:
            return None
        givers = sorted(b.name for b in _REGISTRY.values() if b.returns_lse)
        named = givers[0] + " does" if len(givers) == 1 else ", ".join(givers[:-1]) + f" and {givers[-1]} do"
        return (f"{self.name} does not return the log-sum-exp that ring attention merges partial results by; "
                f"{named}")

    def run(self, qkv: VarlenQKV, plan: KernelPlan) -> KernelResult:
        return self.runner(qkv, plan)


class _Registry(dict):
    """Backends by name; a change (a registration, a test's stand-in) forgets the routes resolved so far."""

    def __setitem__(self, name, backend):
        super().__setitem__(name, backend)
        route_runner.cache_clear()

    def __delitem__(self, name):
        super().__delitem__(name)
        route_runner.cache_clear()


_REGISTRY: dict[str, FunctionBackend] = _Registry()

#: Test seam: with this variable set to 1 when a call site is planned, ``TRTLLM_ATTN`` reports itself available on
#: any device and computes with ``TORCH_REFERENCE``, so integrations (vLLM-Omni's diffusers path) can be tested end
#: to end on a CPU. It is read when a backend is chosen (install, or an unplanned call's first call), never per call.
TRTLLM_ON_REFERENCE_ENV = "DIFFUSERS_TRTLLM_TRTLLM_ATTN_ON_REFERENCE"
#: The route a call planned under the test seam runs: ``TRTLLM_ATTN``'s limits, ``TORCH_REFERENCE``'s arithmetic.
TRTLLM_ON_REFERENCE_ROUTE = "TRTLLM_ATTN@TORCH_REFERENCE"
#: A route is a backend's name, optionally followed by this and one of the backend's kernels chosen at install
#: (``TRTLLM_ATTN+flash_attn4``: Hopper's dense kernel); the backend reads it from ``KernelPlan.backend``.
ROUTE_KERNEL_SEPARATOR = "+"


def register_backend(name: str, runner, check, priority: int = 0, returns_lse: bool = False) -> FunctionBackend:
    """Add a backend to the registry (``priority``: higher is preferred by ``auto``; ``returns_lse``: it fills
    ``KernelResult.lse`` when asked)."""
    backend = FunctionBackend(name, check, runner, priority, returns_lse)
    _REGISTRY[name] = backend
    return backend


def _seam_active() -> bool:
    return env_switch(TRTLLM_ON_REFERENCE_ENV)


def get_backend(name: str) -> FunctionBackend:
    """The backend ``name`` as selection sees it now (the test seam applied)."""
    if name == "TRTLLM_ATTN" and _seam_active():
        return _seam_backend()
    return _REGISTRY[name]


def route_of(name: str) -> str:
    """The kernel route a call site chosen to run on backend ``name`` runs (decided once, when it is planned)."""
    return TRTLLM_ON_REFERENCE_ROUTE if name == "TRTLLM_ATTN" and _seam_active() else name


def backend_for_route(route: str) -> FunctionBackend:
    """The backend that runs a planned route (no environment lookup: the per-call path): the backend it names
    (:data:`ROUTE_KERNEL_SEPARATOR`), or the test seam's."""
    if route == TRTLLM_ON_REFERENCE_ROUTE:
        return _seam_backend()
    return _REGISTRY[route.partition(ROUTE_KERNEL_SEPARATOR)[0]]


@functools.lru_cache(maxsize=None)  # one per route: the per-call path parses no route string
def route_runner(route: str) -> Callable[[VarlenQKV, KernelPlan], KernelResult]:
    """The function that runs a planned route (:func:`backend_for_route`'s ``run``)."""
    return backend_for_route(route).run


def dense_kernel_of(route: str) -> str:
    """The kernel a route names (``"TRTLLM_ATTN+flash_attn4"`` -> ``"flash_attn4"``), "" for none."""
    return route.partition(ROUTE_KERNEL_SEPARATOR)[2]


def _seam_backend() -> FunctionBackend:
    trtllm = _REGISTRY["TRTLLM_ATTN"]
    return FunctionBackend("TRTLLM_ATTN", _simulated_trtllm_reason, _REGISTRY["TORCH_REFERENCE"].runner,
                           trtllm.priority, trtllm.returns_lse)


def _simulated_trtllm_reason(plan: KernelPlan, qkv: VarlenQKV) -> str | None:
    """What the seam keeps of TRTLLM_ATTN's limits on any device: its kernels run non-causal attention only (the
    GPU, dtype and head_dim limits are what the seam lifts)."""
    if plan.causal:
        return "TRTLLM_ATTN runs non-causal attention only (test seam: computed with TORCH_REFERENCE)"
    return None


def registered_backends() -> list[FunctionBackend]:
    """All backends, most preferred first."""
    return sorted((get_backend(name) for name in _REGISTRY), key=lambda b: -b.priority)

"""The way every attention call of this package reaches the attention op, and the ``"trtllm"`` backend of
diffusers' attention dispatcher.

- This package's processors (``WanTrtllmAttnProcessor``...) call :func:`run_attention` with the planned
  :class:`~diffusers_trtllm.plan.AttentionCall` of the role they are computing: the call carries its own settings
  (backend, spec, skip value, counters), so no call depends on another's order, thread or pipeline.
- ``model.set_attention_backend("trtllm")`` (or ``with attention_backend("trtllm"):``) runs any compatible
  diffusers attention (no mask, no dropout; the backend's own limits: head_dim, dtype, GPU) with the default spec
  set by :func:`set_dispatch_config`, this backend's own explicit setting. Incompatible calls raise with the reason.

Context parallelism: under ``enable_parallelism(ContextParallelConfig(...))`` diffusers' own machinery runs around
this package's attention. Ulysses (each rank then sees the whole sequence for its heads, so Skip-Softmax and SAGE
decide exactly as on one GPU); ring and Ulysses × ring, which merge partial results over key chunks by their
log-sum-exp, on a backend that returns it (``TORCH_REFERENCE``; another refuses the call naming it). Under ring,
each key chunk is attended on its own: Skip-Softmax tests a tile against the chunk's running max, SAGE smooths K and
scales K and V per chunk, and the log-sum-exp carries K's smoothing mean back, so chunks merge exactly.
Processors whose ranks hold padding or tokens that every rank holds (HunyuanVideo 1.5's text, Cosmos 3's text keys
and padded generation tokens) pass ``key_masks``: which key tokens of each rank's shard take part, so that padding
is never attended and a token every rank holds is attended once.
"""

from __future__ import annotations

import math

import torch
from diffusers.models import attention_dispatch as diffusers_dispatch
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

from .backends.sdpa import sdpa_attention
from .config import AUTO, TORCH_SDPA, AttentionConfig
from .errors import AttentionConfigError
from .plan import AttentionCall, CallSite
from .run_state import open_run

BACKEND_NAME = "trtllm"


def backend_member() -> AttentionBackendName:
    """``AttentionBackendName`` member ``"trtllm"``, added to diffusers' enum on first use."""
    existing = AttentionBackendName._value2member_map_.get(BACKEND_NAME)
    if existing is not None:
        return existing
    member = str.__new__(AttentionBackendName, BACKEND_NAME)
    member._name_, member._value_ = "TRTLLM", BACKEND_NAME
    AttentionBackendName._member_map_["TRTLLM"] = member
    AttentionBackendName._value2member_map_[BACKEND_NAME] = member
    AttentionBackendName._member_names_.append("TRTLLM")
    return member


#: The calls ``set_attention_backend("trtllm")`` runs, by causality, replaced as a whole by set_dispatch_config.
_DISPATCH_CALLS: dict[bool, AttentionCall] = {}


def set_dispatch_config(config: AttentionConfig | dict | str | None) -> None:
    """The spec ``set_attention_backend("trtllm")`` runs with: the config's ``default`` (per-role keys and the
    timestep gate need this package's processors, which carry their own planned calls)."""
    config = AttentionConfig.coerce(config)
    if config.per_role:
        raise AttentionConfigError(
            f"per_role keys {sorted(config.per_role)} need this package's processors (enable_trtllm_attention); "
            "set_dispatch_config takes a default spec only")
    skip = config.default.skip_softmax
    if skip is not None and (skip.disabled_until_timestep > 0 or skip.target_sparsity is not None
                             or skip.reuse_steps):
        raise AttentionConfigError(
            "skip_softmax.disabled_until_timestep, target_sparsity and reuse_steps need the pipeline's steps, "
            "timestep and calibration (enable_trtllm_attention); set_dispatch_config takes skip_softmax.threshold "
            "only")
    spec = config.default
    if spec.dense_kernel != AUTO:
        raise AttentionConfigError(
            f"dense_kernel={spec.dense_kernel!r} is chosen per call site at install (enable_trtllm_attention); "
            "set_dispatch_config takes dense_kernel 'auto' only")
    _DISPATCH_CALLS.update({causal: AttentionCall.unplanned(CallSite("*", "*", "attention", "*"), spec.backend, causal,
                                                            spec.quant, skip, spec.accuracy)
                            for causal in (False, True)})


set_dispatch_config(None)


def run_attention(call: AttentionCall, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                  scale: float | None = None, valid_lengths: torch.Tensor | None = None,
                  parallel_config=None, return_lse: bool = False, key_masks: torch.Tensor | None = None):
    """One attention call of ``[B, S, H, D]`` tensors as ``call`` plans it (causal or not is the call's role's).
    ``valid_lengths`` (int CPU tensor ``[B]``) restricts each sample to its first tokens (one process only);
    ``parallel_config`` is the processor's diffusers context-parallel config, or None; under it ``key_masks``
    (bool CPU tensor ``[ranks, B, S_kv]``, indexed by the rank of diffusers' flattened (ring, ulysses) mesh) says
    which key tokens of each rank's shard take part (None: all). ``return_lse``: ``(out, lse [B, Sq, Hq])``."""
    if parallel_config is None or parallel_config.context_parallel_config is None:
        return _run(call, query, key, value, scale, valid_lengths, return_lse)
    if valid_lengths is not None:
        raise ValueError("valid_lengths describe one process's sequence; under context parallelism pass key_masks")
    return _context_parallel(call, key_masks, query, key, value, scale, parallel_config, return_lse)


def _run(call: AttentionCall, query, key, value, scale, valid_lengths, return_lse: bool = False):
    """The call's attention (and, with ``return_lse``, each query row's log-sum-exp ``[B, Sq, Hq]``)."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    if (not return_lse and call.backend == TORCH_SDPA and call.planned and valid_lengths is None
            and call.probe is None and call.accuracy is None and not (call.counting and torch.compiler.is_compiling())):
        # TORCH_SDPA's own function outside the op: traced by inductor where nothing is counted; in eager runs a
        # counted call is counted here, on the host (a compiled one goes through the op, which finds its run).
        out = sdpa_attention(query, key, value, scale, call.causal)
        if call.counting:
            run = open_run(call.owner.value)
            if run is not None and run.counting:
                run.count_call(call.index)
        return out
    op = torch.ops.diffusers_trtllm.attention_lse if return_lse else torch.ops.diffusers_trtllm.attention
    return op(query.contiguous(), key.contiguous(), value.contiguous(), valid_lengths, call.settings, call.route,
              scale, call.causal, call.quant_arg, call.per_kv_len, call.tile[0], call.tile[1], call.planned)


def trtllm_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                     scale: float | None = None, enable_gqa: bool = False, return_lse: bool = False,
                     _parallel_config=None) -> torch.Tensor:
    """diffusers backend function: ``[B, S, H, D]`` in and out, with :func:`set_dispatch_config`'s spec."""
    if attn_mask is not None:
        raise ValueError(f"the {BACKEND_NAME!r} attention backend takes no attn_mask (got one shaped "
                         f"{tuple(attn_mask.shape)}); use a backend with masks (e.g. 'native') for this model")
    if dropout_p:
        raise ValueError(f"the {BACKEND_NAME!r} attention backend has no dropout (dropout_p={dropout_p})")
    return run_attention(_DISPATCH_CALLS[bool(is_causal)], query, key, value, scale=scale,
                         parallel_config=_parallel_config, return_lse=return_lse)


def _context_parallel(call, key_masks, query, key, value, scale, parallel_config, return_lse=False):
    cp = parallel_config.context_parallel_config
    if key_masks is not None and (cp.ring_anything or cp.ulysses_anything):
        raise ValueError("ring_anything / ulysses_anything split sequences unevenly, which this model's key masks "
                         "do not describe; use ContextParallelConfig(ring_degree=..., ulysses_degree=...) alone")
    # diffusers' ring calls forward_op once per key chunk, its own first, then ring rank r + 1, r + 2, ...; each
    # chunk is the shards of that ring rank's Ulysses group, concatenated in Ulysses order (mesh (ring, ulysses))
    chunks = iter(range(cp.ring_degree))

    def forward_op(ctx, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                   return_lse=False, _save_ctx=True, _parallel_config=None):
        if key_masks is None:
            return _run(call, q, k, v, scale, None, return_lse)
        step = next(chunks)
        ring_rank = (cp._ring_local_rank + step) % cp.ring_degree
        shards = key_masks[ring_rank * cp.ulysses_degree:(ring_rank + 1) * cp.ulysses_degree]
        return _run_masked_keys(call, q, k, v, scale, shards.transpose(0, 1).flatten(1), return_lse, step == 0)

    def backward_op(*args, **kwargs):
        raise NotImplementedError(f"the {BACKEND_NAME!r} attention backend has no backward under context parallelism")

    # Grouped-query heads: the op takes fewer key/value heads itself, so diffusers' enable_gqa (which its templates
    # refuse) stays False; ring passes them as they are, but Ulysses' all-to-all splits K and V by the query heads'
    # count, so they travel expanded to the query heads there
    if cp.ulysses_degree > 1 and key.shape[2] != query.shape[2]:
        key, value = (x.repeat_interleave(query.shape[2] // key.shape[2], dim=2) for x in (key, value))
    return diffusers_dispatch._templated_context_parallel_attention(
        query, key, value, None, 0.0, call.causal, scale, False, return_lse, forward_op=forward_op,
        backward_op=backward_op, _parallel_config=parallel_config)


def _run_masked_keys(call, q, k, v, scale, keep: torch.Tensor, return_lse: bool, first_chunk: bool):
    """Attention of every query to the keys ``keep`` ``[B, S_kv]`` marks: one call when the samples keep the same
    keys, else one per sample. A sample keeping no key of a later ring chunk gives 0 with log-sum-exp -inf, which
    the ring merge ignores; its first chunk (the merge's start) must keep one."""
    if bool(keep.all()):
        return _run(call, q, k, v, scale, None, return_lse)
    groups = [(slice(None), keep[0])] if bool((keep == keep[:1]).all()) else \
        [(slice(b, b + 1), keep[b]) for b in range(keep.shape[0])]
    outs, lses = [], []
    for rows, kept in groups:
        index = kept.nonzero()[:, 0].to(k.device)
        if index.numel() == 0:
            if first_chunk:
                raise ValueError(
                    "a rank's own key shard holds no real key of a sample (the sequence is too short for this many "
                    "ranks); use fewer ranks (ring_degree × ulysses_degree)")
            outs.append(q[rows].new_zeros(q[rows].shape))
            lses.append(torch.full(q[rows].shape[:3], -math.inf, device=q.device))
            continue
        out, lse = _run(call, q[rows], k[rows].index_select(1, index), v[rows].index_select(1, index), scale, None,
                        True)
        outs.append(out)
        lses.append(lse)
    out = torch.cat(outs)
    return (out, torch.cat(lses)) if return_lse else out


def register_dispatch_backend() -> AttentionBackendName:
    """Register ``"trtllm"`` with diffusers' dispatcher (idempotent) and return its enum member."""
    member = backend_member()
    if member not in _AttentionBackendRegistry._backends:
        _AttentionBackendRegistry.register(member, constraints=[], supports_context_parallel=True)(trtllm_attention)
    return member


BACKEND = register_dispatch_backend()

"""Attention as one opaque ``torch.library`` op, so ``torch.compile`` traces a transformer without looking inside.

``torch.ops.diffusers_trtllm.attention`` runs any registered backend (FlashInfer's TRT-LLM kernels, the Triton
SAGE kernel, the PyTorch reference). Dynamo sees one op with a fake implementation (output shaped like q); it
never traces the Triton kernel, FlashInfer's Python, the reference's tile loop, the probe or the run lookup.

What changes during a run never reaches the traced graph as Python state, so it never forces a recompile: the op
finds, in its body, the open run of its handle in the calling thread or task (the run key in its ``settings``;
see :mod:`~diffusers_trtllm.run_state`) and reads its site's row of that run's settings (one host read of a CPU
tensor, never a device sync):

- ``[SKIP]``: 0 runs without skipping; otherwise FlashInfer's threshold scale factor, or λ when ``per_kv_len``
  (the factor is then λ · the longest key length of the call);
- ``[SAGE]``: 1 runs the ``quant`` argument's SAGE, 0 runs dense (the SAGE step schedule, the guard);
- ``[PROBE]``: query rows the accuracy probe checks in this step (0: not probed).

Outside any run (the unbound processors, the ``"trtllm"`` dispatcher backend, a call no run reaches) it reads the
``settings`` argument instead. When the run counts, the op adds the call's tile counts (and the probe's
``[Σ error², Σ exact²]``) to the run's counters on the device. Autograd (a dense, straight-through backward) and
``torch.export`` take it.

``valid_lengths``: an int CPU tensor of each sample's valid prefix (HunyuanVideo's padded text), read on the host
once per transformer call by the processor's pre-hook, or None.
"""

from __future__ import annotations

import functools
import json
import math

import torch

from .accuracy import probe_error_sums
from .backends import masked_dense_attention, planned_route, run_backend, select_backend
from .backends.base import KernelPlan, VarlenQKV, backend_for_route
from .config import AttnQuantSpec
from .errors import BackendUnavailableError, warn_once
from .run_state import OWNER, REUSE_FRESH, REUSE_KEEP, SETTINGS, SITE, open_run


def encode_quant(quant: AttnQuantSpec | None) -> str:
    """The op's ``quant`` argument: the kernel's fields as a JSON object, or "" for no SAGE (a string is a constant
    in a traced graph; the step schedule reaches the op through the run's ``[SAGE]`` setting)."""
    if quant is None:
        return ""
    kernel = {name: getattr(quant, name) for name in ("dtype_qk", "q_block_size", "k_block_size")}
    return json.dumps(kernel, sort_keys=True)


@functools.lru_cache(maxsize=None)
def decode_quant(text: str) -> AttnQuantSpec | None:
    return AttnQuantSpec.from_dict(json.loads(text)) if text else None


def _outside_a_run(owner: int) -> None:
    """Say once per handle that an installed call ran outside any run (nothing of it is counted)."""
    warn_once("diffusers_trtllm: attention ran outside any run, so handle.stats does not count it and a timestep "
              "gate keeps Skip-Softmax and the SAGE schedule as at no timestep. A transformer compiled whole skips "
              "the pre-hook that starts a bare transformer's runs: compile it per block (compile_repeated_blocks), "
              "or call it inside transformer.cache_context(...)", key=("outside a run", owner))


def _attend(q, k, v, valid_lengths, settings, backend, scale, causal, quant, per_kv_len, tile_q, tile_kv, planned,
            return_lse: bool):
    """The ops' body: (output shaped like q, log-sum-exp ``[B, Sq, Hq]`` float32 or None)."""
    own = settings.tolist()
    site, owner = int(own[SITE]), int(own[OWNER])
    run = open_run(owner)
    if run is None and owner:
        _outside_a_run(owner)
    value, sage, probe_rows, reuse_mode = run.settings[site].tolist() if run is not None else own[:SETTINGS]
    qkv, rows = packed_problem(q, k, v, valid_lengths)
    if run is not None and run.probing[site]:
        call = run.calls[site]
        call.probe(call.site, qkv, scale=scale, causal=causal, tile=(tile_q, tile_kv), step=run.step)
        value = 0.0
    tile_map = None
    reuse = bool(reuse_mode and value and run is not None)  # a run owns the maps; outside one none is reused
    if reuse:
        lengths = (qkv.seqlens_q, qkv.seqlens_kv)
        branch, tile_map = run.tile_map(site, lengths)
        if tile_map is not None and reuse_mode == REUSE_FRESH:
            tile_map.zero_()
    if not planned:
        backend = unplanned_backend(backend, qkv, causal, value, quant)
    factor = value * qkv.max_seqlen_kv if per_kv_len else value
    if reuse and reuse_mode == REUSE_KEEP and not run.calls[site].reuse_tests:
        factor = 0.0  # the map's tiles are skipped, the others computed untested (the kernels' own rule at 0)
    counting = run is not None and run.counting
    if return_lse and (reason := backend_for_route(backend).lse_reason()):
        raise BackendUnavailableError(reason)
    plan = KernelPlan(backend=backend, scale=scale, causal=causal, skip_factor=factor,
                      quant=decode_quant(quant) if sage else None, tile=(tile_q, tile_kv), count_skips=counting,
                      return_lse=return_lse, reuse=reuse, tile_map=tile_map,
                      map_zeroed=tile_map is not None and reuse_mode == REUSE_FRESH)
    result = run_backend(backend, qkv, plan)
    if reuse:
        run.keep_tile_map(site, branch, lengths, result.tile_map)
    if counting:
        run.count_call(site, result.skipped_tiles, result.total_tiles, result.reused_tiles)
        if probe_rows:
            run.error_sums[site] += probe_error_sums(qkv, result.out, int(probe_rows), scale, causal)
    if rows is None:
        return result.out.view(q.shape), (result.lse.view(q.shape[:3]) if return_lse else None)
    out = q.new_zeros(q.shape).flatten(0, 1).index_copy_(0, rows, result.out).view(q.shape)
    if not return_lse:
        return out, None
    lse = result.lse.new_full((q.shape[0] * q.shape[1], q.shape[2]), -math.inf).index_copy_(0, rows, result.lse)
    return out, lse.view(q.shape[:3])


@torch.library.custom_op("diffusers_trtllm::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid_lengths: torch.Tensor | None,
              settings: torch.Tensor, backend: str, scale: float, causal: bool, quant: str, per_kv_len: bool,
              tile_q: int, tile_kv: int, planned: bool) -> torch.Tensor:
    """Attention of q ``[B, Sq, Hq, D]`` on k/v ``[B, Skv, Hkv, D]``, shaped and typed like q.

    ``valid_lengths`` (int CPU tensor ``[B]``, self-attention only): sample ``b`` attends among its first
    ``valid_lengths[b]`` tokens only (HunyuanVideo's joint sequence with padded text); the other rows are 0.
    ``settings`` (float64 CPU ``[5]``, the call's own): what runs outside a run, then its handle's run key and its
    site index; inside that handle's open run in this thread or task, the run's row for the site runs (module
    docstring). ``backend`` names the kernel route (a registered backend, resolved at install). ``planned``: the
    backend was chosen for this call site at install; otherwise it is checked (explicit) or chosen (``auto``)
    here, once per kind of call.
    """
    return _attend(q, k, v, valid_lengths, settings, backend, scale, causal, quant, per_kv_len, tile_q, tile_kv,
                   planned, return_lse=False)[0]


@torch.library.custom_op("diffusers_trtllm::attention_lse", mutates_args=())
def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid_lengths: torch.Tensor | None,
                  settings: torch.Tensor, backend: str, scale: float, causal: bool, quant: str, per_kv_len: bool,
                  tile_q: int, tile_kv: int, planned: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention` and each query row's log-sum-exp, float32 ``[B, Sq, Hq]`` (natural log of its sum of
    exp(scale · scores) over the keys it kept; ``-inf`` for a row that sees no key): what ring attention merges
    partial results by. Refused by a backend that cannot give it."""
    return _attend(q, k, v, valid_lengths, settings, backend, scale, causal, quant, per_kv_len, tile_q, tile_kv,
                   planned, return_lse=True)


@attention.register_fake
def _(q, k, v, valid_lengths, settings, backend, scale, causal, quant, per_kv_len, tile_q, tile_kv, planned):
    return torch.empty_like(q)


@attention_lse.register_fake
def _(q, k, v, valid_lengths, settings, backend, scale, causal, quant, per_kv_len, tile_q, tile_kv, planned):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


def _setup_backward(ctx, inputs, output) -> None:
    q, k, v, valid_lengths = inputs[:4]
    ctx.scale, ctx.causal = inputs[6], inputs[7]
    ctx.valid_lengths = valid_lengths
    ctx.save_for_backward(q, k, v)


def _backward(ctx, grad_out):
    """Dense attention's gradient, recomputed with SDPA: straight-through for Skip-Softmax and SAGE (what they
    approximate), and exact for dense backends. For fine-tuning and tests; inference never calls it."""
    q, k, v = ctx.saved_tensors
    with torch.enable_grad():
        inputs = [x.detach().requires_grad_() for x in (q, k, v)]
        out = masked_dense_attention(*inputs, ctx.valid_lengths, ctx.scale, ctx.causal)
        grads = torch.autograd.grad(out, inputs, grad_out)
    return (*grads,) + (None,) * 10


attention.register_autograd(_backward, setup_context=_setup_backward)


def packed_problem(q, k, v, valid_lengths) -> tuple[VarlenQKV, torch.Tensor | None]:
    """The batch as one packed problem, and the rows of ``[B * S]`` it holds (None when all rows are valid)."""
    batch, seq_len = q.shape[:2]
    lengths = tuple(valid_lengths.tolist()) if valid_lengths is not None else ()
    if all(n == seq_len for n in lengths):
        return VarlenQKV.from_bshd(q, k, v), None
    rows = packed_rows(lengths, seq_len, q.device)
    packed = (x.flatten(0, 1).index_select(0, rows) for x in (q, k, v))
    return VarlenQKV(*packed, lengths, lengths), rows


@functools.lru_cache(maxsize=64)
def packed_rows(lengths: tuple[int, ...], seq_len: int, device: torch.device) -> torch.Tensor:
    """Row indices of each sample's first ``lengths[b]`` tokens in a flattened ``[B * seq_len]`` batch, cached
    per shape (built on the host and copied once)."""
    rows = [b * seq_len + i for b, n in enumerate(lengths) for i in range(n)]
    return torch.tensor(rows, dtype=torch.long, device=device)


_UNPLANNED_CACHE_SIZE = 256
_UNPLANNED_CHOICES: dict[tuple, str] = {}


def unplanned_backend(requested: str, qkv: VarlenQKV, causal: bool, skip_value: float, quant: str) -> str:
    """The backend of a call not planned at install (``set_attention_backend("trtllm")``, the processors' unbound
    form), chosen once per kind of call: an explicit one that cannot run raises with its reason; ``auto`` that
    drops a feature warns once per reason (not once per shape). TRTLLM_ATTN's dense kernel on Hopper is
    ``auto``'s (:func:`~.backends.planned_route`)."""
    # what the backends' checks read of the lengths: an empty sequence, more queries than keys (SAGE kernels)
    lengths = (qkv.has_empty_sequence, qkv.more_queries_than_keys)
    key = (requested, qkv.q.device, qkv.q.dtype, qkv.head_dim, qkv.q.shape[1], qkv.k.shape[1], causal,
           bool(skip_value), quant, lengths)
    if key not in _UNPLANNED_CHOICES:
        plan = KernelPlan(backend=requested, scale=1.0, causal=causal, skip_factor=float(bool(skip_value)),
                          quant=decode_quant(quant))
        choice = select_backend(requested, plan, qkv)
        if choice.dropped:
            warn_once(f"diffusers_trtllm: auto runs attention dense on {qkv.q.device}: {choice.dropped}",
                      key=("unplanned", requested, choice.dropped))
        if len(_UNPLANNED_CHOICES) >= _UNPLANNED_CACHE_SIZE:
            _UNPLANNED_CHOICES.pop(next(iter(_UNPLANNED_CHOICES)))  # bounded: drop the oldest kind
        _UNPLANNED_CHOICES[key] = planned_route(choice, qkv.q.device)
    return _UNPLANNED_CHOICES[key]

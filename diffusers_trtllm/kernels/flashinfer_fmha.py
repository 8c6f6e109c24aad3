"""Running FlashInfer's TRT-LLM attention kernels: import, workspace, JIT build and cubin loading, execution.

What each call passes is decided in :mod:`.flashinfer_calls`; this module owns the state around the calls:

- one zero-initialised workspace buffer per CUDA stream, allocated on first use and reused by every call on that
  stream (kernels on two streams never share scratch memory); at most :data:`WORKSPACES_PER_DEVICE` are kept per
  device, the least recently used released first, and :func:`release_workspaces` frees them all;
- the ragged index (cumulative lengths) per distinct batch layout, cached so repeated layers copy nothing;
- Hopper's FMHAv2 JIT build (about 90 s on 16 cores on first use; FlashInfer caches the build under
  ``$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer`` (default ``~/.cache/flashinfer``), so it happens once per
  machine) — logged on the ``diffusers_trtllm`` logger, and triggered ahead of time by :func:`warmup`;
- Blackwell's trtllm-gen cubins, downloaded by FlashInfer on first use: a failed download is re-raised as
  :class:`CubinUnavailableError`, which says how to provide them offline.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections import OrderedDict

import torch

from .flashinfer_calls import (LN2, RaggedIndex, SageScales, build_ragged_index, fmha_v2_call, fmha_v2_layout,
                               fmha_v2_stats_lse, sage_quantize_call, trtllm_gen_call)
from .numerics import smoothing_lse_shift

logger = logging.getLogger("diffusers_trtllm")

WORKSPACE_BYTES = 256 * 1024 * 1024  # FlashInfer's own DiT tests use this size for the trtllm-gen kernels
# Streams per device whose workspace stays allocated: a pipeline uses one, a server a few; beyond that the least
# recently used stream's buffer goes back to PyTorch's allocator (and is zeroed anew if that stream returns).
WORKSPACES_PER_DEVICE = 4

_ready_fmha_v2: set[tuple[torch.device, torch.dtype, str]] = set()  # (device, dtype, FMHAv2 input layout)


class CubinUnavailableError(RuntimeError):
    """FlashInfer could not load the trtllm-gen kernel binaries (cubins) it downloads on first use."""


@functools.lru_cache(maxsize=None)
def flashinfer_prefill():
    """``flashinfer.prefill``, imported once (raises ``ImportError`` when FlashInfer is missing or broken)."""
    import flashinfer.prefill

    return flashinfer.prefill


class StreamWorkspaces:
    """Workspace buffers by (device, stream), at most ``per_device`` per device, least recently used released
    first. Releasing is safe while a kernel still uses the buffer: it was allocated on its own stream, so
    PyTorch's caching allocator hands the memory out again only to work ordered after that kernel."""

    def __init__(self, per_device: int):
        if per_device < 1:
            raise ValueError(f"per_device must be >= 1 (one workspace per stream in use); got {per_device!r}")
        self.per_device = per_device
        self._buffers: OrderedDict[tuple[torch.device, int], torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()  # pipelines in several threads share the cache

    def get(self, device: torch.device, stream: int) -> torch.Tensor:
        key = (device, stream)
        with self._lock:
            buf = self._buffers.get(key)
            if buf is not None:
                self._buffers.move_to_end(key)
                return buf
            on_device = [k for k in self._buffers if k[0] == device]
            for old in on_device[:max(0, len(on_device) + 1 - self.per_device)]:
                logger.debug("releasing the FlashInfer workspace of stream %#x on %s (more than %d streams)",
                             old[1], device, self.per_device)
                del self._buffers[old]
            buf = self._buffers[key] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            return buf

    def release(self, device: torch.device | None = None) -> int:
        with self._lock:
            keys = [k for k in self._buffers if device is None or k[0] == device]
            for key in keys:
                del self._buffers[key]
            return len(keys)


_workspaces = StreamWorkspaces(WORKSPACES_PER_DEVICE)


def workspace(device: torch.device | str) -> torch.Tensor:
    """The workspace buffer (``WORKSPACE_BYTES`` of uint8, zeroed when allocated) of the device's current stream:
    calls on one stream run in order and share it; a pipeline on another stream gets its own."""
    device = _canonical(device)
    return _workspaces.get(device, _stream_id(device))


def release_workspaces(device: torch.device | str | None = None) -> int:
    """Free the cached workspace buffers (of ``device``, or of every device) and return how many were held.

    The memory goes back to PyTorch's caching allocator (``torch.cuda.empty_cache()`` then returns it to the
    driver); the next TRTLLM_ATTN call on a stream allocates and zeroes a new buffer."""
    return _workspaces.release(None if device is None else _canonical(device))


def _stream_id(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


@functools.lru_cache(maxsize=256)
def ragged_index(seqlens_q: tuple[int, ...], seqlens_kv: tuple[int, ...], device: torch.device) -> RaggedIndex:
    """Cached :func:`~.flashinfer_calls.build_ragged_index`: a pipeline repeats a few layouts in every layer."""
    return build_ragged_index(seqlens_q, seqlens_kv, device)


def _canonical(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


# --------------------------------------------------------------------------------------------------- Hopper


def fmha_v2_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens_q: tuple[int, ...],
                      seqlens_kv: tuple[int, ...], scale: float, skip_factor: float = 0.0,
                      return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Dense or Skip-Softmax attention on Hopper (sm_90) through FMHAv2, the whole batch in one call.

    ``q`` ``[total_q, Hq, 128]``, ``k``/``v`` ``[total_kv, Hkv, 128]`` bf16, ragged (sequence ``i`` owns
    ``seqlens_q[i]`` query rows and ``seqlens_kv[i]`` key rows, in order; host ints). Made contiguous (a no-op
    when they are; FMHAv2 ignores strides). ``skip_factor`` > 0 skips with λ_i = skip_factor / kv_len_i. Returns
    ``[total_q, Hq, 128]`` in q's dtype. A sequence with fewer queries than keys (Cosmos 3's generation stream on
    text + generation keys) is given zero queries up to its key length, because FMHAv2 0.7.2 computes wrong
    results for such sequences and right ones for equal lengths; the padded rows' outputs are dropped. They cost
    ``(kv_len - q_len) / q_len`` more work, and can keep the sequence's last query tile from skipping.
    ``return_lse``: returns ``(out, lse)``, ``lse`` ``[total_q, Hq]`` float32, each row's natural log-sum-exp of
    its scaled scores over the keys it kept (:func:`~.flashinfer_calls.fmha_v2_stats_lse`).
    """
    device = _canonical(q.device)
    layout = fmha_v2_layout(return_lse)
    if (device, q.dtype, layout) not in _ready_fmha_v2:
        _prepare_fmha_v2(device, q.dtype, layout)
    padded = any(nq < nkv for nq, nkv in zip(seqlens_q, seqlens_kv))
    run_q, run_lens = pad_queries_to_keys(q, seqlens_q, seqlens_kv) if padded else (q, tuple(seqlens_q))
    index = ragged_index(run_lens, tuple(seqlens_kv), device)
    result = fmha_v2_call(run_q.contiguous(), k.contiguous(), v.contiguous(), workspace(device), index, scale,
                          skip_factor, return_lse)(flashinfer_prefill())
    outputs = (result[0], fmha_v2_stats_lse(result[1], scale, q.shape[-1])) if return_lse else (result,)
    if padded:  # the zero queries' rows (of the output and of the statistics) are dropped alike
        outputs = tuple(drop_padded_queries(x, seqlens_q, run_lens) for x in outputs)
    return outputs if return_lse else outputs[0]


def pad_queries_to_keys(q: torch.Tensor, seqlens_q: tuple[int, ...],
                        seqlens_kv: tuple[int, ...]) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``q`` with each sequence's queries zero-padded to at least its key length, and the new query lengths."""
    pieces, lengths, start = [], [], 0
    for nq, nkv in zip(seqlens_q, seqlens_kv):
        piece = q[start:start + nq]
        start += nq
        missing = max(nkv - nq, 0)
        pieces += [piece, piece.new_zeros(missing, *piece.shape[1:])] if missing else [piece]
        lengths.append(nq + missing)
    return torch.cat(pieces), tuple(lengths)


def drop_padded_queries(out: torch.Tensor, seqlens_q: tuple[int, ...], run_lens: tuple[int, ...]) -> torch.Tensor:
    """The rows of ``out`` that belong to real queries, where each sequence's rows run to ``run_lens`` (zero
    queries after the real ones, as :func:`pad_queries_to_keys` and the FMHAv2 SAGE kernel lay them out): a view
    for one sequence, else one gather. The row offsets come from the host lengths, so nothing is
    read back from the device."""
    if len(seqlens_q) == 1:
        return out[:seqlens_q[0]]
    pieces, start = [], 0
    for nq, run in zip(seqlens_q, run_lens):
        pieces.append(out[start:start + nq])
        start += run
    return torch.cat(pieces)


def _prepare_fmha_v2(device: torch.device, dtype: torch.dtype, layout: str) -> None:
    """Build (or load) FlashInfer's FMHAv2 module for ``dtype`` and input ``layout`` and say so: the first build
    takes minutes."""
    prefill = flashinfer_prefill()
    built_dir, cached = _fmha_v2_build_state(dtype, layout)
    if cached:
        logger.info("loading FlashInfer FMHAv2 (%s, %s) from its JIT cache %s", layout, dtype, built_dir)
    else:
        logger.warning(
            "building FlashInfer's TRT-LLM FMHAv2 kernels (%s, %s, sm_90) with nvcc into %s: about 90 s on 16 cores "
            "(MAX_JOBS=%s), once per machine; set FLASHINFER_WORKSPACE_BASE to move the cache, call "
            "diffusers_trtllm.backends.trtllm.warmup() to do it ahead of time", layout, dtype,
            built_dir or "FlashInfer's JIT cache", os.environ.get("MAX_JOBS", "unset"))
    start = time.perf_counter()
    with torch.cuda.device(device):
        prefill.get_trtllm_fmha_v2_module(layout, dtype)
    if not cached:
        logger.warning("FlashInfer FMHAv2 (%s, %s) ready after %.1f s", layout, dtype,
                       time.perf_counter() - start)
    _ready_fmha_v2.add((device, dtype, layout))


def _fmha_v2_build_state(dtype: torch.dtype, layout: str) -> tuple[str | None, bool]:
    """``(build folder, already built)`` of FlashInfer's FMHAv2 JIT module, read through FlashInfer's own spec.
    Internal FlashInfer API: when it moves, report ``(None, False)`` (the build then just logs less precisely)."""
    try:
        from flashinfer.jit.attention import gen_fmha_v2_module

        spec = gen_fmha_v2_module(layout, dtype)
        return str(spec.build_dir), bool(spec.is_compiled)
    except Exception as exc:  # noqa: BLE001 - logging only
        logger.debug("could not inspect FlashInfer's FMHAv2 JIT cache: %r", exc)
        return None, False


# ------------------------------------------------------------------------------------------------ Blackwell


def trtllm_gen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens_q: tuple[int, ...],
                         seqlens_kv: tuple[int, ...], scale: float, skip_factor: float = 0.0, *,
                         sage: tuple[str, int, int] | None = None,
                         return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Dense, Skip-Softmax or SAGE attention on datacenter Blackwell (sm_100, sm_103) through trtllm-gen, one
    call per batch.

    ``q`` ``[total_q, Hq, 128]``, ``k``/``v`` ``[total_kv, Hkv, 128]`` bf16, ragged as :func:`fmha_v2_attention`.
    ``sage``: ``(dtype_qk, q_block, k_block)`` runs FlashInfer's SAGE quantizer first (K's mean and V's scales over
    the whole packed batch), then attention on the quantized tensors. Returns ``[total_q, Hq, 128]`` bf16; with
    ``return_lse`` ``(out, lse)``, ``lse`` ``[total_q, Hq]`` float32, natural log, with SAGE the smoothing's shift
    ``scale · q · mean(K)`` (the quantizer's batch-wide mean) added back. Not run on a GPU yet (no sm_100 here).
    """
    prefill = flashinfer_prefill()
    device = _canonical(q.device)
    index = ragged_index(tuple(seqlens_q), tuple(seqlens_kv), device)
    q, k, v = (t.contiguous() for t in (q, k, v))
    scales = k_mean = None
    with _explain_missing_cubins():
        if sage is not None:
            dtype_qk, q_block, k_block = sage
            q_in = q
            q, k, v, q_scale, k_scale, v_scale, k_mean = sage_quantize_call(
                q, k, v, index, dtype_qk, q_block, k_block)(prefill)
            scales = SageScales(q_scale, k_scale, v_scale, q_block, k_block)
        result = trtllm_gen_call(q, k, v, workspace(device), index, scale, skip_factor, scales,
                                 return_lse)(prefill)
    if not return_lse:
        return result
    out, lse = result
    lse = lse * LN2
    return out, lse if k_mean is None else lse + smoothing_lse_shift(q_in, k_mean, scale)


# FlashInfer's own wording when a cubin or its checksum list cannot be had (jit/cubin_loader.py, jit/attention/
# modules.py): anything else is a different failure and passes through unchanged.
_CUBIN_FAILURE_MARKERS = ("failed to get checksums.txt", "invalid checksums.txt", "artifact not found locally",
                          "refusing to download", "max retries reached. download failed")


def is_cubin_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is FlashInfer failing to obtain trtllm-gen cubins (no network, no local copy)."""
    if any(marker in str(exc).lower() for marker in _CUBIN_FAILURE_MARKERS):
        return True
    return isinstance(exc, OSError) and type(exc).__module__.split(".")[0] in ("requests", "urllib3")


@contextlib.contextmanager
def _explain_missing_cubins():
    """Re-raise a failed cubin download as :class:`CubinUnavailableError` with the offline remedies."""
    try:
        yield
    except (AssertionError, RuntimeError, ValueError, OSError) as exc:
        if is_cubin_failure(exc):
            raise CubinUnavailableError(missing_cubins_message(exc)) from exc
        raise


def missing_cubins_message(exc: BaseException) -> str:
    """The error a user sees when trtllm-gen cubins could not be loaded (no network, no local copy)."""
    try:
        import flashinfer
        from flashinfer.jit import env as jit_env

        cubin_dir, version = str(jit_env.FLASHINFER_CUBIN_DIR), flashinfer.__version__
    except Exception:  # noqa: BLE001 - the message must still be built
        cubin_dir, version = "~/.cache/flashinfer/cubins", "the installed version"
    return (
        f"FlashInfer could not load its trtllm-gen attention kernels ({type(exc).__name__}: {exc}). FlashInfer "
        "downloads these cubins from NVIDIA's artifactory on first use and keeps them in "
        f"{cubin_dir}. Without network access: run any TRTLLM_ATTN call (or "
        "diffusers_trtllm.backends.trtllm.warmup()) once on a machine with network and the same FlashInfer "
        f"({version}), copy that cubin folder here and point FLASHINFER_CUBIN_DIR at it (or install "
        "the flashinfer-cubin wheel of exactly that version, if one is published); set FLASHINFER_NO_DOWNLOAD=1 "
        "so a missing cubin fails at once instead of retrying the download.")

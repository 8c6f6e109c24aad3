"""Running FlashInfer's TRT-LLM attention kernels: import, workspace, JIT build and cubin loading, execution.

What each call passes is decided in :mod:`.flashinfer_calls`; this module owns the state around the calls:

- one zero-initialised workspace buffer per device, allocated on first use and reused by every call;
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
import time
from typing import TYPE_CHECKING, Iterable

import torch

from .flashinfer_calls import (RaggedIndex, SageScales, build_ragged_index, fmha_v2_call, sage_quantize_call,
                               trtllm_gen_call)

from ..backends.base import VarlenQKV  # base is loaded before the backends package imports this module

if TYPE_CHECKING:
    from ..backends.base import KernelPlan

logger = logging.getLogger("diffusers_trtllm")

WORKSPACE_BYTES = 256 * 1024 * 1024  # FlashInfer's own DiT tests use this size for the trtllm-gen kernels
FMHA_V2_LAYOUT = "SEPARATE_Q_K_V"

_workspaces: dict[torch.device, torch.Tensor] = {}
_ready_fmha_v2: set[tuple[torch.device, torch.dtype]] = set()


class CubinUnavailableError(RuntimeError):
    """FlashInfer could not load the trtllm-gen kernel binaries (cubins) it downloads on first use."""


@functools.lru_cache(maxsize=None)
def flashinfer_prefill():
    """``flashinfer.prefill``, imported once (raises ``ImportError`` when FlashInfer is missing or broken)."""
    import flashinfer.prefill

    return flashinfer.prefill


def workspace(device: torch.device | str) -> torch.Tensor:
    """The device's workspace buffer (``WORKSPACE_BYTES`` of uint8, zeroed once). Calls on one device share it,
    so two calls on different streams of one device must not overlap."""
    device = _canonical(device)
    buf = _workspaces.get(device)
    if buf is None:
        buf = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        _workspaces[device] = buf
    return buf


@functools.lru_cache(maxsize=256)
def ragged_index(seqlens_q: tuple[int, ...], seqlens_kv: tuple[int, ...], device: torch.device) -> RaggedIndex:
    """Cached :func:`~.flashinfer_calls.build_ragged_index`: a pipeline repeats a few layouts in every layer."""
    return build_ragged_index(seqlens_q, seqlens_kv, device)


def _canonical(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _index_of(qkv: VarlenQKV) -> RaggedIndex:
    return ragged_index(tuple(qkv.seqlens_q), tuple(qkv.seqlens_kv), _canonical(qkv.q.device))


# --------------------------------------------------------------------------------------------------- Hopper


def run_fmha_v2(qkv: VarlenQKV, plan: KernelPlan) -> torch.Tensor:
    """Dense or Skip-Softmax attention on Hopper through FMHAv2, the whole batch in one call.

    q/k/v are made contiguous (a no-op when they are; FMHAv2 ignores strides). Returns ``[total_q, Hq, 128]``
    in q's dtype. A sequence with fewer queries than keys (Cosmos 3's generation stream on text + generation
    keys) is given zero queries up to its key length, because FMHAv2 0.7.2 computes wrong results for such
    sequences and right ones for equal lengths; the padded rows' outputs are dropped. They cost
    ``(kv_len - q_len) / q_len`` more work, and can keep the sequence's last query tile from skipping.
    """
    device = _canonical(qkv.q.device)
    if (device, qkv.q.dtype) not in _ready_fmha_v2:
        _prepare_fmha_v2(device, qkv.q.dtype)
    padded = any(nq < nkv for nq, nkv in zip(qkv.seqlens_q, qkv.seqlens_kv))
    run_qkv = _pad_queries_to_keys(qkv) if padded else qkv
    q, k, v = (t.contiguous() for t in (run_qkv.q, run_qkv.k, run_qkv.v))
    out = fmha_v2_call(q, k, v, workspace(device), _index_of(run_qkv), plan.scale, plan.skip_factor)(
        flashinfer_prefill())
    if not padded:
        return out
    starts = run_qkv.cu_seqlens("q").tolist()
    return torch.cat([out[start:start + nq] for start, nq in zip(starts, qkv.seqlens_q)])


def _pad_queries_to_keys(qkv: VarlenQKV) -> VarlenQKV:
    """``qkv`` with each sequence's queries zero-padded to at least its key length."""
    pieces, lengths = [], []
    for (q, _, _, _), nkv in zip(qkv.sequences(), qkv.seqlens_kv):
        missing = max(nkv - q.shape[0], 0)
        pieces += [q, q.new_zeros(missing, *q.shape[1:])] if missing else [q]
        lengths.append(q.shape[0] + missing)
    return VarlenQKV(torch.cat(pieces), qkv.k, qkv.v, tuple(lengths), qkv.seqlens_kv)


def _prepare_fmha_v2(device: torch.device, dtype: torch.dtype) -> None:
    """Build (or load) FlashInfer's FMHAv2 module for ``dtype`` and say so: the first build takes minutes."""
    prefill = flashinfer_prefill()
    built_dir, cached = _fmha_v2_build_state(dtype)
    if cached:
        logger.info("loading FlashInfer FMHAv2 (%s, %s) from its JIT cache %s", FMHA_V2_LAYOUT, dtype, built_dir)
    else:
        logger.warning(
            "building FlashInfer's TRT-LLM FMHAv2 kernels (%s, %s, sm_90) with nvcc into %s: about 90 s on 16 cores "
            "(MAX_JOBS=%s), once per machine; set FLASHINFER_WORKSPACE_BASE to move the cache, call "
            "diffusers_trtllm.backends.trtllm.warmup() to do it ahead of time", FMHA_V2_LAYOUT, dtype,
            built_dir or "FlashInfer's JIT cache", os.environ.get("MAX_JOBS", "unset"))
    start = time.perf_counter()
    with torch.cuda.device(device):
        prefill.get_trtllm_fmha_v2_module(FMHA_V2_LAYOUT, dtype)
    if not cached:
        logger.warning("FlashInfer FMHAv2 (%s, %s) ready after %.1f s", FMHA_V2_LAYOUT, dtype,
                       time.perf_counter() - start)
    _ready_fmha_v2.add((device, dtype))


def _fmha_v2_build_state(dtype: torch.dtype) -> tuple[str | None, bool]:
    """``(build folder, already built)`` of FlashInfer's FMHAv2 JIT module, read through FlashInfer's own spec.
    Internal FlashInfer API: when it moves, report ``(None, False)`` (the build then just logs less precisely)."""
    try:
        from flashinfer.jit.attention import gen_fmha_v2_module

        spec = gen_fmha_v2_module(FMHA_V2_LAYOUT, dtype)
        return str(spec.build_dir), bool(spec.is_compiled)
    except Exception as exc:  # noqa: BLE001 - logging only
        logger.debug("could not inspect FlashInfer's FMHAv2 JIT cache: %r", exc)
        return None, False


# ------------------------------------------------------------------------------------------------ Blackwell


def run_trtllm_gen(qkv: VarlenQKV, plan: KernelPlan) -> torch.Tensor:
    """Dense, Skip-Softmax or SAGE attention on datacenter Blackwell through trtllm-gen, one call per batch.

    With ``plan.quant`` the SAGE quantizer runs first (one more kernel), then attention on the quantized
    tensors. Returns ``[total_q, Hq, 128]`` bf16.
    """
    prefill = flashinfer_prefill()
    device = _canonical(qkv.q.device)
    index = _index_of(qkv)
    q, k, v = (t.contiguous() for t in (qkv.q, qkv.k, qkv.v))
    sage = None
    with _explain_missing_cubins():
        if plan.quant is not None:
            quant = plan.quant
            q, k, v, q_scale, k_scale, v_scale, _k_mean = sage_quantize_call(
                q, k, v, index, quant.dtype_qk, quant.q_block_size, quant.k_block_size)(prefill)
            sage = SageScales(q_scale, k_scale, v_scale, quant.q_block_size, quant.k_block_size)
        call = trtllm_gen_call(q, k, v, workspace(device), index, plan.scale, plan.skip_factor, sage)
        return call(prefill)


_CUBIN_FAILURE_MARKERS = ("checksums.txt", "cubin", "artifact", "flashinfer_no_download", "download",
                          "flashinfermetainfo")


@contextlib.contextmanager
def _explain_missing_cubins():
    """Re-raise a failed cubin download as :class:`CubinUnavailableError` with the offline remedies."""
    try:
        yield
    except (RuntimeError, ValueError, OSError) as exc:
        if any(marker in str(exc).lower() for marker in _CUBIN_FAILURE_MARKERS):
            raise CubinUnavailableError(missing_cubins_message(exc)) from exc
        raise


def missing_cubins_message(exc: BaseException) -> str:
    """The error a user sees when trtllm-gen cubins could not be loaded (no network, no local copy)."""
    from ..platform import flashinfer_version

    try:
        from flashinfer.jit import env as jit_env

        cubin_dir = str(jit_env.FLASHINFER_CUBIN_DIR)
    except Exception:  # noqa: BLE001 - the message must still be built
        cubin_dir = "~/.cache/flashinfer/cubins"
    return (
        f"FlashInfer could not load its trtllm-gen attention kernels ({type(exc).__name__}: {exc}). FlashInfer "
        "downloads these cubins from NVIDIA's artifactory on first use and keeps them in "
        f"{cubin_dir}. Without network access: run any TRTLLM_ATTN call (or "
        "diffusers_trtllm.backends.trtllm.warmup()) once on a machine with network and the same FlashInfer "
        f"({flashinfer_version()}), copy that cubin folder here and point FLASHINFER_CUBIN_DIR at it (or install "
        "the flashinfer-cubin wheel of exactly that version, if one is published); set FLASHINFER_NO_DOWNLOAD=1 "
        "so a missing cubin fails at once instead of retrying the download.")


# --------------------------------------------------------------------------------------------------- warm-up


def warmup(device: torch.device | str | None = None, dtypes: Iterable[torch.dtype] = (torch.bfloat16,),
           sage: bool = True) -> dict[str, float]:
    """Build or fetch everything TRTLLM_ATTN needs on ``device`` (default: the current CUDA device), now.

    Hopper: JIT-compiles FlashInfer's FMHAv2 module for each dtype (dense and Skip-Softmax kernels are one
    module; about 90 s the first time on a machine, a load afterwards). Blackwell: loads the trtllm-gen module
    and its cubins (downloaded on first use; see :class:`CubinUnavailableError`) with one small dense call,
    and with ``sage`` one SAGE call per Q/K dtype the GPU has kernels for. Returns seconds per step.
    """
    from ..backends import trtllm
    from ..backends.base import KernelPlan, VarlenQKV
    from ..platform import gpu_arch

    device = _canonical(device if device is not None else "cuda")
    arch = gpu_arch(device)
    timings: dict[str, float] = {}
    for dtype in dtypes:
        if dtype not in trtllm.SUPPORTED_DTYPES:
            raise ValueError(f"warmup dtype {dtype} is not supported by TRTLLM_ATTN; supported: "
                             f"{list(trtllm.SUPPORTED_DTYPES)}")
        plans = [KernelPlan(backend="TRTLLM_ATTN", scale=trtllm.HEAD_DIM ** -0.5)]
        if sage and arch in trtllm.TRTLLM_GEN_ARCHS:
            plans += [KernelPlan(backend="TRTLLM_ATTN", scale=trtllm.HEAD_DIM ** -0.5, quant=quant)
                      for quant in trtllm.sage_specs_with_kernels(arch)]
        qkv = VarlenQKV(*(torch.zeros(256, 1, trtllm.HEAD_DIM, dtype=dtype, device=device) for _ in range(3)),
                        (256,), (256,))
        for plan in plans:
            reason = trtllm.unavailable_reason(plan, qkv)
            if reason is not None:
                raise RuntimeError(f"TRTLLM_ATTN cannot warm up on {device}: {reason}")
            step = f"{arch} {dtype}" + (f" sage {plan.quant.dtype_qk}" if plan.quant else "")
            logger.info("TRTLLM_ATTN warm-up: %s", step)
            start = time.perf_counter()
            trtllm.run(qkv, plan)
            torch.cuda.synchronize(device)
            timings[step] = time.perf_counter() - start
    return timings

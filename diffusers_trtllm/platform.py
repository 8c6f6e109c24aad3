"""What this machine can run: the GPU architecture of a device and the installed FlashInfer."""

from __future__ import annotations

import functools
import importlib.metadata

import torch


def gpu_arch(device: torch.device | str) -> str | None:
    """``"sm_90"``-style name of a CUDA device, or ``None`` for a CPU (or any non-CUDA) device."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return _cuda_arch(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)  # asked on the per-call path: the driver is queried once per GPU
def _cuda_arch(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}"


@functools.lru_cache(maxsize=None)
def flashinfer_version() -> str | None:
    """Installed ``flashinfer-python`` version, or ``None`` when it is not installed."""
    try:
        return importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        return None


def version_tuple(version: str) -> tuple[int, ...]:
    """``"0.6.16rc1"`` -> ``(0, 6, 16)``: the numeric release part, enough for minimum-version checks."""
    parts = []
    for piece in version.split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits or 0))
    return tuple(parts)

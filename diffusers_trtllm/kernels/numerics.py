"""Numbers every attention kernel of the package and its PyTorch reference share: the head dim the kernels are
built for, the int8 / fp8 e4m3 grids Q, K, V and P are quantized to, and the floor that keeps a block scale finite.

Defined here, at the bottom of the package, so that the kernels and the layers above them (``quant``, the
backends) read one definition.
"""

from __future__ import annotations

import torch

HEAD_DIM = 128  # channels per head of every TRT-LLM and Triton kernel the package runs
FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT8_MAX = 127.0  # symmetric int8 grid: -128 is never used
P_SCALE = FP8_MAX  # softmax numerators P in [0, 1] enter P·V as fp8(P · 448), unless a kernel says otherwise
TINY_SCALE = 1e-12  # floor of a block's amax: an all-zero block keeps a finite, nonzero scale
QK_TORCH_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}  # Q/K value dtype by config name


def qmax(dtype_qk: str) -> float:
    """The largest magnitude on the Q/K grid of ``dtype_qk`` (``"int8"`` or ``"fp8_e4m3"``)."""
    return INT8_MAX if dtype_qk == "int8" else FP8_MAX


def head_dim_mismatch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """``None`` when q, k and v all have :data:`HEAD_DIM` channels, else the head dims they have, in words."""
    if q.shape[-1] == k.shape[-1] == v.shape[-1] == HEAD_DIM:
        return None
    return f"head_dim is {q.shape[-1]} (k {k.shape[-1]}, v {v.shape[-1]})"

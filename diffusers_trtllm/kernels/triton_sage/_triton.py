"""Triton, when it is installed, and the decorators the kernels are written with.

CPU-only PyTorch wheels ship without Triton: the decorators then leave the functions as they are, so the package
still imports and :func:`~.attention.triton_sage_unavailable_reason` can say why nothing runs.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

jit = triton.jit if triton is not None else (lambda fn: fn)
# jit that keeps the named integer arguments out of the compiled kernel's key (one binary for every value)
jit_not_specializing = ((lambda *names: triton.jit(do_not_specialize=names)) if triton is not None
                        else (lambda *names: lambda fn: fn))
# Kernels may read only constexpr globals: module constants they use are wrapped in this.
constexpr = tl.constexpr if tl is not None else (lambda value: value)

"""Scratch device arrays shared by the kernel launchers.

Owns `scratch_array`: a temporary device array taken from a caller-kept dict (keyed by name, shape and dtype, so
steady-state calls allocate nothing and can be captured in a CUDA graph) or freshly allocated when the caller keeps
none; `zero=True` zero-fills it when it is created (work counters that the kernels themselves reset after use).
A launcher's scratch never outlives its call: callers may share one dict across launchers on one stream.
"""
import numpy as np
from numba import cuda

__all__ = ["scratch_array"]


def scratch_array(scratch, name, shape, dtype, stream, zero=False):
    """Device array of `shape`/`dtype` for temporary use within one launcher call (module docstring)."""
    key = (name, tuple(int(s) for s in shape), np.dtype(dtype).str)
    if scratch is not None and key in scratch:
        return scratch[key]
    if zero:
        arr = cuda.to_device(np.zeros(key[1], dtype), stream=stream)
    else:
        arr = cuda.device_array(key[1], dtype, stream=stream)
    if scratch is not None:
        scratch[key] = arr
    return arr

"""Scratch device arrays shared by the kernel launchers.

Owns `scratch_array`: a temporary device array taken from a caller-kept dict (keyed by name, shape and dtype, so
steady-state calls allocate nothing and can be captured in a CUDA graph) or freshly allocated when the caller keeps
none; `zero=True` zero-fills it when it is created (work counters that the kernels themselves reset after use).
A launcher's scratch never outlives its call: callers may share one dict across launchers on one stream.
Also `scratch_arrays` (several at once, to a launcher-given specification of shapes and dtypes) and `check_arrays`
(a launcher's check of operands a caller allocated to such a specification: the staged GEMV operands of
kernels.vq_gemv and kernels.q4k_gemv).
"""
import numpy as np
from numba import cuda

__all__ = ["scratch_array", "scratch_arrays", "check_arrays"]


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


def scratch_arrays(scratch, names, specs, stream):
    """scratch_array for each name and (shape, dtype) of specs, as a tuple."""
    return tuple(scratch_array(scratch, n, sh, dt, stream) for n, (sh, dt) in zip(names, specs))


def check_arrays(arrays, specs, name, what):
    """Refuses, with a ValueError naming `name` and `what`, arrays that are not exactly [(shape, dtype), ...] specs."""
    arrays = tuple(arrays)
    if len(arrays) != len(specs) or any(a.dtype != np.dtype(dt) or tuple(a.shape) != tuple(sh)
                                        for a, (sh, dt) in zip(arrays, specs)):
        want = ", ".join(f"{np.dtype(dt).name} {tuple(sh)}" for sh, dt in specs)
        got = ", ".join(f"{a.dtype} {tuple(a.shape)}" for a in arrays)
        raise ValueError(f"{name}: {what} must be ({want}), got ({got})")

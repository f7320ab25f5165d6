"""The CUDA Lloyd backend: ds4lib.solvers.vq's rules on the device (kernels/vq_assign.py, kernels/vq_accumulate.py).

This is the one ds4lib.quant module that imports `kernels`, and only when a CUDA backend is requested
(`make_backend("cuda")`), so the rest of the quantizer imports without numba.cuda. Vectors are copied to the
device once per `put`; assignment indices stay there until `fetch`; per-round transfers are the prepared
codebook (K*9 floats) down and the integer sums (K*9 int64) back.
"""
from __future__ import annotations

import numpy as np

from ds4lib.solvers.vq import DIM, CpuLloyd, LloydBackend, PreparedCodebook, check_fixed_range

__all__ = ["CudaLloyd", "make_backend", "DEVICES"]

DEVICES = ("cpu", "cuda")


class CudaLloyd(LloydBackend):
    name = "cuda"

    def __init__(self):
        from numba import cuda

        from kernels.vq_accumulate import vq_accumulate
        from kernels.vq_assign import vq_assign
        self._cuda, self._assign, self._accumulate = cuda, vq_assign, vq_accumulate

    def put(self, x):
        x = np.ascontiguousarray(np.asarray(x, dtype=np.float32).reshape(-1, DIM))
        amax = float(np.abs(x).max()) if x.size else 0.0
        return self._cuda.to_device(x), amax

    def assign(self, xb, prepared: PreparedCodebook):
        d_x, _ = xb
        return self._assign(d_x, self._cuda.to_device(prepared.cbm2), self._cuda.to_device(prepared.cnorm))

    def accumulate(self, xb, idxb, k: int):
        d_x, amax = xb
        check_fixed_range(d_x.shape[0], np.float32(amax))
        sums, counts = self._accumulate(d_x, idxb, int(k))
        return sums.copy_to_host(), counts.copy_to_host()

    def fetch(self, idxb) -> np.ndarray:
        return idxb.copy_to_host()


def make_backend(device: str) -> LloydBackend:
    """'cpu' -> CpuLloyd (Numba parallel), 'cuda' -> CudaLloyd (Numba CUDA kernels)."""
    if device == "cpu":
        return CpuLloyd()
    if device == "cuda":
        return CudaLloyd()
    raise ValueError(f"unknown device {device!r}; use one of {DEVICES}")

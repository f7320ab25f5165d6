"""Lloyd update sums on the device: per-codeword exact integer sums of the assigned vectors
(ds4lib.solvers.vq states the rule; CpuLloyd._accumulate_cpu is the CPU path).

Shapes: x [N, 8] float32, idx [N] int32, sums [K, 8] int64 (zeroed by the launcher), counts [K] int64.

Each component enters as the int64 fixed-point value floor(x * 2^FIXED_SHIFT + 0.5), computed in float64
(exact: a float32 times a power of two, plus one half, fits in 53 bits). Integer addition is associative,
so the 64-bit atomics may land in any order and the sums are still identical to the CPU's, bit for bit;
float atomics would not be. The host turns sums into means (ds4lib.solvers.vq.finalize_update).
"""
import math

import numpy as np
from numba import cuda

from kernels.pdl import grid_entry_device

__all__ = ["vq_accumulate", "vq_accumulate_kernel", "SIGNATURES", "DIM", "THREADS", "FIXED_SHIFT",
           "MAX_LAUNCH_VECTORS"]

DIM = 8
THREADS = 256
FIXED_SHIFT = 24
FIXED_SCALE = float(1 << FIXED_SHIFT)
MAX_LAUNCH_VECTORS = 1 << 26


@cuda.jit(cache=True)
def vq_accumulate_kernel(x, idx, sums, counts):
    grid_entry_device()
    v = cuda.blockIdx.x * THREADS + cuda.threadIdx.x
    if v < x.shape[0]:
        k = idx[v]
        cuda.atomic.add(counts, k, np.int64(1))
        for i in range(DIM):
            q = np.int64(math.floor(np.float64(x[v, i]) * FIXED_SCALE + 0.5))
            cuda.atomic.add(sums, (k, i), q)


SIGNATURES = {"vq_accumulate_kernel": "void(float32[:, ::1], int32[::1], int64[:, ::1], int64[::1])"}


def vq_accumulate(d_x, d_idx, n_codewords: int, out=None, stream=0):
    """x [N, 8] float32, idx [N] int32 (device) -> (sums [K, 8] int64, counts [K] int64) on the device.
    The caller guarantees N * max|x| * 2^24 < 2^63 (ds4lib.solvers.vq.check_fixed_range)."""
    n = d_x.shape[0]
    if d_x.ndim != 2 or d_x.shape[1] != DIM or d_x.dtype != np.float32:
        raise ValueError(f"vq_accumulate: x {d_x.shape} {d_x.dtype}, expected [N, {DIM}] float32")
    if d_idx.shape != (n,) or d_idx.dtype != np.int32:
        raise ValueError(f"vq_accumulate: idx {d_idx.shape} {d_idx.dtype}, expected ({n},) int32")
    if out is None:
        sums = cuda.to_device(np.zeros((n_codewords, DIM), dtype=np.int64), stream=stream)
        counts = cuda.to_device(np.zeros(n_codewords, dtype=np.int64), stream=stream)
    else:
        sums, counts = out
        if sums.shape != (n_codewords, DIM) or counts.shape != (n_codewords,):
            raise ValueError("vq_accumulate: out arrays do not match n_codewords")
    for s in range(0, n, MAX_LAUNCH_VECTORS):
        e = min(n, s + MAX_LAUNCH_VECTORS)
        grid = (e - s + THREADS - 1) // THREADS
        vq_accumulate_kernel[grid, THREADS, stream](d_x[s:e], d_idx[s:e], sums, counts)
    return sums, counts

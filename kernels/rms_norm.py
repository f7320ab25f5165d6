"""RMSNorm on the device: y = x * rsqrt(mean(x^2) + eps) * w, rounded to BF16 (ds4lib.ref.norm.rms_norm).

One warp per row; each lane sums a strided part of the row in float64 (so the result does not depend
on how the sum is split), the warp reduces with shuffles, and every lane writes its part.
Shapes: x [R, D] float32 (BF16 values), w [D], out [R, D].
"""
import math

import numpy as np
from numba import cuda

from kernels.bf16 import round_bf16_device

__all__ = ["rms_norm", "rms_norm_kernel", "block_sum_rows_f64_device", "SIGNATURES"]

WARP = 32
ROWS_PER_BLOCK = 4


@cuda.jit
def rms_norm_kernel(x, w, eps, out):
    lane = cuda.threadIdx.x % WARP
    row = cuda.blockIdx.x * ROWS_PER_BLOCK + cuda.threadIdx.x // WARP
    n_rows, d = x.shape
    acc = 0.0
    if row < n_rows:
        for j in range(lane, d, WARP):
            v = np.float64(x[row, j])
            acc += v * v
    off = 16
    while off > 0:
        acc += cuda.shfl_down_sync(0xFFFFFFFF, acc, off)
        off //= 2
    total = cuda.shfl_sync(0xFFFFFFFF, acc, 0)
    if row < n_rows:
        var = np.float32(total / d)
        scale = np.float32(1.0) / np.float32(math.sqrt(var + eps))
        for j in range(lane, d, WARP):
            out[row, j] = round_bf16_device(w[j] * (x[row, j] * scale))


SIGNATURES = {"rms_norm_kernel": "void(float32[:, :], float32[:], float32, float32[:, :])"}


def rms_norm(x, w, eps, out=None, stream=0):
    """x [R, D], w [D] (device or host float32 arrays) -> out [R, D]."""
    if x.ndim != 2 or w.shape != (x.shape[1],):
        raise ValueError(f"rms_norm: x {x.shape} and w {w.shape} do not match")
    if out is None:
        out = cuda.device_array(x.shape, dtype=np.float32, stream=stream)
    grid = (x.shape[0] + ROWS_PER_BLOCK - 1) // ROWS_PER_BLOCK
    rms_norm_kernel[grid, WARP * ROWS_PER_BLOCK, stream](x, w, np.float32(eps), out)
    return out


@cuda.jit(device=True, inline=True)
def block_sum_rows_f64_device(sh, n_rows):
    """Sum sh[r, :blockDim.x] into sh[r, 0] for r < n_rows with a shared-memory tree (blockDim.x a power of
    two). Deterministic: the order depends only on the block size. Every thread of the block must call it;
    it ends with a barrier, so sh[r, 0] is then readable by all threads."""
    tid = cuda.threadIdx.x
    n = cuda.blockDim.x
    cuda.syncthreads()
    s = n // 2
    while s > 0:
        if tid < s:
            for r in range(n_rows):
                sh[r, tid] += sh[r, tid + s]
        cuda.syncthreads()
        s //= 2

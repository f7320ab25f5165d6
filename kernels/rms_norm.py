"""RMSNorm on the device: y = x * rsqrt(mean(x^2) + eps) * w, rounded to BF16 (ds4lib.ref.norm.rms_norm).

Owns `rms_norm` and `block_sum_rows_f64_device`, the shared-memory float64 block sum other kernels use.

One block per row, n threads (a multiple of 32, chosen from D by the launcher so that one pass of ELEMS elements
per thread covers the row: n = 32 * ceil(D / (32 * ELEMS)), at most THREADS_MAX). Thread t owns elements
t, t + n, t + 2n, ... (a warp's load covers 128 contiguous bytes). A pass loads ELEMS elements of x
and of w per thread with unconditional loads (the index is clamped, not branched on, and the values land in
registers before any store), so the whole row is in flight at once. The squares are summed in float64 per
thread, then over the block in a fixed tree: shuffles within each warp, then the warps' sums by the same
shuffle tree (every warp computes it, so no second barrier). The order depends only on D (n is a function of D).

Squares of BF16 values carry at most 16 significant bits, so the float64 total is exact when the row's nonzero
magnitudes lie within a factor 2^((37 - log2 D) / 2) of each other (2^12 at D = 5120), and a few float64 ulps
from exact otherwise; the float32 variance rounded from it can then differ between summation orders only when
the total lies within those ulps of a float32 rounding boundary (about one row in 10^8). The scale and the
output follow the reference's FP32 steps: var = f32(total / D), scale = 1 / f32(sqrt(var + eps)),
y = bf16(w * (x * scale)).

Shapes: x [T, D] float32 (BF16 values), w [D], out [T, D].
"""
import math

import numpy as np
from numba import cuda

from kernels.bf16 import round_bf16_device

__all__ = ["rms_norm", "rms_norm_kernel", "block_sum_rows_f64_device", "SIGNATURES"]

WARP = 32
ELEMS = 8                       # elements of a row per thread and pass (unrolled loads)
THREADS_MAX = 1024              # one pass up to D = 8192; longer rows take several


@cuda.jit(device=True, inline=True)
def _warp_tree_f64_device(v):
    """Sum of v over the warp's lanes, valid in lane 0: shuffle tree, fixed order."""
    off = WARP // 2
    while off > 0:
        v += cuda.shfl_down_sync(0xFFFFFFFF, v, off)
        off //= 2
    return v


@cuda.jit(device=True, inline=True)
def _block_sum_f64_device(v, sh):
    """Sum of v over the block, returned to every thread (blockDim.x a multiple of 32, every thread calls it).
    sh: float64 [WARP] shared. Each warp sums its lanes, then each warp sums the warps' sums with the same tree,
    so all threads get the same bits without a second barrier."""
    lane = cuda.threadIdx.x % WARP
    v = _warp_tree_f64_device(v)
    if lane == 0:
        sh[cuda.threadIdx.x // WARP] = v
    cuda.syncthreads()
    s = sh[lane] if lane < cuda.blockDim.x // WARP else 0.0
    s = _warp_tree_f64_device(s)
    return cuda.shfl_sync(0xFFFFFFFF, s, 0)


@cuda.jit(device=True, inline=True)
def _load_pass_device(x, w, row, base, d, xs, ws):
    """xs[m], ws[m] = x[row, j], w[j] for the thread's j = base + m * blockDim.x + threadIdx.x (m < ELEMS); j
    past the row reads element D - 1 (a clamped index keeps the loads unconditional)."""
    for m in range(ELEMS):
        j = min(base + m * cuda.blockDim.x + cuda.threadIdx.x, d - 1)
        xs[m] = x[row, j]
        ws[m] = w[j]


@cuda.jit(cache=True)
def rms_norm_kernel(x, w, eps, out):
    """out[r] = bf16(w * (x[r] * scale_r)) for row r = blockIdx.x (module docstring)."""
    row = cuda.blockIdx.x
    nt = cuda.blockDim.x
    d = x.shape[1]
    step = nt * ELEMS
    sh = cuda.shared.array(WARP, np.float64)
    xs = cuda.local.array(ELEMS, np.float32)
    ws = cuda.local.array(ELEMS, np.float32)
    acc = 0.0
    for base in range(0, d, step):
        _load_pass_device(x, w, row, base, d, xs, ws)
        for m in range(ELEMS):
            v = np.float64(xs[m]) if base + m * nt + cuda.threadIdx.x < d else 0.0
            acc += v * v
    total = _block_sum_f64_device(acc, sh)
    var = np.float32(total / d)
    scale = np.float32(1.0) / np.float32(math.sqrt(var + eps))
    for base in range(0, d, step):
        if step < d:                              # several passes: reload (one pass kept its values in registers)
            _load_pass_device(x, w, row, base, d, xs, ws)
        for m in range(ELEMS):
            j = base + m * nt + cuda.threadIdx.x
            if j < d:
                out[row, j] = round_bf16_device(ws[m] * (xs[m] * scale))


SIGNATURES = {"rms_norm_kernel": "void(float32[:, :], float32[:], float32, float32[:, :])"}


def rms_norm(x, w, eps, out=None, stream=0):
    """x [T, D], w [D] (device or host float32 arrays) -> out [T, D]."""
    if x.ndim != 2 or w.shape != (x.shape[1],):
        raise ValueError(f"rms_norm: x {x.shape} and w {w.shape} do not match")
    if out is None:
        out = cuda.device_array(x.shape, dtype=np.float32, stream=stream)
    n_rows, d = x.shape
    if n_rows and d:
        threads = min(THREADS_MAX, WARP * -(-d // (WARP * ELEMS)))
        rms_norm_kernel[n_rows, threads, stream](x, w, np.float32(eps), out)
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

"""Manifold-constrained hyper-connections on the device (ds4lib.ref.hc; docs/architecture.md §4).

Owns: the mixes of one sub-layer (weightless RMS of the flattened S*D state, the [(2+S)*S, S*D] FP32
projection, sigmoid pre/post, Sinkhorn on the SxS comb), the collapse hc_pre and the expand hc_post.

- `hc_mixes`: two kernels. The first streams fn (FP32, 1.97 MB per sub-layer in V4.1) once: each block owns
  COLS_PER_BLOCK of the S*D columns (V4.1: 160 blocks, a column per thread), accumulates the 24 dot products
  and the sum of squares in float64 (exact products, so the result is the reference's exact dot rounded once,
  up to float64 rounding), and reduces them through shared memory into per-slice partials in a fixed order
  (two barriers). The second, one block per token, sums the partials in a fixed order (FIN_PARTS threads per
  mix with loads in flight: a lane adding 160 partials one dependent load at a time took 13 us on the H200)
  and its first warp runs the mixes and the 20 Sinkhorn iterations with one lane per comb entry; row and
  column sums are gathered and added in the reference's order.
- `hc_pre`: out[t, d] = bf16(sum_i pre[t, i] h[t, i, d]), the four exact products summed in float64.
- `hc_post`: out[t, j, d] = bf16(post[t, j] y[t, d] + sum_i comb[t, i, j] h[t, i, d]); one thread owns a
  column (t, d) and reads it whole before writing, so out may alias h (in-place update of the state).

Shapes: T tokens, S = 4 streams, D hidden; fn [24, S*D], base [24], scale [3]; h [T, S, D].
"""
import math

import numpy as np
from numba import cuda

from kernels.bf16 import exp_f32_device, mul_rn_device, round_bf16_device
from kernels.scratch import scratch_array as _scratch

__all__ = ["hc_mixes", "hc_pre", "hc_post", "hc_mix_partial_kernel", "hc_mix_finish_kernel", "hc_pre_kernel",
           "hc_post_kernel", "SIGNATURES"]

HC = 4                        # streams (hc_mult)
N_MIX = (2 + HC) * HC         # 24 mixes: pre, post, comb
N_ACC = N_MIX + 1             # the mixes and the sum of squares
THREADS = 128
WARP = 32
COLS_PER_BLOCK = 128          # S*D columns per partial block (V4.1: 160 blocks, one column per thread)
FIN_PARTS = 8                 # threads summing one mix's partials in the finishing kernel
FIN_THREADS = 256             # >= N_ACC * FIN_PARTS


@cuda.jit(cache=True)
def hc_mix_partial_kernel(h2, fn, cols, partial):
    """partial[t, b, m] = sum over block b's columns k of fn[m, k] h2[t, k] (m < 24), partial[t, b, 24] the
    sum of squares; float64. Each thread keeps its columns' 25 sums; they meet in shared memory, where thread
    (m, q) adds the 32 values of quarter q of row m in lane order, then thread m the four quarters: two
    barriers, a fixed order."""
    tid = cuda.threadIdx.x
    b = cuda.blockIdx.x
    n_tok, n_cols = h2.shape
    k0 = b * cols
    k1 = min(k0 + cols, n_cols)
    sh = cuda.shared.array((N_ACC, THREADS), np.float64)
    quarter = cuda.shared.array((N_ACC, 4), np.float64)
    acc = cuda.local.array(N_ACC, np.float64)
    for t in range(n_tok):
        for m in range(N_ACC):
            acc[m] = 0.0
        for k in range(k0 + tid, k1, THREADS):
            hv = np.float64(h2[t, k])
            acc[N_MIX] += hv * hv
            for m in range(N_MIX):
                acc[m] += np.float64(fn[m, k]) * hv
        for m in range(N_ACC):
            sh[m, tid] = acc[m]
        cuda.syncthreads()
        if tid < 4 * N_ACC:
            r = tid // 4
            q0 = (tid % 4) * (THREADS // 4)
            s = 0.0
            for i in range(THREADS // 4):
                s += sh[r, q0 + i]
            quarter[r, tid % 4] = s
        cuda.syncthreads()
        if tid < N_ACC:
            partial[t, b, tid] = ((quarter[tid, 0] + quarter[tid, 1]) + quarter[tid, 2]) + quarter[tid, 3]
        # the next token's first barrier orders these reads of `quarter` before its overwrites


@cuda.jit(device=True, inline=True)
def _sigmoid_device(x):
    return np.float32(1.0) / (np.float32(1.0) + exp_f32_device(-x))


@cuda.jit(device=True, inline=True)
def _gather_sum_device(c, src0, stride):
    """((c[src0] + c[src0+stride]) + c[src0+2*stride]) + c[src0+3*stride] across lanes, in that order."""
    s = cuda.shfl_sync(0xFFFFFFFF, c, src0)
    for k in range(1, HC):
        s += cuda.shfl_sync(0xFFFFFFFF, c, src0 + k * stride)
    return s


@cuda.jit(cache=True)
def hc_mix_finish_kernel(partial, base, scale, n_cols, norm_eps, hc_eps, iters, pre, post, comb):
    """One block per token. The partials are summed by FIN_PARTS threads per mix (part p adds blocks p,
    p + FIN_PARTS, ... in order, four loads in flight), then the parts in order; then the first warp finishes:
    lanes 0-3 pre, 4-7 post, 8-23 comb[i, j] (lane 8 + 4i + j)."""
    t = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    n_blk = partial.shape[1]
    parts = cuda.shared.array((N_ACC, FIN_PARTS), np.float64)
    if tid < N_ACC * FIN_PARTS:
        m_ = tid // FIN_PARTS
        p = tid % FIN_PARTS
        s = 0.0
        b = p
        while b + 3 * FIN_PARTS < n_blk:
            v0 = partial[t, b, m_]
            v1 = partial[t, b + FIN_PARTS, m_]
            v2 = partial[t, b + 2 * FIN_PARTS, m_]
            v3 = partial[t, b + 3 * FIN_PARTS, m_]
            s = (((s + v0) + v1) + v2) + v3
            b += 4 * FIN_PARTS
        while b < n_blk:
            s += partial[t, b, m_]
            b += FIN_PARTS
        parts[m_, p] = s
    cuda.syncthreads()
    if tid >= WARP:
        return                                   # warp-uniform: the first warp finishes alone
    lane = tid
    acc = 0.0
    if lane <= N_MIX:
        for p in range(FIN_PARTS):
            acc += parts[lane, p]
    ssq = cuda.shfl_sync(0xFFFFFFFF, acc, N_MIX)
    var = np.float32(ssq / n_cols)
    rs = np.float32(1.0) / np.float32(math.sqrt(var + norm_eps))
    m = np.float32(acc) * rs
    bm = base[min(lane, N_MIX - 1)]
    if lane < HC:
        pre[t, lane] = _sigmoid_device(mul_rn_device(m, scale[0]) + bm) + hc_eps
    elif lane < 2 * HC:
        post[t, lane - HC] = np.float32(2.0) * _sigmoid_device(mul_rn_device(m, scale[1]) + bm)
    e = (lane - 2 * HC) & (HC * HC - 1)          # comb entry of this lane (lanes outside 8..23 shadow one)
    i = e // HC
    j = e % HC
    row0 = 2 * HC + HC * i                       # first lane of row i
    col0 = 2 * HC + j                            # first lane of column j
    c = mul_rn_device(m, scale[2]) + bm if 2 * HC <= lane < N_MIX else np.float32(0.0)
    rmax = cuda.shfl_sync(0xFFFFFFFF, c, row0)
    for k in range(1, HC):
        rmax = max(rmax, cuda.shfl_sync(0xFFFFFFFF, c, row0 + k))
    c = exp_f32_device(c - rmax)
    c = c / _gather_sum_device(c, row0, 1) + hc_eps
    c = c / (_gather_sum_device(c, col0, HC) + hc_eps)
    for _ in range(iters - 1):
        c = c / (_gather_sum_device(c, row0, 1) + hc_eps)
        c = c / (_gather_sum_device(c, col0, HC) + hc_eps)
    if 2 * HC <= lane < N_MIX:
        comb[t, i, j] = c


@cuda.jit(cache=True)
def hc_pre_kernel(h, pre, out):
    """out[t, d] = bf16(sum_i pre[t, i] h[t, i, d]); one thread per (t, d)."""
    n_tok, n_s, d = h.shape
    g = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if g >= n_tok * d:
        return
    t = g // d
    k = g % d
    acc = 0.0
    for i in range(n_s):
        acc += np.float64(pre[t, i]) * np.float64(h[t, i, k])
    out[t, k] = round_bf16_device(np.float32(acc))


@cuda.jit(cache=True)
def hc_post_kernel(y, h, post, comb, out):
    """out[t, j, d] = bf16(post[t, j] y[t, d] + sum_i comb[t, i, j] h[t, i, d]); one thread per (t, d)."""
    n_tok, n_s, d = h.shape
    g = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if g >= n_tok * d:
        return
    t = g // d
    k = g % d
    col = cuda.local.array(HC, np.float64)
    for i in range(HC):
        col[i] = np.float64(h[t, i, k])
    yv = y[t, k]
    for j in range(HC):
        acc = 0.0
        for i in range(HC):
            acc += np.float64(comb[t, i, j]) * col[i]
        out[t, j, k] = round_bf16_device(mul_rn_device(post[t, j], yv) + np.float32(acc))


SIGNATURES = {
    "hc_mix_partial_kernel": "void(float32[:, :], float32[:, :], int64, float64[:, :, :])",
    "hc_mix_finish_kernel": "void(float64[:, :, :], float32[:], float32[:], int64, float32, float32, int64, "
                            "float32[:, :], float32[:, :], float32[:, :, :])",
    "hc_pre_kernel": "void(float32[:, :, :], float32[:, :], float32[:, :])",
    "hc_post_kernel": "void(float32[:, :], float32[:, :, :], float32[:, :], float32[:, :, :], float32[:, :, :])",
}




def _check_state(h, name):
    shape = tuple(h.shape)
    if len(shape) != 3 or shape[1] != HC or h.dtype != np.float32:
        raise ValueError(f"{name}: h must be float32 [T, {HC}, D], got {h.dtype} {shape}")
    return shape


def hc_mixes(h, fn, base, scale, *, norm_eps, hc_eps, iters, out=None, scratch=None, stream=0):
    """h [T, 4, D] -> (pre [T, 4], post [T, 4], comb [T, 4, 4]) float32. fn [24, 4D], base [24], scale [3]."""
    n_tok, _, d = _check_state(h, "hc_mixes")
    if tuple(fn.shape) != (N_MIX, HC * d) or tuple(base.shape) != (N_MIX,) or tuple(scale.shape) != (3,):
        raise ValueError(f"hc_mixes: fn {fn.shape}, base {base.shape}, scale {scale.shape} do not fit D={d}")
    if out is None:
        out = (cuda.device_array((n_tok, HC), np.float32, stream=stream),
               cuda.device_array((n_tok, HC), np.float32, stream=stream),
               cuda.device_array((n_tok, HC, HC), np.float32, stream=stream))
    if n_tok == 0:
        return out
    n_blk = (HC * d + COLS_PER_BLOCK - 1) // COLS_PER_BLOCK
    partial = _scratch(scratch, "partial", (n_tok, n_blk, N_ACC), np.float64, stream)
    hc_mix_partial_kernel[n_blk, THREADS, stream](h.reshape((n_tok, HC * d)), fn, COLS_PER_BLOCK, partial)
    hc_mix_finish_kernel[n_tok, FIN_THREADS, stream](partial, base, scale, HC * d, np.float32(norm_eps),
                                              np.float32(hc_eps), int(iters), *out)
    return out


def hc_pre(h, pre, out=None, stream=0):
    """Collapse: h [T, 4, D], pre [T, 4] -> out [T, D] (BF16 values)."""
    n_tok, _, d = _check_state(h, "hc_pre")
    if tuple(pre.shape) != (n_tok, HC):
        raise ValueError(f"hc_pre: pre {pre.shape} must be [{n_tok}, {HC}]")
    if out is None:
        out = cuda.device_array((n_tok, d), np.float32, stream=stream)
    if n_tok * d:
        hc_pre_kernel[(n_tok * d + THREADS - 1) // THREADS, THREADS, stream](h, pre, out)
    return out


def hc_post(y, h, post, comb, out=None, stream=0):
    """Expand: y [T, D], h [T, 4, D], post [T, 4], comb [T, 4, 4] -> out [T, 4, D] (may be h itself)."""
    n_tok, _, d = _check_state(h, "hc_post")
    if tuple(y.shape) != (n_tok, d) or tuple(post.shape) != (n_tok, HC) or tuple(comb.shape) != (n_tok, HC, HC):
        raise ValueError(f"hc_post: y {y.shape}, post {post.shape}, comb {comb.shape} do not fit h {h.shape}")
    if out is None:
        out = cuda.device_array((n_tok, HC, d), np.float32, stream=stream)
    if n_tok * d:
        hc_post_kernel[(n_tok * d + THREADS - 1) // THREADS, THREADS, stream](y, h, post, comb, out)
    return out

"""Manifold-constrained hyper-connections on the device (ds4lib.ref.hc; docs/architecture.md §4).

Owns: the mixes of one sub-layer (weightless RMS of the flattened S*D state, the [(2+S)*S, S*D] FP32
projection, sigmoid pre/post, Sinkhorn on the SxS comb), the collapse hc_pre and the expand hc_post.

- `hc_mixes`: two kernels, or for T <= FUSED_T_MAX (decode, short verify calls) both in one launch. The first
  streams fn (FP32, 1.97 MB per sub-layer in V4.1) once: each block owns COLS_PER_BLOCK of the S*D columns (V4.1:
  160 blocks, a column per thread), accumulates the 24 dot products and the sum of squares in float64 (exact
  products, so the result is the reference's exact dot rounded once, up to float64 rounding), and reduces them
  through shared memory into per-slice partials in a fixed order (two barriers). The second, one block per token,
  sums the partials in a fixed order (FIN_PARTS threads per mix with loads in flight: a lane adding 160 partials one
  dependent load at a time took 13 us on the H200) and its first warp runs the mixes and the 20 Sinkhorn iterations
  with one lane per comb entry; row and column sums are gathered and added in the reference's order.
  `hc_mix_fused_kernel` (the finishing kernel alone cost 6.3 us a call on the H200, the pair 11.5 us, 80 calls a
  token) runs the same device functions, so it gives the same bits: every block writes its partials, and the last
  block to take a ticket from a device counter sums and finishes every token (its 128 threads take the 200 (mix, part)
  sums of each token two at a time, both parts' loads in flight together; warp w finishes tokens w, w+4, ...) and
  puts the counter back to zero, so a captured graph replays it and eager calls follow. Both mix kernels load their
  first column's 24 weights before the grid entry (EARLY_READS, kernels.pdl): with a programmatic edge those loads
  overlap the kernel before, and the block's work after the entry starts from its state column's load.
  Memory order: kernels.ticket's last-block pattern (as q4k_gemv.q4k_mma_kernel's split rows): a block barrier after
  the partial stores, thread 0's acquire-release atomic ticket, a second barrier before the last block's loads. The
  acquire invalidates the SM's L1 (CCTL.IVALL on sm_90; L1 is not coherent across SMs), so the plain loads after it
  cannot be served stale lines (checked with nvdisasm; Numba emits generic ld, never ld.global.nc, for `partial`). The
  work of the last block grows with T (ceil(200 T / 256) rounds of dependent loads, T/4 Sinkhorn runs per warp) while
  the two-kernel path finishes tokens in parallel blocks: hence FUSED_T_MAX = 4 (not measured yet). The counter (int32
  [1]) comes from the caller's scratch dict, zero-filled when created (scratch_array zero=True, a host-to-device
  copy): make it with an eager call before capturing a graph that uses it (the CUDA backend warms every shape
  eagerly), and share it only among launches on one stream.
- `hc_pre`: out[t, d] = bf16(sum_i pre[t, i] h[t, i, d]), the four exact products summed in float64.
- `hc_post`: out[t, j, d] = bf16(post[t, j] y[t, d] + sum_i comb[t, i, j] h[t, i, d]); one thread owns a
  column (t, d) and reads it whole before writing, so out may alias h (in-place update of the state). With `moe`
  (hc_post_moe_kernel) y is the MoE's combine (kernels.vq_gemv.combine_group_device, formed in registers: the combine
  launch goes), a thread taking its four columns of one token.

Shapes: T tokens, S = 4 streams, D hidden; fn [24, S*D], base [24], scale [3]; h [T, S, D].
"""
import math

import numpy as np
from numba import cuda

from kernels import bounded_jit, inline_device, rows_grid
from kernels.bf16 import exp_f32_device, mul_rn_device, round_bf16_device
from kernels.pdl import grid_entry_device
from kernels.scratch import scratch_array as _scratch
from kernels.ticket import last_block_device
from kernels.vq_gemv import COMBINE_COLS, check_combine, combine_group_device, combine_slot_device

__all__ = ["hc_mixes", "hc_pre", "hc_post", "hc_mix_partial_kernel", "hc_mix_finish_kernel", "hc_mix_fused_kernel",
           "hc_pre_kernel", "hc_post_kernel", "hc_post_moe_kernel", "SIGNATURES"]

HC = 4                        # streams (hc_mult)
N_MIX = (2 + HC) * HC         # 24 mixes: pre, post, comb
N_ACC = N_MIX + 1             # the mixes and the sum of squares
THREADS = 128
WARP = 32
COLS_PER_BLOCK = 128          # S*D columns per partial block (V4.1: 160 blocks, one column per thread)
FIN_PARTS = 8                 # threads summing one mix's partials in the finishing kernel
FIN_THREADS = 256             # >= N_ACC * FIN_PARTS
PART_LOADS = 20               # loads in flight per thread summing a part (_part_sum_device; V4.1: 20 a part)
FUSED_T_MAX = 4               # tokens up to which hc_mixes takes the one-launch kernel (module docstring)
MIX_MIN_BLOCKS = 4            # launch bounds of the mixes' kernels: 128 registers a thread at most, as before
EARLY_READS = {"hc_mix_partial_kernel": ("fn", "cols"),     # parameters read before the grid entry (kernels.pdl):
               "hc_mix_fused_kernel": ("fn", "cols")}       # the first column's weights


@inline_device
def _fn_column_device(fn, cols, fv):
    """fv[m] = fn[m, k] (m < 24) for this thread's first column k = blockIdx.x * cols + threadIdx.x of its block
    (clamped to the last column: a thread without one loads a valid word it never uses). Reads fn alone, so the
    kernels take it before their grid entry (EARLY_READS: no step's kernel writes the mixes' weights)."""
    k = min(cuda.blockIdx.x * cols + cuda.threadIdx.x, fn.shape[1] - 1)
    for m in range(N_MIX):
        fv[m] = fn[m, k]


@inline_device
def _mix_partial_device(h2, fn, cols, partial, fv):
    """partial[t, b, m] = sum over block b's columns k of fn[m, k] h2[t, k] (m < 24), partial[t, b, 24] the
    sum of squares; float64. Each thread keeps its columns' 25 sums (its first column's weights fv from
    _fn_column_device, the others loaded here); they meet in shared memory, where thread (m, q) adds the 32 values
    of quarter q of row m in lane order, then thread m the four quarters: two barriers, a fixed order. Every thread
    of the block (THREADS) calls it."""
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
        if k0 + tid < k1:                        # the first column: its weights already in fv
            hv = np.float64(h2[t, k0 + tid])
            acc[N_MIX] += hv * hv
            for m in range(N_MIX):
                acc[m] += np.float64(fv[m]) * hv
        for k in range(k0 + tid + THREADS, k1, THREADS):
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


@bounded_jit(THREADS, MIX_MIN_BLOCKS)
def hc_mix_partial_kernel(h2, fn, cols, partial):
    """The partials of every token, one block per COLS_PER_BLOCK columns (_mix_partial_device); the first column's
    weights are loaded before the grid entry (EARLY_READS)."""
    fv = cuda.local.array(N_MIX, np.float32)
    _fn_column_device(fn, cols, fv)
    grid_entry_device()
    _mix_partial_device(h2, fn, cols, partial, fv)


@inline_device
def _sigmoid_device(x):
    return np.float32(1.0) / (np.float32(1.0) + exp_f32_device(-x))


@inline_device
def _gather_sum_device(c, src0, stride):
    """((c[src0] + c[src0+stride]) + c[src0+2*stride]) + c[src0+3*stride] across lanes, in that order."""
    s = cuda.shfl_sync(0xFFFFFFFF, c, src0)
    for k in range(1, HC):
        s += cuda.shfl_sync(0xFFFFFFFF, c, src0 + k * stride)
    return s


@inline_device
def _part_loads_device(partial, t, m_, p, r, n_blk, v):
    """v[i] = partial[t, b, m_] for b = p + (r + i) FIN_PARTS, i < PART_LOADS: one batch of loads in flight, without
    branches (b past n_blk reads block n_blk - 1's, which _part_adds_device leaves out)."""
    tu = np.uint32(t)                            # unsigned indices: no negative-index wraparound (docs/toolchain.md)
    mu = np.uint32(m_)
    last = np.uint32(n_blk - 1)
    b0 = np.uint32(p + r * FIN_PARTS)
    for i in range(PART_LOADS):
        v[i] = partial[tu, min(b0 + np.uint32(i * FIN_PARTS), last), mu]


@inline_device
def _part_adds_device(s, p, r, n_blk, v):
    """s plus the batch's values v[i] (b = p + (r + i) FIN_PARTS < n_blk), one at a time in b order."""
    for i in range(PART_LOADS):
        if p + (r + i) * FIN_PARTS < n_blk:
            s += v[i]
    return s


@inline_device
def _part_sum_device(partial, t, m_, p, n_blk):
    """Part p of mix m_ of token t: partial[t, b, m_] for b = p, p + FIN_PARTS, ... added in that order, PART_LOADS
    loads in flight (V4.1's 20 partials a part: one round of L2 loads)."""
    s = 0.0
    v = cuda.local.array(PART_LOADS, np.float64)
    r = 0
    while p + r * FIN_PARTS < n_blk:
        _part_loads_device(partial, t, m_, p, r, n_blk, v)
        s = _part_adds_device(s, p, r, n_blk, v)
        r += PART_LOADS
    return s


@inline_device
def _part_sum_pair_device(partial, i0, i1, n_blk):
    """_part_sum_device of flat parts i0 and i1 (i = (t * N_ACC + m) * FIN_PARTS + p), both parts' loads in flight
    together: the last block's thread takes its parts two at a time, one round of loads where two parts one after
    the other took two (or four at V4.1's 20 partials and the old 10 loads a batch). i1 past the last part reads the
    last part's partials instead; its sum is then meaningless and the caller must not store it."""
    n_all = partial.shape[0] * N_ACC * FIN_PARTS
    live1 = i1 < n_all
    j1 = min(i1, n_all - 1)
    t0, q0 = i0 // (N_ACC * FIN_PARTS), i0 % (N_ACC * FIN_PARTS)
    t1, q1 = j1 // (N_ACC * FIN_PARTS), j1 % (N_ACC * FIN_PARTS)
    m0, p0 = q0 // FIN_PARTS, q0 % FIN_PARTS
    m1, p1 = q1 // FIN_PARTS, q1 % FIN_PARTS
    s0 = 0.0
    s1 = 0.0
    v0 = cuda.local.array(PART_LOADS, np.float64)
    v1 = cuda.local.array(PART_LOADS, np.float64)
    r = 0
    while p0 + r * FIN_PARTS < n_blk or (live1 and p1 + r * FIN_PARTS < n_blk):
        _part_loads_device(partial, t0, m0, p0, r, n_blk, v0)
        _part_loads_device(partial, t1, m1, p1, r, n_blk, v1)
        s0 = _part_adds_device(s0, p0, r, n_blk, v0)
        s1 = _part_adds_device(s1, p1, r, n_blk, v1)
        r += PART_LOADS
    return s0, s1


@inline_device
def _mix_finish_device(parts, pt, t, lane, base, scale, n_cols, norm_eps, hc_eps, iters, pre, post, comb):
    """One warp finishes token t from its parts parts[pt] (N_ACC x FIN_PARTS, added in part order): lanes 0-3
    pre, 4-7 post, 8-23 comb[i, j] (lane 8 + 4i + j). Every lane of the warp calls it; its shuffles are
    unconditional (the simulator's shuffle is a barrier of the block's live threads)."""
    acc = 0.0
    if lane <= N_MIX:
        for p in range(FIN_PARTS):
            acc += parts[pt, lane, p]
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


@bounded_jit(FIN_THREADS)
def hc_mix_finish_kernel(partial, base, scale, n_cols, norm_eps, hc_eps, iters, pre, post, comb):
    """One block per token. The partials are summed by FIN_PARTS threads per mix (_part_sum_device), then the
    first warp finishes (_mix_finish_device)."""
    grid_entry_device()
    t = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    parts = cuda.shared.array((1, N_ACC, FIN_PARTS), np.float64)
    if tid < N_ACC * FIN_PARTS:
        parts[0, tid // FIN_PARTS, tid % FIN_PARTS] = _part_sum_device(partial, t, tid // FIN_PARTS, tid % FIN_PARTS,
                                                                       partial.shape[1])
    cuda.syncthreads()
    if tid >= WARP:
        return                                   # warp-uniform: the first warp finishes alone
    _mix_finish_device(parts, 0, t, tid, base, scale, n_cols, norm_eps, hc_eps, iters, pre, post, comb)


@bounded_jit(THREADS, MIX_MIN_BLOCKS)
def hc_mix_fused_kernel(h2, fn, cols, partial, counter, base, scale, n_cols, norm_eps, hc_eps, iters, pre, post,
                        comb):
    """hc_mix_partial_kernel and hc_mix_finish_kernel in one launch (T <= FUSED_T_MAX, THREADS threads a block):
    each block writes its partials, then the block that draws the last ticket of `counter` (int32 [1], zero on
    entry; left zero) sums every token's partials and finishes them, warp w taking tokens w, w + 4, ... The
    same device functions as the two kernels, so the same bits (module docstring: memory order)."""
    fv = cuda.local.array(N_MIX, np.float32)
    _fn_column_device(fn, cols, fv)                 # before the entry: the weights (EARLY_READS)
    grid_entry_device()
    tid = cuda.threadIdx.x
    n_tok = h2.shape[0]
    n_blk = cuda.gridDim.x
    parts = cuda.shared.array((FUSED_T_MAX, N_ACC, FIN_PARTS), np.float64)
    _mix_partial_device(h2, fn, cols, partial, fv)
    if not last_block_device(counter, 0, n_blk):     # the block's partials, then its ticket (kernels.ticket)
        return                                   # block-uniform
    n_pairs = N_ACC * FIN_PARTS
    for i in range(tid, n_tok * n_pairs, 2 * THREADS):    # parts i and i + THREADS, their loads together
        s0, s1 = _part_sum_pair_device(partial, i, i + THREADS, n_blk)
        q = i % n_pairs
        parts[i // n_pairs, q // FIN_PARTS, q % FIN_PARTS] = s0
        j = i + THREADS
        if j < n_tok * n_pairs:
            q = j % n_pairs
            parts[j // n_pairs, q // FIN_PARTS, q % FIN_PARTS] = s1
    cuda.syncthreads()
    for t in range(tid // WARP, n_tok, THREADS // WARP):     # warp-uniform; no barrier after this
        _mix_finish_device(parts, t, t, tid % WARP, base, scale, n_cols, norm_eps, hc_eps, iters, pre, post, comb)


@bounded_jit(THREADS)
def hc_pre_kernel(h, pre, out):
    """out[t, d] = bf16(sum_i pre[t, i] h[t, i, d]); one thread per (t, d): d from the block's x index and the
    thread, t from its y index and steps of gridDim.y (no 64-bit division of a flat index)."""
    grid_entry_device()
    n_tok, n_s, d = h.shape
    k = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if k >= d:
        return
    t = cuda.blockIdx.y
    while t < n_tok:
        acc = 0.0
        for i in range(n_s):
            acc += np.float64(pre[t, i]) * np.float64(h[t, i, k])
        out[t, k] = round_bf16_device(np.float32(acc))
        t += cuda.gridDim.y


@inline_device
def _post_operands_device(post, comb, t, pv, cv):
    """pv = post[t], cv = comb[t]: the expand's 20 mixing values of token t, loaded together."""
    for i in range(HC):
        pv[i] = post[t, i]
        for j in range(HC):
            cv[i, j] = comb[t, i, j]


@inline_device
def _post_values_device(yv, hv, c, pv, cv, out, t, k):
    """out[t, j, k] = bf16(post[t, j] yv + sum_i comb[t, i, j] h[t, i, k]) for the four streams j (hc_post's
    arithmetic: the products exact in float64, added in stream order) on values already loaded: hv[i, c] = h[t, i,
    k], pv = post[t], cv = comb[t]."""
    for j in range(HC):
        acc = 0.0
        for i in range(HC):
            acc += np.float64(cv[i, j]) * np.float64(hv[i, c])
        out[t, j, k] = round_bf16_device(mul_rn_device(pv[j], yv) + np.float32(acc))


@bounded_jit(THREADS)
def hc_post_kernel(y, h, post, comb, out):
    """out[t, j, d] = bf16(post[t, j] y[t, d] + sum_i comb[t, i, j] h[t, i, d]); one thread per (t, d), laid out
    as hc_pre_kernel's. A thread loads its column, y, post and comb before its first store (one memory round trip:
    out may alias h, so a load after a store waited for it, and comb's and post's loads of the next stream came
    after the store of the one before)."""
    grid_entry_device()
    n_tok, n_s, d = h.shape
    k = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if k >= d:
        return
    hv = cuda.local.array((HC, 1), np.float32)              # constant indices only: registers
    pv = cuda.local.array(HC, np.float32)
    cv = cuda.local.array((HC, HC), np.float32)
    t = cuda.blockIdx.y
    while t < n_tok:
        yv = y[t, k]
        for i in range(HC):
            hv[i, 0] = h[t, i, k]
        _post_operands_device(post, comb, t, pv, cv)
        _post_values_device(yv, hv, 0, pv, cv, out, t, k)
        t += cuda.gridDim.y


@bounded_jit(THREADS)
def hc_post_moe_kernel(ye, ids, shared, h, post, comb, out):
    """hc_post_kernel of y = moe_combine(ye, ids, shared), y formed in registers (kernels.vq_gemv.combine_group_device,
    the combine kernel's arithmetic) and never written: a thread takes the combine's four columns of one token. Its
    state columns, post and comb are loaded first, then the combine's terms, all before the first use (one memory
    round trip where the combine's and then hc_post's loads took two or three); every column is read before any is
    written, so out may alias h."""
    grid_entry_device()
    n_tok, n_s, d = h.shape
    live, t, d0 = combine_slot_device(n_tok, d)
    if not live:
        return
    hv = cuda.local.array((HC, COMBINE_COLS), np.float32)    # constant indices only: registers
    pv = cuda.local.array(HC, np.float32)
    cv = cuda.local.array((HC, HC), np.float32)
    _post_operands_device(post, comb, t, pv, cv)
    for i in range(HC):
        for c in range(COMBINE_COLS):
            hv[i, c] = h[t, i, min(d0 + c, d - 1)]
    y0, y1, y2, y3 = combine_group_device(ye, ids, shared, t, d0, d)
    _post_values_device(y0, hv, 0, pv, cv, out, t, d0)
    if d0 + 1 < d:
        _post_values_device(y1, hv, 1, pv, cv, out, t, d0 + 1)
    if d0 + 2 < d:
        _post_values_device(y2, hv, 2, pv, cv, out, t, d0 + 2)
    if d0 + 3 < d:
        _post_values_device(y3, hv, 3, pv, cv, out, t, d0 + 3)


SIGNATURES = {
    "hc_mix_partial_kernel": "void(float32[:, :], float32[:, :], int64, float64[:, :, :])",
    "hc_mix_finish_kernel": "void(float64[:, :, :], float32[:], float32[:], int64, float32, float32, int64, "
                            "float32[:, :], float32[:, :], float32[:, :, :])",
    "hc_mix_fused_kernel": "void(float32[:, :], float32[:, :], int64, float64[:, :, :], int32[:], float32[:], "
                           "float32[:], int64, float32, float32, int64, float32[:, :], float32[:, :], "
                           "float32[:, :, :])",
    "hc_pre_kernel": "void(float32[:, :, :], float32[:, :], float32[:, :])",
    "hc_post_kernel": "void(float32[:, :], float32[:, :, :], float32[:, :], float32[:, :, :], float32[:, :, :])",
    "hc_post_moe_kernel": "void(float32[:, :], int32[:, :], float32[:, :], float32[:, :, :], float32[:, :], "
                          "float32[:, :, :], float32[:, :, :])",
}


def _check_state(h, name):
    shape = tuple(h.shape)
    if len(shape) != 3 or shape[1] != HC or h.dtype != np.float32:
        raise ValueError(f"{name}: h must be float32 [T, {HC}, D], got {h.dtype} {shape}")
    return shape


def hc_mixes(h, fn, base, scale, *, norm_eps, hc_eps, iters, out=None, scratch=None, stream=0):
    """h [T, 4, D] -> (pre [T, 4], post [T, 4], comb [T, 4, 4]) float32. fn [24, 4D], base [24], scale [3].
    T <= FUSED_T_MAX: one launch, whose ticket counter is a zero-filled scratch array made at the first such call
    (module docstring: make it eagerly, before a CUDA graph capture)."""
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
    h2 = h.reshape((n_tok, HC * d))                                         # [T, S*D]
    finish = (base, scale, HC * d, np.float32(norm_eps), np.float32(hc_eps), int(iters), *out)
    if n_tok <= FUSED_T_MAX:
        counter = _scratch(scratch, "hc_mix_counter", (1,), np.int32, stream, zero=True)
        hc_mix_fused_kernel[n_blk, THREADS, stream](h2, fn, COLS_PER_BLOCK, partial, counter, *finish)
    else:
        hc_mix_partial_kernel[n_blk, THREADS, stream](h2, fn, COLS_PER_BLOCK, partial)
        hc_mix_finish_kernel[n_tok, FIN_THREADS, stream](partial, *finish)
    return out


def hc_pre(h, pre, out=None, stream=0):
    """Collapse: h [T, 4, D], pre [T, 4] -> out [T, D] (BF16 values)."""
    n_tok, _, d = _check_state(h, "hc_pre")
    if tuple(pre.shape) != (n_tok, HC):
        raise ValueError(f"hc_pre: pre {pre.shape} must be [{n_tok}, {HC}]")
    if out is None:
        out = cuda.device_array((n_tok, d), np.float32, stream=stream)
    if n_tok * d:
        hc_pre_kernel[rows_grid((d + THREADS - 1) // THREADS, n_tok), THREADS, stream](h, pre, out)
    return out


def hc_post(y, h, post, comb, out=None, moe=None, stream=0):
    """Expand: y [T, D], h [T, 4, D], post [T, 4], comb [T, 4, 4] -> out [T, 4, D] (may be h itself). `moe` = (ye,
    ids, shared) of kernels.vq_gemv.moe_combine, with y None: y is that combine, formed in the same kernel and not
    written (one launch where the combine and hc_post took two; the same bits)."""
    n_tok, _, d = _check_state(h, "hc_post")
    if moe is not None:
        if y is not None:
            raise ValueError("hc_post: give y or moe, not both")
        if check_combine(*moe, "hc_post") != (n_tok, d):
            raise ValueError(f"hc_post: moe terms of {check_combine(*moe, 'hc_post')} do not fit h {h.shape}")
    elif tuple(y.shape) != (n_tok, d):
        raise ValueError(f"hc_post: y {y.shape} does not fit h {h.shape}")
    if tuple(post.shape) != (n_tok, HC) or tuple(comb.shape) != (n_tok, HC, HC):
        raise ValueError(f"hc_post: post {post.shape}, comb {comb.shape} do not fit h {h.shape}")
    if out is None:
        out = cuda.device_array((n_tok, HC, d), np.float32, stream=stream)
    if n_tok * d and moe is not None:
        n = n_tok * -(-d // COMBINE_COLS)
        hc_post_moe_kernel[-(-n // THREADS), THREADS, stream](*moe, h, post, comb, out)
    elif n_tok * d:
        hc_post_kernel[rows_grid((d + THREADS - 1) // THREADS, n_tok), THREADS, stream](y, h, post, comb, out)
    return out

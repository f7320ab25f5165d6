"""index_score variant 4: a warp per key row, the row's 256 bytes one coalesced load shared by shuffles, lane h
head h with its query in thread-local memory, blocks striding over the rows (at most SCORE_BLOCKS). Kept for
bench/dev/index_probe.py: on the H200 the fastest layout at 256 rows (1k context, 22 us per call in the decode
step) but 112 us at 16,384 rows (64k) against the launcher's 53."""
import numpy as np
from numba import cuda

from kernels.bf16 import bf16x4_device, mul_rn_device, round_bf16_device

THREADS = 128
WARP = 32
WARPS = THREADS // WARP
NI_MAX = 32
DI_MAX = 128
SCORE_BLOCKS = 256
NEG_INF = np.float32(-np.inf)


@cuda.jit(cache=True)
def index_score_kernel(q, wts, wscale, keys, positions, ratio, cand, cand_block, use_cand, out):
    """out[t, s]: lane h of a warp holds head h's query in registers (DI_MAX floats, zero past dI) and the warp
    takes key rows s = its index, + the number of warps, ...: lane c loads word c of the row (the whole row in
    one coalesced load, the next row's already in flight), the words reach every lane by shuffles, and lane 0
    adds the heads' rounded terms in head order (shared memory)."""
    lane = cuda.threadIdx.x % WARP
    wib = cuda.threadIdx.x // WARP
    t = cuda.blockIdx.y
    n_heads, di = q.shape[1], q.shape[2]
    n_rows = keys.shape[0]
    n_words = di // 4
    v_sh = cuda.shared.array((WARPS, WARP), np.float32)
    qr = cuda.local.array(DI_MAX, np.float32)      # the head's query (stack memory: L1 hits in the row loop)
    h = min(lane, n_heads - 1)
    on = lane < n_heads
    for d in range(DI_MAX):
        v = q[t, h, min(d, di - 1)]                 # in bounds whatever d; kept only for d < dI
        qr[d] = v if on and d < di else np.float32(0.0)
    w = round_bf16_device(mul_rn_device(wts[t, h], wscale)) if lane < n_heads else np.float32(0.0)
    lim = (positions[t] + 1) // ratio
    step = cuda.gridDim.x * WARPS
    s = cuda.blockIdx.x * WARPS + wib
    col = min(lane, n_words - 1)
    nxt = keys[min(s, n_rows - 1), col]
    while s < n_rows:                               # warp-uniform
        word = nxt if lane < n_words else np.uint64(0)
        if s + step < n_rows:
            nxt = keys[s + step, col]
        acc = np.float32(0.0)
        for c in range(DI_MAX // 4):                # products and partial sums exact: any order gives the same
            wc = np.uint64(cuda.shfl_sync(0xFFFFFFFF, np.int64(word), c))     # shuffles take signed words
            acc += (qr[4 * c] * bf16x4_device(wc, 0) + qr[4 * c + 1] * bf16x4_device(wc, 1)) + (
                qr[4 * c + 2] * bf16x4_device(wc, 2) + qr[4 * c + 3] * bf16x4_device(wc, 3))
        v_sh[wib, lane] = round_bf16_device(max(round_bf16_device(acc), np.float32(0.0)) * w)
        cuda.syncwarp(0xFFFFFFFF)
        if lane == 0:
            tot = np.float32(0.0)
            for j in range(NI_MAX):                 # head sum in head order, as the reference (+0 past nI)
                tot += v_sh[wib, j]
            v = round_bf16_device(tot)
            if s >= lim or (use_cand and cand[t, s // cand_block] == 0):
                v = NEG_INF
            out[t, s] = v
        cuda.syncwarp(0xFFFFFFFF)                  # v_sh is read before the next row overwrites it
        s += step



def grid(n_rows, n_tok):
    return (min(-(-n_rows // WARPS), SCORE_BLOCKS), n_tok), THREADS

"""index_score variant 2: a warp per key row, a lane per head, 4 rows per warp. Kept for bench/dev/index_probe.py (faster than variant 1 at 256 rows, slower at 16,384 on the H200)."""
import numpy as np
from numba import cuda

from kernels import inline_device
from kernels.bf16 import bf16x4_device, f32_bits, f32x2_device, mul_rn_device, round_bf16_device

THREADS = 128
WARP = 32
WARPS = THREADS // WARP
NI_MAX = 32
DI_MAX = 128
DI_PAIRS = DI_MAX // 2
NEG_INF = np.float32(-np.inf)
SCORE_ROWS_PER_WARP = 4
SCORE_ROWS = SCORE_ROWS_PER_WARP * WARPS


@cuda.jit(cache=True)
def index_score_kernel(q, wts, wscale, keys, positions, ratio, cand, cand_block, use_cand, out):
    """out[t, s]: one warp per key row at a time (SCORE_ROWS_PER_WARP rows each), lane h computing head h's dot
    product (the row's key words are one broadcast load for the warp, the queries sit in shared memory as
    [pair, head] so the lanes read consecutive words); the heads' rounded terms are added in head order by
    lane 0 through shared memory."""
    tid = cuda.threadIdx.x
    lane = tid % WARP
    warp = tid // WARP
    t = cuda.blockIdx.y
    n_heads, di = q.shape[1], q.shape[2]
    n_rows = keys.shape[0]
    n_words = di // 4
    q_sh = cuda.shared.array((DI_PAIRS, NI_MAX), np.uint64)
    w_sh = cuda.shared.array(NI_MAX, np.float32)
    v_sh = cuda.shared.array((WARPS, NI_MAX), np.float32)
    for k in range(tid, NI_MAX * (di // 2), THREADS):           # heads past n_heads are zero: they add +0
        c = k // NI_MAX
        h = k % NI_MAX
        v = np.uint64(0)
        if h < n_heads:
            v = np.uint64(f32_bits(q[t, h, 2 * c])) | (np.uint64(f32_bits(q[t, h, 2 * c + 1])) << np.uint64(32))
        q_sh[c, h] = v
    if tid < NI_MAX:
        w_sh[tid] = round_bf16_device(mul_rn_device(wts[t, tid], wscale)) if tid < n_heads else np.float32(0.0)
    cuda.syncthreads()
    w = w_sh[lane]
    lim = (positions[t] + 1) // ratio
    r0 = (cuda.blockIdx.x * WARPS + warp) * SCORE_ROWS_PER_WARP
    for rr in range(SCORE_ROWS_PER_WARP):
        s = r0 + rr
        if s >= n_rows:
            break                                   # warp-uniform
        acc = np.float32(0.0)
        for c0 in range(0, n_words, 4):             # four key words (16 dims) in flight; n_words % 4 == 0
            k0 = keys[s, c0]
            k1 = keys[s, c0 + 1]
            k2 = keys[s, c0 + 2]
            k3 = keys[s, c0 + 3]
            acc = _dot_word_device(k0, q_sh, 2 * c0, lane, acc)
            acc = _dot_word_device(k1, q_sh, 2 * c0 + 2, lane, acc)
            acc = _dot_word_device(k2, q_sh, 2 * c0 + 4, lane, acc)
            acc = _dot_word_device(k3, q_sh, 2 * c0 + 6, lane, acc)
        v_sh[warp, lane] = round_bf16_device(max(round_bf16_device(acc), np.float32(0.0)) * w)
        cuda.syncwarp(0xFFFFFFFF)
        if lane == 0:
            tot = np.float32(0.0)
            for h in range(NI_MAX):                 # head sum in head order, as the reference
                tot += v_sh[warp, h]
            v = round_bf16_device(tot)
            if s >= lim or (use_cand and cand[t, s // cand_block] == 0):
                v = NEG_INF
            out[t, s] = v
        cuda.syncwarp(0xFFFFFFFF)                  # v_sh is read before the next row overwrites it


@inline_device
def _dot_word_device(word, q_sh, p, lane, acc):
    """acc + the lane's head's query pairs p, p + 1 against the 4 BF16 of a key word (products exact)."""
    qa = q_sh[p, lane]
    qb = q_sh[p + 1, lane]
    acc += f32x2_device(qa, 0) * bf16x4_device(word, 0) + f32x2_device(qa, 1) * bf16x4_device(word, 1)
    return acc + (f32x2_device(qb, 0) * bf16x4_device(word, 2) + f32x2_device(qb, 1) * bf16x4_device(word, 3))



def grid(n_rows, n_tok):
    return (-(-n_rows // SCORE_ROWS), n_tok), THREADS

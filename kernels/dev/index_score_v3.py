"""index_score variant 3: a thread per key row with every head's accumulator in registers, the queries in shared
memory as float pairs read as broadcasts, key words as 8-byte BF16 loads. The launcher's kernel until the tensor-core
one (kernels.indexer) replaced it; kept for bench/dev/index_probe.py (39, 41 and 53 us per call at 1k, 16k and 64k
context in a V4.1 decode step on the H200)."""
import math

import numpy as np
from numba import cuda

from kernels.bf16 import bf16x4_device, f32_bits, f32x2_device, mul_rn_device, round_bf16_device
from kernels.pdl import grid_entry_device

WARP = 32
NI_MAX = 32
DI_MAX = 128
SCORE_THREADS = 64                  # key rows (a thread each) per block
DI_PAIRS = DI_MAX // 2
NEG_INF = np.float32(-np.inf)


@cuda.jit(cache=True)
def index_score_kernel(q, wts, wscale, keys, positions, ratio, cand, cand_block, use_cand, out):
    """out[t, s]: a thread per key row with all heads' accumulators in registers; per key word (4 dims, the next
    word's load in flight) every head's two query pairs come from shared memory as broadcasts; then the heads'
    rounded terms are added in head order."""
    grid_entry_device()
    tid = cuda.threadIdx.x
    t = cuda.blockIdx.y
    n_heads, di = q.shape[1], q.shape[2]
    n_rows = keys.shape[0]
    n_words = di // 4
    q_sh = cuda.shared.array((NI_MAX, DI_PAIRS), np.uint64)
    w_sh = cuda.shared.array(NI_MAX, np.float32)
    for k in range(tid, NI_MAX * DI_PAIRS, SCORE_THREADS):      # heads past n_heads and dims past di are zero
        h = k // DI_PAIRS
        c = k % DI_PAIRS
        v = np.uint64(0)
        if h < n_heads and 2 * c < di:
            v = np.uint64(f32_bits(q[t, h, 2 * c])) | (np.uint64(f32_bits(q[t, h, 2 * c + 1])) << np.uint64(32))
        q_sh[h, c] = v
    if tid < NI_MAX:
        w_sh[tid] = round_bf16_device(mul_rn_device(wts[t, tid], wscale)) if tid < n_heads else np.float32(0.0)
    cuda.syncthreads()
    s = cuda.blockIdx.x * SCORE_THREADS + tid
    if s >= n_rows:
        return                                      # no barrier follows
    acc = cuda.local.array(NI_MAX, np.float32)
    for h in range(NI_MAX):
        acc[h] = np.float32(0.0)
    nxt = keys[s, 0]
    for c in range(n_words):
        word = nxt
        if c + 1 < n_words:
            nxt = keys[s, c + 1]
        k0 = bf16x4_device(word, 0)
        k1 = bf16x4_device(word, 1)
        k2 = bf16x4_device(word, 2)
        k3 = bf16x4_device(word, 3)
        for h in range(NI_MAX):                     # products and partial sums exact: any order gives the same
            qa = q_sh[h, 2 * c]
            qb = q_sh[h, 2 * c + 1]
            acc[h] += (f32x2_device(qa, 0) * k0 + f32x2_device(qa, 1) * k1) + (
                f32x2_device(qb, 0) * k2 + f32x2_device(qb, 1) * k3)
    tot = np.float32(0.0)
    for h in range(NI_MAX):                         # head sum in head order, as the reference
        tot += round_bf16_device(max(round_bf16_device(acc[h]), np.float32(0.0)) * w_sh[h])
    v = round_bf16_device(tot)
    if s >= (positions[t] + 1) // ratio or (use_cand and cand[t, s // cand_block] == 0):
        v = NEG_INF
    out[t, s] = v


def grid(n_rows, n_tok):
    """(grid, threads) of a call over n_rows key rows and n_tok queries."""
    return (math.ceil(n_rows / SCORE_THREADS), n_tok), SCORE_THREADS

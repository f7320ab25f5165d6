"""index_score variant 1 (kernels/indexer.py before 2026-12-02): a thread owns two key rows for all heads, heads in groups of 8; 256 rows per block. Kept for bench/dev/index_probe.py."""
import numpy as np
from numba import cuda

from kernels.bf16 import bf16x4_device, f32_bits, f32x2_device, mul_rn_device, round_bf16_device

THREADS = 128
WARP = 32
WARPS = THREADS // WARP
NI_MAX = 32
DI_MAX = 128
DI_PAIRS = DI_MAX // 2
NEG_INF = np.float32(-np.inf)
SCORE_ROWS = 2 * THREADS
HEAD_GROUP = 8


@cuda.jit(cache=True)
def index_score_kernel(q, wts, wscale, keys, positions, ratio, cand, cand_block, use_cand, out):
    """out[t, s] for s in a block of 256 rows: thread rows s0 + tid and s0 + 128 + tid. Heads go in groups of
    HEAD_GROUP so the accumulators stay in registers; a group re-reads the rows' keys from L1."""
    tid = cuda.threadIdx.x
    t = cuda.blockIdx.y
    n_heads, di = q.shape[1], q.shape[2]
    n_rows = keys.shape[0]
    q_sh = cuda.shared.array((NI_MAX, DI_PAIRS), np.uint64)
    w_sh = cuda.shared.array(NI_MAX, np.float32)
    for k in range(tid, NI_MAX * (di // 2), THREADS):           # heads past n_heads are zero: they add +0
        h = k // (di // 2)
        c = k % (di // 2)
        v = np.uint64(0)
        if h < n_heads:
            v = np.uint64(f32_bits(q[t, h, 2 * c])) | (np.uint64(f32_bits(q[t, h, 2 * c + 1])) << np.uint64(32))
        q_sh[h, c] = v
    if tid < NI_MAX:
        w_sh[tid] = round_bf16_device(mul_rn_device(wts[t, tid], wscale)) if tid < n_heads else np.float32(0.0)
    cuda.syncthreads()
    sa = cuda.blockIdx.x * SCORE_ROWS + tid
    sb = sa + THREADS
    ra = min(sa, n_rows - 1)                      # clamped rows load valid memory; results are dropped
    rb = min(sb, n_rows - 1)
    acc_a = cuda.local.array(HEAD_GROUP, np.float32)
    acc_b = cuda.local.array(HEAD_GROUP, np.float32)
    ka = cuda.local.array(16, np.float32)
    kb = cuda.local.array(16, np.float32)
    tot_a = np.float32(0.0)
    tot_b = np.float32(0.0)
    for h0 in range(0, n_heads, HEAD_GROUP):
        for hh in range(HEAD_GROUP):
            acc_a[hh] = np.float32(0.0)
            acc_b[hh] = np.float32(0.0)
        for c in range(0, di // 4, 4):             # 16 dims per step: 4 words per row
            for u in range(4):
                wa = keys[ra, c + u]
                wb = keys[rb, c + u]
                for i in range(4):
                    ka[4 * u + i] = bf16x4_device(wa, i)
                    kb[4 * u + i] = bf16x4_device(wb, i)
            for hh in range(HEAD_GROUP):
                for p in range(8):
                    qp = q_sh[h0 + hh, 2 * c + p]
                    q0 = f32x2_device(qp, 0)
                    q1 = f32x2_device(qp, 1)
                    acc_a[hh] += q0 * ka[2 * p] + q1 * ka[2 * p + 1]
                    acc_b[hh] += q0 * kb[2 * p] + q1 * kb[2 * p + 1]
        for hh in range(HEAD_GROUP):               # head sum in head order, as the reference
            w = w_sh[h0 + hh]
            tot_a += round_bf16_device(max(round_bf16_device(acc_a[hh]), np.float32(0.0)) * w)
            tot_b += round_bf16_device(max(round_bf16_device(acc_b[hh]), np.float32(0.0)) * w)
    lim = (positions[t] + 1) // ratio
    for rr in range(2):
        s = sa if rr == 0 else sb
        if s < n_rows:
            v = round_bf16_device(tot_a if rr == 0 else tot_b)
            if s >= lim or (use_cand and cand[t, s // cand_block] == 0):
                v = NEG_INF
            out[t, s] = v



def grid(n_rows, n_tok):
    return (-(-n_rows // SCORE_ROWS), n_tok), THREADS

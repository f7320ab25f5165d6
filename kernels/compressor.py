"""The V4.1 KV compressor on the device: pooling of completed groups and the norm (ds4lib.ref.compressor.compress;
docs/architecture.md §6.1, erratum N7 in §1.2).

Owns: for ratio 2, each group of `ratio` consecutive positions whose last token arrives in this call pools
sum_r kv_r[d] * softmax_r(score_r[d]) per dimension (FP32, the reference's order: exp, sequential sum,
divide, multiply, sequential sum), rounds to BF16 and applies RMSNorm(norm_w); the rows of an incomplete
group are kept in a [ratio, Dh] state (kv and score) and completed by later calls. For ratio 1 the latent is
norm(kv_t) for every token (pass-through, no gate, no state).
Does not own: the wkv/wgate projections (gemv: FP32 output for ratio 2, BF16 for ratio 1), RoPE at g*ratio
and the FP4 simulation of the stored row (rope, gemv.act_quant_fp4_e4m3), the cache write (attention.cache_write).

One block per completed group; a thread owns Dh/128 dims, and the block sums the squares in float64
through shared memory. The state update is a second kernel so it never races with a group still reading
the rows it replaces.

Shapes: T tokens, Dh latent width (<= 512), G completed groups in the call, ratio r.
"""
import math

import numpy as np
from numba import cuda

from kernels import inline_device
from kernels.bf16 import exp_f32_device, mul_rn_device, round_bf16_device
from kernels.pdl import grid_entry_device
from kernels.warp import block_sum_rows_f64_device

__all__ = ["compress", "compress_pool_kernel", "compress_state_kernel", "SIGNATURES"]

THREADS = 128
DIMS_PER_THREAD = 4           # Dh <= 512
DH_MAX = THREADS * DIMS_PER_THREAD


@inline_device
def _row_device(kv, state, start_pos, p, d):
    """Row of position p at dim d: from this call's rows, or from the state (an earlier call)."""
    if p >= start_pos:
        return kv[p - start_pos, d]
    return state[p % state.shape[0], d]


@cuda.jit(cache=True)
def compress_pool_kernel(kv, score, state_kv, state_score, positions, ratio, norm_w, eps, out):
    """out[j] = RMSNorm(bf16(pool of group positions[0] // ratio + j)); ratio 1: out[j] = RMSNorm(kv[j]); rows j
    past the call's completed groups are zero."""
    grid_entry_device()
    j = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    dh = kv.shape[1]
    start_pos = positions[0]
    n_groups = (start_pos + kv.shape[0]) // ratio - start_pos // ratio
    if j >= n_groups:                                 # block-uniform
        for d in range(tid, dh, THREADS):
            out[j, d] = np.float32(0.0)
        return
    p0 = (start_pos // ratio + j) * ratio
    x = cuda.local.array(DIMS_PER_THREAD, np.float32)
    ssq = 0.0
    for m in range(DIMS_PER_THREAD):
        d = tid + m * THREADS
        v = np.float32(0.0)
        if d < dh:
            if ratio == 1:
                v = kv[j, d]
            else:
                smax = _row_device(score, state_score, start_pos, p0, d)
                for r in range(1, ratio):
                    smax = max(smax, _row_device(score, state_score, start_pos, p0 + r, d))
                wsum = np.float32(0.0)
                for r in range(ratio):
                    wsum += exp_f32_device(_row_device(score, state_score, start_pos, p0 + r, d) - smax)
                for r in range(ratio):
                    e = exp_f32_device(_row_device(score, state_score, start_pos, p0 + r, d) - smax)
                    v += mul_rn_device(_row_device(kv, state_kv, start_pos, p0 + r, d), e / wsum)
                v = round_bf16_device(v)
        x[m] = v
        ssq += np.float64(v) * np.float64(v)
    sh = cuda.shared.array((1, THREADS), np.float64)
    sh[0, tid] = ssq
    block_sum_rows_f64_device(sh, 1)
    var = np.float32(sh[0, 0] / dh)
    scale = np.float32(1.0) / np.float32(math.sqrt(var + eps))
    for m in range(DIMS_PER_THREAD):
        d = tid + m * THREADS
        if d < dh:
            out[j, d] = round_bf16_device(norm_w[d] * (x[m] * scale))


@cuda.jit(cache=True)
def compress_state_kernel(kv, score, positions, state_kv, state_score):
    """Rows of the trailing incomplete group -> state slot p mod ratio."""
    grid_entry_device()
    n_tok, dh = kv.shape
    ratio = state_kv.shape[0]
    start_pos = positions[0]
    end = start_pos + n_tok
    first = max(end // ratio * ratio, start_pos)
    g = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if g >= (end - first) * dh:
        return
    p = first + g // dh
    d = g % dh
    state_kv[p % ratio, d] = kv[p - start_pos, d]
    state_score[p % ratio, d] = score[p - start_pos, d]


SIGNATURES = {
    "compress_pool_kernel": "void(float32[:, :], float32[:, :], float32[:, :], float32[:, :], int64[:], int64, "
                            "float32[:], float32, float32[:, :])",
    "compress_state_kernel": "void(float32[:, :], float32[:, :], int64[:], float32[:, :], float32[:, :])",
}


def compress(kv, score, state_kv, state_score, positions, ratio, norm_w, eps, n_groups, out=None, stream=0):
    """kv, score [T, Dh] float32 (FP32 projections; for ratio 1 kv is the BF16 projection and score, state_kv,
    state_score are None) at the consecutive device positions [T] int64 -> latents [n_groups, Dh] pre-RoPE.

    Row j is group positions[0] // ratio + j for j < G = (p0 + T) // ratio - p0 // ratio, zero past G; n_groups
    (>= G) is the row count the caller reserves: G itself, or an upper bound when the positions live on the device
    only (a replayed decode step; kernels.step.group_rows gives each row's cache slot). The state [ratio, Dh] holds
    the rows of positions p0 - p0 % ratio .. p0 - 1 and is updated to hold the trailing incomplete group.
    """
    n_tok, dh = tuple(kv.shape)
    if kv.dtype != np.float32 or dh > DH_MAX or tuple(norm_w.shape) != (dh,) or ratio < 1:
        raise ValueError(f"compress: kv must be float32 [T, Dh <= {DH_MAX}] with norm_w [Dh], got {kv.shape}")
    if tuple(positions.shape) != (n_tok,) or positions.dtype != np.int64:
        raise ValueError(f"compress: positions must be int64 [{n_tok}]")
    if ratio == 1:
        score = state_kv = state_score = kv                  # unused by the ratio-1 path
    elif tuple(score.shape) != (n_tok, dh) or tuple(state_kv.shape) != (ratio, dh) \
            or tuple(state_score.shape) != (ratio, dh):
        raise ValueError(f"compress: score {score.shape} and states {state_kv.shape}, {state_score.shape} "
                         f"must be [T, Dh] and [{ratio}, Dh]")
    n_groups = int(n_groups)
    if out is None:
        out = cuda.device_array((n_groups, dh), np.float32, stream=stream)
    elif tuple(out.shape) != (n_groups, dh):
        raise ValueError(f"compress: out {out.shape} must be {(n_groups, dh)}")
    if n_groups:
        compress_pool_kernel[n_groups, THREADS, stream](kv, score, state_kv, state_score, positions, int(ratio),
                                                        norm_w, np.float32(eps), out)
    if ratio > 1 and n_tok:
        n_tail = min(n_tok, ratio - 1) * dh                  # the kernel keeps those of the trailing group
        compress_state_kernel[(n_tail + THREADS - 1) // THREADS, THREADS, stream](kv, score, positions, state_kv,
                                                                                  state_score)
    return out

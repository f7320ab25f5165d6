"""MoE router and the clamped SwiGLU step on the device (ds4lib.ref.moe.route, expert_ffn; docs/architecture.md §7).

Owns:
- `route`: logits = x W_gate^T (FP32 GEMV of the BF16 gate, kernels.gemv), then one block per token: its
  threads compute s = sqrt(softplus(logits / gate_temp)) for every expert and the selection score s + bias
  (+ a sidecar delta) into shared memory (all of a thread's loads issued before its arithmetic: one warp
  scoring 384 experts one dependent load after another took 15.6 us on the H200), then its first warp takes
  the top-k by (selection score descending, lower expert id first), weights = s at the chosen ids divided by
  (their sum + 1e-20) (sum in selection order) times route_scale. Each lane holds E/32 experts; the k
  rounds are warp arg-max reductions.
- `swiglu`: a = silu(min(g, limit)) * clamp(u, -limit, limit) (* routing weight of the row), BF16 — the
  elementwise step between the gate/up GEMVs and the down GEMV of an expert (routed or shared).
Does not own: the expert GEMVs (FP4/VQ weights: the quantized-format kernels), the expert-major reduction.

Shapes: T tokens, D hidden, E experts (<= 512), K active experts (<= 16), n rows of an expert batch, F width.
"""
import math

import numpy as np
from numba import cuda

from kernels.bf16 import exp_f32_device, log1p_f32_device, round_bf16_device
from kernels.gemv import gemv
from kernels.scratch import scratch_array as _scratch

__all__ = ["route", "swiglu", "route_topk_kernel", "swiglu_kernel", "SIGNATURES"]

WARP = 32
THREADS = 128
E_PER_LANE = 16               # experts per lane: E <= 512
E_MAX = WARP * E_PER_LANE
E_PER_BLOCK_THREAD = E_MAX // THREADS     # experts scored per thread of a routing block
K_MAX = 16
NEG_INF = np.float32(-np.inf)


@cuda.jit(device=True, inline=True)
def _better_device(v, e, v2, e2):
    """(v2, e2) beats (v, e): larger value, then lower id."""
    return v2 > v or (v2 == v and e2 < e)


@cuda.jit(cache=True)
def route_topk_kernel(logits, bias, delta, has_delta, gate_temp, top_k, route_scale, normalise, scores, ids,
                      weights):
    """One block of THREADS per token: scores [T, E], ids [T, K] int32, weights [T, K]. The block's threads score
    the experts (thread i: experts i, i + THREADS, ..., their loads issued before any arithmetic) into shared
    memory; then the first warp takes the top-k, each lane holding experts lane + 32 j."""
    tid = cuda.threadIdx.x
    t = cuda.blockIdx.x
    n_tok, n_exp = logits.shape
    sh_sel = cuda.shared.array(E_MAX, np.float32)
    sh_raw = cuda.shared.array(E_MAX, np.float32)
    xs = cuda.local.array(E_PER_BLOCK_THREAD, np.float32)
    bs = cuda.local.array(E_PER_BLOCK_THREAD, np.float32)
    ds = cuda.local.array(E_PER_BLOCK_THREAD, np.float32)
    for i in range(E_PER_BLOCK_THREAD):          # loads first: in bounds whatever e, so none waits on another
        ec = min(tid + THREADS * i, n_exp - 1)
        xs[i] = logits[t, ec]
        bs[i] = bias[ec]
        ds[i] = delta[ec]
    for i in range(E_PER_BLOCK_THREAD):
        e = tid + THREADS * i
        if e < n_exp:
            x = xs[i] / gate_temp
            sp = x if x > np.float32(20.0) else log1p_f32_device(exp_f32_device(min(x, np.float32(20.0))))
            sc = np.float32(math.sqrt(sp))
            scores[t, e] = sc
            v = sc + bs[i]
            if has_delta:
                v = v + ds[i]
            sh_sel[e] = v
            sh_raw[e] = sc
    cuda.syncthreads()
    if tid >= WARP:
        return                                     # warp-uniform: the first warp selects
    lane = tid
    sel = cuda.local.array(E_PER_LANE, np.float32)     # constant indices only: registers
    for j in range(E_PER_LANE):
        e = lane + WARP * j
        sel[j] = sh_sel[e] if e < n_exp else NEG_INF
    got_id = cuda.shared.array(K_MAX, np.int32)
    got_w = cuda.shared.array(K_MAX, np.float32)
    taken = np.uint32(0)
    for i in range(top_k):
        bv = NEG_INF
        be = np.int32(0x7FFFFFFF)
        for j in range(E_PER_LANE):
            e = lane + WARP * j
            if e < n_exp and ((taken >> np.uint32(j)) & np.uint32(1)) == 0 and _better_device(bv, be, sel[j], e):
                bv = sel[j]
                be = np.int32(e)
        off = WARP // 2
        while off > 0:
            v2 = cuda.shfl_xor_sync(0xFFFFFFFF, bv, off)
            e2 = cuda.shfl_xor_sync(0xFFFFFFFF, be, off)
            if _better_device(bv, be, v2, e2):
                bv = v2
                be = e2
            off //= 2
        if lane == be % WARP:
            taken |= np.uint32(1) << np.uint32(be // WARP)
        if lane == 0:
            got_w[i] = sh_raw[be]
            got_id[i] = be
    cuda.syncwarp(0xFFFFFFFF)
    if lane == 0:
        total = np.float32(0.0)
        for i in range(top_k):
            total += got_w[i]
        for i in range(top_k):
            w = got_w[i]
            if normalise and top_k > 1:
                w = w / (total + np.float32(1e-20))
            ids[t, i] = got_id[i]
            weights[t, i] = w * route_scale


@cuda.jit(cache=True)
def swiglu_kernel(g, u, w, has_w, limit, out):
    """out[r, f] = bf16(w[r] * (silu(min(g, limit)) * clamp(u, +-limit))); limit <= 0: no clamp."""
    n, f = g.shape
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i >= n * f:
        return
    r = i // f
    c = i % f
    gv = g[r, c]
    uv = u[r, c]
    if limit > np.float32(0.0):
        uv = min(max(uv, -limit), limit)
        gv = min(gv, limit)
    a = gv / (np.float32(1.0) + exp_f32_device(-gv)) * uv
    if has_w:
        a = w[r] * a
    out[r, c] = round_bf16_device(a)


SIGNATURES = {
    "route_topk_kernel": "void(float32[:, :], float32[:], float32[:], boolean, float32, int64, float32, boolean, "
                         "float32[:, :], int32[:, :], float32[:, :])",
    "swiglu_kernel": "void(float32[:, :], float32[:, :], float32[:], boolean, float32, float32[:, :])",
}




def route(x, gate_w, gate_bias, top_k, route_scale, *, gate_temp=1.0, bias_delta=None, normalise=True,
          out=None, scratch=None, stream=0):
    """x [T, D] float32, gate_w [E, D] uint16 BF16 bits, gate_bias [E] float32 (+ bias_delta [E]) ->
    (scores [T, E], ids [T, K] int32, weights [T, K]) as ds4lib.ref.moe.route (score_func sqrtsoftplus)."""
    n_tok = x.shape[0]
    n_exp = gate_w.shape[0]
    if n_exp > WARP * E_PER_LANE or not 0 < top_k <= min(K_MAX, n_exp) or tuple(gate_bias.shape) != (n_exp,):
        raise ValueError(f"route: {n_exp} experts (<= {WARP * E_PER_LANE}), top_k {top_k} (<= {K_MAX}), "
                         f"bias {gate_bias.shape}")
    if bias_delta is not None and tuple(bias_delta.shape) != (n_exp,):
        raise ValueError(f"route: bias_delta must be [{n_exp}]")
    if out is None:
        out = (cuda.device_array((n_tok, n_exp), np.float32, stream=stream),
               cuda.device_array((n_tok, top_k), np.int32, stream=stream),
               cuda.device_array((n_tok, top_k), np.float32, stream=stream))
    if n_tok == 0:
        return out
    logits = gemv(x, gate_w, out_bf16=False, out=_scratch(scratch, "logits", (n_tok, n_exp), np.float32, stream),
                  stream=stream)
    has_delta = bias_delta is not None
    delta = bias_delta if has_delta else gate_bias
    route_topk_kernel[n_tok, THREADS, stream](
        logits, gate_bias, delta, has_delta, np.float32(gate_temp), int(top_k), np.float32(route_scale),
        bool(normalise), *out)
    return out


def swiglu(g, u, limit, weights=None, out=None, scratch=None, stream=0):
    """g, u [n, F] float32 (BF16 GEMV outputs), weights [n] (routed rows) -> out [n, F] BF16 values."""
    shape = tuple(g.shape)
    if len(shape) != 2 or tuple(u.shape) != shape or g.dtype != np.float32:
        raise ValueError(f"swiglu: g {g.shape} and u {u.shape} must be float32 [n, F]")
    has_w = weights is not None
    if has_w and tuple(weights.shape) != (shape[0],):
        raise ValueError(f"swiglu: weights must be [{shape[0]}]")
    if out is None:
        out = cuda.device_array(shape, np.float32, stream=stream)
    n = shape[0] * shape[1]
    if n:
        w = weights if has_w else _scratch(scratch, "no_weights", (1,), np.float32, stream)
        swiglu_kernel[(n + THREADS - 1) // THREADS, THREADS, stream](g, u, w, has_w, np.float32(limit), out)
    return out

"""MoE router and the clamped SwiGLU step on the device (ds4lib.ref.moe.route, expert_ffn; docs/architecture.md §7).

Owns:
- `route`: logits = x W_gate^T (FP32 GEMV of the BF16 gate, kernels.gemv), then one block per token: its
  threads compute s = sqrt(softplus(logits / gate_temp)) for every expert and the selection score s + bias
  (+ a sidecar delta), each thread for the E/THREADS experts it holds in registers (all of a thread's loads
  issued before its arithmetic: one warp scoring 384 experts one dependent load after another took 15.6 us on the
  H200), then the first warp takes the top-k by (selection score descending, lower expert id first), weights = s
  at the chosen ids divided by (their sum + 1e-20) (sum in selection order) times route_scale. A round is each
  lane's best untaken expert of its E/32 (four independent compare chains), then a warp shuffle arg-max: no
  barrier a round (`_make_route_block_device`).
  One token (decode) takes one launch, `route_gemv_kernel`: the gate's GEMV blocks (kernels.gemv's device function)
  write the logits, and the last block to draw a ticket routes (the same device functions, the same bits; a launch
  fewer a MoE layer on the decode step's critical path; ROUTE_IN_GEMV switches it off for A/B runs).
  With a VQ plan (one token only), the same block also writes the expert-major work list kernels.vq_gemv.vq_plan
  would make of the chosen ids (K distinct ids: K tiles of one pair each, experts ascending; lane k places pair k
  at its id's rank), so decode launches no plan kernel.
- `swiglu`: a = silu(min(g, limit)) * clamp(u, -limit, limit) (* routing weight of the row), BF16 — the
  elementwise step between the gate/up GEMVs and the down GEMV of an expert (routed or shared); with `out_q` the
  same kernel also writes act_quant_fp8(a) (block 32: with F % 32 == 0 a warp's 32 elements are one block of a
  row, so the amax is a shuffle reduction; kernels.fp8.act_quant_fp8_lane_device), and with `im` too out_q staged
  as the integer tensor-core path's operand (kernels.im_operand.im_stage_lane_device: the shared expert's w2
  launches no staging). g and u may be strided views (the two halves of one [n, 2F] GEMV output).
Does not own: the expert GEMVs (FP4/VQ weights: the quantized-format kernels), the expert-major reduction, the
plan for several tokens (kernels.vq_gemv.vq_plan).

Shapes: T tokens, D hidden, E experts (<= 512), K active experts (<= 16), n rows of an expert batch, F width,
G = 32 quant block.
"""
import math

import numpy as np
from numba import cuda

from kernels import bounded_jit, inline_device
from kernels.bf16 import exp_f32_device, log1p_f32_device, round_bf16_device
from kernels.fp8 import act_quant_fp8_lane_device
from kernels.gemv import BLOCK_WARPS as GEMV_BLOCK_WARPS, gemv, gemv_rows_t1_device, launch_geometry
from kernels.im_operand import check_im_staged, im_stage_lane_device
from kernels.pdl import grid_entry_device
from kernels.scratch import scratch_array as _scratch
from kernels.ticket import last_block_device

__all__ = ["route", "swiglu", "swiglu_value_device", "swiglu_scaled_device", "route_topk_kernel", "route_gemv_kernel",
           "route_in_gemv", "swiglu_kernel", "swiglu_q_kernel", "swiglu_qi_kernel", "SIGNATURES"]

WARP = 32
LOG2_WARP = WARP.bit_length() - 1
THREADS = 128
E_MAX = 512                   # experts a router takes
K_MAX = 16
ROUTE_IN_GEMV = True          # decode (T = 1): the gate's GEMV and the routing in one launch (route_gemv_kernel)
QUANT_BLOCK = 32              # act_quant_fp8's block
NEG_INF = np.float32(-np.inf)


@inline_device
def _better_device(v, e, v2, e2):
    """(v2, e2) beats (v, e): larger value, then lower id (bitwise, not short-circuit: no branch, so no convergence
    barrier in a shuffle step)."""
    return (v2 > v) | ((v2 == v) & (e2 < e))


@inline_device
def _write_plan_device(got_id, top_k, lane, pairs, tiles, n_tiles):
    """vq_plan_kernel's plan of one token's K distinct ids: lane k < K places pair k (= t*K + k, t = 0) at the rank
    of its id, with a tile (id, rank, 1) of its own; n_tiles = K."""
    if lane < top_k:
        e = got_id[lane]
        rank = 0
        for k in range(top_k):
            if got_id[k] < e:
                rank += 1
        pairs[rank] = lane
        tiles[rank, 0] = e
        tiles[rank, 1] = rank
        tiles[rank, 2] = 1
    if lane == 0:
        n_tiles[0] = top_k


SLOTS = E_MAX // WARP         # experts a lane of the selecting warp holds
CHAINS = 4                    # independent compare chains of a lane's scan (SLOTS % CHAINS == 0)
NO_ID = np.int32(0x7FFFFFFF)  # a round's id when no untaken expert has a score that is a number


@inline_device
def _untaken_best_device(vals, lane, taken):
    """The best (larger value, then lower id) untaken expert of a lane's SLOTS (experts lane, lane + 32, ...; their
    selection scores in vals) whose score is a number, or (-inf, NO_ID): CHAINS independent chains over alternate
    slots, then their bests in chain order. The order is total on distinct ids, so this is the one arg-max a linear
    scan from (-inf, NO_ID) finds."""
    cv = cuda.local.array(CHAINS, np.float32)        # constant indices only: registers
    ce = cuda.local.array(CHAINS, np.int32)
    for c in range(CHAINS):
        cv[c] = NEG_INF
        ce[c] = NO_ID
    for i in range(SLOTS // CHAINS):
        for c in range(CHAINS):
            j = i * CHAINS + c
            e = np.int32(lane + WARP * j)
            if ((taken >> np.uint32(j)) & np.uint32(1)) == 0 and _better_device(cv[c], ce[c], vals[j], e):
                cv[c] = vals[j]
                ce[c] = e
    bv = cv[0]
    be = ce[0]
    for c in range(1, CHAINS):
        if _better_device(bv, be, cv[c], ce[c]):
            bv = cv[c]
            be = ce[c]
    return bv, be


@inline_device
def _warp_best_device(v, e):
    """Every lane's (v, e) -> the warp's best (larger value, then lower id) in every lane: an xor-shuffle arg-max.
    The values are numbers or -inf (the order is total on distinct ids), so the tree's shape does not matter."""
    off = WARP // 2
    while off > 0:
        v2 = cuda.shfl_xor_sync(0xFFFFFFFF, v, off)
        e2 = cuda.shfl_xor_sync(0xFFFFFFFF, e, off)
        if _better_device(v, e, v2, e2):
            v = v2
            e = e2
        off //= 2
    return v, e


def _make_route_block_device(threads):
    """The routing of token t by a block of `threads` threads (a power of two, 32 .. E_MAX): scores [T, E], ids
    [T, K], weights [T, K] and, with has_plan, the VQ plan of the ids. Thread i scores experts i, i + threads, ...
    (their loads issued before any arithmetic) into shared memory; after one barrier the first warp alone takes the
    K rounds, lane l holding experts l, l + 32, ... (SLOTS of them, a bit each of `taken`): a round is each lane's
    best untaken expert (_untaken_best_device: a few dependent compares over registers), the warp's shuffle arg-max
    and one bit set, no barrier (a block arg-max a round, with its barrier and the warps' bests through shared
    memory, took ~0.73 us a round on an H100: bench/dev/route_probe.py). NaN scores are never chosen; a round with
    no score left that is a number gives NO_ID (its weight: the last expert's score). Every thread of the block must
    call it (its barrier); the choice and the weights do not depend on `threads`."""
    per = E_MAX // threads                       # experts a thread scores

    @inline_device
    def route_block_device(logits, t, bias, delta, has_delta, gate_temp, top_k, route_scale, normalise, scores, ids,
                           weights, has_plan, pairs, tiles, n_tiles):
        tid = cuda.threadIdx.x
        lane = tid % WARP
        n_exp = logits.shape[1]
        sh_raw = cuda.shared.array(E_MAX, np.float32)
        sh_sel = cuda.shared.array(E_MAX, np.float32)
        got_id = cuda.shared.array(K_MAX, np.int32)
        got_w = cuda.shared.array(K_MAX, np.float32)
        xs = cuda.local.array(per, np.float32)       # constant indices only: registers
        bs = cuda.local.array(per, np.float32)
        ds = cuda.local.array(per, np.float32)
        for i in range(per):                         # loads first: in bounds whatever e, so none waits on another
            ec = min(tid + threads * i, n_exp - 1)
            xs[i] = logits[t, ec]
            bs[i] = bias[ec]
            ds[i] = delta[ec]
        for i in range(per):
            e = tid + threads * i
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
            return                                   # warp-uniform: the first warp chooses and writes
        vals = cuda.local.array(SLOTS, np.float32)   # constant indices only: registers
        taken = np.uint32(0)                         # bit j: expert lane + 32 j chosen (or past n_exp)
        for j in range(SLOTS):
            vals[j] = sh_sel[min(lane + WARP * j, n_exp - 1)]
            if lane + WARP * j >= n_exp:
                taken |= np.uint32(1) << np.uint32(j)
        for r in range(top_k):
            bv, be = _untaken_best_device(vals, lane, taken)
            bv, be = _warp_best_device(bv, be)
            ub = np.uint32(be)                       # 32-bit: be is an id or NO_ID, both >= 0
            if ub < np.uint32(n_exp) and (ub & np.uint32(WARP - 1)) == np.uint32(lane):
                taken |= np.uint32(1) << (ub >> np.uint32(LOG2_WARP))
            if lane == 0:
                got_id[r] = be
                got_w[r] = sh_raw[min(be, n_exp - 1)]
        cuda.syncwarp(0xFFFFFFFF)                    # lane 0's got_id / got_w before every lane reads them
        if lane < top_k:
            total = np.float32(0.0)
            for i in range(top_k):                   # in selection order, as every lane adds them
                total += got_w[i]
            w = got_w[lane]
            if normalise and top_k > 1:
                w = w / (total + np.float32(1e-20))
            ids[t, lane] = got_id[lane]
            weights[t, lane] = w * route_scale
        if has_plan:
            _write_plan_device(got_id, top_k, lane, pairs, tiles, n_tiles)
    return route_block_device


_route_block_device = _make_route_block_device(THREADS)
_route_gemv_block_device = _make_route_block_device(WARP * GEMV_BLOCK_WARPS)


@cuda.jit(cache=True)
def route_topk_kernel(logits, bias, delta, has_delta, gate_temp, top_k, route_scale, normalise, scores, ids,
                      weights, has_plan, pairs, tiles, n_tiles):
    """One block of THREADS per token: scores [T, E], ids [T, K] int32, weights [T, K]; has_plan (T = 1 only): also
    pairs [K], tiles [K, 3], n_tiles [1] as vq_plan_kernel writes them for these ids (_make_route_block_device)."""
    grid_entry_device()
    _route_block_device(logits, cuda.blockIdx.x, bias, delta, has_delta, gate_temp, top_k, route_scale, normalise,
                        scores, ids, weights, has_plan, pairs, tiles, n_tiles)


@bounded_jit(WARP * GEMV_BLOCK_WARPS)
def route_gemv_kernel(x64, w64, split, logits, counter, bias, delta, has_delta, gate_temp, top_k, route_scale,
                      normalise, scores, ids, weights, has_plan, pairs, tiles, n_tiles):
    """The gate's GEMV of one token (kernels.gemv's one-token BF16 blocks: logits [1, E], FP32) and its routing in
    one launch: every block writes its rows' logits, and the block that draws the last ticket of `counter` (int32
    [1], zero on entry; left zero) routes the token with route_topk_kernel's device function. The same device
    functions as the two launches, so the same bits. Memory order: kernels.ticket's last-block pattern (a barrier
    after the logits' stores, thread 0's acquire-release ticket, a barrier before the last block's loads)."""
    grid_entry_device()
    gemv_rows_t1_device(x64, w64, logits.shape[1], split, False, logits)
    if not last_block_device(counter, 0, cuda.gridDim.x):
        return                                   # block-uniform
    _route_gemv_block_device(logits, 0, bias, delta, has_delta, gate_temp, top_k, route_scale, normalise, scores,
                             ids, weights, has_plan, pairs, tiles, n_tiles)


@inline_device
def swiglu_scaled_device(gv, uv, wr, has_w, limit):
    """bf16(wr * (silu(min(g, limit)) * clamp(u, +-limit))) of one element's g and u, wr its row's weight w[r]
    (used only when has_w); limit <= 0: no clamp. The one definition of the step's arithmetic (swiglu's kernels
    through swiglu_value_device; kernels.vq_gemv's staging, which loads a row's weight once for its 8 elements)."""
    if limit > np.float32(0.0):
        uv = min(max(uv, -limit), limit)
        gv = min(gv, limit)
    a = gv / (np.float32(1.0) + exp_f32_device(-gv)) * uv
    if has_w:
        a = wr * a
    return round_bf16_device(a)


@inline_device
def swiglu_value_device(gv, uv, w, has_w, r, limit):
    """swiglu_scaled_device with the weight read from w[r] (only when has_w)."""
    return swiglu_scaled_device(gv, uv, w[r] if has_w else np.float32(0.0), has_w, limit)


@inline_device
def _swiglu_device(g, u, w, has_w, limit, r, c):
    return swiglu_value_device(g[r, c], u[r, c], w, has_w, r, limit)


@cuda.jit(cache=True)
def swiglu_kernel(g, u, w, has_w, limit, out):
    """out[r, f] = bf16(w[r] * (silu(min(g, limit)) * clamp(u, +-limit))); limit <= 0: no clamp."""
    grid_entry_device()
    n, f = g.shape
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i >= n * f:
        return
    r = i // f
    c = i % f
    out[r, c] = _swiglu_device(g, u, w, has_w, limit, r, c)


@cuda.jit(cache=True)
def swiglu_q_kernel(g, u, w, has_w, limit, out, out_q):
    """swiglu_kernel and out_q = act_quant_fp8(out) (F % 32 == 0: a warp's elements are one block of a row, and
    a warp is wholly inside or wholly past the n*F elements, so its return is warp-uniform)."""
    grid_entry_device()
    _swiglu_q_device(g, u, w, has_w, limit, out, out_q, out_q, out_q, False)      # (ixd, ips: not read)


@cuda.jit(cache=True)
def swiglu_qi_kernel(g, u, w, has_w, limit, out, out_q, ixd, ips):
    """swiglu_q_kernel, and out_q staged as the integer tensor-core path's operand (ixd, ips: what
    kernels.q4k_gemv.im_stage(out_q, quantize=False) writes for finite values; kernels.im_operand
    .im_stage_lane_device on the warp's block of 32): the shared expert's down projection launches no staging."""
    grid_entry_device()
    _swiglu_q_device(g, u, w, has_w, limit, out, out_q, ixd, ips, True)


@inline_device
def _swiglu_q_device(g, u, w, has_w, limit, out, out_q, ixd, ips, im):
    """The two quantising kernels' one body (`im`: a constant of the caller's)."""
    n, f = g.shape
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i >= n * f:
        return
    r = i // f
    c = i % f
    a = _swiglu_device(g, u, w, has_w, limit, r, c)
    q = act_quant_fp8_lane_device(a)
    if im:
        lane = cuda.threadIdx.x % QUANT_BLOCK      # a warp: one block of 32 (THREADS and F multiples of 32)
        im_stage_lane_device(q, (i - lane) // QUANT_BLOCK, lane, True, ixd, ips)
    out[r, c] = a
    out_q[r, c] = q


SIGNATURES = {
    "route_topk_kernel": "void(float32[:, :], float32[:], float32[:], boolean, float32, int64, float32, boolean, "
                         "float32[:, :], int32[:, :], float32[:, :], boolean, int32[:], int32[:, :], int32[:])",
    "route_gemv_kernel": "void(uint64[:, :], uint64[:, ::1], int64, float32[:, :], int32[:], float32[:], float32[:], "
                         "boolean, float32, int64, float32, boolean, float32[:, :], int32[:, :], float32[:, :], "
                         "boolean, int32[:], int32[:, :], int32[:])",
    "swiglu_kernel": "void(float32[:, :], float32[:, :], float32[:], boolean, float32, float32[:, :])",
    "swiglu_q_kernel": "void(float32[:, :], float32[:, :], float32[:], boolean, float32, float32[:, :], "
                       "float32[:, :])",
    "swiglu_qi_kernel": "void(float32[:, :], float32[:, :], float32[:], boolean, float32, float32[:, :], "
                        "float32[:, :], uint32[:], float32[:])",
}


def route(x, gate_w, gate_bias, top_k, route_scale, *, gate_temp=1.0, bias_delta=None, normalise=True,
          plan=None, out=None, scratch=None, stream=0):
    """x [T, D] float32, gate_w [E, D] uint16 BF16 bits, gate_bias [E] float32 (+ bias_delta [E]) ->
    (scores [T, E], ids [T, K] int32, weights [T, K]) as ds4lib.ref.moe.route (score_func sqrtsoftplus).

    `plan` (T = 1 only): a kernels.vq_gemv.VQPlan for K pairs of E experts whose pairs, tiles and n_tiles the
    routing kernel fills as vq_plan(ids, E) would (plan.ids is not read; give the plan ids = out[1])."""
    n_tok = x.shape[0]
    n_exp = gate_w.shape[0]
    if n_exp > E_MAX or not 0 < top_k <= min(K_MAX, n_exp) or tuple(gate_bias.shape) != (n_exp,):
        raise ValueError(f"route: {n_exp} experts (<= {E_MAX}), top_k {top_k} (<= {K_MAX}), "
                         f"bias {gate_bias.shape}")
    if bias_delta is not None and tuple(bias_delta.shape) != (n_exp,):
        raise ValueError(f"route: bias_delta must be [{n_exp}]")
    has_plan = plan is not None
    if has_plan:
        _check_plan(plan, n_tok, n_exp, top_k)
    if out is None:
        out = (cuda.device_array((n_tok, n_exp), np.float32, stream=stream),
               cuda.device_array((n_tok, top_k), np.int32, stream=stream),
               cuda.device_array((n_tok, top_k), np.float32, stream=stream))
    if n_tok == 0:
        return out
    logits = _scratch(scratch, "logits", (n_tok, n_exp), np.float32, stream)
    has_delta = bias_delta is not None
    delta = bias_delta if has_delta else gate_bias
    if has_plan:
        pairs, tiles, n_tiles = plan.pairs, plan.tiles, plan.n_tiles
    else:
        pairs = n_tiles = _scratch(scratch, "no_plan", (1,), np.int32, stream)         # never written
        tiles = _scratch(scratch, "no_plan_tiles", (1, 3), np.int32, stream)
    args = (gate_bias, delta, has_delta, np.float32(gate_temp), int(top_k), np.float32(route_scale), bool(normalise),
            *out, has_plan, pairs, tiles, n_tiles)
    if ROUTE_IN_GEMV and route_in_gemv(x, gate_w):
        w64 = gate_w.view(np.uint64)
        grid, threads, split = launch_geometry(n_exp, w64.shape[1])
        counter = _scratch(scratch, "route_counter", (1,), np.int32, stream, zero=True)
        route_gemv_kernel[grid, threads, stream](x.view(np.uint64), w64, split, logits, counter, *args)
        return out
    gemv(x, gate_w, out_bf16=False, out=logits, stream=stream)
    route_topk_kernel[n_tok, THREADS, stream](logits, *args)
    return out


def route_in_gemv(x, gate_w):
    """Whether `route` of x takes the one-launch kernel (route_gemv_kernel): one token of float32 (C-contiguous) and
    a BF16 gate [E, K] (K % 4 == 0) that x fits; anything else takes kernels.gemv then route_topk_kernel (whose
    gemv refuses what does not fit)."""
    return (x.ndim == 2 and x.shape[0] == 1 and x.dtype == np.float32 and x.flags["C_CONTIGUOUS"]
            and gate_w.ndim == 2 and gate_w.dtype == np.uint16 and gate_w.flags["C_CONTIGUOUS"]
            and x.shape[1] == gate_w.shape[1] and gate_w.shape[1] % 4 == 0)


def _check_plan(plan, n_tok, n_exp, top_k):
    if n_tok != 1:
        raise ValueError(f"route: a plan is written for one token only (T = {n_tok}: use kernels.vq_gemv.vq_plan)")
    if any(not hasattr(plan, f) for f in ("pairs", "tiles", "n_tiles", "n_pairs", "n_experts")) \
            or plan.n_pairs != top_k or plan.n_experts != n_exp:
        raise ValueError(f"route: plan must be a VQPlan of {top_k} pairs over {n_exp} experts")
    ok = (plan.pairs.dtype == np.int32 and plan.tiles.dtype == np.int32 and plan.n_tiles.dtype == np.int32
          and tuple(plan.pairs.shape) == (top_k,) and tuple(plan.tiles.shape) == (top_k, 3)
          and tuple(plan.n_tiles.shape) == (1,))
    if not ok:
        raise ValueError(f"route: plan arrays must be int32 pairs [{top_k}], tiles [{top_k}, 3], n_tiles [1]")


def swiglu(g, u, limit, weights=None, out=None, out_q=None, im=None, scratch=None, stream=0):
    """g, u [n, F] float32 (BF16 GEMV outputs; strided views allowed), weights [n] (routed rows) -> out [n, F] BF16
    values; with out_q [n, F] (F % 32 == 0) also out_q = act_quant_fp8(out) from the same kernel; with `im` (and
    out_q) = (digits, pairs) of kernels.im_operand.im_stage_shapes(n, F) also out_q staged as the integer
    tensor-core path's operand, the bits kernels.q4k_gemv.im_stage(out_q, quantize=False) writes (finite values), for
    q4k_gemv(..., staged=im) (the shared expert's w2: its staging launch goes)."""
    shape = tuple(g.shape)
    if len(shape) != 2 or tuple(u.shape) != shape or g.dtype != np.float32 or u.dtype != np.float32:
        raise ValueError(f"swiglu: g {g.shape} and u {u.shape} must be float32 [n, F]")
    has_w = weights is not None
    if has_w and tuple(weights.shape) != (shape[0],):
        raise ValueError(f"swiglu: weights must be [{shape[0]}]")
    if out is None:
        out = cuda.device_array(shape, np.float32, stream=stream)
    elif tuple(out.shape) != shape or out.dtype != np.float32:
        raise ValueError(f"swiglu: out must be float32 {list(shape)}, got {out.dtype} {tuple(out.shape)}")
    if out_q is not None and (tuple(out_q.shape) != shape or out_q.dtype != np.float32 or shape[1] % QUANT_BLOCK):
        raise ValueError(f"swiglu: out_q must be float32 {list(shape)} with F % {QUANT_BLOCK} == 0, got "
                         f"{out_q.dtype} {tuple(out_q.shape)}")
    if im is not None:
        if out_q is None:
            raise ValueError("swiglu: im needs out_q (it stages the quantised values)")
        check_im_staged(im, shape[0], shape[1], "swiglu (im)")
    n = shape[0] * shape[1]
    if n:
        w = weights if has_w else _scratch(scratch, "no_weights", (1,), np.float32, stream)
        grid = (n + THREADS - 1) // THREADS
        if out_q is None:
            swiglu_kernel[grid, THREADS, stream](g, u, w, has_w, np.float32(limit), out)
        elif im is None:
            swiglu_q_kernel[grid, THREADS, stream](g, u, w, has_w, np.float32(limit), out, out_q)
        else:
            swiglu_qi_kernel[grid, THREADS, stream](g, u, w, has_w, np.float32(limit), out, out_q, *im)
    return out

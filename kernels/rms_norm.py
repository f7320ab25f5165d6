"""RMSNorm on the device: y = x * rsqrt(mean(x^2) + eps) * w, rounded to BF16 (ds4lib.ref.norm.rms_norm), alone or
fused with its neighbours of a decode step (each fused form gives the bits of the chain of kernels it replaces).

Owns:
- `rms_norm`: out = rms_norm(x, w); with `out_q` also out_q = act_quant_fp8(out) (kernels.gemv) from the same kernel,
  with `im` also out_q staged as the integer tensor-core path's operand (below; the q latent's norm, for wq_b).
- `hc_rms_norm`: out = rms_norm(hc_pre(h, pre), w) (kernels.hc.hc_pre's collapse, recomputed per element and never
  written), optionally with out_q as above: one launch where hc_pre, rms_norm and act_quant_fp8 took three. With `vq`
  it also stages out_q as kernels.vq_gemv's B operand (the halves and block scales vq_stage_kernel writes, bit for
  bit: kernels.vq_gemv.stage_lane_device on each warp's block of 32, stage_pad_device for the padded codewords), so
  the MoE's gate / up GEMV launches no staging kernel (the ffn norm of a layer; 4.9 us a launch on the H200). With
  `im` (with or without `vq`) it stages out_q as the integer tensor-core path's operand
  (kernels.im_operand.im_stage_lane_device), so that the q4_K GEMVs reading out_q launch no q4k_im_stage (the ffn
  norm's for the shared expert's gate / up: 4.8 us on the side stream, H100; the attention norm's for wq_a and wkv).
- `row_sumsq_words_device` / `row_scale_words_device`: a row's sum of squares / scale exactly as rms_norm_kernel
  forms them, from a block of any number of warps (the order played warp by warp): for a kernel that norms its
  input as it stages it (kernels.q4k_gemv's `norm`), so that no norm launch runs before it.
- `rms_norm_rope_q`: rms_norm, then kernels.rope's forward rotation of the tail (rope_pair_value_device, the pair's
  other value from the neighbouring lane), then act_quant_fp8: a window key row in one launch where three were; a
  decode step's row over ELEMS blocks as the norms' (below; one block of 64 threads took 11.1 us a call at D = 512 on
  an H100, its eight passes' quantiser reductions in series: BENCHMARKS.md, thirty-eighth session).
Does not own: the hyper-connection mixes and hc_pre itself (kernels.hc), the activation quantiser's device function
(kernels.fp8), the block sums (kernels.warp).

One block per row, n threads (a multiple of 32, chosen from D by the launcher so that one pass of ELEMS elements
per thread covers the row: n = 32 * ceil(D / (32 * ELEMS)), at most THREADS_MAX). Thread t owns elements
t, t + n, t + 2n, ... (a warp's load covers 128 contiguous bytes). A pass loads ELEMS elements of x
and of w per thread with unconditional loads (the index is clamped, not branched on, and the values land in
registers before any store), so the whole row is in flight at once. The squares are summed in float64 per
thread, then over the block in a fixed tree: shuffles within each warp, then the warps' sums by the same
shuffle tree (every warp computes it, so no second barrier). The order depends only on D (n is a function of D).
The hc forms load h [4, D] and pre [4] instead of x and form each x element as hc_pre_kernel does (the four exact
float64 products added in stream order, rounded to FP32 then BF16), with the same threads and order as rms_norm.
A decode step's row takes ELEMS blocks (`_split`): every block loads the whole row and forms the same sum and
scale with the same threads (so the same bits), and block p stores only element m = p of each thread's pass
(reloaded: the held values would cost registers past the 64 of a 1,024-thread bound): the stores, the quantiser
and the VQ staging, most of the kernel's instructions, spread over ELEMS SMs (one block of 640 threads took ~6 us a
call at D = 5,120 on the H200, issue-bound on its one SM).
The quantised output: for each pass element m, a warp's 32 lanes hold the 32 contiguous elements
base + m * n + 32 * warp + lane, which with D % 32 == 0 is exactly one quantisation block, entirely inside or
entirely past the row; its amax is a shuffle reduction, and act_quant_fp8_kernel's operations follow.

Squares of BF16 values carry at most 16 significant bits, so the float64 total is exact when the row's nonzero
magnitudes lie within a factor 2^((37 - log2 D) / 2) of each other (2^12 at D = 5120), and a few float64 ulps
from exact otherwise; the float32 variance rounded from it can then differ between summation orders only when
the total lies within those ulps of a float32 rounding boundary (about one row in 10^8). The scale and the
output follow the reference's FP32 steps: var = f32(total / D), scale = 1 / f32(sqrt(var + eps)),
y = bf16(w * (x * scale)).

Shapes: T tokens, D hidden, G = 32 quant block; x [T, D] float32 (BF16 values), w [D], out and out_q [T, D];
h [T, 4, D], pre [T, 4].
"""
import math

import numpy as np
from numba import cuda

from ds4lib.formats.vq import VQ_DIM
from kernels import bounded_jit, inline_device
from kernels.bf16 import f32x2_device, round_bf16_device
from kernels.fp8 import act_quant_fp8_lane_amax_device, act_quant_fp8_lane_device
from kernels.hc import HC
from kernels.im_operand import check_im_staged, im_stage_lane_device
from kernels.pdl import grid_entry_device
from kernels.rope import rope_pair_value_device
from kernels.vq_gemv import check_staged, padded_codewords, stage_lane_device, stage_pad_device
from kernels.warp import block_sum_f64_device, warp_tree_sum_device

__all__ = ["rms_norm", "hc_rms_norm", "rms_norm_rope_q", "rms_norm_kernel", "rms_norm_q_kernel", "hc_rms_norm_kernel",
           "hc_rms_norm_q_kernel", "hc_rms_norm_qv_kernel", "rms_norm_split_kernel", "rms_norm_q_split_kernel",
           "hc_rms_norm_q_split_kernel", "hc_rms_norm_qv_split_kernel", "hc_rms_norm_qvi_kernel",
           "hc_rms_norm_qvi_split_kernel", "rms_norm_qi_kernel", "rms_norm_qi_split_kernel", "hc_rms_norm_qi_kernel",
           "hc_rms_norm_qi_split_kernel", "rms_norm_rope_q_kernel", "rms_norm_rope_q_split_kernel",
           "row_scale_words_device", "row_sumsq_words_device", "SIGNATURES"]

WARP = 32
ELEMS = 8                       # elements of a row per thread and pass (unrolled loads)
THREADS_MAX = 1024              # one pass up to D = 8192; longer rows take several
SPLIT_ROWS_MAX = 1              # rows a call up to which a one-pass row takes ELEMS blocks (_split; 0: never)
ROPE_Q_SPLIT = True             # rms_norm_rope_q takes its split form where _split asks (bench/dev/unfused.py times it)


def _row_jit():
    """cuda.jit for a row kernel: launch bounds (THREADS_MAX, 1) on the GPU, so that ptxas keeps it within the
    65,536 registers of a block of THREADS_MAX threads (64 a thread). Unbounded, rms_norm_kernel took 80 (ptxas,
    sm_90): no block over 800 threads could launch, i.e. no row over 6,400 elements (docs/toolchain.md)."""
    return bounded_jit(THREADS_MAX)
QUANT_BLOCK = 32                # act_quant_fp8's block: one warp's elements of a pass


@inline_device
def _load_pass_device(x, w, row, base, d, xs, ws):
    """xs[m], ws[m] = x[row, j], w[j] for the thread's j = base + m * blockDim.x + threadIdx.x (m < ELEMS); j
    past the row reads element D - 1 (a clamped index keeps the loads unconditional)."""
    for m in range(ELEMS):
        j = min(base + m * cuda.blockDim.x + cuda.threadIdx.x, d - 1)
        xs[m] = x[row, j]
        ws[m] = w[j]


@inline_device
def _load_hc_elem_device(h, pv, w, row, j):
    """(x, w) of element j (in the row) of x = hc_pre(h, pre): x = bf16(f32(sum_i pre[i] h[row, i, j])) with pv the
    row's pre in float64, the products exact and added in stream order from 0.0 (hc_pre_kernel's operations)."""
    acc = 0.0
    for i in range(HC):
        acc += pv[i] * np.float64(h[row, i, j])
    return round_bf16_device(np.float32(acc)), w[j]


@inline_device
def _load_x_elem_device(x, pv, w, row, j):
    return x[row, j], w[j]


@inline_device
def _load_hc_pass_device(h, pv, w, row, base, d, xs, ws):
    """_load_pass_device of x = hc_pre(h, pre): xs[m] = bf16(f32(sum_i pre[i] h[row, i, j])) with pv the row's
    pre in float64, the products exact and added in stream order from 0.0 (hc_pre_kernel's operations)."""
    for m in range(ELEMS):
        j = min(base + m * cuda.blockDim.x + cuda.threadIdx.x, d - 1)
        acc = 0.0
        for i in range(HC):
            acc += pv[i] * np.float64(h[row, i, j])
        xs[m] = round_bf16_device(np.float32(acc))
        ws[m] = w[j]


@inline_device
def _add_squares_device(xs, base, d, acc):
    """acc plus the squares of the pass's elements inside the row, in float64, in element order."""
    for m in range(ELEMS):
        v = np.float64(xs[m]) if base + m * cuda.blockDim.x + cuda.threadIdx.x < d else 0.0
        acc += v * v
    return acc


@inline_device
def _scale_of_total_device(total, d, eps):
    """1 / f32(sqrt(f32(total / D) + eps)) from the row's float64 sum of squares."""
    var = np.float32(total / d)
    return np.float32(1.0) / np.float32(math.sqrt(var + eps))


@inline_device
def _row_scale_device(acc, sh, d, eps):
    """The row's scale from the thread's float64 sum of squares (every thread calls it)."""
    return _scale_of_total_device(block_sum_f64_device(acc, sh), d, eps)


@inline_device
def row_sumsq_words_device(x1, off, d, sh):
    """rms_norm_kernel's float64 sum of squares of a row, to the bit, from a block of any whole number of warps: the
    row is d float32 values (d even) at flat uint64 word `off` of x1 (float32 pairs as uint64 words). rms_norm's
    launch has n = _threads(d) threads; warp w of this block plays its warps w, w + nW, ... (nW: this block's warps),
    lane for lane: each lane sums that thread's squares in its order (passes, then elements), then the warp's tree
    (warp_tree_sum_device), then block_sum_f64_device's tree over the n / 32 warp sums. sh: float64 [WARP] shared,
    free for this call. Every thread calls it; returns to every thread."""
    lane = cuda.threadIdx.x % WARP
    n = min(THREADS_MAX, WARP * ((d + WARP * ELEMS - 1) // (WARP * ELEMS)))     # _threads(d)
    n_vw = n // WARP
    n_w = cuda.blockDim.x // WARP
    step = n * ELEMS
    xs = cuda.local.array(ELEMS, np.float32)
    for i in range((n_vw + n_w - 1) // n_w):            # every warp the same rounds (the simulator's shuffles are
        vw = cuda.threadIdx.x // WARP + i * n_w         # block barriers); a warp past the last plays none
        v = min(vw, n_vw - 1) * WARP + lane             # the thread of rms_norm's launch it plays
        acc = 0.0
        for base in range(0, d, step):
            for m in range(ELEMS):                                    # loads first, clamped as _load_pass_device
                j = min(base + m * n + v, d - 1)
                xs[m] = f32x2_device(x1[off + np.uint64(j // 2)], j % 2)
            for m in range(ELEMS):                                    # then _add_squares_device's sums
                u = np.float64(xs[m]) if base + m * n + v < d else 0.0
                acc += u * u
        acc = warp_tree_sum_device(acc)
        if lane == 0 and vw < n_vw:
            sh[vw] = acc
    cuda.syncthreads()
    s = sh[lane] if lane < n_vw else 0.0
    s = warp_tree_sum_device(s)
    return cuda.shfl_sync(0xFFFFFFFF, s, 0)


@inline_device
def row_scale_words_device(x1, off, d, eps, sh):
    """The scale rms_norm_kernel forms for that row (row_sumsq_words_device's arguments), to the bit: a GEMV that
    stages a normed input (kernels.q4k_gemv's `norm`) takes it from here and needs no norm launch before it."""
    return _scale_of_total_device(row_sumsq_words_device(x1, off, d, sh), d, eps)


@inline_device
def _store_x_elem_device(xv, wv, scale, row, j, d, out, out_q, xh, scl1, n_cwp, ixd, ips):
    """out[row, j] of element j (the thread's; not stored past the row)."""
    if j < d:
        out[row, j] = round_bf16_device(wv * (xv * scale))


@inline_device
def _store_q_elem_device(xv, wv, scale, row, j, d, out, out_q, xh, scl1, n_cwp, ixd, ips):
    """_store_x_elem_device and act_quant_fp8 of the stored value: every lane of the warp calls it with the 32
    contiguous elements of one quantisation block (D % 32 == 0: a warp's block is whole)."""
    _store_quant_device(xv, wv, scale, row, j, d, out, out_q, ixd, ips, False)


@inline_device
def _store_qv_elem_device(xv, wv, scale, row, j, d, out, out_q, xh, scl1, n_cwp, ixd, ips):
    """_store_q_elem_device, and the quantised value staged as the VQ GEMV's B operand (xh, scl1: the halves and
    scales vq_stage_kernel would write from out_q; kernels.vq_gemv.stage_lane_device)."""
    _store_staged_device(xv, wv, scale, row, j, d, out, out_q, xh, scl1, n_cwp, ixd, ips, False)


@inline_device
def _store_qvi_elem_device(xv, wv, scale, row, j, d, out, out_q, xh, scl1, n_cwp, ixd, ips):
    """_store_qv_elem_device, and the quantised value also staged as the integer tensor-core path's operand (ixd,
    ips: what kernels.q4k_gemv.im_stage(out_q, quantize=False) would write; kernels.im_operand.im_stage_lane_device)
    for a q4_K GEMV of the same input (the shared expert's gate / up)."""
    _store_staged_device(xv, wv, scale, row, j, d, out, out_q, xh, scl1, n_cwp, ixd, ips, True)


@inline_device
def _store_qi_elem_device(xv, wv, scale, row, j, d, out, out_q, xh, scl1, n_cwp, ixd, ips):
    """_store_q_elem_device, and the quantised value staged as the integer tensor-core path's operand only (ixd,
    ips; kernels.im_operand.im_stage_lane_device) for the q4_K GEMVs that read out_q: the attention norm's output
    (wq_a, wkv), the q latent's (wq_b, the indexer's wq_b)."""
    _store_quant_device(xv, wv, scale, row, j, d, out, out_q, ixd, ips, True)


@inline_device
def _store_quant_device(xv, wv, scale, row, j, d, out, out_q, ixd, ips, im):
    """The quantising stores' one body without the VQ staging (`im`: a constant of the caller's, so that the integer
    staging is compiled in or out)."""
    y = round_bf16_device(wv * (xv * scale))
    q = act_quant_fp8_lane_device(y if j < d else np.float32(0.0))     # every lane: a warp-wide reduction
    if im:
        lane = cuda.threadIdx.x % WARP
        im_stage_lane_device(q, (row * d + j - lane) // QUANT_BLOCK, lane, j < d, ixd, ips)
    if j < d:
        out[row, j] = y
        out_q[row, j] = q


@inline_device
def _store_staged_device(xv, wv, scale, row, j, d, out, out_q, xh, scl1, n_cwp, ixd, ips, im):
    """The two staging stores' one body (`im`: a constant of the caller's, so that the integer staging is compiled
    in or out)."""
    lane = cuda.threadIdx.x % WARP
    y = round_bf16_device(wv * (xv * scale))
    q, amq = act_quant_fp8_lane_amax_device(y if j < d else np.float32(0.0))   # every lane: a warp reduction
    stage_lane_device(q, amq, (j - lane) // QUANT_BLOCK, lane, j < d, row, n_cwp, xh, scl1)
    if im:
        im_stage_lane_device(q, (row * d + j - lane) // QUANT_BLOCK, lane, j < d, ixd, ips)
    if j < d:
        out[row, j] = y
        out_q[row, j] = q


@inline_device
def _stage_pad_device(row, d, xh, scl1, n_cwp):
    stage_pad_device(row, d // VQ_DIM, n_cwp, xh, scl1)


@inline_device
def _no_pad_device(row, d, xh, scl1, n_cwp):
    pass


@inline_device
def _load_pre_device(pre, row, pv):
    for i in range(HC):
        pv[i] = np.float64(pre[row, i])


@inline_device
def _no_pre_device(pre, row, pv):
    pass


@inline_device
def _load_x_pass_device(x, pv, w, row, base, d, xs, ws):
    _load_pass_device(x, w, row, base, d, xs, ws)


def _make_norm_kernel(hc_in, quant, vq=False, split=1, im=False):
    """The row kernel of rms_norm (x [T, D]) or hc_rms_norm (`hc_in`: h [T, 4, D] and pre [T, 4] collapsed per
    element), with act_quant_fp8 of the output into out_q (`quant`), with `vq` (quant only) also out_q staged as
    the VQ GEMV's B operand, and with `im` (quant only) also as the integer tensor-core path's. Arguments (src, pre,
    w, eps, out, out_q), with `vq` then (xh, scl1, n_cwp), with `im` then (ixd, ips); the forms without pre / out_q
    take and ignore a dummy. One body, the loads and stores chosen at build time."""
    assert quant or not (vq or im), "the staged forms stage the quantised output"
    prep = _load_pre_device if hc_in else _no_pre_device
    load = _load_hc_pass_device if hc_in else _load_x_pass_device
    load_one = _load_hc_elem_device if hc_in else _load_x_elem_device
    store = (_store_qvi_elem_device if im and vq else _store_qv_elem_device if vq else _store_qi_elem_device if im
             else _store_q_elem_device if quant else _store_x_elem_device)
    pad = _stage_pad_device if vq else _no_pad_device
    jit = _row_jit()

    @inline_device
    def body(src, pre, w, eps, out, out_q, xh, scl1, n_cwp, ixd, ips):
        row = cuda.blockIdx.x // split
        d = src.shape[src.ndim - 1]
        step = cuda.blockDim.x * ELEMS
        sh = cuda.shared.array(WARP, np.float64)
        xs = cuda.local.array(ELEMS, np.float32)
        ws = cuda.local.array(ELEMS, np.float32)
        pv = cuda.local.array(HC, np.float64)
        prep(pre, row, pv)
        acc = 0.0
        for base in range(0, d, step):
            load(src, pv, w, row, base, d, xs, ws)
            acc = _add_squares_device(xs, base, d, acc)
        scale = _row_scale_device(acc, sh, d, eps)
        if split == 1:
            for base in range(0, d, step):
                if step < d:                      # several passes: reload (one pass kept its values in registers)
                    load(src, pv, w, row, base, d, xs, ws)
                for m in range(ELEMS):
                    store(xs[m], ws[m], scale, row, base + m * cuda.blockDim.x + cuda.threadIdx.x, d, out, out_q,
                          xh, scl1, n_cwp, ixd, ips)
            pad(row, d, xh, scl1, n_cwp)
        else:                                     # one pass (_split's rule): the block's element m = part, reloaded
            part = cuda.blockIdx.x % split
            j = part * cuda.blockDim.x + cuda.threadIdx.x
            prep(pre, row, pv)                    # again: not held across the block sum (registers)
            xv, wv = load_one(src, pv, w, row, min(j, d - 1))
            store(xv, wv, scale, row, j, d, out, out_q, xh, scl1, n_cwp, ixd, ips)
            if part == 0:
                pad(row, d, xh, scl1, n_cwp)

    if im and vq:
        @jit
        def rms_norm_row_kernel(src, pre, w, eps, out, out_q, xh, scl1, n_cwp, ixd, ips):
            grid_entry_device()
            body(src, pre, w, eps, out, out_q, xh, scl1, n_cwp, ixd, ips)
    elif im:
        @jit
        def rms_norm_row_kernel(src, pre, w, eps, out, out_q, ixd, ips):
            grid_entry_device()
            body(src, pre, w, eps, out, out_q, out_q, out_q, 0, ixd, ips)      # (xh, scl1, n_cwp: not read)
    elif vq:
        @jit
        def rms_norm_row_kernel(src, pre, w, eps, out, out_q, xh, scl1, n_cwp):
            grid_entry_device()
            body(src, pre, w, eps, out, out_q, xh, scl1, n_cwp, xh, scl1)    # (ixd, ips: not read)
    else:
        @jit
        def rms_norm_row_kernel(src, pre, w, eps, out, out_q):
            grid_entry_device()
            body(src, pre, w, eps, out, out_q, out_q, out_q, 0, out_q, out_q)    # (xh .. ips: not read)
    return rms_norm_row_kernel


rms_norm_kernel = _make_norm_kernel(False, False)          # out[r] = bf16(w * (x[r] * scale_r)), r = blockIdx.x
rms_norm_q_kernel = _make_norm_kernel(False, True)         # and out_q[r] = act_quant_fp8(out[r]) (D % 32 == 0)
hc_rms_norm_kernel = _make_norm_kernel(True, False)        # of x = hc_pre(h, pre), formed in registers
hc_rms_norm_q_kernel = _make_norm_kernel(True, True)
hc_rms_norm_qv_kernel = _make_norm_kernel(True, True, vq=True)   # and out_q staged for kernels.vq_gemv
hc_rms_norm_qvi_kernel = _make_norm_kernel(True, True, vq=True, im=True)   # and for the integer path
rms_norm_qi_kernel = _make_norm_kernel(False, True, im=True)     # out_q staged for the integer path alone
hc_rms_norm_qi_kernel = _make_norm_kernel(True, True, im=True)
# the same, ELEMS blocks a row (r = blockIdx.x // ELEMS; one pass): the launchers' choice for a decode step's row
# (_split); hc_rms_norm without out_q (no decode caller) keeps the one-block kernel
rms_norm_split_kernel = _make_norm_kernel(False, False, split=ELEMS)
rms_norm_q_split_kernel = _make_norm_kernel(False, True, split=ELEMS)
hc_rms_norm_q_split_kernel = _make_norm_kernel(True, True, split=ELEMS)
hc_rms_norm_qv_split_kernel = _make_norm_kernel(True, True, vq=True, split=ELEMS)
hc_rms_norm_qvi_split_kernel = _make_norm_kernel(True, True, vq=True, split=ELEMS, im=True)
rms_norm_qi_split_kernel = _make_norm_kernel(False, True, split=ELEMS, im=True)
hc_rms_norm_qi_split_kernel = _make_norm_kernel(True, True, split=ELEMS, im=True)


def _make_rope_q_kernel(split=1):
    """rms_norm_rope_q_kernel (a factory for its launch bounds, as _make_norm_kernel); `split` = ELEMS: its form of
    ELEMS blocks a row (a one-pass row: block p stores element m = p of each thread's pass, as the norm kernels'
    split forms do, with the same sum and scale in every block, so the same bits)."""
    jit = _row_jit()

    @jit
    def rms_norm_rope_q_kernel(x, w, eps, positions, cos, sin, out, out_q):
        """rms_norm_kernel, then kernels.rope's forward rotation of the tail's adjacent pairs at positions[r] (in place,
        the head dims as normed), then out_q[r] = act_quant_fp8(out[r]) (D % 32 == 0). A pair (2i, 2i+1) sits in two
        neighbouring lanes of one warp (element j is thread j mod n's), so its other value is one shuffle away."""
        grid_entry_device()
        row = cuda.blockIdx.x // split
        d = x.shape[1]
        step = cuda.blockDim.x * ELEMS
        first = d // 2 - cos.shape[1]                 # first rotated pair
        sh = cuda.shared.array(WARP, np.float64)
        xs = cuda.local.array(ELEMS, np.float32)
        ws = cuda.local.array(ELEMS, np.float32)
        acc = 0.0
        for base in range(0, d, step):
            _load_pass_device(x, w, row, base, d, xs, ws)
            acc = _add_squares_device(xs, base, d, acc)
        scale = _row_scale_device(acc, sh, d, eps)
        pos = positions[row]
        if split == 1:
            for base in range(0, d, step):
                if step < d:
                    _load_pass_device(x, w, row, base, d, xs, ws)
                for m in range(ELEMS):
                    _store_rope_q_device(xs[m], ws[m], scale, row, base + m * cuda.blockDim.x + cuda.threadIdx.x, d,
                                         first, pos, cos, sin, out, out_q)
        else:                                         # one pass (_split's rule): the block's element m = part
            j = (cuda.blockIdx.x % split) * cuda.blockDim.x + cuda.threadIdx.x
            xv, wv = _load_x_elem_device(x, xs, w, row, min(j, d - 1))
            _store_rope_q_device(xv, wv, scale, row, j, d, first, pos, cos, sin, out, out_q)
    return rms_norm_rope_q_kernel


@inline_device
def _store_rope_q_device(xv, wv, scale, row, j, d, first, pos, cos, sin, out, out_q):
    """rms_norm_rope_q's element j (every lane of the warp calls it, with 32 contiguous elements: the pair's other
    value and the quantiser's amax are shuffles): normed, rotated where its pair is in the tail, quantised."""
    y = round_bf16_device(wv * (xv * scale))
    other = cuda.shfl_xor_sync(0xFFFFFFFF, y, 1)
    p = j // 2 - first
    if j < d and p >= 0:
        y = rope_pair_value_device(y, other, j % 2 == 1, cos[pos, p], sin[pos, p])
    q = act_quant_fp8_lane_device(y if j < d else np.float32(0.0))
    if j < d:
        out[row, j] = y
        out_q[row, j] = q


rms_norm_rope_q_kernel = _make_rope_q_kernel()
rms_norm_rope_q_split_kernel = _make_rope_q_kernel(split=ELEMS)     # the launcher's choice for a decode step's row


_ROPE_Q_SIG = ("void(float32[:, :], float32[:], float32, int64[:], float32[:, :], float32[:, :], float32[:, :], "
               "float32[:, :])")
SIGNATURES = {"rms_norm_rope_q_kernel": _ROPE_Q_SIG, "rms_norm_rope_q_split_kernel": _ROPE_Q_SIG}
_X_SIG = "void(float32[:, :], float32[:, :], float32[:], float32, float32[:, :], float32[:, :])"
_HC_SIG = "void(float32[:, :, :], float32[:, :], float32[:], float32, float32[:, :], float32[:, :])"
_HCV_SIG = ("void(float32[:, :, :], float32[:, :], float32[:], float32, float32[:, :], float32[:, :], uint32[:], "
            "float32[:], int64)")
_HCVI_SIG = _HCV_SIG[:-1] + ", uint32[:], float32[:])"
_XI_SIG = _X_SIG[:-1] + ", uint32[:], float32[:])"
_HCI_SIG = _HC_SIG[:-1] + ", uint32[:], float32[:])"
for _s in ("", "_split"):
    SIGNATURES.update({f"rms_norm{_s}_kernel": _X_SIG, f"rms_norm_q{_s}_kernel": _X_SIG,
                       f"hc_rms_norm_q{_s}_kernel": _HC_SIG, f"hc_rms_norm_qv{_s}_kernel": _HCV_SIG,
                       f"hc_rms_norm_qvi{_s}_kernel": _HCVI_SIG, f"rms_norm_qi{_s}_kernel": _XI_SIG,
                       f"hc_rms_norm_qi{_s}_kernel": _HCI_SIG})
SIGNATURES["hc_rms_norm_kernel"] = _HC_SIG


def _threads(d):
    """Threads of a row's block: one pass of ELEMS elements each up to THREADS_MAX (a function of D only)."""
    return min(THREADS_MAX, WARP * -(-d // (WARP * ELEMS)))


def _split(n_rows, d):
    """Blocks a row of the norm kernels: ELEMS when one pass covers a row and the call has at most SPLIT_ROWS_MAX
    rows (a decode step), else 1 (module docstring). One row only: the engine's warm-up (ds4lib.engine.warmup) then
    meets both forms, the split one in its decode steps and the one-block one in its prefill and batched steps."""
    one_pass = _threads(d) * ELEMS >= d
    return ELEMS if one_pass and n_rows <= SPLIT_ROWS_MAX else 1


_SPLIT_FORMS = {rms_norm_kernel: rms_norm_split_kernel, rms_norm_q_kernel: rms_norm_q_split_kernel,
                hc_rms_norm_q_kernel: hc_rms_norm_q_split_kernel, hc_rms_norm_qv_kernel: hc_rms_norm_qv_split_kernel,
                hc_rms_norm_qvi_kernel: hc_rms_norm_qvi_split_kernel, rms_norm_qi_kernel: rms_norm_qi_split_kernel,
                hc_rms_norm_qi_kernel: hc_rms_norm_qi_split_kernel,
                rms_norm_rope_q_kernel: rms_norm_rope_q_split_kernel}


def _launch(kernel, n_rows, d):
    """(kernel, blocks) of a launch over n_rows rows: the one-block kernel's split form where `_split` asks for it
    and the kernel has one (hc_rms_norm without out_q has none: no decode caller)."""
    split = _split(n_rows, d) if kernel in _SPLIT_FORMS else 1
    return (_SPLIT_FORMS[kernel] if split > 1 else kernel), n_rows * split


def _outputs(name, n_rows, d, w, out, out_q, stream, im=None):
    """Checks w, out, out_q and the integer-path operands `im` (which need out_q) against [T, D] (allocating out);
    returns out."""
    if tuple(w.shape) != (d,) or w.dtype != np.float32:
        raise ValueError(f"{name}: w must be float32 [{d}], got {w.dtype} {tuple(w.shape)}")
    if im is not None:
        if out_q is None:
            raise ValueError(f"{name}: im needs out_q (it stages the quantised values)")
        check_im_staged(im, n_rows, d, f"{name} (im)")
    if out is None:
        out = cuda.device_array((n_rows, d), dtype=np.float32, stream=stream)
    elif tuple(out.shape) != (n_rows, d) or out.dtype != np.float32:
        raise ValueError(f"{name}: out must be float32 [{n_rows}, {d}], got {out.dtype} {tuple(out.shape)}")
    if out_q is not None:
        if tuple(out_q.shape) != (n_rows, d) or out_q.dtype != np.float32 or d % QUANT_BLOCK:
            raise ValueError(f"{name}: out_q must be float32 [{n_rows}, {d}] with D % {QUANT_BLOCK} == 0, got "
                             f"{out_q.dtype} {tuple(out_q.shape)}")
    return out


def rms_norm(x, w, eps, out=None, out_q=None, im=None, stream=0):
    """x [T, D], w [D] (device or host float32 arrays) -> out [T, D]; with out_q [T, D] (D % 32 == 0) also
    out_q = act_quant_fp8(out) from the same kernel. `im` = (digits, pairs) of kernels.im_operand.im_stage_shapes(T,
    D) (with out_q): out_q also staged as the integer tensor-core path's operand, the bits
    kernels.q4k_gemv.im_stage(out_q, quantize=False) writes (finite values), for q4k_gemv(..., staged=im) (the q
    latent into wq_b and the indexer's wq_b: their staging launches go)."""
    if x.ndim != 2 or x.dtype != np.float32:
        raise ValueError(f"rms_norm: x must be float32 [T, D], got {x.dtype} {tuple(x.shape)}")
    n_rows, d = tuple(x.shape)
    out = _outputs("rms_norm", n_rows, d, w, out, out_q, stream, im)
    if n_rows and d:
        kernel, blocks = _launch(rms_norm_kernel if out_q is None else rms_norm_q_kernel if im is None
                                 else rms_norm_qi_kernel, n_rows, d)
        kernel[blocks, _threads(d), stream](x, w.reshape((1, d)), w, np.float32(eps), out,   # (pre: not read)
                                            out if out_q is None else out_q, *(() if im is None else im))
    return out


def rms_norm_rope_q(x, w, eps, positions, cos, sin, out, out_q, stream=0):
    """x [T, D], w [D] float32, positions [T] int64, cos, sin [P, rd/2] (kernels.rope's tables) -> out [T, D] =
    rope(rms_norm(x, w, eps), positions) and out_q = act_quant_fp8(out) (D % 32 == 0), one launch where three
    were: the window key row of a decode step (ref attention.window_kv)."""
    if x.ndim != 2 or x.dtype != np.float32:
        raise ValueError(f"rms_norm_rope_q: x must be float32 [T, D], got {x.dtype} {tuple(x.shape)}")
    n_rows, d = tuple(x.shape)
    if out_q is None:
        raise ValueError("rms_norm_rope_q: out_q is required")
    out = _outputs("rms_norm_rope_q", n_rows, d, w, out, out_q, stream)
    if tuple(positions.shape) != (n_rows,) or positions.dtype != np.int64:
        raise ValueError(f"rms_norm_rope_q: positions must be int64 [{n_rows}]")
    if tuple(cos.shape) != tuple(sin.shape) or len(cos.shape) != 2 or cos.dtype != np.float32 \
            or 2 * cos.shape[1] > d or d % 2:
        raise ValueError(f"rms_norm_rope_q: cos {cos.shape} and sin {sin.shape} must be float32 [P, rd/2] with "
                         f"rd <= D = {d}")
    if n_rows and d:
        kernel, blocks = (_launch(rms_norm_rope_q_kernel, n_rows, d) if ROPE_Q_SPLIT
                          else (rms_norm_rope_q_kernel, n_rows))
        kernel[blocks, _threads(d), stream](x, w, np.float32(eps), positions, cos, sin, out, out_q)
    return out


def hc_rms_norm(h, pre, w, eps, out=None, out_q=None, vq=None, im=None, stream=0):
    """h [T, 4, D], pre [T, 4], w [D] float32 -> out = rms_norm(hc_pre(h, pre), w, eps) [T, D]; with out_q [T, D]
    (D % 32 == 0) also out_q = act_quant_fp8(out). The collapsed x is not written. `vq` = (halves, scales) of
    kernels.vq_gemv.stage_shapes(T, D) (with out_q): out_q also staged as the VQ GEMV's B operand, the bits
    vq_gemv.vq_stage(out_q, quantize=False) writes, for vq_gemv(..., staged=vq) (the MoE's w1 / w3 input: one
    launch fewer). `im` = (digits, pairs) of kernels.im_operand.im_stage_shapes(T, D) (with out_q, with or without
    vq): out_q also staged as the integer tensor-core path's operand, the bits kernels.q4k_gemv.im_stage(out_q,
    quantize=False) writes (finite values), for q4k_gemv(..., staged=im) (the ffn norm's for the shared expert's gate
    / up, the attention norm's for wq_a and wkv: one launch fewer each)."""
    shape = tuple(h.shape)
    if len(shape) != 3 or shape[1] != HC or h.dtype != np.float32:
        raise ValueError(f"hc_rms_norm: h must be float32 [T, {HC}, D], got {h.dtype} {shape}")
    n_rows, _, d = shape
    if tuple(pre.shape) != (n_rows, HC) or pre.dtype != np.float32:
        raise ValueError(f"hc_rms_norm: pre must be float32 [{n_rows}, {HC}], got {pre.dtype} {tuple(pre.shape)}")
    out = _outputs("hc_rms_norm", n_rows, d, w, out, out_q, stream, im)
    if vq is not None:
        if out_q is None:
            raise ValueError("hc_rms_norm: vq needs out_q (it stages the quantised values)")
        check_staged(vq, n_rows, d, "hc_rms_norm")
        if n_rows and d:
            kernel, blocks = _launch(hc_rms_norm_qv_kernel if im is None else hc_rms_norm_qvi_kernel, n_rows, d)
            kernel[blocks, _threads(d), stream](h, pre, w, np.float32(eps), out, out_q, *vq, padded_codewords(d),
                                                *(() if im is None else im))
    elif n_rows and d:
        kernel, blocks = _launch(hc_rms_norm_kernel if out_q is None else hc_rms_norm_q_kernel if im is None
                                 else hc_rms_norm_qi_kernel, n_rows, d)
        kernel[blocks, _threads(d), stream](h, pre, w, np.float32(eps), out, out if out_q is None else out_q,
                                            *(() if im is None else im))
    return out

"""The integer path's one-token q4_K GEMV on the SIMD integer dot product (`dp4a`) instead of the tensor cores: the
same exact digit sums as kernels.q4k_gemv's q4k_imma_t1_kernel, combined by the same FP32 operations in the same
order, so the same bits, with a quarter fewer instructions and no warp-wide MMA of which one column in eight is
used.

Owns:
- `dp4a_uu_device(a, b, c)` / `dp4a_us_device(a, b, c)`: c + the dot product of the four bytes of a (unsigned) with
  the four bytes of b (unsigned / signed): PTX `dp4a.u32.u32` / `dp4a.u32.s32` (one IDP.4A), exact int32 where the
  sum fits (the callers' sums do: at most 32 * 240 * 255); the simulator's twins add the same products in Python.
- `q4k_dp_t1_kernel` (and `q4k_dp_t1s_kernel`, which also stages its output for the next GEMV as
  q4k_imma_t1s_kernel does): one token's GEMV on q4k_imma_t1_kernel's operands (the staged digits xd and (p, X)
  pairs ps of q4k_im_stage_kernel), its 16-row tiles, its K quarters a warp and its sums. Lane (g, t) of warp w
  takes rows r0 + g and r0 + g + 8 (as the MMA fragments do), super-blocks of quarter w, and of each the 32 bytes of
  nibble group t: sub-blocks 2t (low nibbles) and 2t + 1 (high), which is what lane t keeps of the imma kernel's
  MMAs. A nibble word masked with 0x0F0F0F0F is four unsigned weights of sub-block 2t; masked with 0xF0F0F0F0, four
  of sub-block 2t + 1 times 16, whose digit sums are divided by 16 (exactly) once. Three dp4a a word and row (the
  digits d0, d1 unsigned, d2 signed) give the three exact digit sums of each sub-block, then S, the term (dd * S -
  dm * X) * p and the sums over quads and quarters are q4k_imma_t1_kernel's (kernels.q4k_gemv helpers). Steps past
  a quarter's last super-block are not run (the imma kernel adds exact zeros there: its accumulators never hold
  -0, so adding +0 changes nothing).
- `dp_fits(kernel, w, n_rows, rows_per_group)`: whether the launcher can give a weight array to one of these
  kernels (16-byte aligned: the lane's words are 16-byte loads; a block's tiles in one input group);
  kernels.q4k_gemv.q4k_gemv takes them for one-token integer-path calls when it holds (USE_DP4A) and
  q4k_imma_t1_kernel otherwise, the same bits either way.
Loads: a lane's words of a super-block are six 16-byte loads (two rows' headers and nibble groups); the next
super-block's are issued before the current one's products (DP_PIPE). The tile's digits are copied into shared
memory with nibble group c's 8-input blocks in the order e ^ c, so that the four lanes t of a quad-row, which read
block e of their groups together, hit four different bank quads; `x_shared=False` (a probe variant, DP_X_SHARED)
reads them where they were staged instead, without the copy and its barrier before the loop.

Shapes: as kernels.q4k_gemv (N rows, K row length per group, NB = K / 256 super-blocks, kx inputs a token).
"""
import numpy as np
from numba import cuda
from numba.cuda.core import config as _cuda_config

from kernels import bounded_jit, inline_device, on_bytes
from kernels.bf16 import round_bf16_device
from kernels.mma import LOAD4_ALIGN, load4_device
from kernels.pdl import grid_entry_device
from kernels.q4k_gemv import (EARLY_WEIGHTS, IM_ROWS, IM_SMEM_PS, IM_SMEM_WORDS, IM_WARPS, QK_K, WARP,
                              _copy16_device, _im_s_device, _im_term_device, _q4k_factor_pair_words_device,
                              _stage_pair_device)
from kernels.warp import quad_sum_device

__all__ = ["dp4a_uu_device", "dp4a_us_device", "q4k_dp_t1_kernel", "q4k_dp_t1s_kernel", "dp_fits", "SIGNATURES",
           "EARLY_READS", "DP_MIN_BLOCKS", "DP_PIPE", "DP_TILES", "DP_X_SHARED"]

SIM = bool(_cuda_config.ENABLE_CUDASIM)
SB_WORDS = 36                  # 32-bit words of a q4_K super-block (144 bytes)
DP_MIN_BLOCKS = 4              # resident blocks per SM the kernels are compiled for (their register bound)
DP_PIPE = True                 # the next super-block's words loaded before the current one's products
DP_TILES = 1                   # 16-row tiles a block of the one-token kernel (one copy of the digits for all)
DP_X_SHARED = True             # the tile's digits copied into shared memory first (False: read where staged)
LO = np.uint32(0x0F0F0F0F)
HI = np.uint32(0xF0F0F0F0)
EARLY_READS = {"q4k_dp_kernel": ("w4", "n_words4", "rows_per_group")}   # (kernels.pdl)

if SIM:
    @cuda.jit(device=True)
    def dp4a_uu_device(a, b, c):
        """c + sum of byte i of a times byte i of b, both unsigned (the simulator's dp4a.u32.u32)."""
        s = int(c)
        for i in range(4):
            s += ((int(a) >> (8 * i)) & 0xFF) * ((int(b) >> (8 * i)) & 0xFF)
        return np.int32(s)

    @cuda.jit(device=True)
    def dp4a_us_device(a, b, c):
        """c + sum of byte i of a (unsigned) times byte i of b (signed) (the simulator's dp4a.u32.s32)."""
        s = int(c)
        for i in range(4):
            v = (int(b) >> (8 * i)) & 0xFF
            s += ((int(a) >> (8 * i)) & 0xFF) * (v - 256 if v >= 128 else v)
        return np.int32(s)
else:
    from llvmlite import ir as _ir
    from numba.core import types as _types
    from numba.core.extending import intrinsic as _intrinsic

    def _dp4a_intrinsic(op):
        """An intrinsic running `op` (dp4a with b32 operands a, b and an int32 c) on one thread's registers."""
        @_intrinsic
        def dp4a(typingctx, a, b, c):
            sig = _types.int32(_types.uint32, _types.uint32, _types.int32)

            def codegen(context, builder, signature, args):
                i32 = _ir.IntType(32)
                return builder.call(_ir.InlineAsm(_ir.FunctionType(i32, [i32] * 3), op + " $0, $1, $2, $3;",
                                                  "=r,r,r,r"), args)
            return sig, codegen
        return dp4a

    _dp4a_uu = _dp4a_intrinsic("dp4a.u32.u32")
    _dp4a_us = _dp4a_intrinsic("dp4a.u32.s32")

    @inline_device
    def dp4a_uu_device(a, b, c):
        """c + the dot product of a's and b's four unsigned bytes (one IDP.4A)."""
        return _dp4a_uu(np.uint32(a), np.uint32(b), np.int32(c))

    @inline_device
    def dp4a_us_device(a, b, c):
        """c + the dot product of a's four unsigned bytes with b's four signed ones (one IDP.4A)."""
        return _dp4a_us(np.uint32(a), np.uint32(b), np.int32(c))


@inline_device
def _dp_words_device(w4, ra, rb, sb, t, live):
    """Lane t's 24 words of super-block sb: rows a and b (flat uint32 offsets ra, rb), each its header (4 words) and
    nibble group t (8 words: bytes 32t .. 32t + 31 of the nibbles); zeros when not `live`."""
    z = np.uint32(0)
    if not live:
        return (z, z, z, z, z, z, z, z, z, z, z, z), (z, z, z, z, z, z, z, z, z, z, z, z)
    o = np.uint64(SB_WORDS) * np.uint64(sb)
    a = ra + o
    b = rb + o
    q = np.uint64(4 + 8 * t)
    ha = load4_device(w4, a)
    qa0 = load4_device(w4, a + q)
    qa1 = load4_device(w4, a + q + np.uint64(4))
    hb = load4_device(w4, b)
    qb0 = load4_device(w4, b + q)
    qb1 = load4_device(w4, b + q + np.uint64(4))
    return ha + qa0 + qa1, hb + qb0 + qb1


@inline_device
def _dp_row_device(w0, w1, lo, hi, acc):
    """acc (6 int32: one row's digit sums d0, d1, d2 of sub-block 2t, then those of 2t + 1 times 16) plus the products
    of its nibble words w0, w1 (inputs 8e .. 8e + 7 of both sub-blocks) with the digit words lo of sub-block 2t's
    inputs and hi of 2t + 1's (six each: d0, d0, d1, d1, d2, d2 for inputs 0-3 / 4-7)."""
    s0, s1, s2, s3, s4, s5 = acc
    l0, l1, h0, h1 = w0 & LO, w1 & LO, w0 & HI, w1 & HI
    s0 = dp4a_uu_device(l1, lo[1], dp4a_uu_device(l0, lo[0], s0))
    s1 = dp4a_uu_device(l1, lo[3], dp4a_uu_device(l0, lo[2], s1))
    s2 = dp4a_us_device(l1, lo[5], dp4a_us_device(l0, lo[4], s2))
    s3 = dp4a_uu_device(h1, hi[1], dp4a_uu_device(h0, hi[0], s3))
    s4 = dp4a_uu_device(h1, hi[3], dp4a_uu_device(h0, hi[2], s4))
    s5 = dp4a_us_device(h1, hi[5], dp4a_us_device(h0, hi[4], s5))
    return s0, s1, s2, s3, s4, s5


@inline_device
def _dp_block_device(wa0, wa1, wb0, wb1, xs, lo_at, hi_at, acc):
    """acc (12 int32: row a's digit sums (_dp_row_device's six), then row b's) plus the products of one 8-input
    block: nibble words wa0, wa1 (row a, inputs 8e .. 8e + 7 of both sub-blocks), wb0, wb1 (row b), the digits of
    sub-block 2t's inputs at xs[lo_at ..] and of 2t + 1's at xs[hi_at ..] (8 words each: d0, d0, d1, d1, d2, d2, 0, 0
    for inputs 0-3 / 4-7)."""
    l0a, l0b, l1a, l1b = load4_device(xs, lo_at)
    l2a, l2b, _, _ = load4_device(xs, lo_at + 4)
    h0a, h0b, h1a, h1b = load4_device(xs, hi_at)
    h2a, h2b, _, _ = load4_device(xs, hi_at + 4)
    lo = (l0a, l0b, l1a, l1b, l2a, l2b)
    hi = (h0a, h0b, h1a, h1b, h2a, h2b)
    return (_dp_row_device(wa0, wa1, lo, hi, acc[0:6]) + _dp_row_device(wb0, wb1, lo, hi, acc[6:12]))


@inline_device
def _dp_sb_device(wa, wb, xs, xb, sw, xp, bt, pa, pb):
    """One super-block of lane (g, t): its words wa, wb (rows g, g + 8: _dp_words_device), the digits xs with this
    super-block's group t at xs[xb ..] (its 8-input block e at xb + 8 * (e ^ sw): sw = t for the swizzled copy in
    shared memory, 0 for the staged digits themselves), its (p, X) pairs xp[bt ..] -> pa, pb plus the terms of
    sub-blocks 2t and 2t + 1 (q4k_imma_t1_kernel's, in its order)."""
    t = cuda.threadIdx.x % 4
    z = np.int32(0)
    acc = (z, z, z, z, z, z, z, z, z, z, z, z)
    acc = _dp_block_device(wa[4], wa[5], wb[4], wb[5], xs, xb + 8 * (0 ^ sw), xb + 8 * (4 ^ sw), acc)
    acc = _dp_block_device(wa[6], wa[7], wb[6], wb[7], xs, xb + 8 * (1 ^ sw), xb + 8 * (5 ^ sw), acc)
    acc = _dp_block_device(wa[8], wa[9], wb[8], wb[9], xs, xb + 8 * (2 ^ sw), xb + 8 * (6 ^ sw), acc)
    acc = _dp_block_device(wa[10], wa[11], wb[10], wb[11], xs, xb + 8 * (3 ^ sw), xb + 8 * (7 ^ sw), acc)
    a0, a1, a2, a3, a4, a5, b0, b1, b2, b3, b4, b5 = acc
    s4 = np.int32(4)
    dda0, dma0, dda1, dma1 = _q4k_factor_pair_words_device(wa[0], wa[1], wa[2], wa[3], t)
    ddb0, dmb0, ddb1, dmb1 = _q4k_factor_pair_words_device(wb[0], wb[1], wb[2], wb[3], t)
    p0, x0, p1, x1 = load4_device(xp, bt)
    pa = _im_term_device(dda0, dma0, _im_s_device(a0, a1, a2), x0, p0, pa)
    pa = _im_term_device(dda1, dma1, _im_s_device(a3 >> s4, a4 >> s4, a5 >> s4), x1, p1, pa)
    pb = _im_term_device(ddb0, dmb0, _im_s_device(b0, b1, b2), x0, p0, pb)
    pb = _im_term_device(ddb1, dmb1, _im_s_device(b3 >> s4, b4 >> s4, b5 >> s4), x1, p1, pb)
    return pa, pb


def _make_dp_kernel(stage=False, min_blocks=DP_MIN_BLOCKS, pipe=DP_PIPE, early=EARLY_WEIGHTS, tiles=1,
                    x_shared=DP_X_SHARED):
    """The one-token dp4a kernel (module docstring); `stage`: its output also staged for the next GEMV
    (q4k_imma_t1s_kernel's); `min_blocks` resident blocks per SM bounding the registers; `pipe` the next
    super-block's words loaded before the current one's products; `early` the first super-block's words loaded
    before the grid entry (kernels.pdl); `tiles` 16-row tiles a block (4 warps each), sharing one copy of the
    digits: every tile of a block must read the same input group (the launcher's `dp_fits`); `x_shared` the tile's
    digits and pairs copied into shared memory first (a barrier before the loop), else read where they were staged
    (global memory: L1 and L2, no copy, no barrier)."""
    if stage and tiles != 1:
        raise ValueError("_make_dp_kernel: the staging variant takes one tile a block (its pairs of blocks)")
    n_threads = tiles * IM_WARPS * WARP
    n_warps = tiles * IM_WARPS                           # (a closure int: a literal for the shared arrays' shapes)
    jit = bounded_jit(n_threads, min_blocks)

    @jit
    def q4k_dp_kernel(xd, ps, kx, w4, n_words4, rows_per_group, out_bf16, out, sxd, sps, pairs):
        """q4_K GEMV of one token on the staged integer-path operands (xd, ps: q4k_im_stage_kernel's, kx inputs);
        w4: the q4_K rows as flat uint32 words (n_words4 a row, 16-byte aligned); out [1, N] FP32 (BF16-rounded if
        out_bf16): q4k_imma_t1_kernel's bits (module docstring). `stage`: sxd, sps, pairs as that kernel's."""
        min_blocks                 # named: closure values, so in the cache key (kernels.bounded_jit)
        pipe                       # (the same)
        early                      # (the same)
        tiles                      # (the same)
        x_shared                   # (the same)
        qsum = cuda.shared.array((n_warps, IM_ROWS), np.float32)
        red = cuda.shared.array((n_warps, WARP), np.float32)
        tid = cuda.threadIdx.x
        lane = tid % WARP
        tw = tid // WARP                                 # the block's warp: tile tw // 4, K quarter tw % 4
        warp = tw % IM_WARPS
        g = lane // 4
        t = lane % 4
        n_rows = out.shape[1]
        nb = n_words4 // SB_WORDS
        rt = cuda.blockIdx.x * tiles * IM_ROWS           # the block's first row
        r0 = rt + (tw // IM_WARPS) * IM_ROWS             # the warp's tile's
        ra = np.uint64(min(r0 + g, n_rows - 1)) * np.uint64(n_words4)       # rows past the end: the last (read,
        rb = np.uint64(min(r0 + g + 8, n_rows - 1)) * np.uint64(n_words4)   # never stored)
        xk0 = (rt // rows_per_group) * nb * QK_K         # the tiles' first input in the token row
        quarter = (nb + IM_WARPS - 1) // IM_WARPS
        sb0 = warp * quarter
        sb1 = min(nb, sb0 + quarter)
        if early:                  # weights are never written by a graph's kernels (kernels.pdl)
            cur_a, cur_b = _dp_words_device(w4, ra, rb, sb0, t, sb0 < sb1)
        grid_entry_device()
        if not early:
            cur_a, cur_b = _dp_words_device(w4, ra, rb, sb0, t, sb0 < sb1)
        if x_shared:
            xs = cuda.shared.array(IM_SMEM_WORDS, np.uint32, alignment=LOAD4_ALIGN)
            xp = cuda.shared.array(IM_SMEM_PS, np.float32, alignment=LOAD4_ALIGN)
            _copy16_device(xd, xk0, nb * QK_K // 4, xs, n_threads, True)    # (groups' blocks swizzled)
            _copy16_device(ps, 2 * (xk0 // 32), nb * 4, xp, n_threads, False)
            cuda.syncthreads()
            xo, po, sw = 0, 0, t
        else:
            xs, xp = xd, ps
            xo, po, sw = xk0, 2 * (xk0 // 32), 0
        pa = np.float32(0.0)
        pb = np.float32(0.0)
        for sb in range(sb0, sb1, 2):                   # two super-blocks a trip: the words alternate between
            if pipe:                                     # two sets of registers without copies
                nxt_a, nxt_b = _dp_words_device(w4, ra, rb, sb + 1, t, sb + 1 < sb1)
            pa, pb = _dp_sb_device(cur_a, cur_b, xs, xo + QK_K * sb + 64 * t, sw, xp, po + 2 * (8 * sb + 2 * t),
                                   pa, pb)
            if sb + 1 < sb1:
                if pipe:
                    cur_a, cur_b = _dp_words_device(w4, ra, rb, sb + 2, t, sb + 2 < sb1)
                else:
                    nxt_a, nxt_b = _dp_words_device(w4, ra, rb, sb + 1, t, True)
                pa, pb = _dp_sb_device(nxt_a, nxt_b, xs, xo + QK_K * (sb + 1) + 64 * t, sw, xp,
                                       po + 2 * (8 * sb + 8 + 2 * t), pa, pb)
                if not pipe and sb + 2 < sb1:
                    cur_a, cur_b = _dp_words_device(w4, ra, rb, sb + 2, t, True)
        sa = quad_sum_device(pa, red[tw])
        sbv = quad_sum_device(pb, red[tw])
        if t == 0:
            qsum[tw, g] = sa
            qsum[tw, g + 8] = sbv
        cuda.syncthreads()
        if tid < tiles * IM_ROWS and rt + tid < n_rows:
            q0 = (tid // IM_ROWS) * IM_WARPS
            r = tid % IM_ROWS
            v = (qsum[q0, r] + qsum[q0 + 1, r]) + (qsum[q0 + 2, r] + qsum[q0 + 3, r])
            out[0, rt + tid] = round_bf16_device(v) if out_bf16 else v
        if stage:
            cuda.syncthreads()                          # the output's stores before the pair's ticket
            _stage_pair_device(out, sxd, sps, pairs)
    q4k_dp_kernel.tiles = tiles            # the launcher's grid and group check (dp_fits)
    return q4k_dp_kernel


def dp_fits(kernel, w, n_rows, rows_per_group):
    """Whether `kernel` (one of this module's) can take a q4_K weight array w (uint8 [N, NB * 144] on the device) of
    n_rows rows, rows_per_group to an input group: its words are 16-byte loads, so w's first byte must lie on 16
    bytes, and every tile of a block must read one input group."""
    rows = kernel.tiles * IM_ROWS
    return on_bytes(w, 16) and (rows_per_group == n_rows or rows_per_group % rows == 0)


q4k_dp_t1_kernel = _make_dp_kernel(tiles=DP_TILES)
q4k_dp_t1s_kernel = _make_dp_kernel(stage=True)    # and the output staged for the next GEMV (wo_a's into wo_b)

_DP_SIG = ("void(uint32[::1], float32[::1], int64, uint32[::1], int64, int64, boolean, float32[:, ::1], uint32[::1], "
           "float32[::1], int32[::1])")
SIGNATURES = {"q4k_dp_t1_kernel": _DP_SIG, "q4k_dp_t1s_kernel": _DP_SIG}

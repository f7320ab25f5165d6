"""q4_K and Q8_0 weights on the device: GEMV / small-batch GEMM straight from the GGUF block bytes, and the row
gather of a q4_K table (the embedding). The formats are ds4lib.formats.q4k (the bit-exact decode); the products
are ds4lib.ref.linear's (linear_q, linear_bf16, linear_f32).

Owns:
- `q4k_gemv`: y[t, n] = sum_k W[n, k] x[t, g(n)*K + k] with W stored as in the base file: q4_K (144-byte super-blocks
  of 256 weights: f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles) or Q8_0 (34-byte blocks of
  32: f16 d, 32 int8). Every weight is decoded to the reference's float32 value (q4_K: fl(dd*q - dm) with dd = d*sc
  and dm = dmin*m exact, i.e. one FMA of exact terms; Q8_0: d*q, exact) and accumulated with explicit FP32 FMAs in a
  fixed order, so a token's result does not depend on which tokens share the call. Output BF16-rounded
  (linear_q / linear_bf16) or FP32 (linear_f32, the head). `quantize=True` first applies the activation rule of
  linear_q (gemv.act_quant_fp8, block 32) to x. Rows of group g read the g-th K-slice of x (`rows_per_group`:
  attention's grouped wo_a).
- `q4k_rows`: rows of a q4_K / Q8_0 table decoded to float32 (exactly dequantize_q4k's values): the embedding.
Does not own: BF16/FP32 weights (kernels.gemv), the activation quantiser itself (kernels.gemv), F16 fallback
tensors (the engine uploads those as float32 and uses kernels.gemv).

Numerics: the FP32 sums differ from the reference's exact (float64) 32-block sums only in rounding order
(tests/kernels/tolerances.py "gemv_bf16" / "gemv_f32").

Speed (q4_K): one warp per output row; a lane owns 8 bytes of nibbles (8 weights of sub-block 2c and the same 8 of
2c+1), so half a warp covers one 256-weight super-block and a warp two per step, with two steps' loads issued
together (16 bytes of nibbles + the 16-byte header per lane in flight). Nibbles become floats through the
exponent trick (0x4B000000 | q is 2^23 + q), not an int-to-float conversion. Tokens are processed TOKENS_WIDE at
a time, so a prefill chunk reads each weight row once per TOKENS_WIDE tokens. A decode call (one token) takes
`q4k_gemv_deep_kernel`: the same lanes, super-blocks and FMA order (so the same bits), with four steps' loads in
flight per lane and the activations read as 8-byte words (x viewed as uint64); on the H200 it is 1.2-1.45x faster
than the two-step kernel at V4.1's shapes (BENCHMARKS.md, issue 12). Its instruction count per weight is what bounds
it (Nsight Compute: ~24 per weight), so it indexes flat arrays with unsigned integers (no wraparound checks or row
strides per load), converts the f16 header with the hardware, takes nibbles and scale bytes with 32-bit operations,
and selects the two scale layouts instead of branching on the lane's sub-block.

Shapes: T tokens, N rows, K row length (per group), G groups, NB = K/256 super-blocks (q4_K) or K/32 blocks (Q8_0).
"""
import math

import numpy as np
from numba import cuda
from numba.cuda.core import config as _cuda_config

from kernels.bf16 import bits_f32, f16_bits_device, f32x2_device, round_bf16_device
from kernels.gemv import act_quant_fp8
from kernels.scratch import scratch_array as _scratch

__all__ = ["q4k_gemv", "q4k_rows", "warp_sum_device", "q4k_gemv_t1_kernel", "q4k_gemv_t4_kernel", "q4k_gemv_deep_kernel",
           "q8_0_gemv_t1_kernel", "q8_0_gemv_t4_kernel", "q4k_rows_kernel", "q8_0_rows_kernel", "SIGNATURES", "KINDS"]

SIM = bool(_cuda_config.ENABLE_CUDASIM)
WARP = 32
WARPS_PER_BLOCK = 4
THREADS_ROWS = 128
TOKENS_WIDE = 4
QK_K = 256
Q4K_WORDS = 18                 # 144 bytes = 18 uint64 words per super-block
QK8_0 = 32
Q8_0_HALVES = 17               # 34 bytes = 17 uint16 per block
KINDS = {"q4_K": (QK_K, 144), "q8_0": (QK8_0, 34)}
MAGIC = np.float32(8388608.0)  # 2^23


if SIM:
    @cuda.jit(device=True)
    def warp_sum_device(v, red):
        """Sum of v over the 32 lanes of the warp (valid in lane 0). `red` is the warp's float32 [32] slice of a
        shared array the kernel allocated. The simulator pays two block barriers per shuffle, so here the lanes
        meet once in shared memory (two barriers in all) and add in lane order."""
        lane = cuda.threadIdx.x % WARP
        red[lane] = v
        cuda.syncwarp(0xFFFFFFFF)
        s = red[0]
        for j in range(1, WARP):
            s += red[j]
        cuda.syncwarp(0xFFFFFFFF)
        return s
else:
    @cuda.jit(device=True, inline=True)
    def warp_sum_device(v, red):
        """Sum of v over the 32 lanes of the warp (valid in lane 0): shuffle tree, fixed order (`red` unused)."""
        off = WARP // 2
        while off > 0:
            v += cuda.shfl_down_sync(0xFFFFFFFF, v, off)
            off //= 2
        return v


@cuda.jit(device=True, inline=True)
def _nibble_f32_device(word, shift):
    """float32 of the 4-bit field of `word` (uint64) at bit `shift`, exactly (2^23 + q - 2^23)."""
    q = np.uint32((word >> np.uint64(shift)) & np.uint64(0xF))
    return bits_f32(np.uint32(0x4B000000) | q) - MAGIC


@cuda.jit(device=True, inline=True)
def _small_f32_device(v):
    """float32 of a uint32 v < 2^23, exactly (2^23 + v - 2^23): an OR and an FADD instead of a conversion."""
    return bits_f32(np.uint32(0x4B000000) | v) - MAGIC


@cuda.jit(device=True, inline=True)
def _scale_min_device(h0, h1, j):
    """(scale, min) 6-bit values of sub-block j (GGML get_scale_min_k4), as float32. The 12 scale bytes are bytes
    4..7 of header word h0, then bytes 0..7 of h1; byte j % 4 of each 4-byte third is taken with 32-bit shifts and
    both cases (j < 4, j >= 4) are formed and selected, so a warp whose lanes hold different j does not diverge."""
    s0 = np.uint32(h0 >> np.uint64(32))                  # scale bytes 0..3
    s1 = np.uint32(h1 & np.uint64(0xFFFFFFFF))           # bytes 4..7
    s2 = np.uint32(h1 >> np.uint64(32))                  # bytes 8..11
    sh = np.uint32(8) * np.uint32(j & 3)
    b0 = (s0 >> sh) & np.uint32(0xFF)                    # byte j % 4
    b1 = (s1 >> sh) & np.uint32(0xFF)                    # byte 4 + j % 4
    b2 = (s2 >> sh) & np.uint32(0xFF)                    # byte 8 + j % 4
    lo = j < 4
    sc = (b0 & np.uint32(63)) if lo else ((b2 & np.uint32(0xF)) | ((b0 >> np.uint32(6)) << np.uint32(4)))
    m = (b1 & np.uint32(63)) if lo else ((b2 >> np.uint32(4)) | ((b1 >> np.uint32(6)) << np.uint32(4)))
    return _small_f32_device(sc), _small_f32_device(m)


@cuda.jit(device=True, inline=True)
def _q4k_factors_device(h0, h1, j):
    """(dd, dm) of sub-block j: d*sc and dmin*m, both exact in FP32 (11 x 6 significant bits)."""
    d = f16_bits_device(np.uint32(h0 & np.uint64(0xFFFF)))
    dmin = f16_bits_device(np.uint32((h0 >> np.uint64(16)) & np.uint64(0xFFFF)))
    sc, m = _scale_min_device(h0, h1, j)
    return d * sc, dmin * m


if SIM:
    @cuda.jit(device=True)
    def _nibbles8_device(q, shift):
        """The 4-bit fields at bit 8b + shift (b = 0..7) of uint64 q as 8 float32 (the simulator: one NumPy op)."""
        v = ((np.array([q], np.uint64).view(np.uint8) >> np.uint8(shift)) & np.uint8(0xF)).astype(np.float32)
        return v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]
else:
    @cuda.jit(device=True, inline=True)
    def _nibble32_f32_device(w, shift):
        """float32 of the 4-bit field of uint32 w at bit `shift`, exactly."""
        return _small_f32_device((w >> np.uint32(shift)) & np.uint32(0xF))

    @cuda.jit(device=True, inline=True)
    def _nibbles8_device(q, shift):
        """The 4-bit fields at bit 8b + shift (b = 0..7) of uint64 q as 8 float32 (32-bit halves: no 64-bit shifts)."""
        lo = np.uint32(q & np.uint64(0xFFFFFFFF))
        hi = np.uint32(q >> np.uint64(32))
        return (_nibble32_f32_device(lo, shift), _nibble32_f32_device(lo, 8 + shift),
                _nibble32_f32_device(lo, 16 + shift), _nibble32_f32_device(lo, 24 + shift),
                _nibble32_f32_device(hi, shift), _nibble32_f32_device(hi, 8 + shift),
                _nibble32_f32_device(hi, 16 + shift), _nibble32_f32_device(hi, 24 + shift))


@cuda.jit(device=True, inline=True)
def _q4k_dot8_device(q, shift, dd, dm, x, t, k0, acc):
    """acc + sum over the 8 bytes b of q of w_b * x[t, k0 + b], w_b = fl(dd * nibble_b - dm) (the nibble at bit
    8b + shift); FMAs in byte order."""
    n0, n1, n2, n3, n4, n5, n6, n7 = _nibbles8_device(q, shift)
    acc = cuda.fma(cuda.fma(dd, n0, -dm), x[t, k0], acc)
    acc = cuda.fma(cuda.fma(dd, n1, -dm), x[t, k0 + 1], acc)
    acc = cuda.fma(cuda.fma(dd, n2, -dm), x[t, k0 + 2], acc)
    acc = cuda.fma(cuda.fma(dd, n3, -dm), x[t, k0 + 3], acc)
    acc = cuda.fma(cuda.fma(dd, n4, -dm), x[t, k0 + 4], acc)
    acc = cuda.fma(cuda.fma(dd, n5, -dm), x[t, k0 + 5], acc)
    acc = cuda.fma(cuda.fma(dd, n6, -dm), x[t, k0 + 6], acc)
    return cuda.fma(cuda.fma(dd, n7, -dm), x[t, k0 + 7], acc)


def _make_q4k_kernel(tt):
    """q4_K GEMV for `tt` tokens per pass; x [T, G*K], w64 [N, NB*18]."""
    @cuda.jit(cache=True)
    def q4k_gemv_kernel(x, w64, rows_per_group, out_bf16, out):
        red = cuda.shared.array((WARPS_PER_BLOCK, WARP), np.float32)
        lane = cuda.threadIdx.x % WARP
        row = cuda.blockIdx.x * WARPS_PER_BLOCK + cuda.threadIdx.x // WARP
        n_rows, n_words = w64.shape
        n_tok = x.shape[0]
        if row >= n_rows:
            return                                        # warp-uniform
        nb = n_words // Q4K_WORDS
        xrow0 = (row // rows_per_group) * nb * QK_K           # first input of the row's group
        half = lane // 16                                 # which super-block of the pair
        c = (lane % 16) // 4                              # sub-blocks 2c (low nibbles) and 2c + 1 (high)
        e8 = lane % 4                                     # 8-weight chunk of the sub-blocks
        acc = cuda.local.array(tt, np.float32)
        for t0 in range(0, n_tok, tt):
            for i in range(tt):
                acc[i] = np.float32(0.0)
            sb = half
            while sb < nb:
                sb2 = sb + 2
                base = Q4K_WORDS * sb
                h0 = w64[row, base]
                h1 = w64[row, base + 1]
                q = w64[row, base + 2 + 4 * c + e8]
                has2 = sb2 < nb
                h0b = np.uint64(0)
                h1b = np.uint64(0)
                qb = np.uint64(0)
                if has2:                                  # the next step's loads go out with this step's
                    base2 = Q4K_WORDS * sb2
                    h0b = w64[row, base2]
                    h1b = w64[row, base2 + 1]
                    qb = w64[row, base2 + 2 + 4 * c + e8]
                dd0, dm0 = _q4k_factors_device(h0, h1, 2 * c)
                dd1, dm1 = _q4k_factors_device(h0, h1, 2 * c + 1)
                xk = xrow0 + QK_K * sb + 64 * c + 8 * e8
                for i in range(tt):
                    if t0 + i < n_tok:
                        a = _q4k_dot8_device(q, 0, dd0, dm0, x, t0 + i, xk, acc[i])
                        acc[i] = _q4k_dot8_device(q, 4, dd1, dm1, x, t0 + i, xk + 32, a)
                if has2:
                    dd0, dm0 = _q4k_factors_device(h0b, h1b, 2 * c)
                    dd1, dm1 = _q4k_factors_device(h0b, h1b, 2 * c + 1)
                    xk = xrow0 + QK_K * sb2 + 64 * c + 8 * e8
                    for i in range(tt):
                        if t0 + i < n_tok:
                            a = _q4k_dot8_device(qb, 0, dd0, dm0, x, t0 + i, xk, acc[i])
                            acc[i] = _q4k_dot8_device(qb, 4, dd1, dm1, x, t0 + i, xk + 32, a)
                sb += 4
            for i in range(tt):
                if t0 + i < n_tok:                        # block-uniform: every warp has the same tokens
                    v = warp_sum_device(acc[i], red[cuda.threadIdx.x // WARP])
                    if lane == 0:
                        out[t0 + i, row] = round_bf16_device(v) if out_bf16 else v
    return q4k_gemv_kernel


if SIM:
    _f16_header_device = f16_bits_device
else:
    from llvmlite import ir as _ir
    from numba.core import types as _types
    from numba.core.extending import intrinsic as _intrinsic

    @_intrinsic
    def _cvt_f32_f16(typingctx, h):
        """cvt.f32.f16: the hardware conversion of an IEEE half (exact for every finite value)."""
        sig = _types.float32(_types.uint16)

        def codegen(context, builder, signature, args):
            fnty = _ir.FunctionType(_ir.FloatType(), [_ir.IntType(16)])
            return builder.call(_ir.InlineAsm(fnty, "cvt.f32.f16 $0, $1;", "=f,h"), args)
        return sig, codegen

    @cuda.jit(device=True, inline=True)
    def _f16_header_device(h):
        """f16 bits (low 16 bits of h) -> float32 by the hardware conversion: f16_bits_device's bits for every
        finite or infinite half; a NaN stays a NaN (its payload bits may differ, and any row it enters is NaN)."""
        return _cvt_f32_f16(np.uint16(h & np.uint32(0xFFFF)))


@cuda.jit(device=True, inline=True)
def _q4k_factors_hw_device(h0, h1, j):
    """_q4k_factors_device with the header's two halves converted by the hardware."""
    lo = np.uint32(h0 & np.uint64(0xFFFFFFFF))
    sc, m = _scale_min_device(h0, h1, j)
    return _f16_header_device(lo) * sc, _f16_header_device(lo >> np.uint32(16)) * m


@cuda.jit(device=True, inline=True)
def _q4k_dot8u_device(q, shift, dd, dm, x1, k2, acc):
    """acc + sum over the 8 bytes b of q of w_b * x_b, w_b = fl(dd * nibble_b - dm), FMAs in byte order (as
    _q4k_dot8_device), with the 8 activations read as four 8-byte words of x as a flat uint64 array (k2 = k0 / 2)
    with an unsigned index: no signed-index wraparound or row-stride arithmetic per load."""
    n0, n1, n2, n3, n4, n5, n6, n7 = _nibbles8_device(q, shift)
    w = x1[k2]
    x0, x1_ = f32x2_device(w, 0), f32x2_device(w, 1)
    w = x1[k2 + np.uint64(1)]
    x2, x3 = f32x2_device(w, 0), f32x2_device(w, 1)
    w = x1[k2 + np.uint64(2)]
    x4, x5 = f32x2_device(w, 0), f32x2_device(w, 1)
    w = x1[k2 + np.uint64(3)]
    x6, x7 = f32x2_device(w, 0), f32x2_device(w, 1)
    acc = cuda.fma(cuda.fma(dd, n0, -dm), x0, acc)
    acc = cuda.fma(cuda.fma(dd, n1, -dm), x1_, acc)
    acc = cuda.fma(cuda.fma(dd, n2, -dm), x2, acc)
    acc = cuda.fma(cuda.fma(dd, n3, -dm), x3, acc)
    acc = cuda.fma(cuda.fma(dd, n4, -dm), x4, acc)
    acc = cuda.fma(cuda.fma(dd, n5, -dm), x5, acc)
    acc = cuda.fma(cuda.fma(dd, n6, -dm), x6, acc)
    return cuda.fma(cuda.fma(dd, n7, -dm), x7, acc)


@cuda.jit(device=True, inline=True)
def _q4k_stepu_device(w1, rb, sb, nb, lw):
    """(h0, h1, q) of super-block sb of the row starting at flat word rb, lane word lw = 2 + 4c + e8; zeros past
    the row. Unsigned flat indices."""
    if sb >= nb:
        return np.uint64(0), np.uint64(0), np.uint64(0)
    base = rb + np.uint64(Q4K_WORDS) * np.uint64(sb)
    return w1[base], w1[base + np.uint64(1)], w1[base + lw]


@cuda.jit(device=True, inline=True)
def _q4k_sbu_device(h0, h1, q, c, x1, k2, acc):
    """The lane's 16 weights of one super-block (sub-blocks 2c and 2c + 1) against x, accumulated in order."""
    dd0, dm0 = _q4k_factors_hw_device(h0, h1, 2 * c)
    dd1, dm1 = _q4k_factors_hw_device(h0, h1, 2 * c + 1)
    a = _q4k_dot8u_device(q, 0, dd0, dm0, x1, k2, acc)
    return _q4k_dot8u_device(q, 4, dd1, dm1, x1, k2 + np.uint64(16), a)


def _make_q4k_deep_kernel(warps):
    """Decode (one token) q4_K GEMV with four super-block steps of loads in flight per lane and 8-byte activation
    loads; per lane the same super-blocks in the same order as q4k_gemv_t1_kernel, so the same bits.
    x1 [G*K/2] (x as flat uint64), w1 [N*NB*18] (the weights as flat uint64 words), n_words = NB*18."""
    @cuda.jit(cache=True)
    def q4k_gemv_deep_kernel(x1, w1, n_words, rows_per_group, out_bf16, out):
        red = cuda.shared.array((warps, WARP), np.float32)
        lane = cuda.threadIdx.x % WARP
        row = cuda.blockIdx.x * warps + cuda.threadIdx.x // WARP
        n_rows = out.shape[1]
        if row >= n_rows:
            return
        nb = n_words // Q4K_WORDS
        rb = np.uint64(row) * np.uint64(n_words)
        xrow0 = (row // rows_per_group) * nb * QK_K
        half = lane // 16
        c = (lane % 16) // 4
        e8 = lane % 4
        lw = np.uint64(2 + 4 * c + e8)
        acc = np.float32(0.0)
        sb = half
        while sb < nb:
            a0, b0, q0 = _q4k_stepu_device(w1, rb, sb, nb, lw)
            a1, b1, q1 = _q4k_stepu_device(w1, rb, sb + 2, nb, lw)
            a2, b2, q2 = _q4k_stepu_device(w1, rb, sb + 4, nb, lw)
            a3, b3, q3 = _q4k_stepu_device(w1, rb, sb + 6, nb, lw)
            k2 = np.uint64((xrow0 + QK_K * sb + 64 * c + 8 * e8) // 2)
            acc = _q4k_sbu_device(a0, b0, q0, c, x1, k2, acc)
            if sb + 2 < nb:
                acc = _q4k_sbu_device(a1, b1, q1, c, x1, k2 + np.uint64(QK_K), acc)
            if sb + 4 < nb:
                acc = _q4k_sbu_device(a2, b2, q2, c, x1, k2 + np.uint64(2 * QK_K), acc)
            if sb + 6 < nb:
                acc = _q4k_sbu_device(a3, b3, q3, c, x1, k2 + np.uint64(3 * QK_K), acc)
            sb += 8
        v = warp_sum_device(acc, red[cuda.threadIdx.x // WARP])
        if lane == 0:
            out[0, row] = round_bf16_device(v) if out_bf16 else v
    return q4k_gemv_deep_kernel


q4k_gemv_deep_kernel = _make_q4k_deep_kernel(WARPS_PER_BLOCK)


@cuda.jit(device=True, inline=True)
def _q8_0_weight_device(w16, row, blk, i):
    """Weight i (0..31) of Q8_0 block `blk` of a row: f16 d * int8 q (exact)."""
    d = f16_bits_device(np.uint32(w16[row, Q8_0_HALVES * blk]))
    pair = np.uint32(w16[row, Q8_0_HALVES * blk + 1 + i // 2])
    q = np.int32((pair >> np.uint32(8 * (i % 2))) & np.uint32(0xFF))
    if q >= 128:
        q -= 256
    return d * np.float32(q)


def _make_q8_0_kernel(tt):
    """Q8_0 GEMV (the fallback of rows that are not a multiple of 256): lane i owns weight i of each block."""
    @cuda.jit(cache=True)
    def q8_0_gemv_kernel(x, w16, rows_per_group, out_bf16, out):
        red = cuda.shared.array((WARPS_PER_BLOCK, WARP), np.float32)
        lane = cuda.threadIdx.x % WARP
        row = cuda.blockIdx.x * WARPS_PER_BLOCK + cuda.threadIdx.x // WARP
        n_rows, n_halves = w16.shape
        n_tok = x.shape[0]
        if row >= n_rows:
            return
        nb = n_halves // Q8_0_HALVES
        x0 = (row // rows_per_group) * nb * QK8_0
        acc = cuda.local.array(tt, np.float32)
        for t0 in range(0, n_tok, tt):
            for i in range(tt):
                acc[i] = np.float32(0.0)
            for blk in range(nb):
                w = _q8_0_weight_device(w16, row, blk, lane)
                for i in range(tt):
                    if t0 + i < n_tok:
                        acc[i] = cuda.fma(w, x[t0 + i, x0 + QK8_0 * blk + lane], acc[i])
            for i in range(tt):
                if t0 + i < n_tok:
                    v = warp_sum_device(acc[i], red[cuda.threadIdx.x // WARP])
                    if lane == 0:
                        out[t0 + i, row] = round_bf16_device(v) if out_bf16 else v
    return q8_0_gemv_kernel


q4k_gemv_t1_kernel = _make_q4k_kernel(1)
q4k_gemv_t4_kernel = _make_q4k_kernel(TOKENS_WIDE)
q8_0_gemv_t1_kernel = _make_q8_0_kernel(1)
q8_0_gemv_t4_kernel = _make_q8_0_kernel(TOKENS_WIDE)


@cuda.jit(cache=True)
def q4k_rows_kernel(w8, ids, out):
    """out[t, k] = dequantize_q4k(w[ids[t]])[k]; one thread per output element."""
    n_tok, k_len = out.shape
    g = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if g >= n_tok * k_len:
        return
    t = g // k_len
    k = g % k_len
    row = ids[t]
    b0 = (k // QK_K) * 144
    s = (k % QK_K) // 32
    i = k % 32
    h0 = np.uint64(0)
    h1 = np.uint64(0)
    for j in range(8):
        h0 |= np.uint64(w8[row, b0 + j]) << np.uint64(8 * j)
        h1 |= np.uint64(w8[row, b0 + 8 + j]) << np.uint64(8 * j)
    dd, dm = _q4k_factors_device(h0, h1, s)
    byte = np.uint64(w8[row, b0 + 16 + 32 * (s // 2) + i])
    out[t, k] = cuda.fma(dd, _nibble_f32_device(byte, 4 * (s % 2)), -dm)


@cuda.jit(cache=True)
def q8_0_rows_kernel(w16, ids, out):
    """out[t, k] = dequantize_q8_0(w[ids[t]])[k]; one thread per output element."""
    n_tok, k_len = out.shape
    g = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if g >= n_tok * k_len:
        return
    t = g // k_len
    k = g % k_len
    out[t, k] = _q8_0_weight_device(w16, ids[t], k // QK8_0, k % QK8_0)


_GEMV_SIG = "void(float32[:, :], uint64[:, :], int64, boolean, float32[:, :])"
_Q8_SIG = "void(float32[:, :], uint16[:, :], int64, boolean, float32[:, :])"
SIGNATURES = {
    "q4k_gemv_t1_kernel": _GEMV_SIG,
    "q4k_gemv_t4_kernel": _GEMV_SIG,
    "q8_0_gemv_t1_kernel": _Q8_SIG,
    "q8_0_gemv_t4_kernel": _Q8_SIG,
    "q4k_gemv_deep_kernel": "void(uint64[:], uint64[:], int64, int64, boolean, float32[:, :])",
    "q4k_rows_kernel": "void(uint8[:, :], int64[:], float32[:, :])",
    "q8_0_rows_kernel": "void(uint16[:, :], int64[:], float32[:, :])",
}




def _contiguous(x):
    """Whether x can be re-viewed as uint64 words (C-contiguous rows of an even length)."""
    return x.shape[1] % 2 == 0 and bool(x.is_c_contiguous())


def _row_length(w, kind, name):
    if kind not in KINDS:
        raise ValueError(f"{name}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    per, nbytes = KINDS[kind]
    shape = tuple(w.shape)
    if len(shape) != 2 or w.dtype != np.uint8 or shape[1] % nbytes:
        raise ValueError(f"{name}: w must be uint8 [N, blocks * {nbytes}] ({kind} bytes), got {w.dtype} {shape}")
    return shape[1] // nbytes * per


# ----------------------------------------------------------------------------------------------- launchers
def q4k_gemv(x, w, *, kind="q4_K", quantize=True, out_bf16=True, rows_per_group=None, out=None, scratch=None,
             stream=0):
    """x [T, G*K] float32 (C-contiguous), w uint8 [N, K/256*144] (q4_K) or [N, K/32*34] (Q8_0) -> out [T, N] float32.

    `quantize` applies linear_q's activation rule (act_quant_fp8, block 32) to x first (into scratch);
    `out_bf16` rounds to BF16 (linear_q / linear_bf16), False keeps FP32 (linear_f32). `rows_per_group` (default
    N) maps row n to the x slice n // rows_per_group (attention's grouped wo_a)."""
    k = _row_length(w, kind, "q4k_gemv")
    n_rows = w.shape[0]
    if x.dtype != np.float32 or len(tuple(x.shape)) != 2:
        raise ValueError(f"q4k_gemv: x must be float32 [T, G*K], got {x.dtype} {x.shape}")
    rpg = n_rows if rows_per_group is None else int(rows_per_group)
    if rpg <= 0 or n_rows % rpg or x.shape[1] != (n_rows // rpg) * k:
        raise ValueError(f"q4k_gemv: x {x.shape} does not fit {kind} weights of {n_rows} rows x {k} with {rpg} "
                         f"rows per group")
    n_tok = x.shape[0]
    if out is None:
        out = cuda.device_array((n_tok, n_rows), dtype=np.float32, stream=stream)
    elif tuple(out.shape) != (n_tok, n_rows):
        raise ValueError(f"q4k_gemv: out {out.shape} must be {(n_tok, n_rows)}")
    if n_tok == 0 or n_rows == 0:
        return out
    if quantize:
        x = act_quant_fp8(x, out=_scratch(scratch, "xq", tuple(x.shape), np.float32, stream), stream=stream)
    grid = (n_rows + WARPS_PER_BLOCK - 1) // WARPS_PER_BLOCK
    if kind == "q4_K" and n_tok == 1 and _contiguous(x):
        w64 = w.view(np.uint64)
        q4k_gemv_deep_kernel[grid, WARP * WARPS_PER_BLOCK, stream](
            x.view(np.uint64).reshape(x.shape[1] // 2), w64.reshape(w64.shape[0] * w64.shape[1]), w64.shape[1], rpg,
            bool(out_bf16), out)
    elif kind == "q4_K":
        kernel = q4k_gemv_t1_kernel if n_tok == 1 else q4k_gemv_t4_kernel
        kernel[grid, WARP * WARPS_PER_BLOCK, stream](x, w.view(np.uint64), rpg, bool(out_bf16), out)
    else:
        kernel = q8_0_gemv_t1_kernel if n_tok == 1 else q8_0_gemv_t4_kernel
        kernel[grid, WARP * WARPS_PER_BLOCK, stream](x, w.view(np.uint16), rpg, bool(out_bf16), out)
    return out


def q4k_rows(w, ids, *, kind="q4_K", out=None, stream=0):
    """Rows ids [T] int64 of a q4_K / Q8_0 table w uint8 [N, bytes] -> float32 [T, K] (dequantize_q4k's values)."""
    k = _row_length(w, kind, "q4k_rows")
    if ids.dtype != np.int64 or len(tuple(ids.shape)) != 1:
        raise ValueError(f"q4k_rows: ids must be int64 [T], got {ids.dtype} {ids.shape}")
    n_tok = ids.shape[0]
    if out is None:
        out = cuda.device_array((n_tok, k), dtype=np.float32, stream=stream)
    elif tuple(out.shape) != (n_tok, k):
        raise ValueError(f"q4k_rows: out {out.shape} must be {(n_tok, k)}")
    n = n_tok * k
    if n:
        grid = math.ceil(n / THREADS_ROWS)
        if kind == "q4_K":
            q4k_rows_kernel[grid, THREADS_ROWS, stream](w, ids, out)
        else:
            q8_0_rows_kernel[grid, THREADS_ROWS, stream](w.view(np.uint16), ids, out)
    return out

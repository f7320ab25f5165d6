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
Does not own: BF16/FP32 weights (kernels.gemv), the activation quantiser (kernels.gemv; its device numerics and the
codeword form the tensor-core path stages with: kernels.fp8), the warp reductions (kernels.warp), F16 fallback
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

The FP8 tensor-core path (`q4k_mma_kernel`): for x holding act_quant_fp8 values (quantize=True, or fp8_input=True from a
caller that quantised it) of matrices the integer path leaves to it (none by default: IM_FP8_MIN_* below; raised for
probes and a batched / prefill timing not yet made), q4_K rows are multiplied on the tensor cores with FP8 MMAs: each
block of 32 activations becomes E4M3 codes times a power of two, each 4-bit weight nibble is itself the E4M3 code of
q * 2^-9, and a sub-block's 32 products are one E4M3 MMA, issued as the two chained f16 MMAs that ptxas's sm_90
emulation of it runs (kernels.mma.mma_e4m3_f16h_device: the same bits without the emulation's add of a zero C; the
activations are staged as halves once); the sub-block's factors dd and dm and the block's scale are applied in FP32
afterwards (q4k_mma_kernel's docstring). It changes the summation order against the FMA kernels (a tolerance test
against the reference, as theirs), and on the GPU the tensor cores' own accumulation; a decode call and a batched call
give the same bits. With `norm` the path also applies an RMSNorm to x first (each block forms the row's scale itself,
kernels.rms_norm.row_scale_words_device, and norms what it stages): the bits of rms_norm(..., out_q=) then this GEMV,
without the norm's launch (the engine's q latent into wq_b where that takes this path: `norm_path`, never with the
default IM_FP8_MIN_*).

Both tensor-core kernels load their first weight words (q4k_mma: the first super-block; q4k_imma: the first batch)
before their grid entry (EARLY_WEIGHTS; kernels.pdl): weights are never written by a step's kernels, so inside a
graph with programmatic edges those DRAM reads overlap the predecessor's end. The same loads, the same bits.
The one-token kernels of both tensor-core paths (q4k_mma_t1_kernel; q4k_imma_t1_kernel and its staging twin) take
their weights through a ring of MMA_RING / IM_RING super-block tiles a warp (16 rows x 144 bytes, rows padded to 160)
in dynamic shared memory, filled by cp.async (kernels.cp_async): the next tiles are on their way from DRAM while the
warp computes, without holding registers, and the first ones are issued before the grid entry. Ring 0 keeps the
register paths (q4k_mma: the next super-block's words loaded one ahead; q4k_imma: IM_BATCH super-blocks' words at a
time, nothing in flight during their MMAs). A lane reads the words the register path loads: the same bits. The
weights must lie on 16 bytes (the launcher checks). Measured on an H100 (BENCHMARKS.md, thirty-third session), rings
of 2 did not make the step faster (wq_b 15.5 -> 17.5 us, the head 184 -> 168, wq_a 9.8 -> 8.2, wo_a and wo_b
unchanged; the step 8.19 -> 8.39 ms): both default to 0, the rings stay for probes (q4k_probe --rings).

The integer tensor-core path (`q4k_imma_kernel`, `q4k_imma_t1_kernel`): activations of q4_K rows whose 16-row tiles lie
in one input group (`im_fits`): FP32 / BF16 ones (the head, grouped wo_a) and, by default, every FP8-grid one
(quantize=True or fp8_input=True: IM_FP8_MIN_ROWS = IM_FP8_MIN_SB = 0, so every shape). FP8-grid values are exact on its
digits, so a sub-block's sum is an exact integer where q4k_mma's is the tensor cores' FP32 sum: other bits, not another
accuracy. Measured on an H100 (BENCHMARKS.md, thirty-seventh session; V4.1's shapes, a whole decode step as a CUDA
graph, 1k context), every FP8-grid matrix on this path made the step 7.72 / 7.70 -> 7.48 / 7.46 ms in two runs (-3.1 %;
an earlier session -3.7 %): wq_a 10.14 -> 7.85 us a call, the shared expert's w2 9.85 -> 7.55, wq_b 15.5 -> 15.9; moving
wq_a alone was slower (+0.35 ms), moving only matrices of at least 4,096 rows about the same (-0.06). Which path an
FP8-grid call takes is still a function of the shape alone (at least IM_FP8_MIN_ROWS rows and IM_FP8_MIN_SB super-blocks
a row), so a token's bits are the same in decode and batched calls; raising the two gives the smaller matrices back to
q4k_mma and the norm-in-staging fusion (`norm_path`, the engine's NORM_IN_STAGING), kept for probes and for a batched /
prefill timing that has not been made. q4k_im_stage_kernel turns each block of 32 activations into a power of two p and
integers X = round(x / p) of 23 bits (the block's largest |x| / p in [2^21, 2^22), so the rounding costs at most 2^-22
of it, about FP32's own precision) held as three byte digits; the nibble bytes of the base file are the u8 MMA's A as
they lie (masked), the digits its B, and the three digit sums of a sub-block are exact integers, combined in FP32 into
S; a sub-block adds (dd * S - dm * X) * p. Against the FMA kernels (up to 11 instructions a weight) it takes a fraction
of the instructions: on the H200 the head went 360 -> 190 us and wo_a 23.2 -> 16.4 us a call, at the FMA kernels'
accuracy (BENCHMARKS.md). A decode call and a batched call give the same bits. A block of 32 holding a NaN or an
infinity makes its rows NaN (the FMA kernels would give an infinity where the reference does). The FMA kernels remain
for tiles across groups, strided x and Q8_0.
A one-token call on this path runs kernels.q4k_dp4a's kernel instead of q4k_imma_t1_kernel (USE_DP4A): the same
digit sums by the SIMD byte dot product, the same FP32 operations in the same order, so the same bits, with no MMA
of which seven columns in eight are idle (on the H200 the head went 178 -> 119 us a call, wo_a 17.2 -> 10.5;
BENCHMARKS.md, thirty-fourth session); the imma kernel stays for weights off 16 bytes and for probes.

Shapes: T tokens, N rows, K row length (per group), G groups, NB = K/256 super-blocks (q4_K) or K/32 blocks (Q8_0).
"""
import math

import numpy as np
from numba import cuda
from numba import uint64 as nb_uint64
from numba.cuda.core import config as _cuda_config

from kernels import bounded_jit, inline_device, on_bytes, smem_launch
from kernels.bf16 import bits_f32, f16_bits_device, f32x2_device, round_bf16_device
from kernels.cp_async import cp_async16_device, cp_async_commit_device, cp_async_wait_device
from kernels.fp8 import (act_quant_fp8_lane_device, code_word_device, fp8_block_scale_device, pow2_inverse_device,
                         quant8_device)
from kernels.gemv import act_quant_fp8
from kernels.im_operand import (FLT_MAX, check_im_staged, im_bytes4_device, im_int_device, im_scale_device,
                                im_stage_lane_device, im_stage_shapes)
from kernels.mma import (LOAD4_ALIGN, MMA_EX_WORDS, byte_perm_device, e4m3x8_to_f16x2_device, load4_device,
                         load_at_device, mma_e4m3_f16h_device, mma_u8s8_device, mma_u8u8_device)
from kernels.pdl import grid_entry_device
from kernels.rms_norm import row_scale_words_device
from kernels.warp import quad_max_device, quad_sum_device, warp_sum_device
from kernels.scratch import scratch_array as _scratch, scratch_arrays
from kernels.ticket import take_ticket_device

__all__ = ["q4k_gemv", "q4k_rows", "q4k_gemv_t1_kernel", "q4k_gemv_t4_kernel", "q4k_gemv_deep_kernel",
           "q4k_mma_kernel", "q4k_mma_t1_kernel", "q4k_imma_kernel", "q4k_imma_t1_kernel", "q4k_imma_t1s_kernel",
           "q4k_im_stage_kernel", "im_fits", "im_path", "norm_path", "stage_out_path", "im_stage", "mma_splits",
           "mma_part_rows", "mma_part_bytes", "fp8_scratch_bytes",
           "q8_0_gemv_t1_kernel", "q8_0_gemv_t4_kernel", "q4k_rows_kernel", "q8_0_rows_kernel", "SIGNATURES", "KINDS",
           "EARLY_READS"]

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
MMA_WARPS = 4                  # tensor-core path: warps per block,
MMA_ROWS = 16                  # rows per warp (the MMA's M),
MMA_TOK = 8                    # tokens per pass (its N),
MMA_STAGE_SB = 32              # token x super-blocks of activations staged in shared memory at a time,
MMA_STAGE_BLK = MMA_STAGE_SB * QK_K // 32       # their blocks of 32 (a scale and a code sum each),
MMA_CODES_WORDS = MMA_STAGE_SB * QK_K // 8 + 4 * MMA_TOK   # their groups of 8 codes (16 bytes of halves each; 4
#                                                          groups of padding a token row)
MMA_CODES_U32 = 4 * MMA_CODES_WORDS                        # their halves as uint32 (two a word)
MMA_TARGET_BLOCKS = 528        # K is split until a matrix has about this many blocks (a function of its shape)
MMA_MIN_BLOCKS_T1 = 4          # resident blocks per SM the decode kernel is compiled for (<= 128 registers)
MMA_RING = 0                   # the decode kernel's weight tiles in flight per warp (cp.async into shared memory;
                               # 0: the register path, the next super-block's words loaded one ahead). 0: a ring of
                               # 2 made wq_b 15.5 -> 17.5 us and a V4.1 step 0.2 ms slower (H100, BENCHMARKS.md)
RING_ROW_WORDS = 20            # a ring row: one super-block of a weight row (18 words) and 16 bytes of padding,
                               # so the 8-byte reads of a half warp (4 rows x 4 lanes) hit distinct banks
RING_TILE_WORDS = 16 * RING_ROW_WORDS             # a warp's 16 rows of one super-block (the MMA's M)
RING_COPIES = 5                                   # copies a lane issues a tile (9 pieces of a row, two lanes)
RING_ALIGN = None if SIM else 16                  # cp.async's 16-byte destinations
MMA_MIN_BLOCKS = 2             # the batched kernel's
MMA_PART_TOKENS = 64           # tokens per launch of a split matrix (bounds its slice-partials scratch)
USE_MMA = True                 # FP8-grid activations the integer path leaves (IM_FP8_MIN_*; none by default) take
                               # the FP8 tensor-core path (bench/dev/q4k_probe.py compares)
USE_IMMA = True                # other activations take the integer tensor-core path where im_fits (q4k_probe compares)
USE_DP4A = True                # one-token integer-path calls run kernels.q4k_dp4a's kernel (the same bits; dp4a)
EARLY_WEIGHTS = True           # the tensor-core kernels load their first weight words before the grid entry,
EARLY_READS = {"q4k_mma_kernel": ("w1", "n_words", "sps"),       # reading only these parameters (and shapes)
               "q4k_imma_kernel": ("w1", "n_words", "rows_per_group", "kx")}   # before it (kernels.pdl)


@inline_device
def _nibble_f32_device(word, shift):
    """float32 of the 4-bit field of `word` (uint64) at bit `shift`, exactly (2^23 + q - 2^23)."""
    q = np.uint32((word >> np.uint64(shift)) & np.uint64(0xF))
    return bits_f32(np.uint32(0x4B000000) | q) - MAGIC


@inline_device
def _small_f32_device(v):
    """float32 of a uint32 v < 2^23, exactly (2^23 + v - 2^23): an OR and an FADD instead of a conversion."""
    return bits_f32(np.uint32(0x4B000000) | v) - MAGIC


@inline_device
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


@inline_device
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
    @inline_device
    def _nibble32_f32_device(w, shift):
        """float32 of the 4-bit field of uint32 w at bit `shift`, exactly."""
        return _small_f32_device((w >> np.uint32(shift)) & np.uint32(0xF))

    @inline_device
    def _nibbles8_device(q, shift):
        """The 4-bit fields at bit 8b + shift (b = 0..7) of uint64 q as 8 float32 (32-bit halves: no 64-bit shifts)."""
        lo = np.uint32(q & np.uint64(0xFFFFFFFF))
        hi = np.uint32(q >> np.uint64(32))
        return (_nibble32_f32_device(lo, shift), _nibble32_f32_device(lo, 8 + shift),
                _nibble32_f32_device(lo, 16 + shift), _nibble32_f32_device(lo, 24 + shift),
                _nibble32_f32_device(hi, shift), _nibble32_f32_device(hi, 8 + shift),
                _nibble32_f32_device(hi, 16 + shift), _nibble32_f32_device(hi, 24 + shift))


@inline_device
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
        grid_entry_device()
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

    @inline_device
    def _f16_header_device(h):
        """f16 bits (low 16 bits of h) -> float32 by the hardware conversion: f16_bits_device's bits for every
        finite or infinite half; a NaN stays a NaN (its payload bits may differ, and any row it enters is NaN)."""
        return _cvt_f32_f16(np.uint16(h & np.uint32(0xFFFF)))


@inline_device
def _q4k_factors_hw_device(h0, h1, j):
    """_q4k_factors_device with the header's two halves converted by the hardware."""
    lo = np.uint32(h0 & np.uint64(0xFFFFFFFF))
    sc, m = _scale_min_device(h0, h1, j)
    return _f16_header_device(lo) * sc, _f16_header_device(lo >> np.uint32(16)) * m


@inline_device
def _q4k_factor_pair_hw_device(h0, h1, t):
    """_q4k_factors_hw_device of sub-blocks 2t and 2t + 1 together -> (dd, dm of 2t, dd, dm of 2t + 1), the same
    values (_q4k_factor_pair_words_device on the header's four 32-bit words)."""
    return _q4k_factor_pair_words_device(np.uint32(h0 & np.uint64(0xFFFFFFFF)), np.uint32(h0 >> np.uint64(32)),
                                         np.uint32(h1 & np.uint64(0xFFFFFFFF)), np.uint32(h1 >> np.uint64(32)), t)


@inline_device
def _q4k_factor_pair_words_device(u0, u1, u2, u3, t):
    """(dd, dm of sub-block 2t, dd, dm of 2t + 1) of a super-block whose header is the 32-bit words u0 (d, dmin), u1,
    u2, u3 (scale bytes 0-3, 4-7, 8-11). Their scale bytes are neighbours (bytes j = 2(t % 2) and j + 1 of each
    third), so one shift a third brings both down, and the two 6-bit fields are formed side by side in 16 bits (the
    masks keep each byte's bits to itself). Sub-blocks 0-3 take the low 6 bits of bytes j (scale) and 4 + j (min);
    4-7 a nibble of byte 8 + j with the top 2 bits of byte j or 4 + j above it. One formula serves both, with shifts
    and masks that depend on t alone (lanes of a warp hold different t: no branch, no select). Each field becomes a
    float by a byte permutation into 2^23's bits and a subtraction; d and dmin by the hardware's conversion."""
    hi = np.uint32(t >> 1)                                    # sub-blocks 4-7
    sh = np.uint32(16) * np.uint32(t & 1)
    s2 = np.uint32(2) * hi                                    # top bits of byte j / 4 + j: 6-7 -> 4-5
    keep = np.uint32(0x3F3F) - np.uint32(0x0F0F) * hi         # 0x3F3F, or 0x3030
    nib = np.uint32(0x0F0F) * hi                              # 0, or the nibble of byte 8 + j
    b0 = u1 >> sh                                             # scale bytes j, j + 1 in bits 0-15
    b1 = u2 >> sh                                             # bytes 4 + j, 5 + j
    b2 = u3 >> sh                                             # bytes 8 + j, 9 + j
    sc = ((b0 >> s2) & keep) | (b2 & nib)
    m = ((b1 >> s2) & keep) | ((b2 >> np.uint32(4)) & nib)
    one = np.uint32(0x4B000000)
    sc0 = bits_f32(byte_perm_device(sc, one, 0x7540)) - MAGIC
    sc1 = bits_f32(byte_perm_device(sc, one, 0x7541)) - MAGIC
    m0 = bits_f32(byte_perm_device(m, one, 0x7540)) - MAGIC
    m1 = bits_f32(byte_perm_device(m, one, 0x7541)) - MAGIC
    d = _f16_header_device(u0)
    dmin = _f16_header_device(u0 >> np.uint32(16))
    return d * sc0, dmin * m0, d * sc1, dmin * m1


@inline_device
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


@inline_device
def _q4k_stepu_device(w1, rb, sb, nb, lw):
    """(h0, h1, q) of super-block sb of the row starting at flat word rb, lane word lw = 2 + 4c + e8; zeros past
    the row. Unsigned flat indices."""
    if sb >= nb:
        return np.uint64(0), np.uint64(0), np.uint64(0)
    base = rb + np.uint64(Q4K_WORDS) * np.uint64(sb)
    return w1[base], w1[base + np.uint64(1)], w1[base + lw]


@inline_device
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
        grid_entry_device()
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


# ------------------------------------------------------------------------------ the tensor-core path (FP8 inputs)
@inline_device
def _x8_device(x1, base, raw, red):
    """_quant8_device of the 8 activations at flat uint64 word `base` of x (four words)."""
    w0 = x1[base]
    w1 = x1[base + np.uint64(1)]
    w2 = x1[base + np.uint64(2)]
    w3 = x1[base + np.uint64(3)]
    return quant8_device(f32x2_device(w0, 0), f32x2_device(w0, 1), f32x2_device(w1, 0), f32x2_device(w1, 1),
                         f32x2_device(w2, 0), f32x2_device(w2, 1), f32x2_device(w3, 0), f32x2_device(w3, 1),
                         raw, red)


@inline_device
def _x8_norm_device(x1, base, nw1, kb, s, red):
    """_x8_device of rms_norm's output: the 8 activations at flat word `base` of x normed as rms_norm_kernel stores
    them, bf16(w * (x * s)) with s the row's scale and w the norm weight's 8 values at flat word kb of nw1, then
    act_quant_fp8's rule (quant8_device, raw)."""
    return quant8_device(_normed_device(x1, base, nw1, kb, s, 0, 0), _normed_device(x1, base, nw1, kb, s, 0, 1),
                         _normed_device(x1, base, nw1, kb, s, 1, 0), _normed_device(x1, base, nw1, kb, s, 1, 1),
                         _normed_device(x1, base, nw1, kb, s, 2, 0), _normed_device(x1, base, nw1, kb, s, 2, 1),
                         _normed_device(x1, base, nw1, kb, s, 3, 0), _normed_device(x1, base, nw1, kb, s, 3, 1),
                         True, red)


@inline_device
def _normed_device(x1, base, nw1, kb, s, i, h):
    """bf16(w * (x * s)) of half h of word i after `base` of x and kb of the norm weight (rms_norm's stored
    value)."""
    return round_bf16_device(f32x2_device(nw1[kb + np.uint64(i)], h) * (f32x2_device(x1[base + np.uint64(i)], h) * s))


@cuda.jit(device=True)
def _stage_fp8_device(x1, kx, t0, nt, k0, n_sb, pitch, stride, codes, scl, xsum, red, raw, norm, nw1, nscl):
    """Tokens t0..t0+nt-1, inputs k0 .. k0 + 256*n_sb - 1 of x (FP8-grid float32; x1 its flat uint64 words, kx
    floats a row) -> E4M3 codes in shared memory as the halves of their values (`codes`, uint32: 8 codes a 16-byte
    group, as f16x2 words of codes 0-1, 4-5, 2-3, 6-7: the B registers of the first f16 MMA, then the second's, so a
    16-byte load lands them in place; token row r at group r*stride, groups in input order) and
    per token and block of 32 (index r*pitch + b) the power-of-two scale P (scl) and the exact FP32 sum of the
    block's codes (xsum: at most 32 * 448 in steps of 2^-9, so every partial sum is exact, in any order). `raw`:
    x holds unquantised values, and act_quant_fp8's rule is applied first with the same operations as its kernel,
    so the codes are those of the quantised x (the activation rule of linear_q without a launch of its own). A thread
    takes 8 inputs, the four threads of a quad one block (its max and sum over the quad). Every thread runs the
    same number of steps (the simulator's quad exchange is a block barrier): a token row at a time, its jobs in
    steps of the block, with no 64-bit division (a flat job index over rows, or a range with a run-time step, cost
    three calls of the division routine a job). `norm`: x is rms_norm's input, token row r's scale is nscl[r] and the
    norm weight's words are nw1 (one input group: kx is the row length); the staged values are those of
    act_quant_fp8(rms_norm(x)) (_x8_norm_device)."""
    nblk = 8 * n_sb
    per_row = 4 * nblk                                    # a multiple of 32: whole warps are in or out
    for r in range(nt):
        j0 = 0
        while j0 < per_row:
            j = j0 + cuda.threadIdx.x
            ok = j < per_row
            jj = j if ok else per_row - 1
            b = jj // 4
            part = jj % 4
            base = np.uint64(((t0 + r) * kx + k0 + 32 * b + 8 * part) // 2)
            if norm:
                v0, v1, v2, v3, v4, v5, v6, v7, am = _x8_norm_device(x1, base, nw1, np.uint64((k0 + 32 * b + 8 * part)
                                                                                                // 2), nscl[r], red)
            else:
                v0, v1, v2, v3, v4, v5, v6, v7, am = _x8_device(x1, base, raw, red)
            p = fp8_block_scale_device(am)
            word, sm = code_word_device(v0, v1, v2, v3, v4, v5, v6, v7, pow2_inverse_device(p))
            sm = quad_sum_device(sm, red)
            h0, h1, h2, h3 = e4m3x8_to_f16x2_device(word)
            if ok:
                o = 4 * (r * stride + 4 * b + part)   # in the order the two MMAs take them: codes 0-1, 4-5, 2-3, 6-7
                codes[o] = h0
                codes[o + 1] = h2
                codes[o + 2] = h1
                codes[o + 3] = h3
                if part == 0:
                    scl[r * pitch + b] = p
                    xsum[r * pitch + b] = sm
            j0 += cuda.blockDim.x


@inline_device
def _sub_block_term_device(dd, dm, d, xs, p, acc):
    """acc + (dd * 512 * d - dm * xs) * p: one sub-block's contribution to a row sum. d = sum of (q * 2^-9) *
    code over its 32 inputs (the MMA), xs = the sum of the codes, p = the block's scale, dd / dm its factors."""
    return cuda.fma(cuda.fma(dd * np.float32(512.0), d, -(dm * xs)), p, acc)


@inline_device
def _tile_rows_device(r0, g, n_rows, n_words):
    """Flat word offsets of rows r0 + g and r0 + g + 8 (a lane's two MMA fragment rows), rows past the end clamped to
    the last (read, never stored)."""
    return (np.uint64(min(r0 + g, n_rows - 1)) * np.uint64(n_words),
            np.uint64(min(r0 + g + 8, n_rows - 1)) * np.uint64(n_words))


@inline_device
def _mma_words_device(w1, wa, wb, sb, lw):
    """(header words of rows a and b, their nibble words of groups c = 0..3 for the lane) of super-block sb."""
    ba = wa + np.uint64(Q4K_WORDS * sb)
    bb = wb + np.uint64(Q4K_WORDS * sb)
    la = ba + lw
    lb = bb + lw
    return (load_at_device(w1, ba, 0), load_at_device(w1, ba, 1), load_at_device(w1, bb, 0), load_at_device(w1, bb, 1),
            load_at_device(w1, la, 0), load_at_device(w1, la, 4), load_at_device(w1, la, 8), load_at_device(w1, la, 12),
            load_at_device(w1, lb, 0), load_at_device(w1, lb, 4), load_at_device(w1, lb, 8), load_at_device(w1, lb, 12))


@inline_device
def _ring_issue_device(wr, w1, src, dst, half, sb, slot):
    """Start copying the lane's pieces of super-block sb into tile `slot` of the warp's ring wr. A tile is 16 rows x
    9 pieces of 16 bytes; lane (half, row) = (lane // 16, lane % 16) copies pieces half, half + 2, ... of its row
    (the first half-warp five, the second four), so each copy instruction reads two neighbouring pieces of every
    row (a 32-byte sector each). src: the word of the row's first piece of the lane in w1 (rows past the end read
    the last row, never stored); dst: its word in a tile."""
    s0 = src + np.uint64(Q4K_WORDS * sb)
    d0 = dst + np.uint64(slot * RING_TILE_WORDS)
    for j in range(RING_COPIES):
        if j < RING_COPIES - 1 or half == 0:
            cp_async16_device(wr, d0 + np.uint64(4 * j), w1, s0 + np.uint64(4 * j))


@inline_device
def _ring_lane_device(r0, lane, n_rows, n_words):
    """(src, dst, half) of the lane's copies into a warp's ring of rows r0 .. r0 + 15 (_ring_issue_device)."""
    half = lane // 16
    src = np.uint64(min(r0 + lane % 16, n_rows - 1)) * np.uint64(n_words) + np.uint64(2 * half)
    return src, np.uint64(RING_ROW_WORDS * (lane % 16) + 2 * half), half


@inline_device
def _ring_fill_device(wr, w1, src, dst, half, sb0, sb1, ring):
    """The ring's first `ring` tiles, super-blocks sb0 .. (those below sb1), a group of copies each (an empty group
    past sb1, so that every step waits for the same count)."""
    for k in range(ring):
        if sb0 + k < sb1:
            _ring_issue_device(wr, w1, src, dst, half, sb0 + k, k)
        cp_async_commit_device()


@inline_device
def _ring_refill_device(wr, w1, src, dst, half, sb, sb1, slot):
    """After tile `slot` was read: super-block sb into it if below sb1, and the step's group closed either way."""
    if sb < sb1:
        _ring_issue_device(wr, w1, src, dst, half, sb, slot)
    cp_async_commit_device()


@inline_device
def _ring_words_device(wr, slot, g, lw):
    """_mma_words_device's twelve words of the lane, read from tile `slot` of the warp's ring (rows g and g + 8)."""
    ba = np.uint64(slot * RING_TILE_WORDS + RING_ROW_WORDS * g)
    bb = ba + np.uint64(8 * RING_ROW_WORDS)
    la = ba + lw
    lb = bb + lw
    return (load_at_device(wr, ba, 0), load_at_device(wr, ba, 1), load_at_device(wr, bb, 0),
            load_at_device(wr, bb, 1), load_at_device(wr, la, 0), load_at_device(wr, la, 4),
            load_at_device(wr, la, 8), load_at_device(wr, la, 12), load_at_device(wr, lb, 0),
            load_at_device(wr, lb, 4), load_at_device(wr, lb, 8), load_at_device(wr, lb, 12))


@inline_device
def _pick4(c, v0, v1, v2, v3):
    return v0 if c == 0 else (v1 if c == 1 else (v2 if c == 2 else v3))


@inline_device
def _mma_sub_device(la, lb, ha, hb, sh, codes, i, ex):
    """The MMA of one sub-block: rows g / g+8 nibbles at bit `sh` of the lane's words against the staged halves of
    8 codes at codes[i .. i + 3] (one 16-byte load)."""
    m = np.uint32(0x0F0F0F0F)
    b0l, b1l, b0h, b1h = load4_device(codes, i)
    return mma_e4m3_f16h_device((la >> sh) & m, (lb >> sh) & m, (ha >> sh) & m, (hb >> sh) & m, b0l, b0h, b1l, b1h,
                                ex)


@inline_device
def _mma_step_t1_device(ha0, ha1, hb0, hb1, qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3, kb, t, codes, xsum, scl, ex, p):
    """One super-block of a one-token pass (its first block of 32 at kb in the stage; the lane's header and nibble
    words): the MMAs of its four groups, of which the lane keeps group t's, and its two sub-blocks' terms added to
    p[0] (row g) and p[2] (row g + 8)."""
    dda0, dma0, dda1, dma1 = _q4k_factor_pair_hw_device(ha0, ha1, t)
    ddb0, dmb0, ddb1, dmb1 = _q4k_factor_pair_hw_device(hb0, hb1, t)
    ka0 = np.float32(0.0)
    ka1 = np.float32(0.0)
    kb0 = np.float32(0.0)
    kb1 = np.float32(0.0)
    for c in range(4):
        qa = _pick4(c, qa0, qa1, qa2, qa3)
        qb = _pick4(c, qb0, qb1, qb2, qb3)
        la, ha = np.uint32(qa & np.uint64(0xFFFFFFFF)), np.uint32(qa >> np.uint64(32))
        lb, hb = np.uint32(qb & np.uint64(0xFFFFFFFF)), np.uint32(qb >> np.uint64(32))
        i0 = 4 * (4 * kb + 8 * c + t)
        d0, d1, d2, d3 = _mma_sub_device(la, lb, ha, hb, np.uint32(0), codes, i0, ex)
        e0, e1, e2, e3 = _mma_sub_device(la, lb, ha, hb, np.uint32(4), codes, i0 + 16, ex)
        if c == t:
            ka0, kb0, ka1, kb1 = d0, d2, e0, e2
    bt = kb + 2 * t
    p[0] = _sub_block_term_device(dda0, dma0, ka0, xsum[bt], scl[bt], p[0])
    p[0] = _sub_block_term_device(dda1, dma1, ka1, xsum[bt + 1], scl[bt + 1], p[0])
    p[2] = _sub_block_term_device(ddb0, dmb0, kb0, xsum[bt], scl[bt], p[2])
    p[2] = _sub_block_term_device(ddb1, dmb1, kb1, xsum[bt + 1], scl[bt + 1], p[2])


@inline_device
def _mma_step_device(ha0, ha1, hb0, hb1, qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3, kb, t, tr, n0, n1, nblk, stride,
                     codes, xsum, scl, ex, p):
    """One super-block of a pass of several tokens: the lane's B column is token row tr of the stage, its D columns
    tokens n0 and n1; every term goes to p[4c + j] (group c; j: row g / g + 8, column 2t / 2t + 1)."""
    for c in range(4):
        qa = _pick4(c, qa0, qa1, qa2, qa3)
        qb = _pick4(c, qb0, qb1, qb2, qb3)
        la, ha = np.uint32(qa & np.uint64(0xFFFFFFFF)), np.uint32(qa >> np.uint64(32))
        lb, hb = np.uint32(qb & np.uint64(0xFFFFFFFF)), np.uint32(qb >> np.uint64(32))
        for h in range(2):
            i = 4 * (tr * stride + 4 * kb + 8 * c + 4 * h + t)
            d0, d1, d2, d3 = _mma_sub_device(la, lb, ha, hb, np.uint32(4 * h), codes, i, ex)
            dda, dma = _q4k_factors_hw_device(ha0, ha1, 2 * c + h)
            ddb, dmb = _q4k_factors_hw_device(hb0, hb1, 2 * c + h)
            blk = kb + 2 * c + h
            b0 = n0 * nblk + blk
            b1 = n1 * nblk + blk
            p[4 * c] = _sub_block_term_device(dda, dma, d0, xsum[b0], scl[b0], p[4 * c])
            p[4 * c + 1] = _sub_block_term_device(dda, dma, d1, xsum[b1], scl[b1], p[4 * c + 1])
            p[4 * c + 2] = _sub_block_term_device(ddb, dmb, d2, xsum[b0], scl[b0], p[4 * c + 2])
            p[4 * c + 3] = _sub_block_term_device(ddb, dmb, d3, xsum[b1], scl[b1], p[4 * c + 3])


def _make_mma_kernel(decode, min_blocks, early=EARLY_WEIGHTS, ring=0):
    """q4k_mma_kernel for one-token calls (`decode`: the batched branch compiled out, fewer registers) or any
    token count; `min_blocks` resident blocks per SM bound its registers (launch_bounds); `early`: the first
    super-block's weight words loaded before the grid entry. `ring` (decode only; 0 or more): the weights come
    through a ring of that many super-block tiles a warp in shared memory, filled by cp.async (the kernel's
    docstring); 0 keeps them in registers, one super-block ahead."""
    if ring and not decode:
        raise ValueError("_make_mma_kernel: the weight ring is for the decode kernel")
    jit = bounded_jit(MMA_WARPS * WARP, min_blocks)
    ring_pending = max(ring - 1, 0)        # groups of copies a warp leaves in flight when it reads a tile
    ring_mod = max(ring, 1)
    ring_words = ring * RING_TILE_WORDS

    @jit
    def q4k_mma_kernel(x1, kx, w1, n_words, sps, n_slices, out_bf16, raw, norm, nw1, eps, part, counters, out):
        """q4_K GEMV / GEMM on the tensor cores for activations on the FP8 grid (act_quant_fp8 values; x1 = x [T, kx]
        as flat uint64 words), or for raw activations that it quantises itself by the same rule (`raw`).

        Block (bx, slice): rows bx*64 .. +63 (16 per warp: the MMA's M), super-blocks slice*sps .. +sps-1 of K, tokens
        in passes of up to 8 (the MMA's N; a pass's missing columns repeat its last token and are dropped). The
        activations of a pass are staged in shared memory as the halves of their E4M3 codes, converted once there
        instead of in every warp's MMAs (_stage_fp8_device; a one-token pass stages up to 32 super-blocks at once, 8
        tokens 4). Lane (g, t) loads 8 nibble bytes of rows g and g+8 per 32-byte group
        c of a super-block (the next super-block's loads go out before this one's MMAs): bytes 32c+8t .. +7 hold
        inputs 8t..8t+7 of sub-blocks 2c (low nibbles) and 2c+1 (high nibbles); a nibble byte masked to 0x0F is the
        E4M3 code of q * 2^-9 exactly (a subnormal for q < 8), so the MMA over a sub-block's 32 inputs gives d = sum of
        q * code * 2^-9, and the row sum is the sum over sub-blocks of (dd * 512 * d - dm * sum(code)) * P.

        Per row and token the terms go into four partial sums, p_c over the sub-blocks 2c and 2c+1 of the slice's
        super-blocks in order, combined as (p_0 + p_1) + (p_2 + p_3). A one-token pass has lane t form p_t (its
        factors dd, dm computed once per super-block, the MMA results of group c == t kept); a wider pass has each lane
        form all four for its two columns. The same operations in the same order, so a token's result does not depend
        on the tokens that share the call. Slices are added in slice order by the last block of a row block to finish
        (counters, reset to 0 by it); a single slice writes directly.

        `norm` (with `raw`): x is the input of rms_norm with weight nw1 (its float32 values as uint64 words) and eps,
        and the GEMV's input is act_quant_fp8(rms_norm(x)): every block forms each token's row scale itself
        (kernels.rms_norm.row_scale_words_device: rms_norm_kernel's sum to the bit), while its first weight words are
        in flight, and the staging norms the values it stages (the same bits as launching rms_norm(..., out_q=)
        first and passing out_q as FP8-grid input, without that launch).

        `ring` (the decode kernel): each warp keeps its next `ring` super-blocks' tiles (16 rows x 144 bytes) on
        their way from global memory into a ring in shared memory (cp.async: the copies hold no registers), issued
        before the grid entry for the first ones and refilled as each tile is read; the lane reads its twelve words
        from the tile, the same words the register path loads, so the same bits."""
        min_blocks                 # named: a closure value, so in the cache key (kernels.bounded_jit)
        early                      # (the same)
        ring                       # (the same)
        ring_mod                   # (the same)
        ring_pending               # (the same)
        codes = cuda.shared.array(MMA_CODES_U32, np.uint32, alignment=LOAD4_ALIGN)     # halves, read 16 bytes a load
        scl = cuda.shared.array(MMA_STAGE_BLK, np.float32)
        xsum = cuda.shared.array(MMA_STAGE_BLK, np.float32)
        ex = cuda.shared.array((MMA_WARPS, WARP, MMA_EX_WORDS), np.uint32)
        red = cuda.shared.array((MMA_WARPS, WARP), np.float32)
        last = cuda.shared.array(1, np.int32)
        nsh = cuda.shared.array((MMA_TOK, WARP), np.float64)            # the norm's warp sums, a token row each
        nscl = cuda.shared.array(MMA_TOK, np.float32)                  # and its row scales
        rings = cuda.shared.array(0, np.uint64, alignment=RING_ALIGN)    # dynamic: ring_bytes(ring) at launch
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        g = lane // 4
        t = lane % 4
        n_tok, n_rows = out.shape
        nb = n_words // Q4K_WORDS
        r0 = cuda.blockIdx.x * (MMA_WARPS * MMA_ROWS) + warp * MMA_ROWS
        ra = r0 + g
        rb = r0 + g + 8
        wa, wb = _tile_rows_device(r0, g, n_rows, n_words)
        lw = np.uint64(2 + t)
        sl = cuda.blockIdx.y
        sb0 = sl * sps
        sb1 = min(nb, sb0 + sps)
        one = decode
        wr = rings[warp * ring_words:(warp + 1) * ring_words]
        src, dst, half = _ring_lane_device(r0, lane, n_rows, n_words)
        if ring:                   # weights are never written by a graph's kernels: the first tiles may be in
            _ring_fill_device(wr, w1, src, dst, half, sb0, sb1, ring)     # flight while the predecessor finishes
        elif early:                # (the same for the register path's first words)
            pre = _mma_words_device(w1, wa, wb, min(sb0, nb - 1), lw)
        grid_entry_device()
        p = cuda.local.array(16, np.float32)                  # [c][row g / g+8][column 2t / 2t+1]
        for t0 in range(0, n_tok, MMA_TOK):
            nt = min(MMA_TOK, n_tok - t0)
            csb = MMA_STAGE_SB // nt                           # super-blocks staged at a time
            stride = 32 * csb + 4                              # groups per staged token row (64 bytes of padding)
            nblk = 8 * csb
            tr = min(g, nt - 1)                                # the token of this lane's B column
            n0 = min(2 * t, nt - 1)                            # the tokens of its two D columns
            n1 = min(2 * t + 1, nt - 1)
            for i in range(16):
                p[i] = np.float32(0.0)
            for cb in range(sb0, sb1, csb):
                ce = min(sb1, cb + csb)
                if ring:
                    pass                                        # each super-block's words come from the ring
                elif early and t0 == 0 and cb == sb0:
                    (ha0, ha1, hb0, hb1, qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3) = pre
                else:
                    (ha0, ha1, hb0, hb1, qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3) = _mma_words_device(w1, wa, wb, cb,
                                                                                                     lw)
                if norm and cb == sb0:                          # block-uniform: the pass's row scales, once
                    for r in range(nt):
                        sr = row_scale_words_device(x1, np.uint64((t0 + r) * kx // 2), kx, eps, nsh[r])
                        if tid == 0:
                            nscl[r] = sr
                cuda.syncthreads()
                _stage_fp8_device(x1, kx, t0, nt, QK_K * cb, ce - cb, nblk, stride, codes, scl, xsum, red[warp], raw,
                                  norm, nw1, nscl)
                cuda.syncthreads()
                for sb in range(cb, ce):
                    if ring:               # tile sb - sb0 is the oldest group of copies: wait for it, read the
                        slot = (sb - sb0) % ring_mod               # lane's words, refill the slot with sb + ring
                        cp_async_wait_device(ring_pending)
                        cuda.syncwarp(0xFFFFFFFF)              # the other lanes' copies of the tile landed
                        (ha0, ha1, hb0, hb1, qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3) = _ring_words_device(wr, slot,
                                                                                                        g, lw)
                        cuda.syncwarp(0xFFFFFFFF)              # every lane has read the slot before it is refilled
                        _ring_refill_device(wr, w1, src, dst, half, sb + ring, sb1, slot)
                    else:
                        # the next super-block's words; past the chunk, the chunk's last again (never used: the next
                        # chunk loads its own first words), a load with no branch or zeros around it
                        (na0, na1, nb0, nb1, nqa0, nqa1, nqa2, nqa3, nqb0, nqb1, nqb2, nqb3) = _mma_words_device(
                            w1, wa, wb, min(sb + 1, ce - 1), lw)
                    if one:
                        _mma_step_t1_device(ha0, ha1, hb0, hb1, qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3, 8 * (sb - cb),
                                            t, codes, xsum, scl, ex[warp], p)
                    else:
                        _mma_step_device(ha0, ha1, hb0, hb1, qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3, 8 * (sb - cb), t,
                                         tr, n0, n1, nblk, stride, codes, xsum, scl, ex[warp], p)
                    if not ring:
                        (ha0, ha1, hb0, hb1, qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3) = (
                            na0, na1, nb0, nb1, nqa0, nqa1, nqa2, nqa3, nqb0, nqb1, nqb2, nqb3)
            if one:
                sa = quad_sum_device(p[0], red[warp])
                sbv = quad_sum_device(p[2], red[warp])
                if t == 0:
                    _mma_store_device(sa, t0, ra, sl, n_slices, out_bf16, part, out)
                    _mma_store_device(sbv, t0, rb, sl, n_slices, out_bf16, part, out)
            else:
                for j in range(4):                                   # (row g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)
                    col = 2 * t + j % 2
                    v = (p[j] + p[4 + j]) + (p[8 + j] + p[12 + j])
                    if col < nt:
                        _mma_store_device(v, t0 + col, ra if j < 2 else rb, sl, n_slices, out_bf16, part, out)
        if n_slices > 1:                                             # block-uniform; kernels.ticket's pattern
            cuda.syncthreads()
            if tid == 0:
                last[0] = 1 if take_ticket_device(counters, cuda.blockIdx.x) == n_slices - 1 else 0
            cuda.syncthreads()
            if last[0] == 1:
                rows = MMA_WARPS * MMA_ROWS
                for i in range(tid, n_tok * rows, cuda.blockDim.x):
                    tok = i // rows
                    row = cuda.blockIdx.x * rows + i % rows
                    if row < n_rows:
                        v = part[0, tok, row]
                        for s in range(1, n_slices):
                            v += part[s, tok, row]
                        out[tok, row] = round_bf16_device(v) if out_bf16 else v
                if tid == 0:
                    counters[cuda.blockIdx.x] = 0
    q4k_mma_kernel.ring_tiles = ring       # the launcher sizes the dynamic shared memory from it (ring_bytes)
    return q4k_mma_kernel


def _check_ring_alignment(kernel, w):
    """Refuses (ValueError) weights whose device address is not on 16 bytes for a kernel with a weight ring: its
    cp.async copies read 16-byte pieces (a q4_K row is a multiple of 16 bytes, so the first row's address decides).
    The engine's weights are allocations of their own (256-byte aligned) or row ranges of one."""
    if kernel.ring_tiles and not on_bytes(w, 16):
        raise ValueError(f"q4k_gemv: the weights' device address {w.device_ctypes_pointer.value:#x} is not on 16 "
                         f"bytes, which the one-token kernels' cp.async copies need")


def ring_bytes(ring):
    """Dynamic shared memory of a block of a decode kernel with a ring of `ring` tiles a warp (the FP8 and the
    integer kernels both have 4 warps a block)."""
    return MMA_WARPS * ring * RING_TILE_WORDS * 8


@inline_device
def _mma_store_device(v, tok, row, sl, n_slices, out_bf16, part, out):
    """A slice's row sum: the output itself (one slice) or its slot of the slice partials."""
    if row < out.shape[1]:
        if n_slices == 1:
            out[tok, row] = round_bf16_device(v) if out_bf16 else v
        else:
            part[sl, tok, row] = v


q4k_mma_t1_kernel = _make_mma_kernel(True, MMA_MIN_BLOCKS_T1, ring=MMA_RING)
q4k_mma_kernel = _make_mma_kernel(False, MMA_MIN_BLOCKS)


# ------------------------------ the integer tensor-core path (FP32 / BF16 activations; FP8-grid ones by default)
IM_WARPS = 4                   # warps of a block: the K quarters of one 16-row tile
IM_ROWS = 16                   # rows of a block (the MMA's M)
IM_BATCH = 2                   # super-blocks whose weight words a lane loads before using any of them,
IM_MIN_BLOCKS = 3              # resident blocks per SM the one-token kernel is compiled for (its register bound)
IM_RING = 0                    # the one-token kernels' weight tiles in flight per warp (cp.async; 0: IM_BATCH
                               # super-blocks' words loaded into registers at a time). 0: a ring of 2 sped up the
                               # head and wq_a but not wo_a / wo_b, and the step was slower (with MMA_RING = 2)
IM_SMEM_SB = 32                # a one-token call stages its tile's activations (<= 32 super-blocks) in shared memory
IM_SMEM_WORDS = IM_SMEM_SB * QK_K                 # (uint32 words of digit bytes: 8 per 8 inputs)
IM_SMEM_PS = IM_SMEM_SB * 16                      # (floats of its (p, X) pairs)
IM_FP8_MIN_ROWS = 0            # FP8-grid activations take this path for matrices of at least this many rows and
IM_FP8_MIN_SB = 0              # super-blocks a row, the others q4k_mma: 0, every matrix (a function of the shape
                               # alone, so a token's bits are the same in decode and batched calls). On an H100 a
                               # V4.1 step went 7.72 -> 7.48 ms with every FP8-grid matrix here (wq_a 10.14 -> 7.85
                               # us a call, shared w2 9.85 -> 7.55, wq_b 15.5 -> 15.9), +0.35 ms with wq_a alone,
                               # -0.06 with rows >= 4,096 alone (BENCHMARKS.md, thirty-seventh session; the imma
                               # kernel on the H200 earlier: wo_b 21.1 -> 18.3 us, wq_b 17.6 -> 23.6). Raised, they
                               # give q4k_mma and norm_path back (probes; a batched / prefill timing not yet made)
IM_STAGE_THREADS = 256         # threads of a staging block (8 inputs each),
IM_STAGE_WARPS = IM_STAGE_THREADS // WARP         # its warps

if SIM:
    @cuda.jit(device=True)
    def _quad_pick_u64_device(v, src, xch):
        """v of lane 4g + src (src 0..3) in every lane of quad g (the simulator: shared memory; `xch` is the warp's
        uint64 [32] slice of a shared array)."""
        lane = cuda.threadIdx.x % WARP
        xch[lane] = v
        cuda.syncwarp(0xFFFFFFFF)
        r = xch[lane - lane % 4 + src]
        cuda.syncwarp(0xFFFFFFFF)
        return r
else:
    @inline_device
    def _quad_pick_u64_device(v, src, xch):
        """v of lane 4g + src (src 0..3) in every lane of quad g (a 64-bit shuffle: two 32-bit ones; `xch` unused)."""
        lane = cuda.threadIdx.x % WARP
        return np.uint64(cuda.shfl_sync(0xFFFFFFFF, np.int64(v), lane - lane % 4 + src))


@cuda.jit(cache=True)
def q4k_im_stage_kernel(x1, kx, n_jobs, raw, xd, ps):
    """FP32 activations x [T, kx] (x1: its flat uint64 words) -> the integer tensor-core path's operands. Per token
    and block of 32 inputs: the power of two p with max |x| / p in [2^21, 2^22) (p = 1 for an all-zero block, never
    below 2^-126, NaN for a block holding a NaN or an infinity), per input X = round(x / p), an integer of at most 23
    bits (x / p is exact; the rounding costs at most 2^-22 of the block's largest |x|), split into digits X = d2 *
    2^16 + d1 * 2^8 + d0 with d0, d1 unsigned bytes and d2 a signed one. xd [T * kx] uint32: per 8 inputs the d0
    bytes (two words), the d1 bytes, the d2 bytes, two zero words (a lane's B fragments of one sub-block: two 16-byte
    loads). ps [T * kx/32 * 2] float32: per block p and the FP32 value of the exact integer sum of its X. A thread
    takes 8 inputs, the quad of four threads one block; job j = thread index (n_jobs = T * kx / 8). `raw`: x holds
    unquantised values, and act_quant_fp8's rule is applied first with the same operations as its kernel (the
    activation rule of linear_q without a launch of its own). FP8-grid values are integers here exactly: a block's
    smallest step, 2^-9 of its act_quant scale, is at least 2^3 p."""
    grid_entry_device()
    red = cuda.shared.array((IM_STAGE_WARPS, WARP), np.float32)
    redi = cuda.shared.array((IM_STAGE_WARPS, WARP), np.int32)
    j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    w = cuda.threadIdx.x // WARP
    ok = j < n_jobs
    jj = j if ok else n_jobs - 1                       # idle threads of the last warp still join the quad ops
    v0, v1, v2, v3, v4, v5, v6, v7, am = _x8_device(x1, np.uint64(jj * 4), raw, red[w])
    fin = ((abs(v0) <= FLT_MAX and abs(v1) <= FLT_MAX) and (abs(v2) <= FLT_MAX and abs(v3) <= FLT_MAX)
           and (abs(v4) <= FLT_MAX and abs(v5) <= FLT_MAX) and (abs(v6) <= FLT_MAX and abs(v7) <= FLT_MAX))
    bad = quad_max_device(np.float32(0.0) if fin else np.float32(1.0), red[w]) > np.float32(0.0)
    p, inv = im_scale_device(am)
    i0, i1, i2, i3 = im_int_device(v0, inv), im_int_device(v1, inv), im_int_device(v2, inv), im_int_device(v3, inv)
    i4, i5, i6, i7 = im_int_device(v4, inv), im_int_device(v5, inv), im_int_device(v6, inv), im_int_device(v7, inv)
    sm = quad_sum_device(((i0 + i1) + (i2 + i3)) + ((i4 + i5) + (i6 + i7)), redi[w])   # exact integers
    if ok:
        o = 8 * jj
        xd[o] = im_bytes4_device(i0, i1, i2, i3, 0)
        xd[o + 1] = im_bytes4_device(i4, i5, i6, i7, 0)
        xd[o + 2] = im_bytes4_device(i0, i1, i2, i3, 8)
        xd[o + 3] = im_bytes4_device(i4, i5, i6, i7, 8)
        xd[o + 4] = im_bytes4_device(i0, i1, i2, i3, 16)
        xd[o + 5] = im_bytes4_device(i4, i5, i6, i7, 16)
        xd[o + 6] = np.uint32(0)
        xd[o + 7] = np.uint32(0)
        if jj % 4 == 0:
            ps[jj // 2] = np.float32(np.nan) if bad else p
            ps[jj // 2 + 1] = np.float32(sm)


@inline_device
def _im_words_device(w1, wa, wb, sb, t, live):
    """A lane's weight words of super-block sb: header word t of (row a's two, row b's two), then the nibble words
    of groups c = 0..3 (bytes 32c + 8t .. +7 of the nibbles) of row a and of row b; zeros when not `live`."""
    z = np.uint64(0)
    if not live:
        return z, z, z, z, z, z, z, z, z
    o = np.uint64(Q4K_WORDS) * np.uint64(sb)
    ba = wa + o
    bb = wb + o
    lw = np.uint64(2 + t)
    hw = w1[(ba if t < 2 else bb) + np.uint64(t % 2)]
    return (hw, w1[ba + lw], w1[ba + lw + np.uint64(4)], w1[ba + lw + np.uint64(8)], w1[ba + lw + np.uint64(12)],
            w1[bb + lw], w1[bb + lw + np.uint64(4)], w1[bb + lw + np.uint64(8)], w1[bb + lw + np.uint64(12)])


@inline_device
def _ring_im_words_device(wr, slot, g, t, live):
    """_im_words_device's nine words of the lane, read from tile `slot` of the warp's ring; zeros when not `live`."""
    z = np.uint64(0)
    if not live:
        return z, z, z, z, z, z, z, z, z
    ba = np.uint64(slot * RING_TILE_WORDS + RING_ROW_WORDS * g)
    bb = ba + np.uint64(8 * RING_ROW_WORDS)
    lw = np.uint64(2 + t)
    la = ba + lw
    lb = bb + lw
    hw = wr[(ba if t < 2 else bb) + np.uint64(t % 2)]
    return (hw, load_at_device(wr, la, 0), load_at_device(wr, la, 4), load_at_device(wr, la, 8),
            load_at_device(wr, la, 12), load_at_device(wr, lb, 0), load_at_device(wr, lb, 4),
            load_at_device(wr, lb, 8), load_at_device(wr, lb, 12))


@inline_device
def _im_sub_device(qa, qb, h, xd, x0, ex):
    """The digit sums of sub-block 2c + h (nibble h of the lane's words qa / qb: rows g / g+8, bytes 8t .. 8t+7 =
    inputs 8t .. 8t+7) against the B columns' digits at xd[x0 ..]: three exact integer MMAs (d0, d1 unsigned, d2
    signed), their D registers (c0..c3 layout) as 12 int32, digit-major."""
    m = np.uint32(0x0F0F0F0F)
    sh = np.uint32(4 * h)
    a0 = (np.uint32(qa & np.uint64(0xFFFFFFFF)) >> sh) & m
    a2 = (np.uint32(qa >> np.uint64(32)) >> sh) & m
    a1 = (np.uint32(qb & np.uint64(0xFFFFFFFF)) >> sh) & m
    a3 = (np.uint32(qb >> np.uint64(32)) >> sh) & m
    b00, b01, b10, b11 = load4_device(xd, x0)
    b20, b21, _, _ = load4_device(xd, x0 + 4)
    z = np.int32(0)
    s00, s01, s02, s03 = mma_u8u8_device(a0, a1, a2, a3, b00, b01, z, z, z, z, ex)
    s10, s11, s12, s13 = mma_u8u8_device(a0, a1, a2, a3, b10, b11, z, z, z, z, ex)
    s20, s21, s22, s23 = mma_u8s8_device(a0, a1, a2, a3, b20, b21, z, z, z, z, ex)
    return s00, s01, s02, s03, s10, s11, s12, s13, s20, s21, s22, s23


@inline_device
def _im_s_device(s0, s1, s2):
    """S = s2 * 2^16 + s1 * 2^8 + s0 in FP32 (each digit sum converts exactly; two roundings, in this order)."""
    return cuda.fma(np.float32(s2), np.float32(65536.0), np.float32(s1) * np.float32(256.0)) + np.float32(s0)


@inline_device
def _im_term_device(dd, dm, s, xs, p, acc):
    """acc + (dd * S - dm * X) * p: a sub-block's contribution to a row sum (S = sum of q * round(x/p), X = sum of
    round(x/p))."""
    return cuda.fma(cuda.fma(dd, s, -(dm * xs)), p, acc)


@inline_device
def _im_keep_device(keep, r, k):
    """r's digit sums of rows g (D register 0) and g+8 (register 2) where `keep`, else k's (6 int32)."""
    if keep:
        return r[0], r[4], r[8], r[2], r[6], r[10]
    return k


@inline_device
def _im_headers_device(hw, xch):
    """The two header words of rows g and g + 8 (ha0, ha1, hb0, hb1) from the quad's four lanes, each of which
    loaded one of them (_im_words_device's word t)."""
    return (_quad_pick_u64_device(hw, 0, xch), _quad_pick_u64_device(hw, 1, xch), _quad_pick_u64_device(hw, 2, xch),
            _quad_pick_u64_device(hw, 3, xch))


@inline_device
def _im_sb_t1_device(hw, qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3, xd, xi, ps, bt, xch, ex, pa, pb):
    """One super-block of a one-token call: lane t's terms of sub-blocks 2t and 2t + 1 (rows g, g+8) added to pa, pb.
    hw: the lane's header word (_im_words_device), q*: its nibble words; xi: xd index of its 8 inputs of sub-block
    0; bt: ps index of sub-block 2t's (p, X). Every lane runs every group's MMAs (they are warp-wide) and keeps the
    digit sums of group c == t."""
    t = cuda.threadIdx.x % 4
    ha0, ha1, hb0, hb1 = _im_headers_device(hw, xch)
    z = np.int32(0)
    k0 = (z, z, z, z, z, z)
    k1 = (z, z, z, z, z, z)
    k0 = _im_keep_device(t == 0, _im_sub_device(qa0, qb0, 0, xd, xi, ex), k0)
    k1 = _im_keep_device(t == 0, _im_sub_device(qa0, qb0, 1, xd, xi + 32, ex), k1)
    k0 = _im_keep_device(t == 1, _im_sub_device(qa1, qb1, 0, xd, xi + 64, ex), k0)
    k1 = _im_keep_device(t == 1, _im_sub_device(qa1, qb1, 1, xd, xi + 96, ex), k1)
    k0 = _im_keep_device(t == 2, _im_sub_device(qa2, qb2, 0, xd, xi + 128, ex), k0)
    k1 = _im_keep_device(t == 2, _im_sub_device(qa2, qb2, 1, xd, xi + 160, ex), k1)
    k0 = _im_keep_device(t == 3, _im_sub_device(qa3, qb3, 0, xd, xi + 192, ex), k0)
    k1 = _im_keep_device(t == 3, _im_sub_device(qa3, qb3, 1, xd, xi + 224, ex), k1)
    dda0, dma0, dda1, dma1 = _q4k_factor_pair_hw_device(ha0, ha1, t)
    ddb0, dmb0, ddb1, dmb1 = _q4k_factor_pair_hw_device(hb0, hb1, t)
    pa = _im_term_device(dda0, dma0, _im_s_device(k0[0], k0[1], k0[2]), ps[bt + 1], ps[bt], pa)
    pa = _im_term_device(dda1, dma1, _im_s_device(k1[0], k1[1], k1[2]), ps[bt + 3], ps[bt + 2], pa)
    pb = _im_term_device(ddb0, dmb0, _im_s_device(k0[3], k0[4], k0[5]), ps[bt + 1], ps[bt], pb)
    pb = _im_term_device(ddb1, dmb1, _im_s_device(k1[3], k1[4], k1[5]), ps[bt + 3], ps[bt + 2], pb)
    return pa, pb


@inline_device
def _im_sb_device(hw, qa0, qa1, qa2, qa3, qb0, qb1, qb2, qb3, xd, xi, ps, b0, b1, xch, ex, p):
    """One super-block of a wider call: the lane's terms of every sub-block for its rows and two columns, into
    p [c][row g / g+8][column 2t / 2t+1]. b0 / b1: ps index of sub-block 0's (p, X) for the two columns."""
    ha0, ha1, hb0, hb1 = _im_headers_device(hw, xch)
    for c in range(4):
        qa = _pick4(c, qa0, qa1, qa2, qa3)
        qb = _pick4(c, qb0, qb1, qb2, qb3)
        for h in range(2):
            r = _im_sub_device(qa, qb, h, xd, xi + 64 * c + 32 * h, ex)
            dda, dma = _q4k_factors_hw_device(ha0, ha1, 2 * c + h)
            ddb, dmb = _q4k_factors_hw_device(hb0, hb1, 2 * c + h)
            j0 = b0 + 2 * (2 * c + h)
            j1 = b1 + 2 * (2 * c + h)
            p[4 * c] = _im_term_device(dda, dma, _im_s_device(r[0], r[4], r[8]), ps[j0 + 1], ps[j0], p[4 * c])
            p[4 * c + 1] = _im_term_device(dda, dma, _im_s_device(r[1], r[5], r[9]), ps[j1 + 1], ps[j1], p[4 * c + 1])
            p[4 * c + 2] = _im_term_device(ddb, dmb, _im_s_device(r[2], r[6], r[10]), ps[j0 + 1], ps[j0], p[4 * c + 2])
            p[4 * c + 3] = _im_term_device(ddb, dmb, _im_s_device(r[3], r[7], r[11]), ps[j1 + 1], ps[j1],
                                           p[4 * c + 3])


@inline_device
def _copy16_device(src, o, n4, dst, n, swizzle):
    """dst[:4 * n4] = src[o : o + 4 * n4] (32-bit elements, o a multiple of 4) by a block's n threads, four 16-byte
    loads a thread in flight before their stores. `swizzle` (the integer path's digits, as kernels.q4k_dp4a reads
    them): word w = 256 sb + 64 c + 8 e + r goes to w ^ 8c, i.e. each 64-input group c's 8-input blocks e to e ^ c."""
    for j0 in range(cuda.threadIdx.x, n4, 4 * n):
        j1 = min(j0 + n, n4 - 1)
        j2 = min(j0 + 2 * n, n4 - 1)
        j3 = min(j0 + 3 * n, n4 - 1)
        a0, a1, a2, a3 = load4_device(src, o + 4 * j0)
        b0, b1, b2, b3 = load4_device(src, o + 4 * j1)
        c0, c1, c2, c3 = load4_device(src, o + 4 * j2)
        d0, d1, d2, d3 = load4_device(src, o + 4 * j3)
        d = _swizzled(np.uint32(4) * np.uint32(j0), swizzle)
        dst[d], dst[d + 1], dst[d + 2], dst[d + 3] = a0, a1, a2, a3
        d = _swizzled(np.uint32(4) * np.uint32(j1), swizzle)
        dst[d], dst[d + 1], dst[d + 2], dst[d + 3] = b0, b1, b2, b3
        d = _swizzled(np.uint32(4) * np.uint32(j2), swizzle)
        dst[d], dst[d + 1], dst[d + 2], dst[d + 3] = c0, c1, c2, c3
        d = _swizzled(np.uint32(4) * np.uint32(j3), swizzle)
        dst[d], dst[d + 1], dst[d + 2], dst[d + 3] = d0, d1, d2, d3


@inline_device
def _swizzled(w, swizzle):
    """_copy16_device's destination of word w (uint32; w itself without `swizzle`)."""
    return w ^ ((w >> np.uint32(3)) & np.uint32(0x18)) if swizzle else w


@inline_device
def _im_copy_device(src, o, n4, dst):
    """dst[:4 * n4] = src[o : o + 4 * n4] by the block's IM_WARPS warps (_copy16_device, no swizzle)."""
    _copy16_device(src, o, n4, dst, IM_WARPS * WARP, False)


def _make_im_kernel(decode, batch=IM_BATCH, min_blocks=IM_MIN_BLOCKS, stage=False, early=EARLY_WEIGHTS, ring=0):
    """q4k_imma kernel for one token (`decode`) or any token count (the same operations per token either way);
    `batch` (2 or 4) super-blocks' weight words loaded together, `min_blocks` resident blocks per SM bounding the
    registers (bench/dev/q4k_probe.py compares variants); `stage` (with decode): the output also staged for the next
    GEMV (a kernel of its own: the staging's code cost the one-token kernel 8 registers and spills in its loop).
    `ring` (decode only): the weights come through a ring of that many super-block tiles a warp in dynamic shared
    memory, filled by cp.async (as q4k_mma_kernel's), a super-block at a time (`batch` then unused)."""
    if ring and not decode:
        raise ValueError("_make_im_kernel: the weight ring is for the decode kernel")
    jit = bounded_jit(IM_WARPS * WARP, min_blocks)
    step = 1 if ring else batch
    four = step == 4
    ring_mod = max(ring, 1)
    ring_words = ring * RING_TILE_WORDS
    ring_pending = max(ring - 1, 0)

    @jit
    def q4k_imma_kernel(xd, ps, kx, w1, n_words, rows_per_group, out_bf16, out, sxd, sps, pairs):
        """q4_K GEMV / GEMM on the tensor cores' integer MMA for FP32 activations staged by q4k_im_stage_kernel (xd,
        ps; kx inputs a token): out[tok, n] = sum over k of W[n, k] x[tok, grp(n) * K + k], FP32 (BF16-rounded if
        out_bf16). Block b: rows 16b .. 16b+15 (one group: rows_per_group a multiple of 16 or all rows); warp w: the
        w-th quarter of the row's super-blocks (ceil(NB/4) steps each; steps past NB weigh zero), loaded `batch`
        super-blocks at a time (a lane's 9 words each: one header word, shared in its quad by shuffles, and 8 nibble
        words). The nibbles are the MMA's A as they lie in the base file (a byte masked to 0x0F is the unsigned q),
        the activations' digits its B (tokens in passes of up to 8 columns; a pass's missing columns repeat its last
        token); a one-token call first copies its tile's digits and (p, X) pairs to shared memory. A sub-block's
        three digit sums give S (exact integers, combined in FP32) and the term (dd * S - dm * X) * p; per row and
        token the terms go into p_c over sub-blocks 2c, 2c+1 in super-block order, the quarter's value is (p_0 + p_1)
        + (p_2 + p_3) and the row's ((q_0 + q_1) + (q_2 + q_3)) over the quarters. A one-token call has lane t form
        p_t (the digit sums of group c == t kept), a wider one every lane all four for its two columns: the same
        operations in the same order, so a token's result does not depend on the tokens beside it. With `ring`, a
        warp's next super-blocks' tiles are on their way into shared memory by cp.async (q4k_mma_kernel's ring, the
        first tiles issued before the grid entry) and the lane reads the words it would load: the same bits.

        `stage` (a one-token kernel of its own): the output is also staged as the next GEMV's integer-path operands,
        what im_stage(out, quantize=True) writes into (sxd, sps): blocks 2i and 2i + 1 hold the rows of one block of
        32 outputs, and the second of the two to finish (a ticket from pairs[i], kernels.ticket's pattern; put back
        to 0 by it) quantises the 32 values by act_quant_fp8's rule and stages them, one a lane of its first warp
        (im_stage_lane_device): the staging launch before that GEMV goes (wo_a's output for wo_b)."""
        min_blocks                 # named: a closure value, so in the cache key (kernels.bounded_jit)
        early                      # (the same)
        ring                       # (the same)
        ring_mod                   # (the same)
        ring_pending               # (the same)
        ex = cuda.shared.array((IM_WARPS, WARP, MMA_EX_WORDS), np.uint32)
        rings = cuda.shared.array(0, np.uint64, alignment=RING_ALIGN)    # dynamic: ring_bytes(ring) at launch
        xch = cuda.shared.array((IM_WARPS, WARP), nb_uint64)
        red = cuda.shared.array((IM_WARPS, WARP), np.float32)
        qsum = cuda.shared.array((IM_WARPS, MMA_TOK, IM_ROWS), np.float32)
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        g = lane // 4
        t = lane % 4
        n_tok, n_rows = out.shape
        nb = n_words // Q4K_WORDS
        r0 = cuda.blockIdx.x * IM_ROWS
        wa, wb = _tile_rows_device(r0, g, n_rows, n_words)
        xk0 = (r0 // rows_per_group) * nb * QK_K         # the tile's first input in a token row
        quarter = (nb + IM_WARPS - 1) // IM_WARPS
        sb0 = warp * quarter                             # every warp takes `quarter` steps (the simulator's shuffles
        sb1 = min(nb, sb0 + quarter)                     # are block barriers); those past nb have zero weights and
        sbe = sb0 + quarter                              # add exact zeros
        nblk = kx // 32
        p = cuda.local.array(16, np.float32)             # [c][row g / g+8][column 2t / 2t+1] (wider calls)
        wr = rings[warp * ring_words:(warp + 1) * ring_words]
        src, dst, half = _ring_lane_device(r0, lane, n_rows, n_words)
        if ring:                   # weights are never written by a graph's kernels: the first tiles may be in
            _ring_fill_device(wr, w1, src, dst, half, sb0, sb1, ring)     # flight while the predecessor finishes
        elif early:                # (the same for the register path's first batch)
            pre0 = _im_words_device(w1, wa, wb, sb0, t, sb0 < sb1)
            pre1 = _im_words_device(w1, wa, wb, sb0 + 1, t, sb0 + 1 < sb1)
        grid_entry_device()
        if decode:                                       # the tile's hi / lo words and (p, X) pairs -> shared memory
            xs = cuda.shared.array(IM_SMEM_WORDS, np.uint32, alignment=LOAD4_ALIGN)   # read by 16-byte loads
            xp = cuda.shared.array(IM_SMEM_PS, np.float32)
            _im_copy_device(xd, xk0, nb * QK_K // 4, xs)
            _im_copy_device(ps, 2 * (xk0 // 32), nb * 4, xp)
            cuda.syncthreads()
        for t0 in range(0, n_tok, MMA_TOK):
            nt = min(MMA_TOK, n_tok - t0)
            tr = t0 + min(g, nt - 1)                     # the token of this lane's B column
            n0 = t0 + min(2 * t, nt - 1)                 # the tokens of its two D columns
            n1 = t0 + min(2 * t + 1, nt - 1)
            for i in range(16):
                p[i] = np.float32(0.0)
            pa = np.float32(0.0)
            pb = np.float32(0.0)
            for cb in range(sb0, sbe, step):
                if ring:                                 # the oldest tile: wait, read, refill its slot with cb + ring
                    slot = (cb - sb0) % ring_mod
                    cp_async_wait_device(ring_pending)
                    cuda.syncwarp(0xFFFFFFFF)                  # the other lanes' copies of the tile landed
                    (e0, qa00, qa01, qa02, qa03, qb00, qb01, qb02, qb03) = _ring_im_words_device(wr, slot, g, t,
                                                                                                    cb < sb1)
                    cuda.syncwarp(0xFFFFFFFF)                  # every lane has read the slot before it is refilled
                    _ring_refill_device(wr, w1, src, dst, half, cb + ring, sb1, slot)
                    (e1, qa10, qa11, qa12, qa13, qb10, qb11, qb12, qb13) = (e0, qa00, qa01, qa02, qa03, qb00, qb01,
                                                                            qb02, qb03)       # (unused: one a step)
                elif early and t0 == 0 and cb == sb0:
                    (e0, qa00, qa01, qa02, qa03, qb00, qb01, qb02, qb03) = pre0
                    (e1, qa10, qa11, qa12, qa13, qb10, qb11, qb12, qb13) = pre1
                else:
                    (e0, qa00, qa01, qa02, qa03, qb00, qb01, qb02, qb03) = _im_words_device(w1, wa, wb, cb, t,
                                                                                               cb < sb1)
                    (e1, qa10, qa11, qa12, qa13, qb10, qb11, qb12, qb13) = _im_words_device(w1, wa, wb, cb + 1, t,
                                                                                               cb + 1 < sb1)
                if four:
                    (e2, qa20, qa21, qa22, qa23, qb20, qb21, qb22, qb23) = _im_words_device(w1, wa, wb, cb + 2, t,
                                                                                               cb + 2 < sb1)
                    (e3, qa30, qa31, qa32, qa33, qb30, qb31, qb32, qb33) = _im_words_device(w1, wa, wb, cb + 3, t,
                                                                                               cb + 3 < sb1)
                for i in range(step):
                    sb = cb + i
                    if sb < sbe:                         # block-uniform
                        sbc = min(sb, nb - 1)                # a dead step reads a live step's activations
                        xi = tr * kx + xk0 + QK_K * sbc + 8 * t      # the lane's 8 inputs of sub-block 0
                        blk = (xk0 + QK_K * sbc) // 32
                        if decode:                       # shared-memory indices of the staged tile
                            xj = QK_K * sbc + 8 * t
                            bt = 2 * (8 * sbc + 2 * t)
                            if i == 0:
                                pa, pb = _im_sb_t1_device(e0, qa00, qa01, qa02, qa03, qb00, qb01, qb02, qb03, xs, xj,
                                                          xp, bt, xch[warp], ex[warp], pa, pb)
                            elif i == 1:
                                pa, pb = _im_sb_t1_device(e1, qa10, qa11, qa12, qa13, qb10, qb11, qb12, qb13, xs, xj,
                                                          xp, bt, xch[warp], ex[warp], pa, pb)
                            elif four:
                                if i == 2:
                                    pa, pb = _im_sb_t1_device(e2, qa20, qa21, qa22, qa23, qb20, qb21, qb22, qb23, xs,
                                                              xj, xp, bt, xch[warp], ex[warp], pa, pb)
                                else:
                                    pa, pb = _im_sb_t1_device(e3, qa30, qa31, qa32, qa33, qb30, qb31, qb32, qb33, xs,
                                                              xj, xp, bt, xch[warp], ex[warp], pa, pb)
                        else:
                            b0 = 2 * (n0 * nblk + blk)
                            b1 = 2 * (n1 * nblk + blk)
                            if i == 0:
                                _im_sb_device(e0, qa00, qa01, qa02, qa03, qb00, qb01, qb02, qb03, xd, xi, ps, b0, b1,
                                              xch[warp], ex[warp], p)
                            elif i == 1:
                                _im_sb_device(e1, qa10, qa11, qa12, qa13, qb10, qb11, qb12, qb13, xd, xi, ps, b0, b1,
                                              xch[warp], ex[warp], p)
                            elif four:
                                if i == 2:
                                    _im_sb_device(e2, qa20, qa21, qa22, qa23, qb20, qb21, qb22, qb23, xd, xi, ps, b0,
                                                  b1, xch[warp], ex[warp], p)
                                else:
                                    _im_sb_device(e3, qa30, qa31, qa32, qa33, qb30, qb31, qb32, qb33, xd, xi, ps, b0,
                                                  b1, xch[warp], ex[warp], p)
            if decode:
                sa = quad_sum_device(pa, red[warp])
                sbv = quad_sum_device(pb, red[warp])
                if t == 0:
                    qsum[warp, 0, g] = sa
                    qsum[warp, 0, g + 8] = sbv
            else:
                for j in range(4):                                   # (row g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)
                    col = 2 * t + j % 2
                    v = (p[j] + p[4 + j]) + (p[8 + j] + p[12 + j])
                    if col < nt:
                        qsum[warp, col, g + (8 if j >= 2 else 0)] = v
            cuda.syncthreads()
            if tid < nt * IM_ROWS:
                col = tid // IM_ROWS
                r = tid % IM_ROWS
                if r0 + r < n_rows:
                    v = (qsum[0, col, r] + qsum[1, col, r]) + (qsum[2, col, r] + qsum[3, col, r])
                    out[t0 + col, r0 + r] = round_bf16_device(v) if out_bf16 else v
            cuda.syncthreads()
        if decode and stage:                            # the barrier above follows the output's stores
            _stage_pair_device(out, sxd, sps, pairs)
    q4k_imma_kernel.ring_tiles = ring      # the launcher sizes the dynamic shared memory from it (ring_bytes)
    return q4k_imma_kernel


@cuda.jit(device=True)
def _stage_pair_device(out, sxd, sps, pairs):
    """q4k_imma_kernel's `stage` (its docstring), after the block's output stores and a barrier."""
    last = cuda.shared.array(1, np.int32)
    if cuda.threadIdx.x == 0:
        last[0] = 1 if take_ticket_device(pairs, cuda.blockIdx.x // 2) == 1 else 0
    cuda.syncthreads()
    if last[0] == 1 and cuda.threadIdx.x < WARP:
        blk = cuda.blockIdx.x // 2
        lane = cuda.threadIdx.x
        q = act_quant_fp8_lane_device(out[0, 32 * blk + lane])        # the warp's block of 32
        im_stage_lane_device(q, blk, lane, True, sxd, sps)
        if lane == 0:
            pairs[blk] = 0


q4k_imma_t1_kernel = _make_im_kernel(True, ring=IM_RING)
q4k_imma_t1s_kernel = _make_im_kernel(True, stage=True, ring=IM_RING)   # and the output staged for the next GEMV
q4k_imma_kernel = _make_im_kernel(False, min_blocks=2)   # its p[16] needs registers


@inline_device
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
        grid_entry_device()
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
    grid_entry_device()
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
    grid_entry_device()
    n_tok, k_len = out.shape
    g = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if g >= n_tok * k_len:
        return
    t = g // k_len
    k = g % k_len
    out[t, k] = _q8_0_weight_device(w16, ids[t], k // QK8_0, k % QK8_0)


_GEMV_SIG = "void(float32[:, :], uint64[:, :], int64, boolean, float32[:, :])"
_Q8_SIG = "void(float32[:, :], uint16[:, :], int64, boolean, float32[:, :])"
_MMA_SIG = ("void(uint64[:], int64, uint64[:], int64, int64, int64, boolean, boolean, boolean, uint64[:], float32, "
            "float32[:, :, :], int32[:], float32[:, :])")
_IM_SIG = ("void(uint32[::1], float32[::1], int64, uint64[::1], int64, int64, boolean, float32[:, ::1], uint32[::1], "
           "float32[::1], int32[::1])")
SIGNATURES = {
    "q4k_gemv_t1_kernel": _GEMV_SIG,
    "q4k_gemv_t4_kernel": _GEMV_SIG,
    "q8_0_gemv_t1_kernel": _Q8_SIG,
    "q8_0_gemv_t4_kernel": _Q8_SIG,
    "q4k_gemv_deep_kernel": "void(uint64[:], uint64[:], int64, int64, boolean, float32[:, :])",
    "q4k_mma_kernel": _MMA_SIG,
    "q4k_mma_t1_kernel": _MMA_SIG,
    "q4k_imma_kernel": _IM_SIG,
    "q4k_imma_t1_kernel": _IM_SIG,
    "q4k_imma_t1s_kernel": _IM_SIG,
    "q4k_im_stage_kernel": "void(uint64[::1], int64, int64, boolean, uint32[::1], float32[::1])",
    "q4k_rows_kernel": "void(uint8[:, :], int64[:], float32[:, :])",
    "q8_0_rows_kernel": "void(uint16[:, :], int64[:], float32[:, :])",
}




def mma_splits(n_rows, nb):
    """(super-blocks per slice, slices) of the tensor-core path for a q4_K matrix of n_rows x nb super-blocks: K is
    split into as many slices as keep the launch within MMA_TARGET_BLOCKS blocks of 64 rows (one wave of the decode
    kernel on the H200: 132 SMs x 4 blocks), and never more than that. Rounding the slice count up instead left a
    second, nearly empty wave (wq_b 1,024 blocks = 1.94 waves, wo_b 560 = 1.06; Nsight Compute). A function of the
    shape alone, so every call on a matrix adds its slices in the same order."""
    row_blocks = -(-n_rows // (MMA_WARPS * MMA_ROWS))
    want = max(1, min(nb, MMA_TARGET_BLOCKS // row_blocks))
    sps = -(-nb // want)
    return sps, -(-nb // sps)


def mma_part_rows(n_tok):
    """Token rows of the slice-partials scratch for a call of n_tok tokens: 1 for decode, else the next power of two
    from 8 up to MMA_PART_TOKENS (a longer call is launched in pieces of that many tokens), so calls of many sizes
    share a few bounded arrays instead of one each."""
    return 1 if n_tok == 1 else min(MMA_PART_TOKENS, max(MMA_TOK, 1 << (n_tok - 1).bit_length()))


def mma_part_bytes(n_rows, k, n_tok):
    """Bytes of the slice-partials scratch a tensor-core call on a q4_K [n_rows, k] matrix allocates (0 unsplit)."""
    _, n_slices = mma_splits(n_rows, k // QK_K)
    return 0 if n_slices == 1 else n_slices * mma_part_rows(n_tok) * n_rows * 4


def im_fits(n_rows, rows_per_group):
    """Whether a q4_K matrix of n_rows rows, rows_per_group to an input group, fits the integer tensor-core path:
    its 16-row tiles must each lie in one group (rows_per_group a multiple of 16, or every row in one group)."""
    return rows_per_group == n_rows or rows_per_group % IM_ROWS == 0


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
def _fp8_mma_fits(kind, n_rows, rpg, quantize, fp8_input):
    """Whether FP8-grid activations of these q4_K rows suit q4k_mma_kernel (C-contiguous x; ungrouped rows): it
    takes them where im_path does not (IM_FP8_MIN_*; by default it always does)."""
    return kind == "q4_K" and USE_MMA and (quantize or fp8_input) and rpg == n_rows


def im_path(kind, n_rows, k, rows_per_group=None, *, quantize, fp8_input=False):
    """Whether q4k_gemv takes the integer tensor-core path (q4k_imma_kernel, staged by q4k_im_stage_kernel) for a
    C-contiguous x and these weights and flags: a function of the shape and flags alone (q4k_gemv's docstring)."""
    rpg = n_rows if rows_per_group is None else int(rows_per_group)
    mma = _fp8_mma_fits(kind, n_rows, rpg, quantize, fp8_input)
    return bool(kind == "q4_K" and USE_IMMA and im_fits(n_rows, rpg)
                and (not mma or (n_rows >= IM_FP8_MIN_ROWS and k >= IM_FP8_MIN_SB * QK_K)))


def fp8_scratch_bytes(n_rows, k, n_tok):
    """Bytes of the larger scratch a linear_q call (quantize=True) on n_tok rows of a q4_K [n_rows, k] matrix
    allocates on the path its shape takes (`im_path`): the integer path's staged operands (im_stage_shapes), else
    q4k_mma's slice partials (mma_part_bytes)."""
    if im_path("q4_K", n_rows, k, quantize=True):
        return sum(int(np.prod(shape)) * np.dtype(dt).itemsize for shape, dt in im_stage_shapes(n_tok, k))
    return mma_part_bytes(n_rows, k, n_tok)


def norm_path(kind, n_rows, k, rows_per_group=None):
    """Whether q4k_gemv(x, w, quantize=True, norm=...) can norm x in its staging: linear_q of these q4_K rows takes
    the FP8 tensor-core path (q4k_mma_kernel: one input group, not the integer path), whose staging the norm rides
    on. A function of the shape alone; with the default IM_FP8_MIN_* (0: every FP8-grid matrix on the integer path)
    it holds for none."""
    rpg = n_rows if rows_per_group is None else int(rows_per_group)
    return bool(_fp8_mma_fits(kind, n_rows, rpg, True, False) and k % 2 == 0
                and not im_path(kind, n_rows, k, rpg, quantize=True))


def stage_out_path(kind, n_rows, k, rows_per_group=None, n_tok=1, *, quantize, fp8_input=False):
    """Whether a q4k_gemv call can stage its output for the next GEMV (`stage_out`): one token on the integer path's
    one-token kernel, whole blocks of 32 rows. A function of the shape and flags alone."""
    return bool(n_tok == 1 and n_rows % 32 == 0 and k <= IM_SMEM_WORDS
                and im_path(kind, n_rows, k, rows_per_group, quantize=quantize, fp8_input=fp8_input))


def im_stage(x, *, quantize, out, stream=0):
    """x float32 [T, kx] (C-contiguous, kx % 32 == 0) -> out = (digits, pairs) of im_stage_shapes(T, kx): the integer
    path's operands (q4k_im_stage_kernel; `quantize`: act_quant_fp8's rule first). What q4k_gemv launches first on
    that path unless it is given `staged`; a producer that holds the activations a warp block at a time can write the
    same bits itself (kernels.im_operand.im_stage_lane_device: the attention's combine, the ffn norm)."""
    if x.dtype != np.float32 or len(tuple(x.shape)) != 2 or x.shape[1] % 32 or not _contiguous(x):
        raise ValueError(f"im_stage: x must be C-contiguous float32 [T, kx] with kx % 32 == 0, got {x.dtype} "
                         f"{tuple(x.shape)}")
    n_tok, kx = (int(v) for v in x.shape)
    check_im_staged(out, n_tok, kx, "im_stage")
    n_jobs = n_tok * kx // 8
    if n_jobs:
        q4k_im_stage_kernel[-(-n_jobs // IM_STAGE_THREADS), IM_STAGE_THREADS, stream](
            x.view(np.uint64).reshape(n_tok * kx // 2), kx, n_jobs, bool(quantize), *out)
    return out


def q4k_gemv(x, w, *, kind="q4_K", quantize=True, out_bf16=True, rows_per_group=None, out=None, scratch=None,
             stream=0, fp8_input=False, staged=None, norm=None, stage_out=None):
    """x [T, G*K] float32 (C-contiguous), w uint8 [N, K/256*144] (q4_K) or [N, K/32*34] (Q8_0) -> out [T, N] float32.

    `quantize` applies linear_q's activation rule (act_quant_fp8, block 32) to x first (into scratch);
    `out_bf16` rounds to BF16 (linear_q / linear_bf16), False keeps FP32 (linear_f32). `rows_per_group` (default
    N) maps row n to the x slice n // rows_per_group (attention's grouped wo_a). `fp8_input` says that x already
    holds act_quant_fp8 values (quantize=False): q4_K rows then take a tensor-core path, as they do with
    quantize=True: by default the integer one for every shape (q4k_imma_kernel; one token: kernels.q4k_dp4a's),
    q4k_mma_kernel only for matrices below IM_FP8_MIN_* where those are raised; any other x must not be passed with
    it. Other q4_K calls take q4k_imma_kernel where `im_fits`, else the FMA kernels (`im_path` says which).
    `staged` (only where im_path holds): the operands `im_stage(x, quantize=quantize)` would write, written by x's
    producer; the staging launch is skipped (x still gives the shape).
    `norm` = (weight [K] float32, eps) (only with quantize=True, where `norm_path` holds: q4k_mma_kernel, so never
    with the default IM_FP8_MIN_*): x is the input of kernels.rms_norm.rms_norm, and the GEMV is linear_q of its
    output, the bits of rms_norm(x, weight, eps, out_q=xq) then q4k_gemv(xq, w, quantize=False, fp8_input=True), in
    one launch (q4k_mma_kernel's docstring).
    `stage_out` (where `stage_out_path` holds: a one-token integer-path call): the (digits, pairs) that
    im_stage(out, quantize=True) would write, written by this call (q4k_imma_kernel's `stage`), for the next GEMV's
    `staged` (wo_a's output into wo_b: one staging launch fewer)."""
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
    mma = _contiguous(x) and _fp8_mma_fits(kind, n_rows, rpg, quantize, fp8_input)
    imma = _contiguous(x) and im_path(kind, n_rows, k, rpg, quantize=quantize, fp8_input=fp8_input)
    mma = mma and not imma
    if norm is not None:
        nw, eps = norm
        if not (quantize and mma and norm_path(kind, n_rows, k, rpg)):
            raise ValueError("q4k_gemv: norm is for linear_q on the FP8 tensor-core path (norm_path, quantize=True, "
                             "C-contiguous x), which this call does not take")
        if tuple(nw.shape) != (k,) or nw.dtype != np.float32 or not nw.is_c_contiguous():
            raise ValueError(f"q4k_gemv: the norm weight must be float32 [{k}] (contiguous), got {nw.dtype} "
                             f"{tuple(nw.shape)}")
    if stage_out is not None:
        if not (imma and stage_out_path(kind, n_rows, k, rpg, n_tok, quantize=quantize, fp8_input=fp8_input)):
            raise ValueError("q4k_gemv: stage_out is for one-token integer-path calls of a multiple of 32 rows "
                             "(stage_out_path), which this call is not")
        check_im_staged(stage_out, 1, n_rows, "q4k_gemv (stage_out)")
    if staged is not None:
        if not imma:
            raise ValueError("q4k_gemv: staged operands are for the integer tensor-core path (im_path), which this "
                             "call does not take")
        check_im_staged(staged, n_tok, x.shape[1], "q4k_gemv")
    if quantize and not mma and not imma:
        x = act_quant_fp8(x, out=_scratch(scratch, "xq", tuple(x.shape), np.float32, stream), stream=stream)
    grid = (n_rows + WARPS_PER_BLOCK - 1) // WARPS_PER_BLOCK
    if mma:
        nb = k // QK_K
        sps, n_slices = mma_splits(n_rows, nb)
        row_blocks = -(-n_rows // (MMA_WARPS * MMA_ROWS))
        part = _scratch(scratch, "mma_part", (n_slices, mma_part_rows(n_tok), n_rows) if n_slices > 1 else (1, 1, 1),
                        np.float32, stream)
        counters = _scratch(scratch, "mma_counters", (row_blocks,), np.int32, stream, zero=True)
        w64 = w.view(np.uint64)
        kernel = q4k_mma_t1_kernel if n_tok == 1 else q4k_mma_kernel
        _check_ring_alignment(kernel, w)
        step = n_tok if n_slices == 1 else max(1, part.shape[1])          # tokens per launch
        nw1 = w64[0] if norm is None else nw.view(np.uint64)              # (without a norm: not read)
        eps = np.float32(0.0 if norm is None else norm[1])
        for t0 in range(0, n_tok, step):
            xs, os_ = (x, out) if step == n_tok else (x[t0:t0 + step], out[t0:t0 + step])
            smem_launch(kernel, (row_blocks, n_slices), MMA_WARPS * WARP, stream, ring_bytes(kernel.ring_tiles))(
                xs.view(np.uint64).reshape(xs.shape[0] * k // 2), k, w64.reshape(w64.shape[0] * w64.shape[1]),
                w64.shape[1], sps, n_slices, bool(out_bf16), bool(quantize), norm is not None, nw1, eps, part,
                counters, os_)
    elif imma:
        kx = x.shape[1]
        if staged is not None:
            xd, ps = staged                              # written by x's producer
        else:
            xd, ps = im_stage(x, quantize=quantize, stream=stream,
                              out=scratch_arrays(scratch, ("im_xd", "im_ps"), im_stage_shapes(n_tok, kx), stream))
        w64 = w.view(np.uint64)
        kernel = q4k_imma_t1_kernel if n_tok == 1 and k <= IM_SMEM_WORDS else q4k_imma_kernel
        if stage_out is None:
            sxd, sps, pairs = xd, ps, _scratch(scratch, "im_no_pairs", (1,), np.int32, stream)       # (not read)
        else:
            kernel = q4k_imma_t1s_kernel
            sxd, sps = stage_out
            pairs = _scratch(scratch, "im_pairs", (n_rows // 32,), np.int32, stream, zero=True)
        if USE_DP4A and kernel is not q4k_imma_kernel:
            from kernels import q4k_dp4a                 # (it builds on this module's helpers)
            dp = q4k_dp4a.q4k_dp_t1s_kernel if stage_out is not None else q4k_dp4a.q4k_dp_t1_kernel
            if q4k_dp4a.dp_fits(dp, w, n_rows, rpg):     # the same bits as the imma kernel, fewer instructions
                w4 = w.view(np.uint32)
                rows = dp.tiles * IM_ROWS
                dp[-(-n_rows // rows), dp.tiles * IM_WARPS * WARP, stream](
                    xd, ps, kx, w4.reshape(w4.shape[0] * w4.shape[1]), w4.shape[1], rpg, bool(out_bf16), out, sxd,
                    sps, pairs)
                return out
        _check_ring_alignment(kernel, w)
        smem_launch(kernel, -(-n_rows // IM_ROWS), IM_WARPS * WARP, stream, ring_bytes(kernel.ring_tiles))(
            xd, ps, kx, w64.reshape(w64.shape[0] * w64.shape[1]), w64.shape[1], rpg, bool(out_bf16), out, sxd, sps,
            pairs)
    elif kind == "q4_K" and n_tok == 1 and _contiguous(x):
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

"""FP8 (E4M3) and FP4 (E2M1) numerics on the device, and the device functions of the FP8 activation quantiser:
the one home of what the op kernels share of these formats (ds4lib.formats.fp8, ds4lib.formats.fp4 and
ds4lib.formats.actquant are the definitions; every function here gives their bits).

Owns:
- `e4m3_decode_device` (byte -> float32, exact; NaN codes give NaN), `e4m3_encode_device` (float32 on the E4M3 grid
  -> its byte), `f16_of_e4m3_value_device` (a value E4M3 represents -> the bits of the same half).
- `e4m3_round_device`, `e2m1_round_device`: nearest E4M3 / E2M1 value, ties to even, sign kept; `pow2_ceil_device`
  (2^ceil(log2 x) from the exponent bits), `pow2_inverse_device` (the exact inverse of a power of two, so that the
  quantisers multiply where the reference divides), `rint_step_device` (rounding to a multiple of a power-of-two
  step by one FP32 add), `with_sign_device`.
- `act_quant_fp8_lane_device`: act_quant_fp8's value when a warp's 32 lanes hold one block of 32 (the one definition
  for act_quant_fp8_kernel and the fused producers of kernels.rms_norm and kernels.moe);
  `act_quant_fp8_lane_amax_device` also gives the block's largest quantised magnitude.
- The codeword form of the same quantiser, for the tensor-core GEMVs that stage 8 activations a thread
  (kernels.q4k_gemv, kernels.vq_gemv): `quant8_device` (the quad's block max, act_quant_fp8's rule applied first
  when `raw`), `fp8_block_scale_device` (the power of two that turns the block's FP8-grid values into E4M3 codes
  exactly) and `code_word_device` (8 codes packed into a uint64, and their exact sum).
- `e4m3_encode_kernel`: the encoder over an array (the tests run it on every code).
Does not own: the quantiser kernels and launchers (kernels.gemv), the conversions that feed the MMAs (kernels.mma),
the warp reductions (kernels.warp).
"""
import numpy as np
from numba import cuda

from kernels import inline_device
from kernels.bf16 import bits_f32, f32_bits, mul_rn_device
from kernels.pdl import grid_entry_device
from kernels.warp import group_amax_device, quad_max_device

__all__ = ["e4m3_decode_device", "e4m3_encode_device", "f16_of_e4m3_value_device", "pow2_ceil_device",
           "pow2_inverse_device", "rint_step_device", "with_sign_device", "e4m3_round_device", "e2m1_round_device",
           "act_quant_fp8_lane_device", "act_quant_fp8_lane_amax_device", "fp8_block_scale_device", "code_word_device",
           "quant8_device",
           "e4m3_encode_kernel", "E4M3_MAX", "E2M1_MAX", "INV448", "INV6", "F32_NAN", "E4M3_SUBNORMAL_STEP",
           "SIGNATURES"]

E4M3_MAX = np.float32(448.0)
E2M1_MAX = np.float32(6.0)
INV448 = np.float32(1.0) / np.float32(448.0)        # act_quant_fp8's constant
INV6 = np.float32(1.0) / np.float32(6.0)
F32_NAN = np.float32(np.nan)
E4M3_SUBNORMAL_STEP = np.float32(2.0 ** -9)


@inline_device
def e4m3_decode_device(code):
    """E4M3FN byte -> float32 (exact; 0x7F/0xFF NaN)."""
    c = np.uint32(code)
    e = (c >> np.uint32(3)) & np.uint32(0xF)
    m = c & np.uint32(7)
    if e == np.uint32(0xF) and m == np.uint32(7):
        return F32_NAN
    if e == np.uint32(0):
        v = np.float32(m) * E4M3_SUBNORMAL_STEP
    else:
        v = bits_f32(((e + np.uint32(120)) << np.uint32(23)) | (m << np.uint32(20)))
    return -v if c & np.uint32(0x80) else v


@inline_device
def e4m3_encode_device(v):
    """The E4M3 byte of float32 v, exact for every v that E4M3 represents (|v| <= 448 on its grid): normal values
    take the biased exponent and the top 3 fraction bits, values below 2^-6 are m * 2^-9 (m = 0..7)."""
    bits = f32_bits(v)
    sign = (bits >> np.uint32(24)) & np.uint32(0x80)
    a = bits & np.uint32(0x7FFFFFFF)
    e = np.int32(a >> np.uint32(23)) - 127
    if a == np.uint32(0):
        return sign
    if e >= -6:
        return sign | (np.uint32(e + 7) << np.uint32(3)) | ((a >> np.uint32(20)) & np.uint32(7))
    mant = (a & np.uint32(0x7FFFFF)) | np.uint32(0x800000)
    return sign | (mant >> np.uint32(14 - e))           # e = -7..-9: m = 1.f * 2^(e+9) = mant >> (23 - (e + 9))


@inline_device
def f16_of_e4m3_value_device(v):
    """IEEE half bits of float32 v, exact for every value E4M3 represents: those are 0 or m * 2^e with a 3-bit
    fraction and -9 <= e <= 8, all normal halves (the half keeps the sign, e + 15 and the top fraction bits)."""
    bits = f32_bits(v)
    sign = (bits >> np.uint32(16)) & np.uint32(0x8000)
    a = bits & np.uint32(0x7FFFFFFF)
    if a == np.uint32(0):
        return sign
    e = np.int32(a >> np.uint32(23)) - 127
    return sign | (np.uint32(e + 15) << np.uint32(10)) | ((a >> np.uint32(13)) & np.uint32(0x3FF))


@inline_device
def pow2_ceil_device(x):
    """2^ceil(log2(x)) for a positive normal float32, from the exponent bits (ds4lib.formats.fp8.pow2_ceil_exponent)."""
    u = f32_bits(x)
    e = np.int32((u >> np.uint32(23)) & np.uint32(0xFF))
    if (u & np.uint32(0x7FFFFF)) != np.uint32(0):
        e += 1
    return bits_f32(np.uint32(e) << np.uint32(23))


@inline_device
def pow2_inverse_device(s):
    """1 / s for s a power of two whose inverse is normal too (2^-126 <= s <= 2^126), from the exponent bits:
    v * pow2_inverse_device(s) is v / s to the bit (both round the same exact value) without the division's
    reciprocal refinement and slow-path branch. s = +inf (the scale of an infinite amax) gives 0, as 1 / inf."""
    return bits_f32(np.uint32(0x7F000000) - min(f32_bits(s), np.uint32(0x7F000000)))


@inline_device
def rint_step_device(ax, magic):
    """Round a float32 to a multiple of the step whose 1.5*2^23 multiple is `magic`, ties to even: the FP32 add
    rounds at exactly that bit (|ax| below 2^22 steps, so that ax + magic stays between 2^23 and 2^24 steps)."""
    return (ax + magic) - magic


@inline_device
def with_sign_device(mag, x):
    return bits_f32(f32_bits(mag) | (f32_bits(x) & np.uint32(0x80000000)))


@inline_device
def e4m3_round_device(x):
    """Nearest E4M3 value of |x| <= 448 (ties to even), sign kept (ds4lib.formats.fp8.e4m3_round)."""
    ax = abs(x)
    if ax < np.float32(0.015625):                                   # subnormal grid: step 2^-9
        r = rint_step_device(ax, np.float32(24576.0))
    else:                                                           # 3 mantissa bits, ties to even
        u = f32_bits(ax)
        lsb = (u >> np.uint32(20)) & np.uint32(1)
        r = bits_f32((u + np.uint32(0x7FFFF) + lsb) & np.uint32(0xFFF00000))
    return with_sign_device(r, x)


@inline_device
def e2m1_round_device(x):
    """Nearest E2M1 value of |x| <= 6 (ties to the even code), sign kept (ds4lib.formats.fp4.e2m1_round)."""
    ax = abs(x)
    if ax < np.float32(2.0):
        r = rint_step_device(ax, np.float32(6291456.0))            # step 0.5
    elif ax < np.float32(4.0):
        r = rint_step_device(ax, np.float32(12582912.0))           # step 1
    else:
        r = rint_step_device(ax, np.float32(25165824.0))           # step 2
    return with_sign_device(min(r, E2M1_MAX), x)


@inline_device
def act_quant_fp8_lane_amax_device(v):
    """(act_quant_fp8's value of v, the largest |value| of the block) when the warp's 32 lanes hold one aligned block
    of 32: amax of the block floored at 1e-4, power-of-two scale, clamp, E4M3 rounding. Every lane of the warp calls
    it (a lane outside the data passes 0). Clamping and rounding are monotone in |v|, so the block's largest
    quantised magnitude is the quantised amax: no second reduction. The one definition: act_quant_fp8_kernel and the
    fused producers (kernels.rms_norm, kernels.moe)."""
    amax = group_amax_device(v, 32)
    s = pow2_ceil_device(mul_rn_device(max(amax, np.float32(1e-4)), INV448))   # 2^-22 .. 2^120: exact inverse
    inv = pow2_inverse_device(s)
    y = min(max(v * inv, -E4M3_MAX), E4M3_MAX)
    return e4m3_round_device(y) * s, e4m3_round_device(min(amax * inv, E4M3_MAX)) * s


@inline_device
def act_quant_fp8_lane_device(v):
    """act_quant_fp8's value of v when the warp's 32 lanes hold one aligned block of 32 (act_quant_fp8_lane_amax_device
    without the block maximum)."""
    q, _ = act_quant_fp8_lane_amax_device(v)
    return q


@inline_device
def fp8_block_scale_device(amax):
    """The least power of two P with amax <= 448 P (1 for amax == 0): FP8-grid values of a block divided by P are
    E4M3 codes exactly (P never exceeds the block's quantisation scale, so no code loses a bit)."""
    if amax == np.float32(0.0):
        return np.float32(1.0)
    u = f32_bits(amax)
    e = np.int32(u >> np.uint32(23)) - 127                 # amax = 1.f * 2^e (normal)
    if (u & np.uint32(0x7FFFFF)) > np.uint32(0x600000):   # 1.f > 1.75: 448 * 2^(e-8) < amax
        e += 1
    e = max(e - 8, -126)
    return bits_f32(np.uint32(e + 127) << np.uint32(23))


@inline_device
def code_word_device(v0, v1, v2, v3, v4, v5, v6, v7, inv):
    """(8 E4M3 codes of v_i * inv packed low byte first, the exact FP32 sum of the 8 scaled values)."""
    c0, c1, c2, c3 = v0 * inv, v1 * inv, v2 * inv, v3 * inv
    c4, c5, c6, c7 = v4 * inv, v5 * inv, v6 * inv, v7 * inv
    lo = (e4m3_encode_device(c0) | (e4m3_encode_device(c1) << np.uint32(8)) | (e4m3_encode_device(c2) << np.uint32(16))
          | (e4m3_encode_device(c3) << np.uint32(24)))
    hi = (e4m3_encode_device(c4) | (e4m3_encode_device(c5) << np.uint32(8)) | (e4m3_encode_device(c6) << np.uint32(16))
          | (e4m3_encode_device(c7) << np.uint32(24)))
    return np.uint64(lo) | (np.uint64(hi) << np.uint64(32)), ((c0 + c1) + (c2 + c3)) + ((c4 + c5) + (c6 + c7))


@inline_device
def _aq_device(v, q, inv_q):
    """act_quant_fp8_kernel's value: e4m3_round(clamp(v / q, +-448)) * q, with v / q as v * inv_q (q a power of two,
    inv_q = pow2_inverse_device(q): the same bits)."""
    return e4m3_round_device(min(max(v * inv_q, -E4M3_MAX), E4M3_MAX)) * q


@inline_device
def quant8_device(v0, v1, v2, v3, v4, v5, v6, v7, raw, red):
    """A thread's 8 activations of a block of 32 (the quad holds the block) and the max |v| over the quad (`red`: the
    warp's float32 [32] slice of a shared array, for the simulator). `raw`: act_quant_fp8's rule is applied first,
    with the same operations as its kernel (block scale from the quad's max), and the max is taken again."""
    am = max(max(max(abs(v0), abs(v1)), max(abs(v2), abs(v3))), max(max(abs(v4), abs(v5)), max(abs(v6), abs(v7))))
    am = quad_max_device(am, red)
    if raw:
        q = pow2_ceil_device(mul_rn_device(max(am, np.float32(1e-4)), INV448))
        iq = pow2_inverse_device(q)
        v0, v1, v2, v3 = _aq_device(v0, q, iq), _aq_device(v1, q, iq), _aq_device(v2, q, iq), _aq_device(v3, q, iq)
        v4, v5, v6, v7 = _aq_device(v4, q, iq), _aq_device(v5, q, iq), _aq_device(v6, q, iq), _aq_device(v7, q, iq)
        am = max(max(max(abs(v0), abs(v1)), max(abs(v2), abs(v3))),
                 max(max(abs(v4), abs(v5)), max(abs(v6), abs(v7))))
        am = quad_max_device(am, red)
    return v0, v1, v2, v3, v4, v5, v6, v7, am


@cuda.jit(cache=True)
def e4m3_encode_kernel(v, out):
    """out[i] = e4m3_encode_device(v[i]) (tests: the encoder on every code)."""
    grid_entry_device()
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < v.shape[0]:
        out[i] = e4m3_encode_device(v[i])


SIGNATURES = {"e4m3_encode_kernel": "void(float32[:], uint32[:])"}

"""FP8 E4M3 ("e4m3fn") and UE8M0 scales, and the 32x32 block-scaled FP8 weight format.

E4M3FN: 1 sign, 4 exponent bits (bias 7), 3 mantissa bits; max finite 448; no infinities; codes
0x7F/0xFF are NaN; subnormal step 2^-9. Encoding rounds to nearest, ties to even; finite values
beyond 448 saturate to +-448 when `saturate` (the activation rule, which clamps first) and
become NaN otherwise (a plain cast).

UE8M0: an unsigned exponent byte e meaning 2^(e-127); 255 is NaN.

FP8 weight: W[out, in] E4M3 codes + scale[ceil(out/B), ceil(in/B)] UE8M0, value = code * scale
of its BxB block (B = 32 in V4.1; docs/architecture.md §11.2).
"""
from __future__ import annotations

import numpy as np

__all__ = ["E4M3_MAX", "E4M3_VALUES", "e4m3_decode", "e4m3_encode", "e4m3_round", "ue8m0_decode",
           "ue8m0_encode", "pow2_ceil_exponent", "fp8_weight_dequant", "fp8_weight_quantize"]

E4M3_MAX = 448.0


def _e4m3_table() -> np.ndarray:
    vals = np.zeros(256, dtype=np.float32)
    for code in range(256):
        s = -1.0 if code & 0x80 else 1.0
        e = (code >> 3) & 0xF
        m = code & 0x7
        if e == 0xF and m == 0x7:
            vals[code] = np.nan
        elif e == 0:
            vals[code] = s * m * 2.0 ** -9
        else:
            vals[code] = s * (1 + m / 8) * 2.0 ** (e - 7)
    return vals


E4M3_VALUES = _e4m3_table()


def e4m3_decode(codes) -> np.ndarray:
    """uint8 codes -> float32 values (exact)."""
    return E4M3_VALUES[np.asarray(codes, dtype=np.uint8)]


def _round_to_grid(x64, min_exp, mant_bits):
    """Round float64 magnitudes to a float grid with `mant_bits` mantissa bits and subnormals below
    2^min_exp, ties to even (np.rint)."""
    ax = np.abs(x64)
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.where(ax > 0, ax, 1.0)))
    # log2 can be off by one ulp near powers of two: fix e so that 2^e <= ax < 2^(e+1)
    e = np.where(np.ldexp(1.0, e.astype(np.int64)) > ax, e - 1, e)
    e = np.where(np.ldexp(1.0, (e + 1).astype(np.int64)) <= ax, e + 1, e)
    e = np.maximum(e, min_exp)
    step = np.ldexp(1.0, (e - mant_bits).astype(np.int64))
    return np.copysign(np.rint(ax / step) * step, x64)


def e4m3_round(x, saturate: bool = True) -> np.ndarray:
    """Round values to the nearest E4M3 value (float32 result). NaN stays NaN."""
    x64 = np.asarray(x, dtype=np.float64)
    r = _round_to_grid(x64, -6, 3)
    big = np.abs(r) > E4M3_MAX
    if saturate:
        r = np.where(big, np.copysign(E4M3_MAX, x64), r)
    else:
        r = np.where(big, np.nan, r)
    return r.astype(np.float32)


def e4m3_encode(x, saturate: bool = True) -> np.ndarray:
    """float values -> uint8 E4M3 codes, round to nearest even (NaN -> 0x7F, sign kept)."""
    x64 = np.asarray(x, dtype=np.float64)
    r = e4m3_round(x64, saturate).astype(np.float64)
    sign = np.signbit(x64).astype(np.uint8) << 7
    ar = np.abs(r)
    nan = np.isnan(ar)
    ar = np.where(nan, 0.0, ar)
    sub = ar < 2.0 ** -6
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.where(ar > 0, ar, 1.0))).astype(np.int64)
    m_norm = np.rint((ar / np.ldexp(1.0, e) - 1.0) * 8).astype(np.int64)
    code_norm = ((e + 7) << 3) | m_norm
    code_sub = np.rint(ar / 2.0 ** -9).astype(np.int64)
    code = np.where(sub, code_sub, code_norm).astype(np.uint8)
    code = np.where(nan, np.uint8(0x7F), code)
    return (code | sign).astype(np.uint8)


def ue8m0_decode(codes) -> np.ndarray:
    """UE8M0 bytes -> float32 2^(e-127); 255 -> NaN. e=0 gives 2^-127 (an FP32 subnormal)."""
    c = np.asarray(codes, dtype=np.uint8).astype(np.int64)
    out = np.ldexp(np.float64(1.0), np.minimum(c, 254) - 127).astype(np.float32)
    return np.where(c == 255, np.float32(np.nan), out)


def ue8m0_encode(pow2_values) -> np.ndarray:
    """Exact powers of two (2^-127 .. 2^127) -> UE8M0 bytes; anything else is an error."""
    v = np.asarray(pow2_values, dtype=np.float64)
    m, e = np.frexp(v)
    if np.any(m != 0.5) or np.any(e - 1 < -127) or np.any(e - 1 > 127):
        raise ValueError("ue8m0_encode: values must be powers of two in [2^-127, 2^127]")
    return (e - 1 + 127).astype(np.uint8)


def pow2_ceil_exponent(x) -> np.ndarray:
    """ceil(log2(x)) for positive float32 x, read from the exponent bits (exact, no log)."""
    x = np.asarray(x, dtype=np.float32)
    m, e = np.frexp(x.astype(np.float64))   # x = m * 2^e, m in [0.5, 1)
    return np.where(m == 0.5, e - 1, e).astype(np.int64)


def fp8_weight_dequant(codes, scale_codes, block: int = 32) -> np.ndarray:
    """E4M3 weight [out, in] with UE8M0 block scales [ceil(out/B), ceil(in/B)] -> float32 [out, in]."""
    w = e4m3_decode(codes)
    s = ue8m0_decode(scale_codes)
    out, inp = w.shape
    s_full = np.repeat(np.repeat(s, block, axis=0)[:out], block, axis=1)[:, :inp]
    return w * s_full


def fp8_weight_quantize(w, block: int = 32):
    """float weight [out, in] -> (E4M3 codes, UE8M0 block scales) with scale 2^ceil(log2(amax/448)) per
    BxB block (the official convention). Returns (uint8 [out, in], uint8 [ceil(out/B), ceil(in/B)])."""
    w = np.asarray(w, dtype=np.float32)
    out, inp = w.shape
    nb_o, nb_i = -(-out // block), -(-inp // block)
    pad = np.zeros((nb_o * block, nb_i * block), dtype=np.float32)
    pad[:out, :inp] = w
    blocks = np.abs(pad).reshape(nb_o, block, nb_i, block).max(axis=(1, 3))
    amax = np.maximum(blocks, np.float32(1e-30))
    exp = pow2_ceil_exponent(amax / np.float32(E4M3_MAX))
    exp = np.clip(exp, -127, 127)
    scale = np.ldexp(np.float32(1.0), exp).astype(np.float32)
    s_full = np.repeat(np.repeat(scale, block, axis=0)[:out], block, axis=1)[:, :inp]
    codes = e4m3_encode(w / s_full, saturate=True)
    return codes, (exp + 127).astype(np.uint8)

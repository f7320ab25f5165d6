"""FP4 E2M1 with one UE8M0 scale per 32 values: the routed-expert weight format.

E2M1 code c: magnitude [0, .5, 1, 1.5, 2, 3, 4, 6][c & 7], sign = bit 3 (so code 8 is -0).
Packing: logical element 2k of a row sits in the low nibble (bits 0-3) of byte k and element 2k+1
in the high nibble (erratum U6, docs/architecture.md §1.3: the official converters unpack this way). `NIBBLE_LOW_IS_EVEN`
is the one place that order is decided.
Encoding rounds to nearest, ties to the even code, and saturates at +-6.
"""
from __future__ import annotations

import numpy as np

from ds4lib.formats.fp8 import pow2_ceil_exponent, ue8m0_decode

__all__ = ["NIBBLE_LOW_IS_EVEN", "E2M1_MAX", "E2M1_VALUES", "e2m1_decode", "e2m1_encode", "e2m1_round",
           "pack_nibbles", "unpack_nibbles", "fp4_weight_dequant", "fp4_weight_quantize", "FP4_GROUP"]

NIBBLE_LOW_IS_EVEN = True
E2M1_MAX = 6.0
FP4_GROUP = 32
E2M1_VALUES = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)
_MAGS = E2M1_VALUES[:8].astype(np.float64)


def e2m1_decode(codes) -> np.ndarray:
    return E2M1_VALUES[np.asarray(codes, dtype=np.uint8) & 0xF]


def e2m1_round(x) -> np.ndarray:
    """Nearest E2M1 value (ties to even code), saturating at +-6; float32 result. NaN -> NaN."""
    x64 = np.asarray(x, dtype=np.float64)
    ax = np.minimum(np.abs(x64), E2M1_MAX)
    # step 0.5 below 2, 1 in [2, 4), 2 in [4, 6]: integer rint ties-to-even == even-code ties
    step = np.where(ax < 2.0, 0.5, np.where(ax < 4.0, 1.0, 2.0))
    r = np.minimum(np.rint(ax / step) * step, E2M1_MAX)
    return np.where(np.isnan(x64), np.nan, np.copysign(r, x64)).astype(np.float32)


def e2m1_encode(x) -> np.ndarray:
    """float values -> uint8 codes 0..15 (NaN is not representable and raises)."""
    x64 = np.asarray(x, dtype=np.float64)
    if np.isnan(x64).any():
        raise ValueError("e2m1_encode: NaN has no E2M1 code")
    r = np.abs(e2m1_round(x64)).astype(np.float64)
    mag = np.searchsorted(_MAGS, r).astype(np.uint8)
    return mag | (np.signbit(x64).astype(np.uint8) << 3)


def pack_nibbles(codes) -> np.ndarray:
    """uint8 codes [..., 2n] -> packed bytes [..., n]."""
    c = np.asarray(codes, dtype=np.uint8)
    even, odd = c[..., 0::2] & 0xF, c[..., 1::2] & 0xF
    lo, hi = (even, odd) if NIBBLE_LOW_IS_EVEN else (odd, even)
    return (lo | (hi << 4)).astype(np.uint8)


def unpack_nibbles(packed) -> np.ndarray:
    """packed bytes [..., n] -> uint8 codes [..., 2n]."""
    p = np.asarray(packed).view(np.uint8) if np.asarray(packed).dtype == np.int8 else np.asarray(packed, np.uint8)
    lo, hi = p & 0xF, p >> 4
    even, odd = (lo, hi) if NIBBLE_LOW_IS_EVEN else (hi, lo)
    out = np.empty(p.shape[:-1] + (p.shape[-1] * 2,), dtype=np.uint8)
    out[..., 0::2] = even
    out[..., 1::2] = odd
    return out


def fp4_weight_dequant(packed, scale_codes) -> np.ndarray:
    """Packed FP4 weight [out, in/2] + UE8M0 scales [out, in/32] -> float32 [out, in]."""
    vals = e2m1_decode(unpack_nibbles(packed))
    s = ue8m0_decode(scale_codes)
    return vals * np.repeat(s, FP4_GROUP, axis=-1)


def fp4_weight_quantize(w):
    """float weight [out, in] -> (packed uint8 [out, in/2], UE8M0 scales [out, in/32]) with scale
    2^ceil(log2(amax/6)) per group of 32 (the official convention)."""
    w = np.asarray(w, dtype=np.float32)
    out, inp = w.shape
    if inp % FP4_GROUP:
        raise ValueError(f"fp4 weight: row length {inp} is not a multiple of {FP4_GROUP}")
    g = w.reshape(out, inp // FP4_GROUP, FP4_GROUP)
    amax = np.maximum(np.abs(g).max(axis=-1), np.float32(1e-30))
    exp = np.clip(pow2_ceil_exponent(amax / np.float32(E2M1_MAX)), -127, 127)
    scale = np.ldexp(np.float32(1.0), exp).astype(np.float32)
    codes = e2m1_encode((g / scale[..., None]).reshape(out, inp))
    return pack_nibbles(codes), (exp + 127).astype(np.uint8)

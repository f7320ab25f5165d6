"""Bit-exact 16-bit float formats: BF16 and F16 (IEEE half).

BF16 is the upper half of an IEEE float32; conversion from float32 rounds to nearest, ties to
even, and keeps NaN a quiet NaN. F16 uses NumPy's own IEEE half (round to nearest even).
`round_bf16` is the value-level helper the reference uses at every BF16 dtype boundary.
"""
from __future__ import annotations

import numpy as np

__all__ = ["f32_to_bf16_bits", "bf16_bits_to_f32", "round_bf16", "f32_to_f16_bits", "f16_bits_to_f32",
           "round_f16"]


def f32_to_bf16_bits(x) -> np.ndarray:
    """float32 values -> uint16 BF16 bit patterns (round to nearest, ties to even; NaN -> quiet NaN)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    lsb = (u >> 16) & 1
    rounded = ((u + 0x7FFF + lsb) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    if nan.any():
        rounded = np.where(nan, ((u >> 16) | 0x0040).astype(np.uint16), rounded)
    return rounded


def bf16_bits_to_f32(b) -> np.ndarray:
    """uint16 BF16 bit patterns -> float32 (exact)."""
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def round_bf16(x) -> np.ndarray:
    """Round float values to the nearest BF16 value, returned as float32."""
    return bf16_bits_to_f32(f32_to_bf16_bits(np.asarray(x, dtype=np.float32)))


def f32_to_f16_bits(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).astype(np.float16).view(np.uint16)


def f16_bits_to_f32(b) -> np.ndarray:
    return np.asarray(b, dtype=np.uint16).view(np.float16).astype(np.float32)


def round_f16(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)

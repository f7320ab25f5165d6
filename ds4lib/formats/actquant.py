"""Activation quantise-dequantise rules of the V4.1 reference (docs/architecture.md §11.3, errata E1 and N3 in §1).

All three work on the last axis in contiguous blocks and return float32 values that the quantised
format can represent exactly (so a BF16 holder keeps them exactly):

- `act_quant_fp8(x, 32)`: amax = max(|x|, 1e-4); s = 2^ceil(log2(fp32(amax * fp32(1/448)))) from the
  exponent bits; value = e4m3(clamp(x/s, +-448)) * s. Input of every FP8/FP4-weight GEMM, the window
  KV and the DSpark context KV.
- `act_quant_fp4_pow2(x, 32)`: amax floored at 6*2^-126; s = 2^ceil(log2(amax * fp32(1/6)));
  value = e2m1(clamp(x/s, +-6)) * s. Indexer queries and index keys.
- `act_quant_fp4_e4m3(x, 16)`: s = e4m3(max(amax, 6*2^-9) / 6) (an FP8 number, not a power of two);
  value = e2m1(clamp(x/s, +-6)) * s. The compressed KV latent.
"""
from __future__ import annotations

import numpy as np

from ds4lib.formats.fp4 import E2M1_MAX, e2m1_round
from ds4lib.formats.fp8 import E4M3_MAX, e4m3_round, pow2_ceil_exponent

__all__ = ["act_quant_fp8", "act_quant_fp4_pow2", "act_quant_fp4_e4m3"]

_INV448 = np.float32(1.0) / np.float32(448.0)
_INV6 = np.float32(1.0) / np.float32(6.0)


def _blocks(x, block):
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] % block:
        raise ValueError(f"activation length {x.shape[-1]} is not a multiple of the block {block}")
    return x.reshape(x.shape[:-1] + (x.shape[-1] // block, block))


def act_quant_fp8(x, block: int = 32) -> np.ndarray:
    xb = _blocks(x, block)
    amax = np.maximum(np.abs(xb).max(axis=-1, keepdims=True), np.float32(1e-4))
    s = np.ldexp(np.float32(1.0), pow2_ceil_exponent((amax * _INV448).astype(np.float32))).astype(np.float32)
    q = e4m3_round(np.clip(xb / s, -E4M3_MAX, E4M3_MAX))
    return (q * s).reshape(np.shape(x)).astype(np.float32)


def act_quant_fp4_pow2(x, block: int = 32) -> np.ndarray:
    xb = _blocks(x, block)
    amax = np.maximum(np.abs(xb).max(axis=-1, keepdims=True), np.float32(6 * 2.0 ** -126))
    s = np.ldexp(np.float32(1.0), pow2_ceil_exponent((amax * _INV6).astype(np.float32))).astype(np.float32)
    q = e2m1_round(np.clip(xb / s, -E2M1_MAX, E2M1_MAX))
    return (q * s).reshape(np.shape(x)).astype(np.float32)


def act_quant_fp4_e4m3(x, block: int = 16) -> np.ndarray:
    xb = _blocks(x, block)
    amax = np.maximum(np.abs(xb).max(axis=-1, keepdims=True), np.float32(6 * 2.0 ** -9))
    s = e4m3_round((amax / np.float32(6.0)).astype(np.float32))
    q = e2m1_round(np.clip((xb / s).astype(np.float32), -E2M1_MAX, E2M1_MAX))
    return (q * s).reshape(np.shape(x)).astype(np.float32)

"""Rotary embedding on the tail of each head, with YaRN (docs/architecture.md §5.3).

Adjacent pairs (2i, 2i+1) of the last `rd` dims rotate by theta = p * f_i; f_i = base^(-2i/rd),
blended towards f_i / factor by the YaRN ramp on compressed layers. No magnitude scaling.
The inverse rotation (by -theta) is applied to the attention output.

Shapes: x [T, ..., Dh] with positions [T]; rd rope dims at the end of Dh.
"""
from __future__ import annotations

import math

import numpy as np

from ds4lib.formats.floats import round_bf16

__all__ = ["rope_freqs", "apply_rope"]


def rope_freqs(rd: int, base: float, yarn: bool, original_seq_len: int, factor: float, beta_fast: float,
               beta_slow: float) -> np.ndarray:
    """float32 [rd/2] angular frequencies."""
    freqs = (np.float32(1.0) / (np.float32(base) ** (np.arange(0, rd, 2, dtype=np.float32) / np.float32(rd))))
    freqs = freqs.astype(np.float32)
    if yarn and original_seq_len > 0:
        def corr(rot):
            return rd * math.log(original_seq_len / (rot * 2 * math.pi)) / (2 * math.log(base))
        low = max(math.floor(corr(beta_fast)), 0)
        high = min(math.ceil(corr(beta_slow)), rd - 1)
        ramp = np.clip((np.arange(rd // 2, dtype=np.float32) - np.float32(low)) / np.float32(max(high - low, 1e-3)),
                       0, 1).astype(np.float32)
        smooth = np.float32(1) - ramp
        freqs = (freqs / np.float32(factor) * (np.float32(1) - smooth) + freqs * smooth).astype(np.float32)
    return freqs


def apply_rope(x, positions, freqs, inverse: bool = False):
    """Rotate the last 2*len(freqs) dims of x [T, ..., Dh] at `positions` [T]; BF16-rounded result."""
    x = np.array(x, dtype=np.float32, copy=True)
    rd = 2 * len(freqs)
    ang = np.outer(np.asarray(positions, dtype=np.float32), freqs).astype(np.float32)   # [T, rd/2]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    if inverse:
        sin = -sin
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (rd // 2,)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    a, b = x[..., -rd::2], x[..., -rd + 1::2]
    ra, rb = a * cos - b * sin, a * sin + b * cos
    x[..., -rd::2], x[..., -rd + 1::2] = ra, rb
    return round_bf16(x)

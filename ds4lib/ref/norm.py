"""RMSNorm (docs/architecture.md §2.5): x * rsqrt(mean(x^2) + eps) * w in FP32, rounded to BF16.

Shapes: any [..., D]; the statistic is over the last axis.
"""
from __future__ import annotations

import numpy as np

from ds4lib.formats.floats import round_bf16

__all__ = ["rms_norm", "rms_scale"]


def rms_scale(x, eps: float):
    """rsqrt(mean(x^2) + eps) over the last axis, FP32, keepdims."""
    x = np.asarray(x, dtype=np.float32)
    var = np.mean(np.square(x), axis=-1, keepdims=True, dtype=np.float32)
    return (np.float32(1.0) / np.sqrt(var + np.float32(eps))).astype(np.float32)


def rms_norm(x, w, eps: float):
    x = np.asarray(x, dtype=np.float32)
    return round_bf16(np.asarray(w, dtype=np.float32) * (x * rms_scale(x, eps)))

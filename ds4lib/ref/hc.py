"""Manifold-constrained hyper-connections (docs/architecture.md §4): mixes, Sinkhorn, collapse, expand.

Shapes: T tokens, S = hc_mult streams, D hidden. State h [T, S, D] (BF16 values); fn [(2+S)*S, S*D],
base [(2+S)*S], scale [3]. V4.1 threads the pre-mix one sub-layer ahead (see ref.model).
"""
from __future__ import annotations

import numpy as np

from ds4lib.formats.floats import round_bf16
from ds4lib.ref.linear import einsum_f32
from ds4lib.ref.linear import matmul_f32
from ds4lib.ref.norm import rms_scale

__all__ = ["hc_mixes", "sinkhorn", "hc_pre", "hc_post"]


def _sigmoid(x):
    return (np.float32(1) / (np.float32(1) + np.exp(-x))).astype(np.float32)


def sinkhorn(c0, iters: int, eps: float):
    """c0 [T, S, S] logits (i = source, j = destination) -> row softmax, then alternate column/row
    normalisation, ending column-normalised; 20 iterations in total."""
    eps = np.float32(eps)
    c = c0 - c0.max(axis=-1, keepdims=True)
    c = np.exp(c)
    c = c / c.sum(axis=-1, keepdims=True) + eps
    c = c / (c.sum(axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(axis=-1, keepdims=True) + eps)
        c = c / (c.sum(axis=-2, keepdims=True) + eps)
    return c.astype(np.float32)


def hc_mixes(h, fn, base, scale, *, norm_eps: float, hc_eps: float, iters: int):
    """h [T, S, D] -> pre [T, S], post [T, S], comb [T, S, S] (all FP32)."""
    T, S, D = h.shape
    f = np.asarray(h, dtype=np.float32).reshape(T, S * D)                  # stream-major flatten
    m = matmul_f32(f, fn.T) * rms_scale(f, norm_eps)                       # [T, (2+S)*S]
    pre = _sigmoid(m[:, :S] * scale[0] + base[:S]) + np.float32(hc_eps)
    post = np.float32(2) * _sigmoid(m[:, S:2 * S] * scale[1] + base[S:2 * S])
    c0 = (m[:, 2 * S:].reshape(T, S, S) * scale[2] + base[2 * S:].reshape(S, S)).astype(np.float32)
    return pre.astype(np.float32), post.astype(np.float32), sinkhorn(c0, iters, hc_eps)


def hc_pre(h, pre):
    """Collapse: sum_i pre_i * h[i] in FP32, BF16 result [T, D]."""
    return round_bf16(einsum_f32("ts,tsd->td", pre, h))


def hc_post(y, h, post, comb):
    """Expand: new stream j = post_j * y + sum_i comb[i, j] * h[i], BF16 result [T, S, D]."""
    out = post[:, :, None] * np.asarray(y, dtype=np.float32)[:, None, :] \
        + einsum_f32("tij,tid->tjd", comb, h)
    return round_bf16(out)

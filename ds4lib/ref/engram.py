"""Engram (docs/architecture.md §8): hashed 2..n-gram memory added into every HC stream before a block.

Hashing per position t and Engram layer: over lookbacks k = 0..max_ngram-1 (k = 0 the token itself),
v_k = pad if blocked else cid[t-k], blocked once t-k < 0 or a DEAD token was passed; rolling ^= v_k *
mult[k] (int64); for k >= 1 the (k+1)-gram hash of head j is rolling mod prime + offset.
Lookup, projection, gate: E = table rows (FP8 dequantised, BF16), kv = wkv(E) split into one key per
stream and one shared value; gate_s = sigmoid(copysign(sqrt(max(|dot_s|, 1e-6)), dot_s)) with
dot_s = sum_d h_s w k_s * rsqrt(mean h_s^2 + eps) rsqrt(mean k_s^2 + eps) / sqrt(D); h_s += gate_s value.

Shapes: T tokens, S streams, D hidden, C = (max_ngram-1)*n_heads hash columns, hd row width.
"""
from __future__ import annotations

import numpy as np

from ds4lib.formats.floats import round_bf16
from ds4lib.ref.linear import linear_q
from ds4lib.ref.norm import rms_scale

__all__ = ["DEAD", "engram_hashes", "engram_apply"]

DEAD = -1


def engram_hashes(cids, history, geometry, pad_cid: int):
    """cids [T] compressed ids of the new tokens (DEAD for image positions); history [max_ngram-1] the
    previous ids, oldest first, with -2 meaning "before the sequence start".
    Returns (hashes [T, Le, C] int64 with offsets added, new history)."""
    n = geometry.max_ngram
    primes, offsets, mults = geometry.arrays()
    seq = np.concatenate([np.asarray(history, dtype=np.int64), np.asarray(cids, dtype=np.int64)])
    T, h0 = len(cids), len(history)
    out = np.zeros((T, len(geometry.layer_ids), geometry.n_cols), dtype=np.int64)
    blocked = np.zeros(T, dtype=bool)
    rolling = np.zeros((T, len(geometry.layer_ids)), dtype=np.int64)
    for k in range(n):
        src = seq[h0 - k:h0 - k + T]
        blocked |= (src == -2) | (src == DEAD)
        v = np.where(blocked, pad_cid, src)
        rolling ^= v[:, None] * mults[None, :, k]
        if k >= 1:
            cols = slice((k - 1) * geometry.n_heads, k * geometry.n_heads)
            out[:, :, cols] = rolling[:, :, None] % primes[None, :, cols] + offsets[None, :, cols]
    return out, seq[-(n - 1):].copy()


def engram_apply(h, rows, w, cfg, quant_sim, dead=None):
    """h [T, S, D]; rows [T, C, hd] dequantised table rows -> h with the gated value added (BF16).
    `dead` [T] bool closes the gate (image positions)."""
    T, S, D = h.shape
    E = round_bf16(rows).reshape(T, -1)
    kv = linear_q(E, w["engram.wkv.weight"], quant_sim)
    key = kv[:, :S * D].reshape(T, S, D)
    value = kv[:, S * D:]
    wgt = (w["engram.q_weight"] * w["engram.k_weight"]).astype(np.float32)
    hf = np.asarray(h, dtype=np.float32)
    rstd = rms_scale(hf, cfg.norm_eps)[..., 0] * rms_scale(key, cfg.norm_eps)[..., 0]
    dot = (hf * wgt[None] * key).sum(-1, dtype=np.float32) * rstd * np.float32(D ** -0.5)
    g = np.copysign(np.sqrt(np.maximum(np.abs(dot), np.float32(1e-6))), dot)
    gate = (1 / (1 + np.exp(-g))).astype(np.float32)
    if dead is not None:
        gate = np.where(np.asarray(dead)[:, None], np.float32(0), gate)
    return round_bf16(hf + gate[..., None] * value[:, None, :])

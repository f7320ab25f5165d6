"""The V4.1 KV compressor (docs/architecture.md §6.1): one latent per group of `ratio` tokens.

Ratio 2: kv = wkv(x), score = wgate(x) in FP32 (BF16 weights promoted); each complete group pools
sum_r kv_r * softmax_r(score_r) per dimension, then BF16 and RMSNorm. Ratio 1: norm(wkv(x)) in BF16,
no gate. Latents are returned before RoPE (the indexer needs them unrotated). A trailing incomplete
group is carried in `pending` across calls and completed by later tokens. While `pending.log` is a list (a
speculative verify in progress, State.mark), each call also logs its first position and all its kv / score rows,
so that State.rollback can rebuild the incomplete group of any earlier position exactly.

Shapes: T tokens, Dh latent width, G completed groups.
"""
from __future__ import annotations

import numpy as np

from ds4lib.formats.floats import round_bf16
from ds4lib.ref.linear import linear_bf16, linear_f32
from ds4lib.ref.norm import rms_norm

__all__ = ["Pending", "compress"]


class Pending:
    """Rows of the current incomplete group: kv [n, Dh], score [n, Dh] (FP32), n < ratio."""

    def __init__(self, dh: int):
        self.kv = np.zeros((0, dh), dtype=np.float32)
        self.score = np.zeros((0, dh), dtype=np.float32)
        self.log = None           # None, or [(first position, kv [n, Dh], score [n, Dh])] while a mark is open

    def copy(self):
        p = Pending(self.kv.shape[1])
        p.kv, p.score = self.kv.copy(), self.score.copy()
        return p


def compress(x, w, cfg, ratio: int, start_pos: int, pending: Pending):
    """x [T, D] at positions start_pos.. -> (latents [G, Dh] pre-RoPE, group ids [G])."""
    T = len(x)
    if ratio == 1:
        lat = rms_norm(linear_bf16(x, w["attn.compressor.wkv.weight"]), w["attn.compressor.norm.weight"],
                       cfg.norm_eps)
        return lat, np.arange(start_pos, start_pos + T, dtype=np.int64)
    kv = linear_f32(x, w["attn.compressor.wkv.weight"])
    score = linear_f32(x, w["attn.compressor.wgate.weight"])
    n_prev = len(pending.kv)
    if start_pos % ratio != n_prev:
        raise ValueError(f"compressor state holds {n_prev} rows but the call starts at position {start_pos}")
    kv = np.concatenate([pending.kv, kv])
    score = np.concatenate([pending.score, score])
    if pending.log is not None:
        pending.log.append((start_pos - n_prev, kv, score))
    n_full = len(kv) // ratio * ratio
    pending.kv, pending.score = kv[n_full:].copy(), score[n_full:].copy()
    if n_full == 0:
        return np.zeros((0, kv.shape[1]), dtype=np.float32), np.zeros(0, dtype=np.int64)
    kv = kv[:n_full].reshape(-1, ratio, kv.shape[1])
    score = score[:n_full].reshape(-1, ratio, score.shape[1])
    e = np.exp(score - score.max(axis=1, keepdims=True))
    pooled = (kv * (e / e.sum(axis=1, keepdims=True))).sum(axis=1, dtype=np.float32)
    lat = rms_norm(round_bf16(pooled), w["attn.compressor.norm.weight"], cfg.norm_eps)
    first = (start_pos - n_prev) // ratio
    return lat, np.arange(first, first + len(lat), dtype=np.int64)

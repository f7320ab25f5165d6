"""The V4.1 indexer (docs/architecture.md §6.2–§6.5): which compressed rows each query may attend to.

score[t, s] = sum_h w[t, h] * relu(qI[t, h] . K[s]) with w = weights_proj(x) * (dI^-1/2 * nI^-1/2),
computed with the official BF16 roundings (q.K product, the weighting and the head sum each
round to BF16; erratum N2), -inf where s >= (t+1)//ratio. The candidate source keeps the best
`candidate_topk_blocks` blocks of `candidate_block_size` positions (newest reachable block pinned);
index sources after it score only inside that mask. Top-k takes the k best in a stable order
(descending score, lower index first among ties) and returns them in position order, -1 padded.

Shapes: T queries, S compressed rows, nI index heads, dI index head dim, k = index_topk.
"""
from __future__ import annotations

import numpy as np

from ds4lib.formats.actquant import act_quant_fp4_pow2
from ds4lib.formats.floats import round_bf16
from ds4lib.ref.linear import einsum_f32
from ds4lib.ref.linear import linear_bf16, linear_q
from ds4lib.ref.norm import rms_norm
from ds4lib.ref.rope import apply_rope

__all__ = ["index_keys", "index_scores", "candidate_blocks", "select_topk", "reach"]


def reach(positions, ratio: int):
    """Number of compressed rows visible to each query: (t + 1) // ratio."""
    return (np.asarray(positions, dtype=np.int64) + 1) // ratio


def index_keys(latent, w, cfg, group_ids, ratio, freqs, quant_sim):
    """Pre-RoPE latents [G, Dh] -> index keys [G, dI]: k_norm(wk(latent)), RoPE at g*ratio, FP4 (block 32)."""
    k = rms_norm(linear_bf16(latent, w["attn.indexer.wk.weight"]), w["attn.indexer.k_norm.weight"], cfg.norm_eps)
    k = apply_rope(k, np.asarray(group_ids) * ratio, freqs)
    return act_quant_fp4_pow2(k, 32) if quant_sim else k


def index_scores(x, qr, w, cfg, keys, positions, ratio, freqs, quant_sim):
    """x [T, D], qr [T, q_lora], keys [S, dI] -> BF16-valued scores [T, S] (-inf where unreachable)."""
    nI, dI = cfg.index_n_heads, cfg.index_head_dim
    q = linear_q(qr, w["attn.indexer.wq_b.weight"], quant_sim).reshape(len(x), nI, dI)
    q = apply_rope(q, positions, freqs)
    if quant_sim:
        q = act_quant_fp4_pow2(q, 32)
    wts = round_bf16(linear_bf16(x, w["attn.indexer.weights_proj.weight"]) * np.float32(dI ** -0.5 * nI ** -0.5))
    dots = round_bf16(einsum_f32("thd,sd->ths", q, keys))
    score = round_bf16(np.maximum(dots, 0) * wts[:, :, None]).sum(axis=1, dtype=np.float32)
    score = round_bf16(score)
    S = keys.shape[0]
    score = np.where(np.arange(S)[None, :] < reach(positions, ratio)[:, None], score, -np.inf)
    return score.astype(np.float32)


def _stable_top(values, k):
    """Indices of the k largest per row: descending value, lower index first among ties."""
    order = np.argsort(-values, axis=-1, kind="stable")
    return order[:, :k]


def candidate_blocks(scores, reach_t, topk_blocks: int, block_size: int):
    """scores [T, S] (-inf unreachable) -> bool mask [T, S] of positions inside the kept blocks."""
    T, S = scores.shape
    nb = -(-S // block_size)
    pad = np.full((T, nb * block_size), -np.inf, dtype=np.float32)
    pad[:, :S] = scores
    bs = pad.reshape(T, nb, block_size).max(axis=-1)
    last = (np.asarray(reach_t) - 1) // block_size
    bs = np.where(np.arange(nb)[None, :] == last[:, None], np.inf, bs)
    top = _stable_top(bs, min(topk_blocks, nb))
    keep = np.zeros((T, nb), dtype=bool)
    rows = np.arange(T)[:, None]
    keep[rows, top] = np.take_along_axis(bs, top, axis=-1) > -np.inf
    return np.repeat(keep, block_size, axis=-1)[:, :S]


def select_topk(scores, reach_t, k: int):
    """scores [T, S] -> int64 [T, k] ascending row ids, -1 where fewer than k rows are reachable."""
    T, S = scores.shape
    if k == 0 or S == 0:
        return np.zeros((T, 0), dtype=np.int64)
    idx = np.sort(_stable_top(scores, k), axis=-1)
    return np.where(idx < np.asarray(reach_t)[:, None], idx, -1)

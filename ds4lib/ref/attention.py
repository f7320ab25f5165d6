"""Attention of V4.1 (docs/architecture.md §5): query path, window KV, sparse attention with a per-head
sink over the union of window rows and selected compressed rows, grouped output projection.

Shapes: T queries, H heads, Dh head dim (rope tail rd), N window candidate rows, K selected
compressed rows per query, G output groups, Ro o-LoRA rank, D hidden.
The key of a row is also its value (one shared latent).
"""
from __future__ import annotations

import numpy as np

from ds4lib.formats.actquant import act_quant_fp8
from ds4lib.formats.floats import round_bf16
from ds4lib.ref.linear import einsum_f32
from ds4lib.ref.linear import linear_q
from ds4lib.ref.norm import rms_norm
from ds4lib.ref.rope import apply_rope

__all__ = ["query_path", "window_kv", "sparse_attention", "output_projection"]


def query_path(x, w, cfg, positions, freqs, quant_sim):
    """x [T, D] -> qr [T, q_lora] (also the indexer input), q [T, H, Dh] with RoPE on the tail."""
    qr = rms_norm(linear_q(x, w["attn.wq_a.weight"], quant_sim), w["attn.q_norm.weight"], cfg.norm_eps)
    q = linear_q(qr, w["attn.wq_b.weight"], quant_sim).reshape(len(x), cfg.n_heads, cfg.head_dim)
    return qr, apply_rope(q, positions, freqs)


def window_kv(x, w, cfg, positions, freqs, quant_sim):
    """x [T, D] -> kv [T, Dh]: kv_norm(wkv(x)), RoPE on the tail, FP8 simulation over all dims."""
    kv = rms_norm(linear_q(x, w["attn.wkv.weight"], quant_sim), w["attn.kv_norm.weight"], cfg.norm_eps)
    kv = apply_rope(kv, positions, freqs)
    return act_quant_fp8(kv, cfg.fp8_block) if quant_sim else kv


def sparse_attention(q, win_keys, win_mask, cmp_keys, cmp_valid, sink, scale):
    """q [T, H, Dh]; win_keys [N, Dh] with win_mask [T, N]; cmp_keys [T, K, Dh] with cmp_valid [T, K].

    One softmax over all visible rows plus the sink (denominator only). The row max covers the valid
    rows only (erratum E4); exp weights are rounded to BF16 before the value product, the FP32
    denominator uses them unrounded. A query with no valid row outputs 0.
    """
    T, H, Dh = q.shape
    zw = einsum_f32("thd,nd->thn", q, win_keys) * np.float32(scale)
    zw = np.where(win_mask[:, None, :], zw, -np.inf)
    if cmp_keys is not None and cmp_keys.shape[1]:
        zc = einsum_f32("thd,tkd->thk", q, cmp_keys) * np.float32(scale)
        zc = np.where(cmp_valid[:, None, :], zc, -np.inf)
        z = np.concatenate([zw, zc], axis=-1)
    else:
        z = zw
    m = z.max(axis=-1, keepdims=True)
    has = np.isfinite(m)
    m = np.where(has, m, np.float32(-1e30))
    e = np.exp(z - m).astype(np.float32)                                    # invalid rows -> 0
    den = e.sum(axis=-1, keepdims=True, dtype=np.float64).astype(np.float32) \
        + np.exp(sink[None, :, None] - m).astype(np.float32)
    eb = round_bf16(e)
    num = einsum_f32("thn,nd->thd", eb[..., :zw.shape[-1]], win_keys)
    if z is not zw:
        num = num + einsum_f32("thk,tkd->thd", eb[..., zw.shape[-1]:], cmp_keys)
    o = num / den
    return round_bf16(np.where(has, o, 0))


def output_projection(o, w, cfg, positions, freqs, quant_sim):
    """o [T, H, Dh] -> inverse RoPE -> grouped wo_a (BF16, no activation quantisation) -> wo_b [T, D]."""
    T = o.shape[0]
    G, R = cfg.o_groups, cfg.o_lora_rank
    o = apply_rope(o, positions, freqs, inverse=True).reshape(T, G, -1)                 # [T, G, H/G*Dh]
    wo_a = w["attn.wo_a.weight"].reshape(G, R, -1)                                      # [G, Ro, H/G*Dh]
    u = round_bf16(einsum_f32("tgd,grd->tgr", o, wo_a)).reshape(T, G * R)
    return linear_q(u, w["attn.wo_b.weight"], quant_sim)


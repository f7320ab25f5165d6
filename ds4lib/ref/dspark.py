"""DSpark draft head of V4.1 (docs/architecture.md §9, erratum E3 in §1.1): context features, Markov bias,
confidence.

Features: the BF16 mean over the HC streams of the state entering each target layer (after Engram),
concatenated. Context: c = main_norm(main_proj(features)); each stage turns c into ring rows with
its own wkv. Head: y = collapse of the last stage; base = head(norm(y)); position i adds the Markov
bias markov.head . markov.embed[prev] and drafts d_i (argmax, or a sample); confidence logit_i =
proj . concat(y_i, markov.embed[prev]) in FP32 (a logit; sigmoid gives the acceptance estimate).

Shapes: B block size, D hidden, R Markov rank, V vocab.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ds4lib.ref.linear import linear_f32, linear_q
from ds4lib.ref.norm import rms_norm

__all__ = ["Proposal", "context_input", "draft_tokens"]


@dataclass
class Proposal:
    tokens: np.ndarray        # [B + 1] anchor then B drafted tokens
    logits: np.ndarray        # [B, V] base + Markov bias (drafts are drawn from these)
    base_logits: np.ndarray   # [B, V]
    confidence: np.ndarray    # [B] confidence logits


def context_input(features, w0, cfg, quant_sim):
    """features [T, n_targets*D] -> main_x [T, D] (stage 0's main_proj and main_norm)."""
    return rms_norm(linear_q(features, w0["main_proj.weight"], quant_sim), w0["main_norm.weight"], cfg.norm_eps)


def draft_tokens(y, anchor: int, wl, head_w, cfg, pick=None) -> Proposal:
    """y [B, D] collapsed last-stage state (pre-norm); `pick(logits_row) -> token` (default argmax)."""
    base = linear_f32(rms_norm(y, wl["norm.weight"], cfg.norm_eps), head_w)
    B = y.shape[0]
    tokens = np.zeros(B + 1, dtype=np.int64)
    tokens[0] = anchor
    logits = base.copy()
    conf = np.zeros(B, dtype=np.float32)
    proj = wl["confidence_head.proj.weight"]
    for i in range(B):
        m = wl["markov_head.embed.weight"][tokens[i]]
        logits[i] = base[i] + linear_f32(m[None], wl["markov_head.head.weight"])[0]
        tokens[i + 1] = int(np.argmax(logits[i])) if pick is None else int(pick(logits[i]))
        conf[i] = linear_f32(np.concatenate([y[i], m])[None], proj)[0, 0]
    return Proposal(tokens, logits, base, conf)

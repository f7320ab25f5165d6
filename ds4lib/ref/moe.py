"""Mixture of experts of V4.1 (docs/architecture.md §7): router, routed experts, shared expert.

Router: s = sqrt(softplus(x W^T / gate_temp)) in FP32; choose top-k of s + bias (selection only);
weights = s at the chosen ids / (sum + 1e-20) * route_scale. Expert (SwiGLU with asymmetric clamp):
g = w1(x), u = w3(x) (BF16 GEMM outputs, then FP32), u clamped to +-limit, g clamped from above;
a = silu(g) * u, times the routing weight before the down projection; y_e = w2(bf16(a)).
Routed contributions accumulate in FP32 in ascending expert id, then the shared expert is added.

Shapes: T tokens, D hidden, E experts, K active experts, F expert width.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ds4lib.formats.floats import round_bf16
from ds4lib.ref.linear import linear_f32, linear_q

__all__ = ["Routing", "route", "select_experts", "expert_ffn", "moe"]


@dataclass
class Routing:
    scores: np.ndarray     # [T, E] unbiased router scores
    ids: np.ndarray        # [T, K] chosen experts, by descending biased score
    weights: np.ndarray    # [T, K] routing weights (normalised, scaled)


def _softplus(x):
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20)))).astype(np.float32)


def route(x, gate_w, gate_bias, cfg, top_k: int, bias_delta=None) -> Routing:
    """`bias_delta` [E] (a sidecar's selection bias) adds to the selection score only."""
    logits = linear_f32(x, gate_w) / np.float32(cfg.gate_temp)
    if cfg.score_func == "sqrtsoftplus":
        s = np.sqrt(_softplus(logits))
    elif cfg.score_func == "sigmoid":
        s = (1 / (1 + np.exp(-logits))).astype(np.float32)
    else:
        e = np.exp(logits - logits.max(-1, keepdims=True))
        s = (e / e.sum(-1, keepdims=True)).astype(np.float32)
    ids = select_experts(s, gate_bias, top_k, bias_delta)
    wts = np.take_along_axis(s, ids, axis=-1)
    if cfg.norm_topk_prob and top_k > 1:
        wts = wts / (wts.sum(-1, keepdims=True) + np.float32(1e-20))
    return Routing(s, ids, (wts * np.float32(cfg.route_scale)).astype(np.float32))


def select_experts(scores, gate_bias, top_k: int, bias_delta=None):
    """scores [T, E] (unbiased) -> chosen ids [T, K] by descending selection score s + bias (+ Δb), ties to the
    lower id. The sidecar solver re-selects with candidate Δb through this same function."""
    sel = scores + gate_bias
    if bias_delta is not None:
        sel = sel + bias_delta
    return np.argsort(-sel, axis=-1, kind="stable")[:, :top_k]


def expert_ffn(x, w1, w2, w3, limit: float, quant_sim: bool, weights=None, down_gain=None):
    """One SwiGLU expert on x [n, D] -> [n, D] BF16 values. `weights` [n] routing weights;
    `down_gain` [D] multiplies the down projection's output channels (sidecar gains)."""
    g = linear_q(x, w1, quant_sim)
    u = linear_q(x, w3, quant_sim)
    if limit > 0:
        u = np.clip(u, -limit, limit)
        g = np.minimum(g, np.float32(limit))
    a = (g / (np.float32(1) + np.exp(-g)) * u).astype(np.float32)
    if weights is not None:
        a = (weights[:, None] * a).astype(np.float32)
    w2_eff = w2 if down_gain is None else w2 * down_gain[:, None]
    return linear_q(round_bf16(a), w2_eff, quant_sim)


def moe(x, w, cfg, top_k, quant_sim, gains=None, bias_delta=None, observe=None):
    """x [T, D] -> y [T, D] BF16 values. `w` maps 'ffn.*' names to float32 weights.
    `gains` {expert: [D]} down-projection output gains; `observe(name, value)` receives observations."""
    E = w["ffn.gate.weight"].shape[0]
    r = route(x, w["ffn.gate.weight"], w["ffn.gate.bias"], cfg, top_k, bias_delta)
    y = np.zeros(x.shape, dtype=np.float32)
    contrib = np.zeros((len(x), top_k, x.shape[1]), dtype=np.float32) if observe else None
    for e in range(E):
        tok, slot = np.nonzero(r.ids == e)
        if len(tok) == 0:
            continue
        ye = expert_ffn(x[tok], w[f"ffn.experts.{e}.w1.weight"], w[f"ffn.experts.{e}.w2.weight"],
                        w[f"ffn.experts.{e}.w3.weight"], cfg.swiglu_limit, quant_sim,
                        weights=r.weights[tok, slot], down_gain=None if gains is None else gains.get(e))
        y[tok] += ye
        if contrib is not None:
            contrib[tok, slot] = ye
    ysh = expert_ffn(x, w["ffn.shared_experts.w1.weight"], w["ffn.shared_experts.w2.weight"],
                     w["ffn.shared_experts.w3.weight"], cfg.swiglu_limit, quant_sim)
    if observe:
        observe("router_scores", r.scores)
        observe("router_ids", r.ids)
        observe("router_weights", r.weights)
        # ye: each chosen expert's down-projection output per unit routing weight (the official order
        # applies the weight before w2, so the exact summed term is ye * weight)
        observe("ye", contrib / np.where(r.weights == 0, 1, r.weights)[:, :, None])
        observe("ysh", ysh)
    return round_bf16(y + ysh)

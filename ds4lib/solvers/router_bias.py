"""The ② router selection bias Δb of one layer (docs/sidecar.md): nudge our router's selection
scores so that it picks the same set of experts as the original.

For every training row, with v = our selection scores (unbiased score + the layer's bias) and thr = our K-th
largest selection score: each expert the original picked and we did not gets the gap thr − v_e (> 0, pull it
up); each expert we picked and the original did not gets thr − v_e (≤ 0, push it down). Δb_e = α · the mean
gap of expert e, for experts with at least `min_events` events (others 0). α is chosen on the held-out rows'
same-set rate (our chosen set equals the original's); Δb is kept only if that rate strictly improves on Δb = 0.
Δb changes selection only, never the routing weights. Selection goes through ds4lib.ref.moe.select_experts.

No files, no model objects. Shapes: T tokens, E experts, K active experts.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ds4lib.ref.moe import select_experts

__all__ = ["BiasSolution", "gap_means", "same_set_rate", "solve_router_bias", "ALPHAS", "MIN_EVENTS"]

ALPHAS = (0.5, 1.0, 1.5, 2.5)
MIN_EVENTS = 8


@dataclass
class BiasSolution:
    bias: np.ndarray | None      # [E] float32 Δb, or None when no α strictly improves the held-out rate
    alpha: float | None
    armed: int                   # experts with ≥ min_events events
    heldout_before: float        # held-out same-set rate with Δb = 0
    heldout_after: float         # with the chosen Δb (= before when none is kept)
    train_before: float
    train_after: float
    rows: list                   # [{alpha, train, heldout}]


def same_set_rate(ids_a, ids_b) -> float:
    """Share of rows whose chosen sets are equal (order ignored). ids [T, K]."""
    if len(ids_a) == 0:
        return 0.0
    return float((np.sort(ids_a, -1) == np.sort(ids_b, -1)).all(-1).mean())


def gap_means(scores, gate_bias, ids_orig, top_k: int):
    """(mean gap [E], event count [E]) over the rows given."""
    E = scores.shape[1]
    v = scores + gate_bias                                                                  # [T, E]
    ours = select_experts(scores, gate_bias, top_k)
    thr = np.take_along_axis(v, ours, -1).min(-1)                                           # [T] K-th score
    in_ours = np.zeros(v.shape, bool)
    np.put_along_axis(in_ours, ours, True, -1)
    in_orig = np.zeros(v.shape, bool)
    np.put_along_axis(in_orig, ids_orig, True, -1)
    event = in_ours ^ in_orig
    gap = np.where(event, thr[:, None].astype(np.float64) - v, 0.0)
    count = event.sum(0)
    total = gap.sum(0)
    return np.where(count > 0, total / np.maximum(count, 1), 0.0), count.astype(np.int64)


def solve_router_bias(*, scores, gate_bias, ids_orig, top_k: int, train, alphas=ALPHAS,
                      min_events: int = MIN_EVENTS) -> BiasSolution:
    """scores [T, E] our unbiased router scores; gate_bias [E] the layer's bias in our stack; ids_orig [T, K]."""
    scores = np.asarray(scores, np.float32)
    gate_bias = np.asarray(gate_bias, np.float32)
    train = np.asarray(train, bool)
    held = ~train
    mean, count = gap_means(scores[train], gate_bias, ids_orig[train], top_k)
    armed = count >= min_events
    base_ids = select_experts(scores, gate_bias, top_k)
    tr0, ho0 = same_set_rate(base_ids[train], ids_orig[train]), same_set_rate(base_ids[held], ids_orig[held])
    rows, best = [], None
    for a in alphas:
        db = np.where(armed, a * mean, 0.0).astype(np.float32)
        # the engine folds Δb into the layer's bias (float32) before adding it to the scores: same order here
        ids = select_experts(scores, (gate_bias + db).astype(np.float32), top_k)
        tr, ho = same_set_rate(ids[train], ids_orig[train]), same_set_rate(ids[held], ids_orig[held])
        rows.append({"alpha": float(a), "train": tr, "heldout": ho})
        if best is None or ho > best[2]:
            best = (a, db, ho, tr)
    if best is None or best[2] <= ho0 or not armed.any():
        return BiasSolution(None, None, int(armed.sum()), ho0, ho0, tr0, tr0, rows)
    return BiasSolution(best[1], float(best[0]), int(armed.sum()), ho0, best[2], tr0, best[3], rows)

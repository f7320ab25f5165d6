"""The rival pass of the ③ solve (docs/posttrain.md "Rivals"): tokens outside a position's captured rivals that the
solved δ is predicted to bring within reach of its token, added as rows of that position for the next solve.

Why. Each captured position gives rows against its M strongest other tokens under the ② stack (capture.py
rows_from_capture); the solve then holds those pairs and nothing else. On day 1 of data/posttrain/general at ρ_o 1e5
one kept position was lost in the real forward to a token ranked 45th under ② (' related' over 'of', raised by 4.85
logits) with 16 and with 32 rivals: every captured pair stayed above 0 (BENCHMARKS.md). More rivals for every position
cost rows everywhere; the prediction of the whole vocabulary's change at the captured positions names the few that
matter.

Prediction. The rows are linear in the MoE output's change Δy = Σ_k rw_k·ye_k ⊙ δ[e_k] (capture.py "Linear rows"),
and every logit moves by the same first-order map: Δℓ = W·(γ ⊙ α·inv·(Δy − inv²·(z·Δy)/D · z)) ("linear" norm; the
bracket is Δy alone with "fixed"), so one [V, D] product per position predicts every token's change.

Shapes: G captured positions, n positions, K active experts, D hidden, V vocab, E experts.
"""
from __future__ import annotations

import numpy as np

__all__ = ["logit_change", "rival_pairs", "RIVAL_PASSES", "RIVAL_MARGIN", "RIVAL_MAX"]

RIVAL_PASSES = 2        # rival passes after the first solve (each one re-solves when it adds rows)
RIVAL_MARGIN = 2.0      # a token outside the rows predicted within this margin of the position's token is added
RIVAL_MAX = 8           # tokens added per position and pass (the nearest first)


def logit_change(cap, row, delta, *, head, norm_weight, norm: str = "linear") -> np.ndarray:
    """[n, V] float64 predicted logit changes at captured positions `row` (indices into cap's G positions) with
    δ [E, D] on the captured layer's gains (module docstring "Prediction")."""
    row = np.asarray(row, np.int64)
    d = np.asarray(delta, np.float64)
    ye = cap.ye[row].astype(np.float64)                                                    # [n, K, D]
    dy = np.einsum("nk,nkd->nd", cap.weights[row].astype(np.float64), ye * d[cap.ids[row]])  # [n, D]
    z = cap.z[row].astype(np.float64)
    inv = cap.inv[row].astype(np.float64)
    if norm == "linear":
        dy = dy - (inv ** 2 * np.einsum("nd,nd->n", dy, z) / z.shape[1])[:, None] * z
    g = (cap.alpha[row] * inv)[:, None] * dy * np.asarray(norm_weight, np.float64)          # [n, D]
    return g @ np.asarray(head, np.float64).T                                               # [n, V]


def rival_pairs(cap, meta, taken: dict, delta, *, head, norm_weight, margin: float = RIVAL_MARGIN,
                limit: int = RIVAL_MAX):
    """The pairs to add for one request's positions: (row [n'], a [n'], b [n'], kind [n'], local group [n']) with b a
    token not yet a rival of its position (`taken` {local group: set of tokens}, updated in place) whose predicted
    margin ℓ_a − ℓ_b after δ is below `margin`, at most `limit` per position, the nearest first."""
    g = meta.group
    first = np.r_[True, g[1:] != g[:-1]] if len(g) else np.zeros(0, bool)
    rows, a, kind, grp = meta.row[first], meta.a[first], meta.kind[first], g[first]
    for k in grp:
        taken.setdefault(int(k), set()).update(int(t) for t in meta.b[g == k])
    if not len(rows):
        return (np.zeros(0, np.int64),) * 5
    after = cap.logits[rows].astype(np.float64) + logit_change(cap, rows, delta, head=head, norm_weight=norm_weight,
                                                               norm=meta.norm)              # [n, V]
    m = after[np.arange(len(rows)), a][:, None] - after                                    # [n, V] ℓ_a − ℓ_t
    out = []
    for i, k in enumerate(grp):
        seen = taken[int(k)]
        near = np.nonzero(m[i] < margin)[0]
        near = near[np.argsort(m[i, near], kind="stable")]
        cand = [int(t) for t in near if t != a[i] and int(t) not in seen][:limit]
        seen.update(cand)
        out += [(rows[i], a[i], t, kind[i], k) for t in cand]
    if not out:
        return (np.zeros(0, np.int64),) * 5
    r, aa, b, kd, gg = (np.array(x) for x in zip(*out))
    return r.astype(np.int64), aa.astype(np.int64), b.astype(np.int64), kd.astype(bool), gg.astype(np.int64)

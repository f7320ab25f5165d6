"""The one comparator for every quality number (docs/design.md §5): original (teacher) vs ours (student).

Per position, with p = softmax(teacher), q = softmax(student):
- Same top-1: argmax p == argmax q;
- Σmin = Σ_v min(p_v, q_v) (the restore rate; 1 = identical distributions), reported as mean, median, p5;
- KL(p || q);
- PPL ratio: exp(mean NLL_ours) / exp(mean NLL_original) on the true next tokens.
Shapes: N positions, V vocab. All arithmetic in float64.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["Comparison", "compare", "merge"]


@dataclass
class Comparison:
    n: int
    same_top1: float
    sigma_min_mean: float
    sigma_min_median: float
    sigma_min_p5: float
    kl_mean: float
    ppl_original: float
    ppl_ours: float
    ppl_ratio: float

    def as_dict(self) -> dict:
        return asdict(self)


def _log_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def per_position(teacher_logits, student_logits, targets):
    """(same top-1 [N] bool, Σmin [N], KL [N], teacher NLL [N], student NLL [N])."""
    lp, lq = _log_softmax(teacher_logits), _log_softmax(student_logits)
    p, q = np.exp(lp), np.exp(lq)
    t = np.asarray(targets, dtype=np.int64)
    idx = np.arange(len(t))
    return (lp.argmax(-1) == lq.argmax(-1), np.minimum(p, q).sum(-1), (p * (lp - lq)).sum(-1),
            -lp[idx, t], -lq[idx, t])


def _summary(same, smin, kl, nll_p, nll_q) -> Comparison:
    n = len(same)
    po, pq = float(np.exp(np.mean(nll_p))), float(np.exp(np.mean(nll_q)))
    return Comparison(n=n, same_top1=float(np.mean(same)), sigma_min_mean=float(np.mean(smin)),
                      sigma_min_median=float(np.median(smin)), sigma_min_p5=float(np.percentile(smin, 5)),
                      kl_mean=float(np.mean(kl)), ppl_original=po, ppl_ours=pq, ppl_ratio=pq / po)


def compare(teacher_logits, student_logits, targets) -> Comparison:
    return _summary(*per_position(teacher_logits, student_logits, targets))


def merge(parts) -> Comparison:
    """Combine per-position arrays of several windows into one comparison."""
    cols = list(zip(*parts))
    return _summary(*(np.concatenate(c) for c in cols))

"""The five numbers of a stack on a slice: each window scored as its own sequence after BOS, every window
token predicted (teacher and student on the same tokens, the student through the engine's serving path)."""
from __future__ import annotations

import numpy as np

from ds4lib.corpus.slices import load_slice
from ds4lib.eval.metrics import merge, per_position

__all__ = ["evaluate_slice", "evaluate_windows", "BOS"]

BOS = 0


def evaluate_slice(engine, teacher, name: str, windows: int | None = None, split: int | None = None):
    """Returns (Comparison, per-window list). `split` scores positions >= split through the decode path."""
    return evaluate_windows(engine, teacher, load_slice(name).tokens[:windows], split)


def evaluate_windows(engine, teacher, windows, split: int | None = None):
    """Token windows [W, N] (no BOS; it is prepended) -> (Comparison, per-window list)."""
    parts, rows = [], []
    for w in windows:
        seq = np.concatenate([[BOS], w]).astype(np.int64)
        t_lg = teacher.logits(seq[:-1])
        s_lg = engine.logits(seq[:-1], split=split)
        pp = per_position(t_lg, s_lg, seq[1:])
        parts.append(pp)
        rows.append({"same_top1": float(np.mean(pp[0])), "sigma_min": float(np.mean(pp[1]))})
    return merge(parts), rows

"""Plots of a ③ post-training solve for notebooks/posttrain.ipynb: predicted against real margins of every captured
row. (It lives beside the solve rather than in ds4lib.report because it reads PosttrainReport's margins; it only
draws; the only number it computes is the correlation in the panel title, the same as the report's corr_margin.)"""
from __future__ import annotations

import numpy as np

__all__ = ["plot_margins"]


def plot_margins(margins: dict, title: str = "Margins predicted by the linear rows against a real forward"):
    """margins: PosttrainReport.margins ({"decision", "group", "before", "predicted", "real"}, one entry per row).
    Left: predicted (lattice δ) against real margin after the ③ for every row (each position against each of its
    captured rivals), decision points and other positions apart, the diagonal drawn; without real margins (a
    rejected, unverified candidate) predicted against before instead. Right: before → after per decision point, its
    row against the strongest rival (the token the model wrote)."""
    import matplotlib.pyplot as plt
    if not margins or "predicted" not in margins:
        raise ValueError("plot_margins needs a PosttrainReport's margins (predicted margins per row)")
    dec = np.asarray(margins["decision"], bool)
    before = np.asarray(margins["before"], np.float64)
    pred = np.asarray(margins["predicted"], np.float64)
    real = None if margins.get("real") is None else np.asarray(margins["real"], np.float64)
    y, ylabel = (real, "real margin with the ③") if real is not None else (before, "margin before (not verified)")
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.5))
    for sel, name, colour in ((~dec, "other positions (top-1 − rival)", "tab:blue"),
                              (dec, "decision points (a − rival)", "tab:red")):
        ax.scatter(pred[sel], y[sel], s=10, alpha=0.7, color=colour, label=f"{name}: {int(sel.sum())}")
    lo, hi = float(min(pred.min(), y.min())), float(max(pred.max(), y.max()))
    ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8)
    ax.axhline(0, color="black", lw=0.5)
    ax.axvline(0, color="black", lw=0.5)
    corr = float(np.corrcoef(pred, y)[0, 1]) if len(pred) > 1 and np.std(pred) > 0 and np.std(y) > 0 else np.nan
    ax.set(xlabel="predicted margin (FP4 lattice δ)", ylabel=ylabel, title=f"all rows, correlation {corr:.4f}")
    ax.legend(fontsize=8)
    group = np.asarray(margins.get("group", np.arange(len(dec))))
    first = dec & np.r_[True, group[1:] != group[:-1]]
    after = (real if real is not None else pred)[first]
    order = np.argsort(before[first])
    x = np.arange(int(first.sum()))
    bx.vlines(x, before[first][order], after[order], color="tab:red", lw=1)
    bx.scatter(x, before[first][order], s=12, color="grey", label="before")
    bx.scatter(x, after[order], s=12, color="tab:red", label="after (real)" if real is not None else "predicted")
    bx.axhline(0, color="black", lw=0.5)
    bx.set(xlabel="decision point (sorted by margin before)", ylabel="margin ℓ_a − ℓ_b",
           title=f"decision points: {int((after > 0).sum())} of {int(first.sum())} above the written token after")
    bx.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig

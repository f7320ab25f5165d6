"""Plots of the ② sidecar solve (notebooks/sidecar.ipynb). Each function takes rows that ds4lib.sidecar returned
(SidecarReport.layers, compare_stacks) and returns a matplotlib Figure; nothing is computed here."""
from __future__ import annotations

import numpy as np

__all__ = ["plot_sidecar_layers", "plot_lambda_curves", "plot_stack_comparison"]


def _plt():
    import matplotlib.pyplot as plt
    return plt


def plot_sidecar_layers(layers, gate: float, title: str = "Per-layer held-out gain and router same-set rate"):
    """Bars: held-out gain per layer (filled = mounted), the gate as a line; right: same-set rate before/after Δb."""
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    x = np.array([r["layer"] for r in layers])
    gain = np.array([100 * (r.get("heldout_gain") or 0) for r in layers])
    mounted = np.array([bool(r["gains"]) for r in layers])
    a1.bar(x[mounted], gain[mounted], color="C0", label="mounted")
    a1.bar(x[~mounted], gain[~mounted], color="none", edgecolor="C0", hatch="//", label="not mounted")
    a1.axhline(100 * gate, color="k", ls=":", lw=1, label=f"gate {100 * gate:g}%")
    for r, g in zip(layers, gain):
        if r.get("lam") is not None:
            a1.annotate(f"λ={r['lam']:g}", (r["layer"], g), textcoords="offset points", xytext=(0, 3), ha="center",
                        fontsize=7)
    a1.set_xlabel("layer")
    a1.set_ylabel("held-out gain, % of ‖y − y_orig‖²")
    a1.set_title(title, fontsize=10)
    have = [r for r in layers if "same_set_before" in r]
    if have:
        xs = np.array([r["layer"] for r in have])
        a2.bar(xs - 0.2, [100 * r["same_set_before"] for r in have], 0.4, label="before Δb")
        a2.bar(xs + 0.2, [100 * r["same_set_after"] for r in have], 0.4, label="after Δb (kept only if better)")
        for r in have:
            if r.get("alpha") is not None:
                a2.annotate(f"α={r['alpha']:g}", (r["layer"] + 0.2, 100 * r["same_set_after"]),
                            textcoords="offset points", xytext=(0, 3), ha="center", fontsize=7)
    a2.set_xlabel("layer")
    a2.set_ylabel("held-out same-set rate, %")
    a2.set_title("router: our chosen set == the original's", fontsize=10)
    for a in (a1, a2):
        a.grid(alpha=0.3, axis="y")
        a.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_lambda_curves(layers, title: str = "Held-out gain against the ridge λ"):
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for r in layers:
        rows = r.get("lambda_rows")
        if rows:
            ax.semilogx([x["lam"] for x in rows], [100 * x["heldout_gain"] for x in rows], "o-", ms=3,
                        label=f"layer {r['layer']}")
    ax.set_xlabel("λ")
    ax.set_ylabel("held-out gain, %")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def plot_stack_comparison(rows, title: str = "Bare base vs base + sidecar"):
    """rows: compare_stacks output. Same top-1, Σmin mean and mean KL per slice and stack."""
    plt = _plt()
    slices = list(dict.fromkeys(r["slice"] for r in rows))
    stacks = list(dict.fromkeys(r["stack"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    w = 0.8 / len(stacks)
    x = np.arange(len(slices))
    for ax, (key, label, scale) in zip(axes, (("same_top1", "Same top-1, %", 100),
                                              ("sigma_min_mean", "Σmin mean", 1), ("kl_mean", "mean KL", 1))):
        for k, st in enumerate(stacks):
            vals = [next(r[key] for r in rows if r["slice"] == s and r["stack"] == st) * scale for s in slices]
            ax.bar(x + (k - (len(stacks) - 1) / 2) * w, vals, w, label=st)
        ax.set_xticks(x, [str(s).split("/")[-2] + "/" + str(s).split("/")[-1] if "/" in str(s) else str(s)
                          for s in slices], fontsize=8)
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig

"""Plots of the base quantizer's measurements (notebooks/quantize.ipynb). Each function takes the rows that a
ds4lib.quant function returned and returns a matplotlib Figure; nothing is computed here."""
from __future__ import annotations

import numpy as np

__all__ = ["plot_layer_errors", "plot_bitwidth_curve", "plot_shared_vs_per_expert", "size_table_markdown"]


def _plt():
    import matplotlib.pyplot as plt
    return plt


def plot_layer_errors(layer_rows, title: str = "Relative error per layer and matrix (routed experts)"):
    """layer_rows: QuantReport.layer_rows() dicts (layer, kind, bits, w1, w2, w3, all)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 3.6))
    layers = np.array([r["layer"] for r in layer_rows])
    for k, (m, mk) in enumerate((("w1", "o"), ("w2", "s"), ("w3", "^"))):
        ax.plot(layers + (k - 1) * 0.12, [r[m] for r in layer_rows], mk, label=m, ms=5)
    ax.plot(layers, [r["all"] for r in layer_rows], "k-", lw=1, label="layer")
    for r in layer_rows:
        ax.annotate(f"{r['bits']}b", (r["layer"], r["all"]), textcoords="offset points", xytext=(0, 8),
                    ha="center", fontsize=7)
    ax.set_xlabel("layer (DSpark stages after the backbone)")
    ax.set_ylabel("relative error  ||W - W_q|| / ||W||")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=4)
    fig.tight_layout()
    return fig


def plot_bitwidth_curve(rows, title: str = "Bit-width curve: one shared codebook per layer"):
    """rows: ds4lib.quant.bitwidth_curve output."""
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for layer in sorted({r["layer"] for r in rows}):
        rr = sorted((r for r in rows if r["layer"] == layer), key=lambda r: r["bits"])
        b = [r["bits"] for r in rr]
        e = [r["all"] for r in rr]
        a1.plot(b, e, "o-", label=f"layer {layer}")
        a2.plot(b[1:], [e[i - 1] / e[i] for i in range(1, len(e))], "o-", label=f"layer {layer}")
    bits = sorted({r["bits"] for r in rows})
    a1.set_xticks(bits)
    a2.set_xticks(bits[1:])
    a1.set_xlabel("codebook bits (index width)")
    a1.set_ylabel("relative error")
    a1.set_title(title, fontsize=10)
    a2.axhline(1.189, color="k", ls=":", lw=1, label="seed: 1.189 per bit")
    a2.set_xlabel("codebook bits")
    a2.set_ylabel("error(b-1) / error(b)")
    a2.set_title("gain per extra bit", fontsize=10)
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_shared_vs_per_expert(rows, title: str = "One codebook per layer vs one per expert"):
    """rows: ds4lib.quant.shared_vs_per_expert output."""
    plt = _plt()
    layers = sorted({r["layer"] for r in rows})
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.4))
    w = 0.38
    x = np.arange(len(layers))
    for k, scheme in enumerate(("shared per layer", "one per expert")):
        rr = [next(r for r in rows if r["layer"] == layer and r["scheme"] == scheme) for layer in layers]
        a1.bar(x + (k - 0.5) * w, [r["all"] for r in rr], w, label=scheme)
        a2.bar(x + (k - 0.5) * w, [r["bits_per_weight"] for r in rr], w, label=scheme)
    for a, yl in ((a1, "relative error"), (a2, "bits per routed weight (incl. codebooks, gains)")):
        a.set_xticks(x, [f"layer {layer}" for layer in layers])
        a.set_ylabel(yl, fontsize=9)
        a.grid(alpha=0.3, axis="y")
        a.legend(fontsize=8, loc="lower right")
    a1.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def size_table_markdown(table: dict):
    """The size table (ds4lib.quant.size_table) as Markdown, GB = 1e9 bytes."""
    from ds4lib.report.summary import markdown_table
    rows = [{"part": r["part"], "format": r["format"], "bytes": f"{r['bytes']:,}", "GB": r["gb"]}
            for r in table["rows"]]
    rows.append({"part": "**Total**", "format": f"{table['bits_per_weight']:.3f} bits/weight overall, "
                 f"{table['routed_bits_per_weight']:.3f} per routed weight", "bytes": f"{table['total_bytes']:,}",
                 "GB": table["total_gb"]})
    return markdown_table(rows, ["part", "format", "bytes", "GB"], floatfmt=".4f")

"""The ② sidecar tables of BENCHMARKS.md from the executed sidecar reports' JSON summaries.

    .venv/bin/python bench/sidecar_table.py papermill_runs/sidecar__domain=*__20261201-*.json

Prints (markdown): per domain, bare ① base vs base + its own sidecar on its judging slice and on general English
(Same top-1, Σmin mean / median / p5, mean KL, PPL ratio) with the targets' deltas; the 5 × 6 table of Same top-1
change and KL change of every sidecar on every judging slice; and the solve's own figures per domain.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

SLICES = ("finance", "code", "law", "medicine", "science", "english")


def load(paths):
    out = {}
    for p in paths:
        r = json.loads(Path(p).read_text())
        dom = r["params"]["domain"]
        rows = {(x["slice"].split("/")[0], x["stack"]): x for x in r["results"]["compare"]}
        out[dom] = {"rows": rows, "solve": r["results"]["solve"], "mounted": r["results"]["mounted"],
                    "biased": r["results"]["biased"], "file": Path(p).name}
    return out


def fmt(x, pct=False):
    return f"{100 * x:.2f} %" if pct else f"{x:.3f}"


def main(paths):
    doms = load(paths)
    print("| domain | slice | stack | Same top-1 | Σmin mean / median / p5 | mean KL | PPL ratio |")
    print("|---|---|---|---|---|---|---|")
    for d, r in doms.items():
        for sl in (d, "english"):
            b, s = r["rows"][(sl, "base")], r["rows"][(sl, "base+sidecar")]
            for label, x in (("① alone", b), (f"① + {d} sidecar", s)):
                delta = ""
                if x is s:
                    delta = (f" ({100 * (s['same_top1'] - b['same_top1']):+.2f} pp)", f" ({100 * (s['kl_mean'] / b['kl_mean'] - 1):+.1f} %)")
                print(f"| {d} | {sl} | {label} | {fmt(x['same_top1'], True)}{delta[0] if delta else ''} | "
                      f"{fmt(x['sigma_min_mean'])} / {fmt(x['sigma_min_median'])} / {fmt(x['sigma_min_p5'])} | "
                      f"{fmt(x['kl_mean'])}{delta[1] if delta else ''} | {fmt(x['ppl_ratio'])} |")
    print()
    print("| sidecar \\ judging slice | " + " | ".join(SLICES) + " |")
    print("|---|" + "---|" * len(SLICES))
    for d, r in doms.items():
        cells = []
        for sl in SLICES:
            b, s = r["rows"].get((sl, "base")), r["rows"].get((sl, "base+sidecar"))
            cells.append("—" if b is None else f"{100 * (s['same_top1'] - b['same_top1']):+.2f} pp / "
                                               f"{100 * (s['kl_mean'] / b['kl_mean'] - 1):+.1f} %")
        print(f"| {d} | " + " | ".join(cells) + " |")
    print()
    print("| domain | fixture s | solve s | bytes | gains on layers | router bias on layers | λ per layer | held-out gain per layer |")
    print("|---|---|---|---|---|---|---|---|")
    for d, r in doms.items():
        s = r["solve"]
        gains = " ".join("%.1f" % (100 * l["heldout_gain"]) for l in s["layers"])
        print(f"| {d} | {s['fixture_seconds']:.0f} | {s['solve_seconds']:.0f} | {s['bytes']:,} | "
              f"{','.join(map(str, r['mounted']))} | {','.join(map(str, r['biased']))} | "
              f"{' '.join(str(l['lam']) for l in s['layers'])} | "
              f"{gains} % |")


if __name__ == "__main__":
    main(sys.argv[1:])

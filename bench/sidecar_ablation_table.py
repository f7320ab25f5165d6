"""Markdown table of `bench/sidecar_ablations.sh`'s results (bench/results/sidecar_ablations_<domain>.json).

    .venv/bin/python bench/sidecar_ablation_table.py bench/results/sidecar_ablations_finance.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

LABELS = {"default": "default (Δb + lattice-direct gains, shared-energy ridge, 0.5 % gate)",
          "gains_only": "gains only (no Δb)", "float_then_round": "float-then-round gains",
          "own_ridge": "per-expert ridge energy", "no_gate": "no gate (every layer mounted)"}


def main(path):
    r = json.loads(Path(path).read_text())
    bare = r["bare"]["eval"]["slices"]
    names = list(bare)
    print("| variant | bytes | gains / Δb layers | solve s | " + " | ".join(
        f"{n.split('/')[0]} Same top-1 | {n.split('/')[0]} KL" for n in names) + " |")
    print("|---|---|---|---|" + "---|---|" * len(names))
    cells = " | ".join(f"{100 * bare[n]['same_top1']:.2f} % | {bare[n]['kl_mean']:.3f}" for n in names)
    print(f"| bare ① base | — | — | — | {cells} |")
    for v, label in LABELS.items():
        if v not in r:
            continue
        x, sl = r[v], r[v]["eval"]["slices"]
        cells = " | ".join(f"{100 * sl[n]['same_top1']:.2f} % ({100 * (sl[n]['same_top1'] - bare[n]['same_top1']):+.2f} pp) | "
                           f"{sl[n]['kl_mean']:.3f} ({100 * (sl[n]['kl_mean'] / bare[n]['kl_mean'] - 1):+.1f} %)"
                           for n in names)
        print(f"| {label} | {x['bytes']:,} | {len(x['mounted'])} / {len(x['biased'])} | {x['wall_seconds']:.0f} | {cells} |")


if __name__ == "__main__":
    main(sys.argv[1])

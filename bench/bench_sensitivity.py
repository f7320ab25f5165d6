"""How chaotic is ds4-tiny's forward? Perturb the CPU reference by one BF16 ulp at a few elements and count how many
top-1 choices move: the floor under any CUDA-vs-CPU agreement figure whose arithmetic is not bit-identical.

    python bench/bench_sensitivity.py [--windows 2] [--fractions 1e-5,1e-4,1e-3] [--slices english,code]

For each judging window (BOS + 511 tokens of each slice's judge split, english and code by default) the CPU backend runs once as is and once
per fraction f with the output of the first mHC post-mix of the forward (layer 0, after attention: [T, 4, D]) moved
by one BF16 ulp at a random f of its elements (seeded). Prints one JSON line per (window, fraction): top-1
agreement with the unperturbed run, mean |Δlogit|, the unperturbed run's median top-1 margin, the agreement
where that margin is >= 0.5 logits, and the unperturbed margins at the positions that moved.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from ds4lib.corpus.slices import load_slice  # noqa: E402
from ds4lib.engine import Engine  # noqa: E402
from ds4lib.eval.sensitivity import first_post_mix_perturbed  # noqa: E402

NEAR_TIE = 0.5


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default=str(ROOT / "cache" / "ds4-tiny-base.gguf"))
    ap.add_argument("--engram-dir", default=str(ROOT / "models" / "ds4-tiny"))
    ap.add_argument("--windows", type=int, default=2, help="windows per slice")
    ap.add_argument("--fractions", default="1e-5,1e-4,1e-3")
    ap.add_argument("--slices", default="english,code", help="judging slices (domain names)")
    args = ap.parse_args(argv)
    eng = Engine(args.base, engram_dir=args.engram_dir, tokenizer_path=ROOT / "data" / "tokenizer" / "tokenizer.json")
    for name in (f"{d}/judge" for d in args.slices.split(",")):
        for wi, w in enumerate(load_slice(name).tokens[:args.windows]):
            seq = [0] + [int(t) for t in w[:-1]]
            a = eng.logits(seq)
            ta = a.argmax(-1)
            top2 = np.sort(a, -1)[:, -2:]
            margin = top2[:, 1] - top2[:, 0]
            for frac in (float(f) for f in args.fractions.split(",")):
                with first_post_mix_perturbed(frac, 1000 + wi):
                    b = eng.logits(seq)
                tb = b.argmax(-1)
                moved = np.nonzero(ta != tb)[0]
                clear = margin >= NEAR_TIE
                print(json.dumps({
                    "slice": name, "window": wi, "positions": len(seq), "fraction": frac,
                    "elements_moved": int(round(frac * 4 * eng.cfg.dim * len(seq))),
                    "same_top1": round(float((ta == tb).mean()), 5), "mean_abs_logit_diff": round(float(
                        np.abs(a - b).mean()), 5), "median_top1_margin": round(float(np.median(margin)), 4),
                    "same_top1_not_near_tie": round(float((ta == tb)[clear].mean()), 5),
                    "moved_margin_p50_max": [round(float(v), 4) for v in np.percentile(margin[moved], [50, 100])]
                    if len(moved) else None}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

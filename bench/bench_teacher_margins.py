"""Perplexity and top-1 margins of the original model (`ds4lib.ref` on the checkpoint) on the judging slices, from
the same teacher logits the five numbers use (`ds4lib.eval.teacher`, cached per window; computed when missing).

Each window is fed as the five-number scorer feeds it: BOS + its first T - 1 tokens, every window token predicted.
Margin = top-1 minus top-2 logit at each position (a small margin is a near-tie: there, any backend or
quantisation difference flips the top-1).

    .venv/bin/python bench/bench_teacher_margins.py --out bench/results/teacher_margins_v2.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from ds4lib.config import Env
from ds4lib.corpus.slices import load_slice
from ds4lib.eval.slices import BOS
from ds4lib.eval.teacher import Teacher

DOMAINS = ("finance", "code", "law", "medicine", "science", "english")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=Path("models/ds4-tiny"))
    ap.add_argument("--slices", default=",".join(DOMAINS))
    ap.add_argument("--windows", type=int, default=None)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    t0 = time.time()
    teacher = Teacher(args.model, Path(Env.read().cache_dir) / "teacher")
    res = {}
    for d in args.slices.split(","):
        nll, margin = [], []
        for w in load_slice(f"{d}/judge").tokens[:args.windows]:
            seq = np.concatenate([[BOS], w]).astype(np.int64)
            lg = teacher.logits(seq[:-1]).astype(np.float64)
            mx = lg.max(-1, keepdims=True)
            lse = mx[:, 0] + np.log(np.exp(lg - mx).sum(-1))
            nll.append(lse - lg[np.arange(len(lg)), seq[1:]])
            top2 = np.partition(lg, -2, axis=-1)[:, -2:]
            margin.append(top2[:, 1] - top2[:, 0])
        nll, margin = np.concatenate(nll), np.concatenate(margin)
        res[d] = {"positions": int(len(nll)), "ppl": round(float(np.exp(nll.mean())), 3),
                  "median_margin": round(float(np.median(margin)), 3),
                  "share_margin_below_0.1": round(float((margin < 0.1).mean()), 4)}
        print(d, json.dumps(res[d]), flush=True)
    rec = {"model": str(args.model), "content_hash": teacher.model_hash, "windows": args.windows,
           "seconds": round(time.time() - t0, 1), "results": res}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()

"""DSpark greedy proposal acceptance per draft position on judging text, through the reference (the original).

For each judging slice, the first W windows are read left to right by `ds4lib.ref` (prefill in chunks, DSpark
context rows appended for every processed position). At every `--every`-th position p past `--start`:
  anchor = the target's greedy token for p + 1 (what a speculative round has just verified);
  drafts d_1..d_B = dspark_propose(state, anchor, p) (greedy drafts);
  the target's own greedy continuation g_1..g_B after [text <= p, anchor] (B one-token decode steps on a copy);
  accepted length = the number of leading j with d_j == g_j — exactly what greedy verification accepts.
Reported per slice and overall: a_j = share of rounds whose first j drafts are all accepted, mean accepted
length and tokens per round (1 + mean accepted), as greedy speculative decoding with this draft would see them.

    .venv/bin/python bench/bench_dspark_acceptance.py --windows 2 --every 16 --out bench/results/dspark_acceptance_v2.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from ds4lib.corpus.slices import load_slice
from ds4lib.ref import ReferenceModel

DOMAINS = ("finance", "code", "law", "medicine", "science", "english")


def rounds_of_window(m: ReferenceModel, ids: np.ndarray, start: int, every: int):
    cfg = m.cfg
    B = cfg.dspark_block_size
    st = m.new_state()
    done = 0
    out = []
    for p in range(start, len(ids) - 1, every):
        chunk = ids[done:p + 1]
        fo = m.forward(chunk, st)
        m.dspark_append(st, fo.features, np.arange(done, p + 1))
        done = p + 1
        anchor = int(fo.logits[-1].argmax())
        prop = m.dspark_propose(st, anchor, p)
        s2 = st.copy()
        g, tok = [], anchor
        for _ in range(B):
            tok = int(m.forward(np.array([tok]), s2, last_only=True).logits[-1].argmax())
            g.append(tok)
        d = [int(t) for t in prop.tokens[1:]]
        acc = 0
        while acc < B and d[acc] == g[acc]:
            acc += 1
        out.append(acc)
    return out


def summarise(acc: list, B: int) -> dict:
    a = np.asarray(acc)
    return {"rounds": int(len(a)), "a_j": [round(float((a >= j).mean()), 4) for j in range(1, B + 1)],
            "mean_accepted": round(float(a.mean()), 4), "tokens_per_round": round(1 + float(a.mean()), 4)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=Path("models/ds4-tiny"))
    ap.add_argument("--slices", default=",".join(DOMAINS))
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--start", type=int, default=32)
    ap.add_argument("--every", type=int, default=16)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    m = ReferenceModel.load(args.model)
    B = m.cfg.dspark_block_size
    t0 = time.time()
    res, allacc = {}, []
    for d in args.slices.split(","):
        toks = load_slice(f"{d}/judge").tokens[:args.windows]
        acc = [a for w in toks for a in rounds_of_window(m, np.asarray(w, np.int64), args.start, args.every)]
        res[d] = summarise(acc, B)
        allacc += acc
        print(d, json.dumps(res[d]), flush=True)
    res["all"] = summarise(allacc, B)
    rec = {"model": str(args.model), "content_hash": m.reader.content_hash(), "windows": args.windows,
           "start": args.start, "every": args.every, "block": B, "seconds": round(time.time() - t0, 1),
           "results": res}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rec, indent=1))
    print("all", json.dumps(res["all"]), f"{rec['seconds']} s")


if __name__ == "__main__":
    main()

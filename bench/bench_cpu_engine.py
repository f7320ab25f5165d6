"""CPU engine speed on ds4-tiny: prefill tokens/s (one 512-token window after BOS, blocks of 512) and greedy decode
tokens/s (64 tokens), with the CPU backend. Prints one JSON line.

    .venv/bin/python bench/bench_cpu_engine.py --base cache/ds4-tiny-base.gguf --engram-dir models/ds4-tiny
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from ds4lib.corpus.slices import load_slice
from ds4lib.engine import Engine, SamplingParams


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="cache/ds4-tiny-base.gguf")
    ap.add_argument("--engram-dir", default="models/ds4-tiny")
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    eng = Engine(args.base, engram_dir=args.engram_dir)
    ids = [0] + load_slice("english/judge").tokens[0].tolist()
    eng.logits(ids[:16])                                   # materialise the dequantised layers once
    pre, dec = [], []
    for _ in range(args.repeats):
        s = eng.new_session()
        t = time.perf_counter()
        eng.prefill(s, ids)
        pre.append(len(ids) / (time.perf_counter() - t))
        t = time.perf_counter()
        n = sum(1 for _ in eng.generate_ids(ids[:32], SamplingParams(temperature=0, max_tokens=args.decode)))
        dec.append(n / (time.perf_counter() - t))
    print(json.dumps({"bench": "cpu_engine", "model": args.base, "cores": os.cpu_count(),
                      "prefill_tokens": len(ids), "prefill_tok_s": max(pre), "decode_tok_s": max(dec),
                      "decode_tokens": args.decode, "load_avg": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()

"""Where a speculative round's time goes on a backend (issue 13): the engine's speculative generation with every
backend call it makes (propose, mark, forward, to_host, accept_rows, rollback, append_context, sample) and the host
acceptance (speculative.verify_rows, the CPU path) timed with the stream synchronised after each, summed per call
kind over one long generation after a warm-up generation of the same prompt.

    python bench/dev/spec_round_profile.py --cuda [--temps 0,1] [-n 256] [--draft-k 4] [--out FILE.json]

Prints a JSON object per temperature: seconds and calls per kind, rounds, plain steps, tokens/s. The synchronisation
adds a little to each call; the per-kind split is what it is for, not the absolute speed.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

from ds4lib.corpus.slices import load_slice
from ds4lib.engine import Engine, SamplingParams
from ds4lib.engine import speculative

KINDS = ("propose", "mark", "forward", "to_host", "accept_rows", "rollback", "append_context", "sample")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=Path("models/ds4-tiny-base.gguf"))
    ap.add_argument("--engram-dir", type=Path, default=Path("models/ds4-tiny"))
    ap.add_argument("--cuda", action="store_true")
    ap.add_argument("--temps", default="0,1")
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("--draft-k", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    engine = Engine(args.model, engram_dir=args.engram_dir, backend="cuda" if args.cuda else "cpu")
    if args.cuda:
        engine.warm_up()
    be = engine.backend
    sync = (lambda: be.stream.synchronize()) if args.cuda else (lambda: None)
    spent, calls = defaultdict(float), defaultdict(int)

    def wrap(obj, name, kind):
        real = getattr(obj, name)

        def timed(*a, **k):
            sync()
            t = time.perf_counter()
            out = real(*a, **k)
            sync()
            spent[kind] += time.perf_counter() - t
            calls[kind] += 1
            return out
        setattr(obj, name, timed)
    for k in KINDS:
        if callable(getattr(be, k, None)):
            wrap(be, k, k)
    wrap(speculative, "verify_rows", "verify_rows (host)")
    ids = [int(t) for t in load_slice("english/judge").tokens[0][:48]]
    results = []
    for temp in (float(t) for t in args.temps.split(",")):
        p = SamplingParams(temperature=temp, max_tokens=args.n, draft_k=args.draft_k, seed=1)
        list(engine.generate_ids(ids, p))                          # warm-up: captures, scratch
        spent.clear()
        calls.clear()
        t = time.perf_counter()
        toks = list(engine.generate_ids(ids, p))
        wall = time.perf_counter() - t
        st = engine.last_spec_stats
        rec = {"temperature": temp, "tokens": len(toks), "wall_s": round(wall, 4), "tok_s": round(len(toks) / wall, 1),
               "rounds": st.rounds, "plain_steps": st.plain_steps, "tokens_per_round": round(st.tokens_per_round, 3),
               "ms": {k: round(v * 1e3, 2) for k, v in sorted(spent.items(), key=lambda kv: -kv[1])},
               "calls": dict(calls), "stats": dict(be.stats) if hasattr(be, "stats") else {}}
        rec["ms"]["untimed (engine, scheduler, prefill)"] = round((wall - sum(spent.values())) * 1e3, 2)
        results.append(rec)
        print(json.dumps(rec), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""`ds4 score -m FILE (--tokens 1,2,3 | --text "...") [--zchain DIR] [--score-split P] [--json]`: teacher-forced
log-probabilities through the serving paths (prefill; with --score-split P the first P tokens by prefill and the
rest one token at a time through the decode path)."""
from __future__ import annotations

import json
import math
import sys

import numpy as np

from ds4lib.tools.argtypes import int_at_least
from ds4lib.tools.engine_args import add_engine_args, open_engine

__all__ = ["register"]


def _run(args) -> int:
    from ds4lib.engine import EngineError
    try:
        if args.tokens:
            try:
                ids = [int(t) for t in args.tokens.replace(",", " ").split()]
            except ValueError:
                raise EngineError(f"--tokens {args.tokens!r}: give integer token ids, comma or space separated") \
                    from None
        engine = open_engine(args)
        if not args.tokens:
            ids = [0] + engine.encode(args.text)
        if len(ids) < 2:
            raise EngineError("scoring needs at least two tokens")
        lp = engine.score(ids, split=args.score_split)
    except (EngineError, ValueError) as e:
        print(f"ds4 score: {e}", file=sys.stderr)
        return 2
    rec = {"tokens": ids, "logprobs": [float(x) for x in lp], "nll_mean": float(-np.mean(lp)),
           "ppl": float(math.exp(-np.mean(lp))), "split": args.score_split}
    if args.json:
        print(json.dumps(rec))
    else:
        for t, x in zip(ids[1:], lp):
            print(f"{t:>7} {x:10.4f}  {engine.tokenizer.decode([t])!r}")
        print(f"mean NLL {rec['nll_mean']:.4f}  PPL {rec['ppl']:.3f}  ({len(lp)} tokens)")
    return 0


def register(sub):
    p = sub.add_parser("score", help="teacher-forced log-probabilities through the engine")
    add_engine_args(p)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--tokens", help="token ids, comma or space separated")
    g.add_argument("--text", help="text (BOS is prepended)")
    p.add_argument("--score-split", type=int_at_least(0), default=None, help="prefill P tokens, decode the rest one by one")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_run)

"""A ③ post-training file on held-out requests: do the decisions it was not solved on move?

    .venv/bin/python bench/bench_posttrain.py --base models/ds4-tiny-base.gguf --zchain models/sidecars/finance \
        --posttrain DIR --requests data/posttrain/general/day-5.jsonl [--requests ...] [--out FILE.json]

For each request, through the same path `ds4 posttrain` uses (chat-encoded prompt, greedy answer of the ① + ②
stack up to the right answer's length, ds4lib.posttrain.solve's text-aware judge): the first position where the
answer leaves the right one is its decision point (right token a). Then, with the ③ mounted, the logits of that
same row (the same prefix, the generated part through the decode path) say whether a is now the top token, and a
fresh greedy answer says whether the whole answer is now right or where it now leaves. Requests already right
without the ③ are counted and checked to stay right. Prints one JSON line per requests file.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main(argv=None) -> int:
    from ds4lib.engine import Engine
    from ds4lib.posttrain.solve import _greedy, _judge, _tokenise, read_requests
    from ds4lib.tokenizer import TextEncoder
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", required=True)
    p.add_argument("--zchain", required=True)
    p.add_argument("--posttrain", required=True)
    p.add_argument("--requests", action="append", required=True)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    two = Engine(a.base, zchain=a.zchain)
    three = Engine(a.base, zchain=a.zchain, posttrain=a.posttrain)
    enc = TextEncoder(two.tokenizer)
    rows = []
    for path in a.requests:
        t0 = time.perf_counter()
        items = _tokenise(two, enc, read_requests(path))
        n_dec = flipped = right_before = right_after = kept_right = 0
        for it in items:
            gen = _greedy(two, it.prompt_ids, len(it.answer_ids))
            v = _judge(two, enc, gen, it.answer_ids)
            after = _greedy(three, it.prompt_ids, len(it.answer_ids))
            now_right = _judge(three, enc, after, it.answer_ids).j is None
            right_after += int(now_right)
            if v.j is None:
                right_before += 1
                kept_right += int(now_right)
                continue
            if v.skip:
                continue
            n_dec += 1
            prefix = list(it.prompt_ids) + gen[:v.j]
            row = three.logits(prefix, split=len(it.prompt_ids))[-1]
            flipped += int(int(np.argmax(row)) == v.a)
        rows.append({"requests": path, "n": len(items), "decision_points": n_dec, "flipped_with_posttrain": flipped,
                     "right_before": right_before, "right_after": right_after, "right_kept": kept_right,
                     "seconds": round(time.perf_counter() - t0, 1), "posttrain": a.posttrain, "zchain": a.zchain})
        print(json.dumps(rows[-1]), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A ③ post-training file on held-out requests: do the decisions it was not solved on move?

    .venv/bin/python bench/bench_posttrain.py --base models/ds4-tiny-base.gguf --zchain models/sidecars/finance \
        --posttrain DIR --requests data/posttrain/general/day-5.jsonl [--requests ...] [--out FILE.json]

The measurement is ds4lib.posttrain.heldout.measure_requests (the same one notebooks/posttrain.ipynb shows): per
request, the greedy answer of the ① + ② stack and its decision point, whether the ③ makes the right token the top one
on that row, and whether a fresh greedy answer with the ③ is right. Prints one JSON line of counts per requests
file; --out also writes them, with the per-request rows (texts before and after), as JSON lines.
"""
from __future__ import annotations

import argparse
import json
import os


def main(argv=None) -> int:
    from ds4lib.posttrain.heldout import measure_requests
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", required=True)
    p.add_argument("--zchain", required=True)
    p.add_argument("--posttrain", required=True)
    p.add_argument("--requests", action="append", required=True)
    p.add_argument("--engram-dir", default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    effects = measure_requests(base=a.base, zchain=a.zchain, posttrain=a.posttrain, requests=a.requests,
                               engram_dir=a.engram_dir)
    for eff in effects:
        print(json.dumps({**eff.summary(), "posttrain": a.posttrain, "zchain": a.zchain}), flush=True)
    if a.out:
        tmp = a.out + ".partial"
        with open(tmp, "w") as f:
            f.write("\n".join(json.dumps({**e.as_dict(), "posttrain": a.posttrain, "zchain": a.zchain})
                              for e in effects) + "\n")
        os.replace(tmp, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

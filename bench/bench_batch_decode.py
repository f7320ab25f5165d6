"""Aggregate decode throughput of N sessions decoding at once through the engine (the server's worker loop without
HTTP): each round every session's token is fed and its next token sampled greedily on the device, either with each
session's own decode step (`alone`: what the worker did before batching) or with the round's forwards as one
Engine.decode_batch (`batched`: the backend's default capture policy, so a new set of sessions first runs its rows
alone until a capture pays, unless --capture now). Replies never end at EOS here (the sampled token is fed whatever
it is), so every round carries N rows: the steady state that short chat replies never reach.

    python bench/bench_batch_decode.py --cuda --base models/ds4-tiny-base.gguf --engram-dir models/ds4-tiny
    python bench/bench_batch_decode.py --cuda --rows 1,4,8,16 --steps 128 --capture now

One JSON line per (N, mode): rounds timed after --warm rounds, wall per round, aggregate tokens/s, captures and
batched graph replays during the timed rounds, and whether the greedy tokens of both modes are the same (they must:
a row's logits do not depend on the other rows).
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOPICS = ["ledgers", "rivers", "prime numbers", "the moon", "accounting", "bridges", "tea", "glass", "maps", "salt",
          "clocks", "paper", "bees", "iron", "music", "snow"]


class Greedy:
    temperature, top_k, top_p, min_p = 0.0, 0, 1.0, 0.0


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default=str(ROOT / "models" / "ds4-tiny-base.gguf"))
    p.add_argument("--engram-dir", default=str(ROOT / "models" / "ds4-tiny"))
    p.add_argument("--cuda", action="store_true", help="the CUDA backend (default: CPU, whose rows run one by one)")
    p.add_argument("--rows", default="1,2,4,8,16", help="comma list of session counts N")
    p.add_argument("--steps", type=int, default=96, help="timed rounds per (N, mode)")
    p.add_argument("--warm", type=int, default=8, help="untimed rounds first (graphs captured, pools filled)")
    p.add_argument("--capture", choices=("auto", "now"), default="auto", help="the CUDA backend's batch_capture")
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    return p.parse_args(argv)


def _commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run(engine, n, mode, steps, warm):
    """(seconds per timed round, generated ids [rounds][n], backend stats delta over the timed rounds)."""
    from ds4lib.chat import encode_chat
    from ds4lib.engine import PendingDecode
    be = engine.backend
    sessions, toks = [], []
    for i in range(n):
        s = engine.new_session()
        prompt = encode_chat(engine.tokenizer, [{"role": "user",
                                                  "content": f"Write a long essay about {TOPICS[i % len(TOPICS)]}."}])
        toks.append(be.sample(engine.prefill(s, prompt), Greedy, 0, 0))
        sessions.append(s)
    out = []
    stats0, t0 = None, None
    for r in range(warm + steps):
        if r == warm:
            if hasattr(be, "stream"):
                be.stream.synchronize()
            stats0, t0 = dict(getattr(be, "stats", {})), time.perf_counter()
        if mode == "alone":                            # (a decode step's logits live until the next step)
            toks = [be.sample(engine.decode(s, t), Greedy, 0, r + 1) for s, t in zip(sessions, toks)]
        else:
            pend = [PendingDecode(s, t) for s, t in zip(sessions, toks)]
            engine.decode_batch(pend)
            toks = [be.sample(p.logits(), Greedy, 0, r + 1) for p in pend]
        out.append(list(toks))
    dt = (time.perf_counter() - t0) / steps
    stats = {k: v - stats0.get(k, 0) for k, v in getattr(be, "stats", {}).items() if isinstance(v, int)}
    for s in sessions:                                   # back to the pool (the next N reuses their graphs)
        if hasattr(be, "release_state"):
            be.release_state(s.state)
    return dt, out, stats


def main(argv=None):
    args = _args(argv)
    from ds4lib.engine import Engine
    engine = Engine(args.base, engram_dir=args.engram_dir, backend="cuda" if args.cuda else "cpu",
                    prefix_cache_mb=0)
    engine.warm_up()
    be = engine.backend
    if args.cuda:
        be.batch_capture = args.capture
        be.pool_size = max(be.pool_size, max(int(x) for x in args.rows.split(",")))
    meta = {"bench": "batch_decode", "backend": be.name, "base": args.base, "capture": args.capture if args.cuda
            else None, "date": datetime.date.today().isoformat(), "commit": _commit()}
    lines = []
    for n in (int(x) for x in args.rows.split(",")):
        ids = {}
        for mode in ("alone", "batched"):
            dt, ids[mode], stats = run(engine, n, mode, args.steps, args.warm)
            rec = dict(meta, rows=n, mode=mode, rounds=args.steps, ms_per_round=round(dt * 1e3, 3),
                       aggregate_tok_s=round(n / dt, 1), captures=stats.get("graph_captures"),
                       batch_graph_replays=stats.get("batch_graph_replays"),
                       same_tokens=None if mode == "alone" else ids["alone"] == ids["batched"])
            print(json.dumps(rec), flush=True)
            lines.append(json.dumps(rec))
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

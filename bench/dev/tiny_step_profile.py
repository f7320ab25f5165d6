"""Where a ds4-tiny decode step's wall time goes on the CUDA backend (issue 12's ds4-tiny target): one JSON line per
figure on stdout.

- `loop`: greedy decode as `ds4 -p` runs it (Engine.decode, then the device sampler reads back the token), ms per
  token, split into the decode call (host plan, Engram hashes and row gather, the graph launch) and the sampler
  call (which waits for the step's kernels, samples and copies the token back).
- `graph_only`: the bucket's captured graph replayed back to back (GPU time of a step, no host work between).
- `sample_only`: the sampler alone on a finished logits row; `engram_host`: the host hashes and gather alone.
(The host call sites of a step: `bench/bench_engine.py --only profile`, a cProfile of 32 steps.)

    python bench/dev/tiny_step_profile.py --base models/ds4-tiny-base.gguf --engram-dir models/ds4-tiny
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def emit(rec):
    print(json.dumps(rec), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="models/ds4-tiny-base.gguf")
    ap.add_argument("--engram-dir", default="models/ds4-tiny")
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args(argv)
    from numba import cuda

    from ds4lib.engine import Engine, SamplingParams
    eng = Engine(args.base, engram_dir=args.engram_dir, backend="cuda",
                 tokenizer_path=ROOT / "data" / "tokenizer" / "tokenizer.json")
    be = eng.backend
    p = SamplingParams(temperature=args.temperature)
    s = eng.new_session()
    lg = eng.prefill(s, [0] + list(range(100, 163)))
    tok = be.sample(lg, p, 7, 0)
    for step in range(8):                                   # warm: compile, capture the bucket's graph
        tok = be.sample(eng.decode(s, tok), p, 7, step + 1)
    cuda.synchronize()
    n = args.steps
    t_dec = t_smp = 0.0
    t0 = time.perf_counter()
    for step in range(n):
        a = time.perf_counter()
        lg = eng.decode(s, tok)
        b = time.perf_counter()
        tok = be.sample(lg, p, 7, step + 9)
        t_dec += b - a
        t_smp += time.perf_counter() - b
    wall = time.perf_counter() - t0
    emit({"figure": "loop", "steps": n, "ms_per_token": round(1e3 * wall / n, 4), "tokens_per_s": round(n / wall, 1),
          "decode_call_ms": round(1e3 * t_dec / n, 4), "sample_call_ms": round(1e3 * t_smp / n, 4),
          "stats": dict(be.stats), "temperature": args.temperature})
    graphs = [g for g in s.state.graphs.values() if g is not None]
    if graphs:
        g = graphs[0]
        cuda.synchronize()
        for reps in (50, 200):
            t0 = time.perf_counter()
            for _ in range(reps):
                g.launch()
            be.stream.synchronize()
            dt = time.perf_counter() - t0
        emit({"figure": "graph_only", "reps": reps, "ms_per_step": round(1e3 * dt / reps, 4), "nodes": g.nodes})
    cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(200):
        be.sample(lg, p, 7, i)
    emit({"figure": "sample_only", "ms": round(1e3 * (time.perf_counter() - t0) / 200, 4)})
    ids = np.array([tok], dtype=np.int64)
    hist = s.state.hist
    t0 = time.perf_counter()
    for _ in range(200):
        s.state.hist = hist
        be._engram_host(s.state, ids)
    s.state.hist = hist
    emit({"figure": "engram_host", "ms": round(1e3 * (time.perf_counter() - t0) / 200, 4)})


if __name__ == "__main__":
    main()

"""Aggregate decode throughput of a live `ds4-server` with N concurrent streaming clients (loopback, greedy):
for each N in --streams, N clients each stream one request of --tokens generated tokens (distinct short prompts,
so that no answer is shared), and tokens/s = all streamed content chunks / wall time from the first request to the
last [DONE]. Also per-request time to first token (p50, max). Prints one JSON line per N (and appends them to --out).

    .venv/bin/python bench/bench_serving.py --base cache/ds4-tiny-base.gguf --engram-dir models/ds4-tiny
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from bench.bench_prefix_cache import _start, _stop

TOPICS = ["ledgers", "rivers", "prime numbers", "the moon", "accounting", "bridges", "tea", "glass", "maps", "salt",
          "clocks", "paper", "bees", "iron", "music", "snow"]


def _stream(url, i, tokens):
    body = {"model": "bench", "messages": [{"role": "user", "content": f"Write a long essay about {TOPICS[i]}."}],
            "max_tokens": tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0, ttft, n = time.perf_counter(), None, None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ev = json.loads(line[6:])
                if ev.get("usage"):
                    n = ev["usage"]["completion_tokens"]
                elif ev["choices"] and ev["choices"][0]["delta"].get("content") and ttft is None:
                    ttft = time.perf_counter() - t0
    return ttft, n


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="cache/ds4-tiny-base.gguf")
    ap.add_argument("--engram-dir", default="models/ds4-tiny")
    ap.add_argument("--streams", default="1,4,8")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--log-dir", default="cache")
    ap.add_argument("--out", default="bench/results/serving_cpu.jsonl")
    ap.add_argument("--cuda", action="store_true", help="serve on the CUDA backend (ds4-server --cuda)")
    args = ap.parse_args(argv)
    counts = [int(x) for x in args.streams.split(",")]
    proc, url = _start(args, ["--max-running", str(max(counts)), "--prefix-cache-mb", "0"]
                       + (["--cuda"] if args.cuda else []))
    try:
        _stream(url, 0, 2)                                     # materialise the layers once
        for n in counts:
            t0 = time.perf_counter()
            with ThreadPoolExecutor(n) as pool:
                res = list(pool.map(lambda i: _stream(url, i, args.tokens), range(n)))
            wall = time.perf_counter() - t0
            total = sum(r[1] for r in res)
            ttfts = [r[0] for r in res if r[0] is not None]
            rec = {"bench": "serving_streams", "model": args.base, "backend": "cuda" if args.cuda else "cpu",
                   "cores": os.cpu_count(), "streams": n,
                   "tokens_per_stream": args.tokens, "generated_tokens": total, "wall_s": wall,
                   "aggregate_tok_s": total / wall, "ttft_p50_s": statistics.median(ttfts), "ttft_max_s": max(ttfts),
                   "load_avg": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d")}
            print(json.dumps(rec), flush=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(rec) + "\n")
    finally:
        _stop(proc)


if __name__ == "__main__":
    main()

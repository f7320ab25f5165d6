"""Time to first token of the second turn of a long conversation, cold (no prefix cache) against warm (the first
turn's session cached), through a live `ds4-server` on loopback (streamed /v1/chat/completions, greedy).

The first user message is about --tokens tokens of slice text (english/judge windows, decoded); the first turn
generates --reply tokens; the second turn appends that reply and a short question. Cold: a fresh server started
with --prefix-cache-mb 0 answers the second turn. Warm: a fresh server with the cache answers the first turn, then
the second. Prints one JSON line (and appends it to --out).

    .venv/bin/python bench/bench_prefix_cache.py --base cache/ds4-tiny-base.gguf --engram-dir models/ds4-tiny
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def _start(args, extra):
    log = open(Path(args.log_dir) / ("bench_server" + "".join(extra).replace("-", "_") + ".log"), "w")
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "-m", args.base, "--engram-dir", args.engram_dir,
                             "--port", "0", "--alias", "bench", *extra], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        m = re.search(r"listening on (http://[\d.]+:\d+)", Path(log.name).read_text())
        if m:
            try:
                if httpx.get(m.group(1) + "/health", timeout=5).status_code == 200:
                    return proc, m.group(1)
            except httpx.TransportError:
                pass
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {Path(log.name).read_text()[-2000:]}")
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not start")


def _turn(url, messages, max_tokens):
    """(seconds to the first content token, reply text, usage) of one streamed greedy request."""
    body = {"model": "bench", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0, ttft, text, usage = time.perf_counter(), None, "", None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev.get("choices", []):
                piece = ch["delta"].get("content")
                if piece:
                    ttft = ttft or time.perf_counter() - t0
                    text += piece
    return ttft, text, usage


def _stop(proc):
    proc.terminate()
    proc.wait(60)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="cache/ds4-tiny-base.gguf")
    ap.add_argument("--engram-dir", default="models/ds4-tiny")
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--reply", type=int, default=16)
    ap.add_argument("--log-dir", default="cache")
    ap.add_argument("--out", default="bench/results/prefix_cache_cpu.jsonl")
    args = ap.parse_args(argv)
    from ds4lib.corpus.slices import load_slice
    from ds4lib.tokenizer import load_tokenizer
    tok, sl = load_tokenizer(), load_slice("english/judge")
    ids = [t for w in sl.tokens for t in w.tolist()][:args.tokens]
    first = [{"role": "user", "content": tok.decode(ids)}]
    question = {"role": "user", "content": "Summarise that in one sentence."}

    proc, url = _start(args, ["--prefix-cache-mb", "1024"])
    try:
        t1, reply, u1 = _turn(url, first, args.reply)
        second = first + [{"role": "assistant", "content": reply}, question]
        warm, _, u2 = _turn(url, second, 4)
    finally:
        _stop(proc)
    proc, url = _start(args, ["--prefix-cache-mb", "0"])
    try:
        cold, _, u3 = _turn(url, second, 4)
    finally:
        _stop(proc)
    rec = {"bench": "prefix_cache_ttft", "model": args.base, "cores": os.cpu_count(),
           "first_turn_prompt_tokens": u1["prompt_tokens"], "second_turn_prompt_tokens": u2["prompt_tokens"],
           "cached_tokens_warm": u2["prompt_tokens_details"]["cached_tokens"], "ttft_first_turn_s": t1,
           "ttft_second_turn_cold_s": cold, "ttft_second_turn_warm_s": warm,
           "speedup": cold / warm if warm else None, "cold_prompt_tokens": u3["prompt_tokens"],
           "load_avg": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(rec))
    with open(args.out, "a") as f:
        f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()

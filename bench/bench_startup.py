"""Start-up cost of the CUDA engine, from fresh processes: `ds4 --cuda -p ...`'s time from spawn to its first
streamed token, and `ds4-server --cuda`'s time from spawn to a 200 from /health and its first request's latency,
with a cold kernel cache (an empty folder: every kernel compiles) or a warm one (the same folder, filled by an
earlier run).

    python bench/bench_startup.py --base models/ds4-tiny-base.gguf --engram-dir models/ds4-tiny \
        --runs cli-cold,cli-warm,server-warm [--cache DIR]

One JSON line per run: {"run", "cache_dir", "seconds" (to the first token / to ready), "first_request_s" (server),
"health" (the /health statuses seen, in order), "warm_up" (the warm-up's line)}. `-cold` runs empty the cache
folder first; `-warm` runs use what is there (run a cold one first). Needs a GPU; `--cpu` runs the same on the CPU
backend (a smoke test: nothing compiles there).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "What does 'ledger' mean?"


def _env(cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "NUMBA_CACHE_DIR")}
    env.update(DS4_KERNEL_CACHE=str(cache), PYTHONUNBUFFERED="1")
    return env


def _warm_up_line(text: str) -> str:
    m = re.search(r"(?:ds4: warming up|warm-up:).*", text)
    return m.group(0) if m else ""


def run_cli(args, cache: Path) -> dict:
    cmd = [sys.executable, "-m", "ds4lib.tools.cli", "-m", args.base, "--engram-dir", args.engram_dir, *args.backend,
           "-p", PROMPT, "--temp", "0", "-n", "8"]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=ROOT, env=_env(cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = None
    while True:
        b = p.stdout.read(1)
        if not b:
            break
        if first is None and not b.isspace():
            first = time.perf_counter() - t0
    err = p.stderr.read().decode(errors="replace")
    p.wait()
    if p.returncode:
        raise RuntimeError(f"ds4 exited with {p.returncode}:\n{err[-3000:]}")
    return {"seconds": round(first, 2) if first is not None else None, "warm_up": _warm_up_line(err)}


def _get(url: str):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def run_server(args, cache: Path) -> dict:
    log = Path(tempfile.mkstemp(suffix=".log")[1])
    cmd = [sys.executable, "-m", "server.cli", "-m", args.base, "--engram-dir", args.engram_dir, *args.backend,
           "--port", "0"]
    t0 = time.perf_counter()
    with open(log, "w") as out:
        p = subprocess.Popen(cmd, cwd=ROOT, env=_env(cache), stdout=out, stderr=subprocess.STDOUT)
    try:
        url, seen, ready = None, [], None
        while ready is None and time.perf_counter() - t0 < args.timeout:
            if p.poll() is not None:
                raise RuntimeError(f"ds4-server exited with {p.returncode}:\n{log.read_text()[-3000:]}")
            m = url or re.search(r"listening on (http://[\d.]+:\d+)", log.read_text())
            url = url or (m.group(1) if m else None)
            if url:
                code, body = _get(url + "/health")
                status = f"{code} {body.get('status')}"
                if not seen or seen[-1] != status:
                    seen.append(status)
                if code == 200:
                    ready = time.perf_counter() - t0
            time.sleep(0.1)
        if ready is None:
            raise RuntimeError(f"not ready in {args.timeout} s:\n{log.read_text()[-3000:]}")
        body = json.dumps({"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8,
                           "temperature": 0}).encode()
        req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        t1 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=args.timeout) as r:
            r.read()
        first_request = time.perf_counter() - t1
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)
    return {"seconds": round(ready, 2), "first_request_s": round(first_request, 2), "health": seen,
            "warm_up": _warm_up_line(log.read_text())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="models/ds4-tiny-base.gguf")
    ap.add_argument("--engram-dir", default="models/ds4-tiny")
    ap.add_argument("--cache", default=None, help="kernel cache folder (default: a fresh temporary one)")
    ap.add_argument("--runs", default="cli-cold,cli-warm,server-warm")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--cpu", action="store_true", help="the CPU backend (smoke test)")
    args = ap.parse_args(argv)
    args.backend = [] if args.cpu else ["--cuda"]
    cache = Path(args.cache) if args.cache else Path(tempfile.mkdtemp(prefix="ds4-kernel-cache-"))
    for name in args.runs.split(","):
        what, state = name.split("-")
        if state == "cold":
            shutil.rmtree(cache, ignore_errors=True)
        cache.mkdir(parents=True, exist_ok=True)
        res = (run_cli if what == "cli" else run_server)(args, cache)
        print(json.dumps({"run": name, "cache_dir": str(cache), **res}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

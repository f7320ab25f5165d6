"""Soak of a live `ds4-server` (issue 15 item 6): N concurrent streaming clients on loopback for a bounded time,
then a server killed mid-stream (SIGKILL) and restarted on the same `--kv-disk-dir`.

Each client keeps one conversation of up to three turns and streams its turns in a loop, alternating the OpenAI chat
and the Anthropic messages API (follow-up turns exercise the prefix cache and its disk tier). No client starts a
request after `seconds`; the soak ends when the last stream has ended, so it stops by itself (a request is also
bounded by `request_timeout`). An error is any non-200 answer (429 included), a transport failure, an error event or
a stream that ends without its final event.

Reported (one JSON line, appended to --out): requests, errors (count and the first few), time to first content
token p50/p99 (request sent -> first text delta; replies that end at once with no text are counted apart),
aggregate tokens/s (completion tokens / wall time), per-stream decode tokens/s p50, the server's RSS (VmRSS from
/proc, sampled every 0.5 s: after warm-up, peak in the first and second half, at the end) against a budget, and
prefix-cache hits. Budget = the server's own memory plan (its log line: weights + scratch + prefix cache) + the
per-request state at full context x --max-running (the plan counts one request's state) + `runtime_mb` for the
interpreter and its libraries.

Restart check: one more long stream; the server is killed with SIGKILL once its first tokens arrive; every
`*.ds4kv` file left in the disk cache (in its stack's subdirectory) is verified (magic, sizes, sha256:
`verify_entry`), a `.partial` left by a write the kill cut is reported (the restarted server removes it: its lock
died with the writer); the restarted server answers, and a follow-up of a conversation finished before the kill
resumes from the disk tier (cached tokens > 0).

    .venv/bin/python bench/bench_soak.py --clients 32 --seconds 300          # ds4-tiny ① base, CPU
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ["What is a ledger?", "Name a prime number.", "Describe the sea.", "Who wrote Hamlet?", "What is tea?",
             "How do bridges stand?", "Why is snow white?", "What is salt made of?", "How do bees fly?",
             "What is iron?", "Explain double-entry bookkeeping.", "What are maps for?"]
FOLLOW_UPS = ["Say more.", "Give an example.", "Why?"]
_PLAN = re.compile(r"weights ([\d,.]+) MB \+ per-request state at full context ([\d,.]+) MB \+ scratch ([\d,.]+) MB"
                   r"(?: \+ prefix cache ([\d,.]+) MB)?")


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path

    def rss_mb(self) -> float:
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text()
        except OSError:
            return float("nan")
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024

    def plan_mb(self) -> dict:
        m = _PLAN.search(self.log.read_text())
        num = [float(g.replace(",", "")) if g else 0.0 for g in m.groups()]
        return dict(zip(("weights", "state", "scratch", "prefix_cache"), num))

    def metric(self, name: str) -> float:
        for line in httpx.get(self.url + "/metrics", timeout=30).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return float("nan")


def start_server(base, engram_dir, log: Path, extra=(), timeout: float = 600.0) -> Server:
    out = open(log, "w")
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "-m", str(base), "--engram-dir", str(engram_dir),
                             "--port", "0", "--alias", "soak", *extra], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ds4-server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        m = re.search(r"listening on (http://[\d.]+:\d+)", log.read_text())
        if m:
            try:
                if httpx.get(m.group(1) + "/health", timeout=5).status_code == 200:
                    return Server(proc, m.group(1), log)
            except httpx.TransportError:
                pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"ds4-server did not become healthy in {timeout} s:\n{log.read_text()[-3000:]}")


def stop_server(server: Server) -> int:
    server.proc.send_signal(signal.SIGTERM)
    try:
        return server.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        return server.proc.wait()


# ---------------------------------------------------------------------------------------------- one stream
@dataclass
class Turn:
    ok: bool = False
    status: int | None = None
    error: str | None = None
    ttft: float | None = None            # request sent -> first text delta
    t_last: float | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    text: str = ""


def stream_turn(url: str, messages: list, *, api: str, max_tokens: int, timeout: float,
                on_first_token=None) -> Turn:
    """One streamed greedy turn through `api` ("openai" or "anthropic"), parsed as each API's SSE."""
    body = {"model": "soak", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    if api == "openai":
        path, body["stream_options"] = "/v1/chat/completions", {"include_usage": True}
    else:
        path = "/v1/messages"
    turn, t0, ended = Turn(), time.perf_counter(), False
    try:
        with httpx.stream("POST", url + path, json=body, timeout=timeout) as r:
            turn.status = r.status_code
            if r.status_code != 200:
                turn.error = f"HTTP {r.status_code}: {r.read()[:200]!r}"
                return turn
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    ended = True
                if not line.startswith("data: {"):
                    continue
                ev = json.loads(line[6:])
                text, ended_now = _event(ev, api, turn)
                if turn.error:
                    return turn
                ended = ended or ended_now
                if text:
                    now = time.perf_counter() - t0
                    if turn.ttft is None:
                        turn.ttft = now
                        if on_first_token is not None:
                            on_first_token()
                    turn.t_last, turn.text = now, turn.text + text
    except (httpx.HTTPError, OSError) as e:
        turn.error = f"{type(e).__name__}: {e}"
        return turn
    turn.ok = ended
    if not ended:
        turn.error = "the stream ended without its final event"
    return turn


def _event(ev: dict, api: str, turn: Turn) -> tuple:
    """(text delta, final event seen) of one SSE data object; sets turn.error on an error event."""
    if "error" in ev or ev.get("type") == "error":
        turn.error = f"error event: {json.dumps(ev)[:300]}"
        return "", False
    if api == "openai":
        if ev.get("usage"):
            turn.completion_tokens = ev["usage"]["completion_tokens"]
            turn.cached_tokens = ev["usage"]["prompt_tokens_details"]["cached_tokens"]
        return "".join(c["delta"].get("content") or "" for c in ev.get("choices", [])), False
    kind = ev.get("type")
    if kind == "message_start":
        turn.cached_tokens = ev["message"]["usage"].get("cache_read_input_tokens") or 0
    elif kind == "content_block_delta" and ev["delta"]["type"] == "text_delta":
        return ev["delta"]["text"], False
    elif kind == "message_delta":                     # the final usage: the cache read is known after the prefill
        turn.completion_tokens = ev["usage"]["output_tokens"]
        turn.cached_tokens = ev["usage"].get("cache_read_input_tokens") or turn.cached_tokens
    return "", kind == "message_stop"


# ---------------------------------------------------------------------------------------------- the soak
@dataclass
class _Tally:
    turns: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, turn: Turn):
        with self.lock:
            self.turns.append(turn)


def _client(url, i: int, stop_at: float, tally: _Tally, max_tokens: int, timeout: float):
    messages, n = [], 0
    while time.monotonic() < stop_at:
        if len(messages) >= 5:                           # three turns: start a new conversation
            messages = []
        q = QUESTIONS[(i + n) % len(QUESTIONS)] if not messages else FOLLOW_UPS[(i + n) % len(FOLLOW_UPS)]
        messages = messages + [{"role": "user", "content": q}]
        turn = stream_turn(url, messages, api=("openai", "anthropic")[(i + n) % 2], max_tokens=max_tokens,
                           timeout=timeout)
        tally.add(turn)
        n += 1
        if not turn.ok:
            messages = []
            time.sleep(0.5)                              # an error is recorded, not hammered
            continue
        messages = messages + [{"role": "assistant", "content": turn.text}]


def _pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def soak(server: Server, *, clients: int, seconds: float, max_tokens: int, max_running: int, runtime_mb: float,
         request_timeout: float = 600.0) -> dict:
    """Run the clients against `server` for `seconds` (see the module docstring); the report as a dict."""
    stream_turn(server.url, [{"role": "user", "content": "hi"}], api="openai", max_tokens=2, timeout=request_timeout)
    rss, stop_rss = [], threading.Event()
    rss_start, hits0 = server.rss_mb(), server.metric("ds4_prefix_cache_hits_total")

    def sample():
        while not stop_rss.wait(0.5):
            rss.append((time.monotonic(), server.rss_mb()))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    tally, t0 = _Tally(), time.monotonic()
    stop_at = t0 + seconds
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(lambda i: _client(server.url, i, stop_at, tally, max_tokens, request_timeout), range(clients)))
    wall = time.monotonic() - t0
    stop_rss.set()
    sampler.join()
    rss_end = server.rss_mb()
    turns = tally.turns
    ok = [t for t in turns if t.ok]
    errors = [t.error for t in turns if not t.ok]
    ttfts = [t.ttft for t in ok if t.ttft is not None]
    rates = [(t.completion_tokens - 1) / (t.t_last - t.ttft) for t in ok
             if t.ttft is not None and t.completion_tokens > 2 and t.t_last > t.ttft]
    plan = server.plan_mb()
    budget = plan["weights"] + plan["scratch"] + plan["prefix_cache"] + max_running * plan["state"] + runtime_mb
    half = t0 + wall / 2
    peak = max([r for _, r in rss] + [rss_start, rss_end])
    tokens = sum(t.completion_tokens for t in ok)
    return {"clients": clients, "seconds": seconds, "wall_s": round(wall, 1), "max_tokens": max_tokens,
            "max_running": max_running, "requests": len(turns), "completed": len(ok), "errors": len(errors),
            "error_samples": errors[:5], "no_text_replies": sum(1 for t in ok if t.ttft is None),
            "ttft_p50_s": _round(_pct(ttfts, 50)), "ttft_p99_s": _round(_pct(ttfts, 99)),
            "ttft_max_s": _round(max(ttfts) if ttfts else None), "completion_tokens": tokens,
            "aggregate_tokens_per_s": round(tokens / wall, 2), "stream_decode_tokens_per_s_p50": _round(_pct(rates, 50)),
            "prefix_cache_hits": server.metric("ds4_prefix_cache_hits_total") - hits0,
            "turns_with_cached_tokens": sum(1 for t in ok if t.cached_tokens > 0),
            "rss_mb_after_warm_up": round(rss_start, 1),
            "rss_mb_peak_first_half": round(max([r for t, r in rss if t < half] + [rss_start]), 1),
            "rss_mb_peak_second_half": round(max([r for t, r in rss if t >= half] + [rss_start]), 1),
            "rss_mb_end": round(rss_end, 1), "rss_mb_peak": round(peak, 1),
            "budget_mb": round(budget, 1), "within_budget": peak <= budget, "plan_mb": plan,
            "runtime_allowance_mb": runtime_mb}


def _round(x, nd=3):
    return None if x is None else round(x, nd)


def kill_mid_stream_and_restart(server: Server, restart, kv_dir: Path, *, max_tokens: int = 64,
                                timeout: float = 600.0) -> dict:
    """SIGKILL `server` once a long stream has sent its first tokens, verify every disk-cache file, restart it
    (`restart()` returns the new Server, which the caller stops) and check that it serves and resumes from disk."""
    from ds4lib.engine.kv_disk import KvCacheError, verify_entry
    first = [{"role": "user", "content": QUESTIONS[0]}]
    done = stream_turn(server.url, first, api="openai", max_tokens=4, timeout=timeout)   # finished: on disk
    killed = threading.Event()

    def kill():
        server.proc.send_signal(signal.SIGKILL)
        killed.set()

    cut = stream_turn(server.url, [{"role": "user", "content": "Write a long story about the sea."}],
                      api="anthropic", max_tokens=max_tokens, timeout=timeout, on_first_token=kill)
    server.proc.wait(timeout=60)
    entries, corrupt = list(kv_dir.rglob("*.ds4kv")), []
    for p in entries:
        try:
            verify_entry(p)
        except KvCacheError as e:
            corrupt.append(f"{p.name}: {e}")
    partial = [p.name for p in kv_dir.rglob(".*.partial")]
    new = restart()
    follow = first + [{"role": "assistant", "content": done.text}, {"role": "user", "content": FOLLOW_UPS[0]}]
    again = stream_turn(new.url, follow, api="openai", max_tokens=4, timeout=timeout)
    return {"killed_mid_stream": killed.is_set() and not cut.ok, "stream_error_seen_by_client": cut.error,
            "disk_entries_after_kill": len(entries), "corrupt_entries": corrupt, "partial_files_after_kill": partial,
            "partial_files_after_restart": [p.name for p in kv_dir.rglob(".*.partial")],
            "restart_serves": again.ok and done.ok, "restart_cached_tokens": again.cached_tokens,
            "restart_resumed_from_disk": again.cached_tokens > 0,
            "ok": bool(done.ok and killed.is_set() and not corrupt and again.ok and again.cached_tokens > 0)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="models/ds4-tiny-base.gguf")
    ap.add_argument("--engram-dir", default="models/ds4-tiny")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=300.0, help="no request starts after this (default 5 min)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-running", type=int, default=8)
    ap.add_argument("--prefix-cache-mb", type=float, default=256.0)
    ap.add_argument("--kv-disk-mb", type=float, default=256.0)
    ap.add_argument("--runtime-mb", type=float, default=512.0,
                    help="RSS allowed beyond the memory plan: interpreter, NumPy/Numba, llguidance, Flask, threads")
    ap.add_argument("--kv-disk-dir", default=None, help="default: a new temporary directory under cache/")
    ap.add_argument("--log-dir", default="cache")
    ap.add_argument("--out", default="bench/results/soak_cpu.jsonl")
    args = ap.parse_args(argv)
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    kv_dir = Path(args.kv_disk_dir or tempfile.mkdtemp(prefix="soak_kv_", dir=args.log_dir))
    extra = ["--max-running", str(args.max_running), "--max-queue", str(max(args.clients, 1)),
             "--prefix-cache-mb", str(args.prefix_cache_mb), "--kv-disk-dir", str(kv_dir),
             "--kv-disk-mb", str(args.kv_disk_mb)]

    def start(tag):
        return start_server(args.base, args.engram_dir, Path(args.log_dir) / f"bench_soak_{tag}.log", extra)

    servers = [start("soak")]

    def restart():
        servers.append(start("restart"))
        return servers[-1]

    try:
        report = soak(servers[0], clients=args.clients, seconds=args.seconds, max_tokens=args.max_tokens,
                      max_running=args.max_running, runtime_mb=args.runtime_mb)
        report["restart"] = kill_mid_stream_and_restart(servers[0], restart, kv_dir)
    finally:
        for s in servers:
            if s.proc.poll() is None:
                stop_server(s)
    report.update(kv_disk_dir=str(kv_dir), cpus=os.cpu_count(), load_avg=os.getloadavg(),
                  date=time.strftime("%Y-%m-%d %H:%M"))
    line = json.dumps(report)
    print(line)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        f.write(line + "\n")
    return 0 if report["errors"] == 0 and report["within_budget"] and report["restart"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""Dev tool (not a benchmark of record): the chain of kernels that decided a traced decode step's length, read from
`bench_v41_decode.py --timeline-out` rows (best traced with DS4_CUDA_PDL=0, so that a kernel's start is its
dependencies' end plus the launch, not an early programmatic launch):

    python bench/dev/critical_path.py timeline_pdl0.jsonl [--context 1024] [--steps 2] [--top 25] [--json OUT]

The rows hold no graph edges, so the chain is inferred backwards in time: from the event that ends last, each step
goes to the event that ended last at or before the current one's start (within --slack µs of clock jitter), on any
stream. Under graph replay without programmatic edges a kernel starts only once its last dependency has ended, so
that event is, as a rule, the dependency it waited for. The table gives, per kernel and launch shape, the µs a
step it spends on that chain against its µs a step in all, and the chain's idle time before its chained calls
(launch latency, blocks waiting for room on the SMs, and what the trace does not show). A kernel whose time is mostly off the chain (a side stream's) costs the step nothing
until it lands on it: the thirtieth session's MoE section had the side stream's shared expert and mixes on it."""
import argparse
import bisect
import collections
import json
import sys


def _end(r):
    return r["start_us"] + r["dur_us"]


def chain(rows, slack_us=0.5):
    """The chained rows (in time order) of one context's timeline: from the row that ends last, back through the row
    that ended last at or before each one's start plus `slack_us`, among the rows that started before it."""
    if not rows:
        return []
    by_end = sorted(rows, key=_end)
    ends = [_end(r) for r in by_end]
    cur = by_end[-1]
    out = [cur]
    while True:
        i = bisect.bisect_right(ends, cur["start_us"] + slack_us) - 1
        while i >= 0 and (by_end[i] is cur or by_end[i]["start_us"] >= cur["start_us"]):
            i -= 1
        if i < 0:
            break
        cur = by_end[i]
        out.append(cur)
    return out[::-1]


def _shape(r):
    """(kernel, grid as "AxBxC"): bench_v41_decode.py writes the grid as "A,B,C"; a list is taken too."""
    grid = r.get("grid") or ()
    if isinstance(grid, str):
        grid = grid.split(",")
    return (r["kernel"], "x".join(str(v).strip() for v in grid))


def report(rows, steps=1, slack_us=0.5):
    """{"span_us", "chain_us", "gap_us", "kernels": [[kernel, grid, chain µs, all µs, chained calls, calls, wait µs]
    ...]}, µs a step (divided by `steps`), kernels by chain time, largest first. `wait µs`: the chain's idle time just
    before the kernel's chained calls (from its predecessor's end to its start): a kernel whose blocks found no room
    (another stream's blocks holding the SMs) shows it there."""
    c = chain(rows, slack_us)
    on, every = collections.defaultdict(lambda: [0.0, 0]), collections.defaultdict(lambda: [0.0, 0])
    wait = collections.defaultdict(float)
    for r in rows:
        every[_shape(r)][0] += r["dur_us"]
        every[_shape(r)][1] += 1
    for r in c:
        on[_shape(r)][0] += r["dur_us"]
        on[_shape(r)][1] += 1
    for a, b in zip(c, c[1:]):
        wait[_shape(b)] += max(0.0, b["start_us"] - _end(a))
    gap = sum(wait.values())
    span = (_end(c[-1]) - c[0]["start_us"]) if c else 0.0
    kernels = sorted(([k, g, round(on[(k, g)][0] / steps, 2), round(every[(k, g)][0] / steps, 2),
                       on[(k, g)][1] / steps, every[(k, g)][1] / steps, round(wait[(k, g)] / steps, 2)]
                      for (k, g) in every),
                     key=lambda row: (-row[2], -row[3], row[0], row[1]))
    return {"span_us": round(span / steps, 2), "chain_us": round(sum(r["dur_us"] for r in c) / steps, 2),
            "gap_us": round(gap / steps, 2), "kernels": kernels}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("timeline", help="JSON lines of bench_v41_decode.py --timeline-out")
    ap.add_argument("--context", type=int, help="the context whose rows to read (default: the first in the file)")
    ap.add_argument("--steps", type=int, default=2, help="traced steps in the rows (bench --trace-steps; default 2)")
    ap.add_argument("--slack", type=float, default=0.5, help="µs of clock jitter allowed between an end and a start")
    ap.add_argument("--top", type=int, default=25, help="kernel rows printed (default 25)")
    ap.add_argument("--json", help="also write the report here")
    a = ap.parse_args(argv)
    if a.steps < 1:
        ap.error("--steps must be at least 1")
    try:
        with open(a.timeline) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError) as e:
        sys.exit(f"critical_path: {a.timeline}: {e}")
    ctx = a.context if a.context is not None else (rows[0]["context"] if rows else None)
    rows = [r for r in rows if r.get("context") == ctx]
    if not rows:
        sys.exit(f"critical_path: {a.timeline}: no rows for context {ctx}")
    rep = report(rows, a.steps, a.slack)
    print(f"context {ctx}: span {rep['span_us']} µs a step, {rep['chain_us']} µs of it in chained kernels, "
          f"{rep['gap_us']} µs in gaps between them")
    print(f"{'kernel':>32} {'grid':>12} {'chain us':>9} {'all us':>9} {'chained':>8} {'calls':>6} {'wait us':>8}")
    for k, g, c_us, all_us, n_on, n, w_us in rep["kernels"][:a.top]:
        print(f"{k:>32} {g:>12} {c_us:>9} {all_us:>9} {n_on:>8g} {n:>6g} {w_us:>8}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"context": ctx, "steps": a.steps, **rep}, f)
    return rep


if __name__ == "__main__":
    main()

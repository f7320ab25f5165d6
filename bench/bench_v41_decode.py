"""Real-size DeepSeek V4.1 Flash decode on the CUDA backend (issue 12 item 1): synthetic weights at the true shapes,
made on the GPU in the layout upload_base gives a base file (ds4lib.engine.cuda_synth), whole greedy decode steps
of the backend that serves, eager and graph-replayed, at several contexts.

    python bench/bench_v41_decode.py                          # H200: 1k, 16k, 64k contexts, 20 timed steps a mode
    python bench/bench_v41_decode.py --contexts 1024,65536 --steps 50 --out v41.jsonl
    python bench/bench_v41_decode.py --small                  # no GPU: the simulator, micro model, 1 step a mode
    python bench/bench_v41_decode.py --contexts 1024 --batch-rows 1,2,4,8   # plus B sessions decoded together

Output: JSON lines on stdout (the first describes the run: machine, date, commit, config, VQ bits, weight bytes, the
roofline; then one per context), then a human-readable table; `--out FILE` also writes the JSON lines to FILE.

Per context and mode: tokens/s and ms/token (wall clock around `--steps` steps of forward + greedy device sampling
with its token read back, after `--warm` steps that compile, grow the caches and capture the bucket's graph; with
`--rounds R`, the median of R such rounds, each kept in `ms_per_token_rounds`),
launches per token (eager steps: Numba kernel launches counted at numba's launch call, sampling included), graph
nodes (the replayed decode graph), graph captures during the timed steps (should be 0).
Bytes per token are counted from the device weight structure: every non-expert weight once (the embedding: one row),
the K routed experts' index, plane and gain bytes of every layer, each layer's codebook, the head; plus the cache
rows read at that context (window rings, the top-k compressed rows each compressed layer attends, the index keys each
indexer scores, BF16). The Engram rows gathered on the host travel over PCIe and are reported apart.
The roofline is measured in the same run, before the weights exist: (a) a read-only Numba kernel, uint64 loads in
four independent streams over `--roofline-gib` GiB, (b) an eager device-to-device copy (read + write counted); the
highest rate is the roofline. Weights are cold by construction (~110 GB against a 60 MB L2).
Per-op table: device time per kernel from a CUPTI trace of `--trace-steps` graph-mode steps (PyTorch's profiler,
imported only for that; without torch the table is left out and the JSON says why), grouped by kernel module (op).
From the same trace, `streams` (stream_timeline): how long any stream ran, how long two ran at once, and how long the
main stream sat idle while another ran (a join waiting for the side stream, or SMs held by it), with the main-stream
kernels around the largest waits.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="simulator, micro model, 1 step a mode (a CI smoke run)")
    p.add_argument("--contexts", default=None, help="comma-separated contexts (default 1024,16384,65536; small 8)")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps per context and mode (20; small 1)")
    p.add_argument("--warm", type=int, default=None, help="untimed steps before timing (3; small 0)")
    p.add_argument("--rounds", type=int, default=1,
                   help="timed rounds of --steps steps per context and mode; ms/token is their median, each round's "
                        "figure is kept (ms_per_token_rounds): the spread within one lease (default 1)")
    p.add_argument("--trace-steps", type=int, default=None, help="graph-mode steps in the CUPTI trace (5; small 0)")
    p.add_argument("--bits", default="auto", help="VQ bit plan (ds4lib.quant.plan.parse_bits_plan; default auto)")
    p.add_argument("--engram-rows", type=int, default=1 << 20, help="rows kept of each Engram table (host)")
    p.add_argument("--roofline-gib", type=float, default=None, help="roofline buffer GiB (2; small 1/1024)")
    p.add_argument("--verify-rows", default=None,
                   help="comma list of row counts T (e.g. 1,2,3,4,5): per context, time a speculative verify call "
                        "(mark, forward of T rows, rollback of all of them) on the eager backend, wall and summed "
                        "kernel time (CUPTI), and fit the cost line c_v1 + c_tok * T (issue 13); default off")
    p.add_argument("--verify-reps", type=int, default=5, help="timed verify calls per row count (5)")
    p.add_argument("--batch-rows", default=None,
                   help="comma list of session counts B (e.g. 1,2,4,8): at the first context, B sessions decoded "
                        "together (CudaBackend.decode_batch, graph-replayed, each row sampled greedily), step time "
                        "and aggregate tokens/s (the server's concurrent requests); default off")
    p.add_argument("--one-stream", action="store_true",
                   help="a variant: the side and mix streams' work (mixes, window key, shared expert) queued on the "
                        "main stream, in the same order, without overlap (what the other streams are worth)")
    p.add_argument("--shared-expert", choices=("early", "side", "main"), default="early",
                   help="where the MoE's shared expert runs (CudaBackend.shared_expert_at): early (default) on the "
                        "side stream from the FFN's norm on, beside the routing and the routed experts; side forked "
                        "after the routing; main on the main stream before the routed experts; the same bits")
    p.add_argument("--ffn-mixes", choices=("apart", "late", "side"), default="apart",
                   help="where the FFN's mHC mixes run (CudaBackend.ffn_mixes_apart, ffn_mixes_late): apart "
                        "(default) on a stream of their own beside the whole MoE, late the same forked after the "
                        "routing, side on the side stream ahead of the shared expert; the same bits")
    p.add_argument("--attn-mixes", choices=("beside", "early"), default="beside",
                   help="where the attention's mHC mixes run (CudaBackend.attn_mixes_early): beside (default) on the "
                        "side stream after the window key, beside the scores and values; early on the mix stream "
                        "from the attention norm on, beside the query path; the same bits")
    p.add_argument("--l2-prefetch", default="",
                   help="comma-separated weights the mix stream asks L2 for ahead of their GEMVs "
                        "(CudaBackend.l2_prefetch): wo (the layer's wo_a, wo_b, beside the attention), wq (the next "
                        "layer's wq_a, wq_b, beside the MoE); default none; the same bits")
    p.add_argument("--graph-only", action="store_true",
                   help="time graph replay only, not eager launches (A/B runs of the served path; GPU only)")
    p.add_argument("--experts", type=int, default=None,
                   help="routed experts a layer (default: the config's 384). Fewer keep every decode step's bytes (K "
                        "experts of a layer, still cold) and shrink the resident payload: 160 fits an 80 GB H100, "
                        "for A/B runs there; figures of record use the default on the H200")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--commit", default=None, help="git commit to report (default: git rev-parse HEAD)")
    p.add_argument("--out", default=None, help="also write the JSON lines to this file")
    p.add_argument("--timeline-out", default=None,
                   help="append the traced steps' device events to this file, one JSON line each (kernel, grid, "
                        "block, stream, start and duration in µs; timeline_rows)")
    a = p.parse_args(argv)
    small = a.small
    a.contexts = [int(c) for c in (a.contexts or ("8" if small else "1024,16384,65536")).split(",")]
    a.steps = a.steps if a.steps is not None else (1 if small else 20)
    a.warm = a.warm if a.warm is not None else 0 if small else 3
    a.trace_steps = a.trace_steps if a.trace_steps is not None else (0 if small else 5)
    a.roofline_gib = a.roofline_gib if a.roofline_gib is not None else (1 / 1024 if small else 2.0)
    return a


ARGS = _args() if __name__ == "__main__" else _args(["--small"])
from bench.timing import eager_time, use_simulator  # noqa: E402

if ARGS.small:
    use_simulator()                                     # before the first numba.cuda import

import numpy as np                                      # noqa: E402
from numba import cuda                                  # noqa: E402

import kernels  # noqa: E402,F401  (numpy alias before anything compiles)
from ds4lib.config import Env, ModelConfig              # noqa: E402
from ds4lib.engine.cuda_weights import Lin              # noqa: E402
from ds4lib.engram_geometry import engram_geometry      # noqa: E402
from ds4lib.roles import layer_roles                    # noqa: E402

SIM = ARGS.small


# --------------------------------------------------------------------------------------------- the roofline
@cuda.jit
def _read4_kernel(buf, out):
    """XOR of every uint64 word, read as four independent streams a quarter of the buffer apart."""
    q = buf.shape[0] // 4
    i = cuda.grid(1)
    a0 = a1 = a2 = a3 = np.uint64(0)
    for j in range(i, q, cuda.gridsize(1)):
        a0 ^= buf[j]
        a1 ^= buf[j + q]
        a2 ^= buf[j + 2 * q]
        a3 ^= buf[j + 3 * q]
    out[i] = a0 ^ a1 ^ a2 ^ a3


def _event_seconds(run, stream, reps):
    run()                                               # warm (compile)
    stream.synchronize()
    return eager_time(run, stream, reps, simulator=SIM)


def measure_roofline(gib, reps=20):
    """{read_tbps, copy_tbps, roofline_tbps, buffer_bytes}: the read-only kernel and the eager copy (module doc)."""
    s = cuda.stream()
    n = int(gib * (1 << 30)) // 32 * 4                   # uint64 words, a multiple of 4 streams
    src = cuda.device_array(n, np.uint64, stream=s)
    dst = cuda.device_array(n, np.uint64, stream=s)
    blocks, threads = (cuda.get_current_device().MULTIPROCESSOR_COUNT * 16, 512) if not SIM else (1, 32)
    out = cuda.device_array(blocks * threads, np.uint64, stream=s)
    src.copy_to_device(dst, stream=s)                   # touch both buffers before timing
    nbytes = n * 8
    t_read = _event_seconds(lambda: _read4_kernel[blocks, threads, s](src, out), s, reps)
    t_copy = _event_seconds(lambda: dst.copy_to_device(src, stream=s), s, reps)
    read, copy = nbytes / t_read / 1e12, 2 * nbytes / t_copy / 1e12
    sig = lambda x: float(f"{x:.4g}")      # noqa: E731  four significant digits: the simulator's rates are far below
    return {"read_tbps": sig(read), "copy_tbps": sig(copy), "roofline_tbps": sig(max(read, copy)),   # 0.001 TB/s
            "roofline_from": "read kernel" if read >= copy else "device copy", "buffer_bytes": nbytes}


# --------------------------------------------------------------------------------------------- bytes per token
def _nbytes(a):
    return int(a.size) * a.dtype.itemsize


def _weight_part(key):
    if key.startswith("attn."):
        return "attention"
    for prefix, part in (("ffn.shared_experts.", "shared expert"), ("ffn.gate.", "router"), ("hc_", "mHC"),
                         ("engram.", "engram projections")):
        if key.startswith(prefix):
            return part
    return "norms"


def weight_bytes_per_token(W, cfg) -> dict:
    """Weight bytes one decode step reads, by part (module docstring)."""
    parts = {"embedding row": W.g["embed"].w.shape[1] * W.g["embed"].w.dtype.itemsize,
             "head": _nbytes(W.g["head"].w), "norms": _nbytes(W.g["norm"])}
    for l, w in enumerate(W.L):
        k = cfg.moe_shape(l)[1]
        e = w["vq_experts"]
        routed = _nbytes(w["vq_index"]) + sum(_nbytes(g) for g in w["vq_gains"])
        routed += _nbytes(w["vq_plane"]) if w["vq_plane"] is not None else 0
        parts["routed experts"] = parts.get("routed experts", 0) + routed * k // e
        parts["codebooks"] = parts.get("codebooks", 0) + _nbytes(w["vq_cb"])
        for key, v in w.items():
            if key.startswith("vq_"):
                continue
            part = _weight_part(key)
            parts[part] = parts.get(part, 0) + _nbytes(v.w if isinstance(v, Lin) else v)
    return parts


def cache_bytes_per_token(cfg, pos) -> int:
    """BF16 cache rows a decode step at position `pos` reads (module docstring)."""
    total = 0
    for r in layer_roles(cfg)[:cfg.n_layers]:
        total += min(pos, cfg.window_size) * cfg.head_dim * 2
        if r.ratio:
            total += min((pos + 1) // r.ratio, cfg.index_topk) * cfg.head_dim * 2
        if r.owns_indexer:
            rows = (pos + 1) // r.ratio
            if r.consumes_candidates:
                rows = min(rows, cfg.candidate_topk_blocks * cfg.candidate_block_size)
            total += rows * cfg.index_head_dim * 2
    return total


def engram_host_bytes(cfg) -> int:
    if not cfg.engram_layer_ids:
        return 0
    g = engram_geometry(cfg)
    return len(g.layer_ids) * g.n_cols * (cfg.engram_head_dim + cfg.engram_head_dim // 32)


# --------------------------------------------------------------------------------------------- launches, trace
def count_launches(run):
    """(run(), kernel launches it made): an observer wrapped around numba's launch call for the duration only."""
    if SIM:
        from numba.cuda.simulator import kernel as sk
        cls, name = sk.FakeCUDAKernel, "__call__"

        def is_launch(k):                               # device functions and calls inside a kernel are not
            return not k._device and not sk._kernel_context
    else:
        from numba.cuda.dispatcher import _Kernel as cls
        name = "launch"

        def is_launch(k):
            return True
    orig, n = getattr(cls, name), [0]

    def counted(self, *a, **k):
        n[0] += is_launch(self)
        return orig(self, *a, **k)
    setattr(cls, name, counted)
    try:
        out = run()
    finally:
        setattr(cls, name, orig)
    return out, n[0]


_MANGLED = re.compile(r"(\d+)")


def kernel_op(name: str) -> tuple[str, str]:
    """(op = the kernel's module, kernel function) of a Numba kernel name, mangled (`_ZN7kernels...`) or as CUPTI
    demangles it (`kernels::vq_gemv::_make_vq_kernel::_3clocals_3e::vq_gemv_kernel[abi:...]`); other names pass
    through."""
    if name.startswith("kernels::"):
        parts = [p for p in name.split("[", 1)[0].split("::") if p]
        return (parts[1], parts[-1]) if len(parts) >= 3 else ("other", name[:60])
    if not name.startswith("_ZN"):
        return ("other", name[:60])
    parts, i = [], 3
    while i < len(name) and name[i].isdigit():
        m = _MANGLED.match(name, i)
        n = int(m.group(1))
        parts.append(name[m.end():m.end() + n])
        i = m.end() + n
    parts = [p for p in parts if p != "cudapy"]
    if len(parts) < 2:
        return ("other", name[:60])
    return (parts[-2], parts[-1])


def _device_events(events):
    """The device activities of a Chrome trace: kernels, copies and memsets."""
    return [ev for ev in events if ev.get("ph") == "X" and ev.get("cat", "") in ("kernel", "gpu_memcpy", "gpu_memset")]


def _event_name(ev):
    cat = ev.get("cat", "")
    return kernel_op(ev["name"]) if cat == "kernel" else (cat[4:], ev["name"][:40])


def trace_events(run):
    """(Chrome trace events of run()'s device activity from a CUPTI trace (PyTorch's profiler), None) or (None,
    why)."""
    try:
        import tempfile

        from torch.profiler import ProfilerActivity, profile
    except ImportError as e:
        return None, f"no torch ({e})"
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "trace.json"
            prof.export_chrome_trace(str(path))
            return _device_events(json.loads(path.read_text())["traceEvents"]), None
    except Exception as e:  # noqa: BLE001 - the table is optional; the reason goes into the JSON
        return None, f"trace failed: {type(e).__name__}: {e}"[:300]


def _union(intervals):
    """Merged [start, end) intervals, sorted."""
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _length(intervals):
    return sum(b - a for a, b in intervals)


def _covered(a, b, merged):
    """How much of [a, b) the merged intervals cover."""
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in merged if x < b and y > a)


def stream_timeline(events, steps, top=6):
    """What the streams did in a trace's device events (each with ts and dur in µs and args.stream), per step: the
    time any stream ran (`busy_us`), each stream's own busy time (`streams`, the main stream first: the one with the
    most events), the time two or more ran at once (`overlap_us`), and the main stream's idle gaps — `main_waits_us`
    while another stream ran (the side stream holding up a join, or SMs it held), `main_idle_us` while none did
    (host and launch latency) — with the largest waits grouped by the main-stream kernels around them (`waits`:
    [[before, after, µs per step, gaps per step], ...])."""
    evs = sorted((float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0)), ev.get("args", {}).get("stream", 0),
                  _event_name(ev)[1]) for ev in events)
    if not evs:
        return None
    by_stream = {}
    for a, b, st, name in evs:
        by_stream.setdefault(st, []).append((a, b, name))
    main = max(by_stream, key=lambda st: len(by_stream[st]))
    others = _union([(a, b) for st, es in by_stream.items() if st != main for a, b, _ in es])
    busy = {st: _length(_union([(a, b) for a, b, _ in es])) for st, es in by_stream.items()}
    union = _length(_union([(a, b) for a, b, _, _ in evs]))
    waits, waited, idle = {}, 0.0, 0.0
    mains = by_stream[main]
    end = mains[0][1]
    for (_, _, before), (a, b, after) in zip(mains, mains[1:]):
        if a > end:
            w = _covered(end, a, others)
            waited += w
            idle += (a - end) - w
            if w > 0:
                rec = waits.setdefault((before, after), [0.0, 0])
                rec[0] += w
                rec[1] += 1
        end = max(end, b)
    order = [main] + sorted(st for st in by_stream if st != main)
    return {"busy_us": round(union / steps, 1),
            "streams": [[st, round(busy[st] / steps, 1), len(by_stream[st]) / steps] for st in order],
            "overlap_us": round((sum(busy.values()) - union) / steps, 1),
            "main_waits_us": round(waited / steps, 1), "main_idle_us": round(idle / steps, 1),
            "waits": [[k[0], k[1], round(v[0] / steps, 1), v[1] / steps]
                      for k, v in sorted(waits.items(), key=lambda kv: -kv[1][0])[:top]]}


def _dims(args, key):
    """A launch's grid or block from a trace event's args as "x,y,z" ("" when the event has none)."""
    return ",".join(str(v) for v in args.get(key, ()))


def launch_shapes(events, steps, top=24):
    """The kernels of a trace's device events split by launch shape, the largest device time first: [[kernel, grid,
    block, µs per step, launches per step, µs a launch], ...] (grid and block as "x,y,z" from the events' args). One
    kernel serves several matrices (q4k_imma_kernel: wo_a, wo_b, the head), whose grids differ: this tells them
    apart inside a step, where the op table adds them up."""
    acc = {}
    for ev in events:
        if ev.get("cat") != "kernel":
            continue
        args = ev.get("args", {})
        key = (_event_name(ev)[1], _dims(args, "grid"), _dims(args, "block"))
        rec = acc.setdefault(key, [0.0, 0])
        rec[0] += float(ev.get("dur", 0))
        rec[1] += 1
    rows = sorted(acc.items(), key=lambda kv: -kv[1][0])[:top]
    return [[k, g, b, round(us / steps, 1), n / steps, round(us / n, 2)] for (k, g, b), (us, n) in rows]


def timeline_rows(events, context):
    """A trace's device events as rows for offline study (`--timeline-out`), in start order: {"context", "kernel",
    "op", "grid", "block", "stream", "start_us" (from the first event), "dur_us"}."""
    evs = sorted(events, key=lambda ev: float(ev["ts"]))
    t0 = float(evs[0]["ts"]) if evs else 0.0
    rows = []
    for ev in evs:
        op, k = _event_name(ev)
        args = ev.get("args", {})
        rows.append({"context": context, "kernel": k, "op": op, "grid": _dims(args, "grid"),
                     "block": _dims(args, "block"), "stream": args.get("stream", 0),
                     "start_us": round(float(ev["ts"]) - t0, 3), "dur_us": round(float(ev.get("dur", 0)), 3)})
    return rows


def trace_ops(run, steps, timeline=False):
    """{op: {kernel: [device µs per step, launches per step]}} from a CUPTI trace of run() (PyTorch's profiler), or
    (None, why); with `timeline`, (ops, why, stream_timeline of the same trace, launch_shapes of it, its events)."""
    events, why = trace_events(run)
    if events is None:
        return (None, why, None, None, None) if timeline else (None, why)
    ops = {}
    for ev in events:
        op, k = _event_name(ev)
        rec = ops.setdefault(op, {}).setdefault(k, [0.0, 0])
        rec[0] += float(ev.get("dur", 0)) / steps
        rec[1] += 1
    for kern in ops.values():
        for rec in kern.values():
            rec[0] = round(rec[0], 2)
            rec[1] = rec[1] / steps
    if timeline:
        return ops, None, stream_timeline(events, steps), launch_shapes(events, steps), events
    return ops, None


def ops_total_us(ops) -> float:
    """Device µs of every kernel and copy in a trace_ops table."""
    return sum(v[0] for k in ops.values() for v in k.values())


# --------------------------------------------------------------------------------------------- decode
class Greedy:
    temperature, top_k, top_p, min_p = 0.0, 0, 1.0, 0.0


def decode(backend, st, token, n, step0):
    """n greedy steps (forward + device sampling, the token read back); returns the last token."""
    for i in range(n):
        out = backend.forward(st, [token], last_only=True)
        token = backend.sample(out.logits, Greedy, ARGS.seed, step0 + i)
    return token


def run_mode(backend, ctx, mode):
    """One context, one mode (module docstring). Launches are counted on the last untimed step, or over the timed
    steps when --warm is 0 (the simulator's smoke run: a micro step takes minutes there)."""
    st = backend.synthetic_state(ctx, seed=ARGS.seed)
    tok = decode(backend, st, 1, max(ARGS.warm - 1, 0), 0)
    stats0 = dict(backend.stats)
    if ARGS.warm:
        tok, launches = count_launches(lambda: decode(backend, st, tok, 1, ARGS.warm - 1))
        counted, stats1 = 1, dict(backend.stats)
    rounds, step0, counted_launches = [], ARGS.warm, 0
    for _ in range(ARGS.rounds):
        backend.stream.synchronize()
        t = time.perf_counter()
        if ARGS.warm:
            tok = decode(backend, st, tok, ARGS.steps, step0)
        else:
            tok, n = count_launches(lambda: decode(backend, st, tok, ARGS.steps, step0))
            counted_launches += n
        rounds.append((time.perf_counter() - t) / ARGS.steps)
        step0 += ARGS.steps
    if not ARGS.warm:
        launches, counted, stats1 = counted_launches, ARGS.steps * ARGS.rounds, stats0
    dt = float(np.median(rounds))
    replays = (backend.stats if not ARGS.warm else stats1)["graph_replays"] - stats0["graph_replays"]
    rec = {"mode": mode, "ms_per_token": round(dt * 1e3, 3), "tokens_per_s": round(1 / dt, 2),
           "ms_per_token_rounds": [round(r * 1e3, 3) for r in rounds],
           "kernel_launches_per_token": launches / counted, "graph_launches_per_token": replays / counted,
           "graph_nodes": backend.stats["graph_nodes"] if mode == "graph" else 0,
           "graph_pdl_edges": backend.stats["graph_pdl_edges"] if mode == "graph" else 0,
           "captures_in_timing": backend.stats["graph_captures"] - stats1["graph_captures"], "last_token": int(tok)}
    if mode == "graph" and ARGS.trace_steps:
        ops, why, tl, shapes, events = trace_ops(lambda: decode(backend, st, tok, ARGS.trace_steps, 10_000),
                                                 ARGS.trace_steps, timeline=True)
        rec["ops"] = ops if ops is not None else why
        rec["streams"] = tl
        rec["launch_shapes"] = shapes
        if ARGS.timeline_out and events:
            with open(ARGS.timeline_out, "a") as f:
                for row in timeline_rows(events, ctx):
                    f.write(json.dumps(row) + "\n")
    return rec


def verify_cost(backend, ctx, rows_list, reps):
    """The verify call of a speculative round at context `ctx` for each T in rows_list (on the GPU only: main() skips
    it in the simulator run): mark, forward of T rows (all logits, as the verify takes them), rollback of every row,
    so each call starts from the same state. Per T: the wall time of the calls (eager launches, or with graphs on the
    verify graph captured by the warm call and replayed) and their summed kernel time from a CUPTI trace (None
    without torch): the latter is what a replayed verify costs at best. Returns (rows,
    fit): fit = {c_v1_ms, c_tok_ms, of}, the least-squares line cost = c_v1 + c_tok * T (T = 1 + k: issue 13's
    scheduler cost line) through the kernel times (or the wall times without a trace)."""
    st = backend.synthetic_state(ctx, seed=ARGS.seed)
    out = []
    for T in rows_list:
        toks = [1 + i for i in range(T)]

        def call():
            mk = backend.mark(st)
            backend.forward(st, toks, last_only=False)
            backend.rollback(st, mk, [])

        def calls():
            for _ in range(reps):
                call()
            backend.stream.synchronize()
        call()                                          # warm: compile, scratch for T rows
        backend.stream.synchronize()
        t = time.perf_counter()
        calls()
        wall = (time.perf_counter() - t) / reps
        ops, why = trace_ops(calls, reps)
        kern = ops_total_us(ops) / 1e3 if ops else None
        out.append({"rows": T, "wall_ms": round(wall * 1e3, 3), "kernel_ms": round(kern, 3) if kern else None,
                    **({} if ops else {"trace": why})})
    key = "kernel_ms" if all(r["kernel_ms"] for r in out) else "wall_ms"
    fit = {"of": key}
    if len(out) >= 2:
        c_tok, c0 = np.polyfit([r["rows"] for r in out], [r[key] for r in out], 1)
        fit.update({"c_v1_ms": round(float(c0), 3), "c_tok_ms": round(float(c_tok), 4)})   # cost = c_v1 + c_tok * T
    return out, fit


def batch_cost(backend, ctx, rows_list, steps, warm):
    """B sessions at context `ctx` decoded together for each B in rows_list: `warm` untimed steps (the capture), then
    `steps` timed steps of the batched forward and each row's greedy device sample (token read back), and as many
    timed steps of the forward alone. B = 1 is the plain decode step (decode_batch hands it to it)."""
    out = []
    backend.batch_capture = "now"                       # a stable set: its graph from the first step (the steady state)
    for B in rows_list:
        sts = [backend.synthetic_state(ctx, seed=ARGS.seed + b) for b in range(B)]
        toks = [1 + 7 * b for b in range(B)]
        done = [0]

        def step():
            lg = backend.decode_batch(sts, toks)
            for b in range(B):
                toks[b] = backend.sample(lg[b], Greedy, ARGS.seed + b, done[0])
            done[0] += 1

        for _ in range(max(warm, 1)):
            step()
        captures = backend.stats["graph_captures"]
        backend.stream.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            step()
        full = (time.perf_counter() - t) / steps
        t = time.perf_counter()
        for _ in range(steps):
            backend.decode_batch(sts, toks)
        backend.stream.synchronize()
        fwd = (time.perf_counter() - t) / steps
        out.append({"rows": B, "ms_per_step": round(full * 1e3, 3), "tokens_per_s": round(B / full, 2),
                    "forward_ms_per_step": round(fwd * 1e3, 3), "forward_tokens_per_s": round(B / fwd, 2),
                    "captures_in_timing": backend.stats["graph_captures"] - captures})
        for st in sts:
            backend.park_state(st)                       # its graphs and the batched steps that hold it
        sts.clear()                                      # (the list `step` closes over: the states go with it)
        backend.stream.synchronize()
    return out


def small_config():
    from tests.engine.test_engine_cuda import micro_config
    return micro_config()


def build(cfg, bits):
    """(weights, {mode: backend}, generation seconds)."""
    from ds4lib.engine.backend import BackendContext
    from ds4lib.engine.backend_cuda import CudaBackend
    from ds4lib.engine.cuda_synth import SyntheticEngramTables, synthetic_token_map, synthetic_weights
    t = time.perf_counter()
    W = synthetic_weights(cfg, bits, seed=ARGS.seed)
    gen = time.perf_counter() - t
    tables = SyntheticEngramTables(cfg, rows=ARGS.engram_rows, seed=ARGS.seed) if cfg.engram_layer_ids else None
    ctx = BackendContext(cfg, None, synthetic_token_map(cfg) if tables else None, tables, prefill_block=16,
                         context_length=max(ARGS.contexts) + ARGS.warm + ARGS.steps + ARGS.trace_steps + 16)
    # the simulator has no graphs (both modes would be eager); --graph-only leaves out the eager timing
    modes = ("eager",) if SIM else (("graph",) if ARGS.graph_only else ("eager", "graph"))
    backends = {m: CudaBackend(ctx, weights=W, graphs=(m == "graph")) for m in modes}
    if ARGS.one_stream:
        for b in backends.values():
            b.side = b.mix = b.stream        # the forks and joins become no-ops (CudaBackend: side is stream)
    for b in backends.values():
        b.shared_expert_at = ARGS.shared_expert
        b.ffn_mixes_apart = ARGS.ffn_mixes in ("apart", "late")
        b.ffn_mixes_late = ARGS.ffn_mixes == "late"
        b.attn_mixes_early = ARGS.attn_mixes == "early"
        b.l2_prefetch = tuple(n for n in ARGS.l2_prefetch.split(",") if n)
    return W, backends, gen


def _commit():
    if ARGS.commit:
        return ARGS.commit
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (sha + ("+dirty" if dirty else "")) if sha else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _machine():
    if SIM:
        return "CUDA simulator on " + platform.node()
    dev = cuda.get_current_device()
    name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
    free, total = cuda.current_context().get_memory_info()
    return f"{name}, {total / 2 ** 30:.1f} GiB, {dev.MULTIPROCESSOR_COUNT} SMs"


def emit(rec, sink):
    line = json.dumps(rec)
    print(line, flush=True)
    sink.append(line)


def table(run, rows):
    """The human-readable summary of the JSON lines."""
    out = [f"\n{run['config']} on {run['machine']} ({run['date']}, {run['commit']}); VQ bits {run['bits_plan']}; "
           f"weights {run['weight_bytes'] / 1e9:.2f} GB made in {run['generation_s']:.1f} s",
           f"roofline {run['roofline']['roofline_tbps']:.2f} TB/s ({run['roofline']['roofline_from']}; read kernel "
           f"{run['roofline']['read_tbps']:.2f}, device copy {run['roofline']['copy_tbps']:.2f})",
           f"{'context':>8} {'mode':>6} {'tok/s':>8} {'ms/tok':>8} {'GB/tok':>7} {'roof ms':>8} {'% roof':>7} "
           f"{'launches':>9} {'nodes':>6} {'pdl':>5}"]
    for r in rows:
        for m in ("eager", "graph"):
            if m not in r:
                continue
            x = r[m]
            out.append(f"{r['context']:>8} {m:>6} {x['tokens_per_s']:>8.2f} {x['ms_per_token']:>8.2f} "
                       f"{r['bytes_per_token'] / 1e9:>7.3f} {r['roofline_ms']:>8.3f} {x['pct_of_roofline']:>7.1f} "
                       f"{x['kernel_launches_per_token']:>9.0f} {x['graph_nodes']:>6} {x['graph_pdl_edges']:>5}")
    for r in rows:
        ops = r.get("graph", {}).get("ops")
        if not isinstance(ops, dict):
            out.append(f"context {r['context']}: no per-op table ({ops or 'tracing off'})")
            continue
        total = ops_total_us(ops)
        out.append(f"\nper-op device time, context {r['context']} (graph mode; {total / 1e3:.2f} ms of kernels per "
                   f"token against {r['graph']['ms_per_token']:.2f} ms wall)")
        out.append(f"{'op':>16} {'kernel':>34} {'us/tok':>9} {'calls':>6} {'%':>6}")
        flat = sorted(((v[0], v[1], op, k) for op, ks in ops.items() for k, v in ks.items()), reverse=True)
        by_op = sorted(((sum(v[0] for v in ks.values()), op) for op, ks in ops.items()), reverse=True)
        for us, op in by_op:
            out.append(f"{op:>16} {'(all)':>34} {us:>9.1f} {sum(v[1] for v in ops[op].values()):>6.0f} "
                       f"{100 * us / max(total, 1e-9):>6.1f}")
        for us, calls, op, k in flat[:25]:
            out.append(f"{op:>16} {k[:34]:>34} {us:>9.1f} {calls:>6.0f} {100 * us / max(total, 1e-9):>6.1f}")
        tl = r["graph"].get("streams")
        if tl:
            out.append(f"streams, µs a token: any busy {tl['busy_us']}, overlap {tl['overlap_us']}, main stream "
                       f"waiting while another ran {tl['main_waits_us']}, all idle {tl['main_idle_us']}; "
                       f"busy by stream (main first) {[x[1] for x in tl['streams']]}")
            for before, after, us, n in tl["waits"]:
                out.append(f"  main waits {us:>7.1f} µs ({n:.0f} gaps) between {before[:30]} and {after[:30]}")
        shapes = r["graph"].get("launch_shapes")
        if shapes:
            out.append(f"by launch shape: {'kernel':>30} {'grid':>14} {'block':>10} {'us/tok':>9} {'calls':>6} "
                       f"{'us/call':>8}")
            for k, g, b, us, n, per in shapes:
                out.append(f"{'':>16} {k[:30]:>30} {g:>14} {b:>10} {us:>9.1f} {n:>6.0f} {per:>8.2f}")
    return "\n".join(out)


def main():
    from ds4lib.engine.backend_cuda import L2_PREFETCH
    from ds4lib.quant.plan import parse_bits_plan
    bad = [n for n in ARGS.l2_prefetch.split(",") if n and n not in L2_PREFETCH]
    if bad:                                             # before the weights are made: the backend's own names
        sys.exit(f"bench_v41_decode: --l2-prefetch: {bad[0]!r} is not among {', '.join(L2_PREFETCH)}")
    lines = []
    cfg = small_config() if SIM else ModelConfig.v41_flash()
    if ARGS.experts is not None:
        cfg = cfg.replace(n_routed_experts=ARGS.experts)        # checked as any config is
    plan = parse_bits_plan(ARGS.bits, cfg)
    print(f"roofline: {ARGS.roofline_gib:g} GiB buffers", file=sys.stderr, flush=True)
    roof = measure_roofline(ARGS.roofline_gib)
    if not SIM:
        cuda.current_context().deallocations.clear()      # the roofline buffers go before the weights come
    print(f"weights: generating {cfg.n_layers} layers on the device", file=sys.stderr, flush=True)
    W, backends, gen = build(cfg, plan.bits)
    parts = weight_bytes_per_token(W, cfg)
    run = {"kind": "run", "machine": _machine(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "commit": _commit(), "config": "micro (simulator)" if SIM else "v41-flash",
        "n_layers": cfg.n_layers, "n_routed_experts": cfg.n_routed_experts,
        "bits_plan": f"{plan.spec}: {plan.n13} of {cfg.n_layers} layers 13-bit",
        "bits": list(plan.bits[:cfg.n_layers]), "weight_bytes": W.nbytes, "generation_s": round(gen, 2),
        "weight_bytes_per_token": parts, "engram_host_bytes_per_token": engram_host_bytes(cfg),
        "engram_rows_kept": ARGS.engram_rows, "roofline": roof, "steps": ARGS.steps, "warm": ARGS.warm,
        "sampling": "greedy (temperature 0), device sampler, token read back every step",
        "streams": "one (--one-stream)" if ARGS.one_stream else "main + side + mix",
        "shared_expert": ARGS.shared_expert, "ffn_mixes": ARGS.ffn_mixes, "attn_mixes": ARGS.attn_mixes,
        "l2_prefetch": ARGS.l2_prefetch or "none",
        "programmatic_edges": "on" if Env.read().cuda_pdl else "off (DS4_CUDA_PDL=0)",
        "stream_priority": "main high, side low (DS4_CUDA_PRIORITY=1)" if Env.read().cuda_priority else "off"}
    emit(run, lines)
    rows = []
    for ctx in ARGS.contexts:
        nbytes = sum(parts.values()) + cache_bytes_per_token(cfg, ctx)
        roof_ms = nbytes / (roof["roofline_tbps"] * 1e12) * 1e3
        rec = {"kind": "context", "context": ctx, "bytes_per_token": nbytes,
               "cache_bytes_per_token": cache_bytes_per_token(cfg, ctx), "roofline_ms": round(roof_ms, 4)}
        for mode, backend in backends.items():
            print(f"context {ctx}: {mode}", file=sys.stderr, flush=True)
            x = run_mode(backend, ctx, mode)
            x["pct_of_roofline"] = round(100 * roof_ms / x["ms_per_token"], 2)
            x["gbps"] = round(nbytes / (x["ms_per_token"] / 1e3) / 1e9, 1)
            rec[mode] = x
        emit(rec, lines)
        rows.append(rec)
        if ARGS.verify_rows and SIM:
            print("verify calls: not in the simulator run (the micro config's candidate consumer reads its own "
                  "compressed rows, a different count from the publisher's, which a multi-row call refuses; V4.1's "
                  "consumers read the publisher's layer)", file=sys.stderr, flush=True)
        elif ARGS.verify_rows:
            for mode, backend in backends.items():    # eager launches, and (graph) replayed verify graphs
                print(f"context {ctx}: verify calls ({mode})", file=sys.stderr, flush=True)
                vr, fit = verify_cost(backend, ctx, [int(v) for v in ARGS.verify_rows.split(",")], ARGS.verify_reps)
                emit({"kind": "verify", "context": ctx, "mode": mode, "calls": vr, "fit": fit,
                      "decode_graph_ms": rec.get("graph", {}).get("ms_per_token")}, lines)
    if ARGS.batch_rows:
        backend = backends["graph"] if "graph" in backends else backends["eager"]
        ctx = ARGS.contexts[0]
        print(f"context {ctx}: batched decode of {ARGS.batch_rows} sessions", file=sys.stderr, flush=True)
        br = batch_cost(backend, ctx, [int(v) for v in ARGS.batch_rows.split(",")], ARGS.steps, ARGS.warm)
        emit({"kind": "batch", "context": ctx, "mode": "graph" if "graph" in backends else "eager", "rows": br},
             lines)
    print(table(run, rows), flush=True)
    if ARGS.out:
        Path(ARGS.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

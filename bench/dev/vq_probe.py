"""Dev probe on the H200 (not a benchmark of record): one V4.1 Flash MoE layer's routed-expert GEMVs at decode
(T=1, K=6 of E=384, D=5120, F=2304), cold (every call routes to 6 fresh random experts of a full 384-expert
layer, 2.7 GB of payload), CUDA-graph replay. Prints per-call µs of the w1+w3 call and the w2 call, the plan, and
GB/s of payload read.

    python bench/dev/vq_probe.py [--bits 12|13] [--reps 64] [--eager N] [--small] [--rg N] [--threads N] [--prefetch N]
The payload is random bytes in the device layout (kernels.vq_gemv; at these shapes as large as the file's).
--small: tiny shapes under the simulator, each part run once eagerly (a smoke run: its times mean nothing).
--eager N: N eager calls only (for ncu)."""
import argparse
import json
import sys

sys.path.insert(0, ".")
ap = argparse.ArgumentParser()
ap.add_argument("--bits", type=int, default=13)
ap.add_argument("--reps", type=int, default=64)
ap.add_argument("--eager", type=int, default=0)
ap.add_argument("--small", action="store_true", help="tiny shapes under the simulator (a smoke run)")
ap.add_argument("--rg", type=int, default=0, help="a variant: row groups a unit (1 or 2; 0: the module's)")
ap.add_argument("--threads", type=int, default=0, help="a variant: threads a block (0: the module's)")
ap.add_argument("--prefetch", type=int, default=0,
                help="a variant: blocks of a row group in flight, 1-4 (0: the module's)")
a = ap.parse_args()
if a.small:
    from bench.timing import use_simulator
    use_simulator()
import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402

import kernels.vq_gemv as vq  # noqa: E402
from bench.timing import eager_time, graph_time  # noqa: E402
from kernels.synth_fill import synth_fill  # noqa: E402

if a.rg or a.threads or a.prefetch:
    vq.THREADS = a.threads or vq.THREADS
    vq.vq_gemv_kernel = vq._make_vq_kernel(vq.THREADS, False, a.rg or vq.RG_PER_UNIT, a.prefetch or vq.PREFETCH)
E, K, D, F = (8, 6, 256, 128) if a.small else (384, 6, 5120, 2304)
s = cuda.stream()
S, P = vq.device_stream_bytes((F, D), (D, F))
C = 1 << a.bits
index = cuda.device_array((E, 3, S), np.uint8, stream=s)
synth_fill(index, "bits", key=11, stream=s)
plane = None
if a.bits == 13:
    plane = cuda.device_array((E, 3, P), np.uint8, stream=s)
    synth_fill(plane, "bits", key=12, stream=s)
codes = cuda.device_array((C, 8), np.uint8, stream=s)
synth_fill(codes, "e4m3", key=13, sigma=0.5, stream=s)
cb = vq.vq_codebook(codes, stream=s)
rng = np.random.default_rng(0)
gains = tuple(cuda.to_device(np.full((E, r), 0x2000, np.uint16), stream=s) for r in (F, D, F))
x = cuda.to_device(rng.standard_normal((1, D)).astype(np.float32), stream=s)
h = cuda.to_device(rng.standard_normal((K, F)).astype(np.float32), stream=s)
n_ids = max(a.reps, 1)
ids_all = [cuda.to_device(np.sort(rng.choice(E, K, replace=False)).astype(np.int32).reshape(1, K), stream=s)
           for _ in range(n_ids)]
plan = vq.vq_plan(ids_all[0], E, stream=s)
scratch13, scratch2 = {}, {}
o13 = cuda.device_array((2, K, F), np.float32, stream=s)
o2 = cuda.device_array((1, K, D), np.float32, stream=s)
it = [0]


def step(parts="all"):
    global plan
    ids = ids_all[it[0] % n_ids]
    it[0] += 1
    if parts in ("all", "plan", "w13", "w2"):
        plan = vq.vq_plan(ids, E, out=plan, stream=s)
    if parts in ("all", "w13"):
        vq.vq_gemv(x, plan, cb, index, plane, gains, mats=(0, 2), shape=(F, D), x_div=K, out=o13,
                   scratch=scratch13, stream=s)
    if parts in ("all", "w2"):
        vq.vq_gemv(h, plan, cb, index, plane, gains, mats=(1,), shape=(D, F), x_div=1, out=o2,
                   scratch=scratch2, stream=s)


for _ in range(3):
    step()
s.synchronize()
if a.eager:
    for _ in range(a.eager):
        step()
    s.synchronize()
    sys.exit(0)
res = {}
for parts in ("plan", "w13", "w2", "all"):
    run = lambda: step(parts)  # noqa: E731
    res[parts] = eager_time(run, s, 1, simulator=True) if a.small else graph_time(run, s, a.reps)
bytes_w13 = 2 * K * (S + (P if plane is not None else 0))
bytes_w2 = K * (S + (P if plane is not None else 0))
us = {k: round(v * 1e6, 2) for k, v in res.items()}
w13 = res["w13"] - res["plan"]
w2 = res["w2"] - res["plan"]


def _attr(f):
    """A compiled kernel's attribute (per signature), for the record; the error's text when numba cannot say."""
    try:
        v = f()
        return {str(k): int(x) for k, x in v.items()} if isinstance(v, dict) else int(v)
    except Exception as exc:  # noqa: BLE001  (a probe: report, do not stop)
        return repr(exc)


def _only(v):
    """The value of a one-signature attribute dict (what the probe compiled), else v as it is."""
    return next(iter(v.values())) if isinstance(v, dict) and len(v) == 1 else v


kern = vq.vq_gemv_kernel
print(json.dumps(dict(bits=a.bits, rg=a.rg or vq.RG_PER_UNIT, threads=vq.THREADS, prefetch=a.prefetch or vq.PREFETCH,
                      us=us,
                      regs=_only(_attr(lambda: kern.get_regs_per_thread())),
                      local_bytes=_only(_attr(lambda: kern.get_local_mem_per_thread())), w13_us=round(w13 * 1e6, 2),
                      w2_us=round(w2 * 1e6, 2), w13_gbps=round(bytes_w13 / w13 / 1e9, 1),
                      w2_gbps=round(bytes_w2 / w2 / 1e9, 1),
                      layer_gbps=round((bytes_w13 + bytes_w2) / res["all"] / 1e9, 1),
                      checksum=float(np.abs(o2.copy_to_host()).sum()))), flush=True)

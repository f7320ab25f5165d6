"""Dev probe on the GPU (not a benchmark of record): the mHC kernels of one decode token at V4.1's shapes (hidden
5,120, four streams), per call from a CUDA graph of many calls, in these forms:

    python bench/dev/hc_probe.py                      # every form
    python bench/dev/hc_probe.py --forms mixes --calls 2 --eager     # a few eager calls, for Nsight Compute

- `mixes`: kernels.hc.hc_mixes as the engine's decode calls it (hc_mix_fused_kernel: 160 blocks of partial sums,
  the last block to take a ticket sums them and runs the 20 Sinkhorn rounds), its weights fn (1.97 MB) cold: copies
  cycled past L2;
- `post_moe`: kernels.hc.hc_post of the MoE's terms (hc_post_moe_kernel: the combine of 6 experts and the shared
  expert, then the expand, in place on the state), its operands hot (in the step they were just written);
- `post`: kernels.hc.hc_post of a sub-layer output (hc_post_kernel), hot;
- `empty`: a kernel of one block that does nothing (a graph node's own cost, to subtract).
The whole-step trace (BENCHMARKS.md, fortieth session: H200, PDL off) gave hc_mix_fused_kernel 13.2 us a call on a
side stream (beside the attention's score kernel and the router, which it slows) and hc_post_moe_kernel 5.3 us on
the chain. The probe's graph has no programmatic edges, so loads a kernel issues before its grid entry do not
overlap a predecessor here (the whole step shows that). One JSON line a form.
"""
import argparse
import json
import math
import os
import sys

sys.path.insert(0, ".")
from bench.timing import empty_node, probe_time, use_simulator  # noqa: E402
if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":    # a tiny --eager check on the CPU: the warp-intrinsic shim
    use_simulator()
import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402

from kernels import hc  # noqa: E402


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=5120)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--iters", type=int, default=20, help="Sinkhorn rounds")
    ap.add_argument("--forms", default="mixes,post_moe,post,empty")
    ap.add_argument("--cold-bytes", type=float, default=240e6, help="bytes of weight copies cycled (past L2)")
    ap.add_argument("--calls", type=int, default=0, help="calls a graph (0: enough to cycle the copies 4 times)")
    ap.add_argument("--eager", action="store_true", help="eager calls only (for Nsight Compute), no timing")
    a = ap.parse_args(argv)
    s = cuda.stream()
    rng = np.random.default_rng(0)
    D, K, S = a.dim, a.top_k, hc.HC
    fn_bytes = hc.N_MIX * S * D * 4
    copies = max(1, math.ceil(a.cold_bytes / fn_bytes))
    fns = [cuda.to_device((rng.standard_normal((hc.N_MIX, S * D)) * 0.02).astype(np.float32), stream=s)
           for _ in range(copies)]
    h = cuda.to_device(rng.standard_normal((1, S, D)).astype(np.float32), stream=s)
    base = cuda.to_device((rng.standard_normal(hc.N_MIX) * 0.5).astype(np.float32), stream=s)
    scale = cuda.to_device(np.array([0.7, 1.3, 2.0], np.float32), stream=s)
    mix = (cuda.device_array((1, S), np.float32, stream=s), cuda.device_array((1, S), np.float32, stream=s),
           cuda.device_array((1, S, S), np.float32, stream=s))
    ye = cuda.to_device(rng.standard_normal((K, D)).astype(np.float32), stream=s)
    ids = cuda.to_device(np.sort(rng.choice(384, K, replace=False))[::-1].astype(np.int32)[None], stream=s)
    shared = cuda.to_device(rng.standard_normal((1, D)).astype(np.float32), stream=s)
    y = cuda.to_device(rng.standard_normal((1, D)).astype(np.float32), stream=s)
    post = cuda.to_device(rng.uniform(0.1, 2.0, (1, S)).astype(np.float32), stream=s)
    comb = cuda.to_device(np.full((1, S, S), 0.25, np.float32), stream=s)      # doubly stochastic: no growth
    scratch = {}
    it = [0]

    def mixes():
        hc.hc_mixes(h, fns[it[0] % copies], base, scale, norm_eps=1e-6, hc_eps=1e-6, iters=a.iters, out=mix,
                    scratch=scratch, stream=s)
        it[0] += 1

    def post_moe():
        hc.hc_post(None, h, post, comb, out=h, moe=(ye, ids, shared), stream=s)

    def post_y():
        hc.hc_post(y, h, post, comb, out=h, stream=s)

    def empty():
        empty_node(hc.THREADS, s)
    forms = {"mixes": mixes, "post_moe": post_moe, "post": post_y, "empty": empty}
    for name in a.forms.split(","):
        it[0] = 0
        reps, us = probe_time(forms[name], s, a.eager, a.calls, copies if name == "mixes" else 1)
        print(json.dumps({"form": name, "dim": D, "top_k": K, "copies": copies if name == "mixes" else 1,
                          "calls": reps, "us_per_call": None if us is None else round(us, 2),
                          "comb_sum": float(np.float64(mix[2].copy_to_host()).sum()),
                          "h_sum": float(np.float64(h.copy_to_host()).sum())}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

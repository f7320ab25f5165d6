"""Dev probe on the GPU (not a benchmark of record): the router of one decode token at V4.1's shapes, cold (gate
copies cycled past L2), per call from a CUDA graph of many calls, in four forms:

    python bench/dev/route_probe.py                    # E = 160 (the H100 runs' --experts 160) and 384 (V4.1)
    python bench/dev/route_probe.py --experts 384 --calls 2 --eager   # a few eager calls, for Nsight Compute:
    ncu --clock-control none -k regex:route --launch-skip 1 --launch-count 1 python bench/dev/route_probe.py \\
        --experts 160 --calls 2 --eager

- `fused`: kernels.moe.route as the engine calls it (route_gemv_kernel: the gate's GEMV, then the routing in the
  block that draws the last ticket, with the VQ plan);
- `split`: the same with ROUTE_IN_GEMV off (kernels.gemv's GEMV, then route_topk_kernel);
- `gemv`: the gate's GEMV alone (kernels.gemv.gemv, FP32 out);
- `topk`: route_topk_kernel alone on logits already made;
- `empty`: a kernel of one block that does nothing (the graph's cost of a node, to subtract).
The whole-step trace (BENCHMARKS.md, thirty-eighth session) gave route_gemv_kernel 21.6 us a call on an H100 with 160
experts, where the H200's table had 10.9 with 384: this says which part takes the time. One JSON line a form.
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

import kernels.moe as moe  # noqa: E402
from kernels.gemv import gemv  # noqa: E402
from kernels.vq_gemv import vq_plan  # noqa: E402


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", default="160,384", help="comma-separated router sizes")
    ap.add_argument("--dim", type=int, default=5120)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--forms", default="fused,split,gemv,topk")
    ap.add_argument("--calls", type=int, default=0, help="calls a graph (0: enough to cycle the copies 4 times)")
    ap.add_argument("--eager", action="store_true", help="eager calls only (for Nsight Compute), no timing")
    a = ap.parse_args(argv)
    s = cuda.stream()
    rng = np.random.default_rng(0)
    D, K = a.dim, a.top_k
    for E in (int(v) for v in a.experts.split(",")):
        nbytes = E * D * 2
        copies = max(1, math.ceil(240e6 / nbytes))
        gates = [cuda.to_device(rng.integers(0x3C00, 0x3D00, (E, D), dtype=np.uint16) ^
                                rng.integers(0, 2, (E, D), dtype=np.uint16) << 15, stream=s) for _ in range(copies)]
        x = cuda.to_device(rng.standard_normal((1, D)).astype(np.float32), stream=s)
        bias = cuda.to_device((rng.standard_normal(E) * 0.01).astype(np.float32), stream=s)
        ids0 = cuda.to_device(np.arange(K, dtype=np.int32).reshape(1, K), stream=s)
        plan = vq_plan(ids0, E, stream=s)
        out = (cuda.device_array((1, E), np.float32, stream=s), cuda.device_array((1, K), np.int32, stream=s),
               cuda.device_array((1, K), np.float32, stream=s))
        logits = cuda.to_device(rng.standard_normal((1, E)).astype(np.float32), stream=s)
        glog = cuda.device_array((1, E), np.float32, stream=s)
        scratch = {}
        it = [0]

        def fused():
            moe.route(x, gates[it[0] % copies], bias, K, 2.5, plan=plan, out=out, scratch=scratch, stream=s)
            it[0] += 1

        def split():
            moe.ROUTE_IN_GEMV = False
            try:
                fused()
            finally:
                moe.ROUTE_IN_GEMV = True

        def gemv_only():
            gemv(x, gates[it[0] % copies], out_bf16=False, out=glog, stream=s)
            it[0] += 1

        def topk_only():
            moe.route_topk_kernel[1, moe.THREADS, s](logits, bias, bias, False, np.float32(1.0), K, np.float32(2.5),
                                                     True, *out, True, plan.pairs, plan.tiles, plan.n_tiles)
        def empty():
            empty_node(moe.THREADS, s)
        forms = {"fused": fused, "split": split, "gemv": gemv_only, "topk": topk_only, "empty": empty}
        for name in a.forms.split(","):
            it[0] = 0
            reps, us = probe_time(forms[name], s, a.eager, a.calls, copies)
            if us is None:
                continue
            print(json.dumps({"form": name, "experts": E, "dim": D, "top_k": K, "copies": copies, "calls": reps,
                              "us_per_call": round(us, 2), "gate_gbps": round(nbytes / us / 1e3, 1)
                              if name in ("fused", "split", "gemv") else None,
                              "ids": out[1].copy_to_host().tolist()[0]}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

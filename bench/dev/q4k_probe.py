"""Dev probe on the H200 (not a benchmark of record): the q4_K decode GEMV (the launcher's deep kernel) on V4.1
shapes, cold (copies cycled past L2), eager calls only, for Nsight Compute:

    ncu --clock-control none -k regex:q4k --launch-skip 2 --launch-count 1 python bench/dev/q4k_probe.py --shape wo_b
    python bench/dev/q4k_probe.py --time          # every shape: µs per call, cold, CUDA-graph replay (JSON lines)
    python bench/dev/q4k_probe.py --time --mode mma   # the FP8 tensor-core path (q4k_mma) on FP8-grid activations
        (fp8_input), IM_FP8_MIN_* raised here so that it takes them
    python bench/dev/q4k_probe.py --check         # tensor-core vs FMA kernel vs float64 reference, 512 rows a shape
    python bench/dev/q4k_probe.py --time --mode mma --targets 264,528,1056   # the same per MMA_TARGET_BLOCKS value
    python bench/dev/q4k_probe.py --time --mode mma --rings 0,1,2   # the same per weight-ring depth (decode kernel;
        --mode imma: the integer path's)
    python bench/dev/q4k_probe.py --time --mode imma --dp 0/1,4/0,4   # the one-token integer kernel: imma, then
        kernels.q4k_dp4a's per (PIPE, MIN_BLOCKS) variant, with whether each gives the first one's bits
    python bench/dev/q4k_probe.py --time --mode imma --shapes head,wo_a --im 2,3/4,2   # FP32 activations on the integer
        tensor-core path (q4k_imma), per decode-kernel variant (super-blocks a batch, min blocks per SM); --mode deep
        times the FMA kernel the same calls took before it
    python bench/dev/q4k_probe.py --check --mode imma   # integer tensor-core path vs FMA kernel vs float64, FP32 inputs
    python bench/dev/q4k_probe.py --check --mode mma --save DIR   # also keep the outputs, to compare two trees' bits
    python bench/dev/q4k_probe.py --time --mode imma8   # FP8-grid inputs (fp8_input) on the integer path, every shape
        (the engine's default: kernels.q4k_gemv.IM_FP8_MIN_* = 0, BENCHMARKS.md, thirty-seventh session); --mode mma
        times them on q4k_mma, where the engine takes them only with IM_FP8_MIN_* raised
"""
import argparse
import itertools
import math
import sys

sys.path.insert(0, ".")
import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402

import kernels.q4k_gemv as qk  # noqa: E402
from kernels.q4k_gemv import q4k_gemv  # noqa: E402
from kernels.synth_fill import synth_fill  # noqa: E402

SHAPES = {"wq_a": (1280, 5120), "wq_b": (32768, 1280), "wo_b": (5120, 8192), "shared_w1": (2304, 5120),
          "head": (129280, 5120), "wkv": (512, 5120), "wo_a": (8192, 4096), "shared_w2": (5120, 2304)}
ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="wo_b", choices=sorted(SHAPES))
ap.add_argument("--calls", type=int, default=6)
ap.add_argument("--time", action="store_true")
ap.add_argument("--mode", default="deep", choices=["deep", "mma", "imma", "imma8"])
ap.add_argument("--shapes", default=None, help="comma list of shapes for --time / --check (default all)")
ap.add_argument("--im", default=None,
                help="'/'-separated BATCH,MIN_BLOCKS variants of q4k_imma_t1_kernel (--mode imma)")
ap.add_argument("--check", action="store_true")
ap.add_argument("--save", default=None,
                help="with --check: also write each shape's tensor-core outputs to SAVE/MODE_SHAPE.npy (to compare the "
                     "bits of two kernel trees)")
ap.add_argument("--targets", default=None, help="comma list of MMA_TARGET_BLOCKS values to time (--time --mode mma)")
ap.add_argument("--dp", default=None,
                help="'/'-separated variants of the integer path's one-token kernel to time (--time; --mode imma or "
                     "imma8): 0 = q4k_imma_t1_kernel (USE_DP4A off), PIPE,MIN_BLOCKS[,TILES[,X_SHARED]] = "
                     "kernels.q4k_dp4a's kernel built with those; each line also says whether its output has the "
                     "first variant's bits")
ap.add_argument("--rings", default=None,
                help="comma list of weight-ring depths of the one-token kernel to time (--time; --mode mma: "
                     "q4k_mma's, MMA_RING; imma / imma8: q4k_imma's, IM_RING; 0: the register path)")
a = ap.parse_args()
if a.shapes:
    SHAPES = {k: v for k, v in SHAPES.items() if k in a.shapes.split(",")}
IM_MODE = a.mode in ("imma", "imma8")                     # (--rings: the integer path's one-token kernel)
qk.USE_IMMA = IM_MODE                                      # deep: the FMA kernel FP32 inputs took before q4k_imma
qk.IM_FP8_MIN_ROWS = 0 if a.mode == "imma8" else 1 << 30   # imma8: FP8-grid inputs on the integer path, any shape
qk.IM_FP8_MIN_SB = 0 if a.mode == "imma8" else 1 << 30     # (the module's default); the other modes: on q4k_mma
IM_VARIANTS = [tuple(int(v) for v in iv.split(",")) for iv in a.im.split("/")] if a.im else [None]
RINGS = [int(v) for v in a.rings.split(",")] if a.rings else [None]
if IM_MODE and (a.im or a.rings) and not a.dp:
    qk.USE_DP4A = False                                    # --im / --rings vary the imma one-token kernel
DP_VARIANTS = [tuple(int(v) for v in dv.split(",")) for dv in a.dp.split("/")] if a.dp else [None]
DP_KERNELS = {}


def set_dp(dv):
    """Point q4k_gemv at the one-token integer kernel of --dp variant dv (None: leave the defaults)."""
    if dv is None:
        return
    import kernels.q4k_dp4a as dp
    qk.USE_DP4A = dv != (0,)
    if dv != (0,):
        if dv not in DP_KERNELS:
            DP_KERNELS[dv] = dp._make_dp_kernel(pipe=bool(dv[0]), min_blocks=dv[1], tiles=(dv + (1,))[2],
                                                x_shared=bool((dv + (1, 1))[3]))
        dp.q4k_dp_t1_kernel = DP_KERNELS[dv]
RING_KERNELS = {}
if a.check:
    import json

    from ds4lib.formats.floats import round_bf16
    from ds4lib.formats.q4k import dequantize_q4k
    from kernels.gemv import act_quant_fp8
    s = cuda.stream()
    for name, (N, K) in sorted(SHAPES.items()):
        if name == "wo_a" and a.mode != "imma":
            continue                                       # grouped rows: FP32 activations, no FP8 path
        n = min(N, 512)
        w = cuda.device_array((n, K // 256 * 144), np.uint8, stream=s)
        synth_fill(w, "q4_K", key=7, sigma=K ** -0.5, k=K, stream=s)
        if a.mode == "imma":                               # FP32 x; wo_a: 512 rows of group 0 (K of its slice)
            xq = cuda.to_device(np.random.default_rng(1).standard_normal((1, K)).astype(np.float32) * 3, stream=s)
            qk.USE_IMMA = True
            mma = q4k_gemv(xq, w, quantize=False, out_bf16=False, stream=s).copy_to_host()
            qk.USE_IMMA = False
        else:                                              # mma / imma8: FP8-grid x on its tensor-core path
            x = cuda.to_device(round_bf16(np.random.default_rng(1).standard_normal((1, K)) * 3).astype(np.float32),
                               stream=s)
            xq = act_quant_fp8(x, stream=s)
            qk.USE_IMMA = a.mode == "imma8"
            mma = q4k_gemv(xq, w, quantize=False, fp8_input=True, out_bf16=False, stream=s).copy_to_host()
            qk.USE_IMMA = False
        if a.save:
            import os
            os.makedirs(a.save, exist_ok=True)
            np.save(os.path.join(a.save, f"{a.mode}_{name}.npy"), mma[0])
        fma = q4k_gemv(xq, w, quantize=False, out_bf16=False, stream=s).copy_to_host()
        ref = dequantize_q4k(w.copy_to_host()).astype(np.float64) @ xq.copy_to_host()[0].astype(np.float64)
        scale = np.sqrt(np.mean(ref ** 2))
        row = {"name": name, "rows": n, "K": K}
        for tag, got in ((a.mode if a.mode != "deep" else "mma", mma[0]), ("fma", fma[0])):
            err = got.astype(np.float64) - ref
            row[tag] = {"nmse": float(np.mean(err ** 2) / scale ** 2), "max_rel": float(np.max(np.abs(err)) / scale),
                        "bf16_flips": float(np.mean(round_bf16(got) != round_bf16(ref.astype(np.float32))))}
        print(json.dumps(row), flush=True)
    sys.exit(0)
if a.time:
    import json
    from kernels.gemv import act_quant_fp8
    from bench.timing import graph_time
    s = cuda.stream()
    for name, (N, K) in sorted(SHAPES.items()):
        rpg = 1024 if name == "wo_a" else None
        G = 1 if rpg is None else N // rpg
        nbytes = N * K // 256 * 144
        copies = max(1, math.ceil(240e6 / nbytes))
        ws = []
        for c in range(copies):
            w = cuda.device_array((N, K // 256 * 144), np.uint8, stream=s)
            synth_fill(w, "q4_K", key=100 + c, sigma=K ** -0.5, k=K, stream=s)
            ws.append(w)
        x = cuda.to_device(np.random.default_rng(0).standard_normal((1, G * K)).astype(np.float32), stream=s)
        if a.mode in ("mma", "imma8"):
            if rpg is not None:
                continue                                   # grouped wo_a: FP32 activations only
            x = act_quant_fp8(x, stream=s)
        out = cuda.device_array((1, N), np.float32, stream=s)
        scratch = {}
        it = [0]

        def call():
            q4k_gemv(x, ws[it[0] % copies], quantize=False, out_bf16=False, rows_per_group=rpg, out=out,
                     scratch=scratch, stream=s, fp8_input=a.mode in ("mma", "imma8"))
            it[0] += 1
        targets = [int(v) for v in a.targets.split(",")] if a.targets else [qk.MMA_TARGET_BLOCKS]
        first_bits = None
        for target, iv, ring, dv in itertools.product(targets, IM_VARIANTS, RINGS, DP_VARIANTS):
            qk.MMA_TARGET_BLOCKS = target
            set_dp(dv)
            if iv is not None:
                qk.q4k_imma_t1_kernel = qk._make_im_kernel(True, *iv)
            if ring is not None:
                if ring not in RING_KERNELS:
                    RING_KERNELS[ring] = (qk._make_im_kernel(True, ring=ring) if IM_MODE else
                                          qk._make_mma_kernel(True, qk.MMA_MIN_BLOCKS_T1, ring=ring))
                setattr(qk, "q4k_imma_t1_kernel" if IM_MODE else "q4k_mma_t1_kernel", RING_KERNELS[ring])
            scratch.clear()
            it[0] = 0
            call()
            s.synchronize()
            bits = out.copy_to_host().view(np.uint32).copy()
            first_bits = bits if first_bits is None else first_bits
            sec = graph_time(call, s, max(copies * 4, 40))
            print(json.dumps({"name": name, "mode": a.mode, "shape": [N, K], "copies": copies, "target": target,
                              "splits": qk.mma_splits(N, K // 256), "im": iv, "dp": dv,
                              "same_bits": bool(np.array_equal(bits, first_bits)),
                              "ring": (qk.IM_RING if IM_MODE else qk.MMA_RING) if ring is None else ring,
                              "us": round(sec * 1e6, 2), "gbps": round(nbytes / sec / 1e9, 1)}), flush=True)
        del ws
    sys.exit(0)
N, K = SHAPES[a.shape]
s = cuda.stream()
copies = max(1, math.ceil(240e6 / (N * K // 256 * 144)))
ws = []
for c in range(copies):
    w = cuda.device_array((N, K // 256 * 144), np.uint8, stream=s)
    synth_fill(w, "q4_K", key=100 + c, sigma=K ** -0.5, k=K, stream=s)
    ws.append(w)
rpg = 1024 if a.shape == "wo_a" else None
x = cuda.to_device(np.random.default_rng(0).standard_normal((1, K * (N // rpg if rpg else 1))).astype(np.float32),
                   stream=s)
out = cuda.device_array((1, N), np.float32, stream=s)
scratch = {}
if IM_VARIANTS[0] is not None:
    qk.q4k_imma_t1_kernel = qk._make_im_kernel(True, *IM_VARIANTS[0])
set_dp(DP_VARIANTS[0])
for i in range(a.calls):                                   # imma: FP32 activations, as the head and wo_a
    q4k_gemv(x, ws[i % copies], quantize=a.mode != "imma", rows_per_group=rpg, out=out, scratch=scratch, stream=s)
s.synchronize()
print("ok", a.shape, copies)

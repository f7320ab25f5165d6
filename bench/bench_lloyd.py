"""Lloyd codebook training and final assignment for ONE real-size DeepSeek V4.1 layer (issue 4 "Measure").

A V4.1 layer has 384 routed experts x 3 matrices of 2304 x 5120 (w2: 5120 x 2304) = 13.6 G weights =
1,698,693,120 vectors of 8. The quantizer spends, per layer:
  train   `rounds` Lloyd rounds (assign + exact integer update) on a pool of 1,024 vectors per codeword
          (4.19 M vectors at 12 bits, 8.39 M at 13 bits), and
  final   one assignment of every vector of the layer against the E4M3 codebook.
This script times both on synthetic weights (i.i.d. N(0, 1) vectors, i.e. rows already normalised to RMS 1;
the cost of both steps depends only on the counts) with the project's own code paths:
  --device cuda  ds4lib.quant.cuda_backend.CudaLloyd for the pool rounds (kernels/vq_assign.py,
                 kernels/vq_accumulate.py); the full layer is generated on the GPU in chunks of 2^26 vectors
                 (generation timed apart) and every chunk is assigned (and, for a full-layer Lloyd round,
                 accumulated) there.
  --device cpu   ds4lib.solvers.vq.CpuLloyd (Numba parallel). The pool rounds are measured as they are; the
                 final assignment is measured on --cpu-fraction of the layer and EXTRAPOLATED linearly (the
                 work is exactly proportional to vectors x codewords). The JSON says so ("extrapolated").
Throughput is reported in vectors x codewords per second of the assignment alone.

Prints one JSON line. Run from the repository root:
    python bench/bench_lloyd.py --device cuda      # ~1-2 min on an H200
    python bench/bench_lloyd.py --device cpu       # a few minutes on 16 cores
Add --quick for a seconds-long smoke run on a 1/64 layer (also works under NUMBA_ENABLE_CUDASIM=1 with --tiny).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import kernels  # noqa: E402,F401  (numpy 2.5 alias for numba-cuda, before anything compiles)
from numba import cuda  # noqa: E402
from ds4lib.solvers.vq import (DEFAULT_ROUNDS, POOL_PER_CODEWORD, CpuLloyd, prepare_codebook,  # noqa: E402
                               train_codebook)

EXPERTS, ROWS, COLS = 384, 2304, 5120
LAYER_VECTORS = EXPERTS * 3 * ROWS * COLS // 8          # 1,698,693,120
CHUNK = 1 << 26


def _host_normal(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 8), dtype=np.float32)


@cuda.jit
def normal_kernel(out, seed, offset):
    """out[i, :] = 8 N(0, 1) values from a counter-based hash (splitmix64) of (seed, offset + i)."""
    i = cuda.grid(1)
    if i < out.shape[0]:
        ctr = (np.uint64(offset) + np.uint64(i)) * np.uint64(4) + np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15)
        for q in range(4):
            z = ctr + np.uint64(q) + np.uint64(0x9E3779B97F4A7C15)
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            z = z ^ (z >> np.uint64(31))
            u1 = (np.float64(z >> np.uint64(40)) + 1.0) * (1.0 / 16777216.0)          # (0, 1]
            u2 = np.float64(z & np.uint64(0xFFFFFF)) * (1.0 / 16777216.0)             # [0, 1)
            r = math.sqrt(-2.0 * math.log(u1))
            out[i, 2 * q] = np.float32(r * math.cos(6.283185307179586 * u2))
            out[i, 2 * q + 1] = np.float32(r * math.sin(6.283185307179586 * u2))


def _time_train(pool, k, rounds, backend):
    """Per-round time of train_codebook on `pool` (one warm-up round excluded)."""
    train_codebook(pool[: max(k, 256)], k, 1, backend)                   # JIT / transfer warm-up
    t = time.perf_counter()
    res = train_codebook(pool, k, rounds, backend)
    return (time.perf_counter() - t) / max(rounds, 1), res


def bench_cuda(bits_list, rounds, layer_vectors, full_round, chunk, per_codeword):
    from ds4lib.quant.cuda_backend import CudaLloyd
    from kernels.vq_accumulate import vq_accumulate
    from kernels.vq_assign import vq_assign
    be = CudaLloyd()
    dev = cuda.get_current_device()
    name = getattr(dev, "name", b"CUDA simulator")
    out = {"gpu": name.decode() if isinstance(name, bytes) else str(name)}
    t = time.perf_counter()
    d_tmp = cuda.device_array((256, 8), np.float32)
    normal_kernel[1, 256](d_tmp, 1, 0)
    p0 = prepare_codebook(np.ones((16, 8), np.float32))
    vq_assign(d_tmp, cuda.to_device(p0.cbm2), cuda.to_device(p0.cnorm))
    vq_accumulate(d_tmp, cuda.to_device(np.zeros(256, np.int32)), 16)
    cuda.synchronize()
    out["compile_s"] = time.perf_counter() - t
    for bits in bits_list:
        k = 1 << bits
        pool = _host_normal(per_codeword * k, seed=bits)
        per_round, res = _time_train(pool, k, rounds, be)
        prep = prepare_codebook(res.codebook)
        d_cb, d_cn = cuda.to_device(prep.cbm2), cuda.to_device(prep.cnorm)
        d_x = cuda.device_array((chunk, 8), np.float32)
        d_idx_all = cuda.device_array(chunk, np.int32)
        gen_s = assign_s = acc_s = 0.0
        done = 0
        while done < layer_vectors:
            n = min(chunk, layer_vectors - done)
            xs = d_x[:n]
            cuda.synchronize()
            t = time.perf_counter()
            normal_kernel[(n + 255) // 256, 256](xs, 7, done)
            cuda.synchronize()
            gen_s += time.perf_counter() - t
            t = time.perf_counter()
            d_idx = vq_assign(xs, d_cb, d_cn, out=d_idx_all[:n])
            cuda.synchronize()
            assign_s += time.perf_counter() - t
            if full_round:
                t = time.perf_counter()
                sums, counts = vq_accumulate(xs, d_idx, k)
                sums.copy_to_host()
                acc_s += time.perf_counter() - t
            done += n
        r = {"codewords": k, "pool_vectors": int(pool.shape[0]), "rounds_measured": rounds,
             "train_s_per_round": per_round, f"train_s_{DEFAULT_ROUNDS}_rounds": per_round * DEFAULT_ROUNDS,
             "layer_vectors": int(layer_vectors), "final_assign_s": assign_s, "generate_s": gen_s,
             "assign_vec_cw_per_s": layer_vectors * k / assign_s,
             "layer_total_s": per_round * DEFAULT_ROUNDS + assign_s, "extrapolated": False}
        if full_round:
            r["full_layer_accumulate_s"] = acc_s
            r["full_layer_lloyd_round_s"] = assign_s + acc_s
        out[str(bits)] = r
    return out


def bench_cpu(bits_list, rounds, layer_vectors, fraction, per_codeword):
    import numba
    be = CpuLloyd()
    out = {"cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
           "threads": numba.get_num_threads(), "threading_layer": None}
    t = time.perf_counter()
    train_codebook(_host_normal(4096, 0), 16, 1, be)
    out["compile_s"] = time.perf_counter() - t
    out["threading_layer"] = numba.threading_layer()
    for bits in bits_list:
        k = 1 << bits
        pool = _host_normal(per_codeword * k, seed=bits)
        per_round, res = _time_train(pool, k, rounds, be)
        prep = prepare_codebook(res.codebook)
        n = max(1, int(layer_vectors * fraction))
        xs = _host_normal(n, seed=7)
        t = time.perf_counter()
        xb = be.put(xs)
        put_s = time.perf_counter() - t
        t = time.perf_counter()
        be.assign(xb, prep)
        assign_s = time.perf_counter() - t
        scale = layer_vectors / n
        out[str(bits)] = {
            "codewords": k, "pool_vectors": int(pool.shape[0]), "rounds_measured": rounds,
            "train_s_per_round": per_round, f"train_s_{DEFAULT_ROUNDS}_rounds": per_round * DEFAULT_ROUNDS,
            "layer_vectors": int(layer_vectors), "measured_vectors": n, "final_assign_s": assign_s * scale,
            "final_put_s": put_s * scale, "assign_vec_cw_per_s": n * k / assign_s,
            "layer_total_s": per_round * DEFAULT_ROUNDS + (assign_s + put_s) * scale,
            "extrapolated": scale > 1, "extrapolation_factor": scale}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), required=True)
    ap.add_argument("--bits", type=int, nargs="+", default=[12, 13])
    ap.add_argument("--rounds", type=int, default=4, help="Lloyd rounds timed on the pool (per-round time reported)")
    ap.add_argument("--cpu-fraction", type=float, default=1 / 128,
                    help="CPU: share of the layer assigned for real; the rest is extrapolated")
    ap.add_argument("--no-full-round", action="store_true", help="CUDA: skip the full-layer accumulate")
    ap.add_argument("--pool-per-codeword", type=int, default=POOL_PER_CODEWORD)
    ap.add_argument("--quick", action="store_true", help="1/64 of a layer, 1 round (smoke run)")
    ap.add_argument("--tiny", action="store_true", help="600 vectors, 32 codewords (simulator smoke run)")
    args = ap.parse_args(argv)
    layer_vectors, rounds = LAYER_VECTORS, args.rounds
    if args.quick:
        layer_vectors, rounds = LAYER_VECTORS // 64, 1
    chunk, bits, ppc, frac = CHUNK, args.bits, args.pool_per_codeword, args.cpu_fraction
    if args.tiny:
        layer_vectors, rounds, chunk, bits, ppc, frac = 600, 1, 512, [5], 4, 1.0
    t0 = time.perf_counter()
    if args.device == "cuda":
        res = bench_cuda(bits, rounds, layer_vectors, not args.no_full_round, chunk, ppc)
    else:
        res = bench_cpu(bits, rounds, layer_vectors, frac, ppc)
    rec = {"bench": "lloyd_real_layer", "device": args.device, "pool_per_codeword": ppc,
           "layer": {"experts": EXPERTS, "matrices": 3, "shape": [ROWS, COLS], "vectors": LAYER_VECTORS,
                     "vectors_timed": layer_vectors},
           "quick": bool(args.quick or args.tiny), "python": platform.python_version(),
           "numpy": np.__version__, "simulator": os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"),
           "wall_s": None, **res}
    rec["wall_s"] = time.perf_counter() - t0
    print(json.dumps(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())

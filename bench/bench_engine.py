"""Measure the engine's quantised-weight GEMVs on ONE real-size V4.1 layer, ds4-tiny end to end, and CUDA-vs-CPU
agreement. Prints one JSON line per measurement.

    python bench/bench_engine.py                                   # every section on the GPU
    python bench/bench_engine.py --only copy,vq,q4k --reps 100     # kernel sections only
    python bench/bench_engine.py --only tiny,agreement --base cache/ds4-tiny-base.gguf --engram-dir models/ds4-tiny
    python bench/bench_engine.py --small --only copy,vq,q4k        # no GPU: the simulator, tiny shapes (smoke run)

Sections:
- copy: device-to-device copy of 1 GiB (read + write counted): the bandwidth the GEMVs are judged against.
- vq: kernels.vq_gemv on synthetic weights at the real shapes (384 experts x w1, w3: 2304 x 5120, w2: 5120 x 2304;
  12- and 13-bit; E4M3 codebook, f16 gains, sidecar gains on w2), 6 active experts for one token (decode) and 4
  tokens (24 pairs, two-row tiles). bytes = the index stream (+ bit plane) and gains of the experts touched, x and
  the outputs; time = the GEMV kernel + its finalize (CUDA graph replay when capture works, else eager).
- q4k: kernels.q4k_gemv at the V4.1 attention projections (wq_a 1280x5120, wq_b 32768x1280, wkv 512x5120,
  wo_b 5120x8192), the shared expert (w1/w3 2304x5120, w2 5120x2304) and the output head (129280x5120, FP32 out),
  synthetic q4_K blocks (random nibbles and scales, fixed finite d/dmin); bytes = blocks + x + out.
- tiny: ds4-tiny through Engine(backend="cuda"): prefill tokens/s (512-token prompt, one chunk) and decode tokens/s
  (greedy, device sampling, the token read back each step), eager launches.
- agreement: CUDA vs CPU backend top-1 agreement and logit differences on the judging slices (`--windows` windows of
  each slice, each BOS + the window's tokens, prefill path; positions counted), the CPU margin of every
  disagreement, and the agreement over positions that are not near-ties.
- layers: per-layer, per-tensor differences between the backends on one window (observer hooks).
- profile: cProfile of 32 decode steps (host time per call site).
Each JSON line has "section"; GB/s lines carry pct_of_copy against the copy line.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="copy,vq,q4k,tiny,agreement", help="comma-separated sections")
    p.add_argument("--reps", type=int, default=None, help="repetitions per timing (default 100; 1 with --small)")
    p.add_argument("--small", action="store_true", help="CUDA simulator, tiny shapes (kernel sections)")
    p.add_argument("--base", default=str(ROOT / "cache" / "ds4-tiny-base.gguf"), help="ds4-tiny base GGUF")
    p.add_argument("--engram-dir", default=str(ROOT / "models" / "ds4-tiny"), help="ds4-tiny checkpoint dir")
    p.add_argument("--windows", type=int, default=3, help="judging windows per slice (agreement)")
    p.add_argument("--decode-tokens", type=int, default=128)
    return p.parse_args(argv)


ARGS = _args() if __name__ == "__main__" else _args(["--small"])
sys.path.insert(0, str(ROOT))
from bench.timing import eager_time, graph_time, use_simulator  # noqa: E402

if ARGS.small:
    use_simulator()                                     # before the first numba.cuda import

import numpy as np                                      # noqa: E402

import kernels                                          # noqa: E402,F401  (numpy 2.5 alias before compiling)
from numba import cuda                                  # noqa: E402

from ds4lib.formats.q4k import Q4K_BLOCK_BYTES, QK_K  # noqa: E402
from kernels import gemv, q4k_gemv, vq_gemv            # noqa: E402

COPY_GBPS = [None]


def emit(rec):
    if COPY_GBPS[0] and rec.get("gbps"):
        rec["pct_of_copy"] = round(100 * rec["gbps"] / COPY_GBPS[0], 1)
    print(json.dumps(rec), flush=True)
    return rec


# ------------------------------------------------------------------------------------------ device data
@cuda.jit
def _fill_u32_kernel(out, seed):
    """out[i] = a 32-bit hash of (seed, i)."""
    i = cuda.grid(1)
    if i < out.shape[0]:
        x = (np.uint64(i) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed)) & np.uint64(0xFFFFFFFFFFFFFFFF)
        x = (x ^ (x >> np.uint64(31))) * np.uint64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> np.uint64(29))
        out[i] = np.uint32(x & np.uint64(0xFFFFFFFF))


@cuda.jit
def _q4k_headers_kernel(w16, words_per_block):
    """Set every super-block's d and dmin (first two f16 of its 144 bytes) to fixed finite values."""
    i = cuda.grid(1)
    if i < w16.shape[0] // words_per_block:
        w16[i * words_per_block] = np.uint16(0x1C00)          # d = 2^-8
        w16[i * words_per_block + 1] = np.uint16(0x1800)      # dmin = 2^-9


def random_bytes(nbytes, seed):
    n32 = -(-nbytes // 4)
    if ARGS.small:
        return cuda.to_device(np.random.default_rng(seed).integers(0, 256, 4 * n32, dtype=np.uint8))
    arr = cuda.device_array(n32, np.uint32)
    _fill_u32_kernel[(n32 + 255) // 256, 256](arr, seed)
    return arr.view(np.uint8)


def random_q4k(rows, k, seed):
    nbytes = rows * (k // QK_K) * Q4K_BLOCK_BYTES
    w = random_bytes(nbytes, seed)[:nbytes]
    nb = nbytes // Q4K_BLOCK_BYTES
    _q4k_headers_kernel[(nb + 255) // 256, 256](w.view(np.uint16), Q4K_BLOCK_BYTES // 2)
    return w.reshape(rows, nbytes // rows)


# ------------------------------------------------------------------------------------------------ timing
def timed(section, name, shape, nbytes, run, stream, reps, **extra):
    run()                                                 # compile, allocate the scratch
    cuda.synchronize()
    rec = {"section": section, "name": name, "shape": shape, "bytes": int(nbytes), **extra}
    eager = eager_time(run, stream, reps, simulator=ARGS.small)
    rec["eager_us"] = round(eager * 1e6, 2)
    t, rec["mode"] = eager, "simulator" if ARGS.small else "eager"
    if not ARGS.small:
        try:
            t, rec["mode"] = graph_time(run, stream, reps), "graph"
        except Exception as e:                            # noqa: BLE001 - reported, eager timing kept
            rec["graph_error"] = f"{type(e).__name__}: {e}"[:200]
    rec["time_us"] = round(t * 1e6, 3)
    rec["gbps"] = round(nbytes / t / 1e9, 1) if t > 0 else None
    return emit(rec)


# --------------------------------------------------------------------------------------------- sections
def section_copy(stream, reps):
    n = (1 << 18) if ARGS.small else (1 << 28)
    a, b = cuda.device_array(n, np.float32), cuda.device_array(n, np.float32)
    rec = timed("copy", "device_copy", f"{4 * n} bytes D2D", 8 * n, lambda: b.copy_to_device(a, stream=stream),
                stream, max(1, reps // 10))
    COPY_GBPS[0] = rec["gbps"]


def vq_layer(n_exp, rows_f, dim, bits, seed):
    """Synthetic VQ layer, random bytes in the device layout: (codebook words, index, plane, gains, sidecar scale)."""
    rng = np.random.default_rng(seed)
    s, p = vq_gemv.device_stream_bytes((rows_f, dim), (dim, rows_f))
    index = random_bytes(n_exp * 3 * s, seed + 1)[:n_exp * 3 * s].reshape(n_exp, 3, s)
    plane = random_bytes(n_exp * 3 * p, seed + 2)[:n_exp * 3 * p].reshape(n_exp, 3, p) if bits == 13 else None
    codes = rng.integers(0, 255, (1 << bits, 8)).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E                  # no NaN codes
    cb = vq_gemv.vq_codebook(cuda.to_device(codes))
    gains = tuple(cuda.to_device((rng.uniform(0.5, 1.5, (n_exp, r)) * 0.02).astype(np.float16).view(np.uint16))
                  for r in (rows_f, dim, rows_f))
    scale = cuda.to_device(rng.uniform(0.9, 1.1, (n_exp, dim)).astype(np.float32))
    return cb, index, plane, gains, scale, s, p


def section_vq(stream, reps):
    from ds4lib.config import ModelConfig
    cfg = ModelConfig.v41_flash()
    E, F, D, K = cfg.n_routed_experts, cfg.moe_inter_dim, cfg.dim, cfg.n_activated_experts
    if ARGS.small:
        E, F, D, K = 8, 64, 256, 2
    rng = np.random.default_rng(0)
    for bits in (12, 13):
        _vq_layer_timings(stream, reps, rng, E, F, D, K, bits)
        if not ARGS.small:
            cuda.current_context().deallocations.clear()          # free the 2.6 GB layer before the next


def _vq_layer_timings(stream, reps, rng, E, F, D, K, bits):
    """The VQ GEMV timings of one synthetic layer at `bits` (its device arrays die with this call)."""
    cb, index, plane, gains, scale, s, p = vq_layer(E, F, D, bits, 100 + bits)
    for T in (1, 4):
        ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)
        n_touched = len(np.unique(ids))
        d_ids = cuda.to_device(ids)
        plan = vq_gemv.vq_plan(d_ids, E, tile_rows=min(T * K, vq_gemv.TILE_MAX), stream=stream)
        x = gemv.act_quant_fp8(cuda.to_device(rng.standard_normal((T, D)).astype(np.float32)))
        a = gemv.act_quant_fp8(cuda.to_device(rng.standard_normal((T * K, F)).astype(np.float32)))
        scr = {}
        out13 = cuda.device_array((2, T * K, F), np.float32)
        out2 = cuda.device_array((1, T * K, D), np.float32)
        b13 = n_touched * 2 * (s + (p if plane is not None else 0) + 2 * F) + 4 * T * D + 8 * T * K * F
        b2 = n_touched * (s + (p if plane is not None else 0) + 2 * D + 4 * D) + 4 * T * K * F + 4 * T * K * D
        tag = dict(bits=bits, tokens=T, experts_touched=n_touched)
        timed("vq", f"vq.w1w3_T{T}_{bits}bit", f"{T * K} pairs x 2 x [{F}, {D}]", b13,
              lambda: vq_gemv.vq_gemv(x, plan, cb, index, plane, gains, mats=(0, 2), shape=(F, D), x_div=K,
                                      quantize=False, out=out13, scratch=scr, stream=stream), stream, reps, **tag)
        timed("vq", f"vq.w2_T{T}_{bits}bit", f"{T * K} pairs x [{D}, {F}] + sidecar", b2,
              lambda: vq_gemv.vq_gemv(a, plan, cb, index, plane, gains, mats=(1,), shape=(D, F), scale=scale,
                                      quantize=False, out=out2, scratch=scr, stream=stream), stream, reps, **tag)
        timed("vq", f"vq.plan_T{T}", f"ids [{T}, {K}] of {E}", 4 * T * K,
              lambda: vq_gemv.vq_plan(d_ids, E, tile_rows=min(T * K, vq_gemv.TILE_MAX), out=plan, stream=stream), stream,
              reps, **tag)


def section_q4k(stream, reps):
    from ds4lib.config import ModelConfig
    cfg = ModelConfig.v41_flash()
    D, F, V = cfg.dim, cfg.moe_inter_dim, cfg.vocab_size
    shapes = [("attn.wq_a", cfg.q_lora_rank, D, True), ("attn.wq_b", cfg.n_heads * cfg.head_dim, cfg.q_lora_rank, True),
              ("attn.wkv", cfg.head_dim, D, True), ("attn.wo_b", D, cfg.o_groups * cfg.o_lora_rank, True),
              ("shared.w1", F, D, True), ("shared.w2", D, F, True), ("head_f32", V, D, False)]
    if ARGS.small:
        shapes = [(n, max(8, r // 256), max(256, k // 32 // 256 * 256), bf) for n, r, k, bf in shapes]
    rng = np.random.default_rng(1)
    for i, (name, rows, k, bf16) in enumerate(shapes):
        w = random_q4k(rows, k, 1000 + i)
        for T in ((1, 4) if name in ("attn.wq_a", "attn.wo_b") else (1,)):
            x = cuda.to_device(rng.standard_normal((T, k)).astype(np.float32))
            out = cuda.device_array((T, rows), np.float32)
            nbytes = w.size + 4 * T * k + 4 * T * rows
            timed("q4k", f"q4k.{name}_T{T}", f"[{rows}, {k}] q4_K, T={T}", nbytes,
                  lambda: q4k_gemv.q4k_gemv(x, w, quantize=False, out_bf16=bf16, out=out, stream=stream), stream, reps,
                  tokens=T)


def _tiny_engine(backend="cuda"):
    from ds4lib.engine import Engine
    return Engine(ARGS.base, engram_dir=ARGS.engram_dir, backend=backend,
                  tokenizer_path=ROOT / "data" / "tokenizer" / "tokenizer.json")


def section_tiny(stream, reps):
    from ds4lib.corpus.slices import load_slice
    from ds4lib.engine import SamplingParams
    t0 = time.perf_counter()
    eng = _tiny_engine()
    load_s = time.perf_counter() - t0
    prompt = [0] + [int(t) for t in load_slice("english/judge").tokens[0][:511]]
    t0 = time.perf_counter()
    s = eng.new_session()                                 # warm-up: compiles every kernel of both paths
    lg = eng.prefill(s, prompt[:33])
    tok = eng.backend.sample(lg, SamplingParams(temperature=0), 0, 0)
    eng.decode(s, tok)
    cuda.synchronize()
    warm_s = time.perf_counter() - t0
    times = []
    for _ in range(3):
        s = eng.new_session()
        cuda.synchronize()
        t0 = time.perf_counter()
        lg = eng.prefill(s, prompt)
        cuda.synchronize()
        times.append(time.perf_counter() - t0)
    pre = min(times)
    emit({"section": "tiny", "name": "ds4-tiny.prefill", "tokens": len(prompt), "seconds": round(pre, 4),
          "tokens_per_s": round(len(prompt) / pre, 1), "load_s": round(load_s, 2), "warmup_compile_s": round(warm_s, 2),
          "memory": eng.memory.table(), "mode": "eager"})
    p = SamplingParams(temperature=0)
    be = eng.backend
    modes = [True, False] if getattr(be, "graphs", False) else [False]
    for graphs in modes:                                   # replayed CUDA graphs, then the same steps eagerly
        be.graphs = graphs
        s = eng.new_session()
        lg = eng.prefill(s, prompt[:64])
        tok = be.sample(lg, p, 0, 0)
        n = ARGS.decode_tokens
        before = dict(getattr(be, "stats", {}))
        cuda.synchronize()
        t0 = time.perf_counter()
        for step in range(n):
            lg = eng.decode(s, tok)
            tok = be.sample(lg, p, 0, step + 1)           # the host reads back the token: a full sync per step
        dt = time.perf_counter() - t0
        stats = {k: v - before.get(k, 0) if k not in ("graph_nodes", "graph_pdl_edges") else v
                 for k, v in getattr(be, "stats", {}).items()}
        emit({"section": "tiny", "name": "ds4-tiny.decode_greedy", "tokens": n, "context_start": 64,
              "seconds": round(dt, 4), "tokens_per_s": round(n / dt, 1), "ms_per_token": round(1e3 * dt / n, 3),
              "mode": "graph" if graphs else "eager", "backend_stats": stats})
    be.graphs = modes[0]


NEAR_TIE = 0.5          # logits: a position whose CPU top-1 leads its runner-up by less is a near-tie


def section_agreement(stream, reps):
    """CUDA vs CPU top-1 on judging windows, with each disagreement's CPU margin (its top-1 logit minus the logit
    of the token CUDA chose) and the agreement over positions that are not near-ties (CPU margin >= NEAR_TIE)."""
    from ds4lib.corpus.slices import load_slice
    cpu, gpu = _tiny_engine("cpu"), _tiny_engine("cuda")
    index = json.loads((ROOT / "data" / "slices" / "index.json").read_text())
    names = sorted(n for n in _slice_names(index) if n.endswith("/judge"))
    tot = dict(same=0, n=0, clear_same=0, clear_n=0)
    all_marg = []
    for name in names:
        wins = load_slice(name).tokens[:ARGS.windows]
        same = n = clear_same = clear_n = 0
        dmax, dsum = 0.0, 0.0
        marg = []
        t0 = time.perf_counter()
        for w in wins:
            seq = [0] + [int(t) for t in w[:-1]]
            a, b = cpu.logits(seq), gpu.logits(seq)
            ta, tb = a.argmax(-1), b.argmax(-1)
            top2 = np.sort(a, -1)[:, -2:]
            clear = (top2[:, 1] - top2[:, 0]) >= NEAR_TIE
            same += int((ta == tb).sum())
            n += len(seq)
            clear_same += int((ta == tb)[clear].sum())
            clear_n += int(clear.sum())
            dis = np.nonzero(ta != tb)[0]
            marg.extend((a[dis, ta[dis]] - a[dis, tb[dis]]).tolist())
            d = np.abs(a.astype(np.float64) - b)
            dmax, dsum = max(dmax, float(d.max())), dsum + float(d.mean()) * len(seq)
        for k, v in (("same", same), ("n", n), ("clear_same", clear_same), ("clear_n", clear_n)):
            tot[k] += v
        all_marg.extend(marg)
        emit({"section": "agreement", "slice": name, "windows": len(wins), "positions": n,
              "same_top1": round(same / n, 5), "same_top1_not_near_tie": round(clear_same / max(clear_n, 1), 5),
              "positions_not_near_tie": clear_n, "disagreement_cpu_margin_p50_p90_max":
              [round(float(v), 4) for v in np.percentile(marg, [50, 90, 100])] if marg else None,
              "max_abs_logit_diff": round(dmax, 5), "mean_abs_logit_diff": round(dsum / n, 6),
              "seconds": round(time.perf_counter() - t0, 2)})
    emit({"section": "agreement", "slice": "all", "positions": tot["n"], "same_top1": round(tot["same"] / max(tot["n"], 1), 5),
          "same_top1_not_near_tie": round(tot["clear_same"] / max(tot["clear_n"], 1), 5),
          "positions_not_near_tie": tot["clear_n"], "near_tie_logits": NEAR_TIE,
          "disagreement_cpu_margin_p50_p90_p99_max":
          [round(float(v), 4) for v in np.percentile(all_marg, [50, 90, 99, 100])] if all_marg else None})


def section_layers(stream, reps):
    """Per-layer observations of one judging window on both backends: for each (layer, tensor) the largest
    difference relative to the tensor's largest magnitude and the fraction of elements that differ. Layer 0's
    attention sees identical inputs on both backends, so its figures are the kernels' own rounding differences;
    later layers add what earlier layers passed on."""
    from ds4lib.corpus.slices import load_slice
    cpu, gpu = _tiny_engine("cpu"), _tiny_engine("cuda")
    seq = [0] + [int(t) for t in load_slice("english/judge").tokens[0][:-1]]
    obs = {}

    def grab(tag):
        def observer(layer, name, value):
            obs[(tag, layer, name)] = np.array(value, dtype=np.float64)
        return observer
    cpu.logits(seq, observer=grab("cpu"))
    gpu.logits(seq, observer=grab("cuda"))
    for (tag, layer, name), a in sorted(obs.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        if tag != "cpu" or ("cuda", layer, name) not in obs:
            continue
        b = obs[("cuda", layer, name)]
        if a.shape != b.shape:
            emit({"section": "layers", "layer": layer, "tensor": name, "shape_cpu": list(a.shape),
                  "shape_cuda": list(b.shape)})
            continue
        if name in ("router_ids", "topk"):
            emit({"section": "layers", "layer": layer, "tensor": name,
                  "same_sets": round(float(np.mean([set(x) == set(y) for x, y in zip(a.astype(np.int64),
                                                                                      b.astype(np.int64))])), 5)})
            continue
        fin = np.isfinite(a) & np.isfinite(b)
        d = np.abs(a - b)[fin]
        scale = float(np.abs(a[fin]).max()) if fin.any() else 0.0
        emit({"section": "layers", "layer": layer, "tensor": name, "max_rel": round(float(d.max()) / scale, 7)
              if scale else None, "frac_diff": round(float((d > 0).mean()), 6),
              "nonfinite_mismatch": int((np.isfinite(a) != np.isfinite(b)).sum())})


def section_profile(stream, reps):
    """cProfile of 32 greedy decode steps of ds4-tiny on the CUDA backend: where the host time goes."""
    import cProfile
    import pstats
    from ds4lib.engine import SamplingParams
    eng = _tiny_engine()
    p = SamplingParams(temperature=0)
    s = eng.new_session()
    lg = eng.prefill(s, [0] + list(range(100, 163)))
    tok = eng.backend.sample(lg, p, 0, 0)
    for step in range(4):
        tok = eng.backend.sample(eng.decode(s, tok), p, 0, step + 1)
    prof = cProfile.Profile()
    prof.enable()
    for step in range(32):
        tok = eng.backend.sample(eng.decode(s, tok), p, 0, step + 5)
    prof.disable()
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:30]
    for (fn, line, func), (cc, nc, tt, ct, _) in rows:
        emit({"section": "profile", "func": f"{Path(fn).name}:{line}:{func}", "calls_per_step": round(nc / 32, 1),
              "tottime_ms_per_step": round(1e3 * tt / 32, 3), "cumtime_ms_per_step": round(1e3 * ct / 32, 3)})


def _slice_names(index):
    """Slice names from data/slices/index.json ({"slices": {name: record}})."""
    return list(index["slices"])


SECTIONS = {"copy": section_copy, "vq": section_vq, "q4k": section_q4k, "tiny": section_tiny,
            "agreement": section_agreement, "layers": section_layers, "profile": section_profile}


def main():
    reps = ARGS.reps or (1 if ARGS.small else 100)
    only = [s for s in ARGS.only.split(",") if s]
    stream = cuda.stream()
    if not ARGS.small:
        dev = cuda.get_current_device()
        emit({"section": "device", "device": dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name),
              "sms": int(dev.MULTIPROCESSOR_COUNT), "reps": reps})
    failed = []
    for name in only:
        if name not in SECTIONS:
            raise SystemExit(f"unknown section {name!r}; choose from {', '.join(SECTIONS)}")
        try:
            SECTIONS[name](stream, reps)
        except Exception as e:                            # noqa: BLE001 - one section failing does not stop the rest
            failed.append(name)
            emit({"section": name, "error": f"{type(e).__name__}: {e}"[:2000]})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

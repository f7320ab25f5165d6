"""Time the decode kernels of kernels/ at real DeepSeek V4.1 Flash shapes and print one JSON line per kernel.

    python bench/bench_kernels.py                 # the GPU: V4.1 shapes, CUDA events over --reps repetitions
    python bench/bench_kernels.py --small         # no GPU: the CUDA simulator, tiny shapes, one repetition
    python bench/bench_kernels.py --only gemv,attention --reps 500

Each line: kernel, shape, time_us (per call: the calls are captured in a CUDA graph and replayed, so the time
is device time plus ~1 us of graph launch per kernel node; if capture fails the line says "mode": "eager"),
eager_us (per call from Python, launch overhead included), bytes (compulsory DRAM traffic: weights, caches
and activations read once, outputs written once; intermediates of multi-kernel ops excluded) and gbps, plus
pct_of_copy against the first line, a measured device-to-device copy (read + write counted). Decode shapes:
T = 1 token unless the name says otherwise; long-context cases use 1M tokens (524,288 compressed rows).
With --small the numbers only prove that every case still runs.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="run under the CUDA simulator with tiny shapes")
    p.add_argument("--reps", type=int, default=None, help="repetitions per timing (default 200 GPU, 1 small)")
    p.add_argument("--only", default="", help="comma-separated name prefixes to run")
    return p.parse_args()


ARGS = _args() if __name__ == "__main__" else argparse.Namespace(small=True, reps=1, only="")
sys.path.insert(0, str(ROOT))
from bench.timing import eager_time, graph_time, use_simulator  # noqa: E402

if ARGS.small:
    use_simulator()                                     # before the first numba.cuda import

import numpy as np                                      # noqa: E402
from numba import cuda                                  # noqa: E402

from ds4lib.config import ModelConfig                   # noqa: E402
from ds4lib.engram_geometry import engram_geometry      # noqa: E402
from ds4lib.formats.floats import f32_to_bf16_bits      # noqa: E402

from kernels import attention, compressor, engram, gemv, hc, indexer, moe, rope, sampling   # noqa: E402
from kernels.bf16 import bf16_bits_device               # noqa: E402


# ------------------------------------------------------------------------------------------ device data
@cuda.jit(device=True)
def _hash_value_device(i, seed, scale):
    """A deterministic pseudo-random value in [-scale/2, scale/2) for index i."""
    x = (np.uint64(i) * np.uint64(2654435761) + np.uint64(seed)) & np.uint64(0xFFFFFFFF)
    x = ((x ^ (x >> np.uint64(15))) * np.uint64(2246822519)) & np.uint64(0xFFFFFFFF)
    x = x ^ (x >> np.uint64(13))
    return (np.float32(x & np.uint64(0xFFFF)) / np.float32(65536.0) - np.float32(0.5)) * scale


@cuda.jit
def _fill_f32_kernel(out, seed, scale):
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = _hash_value_device(i, seed, scale)


@cuda.jit
def _fill_bf16_kernel(out, seed, scale):
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = bf16_bits_device(_hash_value_device(i, seed, scale))


class Data:
    """Random device arrays: NumPy for small ones (and in the simulator), a fill kernel for large ones."""

    def __init__(self, seed=0):
        self.rng = np.random.default_rng(seed)
        self.n = 0

    def _big(self, shape, dtype, scale):
        flat = cuda.device_array(math.prod(shape), dtype)
        self.n += 1
        fill = _fill_bf16_kernel if dtype == np.uint16 else _fill_f32_kernel
        fill[(flat.shape[0] + 255) // 256, 256](flat, self.n * 7919, np.float32(scale))
        return flat.reshape(shape)

    def f32(self, shape, scale=1.0):
        if ARGS.small or math.prod(shape) < 1 << 22:
            return cuda.to_device((self.rng.standard_normal(shape) * scale).astype(np.float32))
        return self._big(shape, np.float32, scale)

    def bf16(self, shape, scale=0.02):
        """BF16 bit patterns (weights, caches)."""
        if ARGS.small or math.prod(shape) < 1 << 22:
            return cuda.to_device(f32_to_bf16_bits((self.rng.standard_normal(shape) * scale).astype(np.float32)))
        return self._big(shape, np.uint16, scale * 3.4)

    def host(self, a):
        return cuda.to_device(np.ascontiguousarray(a))


# ------------------------------------------------------------------------------------------------ timing
COPY_GBPS = [None]


def report(name, shape, nbytes, run, stream, reps):
    if not ARGS.small:                                   # compile, fill the scratch buffers
        run()
        cuda.synchronize()
    rec = {"kernel": name, "shape": shape, "bytes": int(nbytes)}
    eager = eager_time(run, stream, reps, simulator=ARGS.small)
    rec["eager_us"] = round(eager * 1e6, 2)
    if ARGS.small:
        t, rec["mode"] = eager, "simulator"
    else:
        try:
            t, rec["mode"] = graph_time(run, stream, reps), "graph"
        except Exception as e:                           # noqa: BLE001 - reported, eager timing kept
            t, rec["mode"], rec["graph_error"] = eager, "eager", f"{type(e).__name__}: {e}"[:200]
    rec["time_us"] = round(t * 1e6, 3)
    rec["gbps"] = round(nbytes / t / 1e9, 1) if t > 0 else None
    if COPY_GBPS[0] and rec["gbps"]:
        rec["pct_of_copy"] = round(100 * rec["gbps"] / COPY_GBPS[0], 1)
    print(json.dumps(rec), flush=True)
    return rec


# ------------------------------------------------------------------------------------------------- cases
def dims(small):
    """V4.1 Flash shapes; with `small`, shapes the simulator runs in well under a minute (every case kept)."""
    cfg = ModelConfig.v41_flash()
    real = dict(D=cfg.dim, H=cfg.n_heads, Dh=cfg.head_dim, rd=cfg.rope_head_dim, QL=cfg.q_lora_rank,
                G=cfg.o_groups, OL=cfg.o_lora_rank, nI=cfg.index_n_heads, dI=cfg.index_head_dim, KT=cfg.index_topk,
                W=cfg.window_size, E=cfg.n_routed_experts, KE=cfg.n_activated_experts, F=cfg.moe_inter_dim,
                V=cfg.vocab_size, ctx=1 << 20, TB=16, blocks=cfg.candidate_topk_blocks,
                bsize=cfg.candidate_block_size, route_scale=cfg.route_scale, limit=cfg.swiglu_limit, cfg=cfg)
    if not small:
        return real
    tiny = ModelConfig.tiny()
    return dict(real, D=32, H=4, Dh=32, rd=16, QL=32, G=2, OL=8, nI=4, dI=32, KT=8, W=16, E=16, KE=6, F=32,
                V=64, ctx=256, TB=2, blocks=tiny.candidate_topk_blocks, bsize=tiny.candidate_block_size, cfg=tiny)


def cases(m, d, s, small):
    """Yield (name, shape, bytes, run) for every benchmarked call."""
    D, H, Dh, rd, QL = m["D"], m["H"], m["Dh"], m["rd"], m["QL"]
    G, OL, nI, dI, KT, W = m["G"], m["OL"], m["nI"], m["dI"], m["KT"], m["W"]
    E, KE, F, V, ctx, TB = m["E"], m["KE"], m["F"], m["V"], m["ctx"], m["TB"]
    S = ctx // 2                                          # compressed rows at ratio 2
    n_cache = S if small else 1 << 16                     # attention's compressed cache (only KT rows read)
    sc = {}                                               # scratch shared by the cases (reused buffers)

    def lin(name, n, k, t=1, bf16_out=True, rpg=None):
        x, w = d.f32((t, k if rpg is None else k * (n // rpg))), d.bf16((n, k))
        out = cuda.device_array((t, n), np.float32)
        nb = 2 * n * k + 4 * x.shape[1] * t + 4 * n * t
        return (f"gemv.{name}", f"T={t} N={n} K={k}" + ("" if rpg is None else f" groups={n // rpg}"), nb,
                lambda: gemv.gemv(x, w, out_bf16=bf16_out, rows_per_group=rpg, out=out, stream=s))

    yield lin("wq_a", QL, D)
    yield lin("wq_b", H * Dh, QL)
    yield lin("wkv", Dh, D)
    yield lin("wo_a_grouped", G * OL, H * Dh // G, rpg=OL)
    yield lin("wo_b", D, G * OL)
    yield lin(f"wo_b_T{TB}", D, G * OL, t=TB)
    yield lin("gate_f32", E, D, bf16_out=False)
    yield lin("head_f32", V, D, bf16_out=False)

    for name, fn, k in (("act_quant_fp8", gemv.act_quant_fp8, D), ("act_quant_fp4_pow2", gemv.act_quant_fp4_pow2, nI * dI),
                        ("act_quant_fp4_e4m3", gemv.act_quant_fp4_e4m3, Dh)):
        x, o = d.f32((1, k)), cuda.device_array((1, k), np.float32)
        yield f"gemv.{name}", f"[1, {k}]", 8 * k, (lambda fn=fn, x=x, o=o: fn(x, out=o, stream=s))

    q = d.f32((1, H, Dh))
    pos = d.host(np.array([ctx - 1], np.int64))
    cos, sin = d.f32((ctx, rd // 2)), d.f32((ctx, rd // 2))
    yield "rope.q", f"[1, {H}, {Dh}] rd={rd}", 2 * 4 * H * rd + 8 * rd, lambda: rope.rope(q, pos, cos, sin, stream=s)
    yield ("rope.inverse_o", f"[1, {H}, {Dh}]", 2 * 4 * H * rd + 8 * rd,
           lambda: rope.rope(q, pos, cos, sin, inverse=True, stream=s))

    h, fn_, base, scale = d.f32((1, 4, D)), d.f32((24, 4 * D), 0.02), d.f32((24,)), d.host(np.ones(3, np.float32))
    mix_out = (cuda.device_array((1, 4), np.float32), cuda.device_array((1, 4), np.float32),
               cuda.device_array((1, 4, 4), np.float32))
    yield ("hc.mixes", f"h [1, 4, {D}], fn [24, {4 * D}]", 4 * 24 * 4 * D + 16 * D,
           lambda: hc.hc_mixes(h, fn_, base, scale, norm_eps=1e-20, hc_eps=1e-6, iters=20, out=mix_out, scratch=sc,
                               stream=s))
    pre, y = d.f32((1, 4)), d.f32((1, D))
    col, newh = cuda.device_array((1, D), np.float32), cuda.device_array((1, 4, D), np.float32)
    yield "hc.pre", f"[1, 4, {D}]", 20 * D, lambda: hc.hc_pre(h, pre, out=col, stream=s)
    yield ("hc.post", f"[1, 4, {D}]", 36 * D,
           lambda: hc.hc_post(y, h, mix_out[1], mix_out[2], out=newh, stream=s))

    # attention, decode at the end of a 1M context: ring of W rows + the new row, top-k compressed rows
    ring_pos_slots = np.empty(W, np.int64)
    ring_pos_slots[np.arange(ctx - 1 - W, ctx - 1) % W] = np.arange(ctx - 1 - W, ctx - 1)
    ring_pos = d.host(ring_pos_slots)
    keys_w = d.bf16((W + TB, Dh), 1.0)
    win_idx = cuda.device_array((1, W), np.int32)
    yield ("attention.window_indices", f"[1, {W}]", 8 * W + 4 * W,
           lambda: attention.window_indices(ring_pos, pos, out=win_idx, stream=s))
    kv1 = d.f32((1, Dh))
    ring = cuda.device_array((W, Dh), np.uint16)
    ring_p2 = d.host(ring_pos_slots)
    yield ("attention.window_write", f"[1, {Dh}] -> ring [{W}, {Dh}]", 6 * Dh,
           lambda: attention.window_write(kv1, pos, ring, ring_p2, stream=s))
    cmp_cache = d.bf16((n_cache, Dh), 1.0)
    rng = np.random.default_rng(1)
    cmp_idx = d.host(np.sort(rng.choice(n_cache, KT, replace=False)).astype(np.int32)[None])
    sink = d.f32((H,))
    att_out = cuda.device_array((1, H, Dh), np.float32)
    rows = W + KT
    yield ("attention.sparse_decode", f"H={H} Dh={Dh} rows={W}+{KT}", 2 * rows * Dh + 8 * H * Dh + 4 * rows,
           lambda: attention.sparse_attention(q, keys_w, win_idx, cmp_cache, cmp_idx, sink, Dh ** -0.5,
                                              out=att_out, scratch=sc, stream=s))
    T16 = TB
    q16 = d.f32((T16, H, Dh))
    pos16 = d.host(np.arange(ctx - T16, ctx, dtype=np.int64))
    win16 = cuda.device_array((T16, W), np.int32)
    attention.window_indices(ring_pos, pos16, out=win16, stream=s)
    cmp16 = d.host(np.sort(rng.choice(n_cache, (T16, KT)), axis=1).astype(np.int32))
    out16 = cuda.device_array((T16, H, Dh), np.float32)
    yield (f"attention.sparse_prefill_T{TB}", f"T={TB} H={H} Dh={Dh} rows={W}+{KT}",
           2 * (W + T16 * KT) * Dh + 8 * T16 * H * Dh + 4 * T16 * rows,
           lambda: attention.sparse_attention(q16, keys_w, win16, cmp_cache, cmp16, sink, Dh ** -0.5, out=out16,
                                              scratch=sc, stream=s))

    kvc, scc = d.f32((1, Dh)), d.f32((1, Dh))
    st_kv, st_sc = d.f32((2, Dh)), d.f32((2, Dh))
    normw = d.f32((Dh,))
    lat = cuda.device_array((1, Dh), np.float32)
    pos_c = cuda.to_device(np.array([ctx - 1], np.int64))
    yield ("compressor.ratio2_decode", f"[1, {Dh}] completing a group", 4 * Dh * 6,
           lambda: compressor.compress(kvc, scc, st_kv, st_sc, pos_c, 2, normw, 1e-20, 1, out=lat, stream=s))

    qi, wts = d.f32((1, nI, dI), 0.5), d.f32((1, nI), 0.5)
    keys_i = d.bf16((S, dI), 1.0)
    scores = cuda.device_array((1, S), np.float32)
    yield ("indexer.scores", f"nI={nI} dI={dI} S={S}", 2 * S * dI + 4 * S,
           lambda: indexer.index_scores(qi, wts, 0.0156, keys_i, pos, 2, out=scores, scratch=sc, stream=s))
    indexer.index_scores(qi, wts, 0.0156, keys_i, pos, 2, out=scores, scratch=sc, stream=s)
    top = cuda.device_array((1, KT), np.int32)
    yield ("indexer.topk", f"S={S} k={KT}", 4 * S + 4 * KT,
           lambda: indexer.select_topk(scores, KT, positions=pos, ratio=2, out=top, scratch=sc, stream=s))
    nb = -(-S // m["bsize"])
    keep = cuda.device_array((1, nb), np.uint8)
    yield ("indexer.candidates", f"S={S} blocks={m['blocks']}x{m['bsize']}", 4 * S + nb,
           lambda: indexer.candidate_blocks(scores, pos, 2, m["blocks"], m["bsize"], out=keep, scratch=sc,
                                            stream=s))

    xr, gw, gb = d.f32((1, D)), d.bf16((E, D)), d.f32((E,), 0.1)
    rout = (cuda.device_array((1, E), np.float32), cuda.device_array((1, KE), np.int32),
            cuda.device_array((1, KE), np.float32))
    yield ("moe.route", f"E={E} K={KE} D={D}", 2 * E * D + 4 * D + 8 * KE,
           lambda: moe.route(xr, gw, gb, KE, m["route_scale"], out=rout, scratch=sc, stream=s))
    g, u, rw = d.f32((KE + 1, F), 4.0), d.f32((KE + 1, F), 4.0), d.f32((KE + 1,))
    act = cuda.device_array((KE + 1, F), np.float32)
    yield ("moe.swiglu", f"[{KE + 1}, {F}]", 12 * (KE + 1) * F,
           lambda: moe.swiglu(g, u, m["limit"], weights=rw, out=act, stream=s))

    geo = engram_geometry(m["cfg"])
    primes, offs, mults = (d.host(a) for a in geo.arrays())
    cids, hist = d.host(np.array([123], np.int64)), d.host(np.array([5, 6, 7], np.int64)[:geo.max_ngram - 1])
    hashes = cuda.device_array((1, len(geo.layer_ids), geo.n_cols), np.int64)
    newh_ = cuda.device_array(geo.max_ngram - 1, np.int64)
    yield ("engram.hashes", f"T=1 layers={len(geo.layer_ids)} cols={geo.n_cols}", 8 * hashes.size,
           lambda: engram.engram_hashes(cids, hist, primes, offs, mults, geo.n_heads, 2, out=hashes,
                                        new_history=newh_, stream=s))
    hd, rows_t = m["cfg"].engram_head_dim, (4096 if small else 1 << 22)
    codes = cuda.to_device(np.random.default_rng(2).integers(0, 0x70, (rows_t, hd)).astype(np.uint8)) if small \
        else d.bf16((rows_t, hd // 2), 1.0).view(np.uint8)
    scl = cuda.to_device(np.full((rows_t, hd // 32), 120, np.uint8))
    hrow = d.host(np.random.default_rng(3).integers(0, rows_t, (1, geo.n_cols)).astype(np.int64))
    grows = cuda.device_array((1, geo.n_cols, hd), np.float32)
    yield ("engram.gather", f"{geo.n_cols} rows x {hd} of {rows_t}", geo.n_cols * (hd + hd // 32 + 4 * hd + 8),
           lambda: engram.engram_gather(hrow, codes, scl, out=grows, stream=s))
    kvE, qw, kw = d.f32((1, 5 * D)), d.f32((4, D)), d.f32((4, D))
    dead = d.host(np.zeros(1, np.uint8))
    hE = cuda.device_array((1, 4, D), np.float32)
    yield ("engram.gate", f"[1, 4, {D}]", 4 * (4 * D * 2 + 5 * D + 8 * D),
           lambda: engram.engram_gate(h, kvE, qw, kw, 1e-20, dead, out=hE, stream=s))

    logits = d.f32((1, V), 3.0)
    seeds, steps = d.host(np.array([1234], np.int64)), d.host(np.array([99], np.int64))
    tok = cuda.device_array(1, np.int64)
    yield ("sampling.greedy", f"V={V}", 4 * V,
           lambda: sampling.sample(logits, seeds, steps, temperature=0.0, out=tok, scratch=sc, stream=s))
    yield ("sampling.top_k50_top_p0.95", f"V={V} T=0.7", 4 * V,
           lambda: sampling.sample(logits, seeds, steps, temperature=0.7, top_k=50, top_p=0.95, out=tok, scratch=sc,
                                   stream=s))
    yield ("sampling.top_p0.9_min_p0.05", f"V={V} T=1", 4 * V,
           lambda: sampling.sample(logits, seeds, steps, temperature=1.0, top_p=0.9, min_p=0.05, out=tok,
                                   scratch=sc, stream=s))


def copy_bandwidth(s, small, reps):
    n = (1 << 18) if small else (1 << 28)                # float32 elements: 1 MiB / 1 GiB
    a = cuda.device_array(n, np.float32)
    b = cuda.device_array(n, np.float32)
    rec = report("device_copy", f"{4 * n} bytes D2D", 8 * n, lambda: b.copy_to_device(a, stream=s), s,
                 max(1, reps // 10))
    COPY_GBPS[0] = rec["gbps"]


def main():
    small = ARGS.small
    reps = ARGS.reps or (1 if small else 200)
    only = [p for p in ARGS.only.split(",") if p]
    s = cuda.stream()
    if not small:
        dev = cuda.get_current_device()
        print(json.dumps({"device": dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name),
                          "reps": reps}), flush=True)
    copy_bandwidth(s, small, reps)
    for name, shape, nbytes, run in cases(dims(small), Data(), s, small):
        if only and not any(name.startswith(p) for p in only):
            continue
        report(name, shape, nbytes, run, s, reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Engram on the device: n-gram hashing, table-row gather with FP8 dequantisation, and the gated add
(ds4lib.ref.engram, ds4lib.formats.checkpoint.CheckpointReader.engram_rows; docs/architecture.md §8, erratum N5 in §1.2).

Owns:
- `engram_hashes`: for each token and Engram layer, over lookbacks k = 0..n-1 (k = 0 the token itself):
  v_k = pad if blocked else cid[t-k], blocked once t-k is before the sequence (-2 in the history) or a DEAD
  (-1) token was passed; rolling ^= v_k * mult[k] (int64, never overflowing by the multiplier bound); for
  k >= 1 the column (k-1)*heads + j hashes to rolling mod prime + offset. One thread per (token, layer,
  column) recomputes its <= n-step rolling value. The new history (the last n-1 ids) goes to a second buffer.
- `engram_gather`: rows of the FP8 E4M3 table with one UE8M0 scale per 32 columns, decoded from the bits and
  rounded to BF16 (exact unless a scale is below 2^-118) -> [T, C, hd]. The table may live in device or
  mapped host memory (V4.1's tables are ~98 GB each); one thread per 4 codes (one 32-bit load).
- `engram_gate`: per (token, stream) block: dot = sum_d (h*w)*key (w = q_weight*k_weight, exact), times both
  RMS scales and D^-1/2; gate = sigmoid(copysign(sqrt(max(|dot|, 1e-6)), dot)), 0 for DEAD tokens;
  h += gate * value (BF16). The three row sums are float64 through shared memory. Out may alias h.
Does not own: the wkv projection (gemv after act_quant_fp8), the compressed token map (ds4lib.tokenmap).

Shapes: T tokens, Le Engram layers, C = (n-1) * heads hash columns, n = max n-gram, R table rows, hd row
width (% 32 == 0), S = 4 streams, D hidden; kv [T, (S+1)*D] = S keys then the shared value.
"""
import math

import numpy as np
from numba import cuda

from kernels import bounded_jit, inline_device
from kernels.bf16 import bits_f32, exp_f32_device, f32_bits, mul_rn_device, round_bf16_device
from kernels.fp8 import F32_NAN, e4m3_decode_device
from kernels.pdl import grid_entry_device
from kernels.warp import block_sum_rows_f64_device

__all__ = ["engram_hashes", "engram_gather", "engram_gate", "engram_hash_kernel", "engram_gather_kernel",
           "engram_gate_kernel", "ue8m0_decode_device", "SIGNATURES"]

THREADS = 128
DEAD = -1
BEFORE_START = -2
GATE_FLOOR = np.float32(1e-6)


@cuda.jit(cache=True)
def engram_hash_kernel(cids, history, primes, offsets, mults, n_heads, pad, out, new_history):
    """out[t, l, c] for every (token, layer, column); new_history = last n-1 of history ++ cids."""
    grid_entry_device()
    n_tok, n_layers, n_cols = out.shape
    h0 = history.shape[0]                          # n - 1
    g = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if g < h0:
        j = n_tok + g
        new_history[g] = cids[j - h0] if j >= h0 else history[j]
    if g >= n_tok * n_layers * n_cols:
        return
    c = g % n_cols
    l = (g // n_cols) % n_layers
    t = g // (n_cols * n_layers)
    order = c // n_heads + 1                       # lookbacks 0..order: an (order+1)-gram
    rolling = np.int64(0)
    blocked = False
    for k in range(order + 1):
        j = h0 + t - k
        v = cids[j - h0] if j >= h0 else history[j]
        blocked = blocked or v == BEFORE_START or v == DEAD
        rolling ^= (pad if blocked else v) * mults[l, k]
    out[t, l, c] = rolling % primes[l, c] + offsets[l, c]


@inline_device
def ue8m0_decode_device(code):
    """UE8M0 byte -> 2^(code-127) (code 0: the subnormal 2^-127; 255: NaN)."""
    c = np.uint32(code)
    if c == np.uint32(255):
        return F32_NAN
    if c == np.uint32(0):
        return bits_f32(np.uint32(0x00400000))
    return bits_f32(c << np.uint32(23))


@cuda.jit(cache=True)
def engram_gather_kernel(hashes, codes32, scales, out):
    """out[t, c, 4w..4w+3] = bf16(e4m3(codes[row, 4w..]) * ue8m0(scales[row, 4w // 32])), row = hashes[t, c]."""
    grid_entry_device()
    n_tok, n_cols, hd = out.shape
    nw = hd // 4
    g = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if g >= n_tok * n_cols * nw:
        return
    w = g % nw
    c = (g // nw) % n_cols
    t = g // (nw * n_cols)
    row = hashes[t, c]
    word = codes32[row, w]
    s = ue8m0_decode_device(scales[row, (4 * w) // 32])
    for i in range(4):
        code = (word >> np.uint32(8 * i)) & np.uint32(0xFF)
        out[t, c, 4 * w + i] = round_bf16_device(e4m3_decode_device(code) * s)


@inline_device
def _gate_sums_device(hv, key, qw, kw, hh, kk, dd):
    """One element's terms added to the running sums (hh, kk, dd) of engram_gate_kernel."""
    p = mul_rn_device(mul_rn_device(hv, mul_rn_device(qw, kw)), key)
    return (hh + np.float64(hv) * np.float64(hv), kk + np.float64(key) * np.float64(key), dd + np.float64(p))


@bounded_jit(THREADS)
def engram_gate_kernel(h, kv, q_weight, k_weight, dead, eps, out):
    """Block (stream s, token t): out[t, s] = bf16(h[t, s] + gate * value). A thread takes elements tid, tid +
    THREADS, ... in that order, four of them loaded before any is used (out may be h: each element is read before
    its own store only, and a decode call has just 4 blocks, so nothing else hides the loads' latency)."""
    grid_entry_device()
    s = cuda.blockIdx.x
    t = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    n_s, d = h.shape[1], h.shape[2]
    sh = cuda.shared.array((3, THREADS), np.float64)
    hh = 0.0
    kk = 0.0
    dd = 0.0
    i = tid
    while i + 3 * THREADS < d:
        h0, h1, h2, h3 = h[t, s, i], h[t, s, i + THREADS], h[t, s, i + 2 * THREADS], h[t, s, i + 3 * THREADS]
        o = s * d + i
        k0, k1, k2, k3 = kv[t, o], kv[t, o + THREADS], kv[t, o + 2 * THREADS], kv[t, o + 3 * THREADS]
        q0, q1 = q_weight[s, i], q_weight[s, i + THREADS]
        q2, q3 = q_weight[s, i + 2 * THREADS], q_weight[s, i + 3 * THREADS]
        w0, w1 = k_weight[s, i], k_weight[s, i + THREADS]
        w2, w3 = k_weight[s, i + 2 * THREADS], k_weight[s, i + 3 * THREADS]
        hh, kk, dd = _gate_sums_device(h0, k0, q0, w0, hh, kk, dd)
        hh, kk, dd = _gate_sums_device(h1, k1, q1, w1, hh, kk, dd)
        hh, kk, dd = _gate_sums_device(h2, k2, q2, w2, hh, kk, dd)
        hh, kk, dd = _gate_sums_device(h3, k3, q3, w3, hh, kk, dd)
        i += 4 * THREADS
    while i < d:
        hh, kk, dd = _gate_sums_device(h[t, s, i], kv[t, s * d + i], q_weight[s, i], k_weight[s, i], hh, kk, dd)
        i += THREADS
    sh[0, tid] = hh
    sh[1, tid] = kk
    sh[2, tid] = dd
    block_sum_rows_f64_device(sh, 3)
    rs_h = np.float32(1.0) / np.float32(math.sqrt(np.float32(sh[0, 0] / d) + eps))
    rs_k = np.float32(1.0) / np.float32(math.sqrt(np.float32(sh[1, 0] / d) + eps))
    dot = np.float32(sh[2, 0]) * (rs_h * rs_k) * np.float32(d ** -0.5)
    r = np.float32(math.sqrt(max(abs(dot), GATE_FLOOR)))
    if f32_bits(dot) >> np.uint32(31):
        r = -r                                      # copysign: a dot of +0 keeps the + sign (erratum N5)
    gate = np.float32(1.0) / (np.float32(1.0) + exp_f32_device(-r))
    if dead[t]:
        gate = np.float32(0.0)
    i = tid
    while i + 3 * THREADS < d:
        h0, h1, h2, h3 = h[t, s, i], h[t, s, i + THREADS], h[t, s, i + 2 * THREADS], h[t, s, i + 3 * THREADS]
        o = n_s * d + i
        v0, v1, v2, v3 = kv[t, o], kv[t, o + THREADS], kv[t, o + 2 * THREADS], kv[t, o + 3 * THREADS]
        out[t, s, i] = round_bf16_device(h0 + mul_rn_device(gate, v0))
        out[t, s, i + THREADS] = round_bf16_device(h1 + mul_rn_device(gate, v1))
        out[t, s, i + 2 * THREADS] = round_bf16_device(h2 + mul_rn_device(gate, v2))
        out[t, s, i + 3 * THREADS] = round_bf16_device(h3 + mul_rn_device(gate, v3))
        i += 4 * THREADS
    while i < d:
        out[t, s, i] = round_bf16_device(h[t, s, i] + mul_rn_device(gate, kv[t, n_s * d + i]))
        i += THREADS


SIGNATURES = {
    "engram_hash_kernel": "void(int64[:], int64[:], int64[:, :], int64[:, :], int64[:, :], int64, int64, "
                          "int64[:, :, :], int64[:])",
    "engram_gather_kernel": "void(int64[:, :], uint32[:, :], uint8[:, :], float32[:, :, :])",
    "engram_gate_kernel": "void(float32[:, :, :], float32[:, :], float32[:, :], float32[:, :], uint8[:], "
                          "float32, float32[:, :, :])",
}


def engram_hashes(cids, history, primes, offsets, mults, n_heads, pad, out=None, new_history=None, stream=0):
    """cids [T] int64 (DEAD = -1), history [n-1] int64 (oldest first, -2 before the start); primes, offsets
    [Le, C], mults [Le, n] int64 (EngramGeometry.arrays()) -> (hashes [T, Le, C] int64, new history [n-1])."""
    n_tok = cids.shape[0]
    n_layers, n_cols = tuple(primes.shape)
    n = history.shape[0] + 1
    if tuple(offsets.shape) != (n_layers, n_cols) or tuple(mults.shape) != (n_layers, n) \
            or n_cols != (n - 1) * n_heads:
        raise ValueError(f"engram_hashes: primes {primes.shape}, offsets {offsets.shape}, mults {mults.shape} "
                         f"and history {history.shape} do not fit {n_heads} heads")
    if out is None:
        out = cuda.device_array((n_tok, n_layers, n_cols), np.int64, stream=stream)
    if new_history is None:
        new_history = cuda.device_array(n - 1, np.int64, stream=stream)
    total = max(n_tok * n_layers * n_cols, n - 1)
    engram_hash_kernel[(total + THREADS - 1) // THREADS, THREADS, stream](
        cids, history, primes, offsets, mults, int(n_heads), int(pad), out, new_history)
    return out, new_history


def engram_gather(hashes, codes, scales, out=None, stream=0):
    """hashes [T, C] int64 rows of one layer's table; codes [R, hd] uint8 (E4M3), scales [R, hd/32] uint8
    (UE8M0) -> rows [T, C, hd] float32 (BF16 values)."""
    n_tok, n_cols = tuple(hashes.shape)
    n_rows, hd = tuple(codes.shape)
    if codes.dtype != np.uint8 or hd % 32 or tuple(scales.shape) != (n_rows, hd // 32) or scales.dtype != np.uint8:
        raise ValueError(f"engram_gather: codes {codes.dtype} {codes.shape} / scales {scales.shape} invalid")
    if out is None:
        out = cuda.device_array((n_tok, n_cols, hd), np.float32, stream=stream)
    n = n_tok * n_cols * (hd // 4)
    if n:
        engram_gather_kernel[(n + THREADS - 1) // THREADS, THREADS, stream](hashes, codes.view(np.uint32), scales,
                                                                           out)
    return out


def engram_gate(h, kv, q_weight, k_weight, eps, dead, out=None, stream=0):
    """h [T, S, D] float32, kv [T, (S+1)*D] (the wkv output), q_weight, k_weight [S, D], dead [T] uint8 (1 for
    image positions, whose gate is closed) -> out [T, S, D] (may be h itself)."""
    n_tok, n_s, d = tuple(h.shape)
    if tuple(kv.shape) != (n_tok, (n_s + 1) * d) or tuple(q_weight.shape) != (n_s, d) \
            or tuple(k_weight.shape) != (n_s, d):
        raise ValueError(f"engram_gate: kv {kv.shape}, q_weight {q_weight.shape}, k_weight {k_weight.shape} do "
                         f"not fit h {h.shape}")
    if tuple(dead.shape) != (n_tok,) or dead.dtype != np.uint8:
        raise ValueError(f"engram_gate: dead must be uint8 [{n_tok}]")
    if out is None:
        out = cuda.device_array((n_tok, n_s, d), np.float32, stream=stream)
    if n_tok:
        engram_gate_kernel[(n_s, n_tok), THREADS, stream](h, kv, q_weight, k_weight, dead, np.float32(eps), out)
    return out

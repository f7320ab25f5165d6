"""Token sampling on the device: Gumbel-max with exact top-k / top-p / min-p truncation (ds4lib.ref.sampling).

The host reads back only the token ids [B]. Semantics are those of ds4lib.ref.sampling: z = (l - max) / T
in float64, integer fixed-point weights W = floor(exp(z) 2^32), kept sets defined by value thresholds on the
logits (top-k: >= the k-th largest; top-p: weight strictly above < P; min-p: W >= min_p 2^32), Philox-4x32-10
uniforms of (seed, step, index), argmax of z + Gumbel over kept tokens.

How (per row, rows in parallel through grid.y):
1. `sample_max_kernel` / `sample_reduce_kernel`: max logit and first argmax (temperature 0 stops here).
2. Radix search for a threshold: three digit passes (11, 11, 10 bits of the order-preserving 32-bit key of
   the logit). `sample_hist_kernel` builds per-block shared histograms of count and integer weight for the
   keys matching the digits chosen so far and merges them with one global atomic per non-empty bin;
   `sample_scan_kernel` (one block) scans the bins from the top and picks the lowest non-empty bin whose
   count (top-k) or weight (top-p) strictly above it is still below the target. After three passes the
   digits are one logit value: the threshold. Top-k runs first; its kept weight sets P for top-p. Integer
   sums make this exact and independent of block order.
3. `sample_gumbel_kernel`: per block, the best kept z + g; `sample_pick_kernel` reduces the blocks in order.
A row with a NaN or +inf logit, or with every logit -inf, gets token -1 (ds4lib.ref.sampling raises for it): the
max pass counts NaN as +inf, so the row's max is non-finite exactly then; later passes give NaN z weight 0.

Token mask (constrained decoding; optional, `mask=` int32 [B, ceil(V / 32)], bit i % 32 of word i // 32 = token i
allowed): every pass reads a disallowed token's logit as -inf, which is ref.sampling's masked row l'. The max pass
still lets a disallowed NaN or +inf through as +inf, so the non-finite rule sees the whole row as ref's does, and a
row whose allowed logits are all -inf gets -1 too. Without `mask` the kernels take their unmasked path (`use_mask`
is a launch argument, the mask a 1 x 1 placeholder).

`truncate` runs steps 1 and 2 alone and returns the per-row state (max, argmax, thresholds): kernels.spec_accept
reads the kept sets of a speculative round's target and draft rows from it.

Shapes: B rows, V vocab, NB = ceil(V / chunk) blocks per row.
"""
import math

import numpy as np
from numba import cuda

from kernels import inline_device
from kernels.bf16 import f32_bits
from kernels.pdl import grid_entry_device
from kernels.scratch import scratch_array as _scratch

__all__ = ["sample", "truncate", "sample_max_kernel", "sample_reduce_kernel", "sample_hist_kernel",
           "sample_scan_kernel", "sample_gumbel_kernel", "sample_pick_kernel", "philox_uniform_device", "SIGNATURES"]

THREADS = 128
WARP = 32
CHUNK = 2048                      # logits per block (V = 129280: 64 blocks per row)
BINS = 2048
BINS_PER_THREAD = BINS // THREADS
WARPS = THREADS // WARP
SHIFTS = (21, 10, 0)              # digit passes: bits 31..21, 20..10, 9..0
WIDTHS = (11, 11, 10)
FIXED_ONE = 4294967296.0          # 2^32
NEG_INF64 = -np.inf
NEG_INF32 = np.float32(-np.inf)
M0 = np.uint64(0xD2511F53)
M1 = np.uint64(0xCD9E8D57)
W0 = np.uint64(0x9E3779B9)
W1 = np.uint64(0xBB67AE85)
LO32 = np.uint64(0xFFFFFFFF)
# per-row integer state
S_PREFIX, S_ACNT, S_AW, S_THETA_K, S_WK, S_THETA_P, S_ARGMAX = range(7)
N_STATE = 8
# per-row float state
F_MAX, F_P = 0, 1
PHASE_K, PHASE_P = 0, 1


@inline_device
def _order_key_device(v):
    """Order-preserving uint32 key of a float32 (-0 and +0 share one); returned in an int64."""
    u = f32_bits(v)
    if (u & np.uint32(0x7FFFFFFF)) == np.uint32(0):
        u = np.uint32(0)
    k = np.int64(u)
    return (k ^ 0xFFFFFFFF) if (k >> 31) else (k | 0x80000000)


@inline_device
def _allowed_device(mask, b, i):
    """Token i of row b is allowed by the int32 bitmask `mask` [B, ceil(V / 32)]."""
    return ((mask[b, i >> 5] >> (i & 31)) & 1) != 0


@inline_device
def philox_uniform_device(seed, step, index):
    """The uniform in (0, 1) of counter (index, step) under key seed (Philox-4x32-10), as ref.sampling.uniforms."""
    s = np.uint64(seed)
    st = np.uint64(step)
    i = np.uint64(index)
    c0 = i & LO32
    c1 = i >> np.uint64(32)
    c2 = st & LO32
    c3 = st >> np.uint64(32)
    k0 = s & LO32
    k1 = (s >> np.uint64(32)) & LO32
    for r in range(10):
        if r > 0:
            k0 = (k0 + W0) & LO32
            k1 = (k1 + W1) & LO32
        p0 = M0 * c0
        p1 = M1 * c2
        n0 = (p1 >> np.uint64(32)) ^ c1 ^ k0
        n1 = p1 & LO32
        n2 = (p0 >> np.uint64(32)) ^ c3 ^ k1
        n3 = p0 & LO32
        c0, c1, c2, c3 = n0, n1, n2, n3
    a = np.float64(c0 >> np.uint64(6))
    b = np.float64(c1 >> np.uint64(6))
    return (a * 67108864.0 + b + 0.5) * (2.0 ** -52)


@inline_device
def _weight_device(v, m, temperature):
    """(z, W): z = (v - m) / T in float64 and W = floor(exp(z) 2^32)."""
    z = (np.float64(v) - np.float64(m)) / temperature
    if z != z:                                    # only in a non-finite row, whose token is -1 anyway
        z = NEG_INF64
    return z, np.int64(math.floor(math.exp(z) * FIXED_ONE))


@inline_device
def _block_best_device(v, i, sh_v, sh_i):
    """Block-wide (max v, then lowest i) through a shared-memory tree; result in sh_v[0], sh_i[0]."""
    tid = cuda.threadIdx.x
    sh_v[tid] = v
    sh_i[tid] = i
    cuda.syncthreads()
    s = THREADS // 2
    while s > 0:
        if tid < s:
            v2 = sh_v[tid + s]
            i2 = sh_i[tid + s]
            if v2 > sh_v[tid] or (v2 == sh_v[tid] and i2 < sh_i[tid]):
                sh_v[tid] = v2
                sh_i[tid] = i2
        cuda.syncthreads()
        s //= 2


@cuda.jit(cache=True)
def sample_max_kernel(logits, chunk, mask, use_mask, part_v, part_i):
    """Per block: the largest (allowed) logit of its chunk and its first index."""
    grid_entry_device()
    b = cuda.blockIdx.y
    blk = cuda.blockIdx.x
    n = logits.shape[1]
    bv = NEG_INF64
    bi = np.int64(n)
    for i in range(blk * chunk + cuda.threadIdx.x, min(n, (blk + 1) * chunk), THREADS):
        v = np.float64(logits[b, i])
        if v != v:                                # NaN: the row's max becomes +inf, which marks it non-finite
            v = -NEG_INF64
        if use_mask and v != -NEG_INF64 and not _allowed_device(mask, b, i):
            v = NEG_INF64                         # disallowed; a NaN or +inf there still marks the row
        if v > bv or bi == n:
            bv = v
            bi = i
    sh_v = cuda.shared.array(THREADS, np.float64)
    sh_i = cuda.shared.array(THREADS, np.int64)
    _block_best_device(bv, bi, sh_v, sh_i)
    if cuda.threadIdx.x == 0:
        part_v[b, blk] = sh_v[0]
        part_i[b, blk] = sh_i[0]


@cuda.jit(cache=True)
def sample_reduce_kernel(part_v, part_i, st, stf, hist_cnt, hist_w, tokens):
    """Per row: max and argmax over the blocks (token for temperature 0); reset the state and histograms."""
    grid_entry_device()
    b = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    bv = NEG_INF64
    bi = np.int64(0x7FFFFFFFFFFFFFFF)
    for k in range(tid, part_v.shape[1], THREADS):
        if part_v[b, k] > bv or (part_v[b, k] == bv and part_i[b, k] < bi):
            bv = part_v[b, k]
            bi = part_i[b, k]
    sh_v = cuda.shared.array(THREADS, np.float64)
    sh_i = cuda.shared.array(THREADS, np.int64)
    _block_best_device(bv, bi, sh_v, sh_i)
    for k in range(tid, BINS, THREADS):
        hist_cnt[b, k] = 0
        hist_w[b, k] = 0
    if tid < N_STATE:
        st[b, tid] = 0
    cuda.syncthreads()
    if tid == 0:
        stf[b, F_MAX] = sh_v[0]
        st[b, S_ARGMAX] = sh_i[0]
        tokens[b] = sh_i[0] if math.isfinite(sh_v[0]) else -1


@cuda.jit(cache=True)
def sample_hist_kernel(logits, chunk, mask, use_mask, temperature, st, stf, pass_id, hist_cnt, hist_w):
    """Count and weight histograms of the current digit over keys matching the chosen higher digits."""
    grid_entry_device()
    b = cuda.blockIdx.y
    blk = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    n = logits.shape[1]
    sh_c = cuda.shared.array(BINS, np.int32)
    sh_w = cuda.shared.array(BINS, np.int64)
    for k in range(tid, BINS, THREADS):
        sh_c[k] = 0
        sh_w[k] = 0
    cuda.syncthreads()
    shift = SHIFTS[0] if pass_id == 0 else (SHIFTS[1] if pass_id == 1 else SHIFTS[2])
    width = WIDTHS[0] if pass_id == 0 else (WIDTHS[1] if pass_id == 1 else WIDTHS[2])
    top = shift + width                              # bits above the current digit must match the prefix
    prefix = st[b, S_PREFIX]
    m = stf[b, F_MAX]
    for i in range(blk * chunk + tid, min(n, (blk + 1) * chunk), THREADS):
        v = logits[b, i]
        if use_mask and not _allowed_device(mask, b, i):
            v = NEG_INF32
        key = _order_key_device(v)
        if top >= 32 or (key >> top) == (prefix >> top):
            bin_ = (key >> shift) & ((1 << width) - 1)
            cuda.atomic.add(sh_c, bin_, 1)
            cuda.atomic.add(sh_w, bin_, _weight_device(v, m, temperature)[1])
    cuda.syncthreads()
    for k in range(tid, BINS, THREADS):
        if sh_c[k]:
            cuda.atomic.add(hist_cnt, (b, k), sh_c[k])
            cuda.atomic.add(hist_w, (b, k), sh_w[k])


@cuda.jit(cache=True)
def sample_scan_kernel(hist_cnt, hist_w, pass_id, phase, top_k, top_p, use_top_k, st, stf):
    """Pick the digit of this pass (see module docstring); record thresholds after the last pass."""
    grid_entry_device()
    b = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    lane = tid % WARP
    warp = tid // WARP
    shift = SHIFTS[0] if pass_id == 0 else (SHIFTS[1] if pass_id == 1 else SHIFTS[2])
    hi_bin = BINS - 1 - BINS_PER_THREAD * tid            # this thread's bins, descending
    c_loc = np.int64(0)
    w_loc = np.int64(0)
    for j in range(BINS_PER_THREAD):
        c_loc += hist_cnt[b, hi_bin - j]
        w_loc += hist_w[b, hi_bin - j]
    c_inc = c_loc
    w_inc = w_loc
    off = 1
    while off < WARP:
        c2 = cuda.shfl_up_sync(0xFFFFFFFF, c_inc, off)
        w2 = cuda.shfl_up_sync(0xFFFFFFFF, w_inc, off)
        if lane >= off:
            c_inc += c2
            w_inc += w2
        off *= 2
    sh_c = cuda.shared.array(WARPS, np.int64)
    sh_w = cuda.shared.array(WARPS, np.int64)
    best = cuda.shared.array(1, np.int64)
    if lane == WARP - 1:
        sh_c[warp] = c_inc
        sh_w[warp] = w_inc
    if tid == 0:
        best[0] = -1
    cuda.syncthreads()
    c_above = c_inc - c_loc + st[b, S_ACNT]
    w_above = w_inc - w_loc + st[b, S_AW]
    w_total = np.int64(0)
    for w in range(WARPS):
        if w < warp:
            c_above += sh_c[w]
            w_above += sh_w[w]
        w_total += sh_w[w]
    if phase == PHASE_P and pass_id == 0:            # the first top-p pass fixes P
        base = st[b, S_WK] if use_top_k else w_total
        target_p = np.float64(base) * top_p
    else:
        target_p = stf[b, F_P]
    mine = np.int64(-1)
    ca = c_above
    wa = w_above
    for j in range(BINS_PER_THREAD):
        cnt = hist_cnt[b, hi_bin - j]
        if cnt > 0:
            ok = ca < top_k if phase == PHASE_K else np.float64(wa) < target_p
            if ok:
                mine = BINS_PER_THREAD * tid + j
        ca += cnt
        wa += hist_w[b, hi_bin - j]
    if mine >= 0:
        cuda.atomic.max(best, 0, mine)
    cuda.syncthreads()
    pick = best[0]
    if pick // BINS_PER_THREAD == tid:               # the owner records the step
        j = pick % BINS_PER_THREAD
        ca = c_above
        wa = w_above
        for jj in range(j):
            ca += hist_cnt[b, hi_bin - jj]
            wa += hist_w[b, hi_bin - jj]
        bin_ = np.int64(hi_bin - j)
        prefix = st[b, S_PREFIX] | (bin_ << shift)
        if pass_id < 2:
            st[b, S_PREFIX] = prefix
            st[b, S_ACNT] = ca
            st[b, S_AW] = wa
        else:                                        # a full key: the threshold; reset for the next phase
            if phase == PHASE_K:
                st[b, S_THETA_K] = prefix
                st[b, S_WK] = wa + hist_w[b, bin_]
            else:
                st[b, S_THETA_P] = prefix
            st[b, S_PREFIX] = 0
            st[b, S_ACNT] = 0
            st[b, S_AW] = 0
        if phase == PHASE_P and pass_id == 0:
            stf[b, F_P] = target_p
    cuda.syncthreads()
    for j in range(BINS_PER_THREAD):                 # clear for the next pass
        hist_cnt[b, hi_bin - j] = 0
        hist_w[b, hi_bin - j] = 0


@cuda.jit(cache=True)
def sample_gumbel_kernel(logits, chunk, mask, use_mask, temperature, min_p, seeds, steps, st, stf, part_v, part_i,
                         kept, write_kept):
    """Per block: the kept token with the largest z + Gumbel noise."""
    grid_entry_device()
    b = cuda.blockIdx.y
    blk = cuda.blockIdx.x
    n = logits.shape[1]
    theta = max(st[b, S_THETA_K], st[b, S_THETA_P])
    m = stf[b, F_MAX]
    w_min = min_p * FIXED_ONE
    bv = NEG_INF64
    bi = np.int64(n)
    for i in range(blk * chunk + cuda.threadIdx.x, min(n, (blk + 1) * chunk), THREADS):
        v = logits[b, i]
        if use_mask and not _allowed_device(mask, b, i):
            v = NEG_INF32
        z, w = _weight_device(v, m, temperature)
        keep = _order_key_device(v) >= theta and (min_p <= 0.0 or np.float64(w) >= w_min)
        if write_kept:
            kept[b, i] = 1 if keep else 0
        if keep:
            g = z - math.log(-math.log(philox_uniform_device(seeds[b], steps[b], i)))
            if g > bv or (g == bv and i < bi):
                bv = g
                bi = i
    sh_v = cuda.shared.array(THREADS, np.float64)
    sh_i = cuda.shared.array(THREADS, np.int64)
    _block_best_device(bv, bi, sh_v, sh_i)
    if cuda.threadIdx.x == 0:
        part_v[b, blk] = sh_v[0]
        part_i[b, blk] = sh_i[0]


@cuda.jit(cache=True)
def sample_pick_kernel(part_v, part_i, tokens):
    """Per row: the best block result, blocks in order (lowest index on ties); a non-finite row keeps its -1."""
    grid_entry_device()
    b = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if b >= tokens.shape[0] or tokens[b] < 0:
        return
    bv = part_v[b, 0]
    bi = part_i[b, 0]
    for k in range(1, part_v.shape[1]):
        if part_v[b, k] > bv or (part_v[b, k] == bv and part_i[b, k] < bi):
            bv = part_v[b, k]
            bi = part_i[b, k]
    tokens[b] = bi


SIGNATURES = {
    "sample_max_kernel": "void(float32[:, :], int64, int32[:, :], boolean, float64[:, :], int64[:, :])",
    "sample_reduce_kernel": "void(float64[:, :], int64[:, :], int64[:, :], float64[:, :], int32[:, :], "
                            "int64[:, :], int64[:])",
    "sample_hist_kernel": "void(float32[:, :], int64, int32[:, :], boolean, float64, int64[:, :], float64[:, :], "
                          "int64, int32[:, :], int64[:, :])",
    "sample_scan_kernel": "void(int32[:, :], int64[:, :], int64, int64, int64, float64, boolean, int64[:, :], "
                          "float64[:, :])",
    "sample_gumbel_kernel": "void(float32[:, :], int64, int32[:, :], boolean, float64, float64, int64[:], int64[:], "
                            "int64[:, :], float64[:, :], float64[:, :], int64[:, :], uint8[:, :], boolean)",
    "sample_pick_kernel": "void(float64[:, :], int64[:, :], int64[:])",
}




def truncate(logits, *, temperature=1.0, top_k=0, top_p=1.0, mask=None, chunk=CHUNK, tokens=None, scratch=None,
             name="", stream=0):
    """The passes before the draw (steps 1 and 2 of the module docstring) over logits [B, V] float32: per row the max
    and first argmax (tokens [B] int64; -1 for a non-finite row) and the truncation thresholds. Returns (st, stf,
    tokens): st int64 [B, N_STATE] (S_THETA_K, S_THETA_P: order keys a kept logit reaches; S_ARGMAX), stf float64
    [B, 2] (F_MAX: the row max). Scratch entries are named with the prefix `name` (two truncations alive at once)."""
    n_rows, n_vocab = tuple(logits.shape)
    use_mask = mask is not None
    if tokens is None:
        tokens = cuda.device_array(n_rows, np.int64, stream=stream)
    if not use_mask:
        mask = _scratch(scratch, "no_mask", (1, 1), np.int32, stream)
    nb = math.ceil(n_vocab / chunk)
    part_v = _scratch(scratch, name + "part_v", (n_rows, nb), np.float64, stream)
    part_i = _scratch(scratch, name + "part_i", (n_rows, nb), np.int64, stream)
    st = _scratch(scratch, name + "state", (n_rows, N_STATE), np.int64, stream)
    stf = _scratch(scratch, name + "state_f", (n_rows, 2), np.float64, stream)
    hist_cnt = _scratch(scratch, "hist_cnt", (n_rows, BINS), np.int32, stream)
    hist_w = _scratch(scratch, "hist_w", (n_rows, BINS), np.int64, stream)
    sample_max_kernel[(nb, n_rows), THREADS, stream](logits, chunk, mask, use_mask, part_v, part_i)
    sample_reduce_kernel[n_rows, THREADS, stream](part_v, part_i, st, stf, hist_cnt, hist_w, tokens)
    if temperature == 0:
        return st, stf, tokens
    use_top_k = 0 < top_k < n_vocab
    phases = ([PHASE_K] if use_top_k else []) + ([PHASE_P] if top_p < 1.0 else [])
    for phase in phases:
        for pass_id in range(3):
            sample_hist_kernel[(nb, n_rows), THREADS, stream](logits, chunk, mask, use_mask, float(temperature), st,
                                                              stf, pass_id, hist_cnt, hist_w)
            sample_scan_kernel[n_rows, THREADS, stream](hist_cnt, hist_w, pass_id, phase, int(top_k), float(top_p),
                                                        use_top_k, st, stf)
    return st, stf, tokens


def sample(logits, seeds, steps, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, mask=None, chunk=CHUNK,
           out=None, kept=None, scratch=None, stream=0):
    """logits [B, V] float32, seeds [B] and steps [B] int64 (>= 0) -> tokens [B] int64 on the device; -1 for a
    row with NaN or +inf, or without a finite (allowed) logit.

    One parameter set for the batch (launch once per distinct set). `mask` (int32 [B, ceil(V / 32)] on the device,
    optional): the allowed tokens of each row (module docstring). `kept` (uint8 [B, V], optional) receives the
    truncation mask, for tests and diagnostics.
    """
    n_rows, n_vocab = tuple(logits.shape)
    if logits.dtype != np.float32 or n_vocab == 0 or chunk % THREADS or temperature < 0:
        raise ValueError("sample: float32 logits [B, V > 0], temperature >= 0 and a chunk multiple of 128")
    if tuple(seeds.shape) != (n_rows,) or tuple(steps.shape) != (n_rows,):
        raise ValueError(f"sample: seeds and steps must be [{n_rows}]")
    if not 0.0 < top_p <= 1.0 or not 0.0 <= min_p <= 1.0 or top_k < 0:
        raise ValueError("sample: top_p in (0, 1], min_p in [0, 1], top_k >= 0")
    use_mask = mask is not None
    if use_mask and (tuple(mask.shape) != (n_rows, (n_vocab + 31) // 32) or mask.dtype != np.int32):
        raise ValueError(f"sample: mask must be int32 [{n_rows}, {(n_vocab + 31) // 32}]")
    if out is None:
        out = cuda.device_array(n_rows, np.int64, stream=stream)
    if n_rows == 0:
        return out
    st, stf, _ = truncate(logits, temperature=temperature, top_k=top_k, top_p=top_p, mask=mask, chunk=chunk,
                          tokens=out, scratch=scratch, stream=stream)
    if temperature == 0:
        return out
    if not use_mask:
        mask = _scratch(scratch, "no_mask", (1, 1), np.int32, stream)
    nb = math.ceil(n_vocab / chunk)
    part_v = _scratch(scratch, "part_v", (n_rows, nb), np.float64, stream)
    part_i = _scratch(scratch, "part_i", (n_rows, nb), np.int64, stream)
    write_kept = kept is not None
    if write_kept and tuple(kept.shape) != (n_rows, n_vocab):
        raise ValueError(f"sample: kept must be uint8 [{n_rows}, {n_vocab}]")
    if not write_kept:
        kept = _scratch(scratch, "no_kept", (1, 1), np.uint8, stream)
    sample_gumbel_kernel[(nb, n_rows), THREADS, stream](logits, chunk, mask, use_mask, float(temperature),
                                                        float(min_p), seeds, steps, st, stf, part_v, part_i, kept,
                                                        write_kept)
    sample_pick_kernel[math.ceil(n_rows / THREADS), THREADS, stream](part_v, part_i, out)
    return out

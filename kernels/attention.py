"""Sparse attention with a per-head sink over index lists, and the window ring (ds4lib.ref.attention; docs/architecture.md
§5.2, §5.4, errata E2 and E4 in §1.1).

Owns:
- `window_write`: the layer's window ring [W, Dh] (BF16 bits) and the position of each slot; a chunk writes
  its last min(T, W) rows at slot p mod W. Call it after attending (erratum E2, "write after reading").
- `window_indices`: the window rows of each query as an index list into the key buffer [ring (W rows);
  chunk (T rows)]: positions p-W+1 .. p, from the chunk when p >= start_pos, else from the ring when the
  slot still holds that position; -1 otherwise. Decode, chunked prefill and the first prefill are the same.
- `cache_write`: pack float32 rows (BF16 values) into a BF16 cache at given rows (compressed KV, index keys,
  the chunk rows of the window key buffer).
- `sparse_attention`: one softmax per (query, head) over window rows + selected compressed rows plus the
  sink (denominator only). The row max covers valid rows only; exp weights are rounded to BF16 before the
  value product; the denominator sums the unrounded weights (float64) and adds exp(sink - max); a query with
  no valid row outputs 0. K = V: the cached 512-vector is both key and value.
Does not own: the query/KV projections (gemv), RoPE (rope), the grouped output projection (gemv with
rows_per_group).

Kernels of `sparse_attention` (all tiles sized for decode, T = 1, and reused for prefill chunks):
1. scores: a block owns 32 x rows_per_quad rows x 4 heads (rows_per_quad 4, or 2 or 1 when a decode step would
   leave the GPU with under SCORE_BLOCKS blocks); the four heads' queries sit in shared memory (a head's 4 values
   of a key word one 16-byte load), each row's key is read once (8-byte words, 4 BF16) by a quad of lanes and used
   for 4 heads; quads combine through shared. Loads go out in batches: a thread's 16 query values and its RoPE
   table values together, the first row's index and first 8 words before the query's staging, each next group of
   8 words before the current group's products (the staging's loop of load, rotate, store waited a round trip at
   each step, 16 to 20 a block: 9.7 us a call at 128 rows against 6.8 now, H200, BENCHMARKS.md).
   Optionally the queries' forward RoPE as they are staged (`rope_q`, kernels.rope's arithmetic): the engine's
   query path then has no launch of its own for it.
2. softmax and values in one kernel: a block owns 4 heads x all Dh dims of a split of the rows. Warp w first
   finds head w's score max over all its rows (every split's block does), and the blocks of split 0 also the
   float64 denominator (lane-strided, then the warp's tree; plus the sink's term), from one batch of a lane's score
   loads up to 640 rows (SOFTMAX_LOADS), with the first tile's scores and row indices loaded before it. The
   weights bf16(exp(z - max)) of the split's rows go to shared memory as they are staged; each thread accumulates
   4 dims x 4 heads while streaming key words, VALUE_GROUP rows' loads at a time (one dependent load per row left
   a V4.1 decode step's value kernel latency-bound: 14.6 us). Rows are summed in chunks of VALUE_CHUNK and the
   chunk sums in order; decode splits one chunk per block (enough blocks), prefill keeps one split: the same bits.
   (Until the twenty-fourth session the softmax was a kernel of its own, one warp per (query, head), writing the
   weights back into z: the same operations in the same order.)
4. combine: sums the splits in a fixed order (COMBINE_LOADS of them loaded at once, with den and the RoPE tables
   before them), divides, rounds to BF16; optionally the inverse RoPE of the output (`inverse_rope`, kernels.rope's
   arithmetic) and the window ring's write after the attention read it (`window`, window_write's stores): one
   launch fewer per layer each; and the output staged for the output projection's integer tensor-core path
   (`im_stage`, kernels.im_operand.im_stage_lane_device: wo_a's q4k_im_stage launch).

Shapes: T queries, H heads, Dh head dim (<= 512, a multiple of 4), W window, Kw window slots per query,
Kc compressed slots per query (top-k), R = Kw + Kc rows per query, Nc compressed cache rows.
"""
import math

import numpy as np
from numba import cuda
from numba.cuda.core import config as _cuda_config

from kernels import bounded_jit, im_operand, inline_device
from kernels.bf16 import bf16_bits_device, bf16x4_device, exp_f32_device, round_bf16_device
from kernels.im_operand import im_stage_lane_device
from kernels.mma import LOAD4_ALIGN, load4_device
from kernels.pdl import grid_entry_device
from kernels.rope import rope_pair_value_device
from kernels.scratch import scratch_array as _scratch
from kernels.warp import warp_tree_sum_device

__all__ = ["window_write", "window_indices", "cache_write", "sparse_attention", "window_write_kernel",
           "window_index_kernel", "cache_write_kernel", "attn_score_kernel",
           "attn_value_kernel", "attn_combine_kernel", "SIGNATURES"]

THREADS = 128
WARP = 32
HEADS_PER_BLOCK = 4          # heads sharing each key load (scores and values); a warp each in the value kernel
assert HEADS_PER_BLOCK == THREADS // WARP
ROWS_PER_QUAD = 4            # most rows per quad of lanes in the score kernel (the launcher picks 1, 2 or 4)
SCORE_ROWS = THREADS // 4 * ROWS_PER_QUAD          # at most 128 rows per score block
SIM = bool(_cuda_config.ENABLE_CUDASIM)
SCORE_BLOCKS = 1 if SIM else 256   # the score grid the launcher aims for (fewer rows per quad until it gets there)
QUAD_SUMS = ROWS_PER_QUAD * HEADS_PER_BLOCK        # partial dot products per lane
SCORE_GROUP = 8              # key words of a row a lane loads before it multiplies them (written out in the kernel)
assert HEADS_PER_BLOCK == 4  # the score kernel's four head sums are scalars (_score_word_device)
DH_MAX = 512
Q_SH = HEADS_PER_BLOCK * DH_MAX   # the score kernel's staged queries (floats)
Q_SLOTS = DH_MAX // THREADS   # a thread's elements of a head's query in the staging (k = tid + THREADS * i)
assert Q_SLOTS * THREADS == DH_MAX
COMBINE_LOADS = 20           # splits' partial sums a combine thread loads at once (a V4.1 decode step's 20)
VALUE_TILE = THREADS         # rows staged per step of the value kernel (a thread each)
E_SH = VALUE_TILE * HEADS_PER_BLOCK   # its staged weights (floats), a row's 4 heads together
VALUE_CHUNK = 32             # rows summed from zero before joining the split's total (VALUE_TILE % VALUE_CHUNK == 0)
VALUE_GROUP = 8              # rows whose key loads go out together (VALUE_CHUNK % VALUE_GROUP == 0)
SOFTMAX_LOADS = 20           # scores a lane loads at once for the softmax's max and denominator (V4.1's 640 rows
                             # in one batch)
NEG_BIG = np.float32(-1e30)  # the row max of a query with no valid row (the reference's value)
NEG_INF = np.float32(-np.inf)


# ------------------------------------------------------------------------------------------- window ring
@inline_device
def _window_store_device(kv, positions, ring, ring_pos, t, d):
    """Element d of row t of a window write: ring[p mod W, d] = bf16(kv[t, d]) and ring_pos[p mod W] = p (d == 0),
    for the last min(T, W) rows only (p = positions[t])."""
    w = ring.shape[0]
    if t >= kv.shape[0] - w:
        slot = positions[t] % w
        ring[slot, d] = bf16_bits_device(kv[t, d])
        if d == 0:
            ring_pos[slot] = positions[t]


@cuda.jit(cache=True)
def window_write_kernel(kv, positions, ring, ring_pos):
    """ring[p mod W] = bf16(kv[t]) for the last min(T, W) rows; ring_pos[p mod W] = p."""
    grid_entry_device()
    n_tok, dh = kv.shape
    g = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    first = max(0, n_tok - ring.shape[0])
    if g >= (n_tok - first) * dh:
        return
    _window_store_device(kv, positions, ring, ring_pos, first + g // dh, g % dh)


@cuda.jit(cache=True)
def window_index_kernel(ring_pos, positions, idx):
    """idx[t, j] = key-buffer row of position positions[t] - W + 1 + j, or -1 (positions[0] starts the call)."""
    grid_entry_device()
    n_tok, w = idx.shape
    g = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if g >= n_tok * w:
        return
    start_pos = positions[0]
    t = g // w
    j = g % w
    q = positions[t] - (w - 1) + j
    r = -1
    if q >= start_pos:
        r = w + (q - start_pos)
    elif q >= 0:
        slot = q % w
        if ring_pos[slot] == q:
            r = slot
    idx[t, j] = r


@cuda.jit(cache=True)
def cache_write_kernel(src, rows, dst):
    """dst[rows[r]] = bf16 bits of src[r] (rows[r] < 0: skipped)."""
    grid_entry_device()
    n, dh = src.shape
    g = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if g >= n * dh:
        return
    r = g // dh
    if rows[r] >= 0:
        dst[rows[r], g % dh] = bf16_bits_device(src[r, g % dh])


# --------------------------------------------------------------------------------------- sparse attention
@inline_device
def _key_row_device(win_idx, cmp_idx, t, r):
    """Key row of slot r of query t: (index, from_window); index -1 when invalid."""
    kw = win_idx.shape[1]
    if r >= kw + cmp_idx.shape[1]:
        return -1, True
    if r < kw:
        return win_idx[t, r], True
    return cmp_idx[t, r - kw], False


@inline_device
def _key_view_device(win_keys, win_idx, cmp_keys, cmp_idx, t, r):
    """(key row index, the row's words) of slot r of query t (_key_row_device): the window buffer's row or the
    compressed cache's, row 0 of it when the slot is invalid or past the end (its loads are never used), chosen once,
    so that the row's loads need no branch."""
    row, inw = _key_row_device(win_idx, cmp_idx, t, r)
    if inw:
        kr = win_keys[max(row, 0)]
    else:
        kr = cmp_keys[max(row, 0)]
    return row, kr


@inline_device
def _score_words_device(kr, w0, nw):
    """The 8 key words w0, w0 + 4, ..., w0 + 28 of a score lane (SCORE_GROUP), each clamped to the row's last word:
    loads issued together."""
    last = np.uint32(nw - 1)
    b = np.uint32(w0)
    return (kr[min(b, last)], kr[_min_u32(b, 4, last)], kr[_min_u32(b, 8, last)], kr[_min_u32(b, 12, last)],
            kr[_min_u32(b, 16, last)], kr[_min_u32(b, 20, last)], kr[_min_u32(b, 24, last)], kr[_min_u32(b, 28, last)])


@inline_device
def _min_u32(b, k, last):
    """min(b + k, last) in 32-bit unsigned arithmetic (numba widens b + k to 64 bits: a 64-bit compare, select and
    address each): a key word's index, so that its address is one wide multiply-add."""
    return min(np.uint32(b + np.uint32(k)), last)


@inline_device
def _score_word_device(q_sh, w, word, nw, a0, a1, a2, a3):
    """_score_word_in_row_device when w < nw, else (a0, a1, a2, a3)."""
    if w < nw:
        a0, a1, a2, a3 = _score_word_in_row_device(q_sh, w, word, a0, a1, a2, a3)
    return a0, a1, a2, a3


@inline_device
def _score_word_in_row_device(q_sh, w, word, a0, a1, a2, a3):
    """a_h + q[h, 4w .. 4w+3] . the word's 4 values for the block's heads h = 0..3. q_sh holds head h's query at
    h * DH_MAX: a head's 4 values are one 16-byte shared load (load4_device)."""
    k0 = bf16x4_device(word, 0)
    k1 = bf16x4_device(word, 1)
    k2 = bf16x4_device(word, 2)
    k3 = bf16x4_device(word, 3)
    i = 4 * w
    q0, q1, q2, q3 = load4_device(q_sh, i)
    a0 += q0 * k0 + q1 * k1 + q2 * k2 + q3 * k3
    q0, q1, q2, q3 = load4_device(q_sh, DH_MAX + i)
    a1 += q0 * k0 + q1 * k1 + q2 * k2 + q3 * k3
    q0, q1, q2, q3 = load4_device(q_sh, 2 * DH_MAX + i)
    a2 += q0 * k0 + q1 * k1 + q2 * k2 + q3 * k3
    q0, q1, q2, q3 = load4_device(q_sh, 3 * DH_MAX + i)
    a3 += q0 * k0 + q1 * k1 + q2 * k2 + q3 * k3
    return a0, a1, a2, a3


@inline_device
def _stage_q_device(q, t, h0, positions, cos, sin, has_rope, q_sh):
    """q_sh[hh * DH_MAX + k] = q[t, h0 + hh, k] for the block's 4 heads, rotated as kernels.rope's forward rotation
    would leave it when `has_rope`, then the block's barrier. Thread tid takes k = tid + THREADS * i (i < Q_SLOTS)
    of every head: its 16 loads of q and its loads of the tables go out together before any is used (a loop of
    load, rotate, store waited a round trip each: 16 to 20 a block), and the pair's other value, k ^ 1, is the
    neighbouring lane's (a shuffle, not a load)."""
    tid = cuda.threadIdx.x
    dh = q.shape[2]
    first = dh // 2 - cos.shape[1]                # the first rotating pair
    qv = cuda.local.array((HEADS_PER_BLOCK, Q_SLOTS), np.float32)
    for hh in range(HEADS_PER_BLOCK):
        for i in range(Q_SLOTS):
            qv[hh, i] = q[t, h0 + hh, min(tid + THREADS * i, dh - 1)]     # (past dh: clamped, never stored)
    cs = cuda.local.array(Q_SLOTS, np.float32)
    sn = cuda.local.array(Q_SLOTS, np.float32)
    if has_rope:
        pos = positions[t]
        for i in range(Q_SLOTS):
            p = min(max((tid + THREADS * i) // 2 - first, 0), cos.shape[1] - 1)
            cs[i] = cos[pos, p]
            sn[i] = sin[pos, p]
    for hh in range(HEADS_PER_BLOCK):
        for i in range(Q_SLOTS):
            k = tid + THREADS * i
            v = qv[hh, i]
            if has_rope:                          # block-uniform: every lane takes part in the shuffle
                other = cuda.shfl_xor_sync(0xFFFFFFFF, v, 1)
                if k // 2 - first >= 0:
                    v = rope_pair_value_device(v, other, k % 2 == 1, cs[i], sn[i])
            if k < dh:
                q_sh[hh * DH_MAX + k] = v
    cuda.syncthreads()


@cuda.jit(cache=True)
def attn_score_kernel(q, win_keys, win_idx, cmp_keys, cmp_idx, scale, rows_per_quad, positions, cos, sin, has_rope,
                      z):
    """z[t, h, r] = scale * q[t, h] . key(r) for 4 heads x (32 * rows_per_quad) rows per block; -inf for invalid
    rows. rows_per_quad (1, 2 or 4) only changes which quad computes a row, never a row's sum or its order. With
    `has_rope` q arrives unrotated and its tail's adjacent pairs rotate to positions[t] as it is staged, exactly as
    kernels.rope's forward rotation would leave q (each element with its pair's other value, loaded beside it)."""
    grid_entry_device()
    tid = cuda.threadIdx.x
    quad = tid // 4
    qd = tid % 4
    t = cuda.blockIdx.z
    h0 = cuda.blockIdx.y * HEADS_PER_BLOCK
    dh = q.shape[2]
    nw = dh // 4
    n_rows = z.shape[2]
    q_sh = cuda.shared.array(Q_SH, np.float32, alignment=LOAD4_ALIGN)   # head hh's query at hh * DH_MAX
    red = cuda.shared.array((QUAD_SUMS, THREADS), np.float32)
    r0 = cuda.blockIdx.x * (THREADS // 4) * rows_per_quad + quad * rows_per_quad
    row, kr = _key_view_device(win_keys, win_idx, cmp_keys, cmp_idx, t, r0)   # the first row's index and its
    x = _score_words_device(kr, qd, nw)                                       # first words, before the staging
    _stage_q_device(q, t, h0, positions, cos, sin, has_rope, q_sh)
    for rr in range(ROWS_PER_QUAD):                   # a row at a time, SCORE_GROUP of its words in flight
        a0 = a1 = a2 = a3 = np.float32(0.0)
        if rr > 0:
            row = -1
            if rr < rows_per_quad:
                row, kr = _key_view_device(win_keys, win_idx, cmp_keys, cmp_idx, t, r0 + rr)
                x = _score_words_device(kr, qd, nw)
        if row >= 0:
            for w0 in range(qd, nw, 4 * SCORE_GROUP):
                y = _score_words_device(kr, w0 + 4 * SCORE_GROUP, nw)   # the next group's loads (clamped past
                x0, x1, x2, x3, x4, x5, x6, x7 = x                      # the end) before this group's products
                # products in word order; a group wholly inside the row (every group when Dh % 128 == 0) takes
                # them without the per-word guard, any other group only for its words inside the row
                if w0 + 4 * (SCORE_GROUP - 1) < nw:
                    a0, a1, a2, a3 = _score_word_in_row_device(q_sh, w0, x0, a0, a1, a2, a3)
                    a0, a1, a2, a3 = _score_word_in_row_device(q_sh, w0 + 4, x1, a0, a1, a2, a3)
                    a0, a1, a2, a3 = _score_word_in_row_device(q_sh, w0 + 8, x2, a0, a1, a2, a3)
                    a0, a1, a2, a3 = _score_word_in_row_device(q_sh, w0 + 12, x3, a0, a1, a2, a3)
                    a0, a1, a2, a3 = _score_word_in_row_device(q_sh, w0 + 16, x4, a0, a1, a2, a3)
                    a0, a1, a2, a3 = _score_word_in_row_device(q_sh, w0 + 20, x5, a0, a1, a2, a3)
                    a0, a1, a2, a3 = _score_word_in_row_device(q_sh, w0 + 24, x6, a0, a1, a2, a3)
                    a0, a1, a2, a3 = _score_word_in_row_device(q_sh, w0 + 28, x7, a0, a1, a2, a3)
                else:
                    a0, a1, a2, a3 = _score_word_device(q_sh, w0, x0, nw, a0, a1, a2, a3)
                    a0, a1, a2, a3 = _score_word_device(q_sh, w0 + 4, x1, nw, a0, a1, a2, a3)
                    a0, a1, a2, a3 = _score_word_device(q_sh, w0 + 8, x2, nw, a0, a1, a2, a3)
                    a0, a1, a2, a3 = _score_word_device(q_sh, w0 + 12, x3, nw, a0, a1, a2, a3)
                    a0, a1, a2, a3 = _score_word_device(q_sh, w0 + 16, x4, nw, a0, a1, a2, a3)
                    a0, a1, a2, a3 = _score_word_device(q_sh, w0 + 20, x5, nw, a0, a1, a2, a3)
                    a0, a1, a2, a3 = _score_word_device(q_sh, w0 + 24, x6, nw, a0, a1, a2, a3)
                    a0, a1, a2, a3 = _score_word_device(q_sh, w0 + 28, x7, nw, a0, a1, a2, a3)
                x = y
        red[rr * HEADS_PER_BLOCK, tid] = a0
        red[rr * HEADS_PER_BLOCK + 1, tid] = a1
        red[rr * HEADS_PER_BLOCK + 2, tid] = a2
        red[rr * HEADS_PER_BLOCK + 3, tid] = a3
    cuda.syncthreads()
    r = r0 + qd                                       # lane qd of the quad finishes row r0 + qd
    if qd < rows_per_quad and r < n_rows:
        valid = _key_row_device(win_idx, cmp_idx, t, r)[0] >= 0
        base = quad * 4
        for hh in range(HEADS_PER_BLOCK):
            v = red[qd * HEADS_PER_BLOCK + hh, base]
            for k in range(1, 4):
                v += red[qd * HEADS_PER_BLOCK + hh, base + k]
            z[t, h0 + hh, r] = v * scale if valid else NEG_INF


@inline_device
def _scores_device(z, t, h, r, v):
    """v[i] = z[t, h, r + 32 i] for i < SOFTMAX_LOADS, the row clamped to the last (every load goes out before any
    is used: a lane's rows are otherwise one dependent L2 round trip each)."""
    last = z.shape[2] - 1
    for i in range(SOFTMAX_LOADS):
        v[i] = z[t, h, min(r + WARP * i, last)]


@inline_device
def _softmax_device(z, sink, t, h, lane, want_den):
    """(m, den) of (t, h) in every lane of the warp: m the largest score over its rows (each lane its rows lane,
    lane + 32, ... in order, then xor shuffles), NEG_BIG in place of -inf when no row is valid; den, when
    `want_den`, the float64 sum of exp(z - m) over the rows (lane-strided in row order, then the warp's tree) plus
    exp(sink - m), as FP32, 0 when no row is valid (valid in lane 0; 0 when not wanted). Up to WARP * SOFTMAX_LOADS
    rows (V4.1's 640) are one batch of loads, which the denominator reuses; more are read again."""
    n = z.shape[2]
    v = cuda.local.array(SOFTMAX_LOADS, np.float32)
    m = NEG_INF
    r = lane
    while r < n:
        _scores_device(z, t, h, r, v)
        for i in range(SOFTMAX_LOADS):
            if r + WARP * i < n:
                m = max(m, v[i])
        r += WARP * SOFTMAX_LOADS
    off = WARP // 2
    while off > 0:
        m = max(m, cuda.shfl_xor_sync(0xFFFFFFFF, m, off))
        off //= 2
    has = m > NEG_INF
    m = m if has else NEG_BIG
    dv = np.float32(0.0)
    if want_den:                                  # (warp-uniform)
        acc = 0.0
        r = lane
        while r < n:
            if n > WARP * SOFTMAX_LOADS:
                _scores_device(z, t, h, r, v)
            for i in range(SOFTMAX_LOADS):
                if r + WARP * i < n:
                    acc += np.float64(exp_f32_device(v[i] - m))
            r += WARP * SOFTMAX_LOADS
        acc = warp_tree_sum_device(acc)
        dv = np.float32(acc) + exp_f32_device(sink[h] - m) if has else np.float32(0.0)
    return m, dv


@inline_device
def _tile_loads_device(z, win_idx, cmp_idx, t, h0, k):
    """What the value kernel's thread stages for row k of a tile: the key row's index and whether it is the
    window's (_key_row_device) and the row's 4 scores of the block's heads, loads issued together (past the last
    row, the last row's: never staged)."""
    kc = min(k, z.shape[2] - 1)
    row, inw = _key_row_device(win_idx, cmp_idx, t, kc)
    return row, inw, z[t, h0, kc], z[t, h0 + 1, kc], z[t, h0 + 2, kc], z[t, h0 + 3, kc]


@inline_device
def _value_word_device(win_keys, cmp_keys, kr, from_win, col):
    """Key word `col` of a row (8 bytes, 4 BF16): row kr of the window buffer or of the compressed cache; row 0
    of it when kr < 0 (a load that is never used, so that the loads of a group go out together)."""
    r = max(kr, 0)
    return win_keys[r, col] if from_win else cmp_keys[r, col]


@inline_device
def _value_group_device(win_keys, cmp_keys, k_sh, w_sh, k0, n, tid, kr, words):
    """kr[g], words[g] = the key row and word `tid` of staged row k0 + g of the tile (g < VALUE_GROUP), -1 and row
    0's word past its n rows: the group's loads issued together."""
    for g in range(VALUE_GROUP):
        k = min(k0 + g, n - 1)
        kr[g] = k_sh[k] if k0 + g < n else np.int64(-1)
        words[g] = _value_word_device(win_keys, cmp_keys, kr[g], w_sh[k], tid)


@cuda.jit(cache=True)
def attn_value_kernel(z, sink, win_keys, win_idx, cmp_keys, cmp_idx, den, part):
    """The softmax and the weighted sum of the values. Warp w takes head h0 + w: the scores' max m over all rows
    of (t, h) (every split's block finds it), and split 0's block writes den[t, h] = float64 sum of exp(z - m) +
    exp(sink - m) (0 when no row is valid). part[t, s, h, :] = sum over rows of split s of the weight
    bf16(exp(z[t, h, r] - m)) * key(r); one thread per 4 dims. A split is whole chunks of VALUE_CHUNK rows (the
    last chunk may be short); each chunk is summed from zero in row order and the chunk sums are added in order, so
    the result does not depend on how many chunks a split holds as long as the splits are 1 or one per chunk (the
    launcher's choices). Rows go in groups of VALUE_GROUP with the group's key loads issued before its
    arithmetic."""
    grid_entry_device()
    tid = cuda.threadIdx.x
    s = cuda.blockIdx.x
    h0 = cuda.blockIdx.y * HEADS_PER_BLOCK
    t = cuda.blockIdx.z
    n_split = part.shape[1]
    nw = part.shape[3] // 4
    n_rows = z.shape[2]
    per = ((n_rows + n_split - 1) // n_split + VALUE_CHUNK - 1) // VALUE_CHUNK * VALUE_CHUNK
    r_lo = s * per
    r_hi = min(n_rows, r_lo + per)
    m_sh = cuda.shared.array(HEADS_PER_BLOCK, np.float32)
    lane = tid % WARP
    hw = h0 + tid // WARP                         # the warp's head (THREADS // WARP == HEADS_PER_BLOCK)
    row, inw, z0, z1, z2, z3 = _tile_loads_device(z, win_idx, cmp_idx, t, h0, r_lo + tid)   # the first
    m, dv = _softmax_device(z, sink, t, hw, lane, s == 0)          # tile's, before the softmax (no need of its max)
    if s == 0 and lane == 0:
        den[t, hw] = dv
    if lane == 0:
        m_sh[tid // WARP] = m
    cuda.syncthreads()
    e_sh = cuda.shared.array(E_SH, np.float32, alignment=LOAD4_ALIGN)   # row k's 4 heads' weights at 4k (one LDS.128)
    k_sh = cuda.shared.array(VALUE_TILE, np.int64)
    w_sh = cuda.shared.array(VALUE_TILE, np.bool_)
    acc = cuda.local.array((HEADS_PER_BLOCK, 4), np.float32)
    tot = cuda.local.array((HEADS_PER_BLOCK, 4), np.float32)
    kr = cuda.local.array(VALUE_GROUP, np.int64)
    words = cuda.local.array(VALUE_GROUP, np.uint64)
    kr2 = cuda.local.array(VALUE_GROUP, np.int64)
    words2 = cuda.local.array(VALUE_GROUP, np.uint64)
    for hh in range(HEADS_PER_BLOCK):
        for i in range(4):
            acc[hh, i] = np.float32(0.0)
            tot[hh, i] = np.float32(0.0)
    for base in range(r_lo, r_hi, VALUE_TILE):
        n = min(VALUE_TILE, r_hi - base)
        if base != r_lo:
            row, inw, z0, z1, z2, z3 = _tile_loads_device(z, win_idx, cmp_idx, t, h0, base + tid)
        if tid < n:                               # a thread a row (VALUE_TILE == THREADS)
            k_sh[tid], w_sh[tid] = row, inw
            e_sh[HEADS_PER_BLOCK * tid] = round_bf16_device(exp_f32_device(z0 - m_sh[0]))
            e_sh[HEADS_PER_BLOCK * tid + 1] = round_bf16_device(exp_f32_device(z1 - m_sh[1]))
            e_sh[HEADS_PER_BLOCK * tid + 2] = round_bf16_device(exp_f32_device(z2 - m_sh[2]))
            e_sh[HEADS_PER_BLOCK * tid + 3] = round_bf16_device(exp_f32_device(z3 - m_sh[3]))
        cuda.syncthreads()
        if tid < nw:
            _value_group_device(win_keys, cmp_keys, k_sh, w_sh, 0, n, tid, kr, words)
            for k0 in range(0, n, VALUE_GROUP):
                _value_group_device(win_keys, cmp_keys, k_sh, w_sh, k0 + VALUE_GROUP, n, tid, kr2, words2)   # the
                for g in range(VALUE_GROUP):                            # next group's loads before this one's sums
                    if kr[g] >= 0:
                        word = words[g]
                        v0 = bf16x4_device(word, 0)
                        v1 = bf16x4_device(word, 1)
                        v2 = bf16x4_device(word, 2)
                        v3 = bf16x4_device(word, 3)
                        es = load4_device(e_sh, HEADS_PER_BLOCK * (k0 + g))
                        for hh in range(HEADS_PER_BLOCK):
                            e = es[hh]
                            acc[hh, 0] += e * v0
                            acc[hh, 1] += e * v1
                            acc[hh, 2] += e * v2
                            acc[hh, 3] += e * v3
                if (k0 + VALUE_GROUP) % VALUE_CHUNK == 0 or k0 + VALUE_GROUP >= n:   # a chunk ends (tiles are
                    for hh in range(HEADS_PER_BLOCK):                                  # whole chunks but the last)
                        for i in range(4):
                            tot[hh, i] += acc[hh, i]
                            acc[hh, i] = np.float32(0.0)
                for g in range(VALUE_GROUP):
                    kr[g] = kr2[g]
                    words[g] = words2[g]
        cuda.syncthreads()
    if tid < nw:
        for hh in range(HEADS_PER_BLOCK):
            for i in range(4):
                part[t, s, h0 + hh, 4 * tid + i] = tot[hh, i]


@bounded_jit(THREADS)
def attn_combine_kernel(part, den, positions, cos, sin, has_rope, kv, kv_pos, ring, ring_pos, has_window, xd, ps,
                        has_stage, out):
    """out[t, h, d] = bf16(sum_s part[t, s, h, d] / den[t, h]), 0 where den == 0 (no valid row); with `has_rope`
    the tail's adjacent pairs then rotate back to positions[t] exactly as kernels.rope's inverse rotation does
    (the pair's other value from the neighbouring lane: a pair never straddles a warp). With `has_window` the
    threads of head 0 also do window_write_kernel's stores of kv [T, Dh] at kv_pos into ring / ring_pos: every
    read of the ring in this attention (scores, values) is done by then. With `has_stage` the output, as the flat
    [T, H * Dh] input of the output projection, is also staged for kernels.q4k_gemv's integer path into xd / ps
    (im_stage_lane_device: a warp's 32 outputs are one block of 32 of that row)."""
    grid_entry_device()
    n_tok, n_split, n_heads, dh = part.shape
    g = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    ok = g < n_tok * n_heads * dh
    gc = g if ok else 0                               # lanes past the end shadow element 0 (the shuffle needs them)
    d = gc % dh
    h = (gc // dh) % n_heads
    t = gc // (dh * n_heads)
    if has_window and ok and h == 0:
        _window_store_device(kv, kv_pos, ring, ring_pos, t, d)
    dv = den[t, h]                                   # every load of the thread before the first add
    p = d // 2 - (dh // 2 - cos.shape[1])
    c = sn = np.float32(0.0)
    if has_rope and p >= 0:
        c = cos[positions[t], p]
        sn = -sin[positions[t], p]
    num = part[t, 0, h, d]
    v = cuda.local.array(COMBINE_LOADS, np.float32)
    last = np.uint32(n_split - 1)
    s = 1
    while s < n_split:                               # the splits added in order, COMBINE_LOADS loads in flight
        for i in range(COMBINE_LOADS):
            v[i] = part[t, _min_u32(s, i, last), h, d]
        for i in range(COMBINE_LOADS):
            if s + i < n_split:
                num += v[i]
        s += COMBINE_LOADS
    v = round_bf16_device(num / dv) if dv > np.float32(0.0) else np.float32(0.0)
    if has_rope:
        other = cuda.shfl_xor_sync(0xFFFFFFFF, v, 1)
        if p >= 0:
            v = rope_pair_value_device(v, other, d % 2 == 1, c, sn)
    if has_stage:                                     # every lane: the staging's warp reductions
        im_stage_lane_device(v if ok else np.float32(0.0), g // WARP, g % WARP, ok, xd, ps)
    if ok:
        out[t, h, d] = v


SIGNATURES = {
    "window_write_kernel": "void(float32[:, :], int64[:], uint16[:, :], int64[:])",
    "window_index_kernel": "void(int64[:], int64[:], int32[:, :])",
    "cache_write_kernel": "void(float32[:, :], int64[:], uint16[:, :])",
    "attn_score_kernel": "void(float32[:, :, :], uint64[:, :], int32[:, :], uint64[:, :], int32[:, :], float32, int64, "
                         "int64[:], float32[:, :], float32[:, :], boolean, float32[:, :, :])",
    "attn_value_kernel": "void(float32[:, :, :], float32[:], uint64[:, :], int32[:, :], uint64[:, :], int32[:, :], "
                         "float32[:, :], float32[:, :, :, :])",
    "attn_combine_kernel": "void(float32[:, :, :, :], float32[:, :], int64[:], float32[:, :], float32[:, :], boolean, "
                           "float32[:, :], int64[:], uint16[:, :], int64[:], boolean, uint32[:], float32[:], boolean, "
                           "float32[:, :, :])",
}




def _blocks(n):
    return (n + THREADS - 1) // THREADS


# ----------------------------------------------------------------------------------------------- launchers
def _check_window(kv, positions, ring, ring_pos, name):
    if len(kv.shape) != 2 or tuple(ring.shape)[1:] != tuple(kv.shape)[1:] or ring.dtype != np.uint16:
        raise ValueError(f"{name}: kv {kv.shape} does not fit ring {ring.shape} (uint16)")
    if tuple(ring_pos.shape) != (ring.shape[0],) or tuple(positions.shape) != (kv.shape[0],):
        raise ValueError(f"{name}: ring_pos must be [W] and positions [T]")


def window_write(kv, positions, ring, ring_pos, stream=0):
    """kv [T, Dh] float32 (BF16 values) at consecutive positions [T] int64 -> ring [W, Dh] uint16, ring_pos [W]."""
    _check_window(kv, positions, ring, ring_pos, "window_write")
    n = min(kv.shape[0], ring.shape[0]) * kv.shape[1]
    if n:
        window_write_kernel[_blocks(n), THREADS, stream](kv, positions, ring, ring_pos)


def window_indices(ring_pos, positions, out=None, stream=0):
    """Window rows of each query into the key buffer [ring (W); chunk rows (T)] -> int32 [T, W]; positions [T]
    int64 on the device, consecutive (the call starts at positions[0])."""
    w = ring_pos.shape[0]
    n_tok = positions.shape[0]
    if out is None:
        out = cuda.device_array((n_tok, w), np.int32, stream=stream)
    elif tuple(out.shape) != (n_tok, w):
        raise ValueError(f"window_indices: out {out.shape} must be {(n_tok, w)}")
    if n_tok * w:
        window_index_kernel[_blocks(n_tok * w), THREADS, stream](ring_pos, positions, out)
    return out


def cache_write(src, rows, dst, stream=0):
    """src [n, Dh] float32 (BF16 values) -> dst[rows[i]] (uint16 [N, Dh]); rows [n] int64, negative = skip."""
    if len(src.shape) != 2 or dst.dtype != np.uint16 or tuple(dst.shape)[1:] != tuple(src.shape)[1:]:
        raise ValueError(f"cache_write: src {src.shape} does not fit dst {dst.shape} (uint16)")
    if tuple(rows.shape) != (src.shape[0],):
        raise ValueError("cache_write: rows must be [n]")
    n = src.shape[0] * src.shape[1]
    if n:
        cache_write_kernel[_blocks(n), THREADS, stream](src, rows, dst)


def _value_splits(n_tok, n_heads, n_rows):
    """Row splits of the value kernel: one per VALUE_CHUNK rows when one split per (token, head block) would
    leave the GPU under ~256 blocks (decode: V4.1 has 16 head blocks), else 1. Either way a row's chunk sums
    are added in the same order, so prefill and decode give the same bits."""
    blocks = n_tok * (n_heads // HEADS_PER_BLOCK)
    return 1 if blocks >= 256 else max(1, math.ceil(n_rows / VALUE_CHUNK))


def _score_rows_per_quad(n_tok, head_blocks, n_rows):
    """Rows per quad of the score kernel: 4 (128 rows a block) unless that leaves the grid under SCORE_BLOCKS
    blocks, as a decode step does (V4.1: 16 head blocks x 640 rows = 80 blocks), then 2 or 1."""
    for rpq in (4, 2):
        if n_tok * head_blocks * math.ceil(n_rows / (THREADS // 4 * rpq)) >= SCORE_BLOCKS:
            return rpq
    return 1


def _rope_args(rope, name, q, scratch, stream):
    """(positions [T] int64, cos, sin [P, rd/2]) of a fused rotation, checked against q [T, H, Dh]; placeholders
    when `rope` is None (the kernel's flag is then off)."""
    if rope is None:
        return (_scratch(scratch, "no_positions", (1,), np.int64, stream),
                *(_scratch(scratch, "no_rope", (1, 1), np.float32, stream),) * 2)
    positions, cos, sin = rope
    n_tok, _, dh = tuple(q.shape)
    if tuple(positions.shape) != (n_tok,) or positions.dtype != np.int64 or tuple(cos.shape) != tuple(sin.shape) \
            or len(cos.shape) != 2 or 2 * cos.shape[1] > dh:
        raise ValueError(f"sparse_attention: {name} positions {positions.shape} / tables {cos.shape} "
                         f"{sin.shape} do not fit q {q.shape}")
    return positions, cos, sin


def sparse_attention(q, win_keys, win_idx, cmp_keys, cmp_idx, sink, scale, out=None, n_split=None, scratch=None,
                     stream=0, rows_per_quad=None, inverse_rope=None, rope_q=None, window=None, im_stage=None):
    """q [T, H, Dh] float32; win_keys [Nw, Dh] uint16 (BF16 bits) with win_idx [T, Kw] int32 rows (-1 invalid);
    cmp_keys [Nc, Dh] uint16 with cmp_idx [T, Kc] int32 (or both None); sink [H] float32 -> out [T, H, Dh].
    `scratch` (a dict kept by the caller) holds the temporaries across calls. `inverse_rope` = (positions [T] int64,
    cos, sin [P, rd/2]): the output then leaves rotated back as `rope.rope(out, positions, cos, sin, inverse=True)`
    would leave it, bit for bit, without that launch. `rope_q` = (positions, cos, sin) likewise: q is the unrotated
    query, and the scores use it rotated as `rope.rope(q, positions, cos, sin)` would leave it, without that launch
    (q itself is left as it is). `window` = (kv [T, Dh], positions [T], ring, ring_pos): after attending, the window
    ring is written as `window_write(*window)` would write it, by the combine kernel (one launch fewer; the ring
    may be what win_keys views). `im_stage` = (digits, pairs) of kernels.im_operand.im_stage_shapes(T, H * Dh): the
    output is also staged for the output projection's integer path as `q4k_gemv.im_stage(out.reshape(T, H * Dh),
    quantize=False)` would stage it (finite outputs: bit for bit), for q4k_gemv(..., staged=im_stage); out must then
    be C-contiguous."""
    n_tok, n_heads, dh = tuple(q.shape)
    if q.dtype != np.float32 or dh % 4 or dh > DH_MAX or n_heads % HEADS_PER_BLOCK:
        raise ValueError(f"sparse_attention: q must be float32 [T, H, Dh] with H % {HEADS_PER_BLOCK} == 0, "
                         f"Dh % 4 == 0 and Dh <= {DH_MAX}, got {q.dtype} {q.shape}")
    if cmp_keys is None:
        cmp_keys = _scratch(scratch, "no_keys", (1, dh), np.uint16, stream)
        cmp_idx = _scratch(scratch, "no_idx", (n_tok, 0), np.int32, stream)
    for keys, idx, name in ((win_keys, win_idx, "window"), (cmp_keys, cmp_idx, "compressed")):
        if keys.dtype != np.uint16 or tuple(keys.shape)[1:] != (dh,) or idx.dtype != np.int32 \
                or len(idx.shape) != 2 or idx.shape[0] != n_tok:
            raise ValueError(f"sparse_attention: {name} keys {keys.dtype} {keys.shape} / index {idx.dtype} "
                             f"{idx.shape} do not fit q {q.shape}")
    if tuple(sink.shape) != (n_heads,):
        raise ValueError(f"sparse_attention: sink must be [{n_heads}]")
    n_rows = win_idx.shape[1] + cmp_idx.shape[1]
    if out is None:
        out = cuda.device_array((n_tok, n_heads, dh), np.float32, stream=stream)
    if n_tok == 0:
        return out
    if n_rows == 0:
        n_rows_z = 1                                 # one invalid row: every output is 0
    else:
        n_rows_z = n_rows
    hb = n_heads // HEADS_PER_BLOCK
    split = n_split or _value_splits(n_tok, n_heads, n_rows_z)
    z = _scratch(scratch, "z", (n_tok, n_heads, n_rows_z), np.float32, stream)
    den = _scratch(scratch, "den", (n_tok, n_heads), np.float32, stream)
    part = _scratch(scratch, "part", (n_tok, split, n_heads, dh), np.float32, stream)
    q_pos, q_cos, q_sin = _rope_args(rope_q, "rope_q", q, scratch, stream)
    positions, cos, sin = _rope_args(inverse_rope, "inverse_rope", q, scratch, stream)
    wk, ck = win_keys.view(np.uint64), cmp_keys.view(np.uint64)
    rpq = rows_per_quad or _score_rows_per_quad(n_tok, hb, n_rows_z)
    grid = (math.ceil(n_rows_z / (THREADS // 4 * rpq)), hb, n_tok)
    attn_score_kernel[grid, THREADS, stream](q, wk, win_idx, ck, cmp_idx, np.float32(scale), rpq, q_pos, q_cos, q_sin,
                                             rope_q is not None, z)
    attn_value_kernel[(split, hb, n_tok), THREADS, stream](z, sink, wk, win_idx, ck, cmp_idx, den, part)
    if window is None:
        kv = _scratch(scratch, "no_kv", (1, 1), np.float32, stream)
        kv_pos = ring_pos = _scratch(scratch, "no_positions", (1,), np.int64, stream)
        ring = _scratch(scratch, "no_ring", (1, 1), np.uint16, stream)
    else:
        kv, kv_pos, ring, ring_pos = window
        _check_window(kv, kv_pos, ring, ring_pos, "sparse_attention window")
        if kv.shape[0] != n_tok:
            raise ValueError(f"sparse_attention: window kv {kv.shape} does not fit q {q.shape}")
    if im_stage is None:
        xd = _scratch(scratch, "no_digits", (1,), np.uint32, stream)
        ps = _scratch(scratch, "no_pairs", (1,), np.float32, stream)
    else:
        if not out.is_c_contiguous() or dh % WARP:
            raise ValueError("sparse_attention: im_stage needs a C-contiguous out and Dh % 32 == 0")
        im_operand.check_im_staged(im_stage, n_tok, n_heads * dh, "sparse_attention")
        xd, ps = im_stage
    attn_combine_kernel[_blocks(n_tok * n_heads * dh), THREADS, stream](part, den, positions, cos, sin,
                                                                       inverse_rope is not None, kv, kv_pos, ring,
                                                                       ring_pos, window is not None, xd, ps,
                                                                       im_stage is not None, out)
    return out

"""The V4.1 indexer on the device: index scores, candidate blocks, top-k (ds4lib.ref.indexer;
docs/architecture.md §6.3–§6.5, errata N1 and N2 in §1.2).

Owns:
- `index_scores`: score[t, s] = bf16(sum_h bf16(relu(bf16(q[t, h] . K[s])) * w[t, h])), the head sum in FP32 in
  head order, w = bf16(weights_proj(x) * scale); -inf where s >= (pos_t + 1) // ratio or where the candidate
  mask (per block of `cand_block` positions) is off. Two kernels give the same bits (with FP4-simulated q and keys
  every product and partial sum is exact in FP32, so the dot products do not depend on their order; the rounded
  terms of a row are added in head order by one thread):
  - `index_score_kernel`, on the tensor cores: a warp takes tiles of 16 key rows as the A operand of BF16 MMAs
    (m16n8k16, the keys' BF16 words as stored) against the query's heads as B (4 tiles of 8 heads, staged once a
    block in shared memory in fragment order), 8 chained steps of 16 dims; tiles wholly past the query's reach skip
    the products. The default (SCORES_MMA): 6.3 / 6.6 / 8.2 us a call at 256 / 4,096 / 16,384 rows against 38-40 us
    for the rows kernel, the same bits (H100, bench/dev/index_probe.py; BENCHMARKS.md, twenty-eighth session).
  - `index_score_rows_kernel`: a thread per key row with all heads in registers, queries in shared memory; 39, 41
    and 53 us per call at 1k, 16k and 64k context in a V4.1 decode step on the H200 (BENCHMARKS.md; the other
    layouts measured are in kernels/dev for bench/dev/index_probe.py). `tensor_cores=False` takes it.
- `select_topk`: the k best per row by (score descending, lower index first), returned in ascending index
  order, entries >= the row's reach replaced by -1, -1 padded: a two-pass radix select on the 16-bit
  order key of the BF16 scores (histograms merged with one global atomic per non-empty bin and block),
  then a compaction in index order (per-block counts, prefix over earlier blocks, ballot ranks): seven launches.
  `topk_one_kernel` does all of it for a row in one block and one launch (a shared histogram, the same scan and
  compaction as device functions), the same result; TOPK_ONE makes it the default up to ONE_MAX_ROWS scores. Off:
  in a V4.1 decode step it gains nothing beyond the runs' spread at 1k context and costs ~1 ms at 16k and 64k (one
  block for 4,096 and 16,384 scores a row; BENCHMARKS.md, twenty-eighth session).
- `candidate_blocks`: block scores (max over blocks of `block_size` positions, the newest reachable block
  pinned to +inf), the best `topk_blocks` blocks by the same selection, kept if their score is > -inf ->
  uint8 [T, nb] (per block; index_scores takes it with cand_block = block_size).
Does not own: the projections (gemv), RoPE (rope), the FP4 simulation (gemv.act_quant_fp4_pow2), the index-key
cache write (attention.cache_write).

Scores must be BF16 values or +-inf (index_scores guarantees it): the selection orders by their upper 16 bits.

Shapes: T queries, nI index heads (<= 32), dI index head dim (<= 128, % 16 == 0), S compressed rows,
nb = ceil(S / block_size) blocks, k = index_topk, NB = ceil(S / chunk) selection blocks per row.
"""
import math

import numpy as np
from numba import cuda
from numba.cuda.core import config as _cuda_config

from kernels import bounded_jit, inline_device
from kernels.bf16 import bf16x4_device, f32_bits, f32x2_device, mul_rn_device, round_bf16_device
from kernels.mma import MMA_EX_WORDS, mma_bf16_device
from kernels.pdl import grid_entry_device
from kernels.scratch import scratch_array as _scratch

__all__ = ["index_scores", "select_topk", "candidate_blocks", "index_score_kernel", "topk_init_kernel",
           "topk_hist_kernel", "topk_scan_kernel", "topk_count_kernel", "topk_write_kernel", "block_max_kernel",
           "candidate_keep_kernel", "SIGNATURES"]

THREADS = 128
WARP = 32
NI_MAX = 32
DI_MAX = 128
SCORE_WARPS = 4                     # index scores: warps of a block (a tile of 16 key rows at a time each),
SCORE_THREADS = SCORE_WARPS * WARP
SCORE_NT = NI_MAX // 8              # head tiles (the MMA's N = 8 heads)
SCORE_KS = DI_MAX // 16             # dim steps (the MMA's K = 16 dims)
SCORE_MAX_BLOCKS = 264              # blocks of a launch: 2 an SM on the H200; warps loop over further tiles
TERMS_PITCH = NI_MAX + 1            # floats a row of a warp's head terms takes in shared memory (no bank conflicts)
ROWS_THREADS = 64                   # index_score_rows_kernel: key rows (a thread each) per block
DI_PAIRS = DI_MAX // 2
SCORES_MMA = True                   # index_scores' default kernel: the tensor-core one (the same bits, 5x faster)
TOPK_ONE = False                    # select_topk's default: seven launches (one a row is slower past 1k context)
KW_WORDS = 2 * SCORE_KS             # a lane's key words of a tile (rows g and g + 8 at every step)
ACC_REGS = 4 * SCORE_NT             # a lane's accumulators of a tile (4 D registers a head tile)
CHUNK = 4096                        # scores per selection block (launch parameter `chunk` overrides)
SIM = bool(_cuda_config.ENABLE_CUDASIM)
ONE_THREADS = 128 if SIM else 1024  # select_topk of a row in one block (topk_one_kernel) ...
ONE_MAX_ROWS = 65536                # ... for rows of up to this many scores (1k to 256k context at ratio 4)
BINS = 256
WARPS = THREADS // WARP
NEG_INF = np.float32(-np.inf)
POS_INF = np.float32(np.inf)
# selection state per row: [hi byte of the threshold, count above it, threshold key, how many ties to take]
ST_HI, ST_ABOVE, ST_THETA, ST_NEED = 0, 1, 2, 3


# ------------------------------------------------------------------------------------------ index scores
@inline_device
def _score_word_device(s, t):
    """The key word (4 dims) that lane column t holds at MMA step s: steps 2i and 2i+1 take the adjacent words
    8i + 2t and 8i + 2t + 1, so a lane's two steps are 16 contiguous bytes of its key rows."""
    return 8 * (s // 2) + 2 * t + s % 2


@cuda.jit(cache=True)
def index_score_kernel(q, wts, wscale, keys, positions, ratio, cand, cand_block, use_cand, out):
    """out[t, s] on the tensor cores: a warp takes tiles of 16 key rows (A, BF16 as stored) against the query's
    heads (B, 4 tiles of 8 heads, staged in shared memory in fragment order); the 8 steps of 16 dims are chained
    BF16 MMAs with FP32 accumulators. Products and partial sums are exact (FP4-simulated q and keys), so the dot
    products are the reference's bits; the heads' rounded terms are then added in head order by one lane per row.
    Tiles wholly past the query's reach are written -inf without the products."""
    grid_entry_device()
    tid = cuda.threadIdx.x
    lane = tid % WARP
    warp = tid // WARP
    g = lane // 4
    tq = lane % 4
    t = cuda.blockIdx.y
    n_heads, di = q.shape[1], q.shape[2]
    n_rows = keys.shape[0]
    n_words = di // 4
    qf = cuda.shared.array((SCORE_NT, SCORE_KS, WARP), np.uint64)
    w_sh = cuda.shared.array(NI_MAX, np.float32)
    terms = cuda.shared.array((SCORE_WARPS, 16, TERMS_PITCH), np.float32)
    ex = cuda.shared.array((SCORE_WARPS, WARP, MMA_EX_WORDS), np.uint32)
    for i in range(tid, SCORE_NT * SCORE_KS * WARP, SCORE_THREADS):   # B fragments: head 8nt + g, word of (s, t)
        nt = i // (SCORE_KS * WARP)
        st = (i // WARP) % SCORE_KS
        ln = i % WARP
        h = 8 * nt + ln // 4
        wd = _score_word_device(st, ln % 4)
        v = np.uint64(0)
        if h < n_heads and wd < n_words:
            for e in range(4):                     # FP4-simulated values: their BF16 bits are exact
                v |= np.uint64(f32_bits(q[t, h, 4 * wd + e]) >> np.uint32(16)) << np.uint64(16 * e)
        qf[nt, st, ln] = v
    if tid < NI_MAX:
        w_sh[tid] = round_bf16_device(mul_rn_device(wts[t, tid], wscale)) if tid < n_heads else np.float32(0.0)
    cuda.syncthreads()
    reach = (positions[t] + 1) // ratio
    n_tiles = (n_rows + 15) // 16
    kw = cuda.local.array(KW_WORDS, np.uint64)               # [step][row g / g + 8]
    acc = cuda.local.array(ACC_REGS, np.float32)             # [head tile][D register]
    for tile in range(cuda.blockIdx.x * SCORE_WARPS + warp, n_tiles, cuda.gridDim.x * SCORE_WARPS):
        r0 = 16 * tile
        if r0 < reach:                                        # warp-uniform
            ra = min(r0 + g, n_rows - 1)
            rb = min(r0 + g + 8, n_rows - 1)
            for st in range(SCORE_KS):                        # every key load of the tile in flight at once
                wd = _score_word_device(st, tq)
                ok = wd < n_words
                kw[2 * st] = keys[ra, wd] if ok else np.uint64(0)
                kw[2 * st + 1] = keys[rb, wd] if ok else np.uint64(0)
            for i in range(4 * SCORE_NT):
                acc[i] = np.float32(0.0)
            for st in range(SCORE_KS):
                a = kw[2 * st]
                b = kw[2 * st + 1]
                a0 = np.uint32(a & np.uint64(0xFFFFFFFF))
                a2 = np.uint32(a >> np.uint64(32))
                a1 = np.uint32(b & np.uint64(0xFFFFFFFF))
                a3 = np.uint32(b >> np.uint64(32))
                for nt in range(SCORE_NT):
                    bw = qf[nt, st, lane]
                    d0, d1, d2, d3 = mma_bf16_device(a0, a1, a2, a3, np.uint32(bw & np.uint64(0xFFFFFFFF)),
                                                     np.uint32(bw >> np.uint64(32)), acc[4 * nt], acc[4 * nt + 1],
                                                     acc[4 * nt + 2], acc[4 * nt + 3], ex[warp])
                    acc[4 * nt] = d0
                    acc[4 * nt + 1] = d1
                    acc[4 * nt + 2] = d2
                    acc[4 * nt + 3] = d3
            for nt in range(SCORE_NT):                        # D: rows g / g + 8, heads 8nt + 2tq + (0, 1)
                for j in range(4):
                    h = 8 * nt + 2 * tq + j % 2
                    terms[warp, g + 8 * (j // 2), h] = round_bf16_device(
                        max(round_bf16_device(acc[4 * nt + j]), np.float32(0.0)) * w_sh[h])
        cuda.syncwarp(0xFFFFFFFF)
        if lane < 16:
            srow = r0 + lane
            if srow < n_rows:
                v = NEG_INF
                if r0 < reach:
                    tot = np.float32(0.0)
                    for h in range(NI_MAX):                   # head sum in head order, as the reference
                        tot += terms[warp, lane, h]
                    if srow < reach and not (use_cand and cand[t, srow // cand_block] == 0):
                        v = round_bf16_device(tot)
                out[t, srow] = v
        cuda.syncwarp(0xFFFFFFFF)


@cuda.jit(cache=True)
def index_score_rows_kernel(q, wts, wscale, keys, positions, ratio, cand, cand_block, use_cand, out):
    """out[t, s] without the tensor cores: a thread per key row with all heads' accumulators in registers; per key
    word (4 dims, the next word's load in flight) every head's two query pairs come from shared memory as
    broadcasts; then the heads' rounded terms are added in head order."""
    grid_entry_device()
    tid = cuda.threadIdx.x
    t = cuda.blockIdx.y
    n_heads, di = q.shape[1], q.shape[2]
    n_rows = keys.shape[0]
    n_words = di // 4
    q_sh = cuda.shared.array((NI_MAX, DI_PAIRS), np.uint64)
    w_sh = cuda.shared.array(NI_MAX, np.float32)
    for k in range(tid, NI_MAX * DI_PAIRS, ROWS_THREADS):      # heads past n_heads and dims past di are zero
        h = k // DI_PAIRS
        c = k % DI_PAIRS
        v = np.uint64(0)
        if h < n_heads and 2 * c < di:
            v = np.uint64(f32_bits(q[t, h, 2 * c])) | (np.uint64(f32_bits(q[t, h, 2 * c + 1])) << np.uint64(32))
        q_sh[h, c] = v
    if tid < NI_MAX:
        w_sh[tid] = round_bf16_device(mul_rn_device(wts[t, tid], wscale)) if tid < n_heads else np.float32(0.0)
    cuda.syncthreads()
    s = cuda.blockIdx.x * ROWS_THREADS + tid
    if s >= n_rows:
        return                                      # no barrier follows
    acc = cuda.local.array(NI_MAX, np.float32)
    for h in range(NI_MAX):
        acc[h] = np.float32(0.0)
    nxt = keys[s, 0]
    for c in range(n_words):
        word = nxt
        if c + 1 < n_words:
            nxt = keys[s, c + 1]
        k0 = bf16x4_device(word, 0)
        k1 = bf16x4_device(word, 1)
        k2 = bf16x4_device(word, 2)
        k3 = bf16x4_device(word, 3)
        for h in range(NI_MAX):                     # products and partial sums exact: any order gives the same
            qa = q_sh[h, 2 * c]
            qb = q_sh[h, 2 * c + 1]
            acc[h] += (f32x2_device(qa, 0) * k0 + f32x2_device(qa, 1) * k1) + (
                f32x2_device(qb, 0) * k2 + f32x2_device(qb, 1) * k3)
    tot = np.float32(0.0)
    for h in range(NI_MAX):                         # head sum in head order, as the reference
        tot += round_bf16_device(max(round_bf16_device(acc[h]), np.float32(0.0)) * w_sh[h])
    v = round_bf16_device(tot)
    if s >= (positions[t] + 1) // ratio or (use_cand and cand[t, s // cand_block] == 0):
        v = NEG_INF
    out[t, s] = v


# --------------------------------------------------------------------------------------------- selection
@inline_device
def _key16_device(v):
    """Order key of a BF16 value: larger value -> larger key; -0 and +0 share a key."""
    u = f32_bits(v)
    if (u & np.uint32(0x7FFFFFFF)) == np.uint32(0):
        u = np.uint32(0)
    h = np.int32(u >> np.uint32(16))
    return (h ^ 0xFFFF) if (h & 0x8000) else (h | 0x8000)


@cuda.jit(cache=True)
def topk_init_kernel(hist, st, out):
    """Zero the histograms and state; -1 into every output slot (slots past min(k, S) stay -1)."""
    grid_entry_device()
    t = cuda.blockIdx.x
    for i in range(cuda.threadIdx.x, hist.shape[1] * BINS, cuda.blockDim.x):
        hist[t, i // BINS, i % BINS] = 0
    for i in range(cuda.threadIdx.x, out.shape[1], cuda.blockDim.x):
        out[t, i] = -1
    if cuda.threadIdx.x < st.shape[1]:
        st[t, cuda.threadIdx.x] = 0


@inline_device
def _hist_pass_device(scores, t, start, stop, step, pass_id, want_hi, hist):
    """Histogram of pass `pass_id` over scores[t, start:stop:step] into hist (int32 [BINS], shared): pass 0 the high
    byte of every key, pass 1 the low byte of the keys whose high byte is want_hi."""
    for i in range(start, stop, step):
        k = _key16_device(scores[t, i])
        if pass_id == 0:
            cuda.atomic.add(hist, k >> 8, 1)
        elif (k >> 8) == want_hi:
            cuda.atomic.add(hist, k & 0xFF, 1)


@cuda.jit(cache=True)
def topk_hist_kernel(scores, chunk, pass_id, st, hist):
    """Pass 0: histogram of the high byte of every key. Pass 1: of the low byte among keys whose high byte is
    the pass-0 choice. One shared histogram per block, merged with one atomic per non-empty bin."""
    grid_entry_device()
    tid = cuda.threadIdx.x
    t = cuda.blockIdx.y
    sh = cuda.shared.array(BINS, np.int32)
    for b in range(tid, BINS, THREADS):
        sh[b] = 0
    cuda.syncthreads()
    lo = cuda.blockIdx.x * chunk
    _hist_pass_device(scores, t, lo + tid, min(lo + chunk, scores.shape[1]), THREADS, pass_id, st[t, ST_HI], sh)
    cuda.syncthreads()
    for b in range(tid, BINS, THREADS):
        if sh[b]:
            cuda.atomic.add(hist, (t, pass_id, b), sh[b])


@inline_device
def _select_bin_device(hist, k, pass_id, st):
    """One selection step of a row (every thread of the block calls it; threads 0..127 own the bins): the lowest
    non-empty bin of `hist` (int32 [BINS]; scanning from the top) with fewer than k keys above it, recorded in `st`
    (int64 [4], ST_*). Thread i owns bins 255 - 2i and 254 - 2i; a warp-shuffle scan plus one shared step gives the
    counts above."""
    tid = cuda.threadIdx.x
    lane = tid % WARP
    warp = tid // WARP
    own = tid < BINS // 2
    b0 = BINS - 1 - 2 * tid
    c0 = hist[b0] if own else 0
    c1 = hist[b0 - 1] if own else 0
    base = np.int64(st[ST_ABOVE]) if pass_id == 1 else np.int64(0)
    incl = np.int64(c0 + c1)
    off = 1
    while off < WARP:
        v = cuda.shfl_up_sync(0xFFFFFFFF, incl, off)
        if lane >= off:
            incl += v
        off *= 2
    wsum = cuda.shared.array(WARPS, np.int64)
    best = cuda.shared.array(1, np.int32)
    if lane == WARP - 1 and own:
        wsum[warp] = incl
    if tid == 0:
        best[0] = -1
    cuda.syncthreads()
    before = base + incl - (c0 + c1)
    if own:
        for w in range(warp):
            before += wsum[w]
    # bins in descending order: b0 (count above = before), then b0 - 1 (above = before + c0)
    if own and c0 > 0 and before < k:
        cuda.atomic.max(best, 0, 2 * tid)
    if own and c1 > 0 and before + c0 < k:
        cuda.atomic.max(best, 0, 2 * tid + 1)
    cuda.syncthreads()
    j = best[0]
    if own and j >= 0 and j // 2 == tid:           # the owner of the chosen bin records the step
        b = BINS - 1 - j
        above = before if j % 2 == 0 else before + c0
        if pass_id == 0:
            st[ST_HI] = b
            st[ST_ABOVE] = above
        else:
            st[ST_THETA] = (st[ST_HI] << 8) | b
            st[ST_NEED] = k - above
    if j < 0 and tid == 0 and pass_id == 1:        # empty row: select nothing
        st[ST_THETA] = 0x10000
        st[ST_NEED] = 0


@cuda.jit(cache=True)
def topk_scan_kernel(hist, k, pass_id, st):
    """Per row (a block of 128 threads): _select_bin_device on the row's histogram of the pass."""
    grid_entry_device()
    t = cuda.blockIdx.x
    _select_bin_device(hist[t, pass_id], k, pass_id, st[t])


@cuda.jit(cache=True)
def topk_count_kernel(scores, chunk, st, cnt):
    """cnt[t, blk] = (keys above the threshold, keys equal to it) in the block's chunk."""
    grid_entry_device()
    tid = cuda.threadIdx.x
    t = cuda.blockIdx.y
    sh = cuda.shared.array(2, np.int32)
    if tid < 2:
        sh[tid] = 0
    cuda.syncthreads()
    lo = cuda.blockIdx.x * chunk
    hi = min(lo + chunk, scores.shape[1])
    theta = st[t, ST_THETA]
    n_gt = np.int32(0)
    n_eq = np.int32(0)
    for i in range(lo + tid, hi, THREADS):
        k = _key16_device(scores[t, i])
        if k > theta:
            n_gt += np.int32(1)
        elif k == theta:
            n_eq += np.int32(1)
    if n_gt:
        cuda.atomic.add(sh, 0, n_gt)
    if n_eq:
        cuda.atomic.add(sh, 1, n_eq)
    cuda.syncthreads()
    if tid < 2:
        cnt[t, cuda.blockIdx.x, tid] = sh[tid]


@inline_device
def _block_rank_device(flag, wtot):
    """(exclusive rank of this thread among flagged threads of the block, block total); thread order. wtot: int32
    shared, one slot a warp of the block."""
    lane = cuda.threadIdx.x % WARP
    warp = cuda.threadIdx.x // WARP
    bal = cuda.ballot_sync(0xFFFFFFFF, flag)
    below = cuda.popc(bal & ((np.uint32(1) << np.uint32(lane)) - np.uint32(1)))
    if lane == 0:
        wtot[warp] = cuda.popc(bal)
    cuda.syncthreads()
    rank = below
    total = 0
    for w in range(cuda.blockDim.x // WARP):
        if w < warp:
            rank += wtot[w]
        total += wtot[w]
    cuda.syncthreads()
    return rank, total


@cuda.jit(cache=True)
def topk_write_kernel(scores, chunk, st, cnt, positions, ratio, use_reach, out):
    """Selected indices of the block's chunk, in index order, at their global output slots."""
    grid_entry_device()
    tid = cuda.threadIdx.x
    t = cuda.blockIdx.y
    blk = cuda.blockIdx.x
    off = cuda.shared.array(2, np.int64)
    wtot = cuda.shared.array(WARPS, np.int32)
    if tid < 2:
        off[tid] = 0
    cuda.syncthreads()
    a_gt = 0
    a_eq = 0
    for b in range(tid, blk, THREADS):
        a_gt += cnt[t, b, 0]
        a_eq += cnt[t, b, 1]
    if a_gt:
        cuda.atomic.add(off, 0, a_gt)
    if a_eq:
        cuda.atomic.add(off, 1, a_eq)
    cuda.syncthreads()
    theta = st[t, ST_THETA]
    need = st[t, ST_NEED]
    eq_run = off[1]
    sel_run = off[0] + min(off[1], need)
    lim = (positions[t] + 1) // ratio if use_reach else scores.shape[1]
    lo = blk * chunk
    _write_selected_device(scores, t, lo, min(lo + chunk, scores.shape[1]), theta, need, eq_run, sel_run, lim, wtot,
                           out)


@inline_device
def _write_selected_device(scores, t, lo, hi, theta, need, eq_run, sel_run, lim, wtot, out):
    """The selected indices of scores[t, lo:hi] in index order into out[t] from slot sel_run on (keys above theta,
    and keys equal to it while fewer than `need` came before, eq_run of them before lo); the whole block calls it
    (a block-uniform trip count)."""
    for base in range(lo, hi, cuda.blockDim.x):
        i = base + cuda.threadIdx.x
        k = _key16_device(scores[t, i]) if i < hi else -1
        eq = k == theta
        r_eq, n_eq = _block_rank_device(eq, wtot)
        sel = k > theta or (eq and eq_run + r_eq < need)
        r_sel, n_sel = _block_rank_device(sel, wtot)
        if sel:
            out[t, sel_run + r_sel] = i if i < lim else -1
        eq_run += n_eq
        sel_run += n_sel


def _make_topk_one_kernel():
    @bounded_jit(ONE_THREADS)
    def topk_one_kernel(scores, k, positions, ratio, use_reach, out):
        """select_topk of a row in one block (blockIdx.x = row): topk_init_kernel, both passes of topk_hist_kernel
        and topk_scan_kernel on a shared histogram, then topk_write_kernel's compaction over the whole row, so the
        same selection in the same slots as the launches it replaces."""
        grid_entry_device()
        tid = cuda.threadIdx.x
        nth = cuda.blockDim.x
        t = cuda.blockIdx.x
        n = scores.shape[1]
        hist = cuda.shared.array(BINS, np.int32)
        st = cuda.shared.array(4, np.int64)
        wtot = cuda.shared.array(WARP, np.int32)
        for i in range(tid, out.shape[1], nth):
            out[t, i] = -1
        if tid < 4:
            st[tid] = 0
        for pass_id in range(2):
            for b in range(tid, BINS, nth):
                hist[b] = 0
            cuda.syncthreads()
            _hist_pass_device(scores, t, tid, n, nth, pass_id, st[ST_HI], hist)
            cuda.syncthreads()
            _select_bin_device(hist, k, pass_id, st)
            cuda.syncthreads()
        lim = (positions[t] + 1) // ratio if use_reach else n
        _write_selected_device(scores, t, 0, n, st[ST_THETA], st[ST_NEED], np.int64(0), np.int64(0), lim, wtot, out)
    return topk_one_kernel


topk_one_kernel = _make_topk_one_kernel()


@cuda.jit(cache=True)
def block_max_kernel(scores, positions, ratio, block_size, out):
    """out[t, b] = max over block b of scores[t] (missing positions -inf); the newest reachable block +inf."""
    grid_entry_device()
    n_tok, n_rows = scores.shape
    nb = out.shape[1]
    g = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if g >= n_tok * nb:
        return
    t = g // nb
    b = g % nb
    m = NEG_INF
    for s in range(b * block_size, min((b + 1) * block_size, n_rows)):
        m = max(m, scores[t, s])
    newest = ((positions[t] + 1) // ratio - 1) // block_size
    out[t, b] = POS_INF if b == newest else m


@cuda.jit(cache=True)
def candidate_keep_kernel(block_scores, ids, keep):
    """keep[t, b] = 1 if block b is among the row's selected ids (ascending, -1 at the end) and > -inf."""
    grid_entry_device()
    n_tok, nb = block_scores.shape
    g = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if g >= n_tok * nb:
        return
    t = g // nb
    b = g % nb
    lo = 0
    hi = ids.shape[1]
    while lo < hi:                                 # first slot whose id is >= b (-1 counts as +inf)
        mid = (lo + hi) // 2
        v = ids[t, mid]
        if v >= 0 and v < b:
            lo = mid + 1
        else:
            hi = mid
    found = lo < ids.shape[1] and ids[t, lo] == b
    keep[t, b] = 1 if found and block_scores[t, b] > NEG_INF else 0


SIGNATURES = {
    "index_score_kernel": "void(float32[:, :, :], float32[:, :], float32, uint64[:, :], int64[:], int64, "
                          "uint8[:, :], int64, boolean, float32[:, :])",
    "index_score_rows_kernel": "void(float32[:, :, :], float32[:, :], float32, uint64[:, :], int64[:], int64, "
                               "uint8[:, :], int64, boolean, float32[:, :])",
    "topk_init_kernel": "void(int32[:, :, :], int64[:, :], int32[:, :])",
    "topk_hist_kernel": "void(float32[:, :], int64, int64, int64[:, :], int32[:, :, :])",
    "topk_scan_kernel": "void(int32[:, :, :], int64, int64, int64[:, :])",
    "topk_count_kernel": "void(float32[:, :], int64, int64[:, :], int32[:, :, :])",
    "topk_write_kernel": "void(float32[:, :], int64, int64[:, :], int32[:, :, :], int64[:], int64, boolean, "
                         "int32[:, :])",
    "topk_one_kernel": "void(float32[:, :], int64, int64[:], int64, boolean, int32[:, :])",
    "block_max_kernel": "void(float32[:, :], int64[:], int64, int64, float32[:, :])",
    "candidate_keep_kernel": "void(float32[:, :], int32[:, :], uint8[:, :])",
}




# ----------------------------------------------------------------------------------------------- launchers
def index_scores(q, wts, wscale, keys, positions, ratio, cand=None, cand_block=1, out=None, scratch=None,
                 stream=0, tensor_cores=None):
    """q [T, nI, dI] float32 (RoPE'd, FP4-simulated); wts [T, nI] float32 (weights_proj output, BF16 values);
    keys [S, dI] uint16 BF16 bits; positions [T] int64 -> scores [T, S] float32 (BF16 values, -inf masked).
    `cand` uint8 [T, ceil(S / cand_block)] from candidate_blocks masks positions of dropped blocks. `tensor_cores`:
    index_score_kernel (True) or index_score_rows_kernel (False), the same bits; None takes SCORES_MMA."""
    n_tok, n_heads, di = tuple(q.shape)
    if q.dtype != np.float32 or n_heads > NI_MAX or di > DI_MAX or di % 16:
        raise ValueError(f"index_scores: q must be float32 [T, nI <= {NI_MAX}, dI <= {DI_MAX}, dI % 16 == 0]")
    if keys.dtype != np.uint16 or tuple(keys.shape)[1:] != (di,) or tuple(wts.shape) != (n_tok, n_heads):
        raise ValueError(f"index_scores: keys {keys.dtype} {keys.shape} / wts {wts.shape} do not fit q {q.shape}")
    n_rows = keys.shape[0]
    use_cand = cand is not None
    if use_cand and tuple(cand.shape) != (n_tok, -(-n_rows // cand_block)):
        raise ValueError(f"index_scores: cand {cand.shape} must be [T, ceil(S / {cand_block})]")
    if not use_cand:
        cand = _scratch(scratch, "no_cand", (1, 1), np.uint8, stream)
    if out is None:
        out = cuda.device_array((n_tok, n_rows), np.float32, stream=stream)
    if n_tok * n_rows:
        args = (q, wts, np.float32(wscale), keys.view(np.uint64), positions, int(ratio), cand, int(cand_block),
                use_cand, out)
        if SCORES_MMA if tensor_cores is None else tensor_cores:
            grid = (min(SCORE_MAX_BLOCKS, math.ceil(n_rows / (16 * SCORE_WARPS))), n_tok)
            index_score_kernel[grid, SCORE_THREADS, stream](*args)
        else:
            index_score_rows_kernel[(math.ceil(n_rows / ROWS_THREADS), n_tok), ROWS_THREADS, stream](*args)
    return out


def select_topk(scores, k, positions=None, ratio=1, chunk=CHUNK, out=None, scratch=None, stream=0, one_block=None):
    """scores [T, S] float32 (BF16 values or -inf) -> int32 [T, k]: the k best by (score desc, index asc) in
    ascending index order; with `positions`, indices >= (pos + 1) // ratio become -1; -1 padded. A row takes one
    block and one launch (topk_one_kernel) up to ONE_MAX_ROWS scores when TOPK_ONE, else selection blocks of `chunk`
    scores and seven launches; `one_block` forces either (the same result)."""
    n_tok, n_rows = tuple(scores.shape)
    if scores.dtype != np.float32 or k < 0 or chunk % THREADS:
        raise ValueError("select_topk: float32 scores, k >= 0 and a chunk multiple of 128 expected")
    if out is None:
        out = cuda.device_array((n_tok, k), np.int32, stream=stream)
    elif tuple(out.shape) != (n_tok, k):
        raise ValueError(f"select_topk: out {out.shape} must be {(n_tok, k)}")
    if n_tok == 0 or k == 0:
        return out
    use_reach = positions is not None
    if not use_reach:
        positions = _scratch(scratch, "no_positions", (n_tok,), np.int64, stream)
    if one_block is None:
        one_block = TOPK_ONE and n_rows <= ONE_MAX_ROWS
    if one_block:                                          # one launch a call (a row a block)
        topk_one_kernel[n_tok, ONE_THREADS, stream](scores, int(k), positions, int(ratio), use_reach, out)
        return out
    nb = max(1, math.ceil(n_rows / chunk))
    hist = _scratch(scratch, "topk_hist", (n_tok, 2, BINS), np.int32, stream)
    st = _scratch(scratch, "topk_state", (n_tok, 4), np.int64, stream)
    cnt = _scratch(scratch, "topk_counts", (n_tok, nb, 2), np.int32, stream)
    topk_init_kernel[n_tok, THREADS, stream](hist, st, out)
    for pass_id in (0, 1):
        topk_hist_kernel[(nb, n_tok), THREADS, stream](scores, chunk, pass_id, st, hist)
        topk_scan_kernel[n_tok, THREADS, stream](hist, int(k), pass_id, st)
    topk_count_kernel[(nb, n_tok), THREADS, stream](scores, chunk, st, cnt)
    topk_write_kernel[(nb, n_tok), THREADS, stream](scores, chunk, st, cnt, positions, int(ratio), use_reach, out)
    return out


def candidate_blocks(scores, positions, ratio, topk_blocks, block_size, chunk=CHUNK, out=None, scratch=None,
                     stream=0, one_block=None):
    """scores [T, S] (index_scores of the candidate source) -> keep uint8 [T, ceil(S / block_size)]."""
    n_tok, n_rows = tuple(scores.shape)
    nb = -(-n_rows // block_size)
    if out is None:
        out = cuda.device_array((n_tok, nb), np.uint8, stream=stream)
    if n_tok * nb == 0:
        return out
    bs = _scratch(scratch, "block_scores", (n_tok, nb), np.float32, stream)
    grid = math.ceil(n_tok * nb / THREADS)
    block_max_kernel[grid, THREADS, stream](scores, positions, int(ratio), int(block_size), bs)
    kb = min(int(topk_blocks), nb)
    ids = select_topk(bs, kb, chunk=chunk, out=_scratch(scratch, "block_ids", (n_tok, kb), np.int32, stream),
                      scratch=scratch, stream=stream, one_block=one_block)
    candidate_keep_kernel[grid, THREADS, stream](bs, ids, out)
    return out

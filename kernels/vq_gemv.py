"""Routed-expert GEMV over the DQV3 vector-quantised payload (docs/design.md §2, §6; ds4lib.formats.vq is the format,
ds4lib.ref.moe.expert_ffn / ds4lib.ref.linear.linear_q the math).

Owns:
- `vq_codebook`: a layer's E4M3 codebook [C, 8] decoded once (at load) to BF16 words uint64 [C, 2] (four BF16 per
  word, element 0 in the low bits). E4M3 values are exact in BF16. On the GPU the decode is the hardware
  `cvt.rn.f16x2.e4m3x2` (inline PTX) followed by an exact f16 -> f32 -> BF16 step; the simulator has no PTX and
  uses the software decoder of kernels.engram; both give the same bits (tests, and the engine re-checks all 256
  codes at load).
- `vq_plan`: routing ids [T, K] -> the expert-major work list: pair p = t*K + k, the pairs of each expert in
  token order, tiles of up to `tile_rows` pairs of one expert, and their count (on the device; nothing is read
  back, so decode needs no host round trip).
- `vq_gemv`: for every pair p of the plan and every selected matrix m (w1 = 0, w2 = 1, w3 = 2) of its expert e,
  y[m, p, r] = bf16( (sum_k C[idx[e, m, r, k/8]][k%8] * xq[p // x_div, k]) * g[e, m, r] * s[e, r] ), i.e.
  linear_q(x, dequant_matrix(C, g, idx) [* s for w2]) of the reference: xq = act_quant_fp8(x) (block 32; done
  first when `quantize`), FP32 accumulation, the f16 row gain and the optional per-expert, per-output-channel
  sidecar gain s (float32, w2) applied to the row sum, BF16 result.
- `moe_combine`: y[t] = bf16( sum over the token's experts in ascending id of ye[t*K + k] + shared[t] ) (FP32,
  ds4lib.ref.moe.moe's order).
Does not own: the router (kernels.moe.route), SwiGLU (kernels.moe.swiglu), the shared expert (kernels.q4k_gemv).

How `vq_gemv` runs. A matrix [R, Kin] has J = Kin/8 vectors per row; its stream is idx flattened row-major (position
p = r*J + j) in blocks of 256 indices = 384 bytes = three full 128-byte lines (+ one 32-byte plane sector for 13-bit
layers). Lane l of a warp owns positions 256b + 8l .. +7 of block b (ds4lib.formats.vq). Blocks repeat their
(row, column) pattern every P = J / gcd(J, 256) blocks (a "group" of G = 256 / gcd(J, 256) rows), so a warp that
handles one residue rho = b mod P reads the same 64 activations for every group: those stay in registers (FP8-
quantised floats), and a warp's work unit is (tile, matrix, rho, GROUPS_PER_UNIT consecutive groups). Units are
taken from a global atomic counter by persistent warps (the layer's codebook is copied into shared memory once per
block, BF16, 16 bytes per codeword). The one-pair-tile (decode) kernel also copies the activation rows of the call
into shared memory behind the codebook when they fit (two floats per word, one pad word per 32 so the lanes of a warp
fall on different banks) and fills a unit's registers from there: read straight from global memory, each lane's 64
floats lie 256 bytes from its neighbour's, and on the H200 80 % of the kernel's global sectors were such excess. Per block a lane looks up 8 codewords and does 8 FMAs each; the row sums
of the block (1-2 rows for J >= 256, more for small test shapes) are reduced across the warp (shuffles, or shared
memory when a block spans more than two rows) and written as partial sums per (row, block of the row); a
finalize kernel adds a row's partials in block order, applies the gains, rounds to BF16 and resets the counter.
Every sum is formed in a fixed order, so results do not depend on scheduling or on which tokens share a call
(prefill, chunked prefill and decode agree bit for bit). Block loads run PREFETCH blocks ahead.

Shapes: T tokens, K active experts per token, E experts, C codewords (2^bits), R rows, Kin inputs, J = Kin/8,
S stream bytes per expert matrix, P plane bytes, n_pairs = T*K, D hidden, F expert width.
"""
import math
from collections import namedtuple

import numpy as np
from numba import cuda
from numba import uint64 as nb_uint64
from numba.cuda.core import config as _cuda_config

from ds4lib.formats.vq import BLOCK_BYTES, BLOCK_INDICES, PLANE_BLOCK_BYTES, VQ_DIM, index_bytes, plane_bytes
from kernels.bf16 import bits_f32, f16_bits_device, f32_bits, f32x2_device, round_bf16_device
from kernels.engram import e4m3_decode_device
from kernels.gemv import act_quant_fp8
from kernels.q4k_gemv import warp_sum_device
from kernels.scratch import scratch_array as _scratch

__all__ = ["vq_codebook", "vq_plan", "vq_gemv", "moe_combine", "VQPlan", "vq_codebook_kernel", "vq_plan_kernel",
           "vq_gemv_t1_kernel", "vq_gemv_t2_kernel", "vq_finalize_kernel", "moe_combine_kernel",
           "e4m3x2_to_bf16x2_device", "SIGNATURES", "GROUPS_PER_UNIT"]

SIM = bool(_cuda_config.ENABLE_CUDASIM)
WARP = 32
E_MAX = 512                     # experts per layer (kernels.moe.route's bound)
K_MAX = 16                      # active experts per token
GROUPS_PER_UNIT = 8             # groups (blocks of one residue) per atomic work unit
PREFETCH = 3                    # blocks loaded ahead of the one being computed
WORDS_PER_BLOCK = BLOCK_BYTES // 4              # 96 uint32 words
THREADS_T1 = 32 if SIM else 384                 # decode kernel: 12 warps, <= 168 registers
THREADS_T2 = 32 if SIM else 256                 # two-token kernel: 8 warps, <= 255 registers
WARPS_MAX = max(THREADS_T1, THREADS_T2) // WARP
THREADS = 128
PLAN_THREADS = 64 if SIM else 512               # plan kernel: one expert per thread up to E_MAX
PLAN_WARPS = PLAN_THREADS // WARP
X_REGS = 8 * VQ_DIM             # activations a lane keeps per token

VQPlan = namedtuple("VQPlan", "ids pairs tiles n_tiles n_pairs n_experts tile_rows")


# ------------------------------------------------------------------------------------ E4M3 codebook decode
if SIM:
    @cuda.jit(device=True)
    def e4m3x2_to_bf16x2_device(pair):
        """Two E4M3 codes (low byte first) -> two BF16 bit patterns packed in a uint32 (low half first)."""
        lo = f32_bits(e4m3_decode_device(np.uint32(pair) & np.uint32(0xFF))) >> np.uint32(16)
        hi = f32_bits(e4m3_decode_device((np.uint32(pair) >> np.uint32(8)) & np.uint32(0xFF))) >> np.uint32(16)
        return np.uint32(lo | (hi << np.uint32(16)))
else:
    from llvmlite import ir as _ir
    from numba.core import types as _types
    from numba.core.extending import intrinsic as _intrinsic

    @_intrinsic
    def _cvt_e4m3x2_f16x2(typingctx, pair):
        """cvt.rn.f16x2.e4m3x2: bits 15..8 of the operand -> f16 in bits 31..16, bits 7..0 -> bits 15..0."""
        sig = _types.uint32(_types.uint16)

        def codegen(context, builder, signature, args):
            fnty = _ir.FunctionType(_ir.IntType(32), [_ir.IntType(16)])
            asm = _ir.InlineAsm(fnty, "cvt.rn.f16x2.e4m3x2 $0, $1;", "=r,h")
            return builder.call(asm, args)
        return sig, codegen

    @cuda.jit(device=True, inline=True)
    def e4m3x2_to_bf16x2_device(pair):
        """Two E4M3 codes (low byte first) -> two BF16 bit patterns packed in a uint32 (low half first).
        Hardware E4M3 -> f16, then f16 -> f32 -> BF16, exact for every finite code."""
        h = _cvt_e4m3x2_f16x2(np.uint16(pair))
        lo = f32_bits(f16_bits_device(h & np.uint32(0xFFFF))) >> np.uint32(16)
        hi = f32_bits(f16_bits_device(h >> np.uint32(16))) >> np.uint32(16)
        return np.uint32(lo | (hi << np.uint32(16)))


@cuda.jit(cache=True)
def vq_codebook_kernel(codes32, out64):
    """codes32 uint32 [C, 2] (8 E4M3 codes per codeword) -> out64 uint64 [C, 2] (8 BF16); a thread per codeword."""
    c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if c >= codes32.shape[0]:
        return
    for h in range(2):
        w = codes32[c, h]
        lo = e4m3x2_to_bf16x2_device(w & np.uint32(0xFFFF))
        hi = e4m3x2_to_bf16x2_device(w >> np.uint32(16))
        out64[c, h] = np.uint64(lo) | (np.uint64(hi) << np.uint64(32))


# --------------------------------------------------------------------------------------------- the plan
@cuda.jit(device=True, inline=True)
def _block_exclusive_scan_device(v, sh):
    """(sum of v over the threads before this one, sum over the block) for int64 v, in thread order; every thread
    of the block calls it (blockDim.x a multiple of 32). sh: int64 [WARP] shared, free again after the next
    barrier. Shuffle scans within each warp, then every warp scans the warps' totals (no second barrier)."""
    lane = cuda.threadIdx.x % WARP
    warp = cuda.threadIdx.x // WARP
    inc = v
    off = 1
    while off < WARP:
        u = cuda.shfl_up_sync(0xFFFFFFFF, inc, off)
        if lane >= off:
            inc += u
        off *= 2
    if lane == WARP - 1:
        sh[warp] = inc
    cuda.syncthreads()
    n_warps = cuda.blockDim.x // WARP
    s = sh[lane] if lane < n_warps else np.int64(0)
    off = 1
    while off < WARP:
        u = cuda.shfl_up_sync(0xFFFFFFFF, s, off)
        if lane >= off:
            s += u
        off *= 2
    before = cuda.shfl_sync(0xFFFFFFFF, s, max(warp - 1, 0))
    total = cuda.shfl_sync(0xFFFFFFFF, s, n_warps - 1)
    return (before if warp > 0 else np.int64(0)) + inc - v, total


@cuda.jit(device=True, inline=True)
def _pair_expert_device(ids, p, p_end, n_experts):
    """The expert of pair p (ids flattened token-major), or -1 past p_end or for an id outside 0..n_experts-1."""
    if p >= p_end:
        return -1
    k_act = ids.shape[1]
    e = ids[p // k_act, p % k_act]
    return e if 0 <= e < n_experts else -1


@cuda.jit(device=True, inline=True)
def _plan_offsets_device(n_experts, tile_rows, n_warps, e0, e1, seen, cnt, off, toff, scan):
    """From seen[w, e] = warp w's pair count of expert e (for the thread's experts e0..e1-1): cnt[e], off[e] (first
    slot of e in pairs), toff[e] (first tile of e), and seen[w, e] = the slot of warp w's first pair of e. Every
    thread calls it; returns the number of tiles."""
    c_sum = 0
    t_sum = 0
    for e in range(e0, e1):
        c = 0
        for w in range(n_warps):
            c += seen[w, e]
        cnt[e] = c
        c_sum += c
        t_sum += (c + tile_rows - 1) // tile_rows
    before, total = _block_exclusive_scan_device(np.int64(c_sum) | (np.int64(t_sum) << np.int64(32)), scan)
    o = before & np.int64(0xFFFFFFFF)                           # (pairs, tiles) of the experts before e0
    to = before >> np.int64(32)
    for e in range(e0, e1):
        off[e] = o
        toff[e] = to
        for w in range(n_warps):
            c = seen[w, e]
            seen[w, e] = o
            o += c
        to += (cnt[e] + tile_rows - 1) // tile_rows
    return total >> np.int64(32)


@cuda.jit(device=True, inline=True)
def _plan_fill_device(ids, n_experts, tile_rows, p0, p_end, n_steps, seen, cnt, off, toff, lane_e, pairs, tiles):
    """The warp's pairs p0..p_end-1 in order, 32 per step, into pairs and tiles. A lane's slot is seen[w, e] plus
    the number of lanes before it with the same expert; the last of them advances seen[w, e]. Every warp of the
    block takes the same n_steps (the simulator's syncwarp is a block barrier)."""
    lane = cuda.threadIdx.x % WARP
    warp = cuda.threadIdx.x // WARP
    for i in range(n_steps):
        p = p0 + i * WARP + lane
        e = _pair_expert_device(ids, p, p_end, n_experts)
        lane_e[warp, lane] = e
        cuda.syncwarp(0xFFFFFFFF)
        rank = 0
        same = 0
        if e >= 0:
            for j in range(WARP):
                if lane_e[warp, j] == e:
                    same += 1
                    if j < lane:
                        rank += 1
            slot = seen[warp, e] + rank
            pairs[slot] = p
            r = slot - off[e]
            if r % tile_rows == 0:
                ti = toff[e] + r // tile_rows
                tiles[ti, 0] = e
                tiles[ti, 1] = slot
                tiles[ti, 2] = min(tile_rows, cnt[e] - r)
        cuda.syncwarp(0xFFFFFFFF)
        if e >= 0 and rank == same - 1:
            seen[warp, e] += same
        cuda.syncwarp(0xFFFFFFFF)


@cuda.jit(cache=True)
def vq_plan_kernel(ids, n_experts, tile_rows, pairs, tiles, n_tiles):
    """One block. pairs: the pair ids of each expert in token order, experts ascending; tiles [n, 3] = (expert,
    first slot in pairs, count <= tile_rows); n_tiles[0] = n. Ids outside 0..n_experts-1 are left out.

    Warp w owns the pairs [w * chunk, (w + 1) * chunk) (chunk a multiple of 32) and counts them per expert with
    shared atomics into seen[w, e]; thread t owns a run of consecutive experts, and an exclusive scan over the
    threads places each expert's pairs and tiles; then each warp writes its pairs in order (_plan_fill_device).
    Every slot is a function of the ids alone, so the pairs of an expert land in ascending order whatever the
    scheduling, and the plan does not depend on the block size."""
    tid = cuda.threadIdx.x
    warp = tid // WARP
    nt = cuda.blockDim.x
    n_warps = nt // WARP
    n_pairs = ids.shape[0] * ids.shape[1]
    seen = cuda.shared.array((PLAN_WARPS, E_MAX), np.int32)     # warp w's pairs of e: count, then next slot
    cnt = cuda.shared.array(E_MAX, np.int32)
    off = cuda.shared.array(E_MAX, np.int32)
    toff = cuda.shared.array(E_MAX, np.int32)
    lane_e = cuda.shared.array((PLAN_WARPS, WARP), np.int32)   # the experts of a warp's current 32 pairs
    scan = cuda.shared.array(WARP, np.int64)
    chunk = WARP * ((n_pairs + WARP * n_warps - 1) // (WARP * n_warps))
    p0 = warp * chunk
    p_end = min(p0 + chunk, n_pairs)
    e_per = (n_experts + nt - 1) // nt
    e0 = min(tid * e_per, n_experts)
    e1 = min(e0 + e_per, n_experts)
    for e in range(e0, e1):
        for w in range(n_warps):
            seen[w, e] = 0
    cuda.syncthreads()
    for b in range(p0, p_end, WARP):
        e = _pair_expert_device(ids, b + cuda.threadIdx.x % WARP, p_end, n_experts)
        if e >= 0:
            cuda.atomic.add(seen, (warp, e), 1)
    cuda.syncthreads()
    n = _plan_offsets_device(n_experts, tile_rows, n_warps, e0, e1, seen, cnt, off, toff, scan)
    if tid == 0:
        n_tiles[0] = n
    cuda.syncthreads()
    _plan_fill_device(ids, n_experts, tile_rows, p0, p_end, chunk // WARP, seen, cnt, off, toff, lane_e, pairs,
                      tiles)


# ------------------------------------------------------------------------------------------ the GEMV
if SIM:
    @cuda.jit(device=True)
    def _stage_codebook_device(cbs, cb_g):
        """Global -> shared codebook copy. The simulator's shared memory is a NumPy array: one thread copies it
        whole (a per-element loop costs seconds there)."""
        if cuda.threadIdx.x == 0:
            cbs[:cb_g.shape[0]] = cb_g[:cb_g.shape[0]]
else:
    @cuda.jit(device=True, inline=True)
    def _stage_codebook_device(cbs, cb_g):
        """Global -> shared codebook copy, 8 bytes per thread and step, coalesced."""
        for i in range(cuda.threadIdx.x, cb_g.shape[0], cuda.blockDim.x):
            cbs[i] = cb_g[i]


def _x_row_words(cols):
    """uint64 words per staged activation row: cols/2 words of two floats, plus one pad word per 32 words, so the
    lanes of a warp, which read words 32 apart, fall on different banks."""
    return cols // 2 + cols // (2 * WARP)


@cuda.jit(device=True, inline=True)
def _stage_x_device(xs, x_off, x_stride, x, x_rows):
    """Global -> shared copy of the first `x_rows` activation rows (two floats per uint64 word, element 2q in the
    low bits; word q of row r at x_off + r*x_stride + q + q//32), coalesced; nothing when x_rows == 0."""
    half = x.shape[1] // 2
    for w in range(cuda.threadIdx.x, x_rows * half, cuda.blockDim.x):
        r = w // half
        q = w % half
        lo = np.uint64(f32_bits(x[r, 2 * q]))
        hi = np.uint64(f32_bits(x[r, 2 * q + 1]))
        xs[x_off + r * x_stride + q + q // WARP] = lo | (hi << np.uint64(32))


@cuda.jit(device=True, inline=True)
def _load_block_device(idx1, pl1, has_plane, ib, pb, b, n_blocks, lane):
    """(lo8 of i0..i3, lo8 of i4..i7, hi4 of i0..i7, plane bits) of the lane in block b of the matrix whose stream
    starts at word ib of the flat index words and byte pb of the flat plane bytes; zeros past the stream. Unsigned
    flat indices: no wraparound checks or strides per load."""
    if b >= n_blocks:
        return np.uint32(0), np.uint32(0), np.uint32(0), np.uint32(0)
    w = ib + np.uint64(WORDS_PER_BLOCK * b + lane)
    pl = np.uint32(pl1[pb + np.uint64(PLANE_BLOCK_BYTES * b + lane)]) if has_plane else np.uint32(0)
    return idx1[w], idx1[w + np.uint64(32)], idx1[w + np.uint64(64)], pl


@cuda.jit(device=True, inline=True)
def _index_device(w0, w1, w2, pl, k):
    """Codeword index of the lane's position k (0..7) from its three stream words and plane byte."""
    lo = (w0 >> np.uint32(8 * k)) if k < 4 else (w1 >> np.uint32(8 * (k - 4)))
    return ((lo & np.uint32(0xFF)) | (((w2 >> np.uint32(4 * k)) & np.uint32(0xF)) << np.uint32(8))
            | (((pl >> np.uint32(k)) & np.uint32(1)) << np.uint32(12)))


if SIM:
    @cuda.jit(device=True)
    def _codeword_device(cbs, ci):
        """The 8 float32 values of codeword ci of the BF16 shared codebook (the simulator: one NumPy op)."""
        v = (cbs[2 * ci:2 * ci + 2].view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
        return v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]
else:
    @cuda.jit(device=True, inline=True)
    def _codeword_device(cbs, ci):
        """The 8 float32 values of codeword ci of the BF16 shared codebook: two 8-byte loads, one integer op each."""
        wa = cbs[2 * ci]
        wb = cbs[2 * ci + 1]
        a0 = np.uint32(wa & np.uint64(0xFFFFFFFF))
        a1 = np.uint32(wa >> np.uint64(32))
        b0 = np.uint32(wb & np.uint64(0xFFFFFFFF))
        b1 = np.uint32(wb >> np.uint64(32))
        hi = np.uint32(0xFFFF0000)
        return (bits_f32(a0 << np.uint32(16)), bits_f32(a0 & hi), bits_f32(a1 << np.uint32(16)), bits_f32(a1 & hi),
                bits_f32(b0 << np.uint32(16)), bits_f32(b0 & hi), bits_f32(b1 << np.uint32(16)), bits_f32(b1 & hi))


@cuda.jit(device=True, inline=True)
def _lane_rows_device(rho, lane, J):
    """(first row within the group, number of the lane's 8 positions in that row) of lane `lane` at residue rho."""
    q0 = BLOCK_INDICES * rho + 8 * lane
    return q0 // J, min(8, J - q0 % J)


def _make_vq_kernel(tt, threads, stage_x):
    """The persistent VQ GEMV for tiles of up to `tt` pairs and `threads` threads per block; `stage_x`: the kernel
    can read the activations from a copy in shared memory (x_rows > 0), else only from global memory."""
    jit = cuda.jit(cache=True) if SIM else cuda.jit(launch_bounds=(threads, 1), cache=True)
    red_rows = 2 * tt

    @jit
    def vq_gemv_kernel(x, x_div, pairs, tiles, n_tiles, cb_g, idx1, pl1, idx_words, plane_len, has_plane, mat0,
                       mat_step, n_mats, n_rows, J, P, G, n_groups, n_blocks, x_rows, part, counter):
        lane = cuda.threadIdx.x % WARP
        warp = cuda.threadIdx.x // WARP
        cbs = cuda.shared.array(0, nb_uint64)                     # [C*2] BF16 codebook words, then staged x
        red = cuda.shared.array((WARPS_MAX, red_rows, WARP), np.float32)
        _stage_codebook_device(cbs, cb_g)
        x_off = cb_g.shape[0]
        x_stride = x.shape[1] // 2 + x.shape[1] // (2 * WARP)  # _x_row_words
        if stage_x:
            _stage_x_device(cbs, x_off, x_stride, x, x_rows)
        cuda.syncthreads()
        n_chunks = (n_groups + GROUPS_PER_UNIT - 1) // GROUPS_PER_UNIT
        total = n_tiles[0] * n_mats * P * n_chunks
        xr = cuda.local.array((tt, X_REGS), np.float32)
        acc0 = cuda.local.array(tt, np.float32)                   # the lane's first row
        acc1 = cuda.local.array(tt, np.float32)                   # the next row (positions k >= split)
        while True:
            u = 0
            if lane == 0:
                u = cuda.atomic.add(counter, 0, 1)
            u = cuda.shfl_sync(0xFFFFFFFF, u, 0)
            if u >= total:
                break                                             # warp-uniform
            chunk = u % n_chunks
            u //= n_chunks
            rho = u % P
            u //= P
            msel = u % n_mats
            tile = u // n_mats
            e = tiles[tile, 0]
            first = tiles[tile, 1]
            count = tiles[tile, 2]
            m = mat0 + mat_step * msel
            ib = np.uint64(3 * e + m) * np.uint64(idx_words)     # the matrix's first index word, plane byte
            pb = np.uint64(3 * e + m) * np.uint64(plane_len)
            rr_lo, split = _lane_rows_device(rho, lane, J)
            j0 = (BLOCK_INDICES * rho + 8 * lane) % J
            for i in range(tt):                                   # the lane's 64 activations per pair
                xrow = pairs[first + i] // x_div if i < count else 0
                for k in range(8):
                    jk = j0 + k if k < split else k - split
                    if stage_x and x_rows > 0:                    # warp-uniform: from the staged copy
                        wb = x_off + xrow * x_stride + 4 * jk + (4 * jk) // WARP
                        w0 = cbs[wb]
                        w1 = cbs[wb + 1]
                        w2 = cbs[wb + 2]
                        w3 = cbs[wb + 3]
                        xr[i, 8 * k] = f32x2_device(w0, 0) if i < count else np.float32(0.0)
                        xr[i, 8 * k + 1] = f32x2_device(w0, 1) if i < count else np.float32(0.0)
                        xr[i, 8 * k + 2] = f32x2_device(w1, 0) if i < count else np.float32(0.0)
                        xr[i, 8 * k + 3] = f32x2_device(w1, 1) if i < count else np.float32(0.0)
                        xr[i, 8 * k + 4] = f32x2_device(w2, 0) if i < count else np.float32(0.0)
                        xr[i, 8 * k + 5] = f32x2_device(w2, 1) if i < count else np.float32(0.0)
                        xr[i, 8 * k + 6] = f32x2_device(w3, 0) if i < count else np.float32(0.0)
                        xr[i, 8 * k + 7] = f32x2_device(w3, 1) if i < count else np.float32(0.0)
                    else:
                        for h in range(VQ_DIM):
                            xr[i, 8 * k + h] = x[xrow, VQ_DIM * jk + h] if i < count else np.float32(0.0)
            rr_min = (BLOCK_INDICES * rho) // J
            rr_max = (BLOCK_INDICES * rho + BLOCK_INDICES - 1) // J
            g0 = chunk * GROUPS_PER_UNIT
            ng = min(GROUPS_PER_UNIT, n_groups - g0)
            na = _load_block_device(idx1, pl1, has_plane, ib, pb, g0 * P + rho, n_blocks, lane)
            nb = _load_block_device(idx1, pl1, has_plane, ib, pb, (g0 + 1) * P + rho if ng > 1 else n_blocks,
                                    n_blocks, lane)
            nc = _load_block_device(idx1, pl1, has_plane, ib, pb, (g0 + 2) * P + rho if ng > 2 else n_blocks,
                                    n_blocks, lane)
            for gi in range(ng):
                cur = na
                na = nb
                nb = nc
                nc = _load_block_device(idx1, pl1, has_plane, ib, pb,
                                        (g0 + gi + PREFETCH) * P + rho if gi + PREFETCH < ng else n_blocks,
                                        n_blocks, lane)
                g = g0 + gi
                if g * P + rho >= n_blocks:
                    continue                                      # past the stream: rows >= R only
                for i in range(tt):
                    acc0[i] = np.float32(0.0)
                    acc1[i] = np.float32(0.0)
                for k in range(8):
                    c0, c1, c2, c3, c4, c5, c6, c7 = _codeword_device(cbs, _index_device(cur[0], cur[1], cur[2],
                                                                                         cur[3], k))
                    for i in range(tt):                       # two independent 4-FMA chains per codeword
                        a = cuda.fma(c1, xr[i, 8 * k + 1], c0 * xr[i, 8 * k])
                        a = cuda.fma(c2, xr[i, 8 * k + 2], a)
                        a = cuda.fma(c3, xr[i, 8 * k + 3], a)
                        b = cuda.fma(c5, xr[i, 8 * k + 5], c4 * xr[i, 8 * k + 4])
                        b = cuda.fma(c6, xr[i, 8 * k + 6], b)
                        b = cuda.fma(c7, xr[i, 8 * k + 7], b)
                        if k < split:
                            acc0[i] += a + b
                        else:
                            acc1[i] += a + b
                row0 = g * G
                if rr_max - rr_min <= 1:                          # warp-uniform: 1 or 2 rows -> shuffles
                    for r in range(rr_min, rr_max + 1):
                        slot = rho - (r * J) // BLOCK_INDICES
                        for i in range(tt):
                            v = np.float32(0.0)
                            if rr_lo == r:
                                v = acc0[i]
                            if split < 8 and rr_lo + 1 == r:
                                v += acc1[i]
                            v = warp_sum_device(v, red[warp, 0])
                            if lane == 0 and i < count and row0 + r < n_rows:
                                part[msel, pairs[first + i], row0 + r, slot] = v
                else:                                             # many short rows: segmented sums in shared
                    for i in range(tt):
                        red[warp, 2 * i, lane] = acc0[i]
                        red[warp, 2 * i + 1, lane] = acc1[i]
                    cuda.syncwarp(0xFFFFFFFF)
                    for r in range(rr_min + lane, rr_max + 1, WARP):
                        if row0 + r < n_rows:
                            slot = rho - (r * J) // BLOCK_INDICES
                            for i in range(tt):
                                if i < count:
                                    v = np.float32(0.0)
                                    for j in range(WARP):
                                        q0j = BLOCK_INDICES * rho + 8 * j
                                        lo_j = q0j // J
                                        sp_j = J - q0j % J
                                        if lo_j == r:
                                            v += red[warp, 2 * i, j]
                                        if sp_j < 8 and lo_j + 1 == r:
                                            v += red[warp, 2 * i + 1, j]
                                    part[msel, pairs[first + i], row0 + r, slot] = v
                    cuda.syncwarp(0xFFFFFFFF)
    return vq_gemv_kernel


vq_gemv_t1_kernel = _make_vq_kernel(1, THREADS_T1, True)
vq_gemv_t2_kernel = _make_vq_kernel(2, THREADS_T2, False)


@cuda.jit(cache=True)
def vq_finalize_kernel(part, ids, gain_a, gain_b, scale, has_scale, J, G, counter, out):
    """out[m, p, r] = bf16(sum over the row's blocks of part[m, p, r, :] * g * s); resets the work counter."""
    n_mats, n_pairs, n_rows, _ = part.shape
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i == 0:
        counter[0] = 0                               # the GEMV kernel that used it has finished (stream order)
    if i >= n_mats * n_pairs * n_rows:
        return
    r = i % n_rows
    p = (i // n_rows) % n_pairs
    msel = i // (n_rows * n_pairs)
    k_act = ids.shape[1]
    e = ids[p // k_act, p % k_act]
    rr = r % G
    n_slots = ((rr + 1) * J - 1) // BLOCK_INDICES - (rr * J) // BLOCK_INDICES + 1
    v = part[msel, p, r, 0]
    for s in range(1, n_slots):
        v += part[msel, p, r, s]
    g = f16_bits_device(np.uint32(gain_a[e, r] if msel == 0 else gain_b[e, r]))
    v = v * g
    if has_scale:
        v = v * scale[e, r]
    out[msel, p, r] = round_bf16_device(v)


@cuda.jit(cache=True)
def moe_combine_kernel(ye, ids, shared, out):
    """out[t, d] = bf16(sum over k in ascending ids[t, k] of ye[t*K + k, d] + shared[t, d])."""
    n_tok, d_len = out.shape
    k_act = ids.shape[1]
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i >= n_tok * d_len:
        return
    t = i // d_len
    d = i % d_len
    y = np.float32(0.0)
    prev = -1
    for _ in range(k_act):                           # selection by ascending expert id (ids are distinct)
        best = 0x7FFFFFFF
        kb = 0
        for k in range(k_act):
            v = ids[t, k]
            if v > prev and v < best:
                best = v
                kb = k
        y += ye[t * k_act + kb, d]
        prev = best
    out[t, d] = round_bf16_device(y + shared[t, d])


_VQ_SIG = ("void(float32[:, :], int64, int32[:], int32[:, :], int32[:], uint64[:], uint32[:], uint8[:], int64, int64, "
           "boolean, int64, int64, int64, int64, int64, int64, int64, int64, int64, int64, float32[:, :, :, :], "
           "int32[:])")
SIGNATURES = {
    "vq_codebook_kernel": "void(uint32[:, :], uint64[:, :])",
    "vq_plan_kernel": "void(int32[:, :], int64, int64, int32[:], int32[:, :], int32[:])",
    "vq_gemv_t1_kernel": _VQ_SIG,
    "vq_gemv_t2_kernel": _VQ_SIG,
    "vq_finalize_kernel": "void(float32[:, :, :, :], int32[:, :], uint16[:, :], uint16[:, :], float32[:, :], boolean, "
                          "int64, int64, int32[:], float32[:, :, :])",
    "moe_combine_kernel": "void(float32[:, :], int32[:, :], float32[:, :], float32[:, :])",
}






_SMEM_MAX = {}
SMEM_LIMIT = 227 * 1024          # dynamic + static shared memory one block may use on sm_90


def _static_smem(tt):
    """Bytes of the GEMV kernel's static shared array (`red`)."""
    return WARPS_MAX * 2 * tt * WARP * 4


def _raise_smem_limit(nbytes):
    """A pre-launch callback that lets a kernel use `nbytes` of dynamic shared memory (> 48 KB needs opting in).
    The limit is a property of the compiled function: it is only ever raised (12-bit and 13-bit layers share the
    kernel, and lowering it for a 12-bit layer would make the next 13-bit launch invalid)."""
    def callback(kernel, launch_config):
        from numba.cuda.cudadrv.driver import binding, driver
        cufunc = kernel._codelibrary.get_cufunc()
        key = id(cufunc)
        if _SMEM_MAX.get(key, 0) >= nbytes:
            return
        attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        driver.cuKernelSetAttribute(attr, int(nbytes), cufunc.handle, cufunc.device.id)
        _SMEM_MAX[key] = nbytes
    return callback


_SM_COUNT = []


def _persistent_blocks():
    if SIM:
        return 1
    if not _SM_COUNT:
        _SM_COUNT.append(int(cuda.get_current_device().MULTIPROCESSOR_COUNT))
    return _SM_COUNT[0]


def _geometry(rows, cols):
    """(J, P, G, groups, blocks, slots) of a [rows, cols] expert matrix (module docstring)."""
    J = cols // VQ_DIM
    g = math.gcd(J, BLOCK_INDICES)
    P, G = J // g, BLOCK_INDICES // g
    n_idx = rows * J
    slots = -(-J // BLOCK_INDICES) + 1
    return J, P, G, -(-rows // G), -(-n_idx // BLOCK_INDICES), slots


# ----------------------------------------------------------------------------------------------- launchers
def vq_codebook(codes, out=None, stream=0):
    """E4M3 codebook uint8 [C, 8] -> BF16 words uint64 [C, 2] (elements 0-3, then 4-7; element 0 lowest)."""
    shape = tuple(codes.shape)
    if len(shape) != 2 or shape[1] != VQ_DIM or codes.dtype != np.uint8:
        raise ValueError(f"vq_codebook: codes must be uint8 [C, {VQ_DIM}], got {codes.dtype} {shape}")
    if out is None:
        out = cuda.device_array((shape[0], 2), np.uint64, stream=stream)
    elif tuple(out.shape) != (shape[0], 2) or out.dtype != np.uint64:
        raise ValueError(f"vq_codebook: out must be uint64 [{shape[0]}, 2]")
    if shape[0]:
        vq_codebook_kernel[math.ceil(shape[0] / THREADS), THREADS, stream](codes.view(np.uint32), out)
    return out


def vq_plan(ids, n_experts, *, tile_rows=1, out=None, stream=0):
    """Routing ids int32 [T, K] (distinct per token) -> VQPlan (device work list; `out` a VQPlan to reuse)."""
    n_tok, k_act = tuple(ids.shape)
    if ids.dtype != np.int32 or not 0 < n_experts <= E_MAX or not 0 < k_act <= K_MAX or tile_rows not in (1, 2):
        raise ValueError(f"vq_plan: ids int32 [T, K <= {K_MAX}], 0 < n_experts <= {E_MAX}, tile_rows 1 or 2")
    n_pairs = n_tok * k_act
    if out is None or out.n_pairs != n_pairs or out.tile_rows != tile_rows or out.n_experts != n_experts:
        out = VQPlan(ids, cuda.device_array(max(n_pairs, 1), np.int32, stream=stream),
                     cuda.device_array((max(n_pairs, 1), 3), np.int32, stream=stream),
                     cuda.device_array(1, np.int32, stream=stream), n_pairs, int(n_experts), int(tile_rows))
    else:
        out = out._replace(ids=ids)
    if n_pairs:
        vq_plan_kernel[1, PLAN_THREADS, stream](ids, int(n_experts), int(tile_rows), out.pairs, out.tiles, out.n_tiles)
    return out


def vq_gemv(x, plan, codebook, index, plane, gains, *, mats, shape, x_div=1, scale=None, quantize=True, out=None,
            scratch=None, stream=0):
    """Routed-expert GEMV (module docstring) -> out float32 [len(mats), n_pairs, R] (BF16 values).

    x float32 [n_x, Kin] (pair p reads row p // x_div: the token for w1/w3 with x_div = K, the pair's own SwiGLU row
    for w2 with x_div = 1); plan from vq_plan; codebook uint64 [C, 2] from vq_codebook; index uint8 [E, 3, S];
    plane uint8 [E, 3, P] (13-bit layers) or None; gains (g1, g2, g3) uint16 [E, rows] f16 bits; mats: (0, 2) for
    w1 and w3 together or (1,) for w2, all of shape (R, Kin); scale float32 [E, R] (sidecar gains of w2) or None.
    """
    rows, cols = (int(v) for v in shape)
    mats = tuple(int(m) for m in mats)
    if cols % 32 or rows <= 0 or not mats or len(mats) > 2 or any(m not in (0, 1, 2) for m in mats):
        raise ValueError(f"vq_gemv: shape {shape} (Kin % 32 == 0) and 1-2 matrices of (0, 1, 2), got {mats}")
    if len(mats) == 2 and rows != int(gains[mats[1]].shape[1]):
        raise ValueError("vq_gemv: the two matrices must have the same shape")
    n_idx = rows * cols // VQ_DIM
    n_exp = int(index.shape[0])
    if index.dtype != np.uint8 or tuple(index.shape) != (n_exp, 3, index_bytes(n_idx)):
        raise ValueError(f"vq_gemv: index must be uint8 [E, 3, {index_bytes(n_idx)}], got {index.dtype} {index.shape}")
    has_plane = plane is not None
    if has_plane and (plane.dtype != np.uint8 or tuple(plane.shape) != (n_exp, 3, plane_bytes(n_idx))):
        raise ValueError(f"vq_gemv: plane must be uint8 [E, 3, {plane_bytes(n_idx)}], got {plane.shape}")
    n_cw = int(codebook.shape[0])
    if codebook.dtype != np.uint64 or tuple(codebook.shape) != (n_cw, 2) or n_cw != (8192 if has_plane else 4096):
        raise ValueError(f"vq_gemv: codebook must be uint64 [{8192 if has_plane else 4096}, 2] (vq_codebook)")
    for m in mats:
        if gains[m].dtype != np.uint16 or tuple(gains[m].shape) != (n_exp, rows):
            raise ValueError(f"vq_gemv: gains of matrix {m} must be uint16 f16 bits [{n_exp}, {rows}]")
    has_scale = scale is not None
    if has_scale and (scale.dtype != np.float32 or tuple(scale.shape) != (n_exp, rows)):
        raise ValueError(f"vq_gemv: scale must be float32 [{n_exp}, {rows}]")
    if x.dtype != np.float32 or len(tuple(x.shape)) != 2 or x.shape[1] != cols:
        raise ValueError(f"vq_gemv: x must be float32 [n, {cols}], got {x.dtype} {x.shape}")
    n_pairs = plan.n_pairs
    if plan.n_experts != n_exp or x_div <= 0 or (n_pairs and (n_pairs - 1) // x_div >= x.shape[0]):
        raise ValueError("vq_gemv: the plan, the experts and x do not fit")
    n_mats = len(mats)
    if out is None:
        out = cuda.device_array((n_mats, n_pairs, rows), np.float32, stream=stream)
    elif tuple(out.shape) != (n_mats, n_pairs, rows):
        raise ValueError(f"vq_gemv: out {out.shape} must be {(n_mats, n_pairs, rows)}")
    if n_pairs == 0:
        return out
    if quantize:
        x = act_quant_fp8(x, out=_scratch(scratch, "xq", tuple(x.shape), np.float32, stream), stream=stream)
    J, P, G, n_groups, n_blocks, slots = _geometry(rows, cols)
    part = _scratch(scratch, "part", (n_mats, n_pairs, rows, slots), np.float32, stream)
    counter = _scratch(scratch, "counter", (1,), np.int32, stream, zero=True)
    dummy = _scratch(scratch, "no_plane", (1,), np.uint8, stream)
    no_scale = _scratch(scratch, "no_scale", (1, 1), np.float32, stream)
    tt = plan.tile_rows
    kernel, threads = (vq_gemv_t1_kernel, THREADS_T1) if tt == 1 else (vq_gemv_t2_kernel, THREADS_T2)
    n_units = n_pairs * n_mats * P * -(-n_groups // GROUPS_PER_UNIT)
    grid = max(1, min(_persistent_blocks(), -(-n_units // (threads // WARP))))
    x_rows = (n_pairs - 1) // x_div + 1                  # the activation rows the pairs read
    x_smem = x_rows * _x_row_words(cols) * 8
    if tt != 1 or x_smem > SMEM_LIMIT - n_cw * 16 - _static_smem(tt):
        x_rows, x_smem = 0, 0                              # too many rows to stage: lanes read x from global
    smem = n_cw * 16 + x_smem
    launch = kernel[grid, threads, stream, smem]
    if not SIM and smem > 48 * 1024 and not launch.pre_launch_callbacks:
        # numba caches configured launches (lru_cache on configure): register the callback once per configuration
        launch.pre_launch_callbacks.append(_raise_smem_limit(smem))
    m0, step = mats[0], (mats[1] - mats[0] if n_mats == 2 else 0)
    idx_words = index.shape[2] // 4
    plane_len = plane.shape[2] if has_plane else 0
    launch(x, int(x_div), plan.pairs, plan.tiles, plan.n_tiles, codebook.reshape(n_cw * 2),
           index.view(np.uint32).reshape(n_exp * 3 * idx_words), plane.reshape(n_exp * 3 * plane_len) if has_plane
           else dummy, idx_words, plane_len, has_plane, m0, step, n_mats, rows, J, P, G, n_groups, n_blocks, x_rows,
           part, counter)
    n = n_mats * n_pairs * rows
    vq_finalize_kernel[math.ceil(n / THREADS), THREADS, stream](
        part, plan.ids, gains[mats[0]], gains[mats[-1]], scale if has_scale else no_scale, has_scale, J, G, counter,
        out)
    return out


def moe_combine(ye, ids, shared, out=None, stream=0):
    """ye float32 [T*K, D] (routed expert outputs, routing weight applied), ids int32 [T, K], shared [T, D] (the
    shared expert) -> out [T, D] BF16 values: routed terms in ascending expert id, then the shared expert."""
    n_tok, k_act = tuple(ids.shape)
    d_len = shared.shape[1]
    if tuple(ye.shape) != (n_tok * k_act, d_len) or tuple(shared.shape) != (n_tok, d_len):
        raise ValueError(f"moe_combine: ye {ye.shape}, ids {ids.shape}, shared {shared.shape} do not fit")
    if out is None:
        out = cuda.device_array((n_tok, d_len), np.float32, stream=stream)
    n = n_tok * d_len
    if n:
        moe_combine_kernel[math.ceil(n / THREADS), THREADS, stream](ye, ids, shared, out)
    return out

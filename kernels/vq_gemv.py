"""Routed-expert GEMV over the DQV3 vector-quantised payload on the tensor cores (docs/design.md §2, §6;
ds4lib.formats.vq is the format, ds4lib.ref.moe.expert_ffn / ds4lib.ref.linear.linear_q the math).

Owns:
- `vq_codebook`: a layer's E4M3 codebook [C, 8] as uint64 [C] (8 codes a word, element 0 in the low byte), checked
  for NaN codes. Nothing is decoded at load: the GEMV converts a codeword's codes to halves as it multiplies.
- `vq_device_layout`: a layer's index stream and 13th-bit plane from the file's layout into the device layout below
  (one kernel at upload; the same bits, placed for the GEMV, with padding).
- `vq_plan`: routing ids [T, K] -> the expert-major work list: pair p = t*K + k, the pairs of each expert in
  token order, tiles of up to `tile_rows` (<= 16) pairs of one expert, and their count (on the device; nothing is
  read back, so decode needs no host round trip).
- `vq_gemv`: for every pair p of the plan and every selected matrix m (w1 = 0, w2 = 1, w3 = 2) of its expert e,
  y[m, p, r] = bf16( (sum_k C[idx[e, m, r, k/8]][k%8] * xq[p // x_div, k]) * g[e, m, r] * s[e, r] ), i.e.
  linear_q(x, dequant_matrix(C, g, idx) [* s for w2]) of the reference: xq = act_quant_fp8(x) (block 32; applied
  first when `quantize`), the f16 row gain and the optional per-expert, per-output-channel sidecar gain s (float32,
  w2) applied to the row sum, BF16 result. The sum is formed by the tensor cores (below), so it matches the
  reference within a tolerance, not bit for bit. `swiglu=(u, weights, limit)` (w2, quantize=True): x is an expert's
  gate g and the staging computes a = swiglu(g, u, limit, weights) as it loads (`vq_stage_swiglu_kernel`; one launch
  fewer per MoE layer than kernels.moe.swiglu then vq_gemv, the same bits: both run kernels.moe.swiglu_scaled_device,
  and a test holds the two paths bit-equal).
- `vq_stage`: the activations as the GEMV's B operand (what `vq_gemv` launches first unless given it as `staged`).
- `moe_combine`: y[t] = bf16( sum over the token's experts in ascending id of ye[t*K + k] + shared[t] ) (FP32,
  ds4lib.ref.moe.moe's order).
Does not own: the router (kernels.moe.route), the SwiGLU step on its own (kernels.moe.swiglu: the shared expert, and
the spec of `swiglu=`), the shared expert (kernels.q4k_gemv).

How `vq_gemv` runs. The tensor cores multiply 16 weight rows by 32 inputs for up to 8 pairs per step (16 in the
wide kernel of prefill tiles: a second MMA for columns 8-15), the weights as the MMA's A operand and the pairs'
activations as B (a decode step's one pair per expert fills one of B's 8 columns, where with the weights as B it
filled one of A's 16 rows: half the MMAs for the same weights). Lane 4g + t
takes, at step k of a block, codeword 4k + t of rows g and g + 8 of its row group from the shared-memory codebook
(C x 8 bytes): their values 0-3 are its A fragment of a first `mma.sync.m16n8k16` f16 MMA and values 4-7 of a
second one chained to it (each pair of E4M3 codes converted to halves by one `cvt.rn.f16x2.e4m3x2`, reading its
half of the codeword's register directly: kernels.mma.e4m3x8_to_f16x2_device). B needs the same
8 inputs of pair g: a first kernel (`vq_stage_kernel`) turns the call's activation rows into E4M3 codes, stores
them as halves in fragment order (16 bytes a lane and step: one load) and their power-of-two block scales (a step's
32 inputs are one act_quant_fp8 block). A producer of FP8-grid activations may write that operand itself
(`stage_lane_device`, `stage_pad_device`; the engine's ffn norm, kernels.rms_norm) and pass it as `staged`: the
call then launches no staging kernel. The MMA outputs (rows g and g + 8, pairs 2t and 2t + 1) are scaled by the
pair's block scale and added in FP32 step by step: a fixed order per output, whatever the tile, so prefill, chunked
prefill and decode give the same bits. Products of E4M3 codes are exact in the MMA; its FP32 sums are the
hardware's, so the result matches the reference within a tolerance (the simulator's MMA is the ideal one). Why
halves and not the E4M3 MMA (m16n8k32): on sm_90 ptxas emulates that one with twelve conversions and two f16 MMAs
per call (docs/toolchain.md). What bounds the kernel is the shared-memory codebook gathers: 8 random bytes a lane,
about 6 bank-conflict wavefronts a warp's gather.

The device layout. A matrix [R, Kin] (J = Kin/8 codewords a row) is stored in blocks of the file's shape (256
indices: three 128-byte lines of low bytes and high nibbles, plus 32 plane bytes on 13-bit layers; lane l's
positions k = 0..7 in words l, 32 + l, 64 + l and plane byte l), but block rg * n_seg + s holds rows 16rg .. 16rg+15
x codewords 16s .. 16s+15, lane 4g + t's position k being codeword 16s + 4(k // 2) + t of row 16rg + g + 8(k % 2):
exactly the A fragments of the block's 4 steps. Within a lane's words the low bytes keep the file's places (byte k %
4 of word k // 4) and so does the plane (bit k), but the high nibble of position k sits in byte k % 4 of the third
word, low nibble for k < 4, high for k >= 4 (the file: nibble k), so that one mask and one shift put the high parts
of four positions one to a byte, and each step's two indices are one byte permutation (`_block_pairs_device`: about
3 instructions an index where bit-field extraction took 6). Rows are padded to a multiple of 16 and J to a multiple
of 16 with index 0 (whose products meet zero activation codes; NaN codes are refused at load); V4.1's shapes need
no padding. A warp's work unit is (tile, matrix, RG_PER_UNIT consecutive row groups): their blocks are read in
order, PREFETCH blocks ahead, and each step's activation loads serve every group of the unit. Units are dealt
round-robin over the blocks (one persistent block of 16 warps per SM) in a fixed order: no atomics, no partial
sums, no finishing kernel. The codebook is staged before the grid entry (EARLY_READS; kernels.pdl): no
step's kernel writes it. The grid takes as few blocks as give each warp at most one unit (V4.1 decode: 108 and 120
of 132 SMs), which leaves SMs to the side stream's shared expert and mixes: dealing the units over every SM made the
isolated call 2 us faster but the whole step 0.3 ms slower (BENCHMARKS.md, twenty-ninth session).

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
from kernels import bounded_jit, inline_device, rows_grid, smem_launch
from kernels.bf16 import f16_bits_device, round_bf16_device
from kernels.fp8 import (code_word_device, f16_of_e4m3_value_device, fp8_block_scale_device, pow2_inverse_device,
                         quant8_device)
from kernels.moe import swiglu_scaled_device
from kernels.mma import MMA_EX_WORDS, byte_perm_device, e4m3x8_to_f16x2_device, load4_device, mma_f16_device
from kernels.pdl import grid_entry_device
from kernels.scratch import check_arrays, scratch_array as _scratch, scratch_arrays

__all__ = ["vq_codebook", "vq_device_layout", "vq_plan", "vq_plan_buffers", "vq_gemv", "vq_stage", "stage_shapes",
           "padded_codewords", "check_staged", "stage_lane_device", "stage_pad_device", "moe_combine", "check_combine",
           "combine_group_device", "combine_slot_device", "VQPlan",
           "vq_plan_kernel", "vq_relayout_kernel", "vq_stage_kernel", "vq_stage_swiglu_kernel", "vq_gemv_kernel",
           "vq_gemv_wide_kernel",
           "moe_combine_kernel", "EARLY_READS", "mma_geometry", "device_stream_bytes", "scratch_bytes", "SIGNATURES"]

SIM = bool(_cuda_config.ENABLE_CUDASIM)
WARP = 32
E_MAX = 512                     # experts per layer (kernels.moe.route's bound)
K_MAX = 16                      # active experts per token
TILE_MAX = 16                   # pairs of a tile: two MMA column blocks
MMA_M = 16                      # weight rows of a row group (of a device block): the MMA's M
MMA_N = 8                       # pairs of one MMA: its N
SEG_CW = 16                     # codewords of a row in a device block (4 MMA steps of 4)
STEPS = SEG_CW // 4             # MMA steps of a block, 32 inputs each: one activation scale block
PREFETCH = 2                    # blocks of each row group in flight: loaded ahead of the one being computed (4:
                                # w1 + w3 33.9 -> 33.6 us, whole steps inside the noise, H100, BENCHMARKS.md)
RG_PER_UNIT = 1                 # row groups a warp's unit takes (they share each step's activation loads)
EARLY_READS = {"vq_gemv_kernel": ("cb_g",)}   # parameters read before the grid entry (kernels.pdl): the codebook
WORDS_PER_BLOCK = BLOCK_BYTES // 4              # 96 uint32 words
THREADS = 32 if SIM else 512                    # GEMV: 16 warps, one block an SM (<= 128 registers: no spills)
WIDE_THREADS = THREADS
STAGE_THREADS = 32 if SIM else 128
COMBINE_THREADS = 128
COMBINE_COLS = 4                                # columns a combine thread takes: its four accumulators, one order
COMBINE_K_FAST = 8                              # experts a token up to which the combine loads them all at once
STAGE_WARPS = STAGE_THREADS // WARP
PLAN_THREADS = 64 if SIM else 512               # plan kernel: one expert per thread up to E_MAX
PLAN_WARPS = PLAN_THREADS // WARP

VQPlan = namedtuple("VQPlan", "ids pairs tiles n_tiles n_pairs n_experts tile_rows")

# --------------------------------------------------------------------------------------------- the plan
@inline_device
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


@inline_device
def _pair_expert_device(ids, p, p_end, n_experts):
    """The expert of pair p (ids flattened token-major), or -1 past p_end or for an id outside 0..n_experts-1."""
    if p >= p_end:
        return -1
    k_act = ids.shape[1]
    e = ids[p // k_act, p % k_act]
    return e if 0 <= e < n_experts else -1


@inline_device
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


@inline_device
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
    grid_entry_device()
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


# ------------------------------------------------------------------------------- the device layout
def mma_geometry(rows, cols):
    """(J, row groups, column segments, device blocks) of a [rows, cols] expert matrix in the device layout."""
    J = cols // VQ_DIM
    n_rg = -(-rows // MMA_M)
    n_seg = -(-J // SEG_CW)
    return J, n_rg, n_seg, n_rg * n_seg


def device_stream_bytes(shape_a, shape_b):
    """(index bytes, plane bytes) per expert matrix in the device layout of a layer whose w1 and w3 have shape_a
    (rows, cols) and w2 shape_b (the engine: [F, D] and [D, F]): the larger of the two block counts, so the three
    matrices share one [E, 3, S] array."""
    nb = max(mma_geometry(*shape_a)[3], mma_geometry(*shape_b)[3])
    return nb * BLOCK_BYTES, nb * PLANE_BLOCK_BYTES


@inline_device
def _file_index_device(src, src_pl, has_plane, base_w, base_p, p):
    """The codeword index at stream position p of one matrix in the file's layout (ds4lib.formats.vq): its block's
    words for the owning lane (_load_block_device), position k = p % 8 in byte k % 4 of word k // 4, nibble k of the
    third word and bit k of the plane byte."""
    b = p // BLOCK_INDICES
    w0, w1, w2, pl = _load_block_device(src, src_pl, has_plane, base_w, base_p, b, b + 1, (p % BLOCK_INDICES) // 8)
    k = p % 8
    lo = (w0 >> np.uint32(8 * k)) if k < 4 else (w1 >> np.uint32(8 * (k - 4)))
    return ((lo & np.uint32(0xFF)) | (((w2 >> np.uint32(4 * k)) & np.uint32(0xF)) << np.uint32(8))
            | (((pl >> np.uint32(k)) & np.uint32(1)) << np.uint32(12)))


@cuda.jit(cache=True)
def vq_relayout_kernel(src, src_pl, s_words, s_plane, dst, dst_pl, d_words, d_plane, has_plane, rows_a, cols_a,
                       rows_b, cols_b, n_mats):
    """File layout -> device layout, one thread per (matrix, device block, lane); matrix i = 3e + m is [rows_b,
    cols_b] for m == 1 (w2), else [rows_a, cols_a]. Positions past a row's end or past the last row get index 0."""
    grid_entry_device()
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    nb_max = d_words // WORDS_PER_BLOCK
    if i >= n_mats * nb_max * WARP:
        return
    lane = i % WARP
    b = (i // WARP) % nb_max
    mat = i // (WARP * nb_max)
    rows, cols = (rows_b, cols_b) if mat % 3 == 1 else (rows_a, cols_a)
    J = cols // VQ_DIM
    n_seg = (J + SEG_CW - 1) // SEG_CW
    rg = b // n_seg
    s = b % n_seg
    w0 = np.uint32(0)
    w1 = np.uint32(0)
    w2 = np.uint32(0)
    pl = np.uint32(0)
    bw = np.uint64(mat) * np.uint64(s_words)
    bp = np.uint64(mat) * np.uint64(s_plane)
    for k in range(8):                                        # position k: step k // 2, row g + 8 (k % 2)
        r = MMA_M * rg + lane // 4 + MMA_N * (k % 2)
        c = SEG_CW * s + 4 * (k // 2) + lane % 4
        v = np.uint32(0)
        if r < rows and c < J:
            v = _file_index_device(src, src_pl, has_plane, bw, bp, r * J + c)
        if k < 4:
            w0 |= (v & np.uint32(0xFF)) << np.uint32(8 * k)
        else:
            w1 |= (v & np.uint32(0xFF)) << np.uint32(8 * (k - 4))
        w2 |= ((v >> np.uint32(8)) & np.uint32(0xF)) << np.uint32(8 * (k % 4) + 4 * (k // 4))
        pl |= ((v >> np.uint32(12)) & np.uint32(1)) << np.uint32(k)
    o = np.uint64(mat) * np.uint64(d_words) + np.uint64(WORDS_PER_BLOCK * b + lane)
    dst[o] = w0
    dst[o + np.uint64(32)] = w1
    dst[o + np.uint64(64)] = w2
    if has_plane:
        dst_pl[np.uint64(mat) * np.uint64(d_plane) + np.uint64(PLANE_BLOCK_BYTES * b + lane)] = np.uint8(pl)


# ------------------------------------------------------------------------- activations as E4M3 codes
@inline_device
def _stage_slot_device(n_cwp):
    """(in range, codeword c) of the staging thread: codewords on the grid's x axis, rows on its y axis (no 64-bit
    division of a flat index); threads past the row's end take codeword 0."""
    c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    ok = c < n_cwp                         # every thread of the block takes part in the quad exchanges
    return ok, c if ok else 0


@inline_device
def _staged_word_device(r, c, n_cwp):
    """The first of the 4 staged words of codeword c of row r (its inputs 0-1, 2-3, 4-5, 6-7): the GEMV's fragment
    order, c = 16s + 4k + t at 4 (r*Jp + 16s + 4t + k)."""
    return 4 * (r * n_cwp + SEG_CW * (c // SEG_CW) + 4 * (c % 4) + (c % SEG_CW) // 4)


@inline_device
def stage_lane_device(q, amq, blk, lane, live, r, n_cwp, xh, scl1):
    """vq_stage_kernel's output for one input, from a producer whose warp holds an aligned block of 32 FP8-grid
    values, one a lane: q, input `lane` of block `blk` of row r (`live`: in the row, else nothing is written), amq the
    block's largest |q| (kernels.fp8.act_quant_fp8_lane_amax_device). The block's scale P = fp8_block_scale(amq) (the
    staging kernel's, from its quad maximum), the half of the E4M3 code q / P (exact: f16_of_e4m3_value_device, the
    value cvt.rn.f16x2.e4m3x2 gives) paired with the neighbouring lane's into the word of inputs (2i, 2i + 1), written
    by the even lane at _staged_word_device's place (codeword c = 4 blk + lane // 8: its word 4 (r Jp + 16 (blk // 4)
    + 4 (lane // 8) + blk % 4) + (lane % 8) // 2, in unsigned arithmetic); the block's first lane writes P. The same
    bits as vq_stage_kernel over the row (tests/kernels/test_rms_norm.py). Every lane of the warp calls it (one
    shuffle)."""
    p = fp8_block_scale_device(amq)
    h = f16_of_e4m3_value_device(q * pow2_inverse_device(p))
    pair = h | (np.uint32(cuda.shfl_xor_sync(0xFFFFFFFF, np.int32(h), 1)) << np.uint32(16))   # (a half: < 2^16)
    b = np.uint32(blk)
    e = np.uint32(lane)
    if live and e % np.uint32(2) == np.uint32(0):
        o = (np.uint32(64) * (b // np.uint32(4)) + np.uint32(4) * (b % np.uint32(4))
             + np.uint32(16) * (e // np.uint32(8)) + (e % np.uint32(8)) // np.uint32(2))
        xh[np.uint64(4 * r * n_cwp) + np.uint64(o)] = pair
    if live and e == np.uint32(0):
        scl1[np.uint64(r * (n_cwp // 4)) + np.uint64(b)] = p


@inline_device
def stage_pad_device(r, J, n_cwp, xh, scl1):
    """The padded codewords J .. Jp - 1 of row r as vq_stage_kernel writes them (zero codes, scale 1), by the threads
    of one block (J % 4 == 0: whole scale blocks), for a producer that stages the row's J codewords itself."""
    for k in range(cuda.threadIdx.x, 4 * (n_cwp - J), cuda.blockDim.x):
        xh[_staged_word_device(r, J + k // 4, n_cwp) + k % 4] = np.uint32(0)
    for k in range(cuda.threadIdx.x, (n_cwp - J) // 4, cuda.blockDim.x):
        scl1[r * (n_cwp // 4) + J // 4 + k] = np.float32(1.0)


@inline_device
def _stage_word_device(v0, v1, v2, v3, v4, v5, v6, v7, raw, ok, r, c, n_cwp, xh, scl1, red):
    """Codeword c of row r (its 8 values v_i, zeros past J) -> its E4M3 codes as 8 halves and, in the quad's first
    lane, the block's scale (vq_stage_kernel's docstring). Every thread of the block calls it."""
    v0, v1, v2, v3, v4, v5, v6, v7, am = quant8_device(v0, v1, v2, v3, v4, v5, v6, v7, raw,
                                                       red[cuda.threadIdx.x // WARP])
    p = fp8_block_scale_device(am)
    word, _ = code_word_device(v0, v1, v2, v3, v4, v5, v6, v7, pow2_inverse_device(p))
    if ok:
        o = _staged_word_device(r, c, n_cwp)
        h0, h1, h2, h3 = e4m3x8_to_f16x2_device(word)
        xh[o] = h0
        xh[o + 1] = h1
        xh[o + 2] = h2
        xh[o + 3] = h3
        if c % 4 == 0:
            scl1[r * (n_cwp // 4) + c // 4] = p


@inline_device
def _row8_device(a, r, k):
    """a[r, k .. k + 7]: the 8 inputs of one codeword."""
    return a[r, k], a[r, k + 1], a[r, k + 2], a[r, k + 3], a[r, k + 4], a[r, k + 5], a[r, k + 6], a[r, k + 7]


@cuda.jit(cache=True)
def vq_stage_kernel(x, raw, J, n_cwp, xh, scl1):
    """x float32 [n, 8J] (FP8-grid values; `raw`: unquantised, act_quant_fp8's rule applied first with its kernel's
    operations) -> xh uint32 [n * Jp * 4] (codeword c's 8 inputs as the halves of their E4M3 codes, two a word, the
    lower input in the low half, zeros for c >= J; in the GEMV's fragment order: c = 16s + 4k + t of row r at words
    4 (r*Jp + 16s + 4t + k) .. + 3) and scl1 float32 [n * Jp/4] (block q of 32 inputs' power-of-two scale P at
    r*Jp/4 + q: x = code * P exactly). One thread per codeword, a quad of lanes per block of 32; rows from the
    block's y index in steps of gridDim.y."""
    grid_entry_device()
    red = cuda.shared.array((STAGE_WARPS, WARP), np.float32)     # the simulator's quad exchange
    ok, c = _stage_slot_device(n_cwp)
    r = cuda.blockIdx.y
    while r < x.shape[0]:                                         # block-uniform
        v0 = v1 = v2 = v3 = v4 = v5 = v6 = v7 = np.float32(0.0)
        if c < J:
            v0, v1, v2, v3, v4, v5, v6, v7 = _row8_device(x, r, VQ_DIM * c)
        _stage_word_device(v0, v1, v2, v3, v4, v5, v6, v7, raw, ok, r, c, n_cwp, xh, scl1, red)
        r += cuda.gridDim.y


@cuda.jit(cache=True)
def vq_stage_swiglu_kernel(g, u, w, has_w, limit, J, n_cwp, xh, scl1):
    """vq_stage_kernel (raw) over a = swiglu(g, u, limit, w) computed as its values are loaded
    (kernels.moe.swiglu_scaled_device, the row's weight loaded once): the SwiGLU step of an expert folded into its
    down projection's staging.
    g, u float32 [n, 8J], w float32 [n]."""
    grid_entry_device()
    red = cuda.shared.array((STAGE_WARPS, WARP), np.float32)     # the simulator's quad exchange
    ok, c = _stage_slot_device(n_cwp)
    r = cuda.blockIdx.y
    while r < g.shape[0]:                                         # block-uniform
        v0 = v1 = v2 = v3 = v4 = v5 = v6 = v7 = np.float32(0.0)
        if c < J:
            g0, g1, g2, g3, g4, g5, g6, g7 = _row8_device(g, r, VQ_DIM * c)
            u0, u1, u2, u3, u4, u5, u6, u7 = _row8_device(u, r, VQ_DIM * c)
            wr = w[r] if has_w else np.float32(0.0)               # once for the 8 (was a load before each)
            v0, v1 = swiglu_scaled_device(g0, u0, wr, has_w, limit), swiglu_scaled_device(g1, u1, wr, has_w, limit)
            v2, v3 = swiglu_scaled_device(g2, u2, wr, has_w, limit), swiglu_scaled_device(g3, u3, wr, has_w, limit)
            v4, v5 = swiglu_scaled_device(g4, u4, wr, has_w, limit), swiglu_scaled_device(g5, u5, wr, has_w, limit)
            v6, v7 = swiglu_scaled_device(g6, u6, wr, has_w, limit), swiglu_scaled_device(g7, u7, wr, has_w, limit)
        _stage_word_device(v0, v1, v2, v3, v4, v5, v6, v7, True, ok, r, c, n_cwp, xh, scl1, red)
        r += cuda.gridDim.y


# ------------------------------------------------------------------------------------------ the GEMV
if SIM:
    @cuda.jit(device=True)
    def _stage_codebook_device(cbs, cb_g):
        """Global -> shared codebook copy. The simulator's shared memory is a NumPy array: one thread copies it
        whole (a per-element loop costs seconds there)."""
        if cuda.threadIdx.x == 0:
            cbs[:cb_g.shape[0]] = cb_g[:cb_g.shape[0]]
else:
    @inline_device
    def _stage_codebook_device(cbs, cb_g):
        """Global -> shared codebook copy, 8 bytes per thread and step, coalesced."""
        for i in range(cuda.threadIdx.x, cb_g.shape[0], cuda.blockDim.x):
            cbs[i] = cb_g[i]


@inline_device
def _load_block_device(idx1, pl1, has_plane, ib, pb, b, n_blocks, lane):
    """(lo8 of i0..i3, lo8 of i4..i7, hi4 of i0..i7, plane bits) of the lane in block b of the run of blocks that
    starts at word ib of the flat index words and byte pb of the flat plane bytes. Past the run's end (b >=
    n_blocks) it loads the run's last block again: the GEMV's loads ahead of its last blocks are never used, and a
    load with no branch around it and no zeros costs fewer instructions. An empty run (n_blocks == 0: a unit's
    missing second row group) gives zeros."""
    if n_blocks <= 0:
        return np.uint32(0), np.uint32(0), np.uint32(0), np.uint32(0)
    b = min(b, n_blocks - 1)
    w = ib + np.uint64(WORDS_PER_BLOCK * b + lane)
    pl = np.uint32(pl1[pb + np.uint64(PLANE_BLOCK_BYTES * b + lane)]) if has_plane else np.uint32(0)
    return idx1[w], idx1[w + np.uint64(32)], idx1[w + np.uint64(64)], pl


@inline_device
def _spread4_device(b):
    """Bits 0-3 of b -> bit 4 of bytes 0-3 (one multiply: the four shifted copies of b do not overlap)."""
    return (b * np.uint32(0x02040810)) & np.uint32(0x10101010)


@inline_device
def _block_pairs_device(blk):
    """A device block's words (_load_block_device) -> the lane's 4 steps as pair words: step k's index of row g in
    bits 0-12 and of row g + 8 in bits 16-28. The index of position k is byte k % 4 of word k // 4, then nibble
    k of the third word in bits 8-11 (its byte k % 4, low nibble for k < 4) and bit k of the plane byte in bit 12:
    the high parts are spread to one byte a position (hi0: positions 0-3, hi1: 4-7) and each pair word is one byte
    permutation of a low word and its high bytes."""
    w0, w1, w2, pl = blk
    m = np.uint32(0x0F0F0F0F)
    hi0 = (w2 & m) | _spread4_device(pl & np.uint32(0xF))
    hi1 = ((w2 >> np.uint32(4)) & m) | _spread4_device(pl >> np.uint32(4))
    s01 = np.uint32(0x5140)                         # bytes lo[0], hi[0], lo[1], hi[1]
    s23 = np.uint32(0x7362)                         # bytes lo[2], hi[2], lo[3], hi[3]
    return (byte_perm_device(w0, hi0, s01), byte_perm_device(w0, hi0, s23), byte_perm_device(w1, hi1, s01),
            byte_perm_device(w1, hi1, s23))


@inline_device
def _pair_row_device(pairs, first, n, count, x_div):
    """The activation row of column n of a tile (pair first + n of the plan); row 0 past the tile's count (its MMA
    column is computed and never stored)."""
    return np.int64(pairs[first + n] // x_div) if n < count else np.int64(0)


@inline_device
def _a_frags_device(cbs, pw, k):
    """The A fragments of step k for the lane's rows g and g + 8 of its row group: the codewords of pair word pw[k]
    (_block_pairs_device), as halves: (values 0-3 as a0..a3 of the first MMA, values 4-7 of the second)."""
    p = pw[k]
    lo = byte_perm_device(p, np.uint32(0), np.uint32(0x4410))   # p & 0xFFFF, in one PRMT before the address step
    g0, g1, g2, g3 = e4m3x8_to_f16x2_device(cbs[lo])
    r0, r1, r2, r3 = e4m3x8_to_f16x2_device(cbs[p >> np.uint32(16)])
    return g0, r0, g1, r1, g2, r2, g3, r3


@inline_device
def _mma_step_device(a, b, p0, p1, acc, ex):
    """acc + P * (A . B) for one step of 32 inputs: two chained m16n8k16 MMAs (values 0-3 of each codeword, then
    4-7); a = _a_frags_device, b = the column's 8 staged halves (load4_device), p0 / p1 the block scales of the
    lane's output columns 2t / 2t + 1. acc = (row g col 2t, row g col 2t+1, row g+8 col 2t, row g+8 col 2t+1)."""
    z = np.float32(0.0)
    e0, e1, e2, e3 = mma_f16_device(a[0], a[1], a[2], a[3], b[0], b[1], z, z, z, z, ex)
    d0, d1, d2, d3 = mma_f16_device(a[4], a[5], a[6], a[7], b[2], b[3], e0, e1, e2, e3, ex)
    return (cuda.fma(d0, p0, acc[0]), cuda.fma(d1, p1, acc[1]), cuda.fma(d2, p0, acc[2]), cuda.fma(d3, p1, acc[3]))


@inline_device
def _load4_live_device(ary, i, live, old):
    """load4_device(ary, i) for a live column, else `old` (the registers' last values) and no load: a dead column's
    lanes take no share of the L1's data path (which a warp's 16-byte load occupies for 4 cycles even when its lanes
    share addresses), and need no zeroing either, since a dead column's MMA outputs are never stored (an output
    depends only on its own row of A and column of B)."""
    if live:
        return load4_device(ary, i)
    return old


@inline_device
def _x_block_device(xh, scl1, o, sa, sb, s, live_b, live_a, live_c, old):
    """What a lane of one column block reads of the activations for block s: its column's staged halves of the 4
    steps (B fragments; live_b: the column is in the tile) and the 4 steps' block scales of its output columns 2t
    and 2t + 1 (live_a, live_c); `old` (the previous block's) where a column is dead. A decode tile of one pair: 4
    lanes load B and 8 the scales."""
    f = 4 * (o + SEG_CW * s)
    q = STEPS * s
    return (_load4_live_device(xh, f, live_b, old[0]), _load4_live_device(xh, f + 4, live_b, old[1]),
            _load4_live_device(xh, f + 8, live_b, old[2]), _load4_live_device(xh, f + 12, live_b, old[3]),
            _load4_live_device(scl1, sa + q, live_a, old[4]), _load4_live_device(scl1, sb + q, live_c, old[5]))


@inline_device
def _unit_step_device(cbs, c0, c1, two, wide, b0, b1, p0, p1, p2, p3, acc00, acc01, acc10, acc11, k, ex):
    """Step k (a literal) of a block for the unit's row groups (block words c0, c1 when `two`) and column blocks
    (tokens 0-7 with B fragments b0, and 8-15 with b1 when `wide`): each column's staged halves are loaded once and
    serve every row group."""
    a = _a_frags_device(cbs, c0, k)
    acc00 = _mma_step_device(a, b0, p0, p1, acc00, ex)
    if wide:
        acc01 = _mma_step_device(a, b1, p2, p3, acc01, ex)
    if two:
        a = _a_frags_device(cbs, c1, k)
        acc10 = _mma_step_device(a, b0, p0, p1, acc10, ex)
        if wide:
            acc11 = _mma_step_device(a, b1, p2, p3, acc11, ex)
    return acc00, acc01, acc10, acc11


@inline_device
def _store_out_device(out, msel, pairs, first, count, n, r, v, n_rows, gain, e, scale, has_scale):
    """out[msel, pair of column n, r] = bf16(v * g [* s]) when column n is in the tile and row r in the matrix."""
    if n < count and r < n_rows:
        v = v * f16_bits_device(np.uint32(gain[e, r]))
        if has_scale:
            v = v * scale[e, r]
        out[msel, pairs[first + n], r] = round_bf16_device(v)


@inline_device
def _store_acc_device(out, msel, pairs, first, count, n0, r, acc, n_rows, gain, e, scale, has_scale):
    """The lane's four outputs of one row group and column block: rows r, r + 8 x columns n0, n0 + 1."""
    _store_out_device(out, msel, pairs, first, count, n0, r, acc[0], n_rows, gain, e, scale, has_scale)
    _store_out_device(out, msel, pairs, first, count, n0 + 1, r, acc[1], n_rows, gain, e, scale, has_scale)
    _store_out_device(out, msel, pairs, first, count, n0, r + MMA_N, acc[2], n_rows, gain, e, scale, has_scale)
    _store_out_device(out, msel, pairs, first, count, n0 + 1, r + MMA_N, acc[3], n_rows, gain, e, scale, has_scale)


@inline_device
def _ring_push_device(ring, blk):
    """A row group's blocks in flight (a tuple, oldest first) without the oldest, with `blk` last."""
    return ring[1:] + (blk,)


def _ring_init(depth):
    """The device function that loads a row group's first `depth` blocks (the blocks in flight, oldest first):
    (idx1, pl1, has_plane, ib, pb, n_blocks, lane) -> a tuple of `depth` _load_block_device results, built as the
    first depth - 1 blocks' tuple with block depth - 1 pushed on (the tuple's length is fixed at compile time)."""
    if not 1 <= depth <= 4:
        raise ValueError(f"vq_gemv: blocks in flight must be 1 to 4, got {depth}")
    ld = _load_block_device
    if depth == 1:
        @inline_device
        def ring_first(idx1, pl1, has_plane, ib, pb, n, lane):
            return (ld(idx1, pl1, has_plane, ib, pb, 0, n, lane),)
        return ring_first
    head = _ring_init(depth - 1)
    last = depth - 1

    @inline_device
    def ring(idx1, pl1, has_plane, ib, pb, n, lane):
        return head(idx1, pl1, has_plane, ib, pb, n, lane) + (ld(idx1, pl1, has_plane, ib, pb, last, n, lane),)
    return ring


def _make_vq_kernel(threads, wide, rg_per_unit=RG_PER_UNIT, prefetch=PREFETCH):
    """The persistent VQ GEMV on the tensor cores with `threads` a block; `wide`: tiles of up to 16 pairs (two MMA
    column blocks), else up to 8 (the decode kernel: the second block's loads and MMAs are compiled out);
    `rg_per_unit` (1 or 2) row groups a warp's unit; `prefetch` (1 to 4) blocks of each row group loaded ahead of
    the one being computed (their words in registers). All give a pair the same bits: an MMA output depends only on
    its own row of A and column of B, and every output is summed step by step in the same order."""
    warps = threads // WARP
    ring_init = _ring_init(prefetch)
    exw = warps if SIM else 1                      # the simulator's MMA exchange (unused on the GPU)
    jit = bounded_jit(threads)
    two_rg = rg_per_unit == 2

    @jit
    def vq_gemv_kernel(xh, scl1, n_cwp, x_div, pairs, tiles, n_tiles, cb_g, idx1, pl1, idx_words, plane_len,
                       has_plane, mat0, mat_step, n_mats, n_rows, n_rg, n_seg, gain_a, gain_b, scale, has_scale, out):
        lane = cuda.threadIdx.x % WARP
        warp = cuda.threadIdx.x // WARP
        cbs = cuda.shared.array(0, nb_uint64)                     # [C] codewords, 8 E4M3 codes each
        ex = cuda.shared.array((exw, WARP, MMA_EX_WORDS), np.uint32)
        _stage_codebook_device(cbs, cb_g)         # before the entry: no step's kernel writes a codebook (EARLY_READS)
        grid_entry_device()
        cuda.syncthreads()
        exl = ex[warp % exw]
        g = lane // 4
        t = lane % 4
        n_q = n_cwp // 4
        n_up = (n_rg + rg_per_unit - 1) // rg_per_unit
        total = n_tiles[0] * n_mats * n_up
        u = warp * cuda.gridDim.x + cuda.blockIdx.x              # units dealt over the SMs first
        while u < total:                                          # warp-uniform
            rg0 = rg_per_unit * (u % n_up)
            v = u // n_up
            msel = v % n_mats
            tile = v // n_mats
            e = tiles[tile, 0]
            first = tiles[tile, 1]
            count = tiles[tile, 2]
            m = mat0 + mat_step * msel
            two = two_rg and rg0 + 1 < n_rg                       # the second row group exists
            ib0 = np.uint64(3 * e + m) * np.uint64(idx_words) + np.uint64(WORDS_PER_BLOCK * n_seg * rg0)
            pb0 = np.uint64(3 * e + m) * np.uint64(plane_len) + np.uint64(PLANE_BLOCK_BYTES * n_seg * rg0)
            ib1 = ib0 + np.uint64(WORDS_PER_BLOCK * n_seg)
            pb1 = pb0 + np.uint64(PLANE_BLOCK_BYTES * n_seg)
            n_seg1 = n_seg if two else 0                          # a missing group reads nothing (zero words)
            o0 = _pair_row_device(pairs, first, g, count, x_div) * n_cwp + 4 * t     # B: column g's halves
            o1 = _pair_row_device(pairs, first, g + MMA_N, count, x_div) * n_cwp + 4 * t if wide else np.int64(0)
            s0 = _pair_row_device(pairs, first, 2 * t, count, x_div) * n_q             # scales: columns 2t, 2t+1
            s1 = _pair_row_device(pairs, first, 2 * t + 1, count, x_div) * n_q
            s2 = _pair_row_device(pairs, first, MMA_N + 2 * t, count, x_div) * n_q if wide else np.int64(0)
            s3 = _pair_row_device(pairs, first, MMA_N + 2 * t + 1, count, x_div) * n_q if wide else np.int64(0)
            z = np.float32(0.0)
            acc00 = acc01 = acc10 = acc11 = (z, z, z, z)
            zu = np.uint32(0)
            xc = xw = ((zu, zu, zu, zu), (zu, zu, zu, zu), (zu, zu, zu, zu), (zu, zu, zu, zu), (z, z, z, z), (z, z, z, z))
            r0 = ring_init(idx1, pl1, has_plane, ib0, pb0, n_seg, lane)      # blocks 0 .. prefetch - 1
            r1 = ring_init(idx1, pl1, has_plane, ib1, pb1, n_seg1, lane)
            for s in range(n_seg):
                c0 = _block_pairs_device(r0[0])
                c1 = _block_pairs_device(r1[0])
                r0 = _ring_push_device(r0, _load_block_device(idx1, pl1, has_plane, ib0, pb0, s + prefetch, n_seg,
                                                              lane))
                r1 = _ring_push_device(r1, _load_block_device(idx1, pl1, has_plane, ib1, pb1, s + prefetch, n_seg1,
                                                              lane))
                xc = _x_block_device(xh, scl1, o0, s0, s1, s, g < count, 2 * t < count, 2 * t + 1 < count, xc)
                xw = _x_block_device(xh, scl1, o1, s2, s3, s, g + MMA_N < count, MMA_N + 2 * t < count,
                                     MMA_N + 2 * t + 1 < count, xw) if wide else xc
                pa = xc[4]
                pb = xc[5]
                pc = xw[4]
                pd = xw[5]
                acc00, acc01, acc10, acc11 = _unit_step_device(cbs, c0, c1, two, wide, xc[0], xw[0], pa[0], pb[0],
                                                               pc[0], pd[0], acc00, acc01, acc10, acc11, 0, exl)
                acc00, acc01, acc10, acc11 = _unit_step_device(cbs, c0, c1, two, wide, xc[1], xw[1], pa[1], pb[1],
                                                               pc[1], pd[1], acc00, acc01, acc10, acc11, 1, exl)
                acc00, acc01, acc10, acc11 = _unit_step_device(cbs, c0, c1, two, wide, xc[2], xw[2], pa[2], pb[2],
                                                               pc[2], pd[2], acc00, acc01, acc10, acc11, 2, exl)
                acc00, acc01, acc10, acc11 = _unit_step_device(cbs, c0, c1, two, wide, xc[3], xw[3], pa[3], pb[3],
                                                               pc[3], pd[3], acc00, acc01, acc10, acc11, 3, exl)
            gain = gain_a if msel == 0 else gain_b
            r0 = MMA_M * rg0 + g
            _store_acc_device(out, msel, pairs, first, count, 2 * t, r0, acc00, n_rows, gain, e, scale, has_scale)
            if wide:
                _store_acc_device(out, msel, pairs, first, count, MMA_N + 2 * t, r0, acc01, n_rows, gain, e, scale,
                                  has_scale)
            if two:
                _store_acc_device(out, msel, pairs, first, count, 2 * t, r0 + MMA_M, acc10, n_rows, gain, e, scale,
                                  has_scale)
                if wide:
                    _store_acc_device(out, msel, pairs, first, count, MMA_N + 2 * t, r0 + MMA_M, acc11, n_rows, gain,
                                      e, scale, has_scale)
            u += cuda.gridDim.x * warps
    return vq_gemv_kernel


vq_gemv_kernel = _make_vq_kernel(THREADS, False)
vq_gemv_wide_kernel = _make_vq_kernel(WIDE_THREADS, True)


@inline_device
def _combine_group_device(ye, r, d0, d_len):
    """ye[r, d0 .. d0 + 3], the columns past d_len read as column d_len - 1 (their sums are never stored)."""
    return (ye[r, d0], ye[r, min(d0 + 1, d_len - 1)], ye[r, min(d0 + 2, d_len - 1)], ye[r, min(d0 + 3, d_len - 1)])


@inline_device
def combine_slot_device(n_tok, d_len):
    """This thread's slot of a combine over n_tok tokens of d_len columns, a thread per COMBINE_COLS consecutive
    columns of one token: (live, t, d0), live False for the threads past the last slot (they must return). The one
    mapping of moe_combine_kernel and kernels.hc's hc_post of the MoE's terms."""
    n_grp = (d_len + COMBINE_COLS - 1) // COMBINE_COLS
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    return i < n_tok * n_grp, i // n_grp, COMBINE_COLS * (i % n_grp)


@inline_device
def combine_group_device(ye, ids, shared, t, d0, d_len):
    """moe_combine's outputs for token t's columns d0 .. d0 + 3: bf16(sum over k in ascending ids[t, k] of ye[t*K + k,
    d] + shared[t, d]), each column adding its terms in that order (columns past d_len are computed from column
    d_len - 1 and must not be stored). Up to COMBINE_K_FAST experts the token's ids, every slot's four columns and
    the shared expert's are loaded at once, in slot order (one memory round trip, none waiting for the ids), and
    the adds then take the slots by ascending id, a selection over the K ids per step whose winner's values are
    picked in registers. More experts take the order one expert at a time. The one definition of the combine's
    arithmetic (moe_combine_kernel, kernels.hc's hc_post of the MoE's terms)."""
    k_act = ids.shape[1]
    y0 = y1 = y2 = y3 = np.float32(0.0)
    s0, s1, s2, s3 = _combine_group_device(shared, t, d0, d_len)
    if k_act <= COMBINE_K_FAST:
        idv = cuda.local.array(COMBINE_K_FAST, np.int32)       # constant indices only: registers
        vals = cuda.local.array((COMBINE_K_FAST, COMBINE_COLS), np.float32)
        for k in range(COMBINE_K_FAST):                       # past k_act: the last slot again, never added
            kk = min(k, k_act - 1)
            idv[k] = ids[t, kk]
            vals[k, 0], vals[k, 1], vals[k, 2], vals[k, 3] = _combine_group_device(ye, t * k_act + kk, d0, d_len)
        prev = -1
        for j in range(COMBINE_K_FAST):                   # selection by ascending expert id (ids are distinct)
            best = 0x7FFFFFFF
            v0 = v1 = v2 = v3 = np.float32(0.0)
            for k in range(COMBINE_K_FAST):
                v = idv[k]
                if k < k_act and v > prev and v < best:
                    best = v
                    v0 = vals[k, 0]
                    v1 = vals[k, 1]
                    v2 = vals[k, 2]
                    v3 = vals[k, 3]
            if j < k_act:
                y0 += v0
                y1 += v1
                y2 += v2
                y3 += v3
            prev = best
    else:
        prev = -1
        for _ in range(k_act):
            best = 0x7FFFFFFF
            kb = 0
            for k in range(k_act):
                v = ids[t, k]
                if v > prev and v < best:
                    best = v
                    kb = k
            a0, a1, a2, a3 = _combine_group_device(ye, t * k_act + kb, d0, d_len)
            y0 += a0
            y1 += a1
            y2 += a2
            y3 += a3
            prev = best
    return (round_bf16_device(y0 + s0), round_bf16_device(y1 + s1), round_bf16_device(y2 + s2),
            round_bf16_device(y3 + s3))


@bounded_jit(COMBINE_THREADS)
def moe_combine_kernel(ye, ids, shared, out):
    """out[t, d] = bf16(sum over k in ascending ids[t, k] of ye[t*K + k, d] + shared[t, d]). A thread takes
    COMBINE_COLS consecutive columns of one token (combine_group_device)."""
    grid_entry_device()
    n_tok, d_len = out.shape
    live, t, d0 = combine_slot_device(n_tok, d_len)
    if not live:
        return
    v0, v1, v2, v3 = combine_group_device(ye, ids, shared, t, d0, d_len)
    out[t, d0] = v0
    if d0 + 1 < d_len:
        out[t, d0 + 1] = v1
    if d0 + 2 < d_len:
        out[t, d0 + 2] = v2
    if d0 + 3 < d_len:
        out[t, d0 + 3] = v3


_VQ_SIG = ("void(uint32[::1], float32[::1], int64, int64, int32[::1], int32[:, ::1], int32[::1], uint64[::1], "
           "uint32[::1], uint8[::1], int64, int64, boolean, int64, int64, int64, int64, int64, int64, uint16[:, ::1], "
           "uint16[:, ::1], float32[:, ::1], boolean, float32[:, :, ::1])")
SIGNATURES = {
    "vq_plan_kernel": "void(int32[:, :], int64, int64, int32[:], int32[:, :], int32[:])",
    "vq_relayout_kernel": "void(uint32[:], uint8[:], int64, int64, uint32[:], uint8[:], int64, int64, boolean, int64, "
                          "int64, int64, int64, int64)",
    "vq_stage_kernel": "void(float32[:, :], boolean, int64, int64, uint32[::1], float32[::1])",
    "vq_stage_swiglu_kernel": "void(float32[:, :], float32[:, :], float32[:], boolean, float32, int64, int64, "
                              "uint32[::1], float32[::1])",
    "vq_gemv_kernel": _VQ_SIG,
    "vq_gemv_wide_kernel": _VQ_SIG,
    "moe_combine_kernel": "void(float32[:, :], int32[:, :], float32[:, :], float32[:, :])",
}


_SM_COUNT = []


def _persistent_blocks():
    if SIM:
        return 1
    if not _SM_COUNT:
        _SM_COUNT.append(int(cuda.get_current_device().MULTIPROCESSOR_COUNT))
    return _SM_COUNT[0]


# ----------------------------------------------------------------------------------------------- launchers
def vq_codebook(codes, stream=0):
    """A layer's E4M3 codebook, device uint8 [C, 8] -> the same bytes as uint64 [C] (codeword c's 8 codes, element 0
    in the low byte), the form the GEMV reads. Refused: NaN codes (0x7F, 0xFF), which no quantiser writes and which
    would turn the zero products of padded positions into NaN."""
    shape = tuple(codes.shape)
    if len(shape) != 2 or shape[1] != VQ_DIM or codes.dtype != np.uint8 or shape[0] not in (4096, 8192):
        raise ValueError(f"vq_codebook: codes must be uint8 [4096 or 8192, {VQ_DIM}], got {codes.dtype} {shape}")
    if ((codes.copy_to_host(stream=stream) & 0x7F) == 0x7F).any():
        raise ValueError("vq_codebook: the codebook holds NaN E4M3 codes")
    return codes.view(np.uint64).reshape(shape[0])


def vq_device_layout(index, plane, shape_a, shape_b, stream=0):
    """A layer's expert payload in the file's layout (device uint8 index [E, 3, S], plane [E, 3, P] or None; w1 and
    w3 of shape_a (rows, cols), w2 of shape_b) -> (index, plane) in the device layout the GEMV reads (module
    docstring)."""
    (ra, ca), (rb, cb) = (tuple(int(v) for v in shape_a), tuple(int(v) for v in shape_b))
    n_exp = int(index.shape[0])
    s_in = int(index.shape[2])
    n_idx = ra * ca // VQ_DIM
    if rb * cb != ra * ca or ca % 32 or cb % 32:
        raise ValueError(f"vq_device_layout: w1/w3 {shape_a} and w2 {shape_b} must hold as many weights, Kin % 32 == 0")
    if index.dtype != np.uint8 or tuple(index.shape) != (n_exp, 3, index_bytes(n_idx)):
        raise ValueError(f"vq_device_layout: index must be uint8 [E, 3, {index_bytes(n_idx)}], got {index.shape}")
    has_plane = plane is not None
    if has_plane and (plane.dtype != np.uint8 or tuple(plane.shape) != (n_exp, 3, plane_bytes(n_idx))):
        raise ValueError(f"vq_device_layout: plane must be uint8 [E, 3, {plane_bytes(n_idx)}], got {plane.shape}")
    s_out, p_out = device_stream_bytes((ra, ca), (rb, cb))
    dst = cuda.device_array((n_exp, 3, s_out), np.uint8, stream=stream)
    dst_pl = cuda.device_array((n_exp, 3, p_out), np.uint8, stream=stream) if has_plane else None
    dummy = cuda.device_array(1, np.uint8, stream=stream)
    p_in = int(plane.shape[2]) if has_plane else 0
    n = n_exp * 3 * (s_out // BLOCK_BYTES) * WARP
    vq_relayout_kernel[math.ceil(n / 128), 128, stream](
        index.view(np.uint32).reshape(n_exp * 3 * s_in // 4), plane.reshape(n_exp * 3 * p_in) if has_plane else dummy,
        s_in // 4, p_in, dst.view(np.uint32).reshape(n_exp * 3 * s_out // 4),
        dst_pl.reshape(n_exp * 3 * p_out) if has_plane else dummy, s_out // 4, p_out, has_plane, ra, ca, rb, cb, n_exp * 3)
    return dst, dst_pl


def vq_plan_buffers(n_tok, k_act, n_experts, tile_rows=None, stream=0):
    """An unfilled VQPlan for T tokens of K experts each (ids None), tiles of `tile_rows` rows (default
    min(T*K, TILE_MAX), as a call's plan takes them): what `vq_plan(out=...)` fills, or kernels.moe.route(plan=...)
    for one token."""
    n_pairs = int(n_tok) * int(k_act)
    return VQPlan(None, cuda.device_array(max(n_pairs, 1), np.int32, stream=stream),
                  cuda.device_array((max(n_pairs, 1), 3), np.int32, stream=stream),
                  cuda.device_array(1, np.int32, stream=stream), n_pairs, int(n_experts),
                  max(1, min(n_pairs, TILE_MAX)) if tile_rows is None else int(tile_rows))


def vq_plan(ids, n_experts, *, tile_rows=1, out=None, stream=0):
    """Routing ids int32 [T, K] (distinct per token) -> VQPlan (device work list; `out` a VQPlan to reuse)."""
    n_tok, k_act = tuple(ids.shape)
    if ids.dtype != np.int32 or not 0 < n_experts <= E_MAX or not 0 < k_act <= K_MAX \
            or not 0 < tile_rows <= TILE_MAX:
        raise ValueError(f"vq_plan: ids int32 [T, K <= {K_MAX}], 0 < n_experts <= {E_MAX}, tile_rows 1..{TILE_MAX}")
    n_pairs = n_tok * k_act
    if out is None or out.n_pairs != n_pairs or out.tile_rows != tile_rows or out.n_experts != n_experts:
        out = vq_plan_buffers(n_tok, k_act, n_experts, tile_rows, stream=stream)
    out = out._replace(ids=ids)
    if n_pairs:
        vq_plan_kernel[1, PLAN_THREADS, stream](ids, int(n_experts), int(tile_rows), out.pairs, out.tiles, out.n_tiles)
    return out


def scratch_bytes(n_x, cols):
    """Device scratch of one vq_gemv call over n_x activation rows of `cols` inputs (staged halves and scales)."""
    (xh, _), (scl, _) = stage_shapes(n_x, cols)
    return xh[0] * 4 + scl[0] * 4


def padded_codewords(cols):
    """Jp: the codewords of a staged row of `cols` inputs, J = cols / 8 padded to a multiple of SEG_CW."""
    return mma_geometry(1, cols)[2] * SEG_CW


def stage_shapes(n_x, cols):
    """((shape, dtype) of the staged halves, (shape, dtype) of the block scales) of n_x activation rows of `cols`
    inputs: the GEMV's B operand (vq_stage_kernel's docstring), for `vq_stage` and `vq_gemv(staged=...)`."""
    n_cwp = padded_codewords(cols)
    return ((n_x * n_cwp * 4,), np.uint32), ((n_x * n_cwp // 4,), np.float32)


def check_staged(staged, n_x, cols, name):
    """Refuses (with a ValueError naming `name`) a (halves, scales) pair that is not of stage_shapes(n_x, cols)."""
    check_arrays(staged, stage_shapes(n_x, cols), name, f"staged for {n_x} rows of {cols} inputs")


def vq_stage(x, *, quantize, out, stream=0):
    """x float32 [n_x, Kin] (Kin % 32 == 0) -> out = (halves, scales) of `stage_shapes(n_x, Kin)`: the activations as
    the GEMV's B operand (vq_stage_kernel; `quantize`: act_quant_fp8's rule applied first, else x holds FP8-grid
    values). What `vq_gemv` runs first unless it is given `staged`; a producer that holds the FP8 values can write the
    same bits itself (stage_lane_device, stage_pad_device: kernels.rms_norm.hc_rms_norm's `vq`)."""
    if x.dtype != np.float32 or len(tuple(x.shape)) != 2 or x.shape[1] % 32:
        raise ValueError(f"vq_stage: x must be float32 [n, Kin] with Kin % 32 == 0, got {x.dtype} {tuple(x.shape)}")
    n_x, cols = (int(v) for v in x.shape)
    check_staged(out, n_x, cols, "vq_stage")
    n_cwp = padded_codewords(cols)
    if n_x:
        vq_stage_kernel[rows_grid(math.ceil(n_cwp / STAGE_THREADS), n_x), STAGE_THREADS, stream](
            x, bool(quantize), cols // VQ_DIM, n_cwp, *out)
    return out


def vq_gemv(x, plan, codebook, index, plane, gains, *, mats, shape, x_div=1, scale=None, quantize=True, swiglu=None,
            staged=None, out=None, scratch=None, stream=0):
    """Routed-expert GEMV (module docstring) -> out float32 [len(mats), n_pairs, R] (BF16 values).

    x float32 [n_x, Kin] (pair p reads row p // x_div: the token for w1/w3 with x_div = K, the pair's own SwiGLU row
    for w2 with x_div = 1); plan from vq_plan; codebook uint64 [C] from vq_codebook; index uint8 [E, 3, S] and
    plane uint8 [E, 3, P] (13-bit layers) or None in the device layout (vq_device_layout); gains (g1, g2, g3) uint16
    [E, rows] f16 bits; mats: (0, 2) for w1 and w3 together or (1,) for w2, all of shape (R, Kin); scale float32
    [E, R] (sidecar gains of w2) or None; quantize: x is unquantised (act_quant_fp8's rule is applied first).
    swiglu: (u, weights, limit) with u float32 like x, weights float32 [n_x] or None: x is the gate g, and the
    staging reads a = kernels.moe.swiglu(g, u, limit, weights) instead of x (bit for bit; quantize=True only).
    staged: (halves, scales) that `vq_stage(x, quantize=quantize)` would write, written already (by the producer of
    x): the staging launch is skipped, and x gives only the row count (not with swiglu).
    """
    rows, cols = (int(v) for v in shape)
    mats = tuple(int(m) for m in mats)
    if cols % 32 or rows <= 0 or not mats or len(mats) > 2 or any(m not in (0, 1, 2) for m in mats):
        raise ValueError(f"vq_gemv: shape {shape} (Kin % 32 == 0) and 1-2 matrices of (0, 1, 2), got {mats}")
    if len(mats) == 2 and rows != int(gains[mats[1]].shape[1]):
        raise ValueError("vq_gemv: the two matrices must have the same shape")
    J, n_rg, n_seg, n_blocks = mma_geometry(rows, cols)
    n_exp = int(index.shape[0])
    s_len = int(index.shape[2])
    if index.dtype != np.uint8 or len(index.shape) != 3 or index.shape[1] != 3 or s_len % BLOCK_BYTES \
            or s_len < n_blocks * BLOCK_BYTES:
        raise ValueError(f"vq_gemv: index must be uint8 [E, 3, >= {n_blocks * BLOCK_BYTES}] in the device layout, "
                         f"got {index.dtype} {index.shape}")
    has_plane = plane is not None
    if has_plane and (plane.dtype != np.uint8 or tuple(plane.shape) != (n_exp, 3, s_len // BLOCK_BYTES
                                                                         * PLANE_BLOCK_BYTES)):
        raise ValueError(f"vq_gemv: plane must be uint8 [E, 3, {s_len // BLOCK_BYTES * PLANE_BLOCK_BYTES}], "
                         f"got {plane.shape}")
    n_cw = int(codebook.shape[0])
    if codebook.dtype != np.uint64 or tuple(codebook.shape) != (n_cw,) or n_cw != (8192 if has_plane else 4096):
        raise ValueError(f"vq_gemv: codebook must be uint64 [{8192 if has_plane else 4096}] (vq_codebook)")
    for m in mats:
        if gains[m].dtype != np.uint16 or tuple(gains[m].shape) != (n_exp, rows):
            raise ValueError(f"vq_gemv: gains of matrix {m} must be uint16 f16 bits [{n_exp}, {rows}]")
    has_scale = scale is not None
    if has_scale and (scale.dtype != np.float32 or tuple(scale.shape) != (n_exp, rows)):
        raise ValueError(f"vq_gemv: scale must be float32 [{n_exp}, {rows}]")
    if x.dtype != np.float32 or len(tuple(x.shape)) != 2 or x.shape[1] != cols:
        raise ValueError(f"vq_gemv: x must be float32 [n, {cols}], got {x.dtype} {x.shape}")
    if swiglu is not None:
        u, weights, limit = swiglu
        if not quantize or u.dtype != np.float32 or tuple(u.shape) != tuple(x.shape):
            raise ValueError(f"vq_gemv: swiglu needs quantize=True and u float32 {tuple(x.shape)}, got {u.dtype} "
                             f"{tuple(u.shape)}")
        if weights is not None and (weights.dtype != np.float32 or tuple(weights.shape) != (x.shape[0],)):
            raise ValueError(f"vq_gemv: swiglu weights must be float32 [{x.shape[0]}] or None")
    if staged is not None:
        if swiglu is not None:
            raise ValueError("vq_gemv: staged and swiglu exclude each other (the SwiGLU step is in the staging)")
        check_staged(staged, int(x.shape[0]), cols, "vq_gemv")
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
    n_x = int(x.shape[0])
    n_cwp = n_seg * SEG_CW
    if staged is not None:
        xh, scl1 = staged                                # written by x's producer
    else:
        xh, scl1 = scratch_arrays(scratch, ("x_halves", "x_scales"), stage_shapes(n_x, cols), stream)
        if swiglu is None:
            vq_stage(x, quantize=quantize, out=(xh, scl1), stream=stream)
        else:
            has_w = weights is not None
            w = weights if has_w else _scratch(scratch, "no_weights", (1,), np.float32, stream)
            vq_stage_swiglu_kernel[rows_grid(math.ceil(n_cwp / STAGE_THREADS), n_x), STAGE_THREADS, stream](
                x, u, w, has_w, np.float32(limit), J, n_cwp, xh, scl1)
    dummy = _scratch(scratch, "no_plane", (1,), np.uint8, stream)
    no_scale = _scratch(scratch, "no_scale", (1, 1), np.float32, stream)
    n_units = n_pairs * n_mats * -(-n_rg // RG_PER_UNIT)    # an upper bound: a tile holds at least one pair
    wide = plan.tile_rows > MMA_N
    threads = WIDE_THREADS if wide else THREADS
    grid = max(1, min(_persistent_blocks(), -(-n_units // (threads // WARP))))
    smem = n_cw * 8
    kernel = vq_gemv_wide_kernel if wide else vq_gemv_kernel
    launch = smem_launch(kernel, grid, threads, stream, smem)
    m0, step = mats[0], (mats[1] - mats[0] if n_mats == 2 else 0)
    idx_words = s_len // 4
    plane_len = int(plane.shape[2]) if has_plane else 0
    launch(xh, scl1, n_cwp, int(x_div), plan.pairs, plan.tiles, plan.n_tiles, codebook,
           index.view(np.uint32).reshape(n_exp * 3 * idx_words), plane.reshape(n_exp * 3 * plane_len) if has_plane
           else dummy, idx_words, plane_len, has_plane, m0, step, n_mats, rows, n_rg, n_seg, gains[mats[0]],
           gains[mats[-1]], scale if has_scale else no_scale, has_scale, out)
    return out


def check_combine(ye, ids, shared, name):
    """Refuses (a ValueError naming `name`) MoE terms that do not fit: ye [T*K, D], ids [T, K], shared [T, D]."""
    n_tok, k_act = tuple(ids.shape)
    d_len = shared.shape[1]
    if tuple(ye.shape) != (n_tok * k_act, d_len) or tuple(shared.shape) != (n_tok, d_len):
        raise ValueError(f"{name}: ye {ye.shape}, ids {ids.shape}, shared {shared.shape} do not fit")
    return n_tok, d_len


def moe_combine(ye, ids, shared, out=None, stream=0):
    """ye float32 [T*K, D] (routed expert outputs, routing weight applied), ids int32 [T, K], shared [T, D] (the
    shared expert) -> out [T, D] BF16 values: routed terms in ascending expert id, then the shared expert."""
    n_tok, d_len = check_combine(ye, ids, shared, "moe_combine")
    if out is None:
        out = cuda.device_array((n_tok, d_len), np.float32, stream=stream)
    n = n_tok * math.ceil(d_len / COMBINE_COLS)
    if n:
        moe_combine_kernel[math.ceil(n / COMBINE_THREADS), COMBINE_THREADS, stream](ye, ids, shared, out)
    return out

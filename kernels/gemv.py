"""Dense GEMV / small-batch GEMM with BF16 weights, and the activation quantise-dequantise kernels.

Owns:
- `gemv`: y[t, n] = sum_k W[n, k] x[t, g(n)*K + k] with W held as BF16 bit patterns (uint16 [N, K]; FP8
  checkpoint weights dequantise exactly to BF16, since E4M3 x UE8M0 has 4 significant bits) or as float32
  (twice the bytes; for weights that are not BF16 values), FP32 accumulation, and a BF16-rounded (ds4lib.ref.linear.linear_bf16, linear_q after act_quant_fp8) or FP32
  (linear_f32: router, ratio-2 compressor, head) output. Rows of group g read the g-th K-slice of x
  (`rows_per_group`), which is attention's grouped wo_a (ds4lib.ref.attention.output_projection); a dense
  linear is one group.
- `act_quant_fp8` (block 32), `act_quant_fp4_pow2` (block 32), `act_quant_fp4_e4m3` (block 16): bit-exact
  with ds4lib.formats.actquant (docs/architecture.md §11.3, errata E1/N3 in §1).
Does not own: FP4 / VQ / q4_K weight formats and their GEMVs; the FP8 / FP4 rounding and the quantiser's device
function (kernels.fp8), the warp reductions (kernels.warp).

Numerics: every product of a BF16 weight and a BF16 or quantised activation is exact in FP32; the FP32
sums differ from the reference's exact (float64) block sums only in rounding order, so outputs agree to
~1e-7 relative before the BF16 rounding (tests/kernels/tolerances.py).

Speed: each lane issues UNROLL independent 8-byte weight loads (4 BF16 or 2 FP32) per step, so a warp streams
1 KiB of a row per step with all loads coalesced; x is small and stays in L1. A matrix with few rows (the
router's 384) would leave the GPU nearly idle with one warp per row (17 us for 3.9 MB on the H200), so
`split_for` gives each row up to BLOCK_WARPS warps that take alternate steps and meet in shared memory; the split
depends only on the weight's shape, so prefill and decode add in the same order. Tokens are processed
TOKENS_WIDE at a time, so a prefill chunk reads each weight row once from DRAM.

Shapes: T tokens, K input features per group, N output rows, G groups (N = G * rows_per_group).
"""
import math

import numpy as np
from numba import cuda

from kernels import bounded_jit, inline_device
from kernels.bf16 import bf16x4_device, f32x2_device, mul_rn_device, round_bf16_device
from kernels.fp8 import (E2M1_MAX, E4M3_MAX, INV6, act_quant_fp8_lane_device, e2m1_round_device, e4m3_round_device,
                         pow2_ceil_device, pow2_inverse_device)
from kernels.pdl import grid_entry_device
from kernels.warp import group_amax_device, warp_tree_sum_device

__all__ = ["gemv", "act_quant_fp8", "act_quant_fp4_pow2", "act_quant_fp4_e4m3", "gemv_t1_kernel", "gemv_t4_kernel",
           "gemv_f32w_t1_kernel", "gemv_f32w_t4_kernel", "gemv_rows_t1_device", "split_for", "launch_geometry",
           "act_quant_fp8_kernel",
           "act_quant_fp4_pow2_kernel", "act_quant_fp4_e4m3_kernel", "SIGNATURES"]

WARP = 32
BLOCK_WARPS = 8              # warps per block: 8 // split rows
SPLIT_WARPS = 4096           # a matrix with fewer rows splits each row's K over up to BLOCK_WARPS warps
UNROLL = 4                   # independent 8-byte weight loads per lane per step
TOKENS_WIDE = 4              # tokens per pass of the batched kernel
THREADS_ACT = 128



@inline_device
def _dot_bf16_device(w, x64, t, j, xw0):
    """Products of weight word j (four BF16) with x[t] at the same K offset (two float32 pairs)."""
    a = x64[t, xw0 + 2 * j]
    b = x64[t, xw0 + 2 * j + 1]
    return (bf16x4_device(w, 0) * f32x2_device(a, 0) + bf16x4_device(w, 1) * f32x2_device(a, 1)
            + bf16x4_device(w, 2) * f32x2_device(b, 0) + bf16x4_device(w, 3) * f32x2_device(b, 1))


@inline_device
def _dot_f32_device(w, x64, t, j, xw0):
    """Products of weight word j (two float32) with x[t] at the same K offset (one float32 pair)."""
    a = x64[t, xw0 + j]
    return f32x2_device(w, 0) * f32x2_device(a, 0) + f32x2_device(w, 1) * f32x2_device(a, 1)


def _make_gemv_rows_device(tt, dot, per_word):
    """A block's rows of a GEMV (blocks of BLOCK_WARPS warps) for `tt` tokens per pass and weight words of
    `per_word` elements combined by `dot`. `split` warps share a row: warp s of the row takes the steps s, s + split,
    ... (a step = UNROLL words per lane), the warps' shuffle-tree sums meet in shared memory and are added in warp
    order. Every thread of the block must call it (its barriers)."""
    @inline_device
    def gemv_rows_device(x64, w64, rows_per_group, split, out_bf16, out):
        red = cuda.shared.array((BLOCK_WARPS, TOKENS_WIDE), np.float32)
        lane = cuda.threadIdx.x % WARP
        wib = cuda.threadIdx.x // WARP                   # warp in block
        row = cuda.blockIdx.x * (BLOCK_WARPS // split) + wib // split
        part = wib % split
        n_rows, nw = w64.shape
        n_tok = x64.shape[0]
        live = row < n_rows                              # warp-uniform; every warp reaches the barriers
        xw0 = (row // rows_per_group) * nw * per_word // 2     # first x word (2 floats) of the row's group
        acc = cuda.local.array(tt, np.float32)
        for t0 in range(0, n_tok, tt):
            for i in range(tt):
                acc[i] = np.float32(0.0)
            j = lane + WARP * UNROLL * part
            while live and j + WARP * (UNROLL - 1) < nw:
                w0 = w64[row, j]
                w1 = w64[row, j + WARP]
                w2 = w64[row, j + 2 * WARP]
                w3 = w64[row, j + 3 * WARP]
                for i in range(tt):
                    if t0 + i < n_tok:
                        acc[i] += (dot(w0, x64, t0 + i, j, xw0) + dot(w1, x64, t0 + i, j + WARP, xw0)
                                   + dot(w2, x64, t0 + i, j + 2 * WARP, xw0)
                                   + dot(w3, x64, t0 + i, j + 3 * WARP, xw0))
                j += WARP * UNROLL * split
            while live and j < nw:                       # a lane's part of the last, partial step, word by word
                w0 = w64[row, j]
                for i in range(tt):
                    if t0 + i < n_tok:
                        acc[i] += dot(w0, x64, t0 + i, j, xw0)
                j += WARP
            for i in range(tt):
                if t0 + i < n_tok:                       # block-uniform: every warp has the same tokens
                    v = warp_tree_sum_device(acc[i])
                    if lane == 0:
                        red[wib, i] = v
            if split > 1:
                cuda.syncthreads()
            if live and part == 0 and lane == 0:
                for i in range(tt):
                    if t0 + i < n_tok:
                        v = red[wib, i]
                        for p in range(1, split):
                            v += red[wib + p, i]
                        out[t0 + i, row] = round_bf16_device(v) if out_bf16 else v
            if split > 1:
                cuda.syncthreads()                       # red is read before the next pass overwrites it
    return gemv_rows_device


def _make_gemv_kernel(rows_device):
    """The GEMV kernel of a block's rows (`_make_gemv_rows_device`). Launch bounds: without them ptxas issued each
    load nearer its use (sm_90 SASS: bench/dev/sass_probe.py's load batches)."""
    @bounded_jit(WARP * BLOCK_WARPS)
    def gemv_kernel(x64, w64, rows_per_group, split, out_bf16, out):
        grid_entry_device()
        rows_device(x64, w64, rows_per_group, split, out_bf16, out)
    return gemv_kernel


def split_for(n_rows, n_words):
    """Warps per row for a weight of n_rows rows of n_words 8-byte words: a power of two up to BLOCK_WARPS that
    keeps at most SPLIT_WARPS warps and gives every warp at least one step (WARP * UNROLL words). Shape-only,
    so prefill and decode of a matrix add in the same order."""
    split = 1
    while split * 2 <= BLOCK_WARPS and n_rows * split * 2 <= SPLIT_WARPS and n_words >= split * 2 * WARP * UNROLL:
        split *= 2
    return split


gemv_rows_t1_device = _make_gemv_rows_device(1, _dot_bf16_device, 4)     # BF16 weights, one token (the router's)
gemv_t1_kernel = _make_gemv_kernel(gemv_rows_t1_device)
gemv_t4_kernel = _make_gemv_kernel(_make_gemv_rows_device(TOKENS_WIDE, _dot_bf16_device, 4))
gemv_f32w_t1_kernel = _make_gemv_kernel(_make_gemv_rows_device(1, _dot_f32_device, 2))
gemv_f32w_t4_kernel = _make_gemv_kernel(_make_gemv_rows_device(TOKENS_WIDE, _dot_f32_device, 2))


# ----------------------------------------------------------------------------------- quantise-dequantise
@cuda.jit(cache=True)
def act_quant_fp8_kernel(x, out):
    """x, out [n] float32, n % 32 == 0; one element per thread, one quantisation block per warp."""
    grid_entry_device()
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    lane = cuda.threadIdx.x % WARP
    n = x.shape[0]
    if i - lane >= n:
        return
    q = act_quant_fp8_lane_device(x[i] if i < n else np.float32(0.0))
    if i < n:
        out[i] = q


@cuda.jit(cache=True)
def act_quant_fp4_pow2_kernel(x, out):
    """x, out [n] float32, n % 32 == 0; scale 2^ceil(log2(amax/6)) per block of 32."""
    grid_entry_device()
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    lane = cuda.threadIdx.x % WARP
    n = x.shape[0]
    if i - lane >= n:
        return
    v = x[i] if i < n else np.float32(0.0)
    amax = max(group_amax_device(v, 32), np.float32(6.0 * 2.0 ** -126))
    s = pow2_ceil_device(mul_rn_device(amax, INV6))             # 2^-126 .. 2^126: its inverse is exact
    y = min(max(v * pow2_inverse_device(s), -E2M1_MAX), E2M1_MAX)
    if i < n:
        out[i] = e2m1_round_device(y) * s


@cuda.jit(cache=True)
def act_quant_fp4_e4m3_kernel(x, out):
    """x, out [n] float32, n % 16 == 0; scale e4m3(amax/6) per block of 16."""
    grid_entry_device()
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    lane = cuda.threadIdx.x % WARP
    n = x.shape[0]
    if i - lane >= n:
        return
    v = x[i] if i < n else np.float32(0.0)
    amax = max(group_amax_device(v, 16), np.float32(6.0 * 2.0 ** -9))
    s = e4m3_round_device(min(amax / np.float32(6.0), E4M3_MAX))
    y = min(max(v / s, -E2M1_MAX), E2M1_MAX)
    if i < n:
        out[i] = e2m1_round_device(y) * s


SIGNATURES = {
    "gemv_t1_kernel": "void(uint64[:, :], uint64[:, ::1], int64, int64, boolean, float32[:, :])",
    "gemv_t4_kernel": "void(uint64[:, :], uint64[:, ::1], int64, int64, boolean, float32[:, :])",
    "gemv_f32w_t1_kernel": "void(uint64[:, :], uint64[:, ::1], int64, int64, boolean, float32[:, :])",
    "gemv_f32w_t4_kernel": "void(uint64[:, :], uint64[:, ::1], int64, int64, boolean, float32[:, :])",
    "act_quant_fp8_kernel": "void(float32[::1], float32[::1])",
    "act_quant_fp4_pow2_kernel": "void(float32[::1], float32[::1])",
    "act_quant_fp4_e4m3_kernel": "void(float32[::1], float32[::1])",
}


# ----------------------------------------------------------------------------------------------- launchers
def gemv(x, w, *, out_bf16=True, rows_per_group=None, out=None, stream=0):
    """x [T, G*K] float32 (C-contiguous), w [N, K] uint16 BF16 bits or float32 (C-contiguous) -> out [T, N]
    float32.

    `out_bf16` rounds the result to BF16 (linear_bf16); False keeps FP32 (linear_f32). `rows_per_group`
    (default N) maps row n to input group n // rows_per_group. BF16 weights move half the bytes: keep every
    BF16-exact weight (BF16 and dequantised FP8 checkpoint tensors) as uint16.
    """
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"gemv: x {x.shape} and w {w.shape} must be 2-D")
    if w.dtype not in (np.uint16, np.float32) or x.dtype != np.float32:
        raise ValueError(f"gemv: w must be uint16 BF16 bits or float32 and x float32, got {w.dtype}, {x.dtype}")
    n_rows, k = w.shape
    rpg = n_rows if rows_per_group is None else int(rows_per_group)
    if k % 4 or rpg <= 0 or n_rows % rpg or x.shape[1] != (n_rows // rpg) * k:
        raise ValueError(f"gemv: x {x.shape} does not fit w {w.shape} with {rpg} rows per group (K % 4 == 0)")
    if out is None:
        out = cuda.device_array((x.shape[0], n_rows), dtype=np.float32, stream=stream)
    elif tuple(out.shape) != (x.shape[0], n_rows):
        raise ValueError(f"gemv: out {out.shape} must be {(x.shape[0], n_rows)}")
    if x.shape[0] == 0 or n_rows == 0:
        return out
    if w.dtype == np.uint16:
        kernel = gemv_t1_kernel if x.shape[0] == 1 else gemv_t4_kernel
    else:
        kernel = gemv_f32w_t1_kernel if x.shape[0] == 1 else gemv_f32w_t4_kernel
    w64 = w.view(np.uint64)
    grid, threads, split = launch_geometry(n_rows, w64.shape[1])
    kernel[grid, threads, stream](x.view(np.uint64), w64, rpg, split, bool(out_bf16), out)
    return out


def launch_geometry(n_rows, n_words):
    """(blocks, threads a block, split) of a GEMV launch over n_rows rows of n_words 8-byte weight words."""
    split = split_for(n_rows, n_words)
    rows_per_block = BLOCK_WARPS // split
    return (n_rows + rows_per_block - 1) // rows_per_block, WARP * BLOCK_WARPS, split


def _act_quant(kernel, block, name, x, out, stream):
    shape = tuple(x.shape)            # the simulator's shapes do not take negative indices
    if x.dtype != np.float32 or not shape or shape[-1] % block:
        raise ValueError(f"{name}: float32 input with a last axis divisible by {block} expected, got "
                         f"{x.dtype} {x.shape}")
    if out is None:
        out = cuda.device_array(shape, dtype=np.float32, stream=stream)
    elif tuple(out.shape) != shape:
        raise ValueError(f"{name}: out {out.shape} must be {shape}")
    n = math.prod(shape)
    if n:
        kernel[(n + THREADS_ACT - 1) // THREADS_ACT, THREADS_ACT, stream](x.reshape(n), out.reshape(n))
    return out


def act_quant_fp8(x, block=32, out=None, stream=0):
    """FP8 E4M3 quantise-dequantise with power-of-two scales per block of 32 (x [..., K], K % 32 == 0)."""
    if block != 32:
        raise ValueError("act_quant_fp8: V4.1 uses block 32")
    return _act_quant(act_quant_fp8_kernel, 32, "act_quant_fp8", x, out, stream)


def act_quant_fp4_pow2(x, block=32, out=None, stream=0):
    """FP4 E2M1 quantise-dequantise with power-of-two scales per block of 32."""
    if block != 32:
        raise ValueError("act_quant_fp4_pow2: V4.1 uses block 32")
    return _act_quant(act_quant_fp4_pow2_kernel, 32, "act_quant_fp4_pow2", x, out, stream)


def act_quant_fp4_e4m3(x, block=16, out=None, stream=0):
    """FP4 E2M1 quantise-dequantise with E4M3 scales per block of 16."""
    if block != 16:
        raise ValueError("act_quant_fp4_e4m3: V4.1 uses block 16")
    return _act_quant(act_quant_fp4_e4m3_kernel, 16, "act_quant_fp4_e4m3", x, out, stream)

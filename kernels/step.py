"""Per-step device inputs of a decode step, so that a captured CUDA graph can be replayed at any position.

Owns:
- `step_inputs`: (position, token) of the step, read from a small host-mapped array written by the host before a
  launch -> the device position [1], the embedding rows [hc_mult] (the token once per stream) and the DEAD flag
  (the image token) [1]. One kernel of one warp.
- `batch_inputs`: the same for a batched decode step of B sessions, one row each: (position, token) [B, 2] ->
  positions [B], embedding rows [B * hc_mult], DEAD flags [B].
- `group_rows`: the compressed rows a call completes, from the device positions: rows[j] = p0 // ratio + j for
  j < G = (p0 + T) // ratio - p0 // ratio, else -1 (kernels.attention.cache_write skips it), and the RoPE position
  of each row gpos[j] = (p0 // ratio + j) * ratio.
- `fill_bits`: deterministic pseudo-random BF16 bit patterns in [-scale/2, scale/2) for a uint16 [R, W] buffer
  (benchmark session states at long contexts).
Does not own: what the host writes into the mapped array (ds4lib.engine.backend_cuda).

Shapes: T tokens of the call, S = hc_mult streams, G_max the row slots of a call (>= G).
"""
import numpy as np
from numba import cuda

from kernels.bf16 import bf16_bits_device
from kernels.pdl import grid_entry_device

__all__ = ["step_inputs", "batch_inputs", "group_rows", "fill_bits", "step_inputs_kernel", "batch_inputs_kernel",
           "group_rows_kernel", "fill_bits_kernel", "SIGNATURES"]

THREADS = 128


@cuda.jit(cache=True)
def step_inputs_kernel(inp, image_token, pos, rep, dead):
    """inp int64 [2] = (position, token) -> pos [1], rep [S] = token, dead [1] = token is the image token."""
    grid_entry_device()
    i = cuda.threadIdx.x
    if i == 0:
        pos[0] = inp[0]
        dead[0] = np.uint8(1) if inp[1] == image_token else np.uint8(0)
    if i < rep.shape[0]:
        rep[i] = inp[1]


@cuda.jit(cache=True)
def batch_inputs_kernel(inp, image_token, pos, rep, dead):
    """inp int64 [B, 2] = (position, token) of each row -> pos [B], rep [B * S] = each row's token S times,
    dead [B]."""
    grid_entry_device()
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    n_rows = inp.shape[0]
    if i >= rep.shape[0]:
        return
    s = rep.shape[0] // n_rows
    b = i // s
    rep[i] = inp[b, 1]
    if i % s == 0:
        pos[b] = inp[b, 0]
        dead[b] = np.uint8(1) if inp[b, 1] == image_token else np.uint8(0)


@cuda.jit(cache=True)
def group_rows_kernel(positions, ratio, rows, gpos):
    """rows[j], gpos[j] of the call's completed groups (module docstring)."""
    grid_entry_device()
    j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if j >= rows.shape[0]:
        return
    p0 = positions[0]
    first = p0 // ratio
    n_groups = (p0 + positions.shape[0]) // ratio - first
    rows[j] = first + j if j < n_groups else -1
    gpos[j] = (first + j) * ratio


@cuda.jit(cache=True)
def fill_bits_kernel(buf, seed, scale):
    """buf[r, c] = BF16 bits of a hash of (seed, r, c) mapped to [-scale/2, scale/2)."""
    grid_entry_device()
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    n_rows, width = buf.shape
    if i >= n_rows * width:
        return
    x = (np.uint64(i) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed)) & np.uint64(0xFFFFFFFFFFFFFFFF)
    x = (x ^ (x >> np.uint64(31))) * np.uint64(0xBF58476D1CE4E5B9) & np.uint64(0xFFFFFFFFFFFFFFFF)
    x = x ^ (x >> np.uint64(29))
    v = (np.float32(x & np.uint64(0xFFFFFF)) / np.float32(16777216.0) - np.float32(0.5)) * scale
    buf[i // width, i % width] = bf16_bits_device(v)


SIGNATURES = {
    "step_inputs_kernel": "void(int64[:], int64, int64[:], int64[:], uint8[:])",
    "batch_inputs_kernel": "void(int64[:, :], int64, int64[:], int64[:], uint8[:])",
    "group_rows_kernel": "void(int64[:], int64, int64[:], int64[:])",
    "fill_bits_kernel": "void(uint16[:, :], uint64, float32)",
}


def step_inputs(inp, image_token, pos, rep, dead, stream=0):
    """inp int64 [2] (device-readable: mapped host memory) -> pos int64 [1], rep int64 [S], dead uint8 [1]."""
    if tuple(inp.shape) != (2,) or tuple(pos.shape) != (1,) or tuple(dead.shape) != (1,) or rep.shape[0] > 32:
        raise ValueError("step_inputs: inp [2], pos [1], dead [1] and rep [<= 32] expected")
    step_inputs_kernel[1, 32, stream](inp, int(image_token), pos, rep, dead)


def batch_inputs(inp, image_token, pos, rep, dead, stream=0):
    """inp int64 [B, 2] (device-readable: mapped host memory) -> pos int64 [B], rep int64 [B * S], dead uint8 [B]."""
    B = inp.shape[0] if len(inp.shape) == 2 else -1
    if len(inp.shape) != 2 or inp.shape[1] != 2 or tuple(pos.shape) != (B,) or tuple(dead.shape) != (B,) \
            or B < 1 or len(rep.shape) != 1 or rep.shape[0] % B or rep.shape[0] < B:
        raise ValueError(f"batch_inputs: inp [B, 2], pos [B], dead [B] and rep [B * S] expected, got inp {inp.shape}, "
                         f"pos {pos.shape}, rep {rep.shape}, dead {dead.shape}")
    n = rep.shape[0]
    batch_inputs_kernel[(n + THREADS - 1) // THREADS, THREADS, stream](inp, int(image_token), pos, rep, dead)


def group_rows(positions, ratio, rows, gpos, stream=0):
    """positions int64 [T] (consecutive) -> rows, gpos int64 [G_max] (module docstring)."""
    if ratio < 1 or tuple(rows.shape) != tuple(gpos.shape) or len(rows.shape) != 1:
        raise ValueError("group_rows: ratio >= 1 and rows, gpos of one shape [G_max] expected")
    n = rows.shape[0]
    if n:
        group_rows_kernel[(n + THREADS - 1) // THREADS, THREADS, stream](positions, int(ratio), rows, gpos)


def fill_bits(buf, seed, scale, stream=0):
    """Fill uint16 [R, W] with pseudo-random BF16 bit patterns (module docstring)."""
    if buf.dtype != np.uint16 or len(buf.shape) != 2:
        raise ValueError("fill_bits: uint16 [R, W] expected")
    n = buf.shape[0] * buf.shape[1]
    if n:
        fill_bits_kernel[(n + THREADS - 1) // THREADS, THREADS, stream](buf, np.uint64(seed), np.float32(scale))

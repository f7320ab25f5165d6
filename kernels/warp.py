"""Warp and block reductions shared by the op kernels: each one adds in a fixed order, so the same inputs give the
same bits on every call.

Owns:
- `warp_sum_device(v, red)`: the sum over the warp's 32 lanes, valid in lane 0. On the GPU it is a shuffle tree
  (offsets 16, 8, 4, 2, 1). The simulator pays two block barriers per shuffle, so there the lanes meet once in `red`
  (the warp's float32 [32] slice of a shared array the kernel allocates) and are added in lane order. The two orders
  differ, so kernels built on it agree with the reference within a tolerance, not bit for bit, across the targets.
- `warp_tree_sum_device(v)`: the shuffle tree on both targets (any numeric type; the simulator's shuffles are
  tests/kernels/cudasim_shim.py's), for sums that must give the same bits there and on the GPU.
- `quad_sum_device(v, red)`, `quad_max_device(v, red)`: ((v0 + v1) + (v2 + v3)) and the max over the four lanes
  4g .. 4g + 3 of each quad, in every lane of it (two butterfly shuffles; the simulator meets in `red`).
- `group_amax_device(v, width)`: max |v| over aligned groups of `width` lanes (16 or 32), in every lane.
- `block_sum_f64_device(v, sh)`: the sum of v over the block, returned to every thread (each warp's tree, then the
  warps' sums by the same tree; sh: float64 [32] shared).
- `block_sum_rows_f64_device(sh, n_rows)`: sh[r, :blockDim.x] summed into sh[r, 0] by a shared-memory tree.
Does not own: scans (kernels.sampling, kernels.indexer, kernels.vq_gemv keep the ones their selections need).
"""
from numba import cuda
from numba.cuda.core import config as _cuda_config

from kernels import inline_device

__all__ = ["warp_sum_device", "warp_tree_sum_device", "quad_sum_device", "quad_max_device", "group_amax_device",
           "block_sum_f64_device", "block_sum_rows_f64_device", "WARP"]

SIM = bool(_cuda_config.ENABLE_CUDASIM)
WARP = 32

if SIM:
    @cuda.jit(device=True)
    def warp_sum_device(v, red):
        """Sum of v over the 32 lanes of the warp (valid in lane 0); the simulator's: one exchange in `red`, added
        in lane order (module docstring)."""
        lane = cuda.threadIdx.x % WARP
        red[lane] = v
        cuda.syncwarp(0xFFFFFFFF)
        s = red[0]
        for j in range(1, WARP):
            s += red[j]
        cuda.syncwarp(0xFFFFFFFF)
        return s

    @cuda.jit(device=True)
    def quad_sum_device(v, red):
        """((v_0 + v_1) + (v_2 + v_3)) over the four lanes 4g..4g+3 of each quad, in every lane of it; `red` is the
        warp's float32 [32] slice of a shared array (the simulator: one exchange in shared memory)."""
        lane = cuda.threadIdx.x % WARP
        red[lane] = v
        cuda.syncwarp(0xFFFFFFFF)
        q = lane - lane % 4
        s = (red[q] + red[q + 1]) + (red[q + 2] + red[q + 3])
        cuda.syncwarp(0xFFFFFFFF)
        return s

    @cuda.jit(device=True)
    def quad_max_device(v, red):
        """max of v over the lanes of each quad (the simulator: shared memory)."""
        lane = cuda.threadIdx.x % WARP
        red[lane] = v
        cuda.syncwarp(0xFFFFFFFF)
        q = lane - lane % 4
        s = max(max(red[q], red[q + 1]), max(red[q + 2], red[q + 3]))
        cuda.syncwarp(0xFFFFFFFF)
        return s
else:
    @inline_device
    def warp_sum_device(v, red):
        """Sum of v over the 32 lanes of the warp (valid in lane 0): warp_tree_sum_device (`red` unused)."""
        return warp_tree_sum_device(v)

    @inline_device
    def quad_sum_device(v, red):
        """((v_0 + v_1) + (v_2 + v_3)) over the lanes of each quad (two butterfly shuffles; `red` unused). Lane 4g
        gets exactly that order; the others the same sums with commuted operands, so the same bits."""
        v += cuda.shfl_xor_sync(0xFFFFFFFF, v, 1)
        v += cuda.shfl_xor_sync(0xFFFFFFFF, v, 2)
        return v

    @inline_device
    def quad_max_device(v, red):
        """max of v over the lanes of each quad (two butterfly shuffles)."""
        v = max(v, cuda.shfl_xor_sync(0xFFFFFFFF, v, 1))
        return max(v, cuda.shfl_xor_sync(0xFFFFFFFF, v, 2))


@inline_device
def warp_tree_sum_device(v):
    """Sum of v over the warp's lanes, valid in lane 0: shuffle tree, fixed order, the same on both targets."""
    off = WARP // 2
    while off > 0:
        v += cuda.shfl_down_sync(0xFFFFFFFF, v, off)
        off //= 2
    return v


@inline_device
def group_amax_device(v, width):
    """max |v| over aligned groups of `width` lanes (16 or 32) of the warp."""
    a = abs(v)
    off = width // 2
    while off > 0:
        a = max(a, cuda.shfl_xor_sync(0xFFFFFFFF, a, off))
        off //= 2
    return a


@inline_device
def block_sum_f64_device(v, sh):
    """Sum of v over the block, returned to every thread (blockDim.x a multiple of 32, every thread calls it).
    sh: float64 [WARP] shared. Each warp sums its lanes, then each warp sums the warps' sums with the same tree,
    so all threads get the same bits without a second barrier."""
    lane = cuda.threadIdx.x % WARP
    v = warp_tree_sum_device(v)
    if lane == 0:
        sh[cuda.threadIdx.x // WARP] = v
    cuda.syncthreads()
    s = sh[lane] if lane < cuda.blockDim.x // WARP else 0.0
    s = warp_tree_sum_device(s)
    return cuda.shfl_sync(0xFFFFFFFF, s, 0)


@inline_device
def block_sum_rows_f64_device(sh, n_rows):
    """Sum sh[r, :blockDim.x] into sh[r, 0] for r < n_rows with a shared-memory tree (blockDim.x a power of
    two). Deterministic: the order depends only on the block size. Every thread of the block must call it;
    it ends with a barrier, so sh[r, 0] is then readable by all threads."""
    tid = cuda.threadIdx.x
    n = cuda.blockDim.x
    cuda.syncthreads()
    s = n // 2
    while s > 0:
        if tid < s:
            for r in range(n_rows):
                sh[r, tid] += sh[r, tid + s]
        cuda.syncthreads()
        s //= 2

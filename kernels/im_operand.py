"""The integer tensor-core path's activation operand, one input at a time (kernels.q4k_gemv's q4k_imma kernels read
it; its staging kernel q4k_im_stage_kernel writes it whole). Per block of 32 inputs: the power of two p with max |x|
/ p in [2^IM_E_TOP, 2^(IM_E_TOP+1)), each input's integer X = round(x / p) as three digit bytes, and the block's (p,
exact sum of its X). Here so that a producer outside kernels.q4k_gemv (the attention's combine, the ffn norm of
kernels.rms_norm, which kernels.q4k_gemv itself imports) can write the operand as it makes its output, and the GEMV
launches no staging.

Owns: `im_stage_shapes` / `check_im_staged` (the operand's arrays), `im_int_device`, `im_scale_device`,
`im_bytes4_device` (the staging's arithmetic, the same operations wherever it runs) and `im_stage_lane_device` (one
warp's aligned block of 32, one input a lane).
Does not own: the staging kernel and its launcher (kernels.q4k_gemv: q4k_im_stage_kernel, im_stage), the rounding
step (kernels.fp8.rint_step_device), the warp reductions (kernels.warp).
"""
import numpy as np
from numba import cuda

from kernels import inline_device
from kernels.bf16 import bits_f32, f32_bits
from kernels.fp8 import rint_step_device
from kernels.scratch import check_arrays
from kernels.warp import group_amax_device, warp_tree_sum_device

__all__ = ["im_stage_shapes", "check_im_staged", "im_int_device", "im_scale_device", "im_bytes4_device",
           "im_stage_lane_device", "IM_E_TOP", "FLT_MAX"]

WARP = 32
IM_E_TOP = 21                  # a block of 32 is scaled so that its largest |x| / p lies in [2^21, 2^22)
INT_MAGIC = np.float32(12582912.0)                # 1.5 * 2^23: rint_step_device's magic for a step of 1
FLT_MAX = np.float32(3.4028234663852886e38)


def im_stage_shapes(n_tok, kx):
    """(shape, dtype) of the integer path's staged digits and of its (p, sum) pairs for n_tok rows of kx inputs."""
    return ((n_tok * kx,), np.uint32), ((n_tok * kx // 16,), np.float32)


def check_im_staged(staged, n_tok, kx, name):
    """Refuses (with a ValueError naming `name`) a (digits, pairs) pair that is not of im_stage_shapes(n_tok, kx)."""
    check_arrays(staged, im_stage_shapes(n_tok, kx), name, f"staged for {n_tok} rows of {kx} inputs")


@inline_device
def im_int_device(v, inv):
    """round(v * inv) as int32 (v * inv exact: inv a power of two; |v * inv| < 2^22, ties to even); 0 if not finite."""
    s = v * inv
    if not abs(s) <= FLT_MAX:
        return np.int32(0)
    return np.int32(rint_step_device(s, INT_MAGIC))


@inline_device
def im_scale_device(am):
    """(p, 1 / p) of a block whose largest |x| is am: max |x| / p in [2^IM_E_TOP, 2^(IM_E_TOP+1)), p = 1 for am = 0,
    2^-126 <= p <= 2^126."""
    e = np.int32(f32_bits(am) >> np.uint32(23)) - 127 - IM_E_TOP
    e = min(max(e, -126), 126) if am != np.float32(0.0) else 0
    return bits_f32(np.uint32(e + 127) << np.uint32(23)), bits_f32(np.uint32(127 - e) << np.uint32(23))


@inline_device
def im_stage_lane_device(v, blk, lane, live, xd, ps):
    """q4k_im_stage_kernel's output (raw = False) for one input, from a producer whose warp holds an aligned block of
    32 FP32 activations, one a lane: v, input `lane` of block `blk` of the flat [T * kx] activations (`live`: a real
    input, else v is 0 and nothing is written). The block's max |v| and its non-finite flag by warp reductions, p and
    X = round(v / p) as the staging kernel forms them (im_scale_device, im_int_device); the block's X summed over
    the warp (an exact integer: the same value in any order); lanes 4i gather the X of lanes 4i .. 4i + 3 and write
    their d0, d1, d2 bytes and a zero word into job 4 blk + i // 2's eight words (its inputs 0-3 from lane 8j, 4-7
    from lane 8j + 4); lane 0 writes (p, sum), p NaN when the block holds a NaN or an infinity. The same bits as the
    staging kernel for finite blocks (tests/kernels/test_attention.py); in a non-finite block the digits may differ
    (the max of a NaN is taken in another order) but p is NaN either way, so are its rows' outputs. Every lane of the
    warp calls it (shuffles)."""
    fin = abs(v) <= FLT_MAX
    bad = group_amax_device(np.float32(0.0) if fin else np.float32(1.0), WARP) > np.float32(0.0)
    p, inv = im_scale_device(group_amax_device(v if fin else np.float32(0.0), WARP))
    x = im_int_device(v, inv)
    sm = warp_tree_sum_device(x)                             # lane 0's: exact, as the quads' sum
    x1 = cuda.shfl_down_sync(0xFFFFFFFF, x, 1)
    x2 = cuda.shfl_down_sync(0xFFFFFFFF, x, 2)
    x3 = cuda.shfl_down_sync(0xFFFFFFFF, x, 3)
    if live and lane % 4 == 0:
        o = np.uint64(32 * blk + 8 * (lane // 8) + (lane % 8) // 4)
        xd[o] = im_bytes4_device(x, x1, x2, x3, 0)
        xd[o + np.uint64(2)] = im_bytes4_device(x, x1, x2, x3, 8)
        xd[o + np.uint64(4)] = im_bytes4_device(x, x1, x2, x3, 16)
        xd[o + np.uint64(6)] = np.uint32(0)
    if live and lane == 0:
        ps[np.uint64(2 * blk)] = np.float32(np.nan) if bad else p
        ps[np.uint64(2 * blk + 1)] = np.float32(sm)


@inline_device
def im_bytes4_device(a, b, c, d, shift):
    """Byte (x >> shift) & 255 of four int32 values packed low first (two's complement: a signed digit's byte)."""
    m = np.int32(255)
    return (np.uint32((a >> shift) & m) | (np.uint32((b >> shift) & m) << np.uint32(8))
            | (np.uint32((c >> shift) & m) << np.uint32(16)) | (np.uint32((d >> shift) & m) << np.uint32(24)))

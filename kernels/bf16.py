"""Device helpers for BF16 values held in float32 (bit-exact with ds4lib.formats.floats.round_bf16)."""
import numpy as np
from numba import cuda

__all__ = ["round_bf16_device", "f32_bits", "bits_f32"]


@cuda.jit(device=True, inline=True)
def f32_bits(x):
    """float32 -> its uint32 bit pattern."""
    a = cuda.local.array(1, np.float32)
    a[0] = x
    return a.view(np.uint32)[0]


@cuda.jit(device=True, inline=True)
def bits_f32(u):
    """uint32 bit pattern -> float32."""
    a = cuda.local.array(1, np.uint32)
    a[0] = u
    return a.view(np.float32)[0]


@cuda.jit(device=True, inline=True)
def round_bf16_device(x):
    """Round a float32 to the nearest BF16 (ties to even), returned as float32. NaN stays NaN."""
    u = f32_bits(np.float32(x))
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.float32(x)
    lsb = (u >> np.uint32(16)) & np.uint32(1)
    r = ((u + np.uint32(0x7FFF) + lsb) >> np.uint32(16)) << np.uint32(16)
    return bits_f32(r)

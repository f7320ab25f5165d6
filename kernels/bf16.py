"""Device helpers for BF16 values held in float32 (bit-exact with ds4lib.formats.floats.round_bf16).

Also: BF16 weights and caches are stored as uint16 bit patterns and loaded 4 at a time as one uint64
word (`bf16x4_device`); `mul_rn_device` is an FP32 multiply that the compiler may not fuse into an FMA.
NVVM contracts `a*b + c` into `fma.rn.f32` by default (even with fastmath off, and even through an f64
detour), which changes the rounding of every elementwise op that the reference evaluates as a rounded
product followed by an add (RoPE, hc_post, gated adds). `libdevice.fmul_rn` emits `mul.rn.f32`, which is
never fused; the simulator has no libdevice (its stubs return None), so there the plain product is used.
`exp_f32_device` / `log1p_f32_device` are CUDA's expf / log1pf on the GPU; in the simulator they are
NumPy's float32 functions (Python's math raises OverflowError where IEEE returns inf).
`f16_bits_device` decodes an IEEE half bit pattern to float32 from the bits (exact, subnormals included), so
f16 gains and scales read from uint16 arrays need no float16 type on either target.
"""
import math

import numpy as np
from numba import cuda
from numba.cuda import libdevice
from numba.cuda.core import config as _cuda_config

from kernels import inline_device

__all__ = ["round_bf16_device", "f32_bits", "bits_f32", "mul_rn_device", "bf16x4_device", "f32x2_device",
           "bf16_bits_device", "exp_f32_device", "log1p_f32_device", "f16_bits_device"]


if _cuda_config.ENABLE_CUDASIM:
    # The local-array bit casts below cost ~10 us per call in the simulator; a NumPy scalar view is the same
    # operation (the value is truncated to 32 bits, as the store into a uint32 local does on the GPU).
    @cuda.jit(device=True)
    def f32_bits(x):
        """float32 -> its uint32 bit pattern."""
        return np.float32(x).view(np.uint32)

    @cuda.jit(device=True)
    def bits_f32(u):
        """uint32 bit pattern -> float32."""
        return np.uint32(int(u) & 0xFFFFFFFF).view(np.float32)
else:
    @inline_device
    def f32_bits(x):
        """float32 -> its uint32 bit pattern."""
        a = cuda.local.array(1, np.float32)
        a[0] = x
        return a.view(np.uint32)[0]

    @inline_device
    def bits_f32(u):
        """uint32 bit pattern -> float32."""
        a = cuda.local.array(1, np.uint32)
        a[0] = u
        return a.view(np.float32)[0]


@inline_device
def round_bf16_device(x):
    """Round a float32 to the nearest BF16 (ties to even), returned as float32. NaN stays NaN."""
    u = f32_bits(np.float32(x))
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.float32(x)
    lsb = (u >> np.uint32(16)) & np.uint32(1)
    r = ((u + np.uint32(0x7FFF) + lsb) >> np.uint32(16)) << np.uint32(16)
    return bits_f32(r)


@inline_device
def bf16_bits_device(x):
    """float32 -> uint16 BF16 bit pattern (round to nearest even), as ds4lib.formats.floats.f32_to_bf16_bits
    for finite values."""
    return np.uint16(f32_bits(round_bf16_device(x)) >> np.uint32(16))


@inline_device
def bf16x4_device(w, i):
    """Element i (0..3, element 0 in the low bits) of a uint64 word holding four BF16 bit patterns."""
    b = np.uint32((w >> np.uint64(16 * i)) & np.uint64(0xFFFF))
    return bits_f32(b << np.uint32(16))


@inline_device
def f32x2_device(w, i):
    """Element i (0 or 1, element 0 in the low bits) of a uint64 word holding two float32 values."""
    return bits_f32(np.uint32((w >> np.uint64(32 * i)) & np.uint64(0xFFFFFFFF)))


if _cuda_config.ENABLE_CUDASIM:
    @cuda.jit(device=True)
    def mul_rn_device(a, b):
        """a * b in FP32, rounded on its own (never fused into an FMA)."""
        return np.float32(np.float32(a) * np.float32(b))
else:
    @inline_device
    def mul_rn_device(a, b):
        """a * b in FP32, rounded on its own (never fused into an FMA)."""
        return libdevice.fmul_rn(np.float32(a), np.float32(b))


if _cuda_config.ENABLE_CUDASIM:
    @cuda.jit(device=True)
    def exp_f32_device(x):
        """exp in FP32 (inf on overflow, as IEEE)."""
        with np.errstate(over="ignore"):
            return np.float32(np.exp(np.float32(x)))

    @cuda.jit(device=True)
    def log1p_f32_device(x):
        """log1p in FP32."""
        return np.float32(np.log1p(np.float32(x)))
else:
    @inline_device
    def exp_f32_device(x):
        """exp in FP32 (inf on overflow, as IEEE)."""
        return np.float32(math.exp(np.float32(x)))

    @inline_device
    def log1p_f32_device(x):
        """log1p in FP32."""
        return np.float32(math.log1p(np.float32(x)))


@inline_device
def f16_bits_device(h):
    """IEEE half bit pattern (low 16 bits of h) -> float32, exact (as ds4lib.formats.floats.f16_bits_to_f32)."""
    u = np.uint32(h) & np.uint32(0xFFFF)
    sign = (u & np.uint32(0x8000)) << np.uint32(16)
    e = (u >> np.uint32(10)) & np.uint32(0x1F)
    m = u & np.uint32(0x3FF)
    if e == np.uint32(0x1F):                                       # inf / NaN
        return bits_f32(sign | np.uint32(0x7F800000) | (m << np.uint32(13)))
    if e == np.uint32(0):                                          # zero / subnormal: m * 2^-24, exact
        v = np.float32(m) * np.float32(2.0 ** -24)
        return -v if sign else v
    return bits_f32(sign | ((e + np.uint32(112)) << np.uint32(23)) | (m << np.uint32(13)))

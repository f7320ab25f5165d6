"""Deterministic pseudo-random contents for synthetic device weights, written on the device directly.

Owns the fill kernels behind ds4lib.engine.cuda_synth (real-size speed measurements without a checkpoint: the
110 GB of V4.1 weights never exist on the host). Every value is a function of (key, element index) only, with
key = `synth_key(seed, tensor)`, so any tensor can be made alone, in any order, on any grid. Not a model op: there
is no reference in ds4lib.ref; tests/engine/test_cuda_synth.py decodes the results with ds4lib.formats.

Formats (`fmt` of `synth_fill`; `sigma` the target standard deviation of the decoded values):
- 'bits'  uniform random bytes, written as uint32 words (VQ index streams and planes);
- 'e4m3'  E4M3 codes, four to a uint32 word, with the exponent's top bit clear: |v| < 2, never the NaN codes
          0x7F / 0xFF (VQ codebooks; RMS of the decoded codes: `E4M3_SMALL_RMS`);
- 'q4_K'  uint8 blocks of 144 bytes (ds4lib.formats.q4k): f16 d, dmin = 8 d, 6-bit scales sc in 8..15 and mins
          m = round(15 sc / 16) (so 7.5 sc - 8 m ~ 0: rows centred), random 4-bit codes;
- 'q8_0'  uint8 blocks of 34 bytes: f16 d, 32 random int8 codes;
- 'f32'   float32 uniform with mean `center` and standard deviation `sigma`;
- 'bf16'  the same as uint16 BF16 bit patterns;
- 'f16'   uint16 f16 bit patterns, positive, in [2^e, 2^(e+1)) with 1.5 * 2^e ~ `center` (VQ row gains).

Shapes: N elements of the flat output (< 2^32), NB blocks.
"""
import math

import numpy as np
from numba import cuda
from numba.cuda.core import config as _cuda_config

from ds4lib.formats.fp8 import E4M3_VALUES
from ds4lib.formats.q4k import Q4K_BLOCK_BYTES, Q8_0_BLOCK_BYTES, QK8_0, QK_K
from kernels import inline_device
from kernels.bf16 import bf16_bits_device
from kernels.pdl import grid_entry_device

__all__ = ["synth_fill", "synth_key", "FORMATS", "E4M3_SMALL_MASK", "E4M3_SMALL_RMS", "SIGNATURES",
           "fill_bits_kernel", "fill_q4k_kernel", "fill_q8_0_kernel", "fill_f32_kernel", "fill_bf16_kernel",
           "fill_f16_kernel"]

THREADS = 256
MAX_BLOCKS = 8192                   # grid-stride beyond this: one launch fills any size
if _cuda_config.ENABLE_CUDASIM:     # a Python thread per CUDA thread (~1 ms each): few threads, long loops
    THREADS, MAX_BLOCKS = 32, 1
M32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B1                 # odd: i -> i * GOLDEN mod 2^32 is a bijection
SCALE_SALT = 0x5BD1E995             # separates the q4_K sub-block scales from the codes of the same key
Q4K_WORDS = Q4K_BLOCK_BYTES // 4    # 36: word 0 d|dmin, words 1-3 scales and mins, words 4-35 codes
E4M3_SMALL_MASK = 0xBFBFBFBF
E4M3_SMALL_RMS = float(np.sqrt(np.mean(E4M3_VALUES[np.arange(256) & 0xBF].astype(np.float64) ** 2)))
Q4K_SC_RMS = float(np.sqrt(np.mean(np.arange(8, 16) ** 2)))
UNIFORM4_STD = float(np.sqrt((16 ** 2 - 1) / 12))        # 4-bit codes 0..15
INT8_STD = float(np.sqrt((256 ** 2 - 1) / 12))           # int8 codes -128..127
FORMATS = ("bits", "e4m3", "q4_K", "q8_0", "f32", "bf16", "f16")


def _mix32(x: int) -> int:
    """murmur3's 32-bit finaliser (host side, for keys)."""
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & M32
    return x ^ (x >> 16)


def synth_key(seed: int, tensor: int) -> int:
    """The 32-bit key of tensor number `tensor` of a synthetic model with `seed`."""
    return _mix32(_mix32((int(seed) * GOLDEN + 0x632BE5AB) & M32) ^ (int(tensor) & M32))


@inline_device
def _mix32_device(x):
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(0x85EBCA6B)) & np.uint64(M32)
    x = x ^ (x >> np.uint64(13))
    x = (x * np.uint64(0xC2B2AE35)) & np.uint64(M32)
    return x ^ (x >> np.uint64(16))


@inline_device
def _hash_device(key, i):
    """32 random bits (in a uint64) of element i < 2^32 under `key`."""
    return _mix32_device(((np.uint64(i) * np.uint64(GOLDEN)) & np.uint64(M32)) ^ np.uint64(key))


@inline_device
def _uniform_device(key, i, center, sigma):
    """center + sigma * (a uniform variable of unit variance)."""
    u = np.float32(_hash_device(key, i) >> np.uint64(8)) * np.float32(1.0 / 16777216.0) - np.float32(0.5)
    return np.float32(center) + u * (np.float32(sigma) * np.float32(3.4641016))          # sqrt(12)


@cuda.jit(cache=True)
def fill_bits_kernel(out, key, mask):
    """out[i] = hash(key, i) & mask."""
    grid_entry_device()
    for i in range(cuda.grid(1), out.shape[0], cuda.gridsize(1)):
        out[i] = np.uint32(_hash_device(key, i) & np.uint64(mask))


@inline_device
def _q4k_scale_device(key, blk, j):
    return np.uint64(8) + (_hash_device(key ^ np.uint64(SCALE_SALT), blk * 8 + j) & np.uint64(7))


@inline_device
def _q4k_min_device(sc):
    return (np.uint64(15) * sc + np.uint64(8)) >> np.uint64(4)


@cuda.jit(cache=True)
def fill_q4k_kernel(out, key, d_dmin):
    """out uint32 [NB * 36]: q4_K blocks (module docstring); d_dmin = d bits | dmin bits << 16."""
    grid_entry_device()
    for i in range(cuda.grid(1), out.shape[0], cuda.gridsize(1)):
        blk = i // Q4K_WORDS
        w = i - blk * Q4K_WORDS
        if w == 0:
            out[i] = np.uint32(d_dmin)
        elif w < 4:
            v = np.uint64(0)
            for j in range(4):
                if w == 1:                                   # bytes 0-3: sc[0..3] (all < 16: no high bits)
                    b = _q4k_scale_device(key, blk, j)
                elif w == 2:                                 # bytes 4-7: m[0..3]
                    b = _q4k_min_device(_q4k_scale_device(key, blk, j))
                else:                                        # bytes 8-11: sc[4+j] | m[4+j] << 4
                    sc = _q4k_scale_device(key, blk, 4 + j)
                    b = sc | (_q4k_min_device(sc) << np.uint64(4))
                v |= b << np.uint64(8 * j)
            out[i] = np.uint32(v)
        else:
            out[i] = np.uint32(_hash_device(key, i))


@cuda.jit(cache=True)
def fill_q8_0_kernel(out, key, d_bits):
    """out uint8 [NB * 34]: Q8_0 blocks, f16 d = d_bits, random int8 codes."""
    grid_entry_device()
    for i in range(cuda.grid(1), out.shape[0], cuda.gridsize(1)):
        o = i % Q8_0_BLOCK_BYTES
        if o == 0:
            out[i] = np.uint8(d_bits & 0xFF)
        elif o == 1:
            out[i] = np.uint8(d_bits >> 8)
        else:
            out[i] = np.uint8(_hash_device(key, i) & np.uint64(0xFF))


@cuda.jit(cache=True)
def fill_f32_kernel(out, key, center, sigma):
    grid_entry_device()
    for i in range(cuda.grid(1), out.shape[0], cuda.gridsize(1)):
        out[i] = _uniform_device(key, i, center, sigma)


@cuda.jit(cache=True)
def fill_bf16_kernel(out, key, center, sigma):
    grid_entry_device()
    for i in range(cuda.grid(1), out.shape[0], cuda.gridsize(1)):
        out[i] = bf16_bits_device(_uniform_device(key, i, center, sigma))


@cuda.jit(cache=True)
def fill_f16_kernel(out, key, exp_bits):
    """Positive f16 values: exponent bits fixed, random mantissa."""
    grid_entry_device()
    for i in range(cuda.grid(1), out.shape[0], cuda.gridsize(1)):
        out[i] = np.uint16(np.uint64(exp_bits) | (_hash_device(key, i) & np.uint64(0x3FF)))


SIGNATURES = {
    "fill_bits_kernel": "void(uint32[:], uint64, uint64)",
    "fill_q4k_kernel": "void(uint32[:], uint64, uint64)",
    "fill_q8_0_kernel": "void(uint8[:], uint64, int64)",
    "fill_f32_kernel": "void(float32[:], uint64, float32, float32)",
    "fill_bf16_kernel": "void(uint16[:], uint64, float32, float32)",
    "fill_f16_kernel": "void(uint16[:], uint64, int64)",
}


def _f16_bits(x: float) -> int:
    b = int(np.array(x, np.float16).view(np.uint16))
    if not (np.isfinite(np.float16(x)) and b & 0x7C00):
        raise ValueError(f"synth_fill: {x} is not a normal f16")
    return b


def synth_fill(out, fmt, *, key, center=0.0, sigma=1.0, k=None, stream=0):
    """Fill the C-contiguous device array `out` in format `fmt` (module docstring) under `key` (`synth_key`).
    q4_K / Q8_0 take `k` (the row length: whole blocks per row); their values have mean ~0 and deviation
    `sigma`. Returns `out`."""
    if fmt not in FORMATS:
        raise ValueError(f"synth_fill: format {fmt!r} is not one of {FORMATS}")
    want = {"bits": np.uint8, "e4m3": np.uint8, "q4_K": np.uint8, "q8_0": np.uint8, "f32": np.float32,
            "bf16": np.uint16, "f16": np.uint16}[fmt]
    if out.dtype != want or not out.is_c_contiguous():
        raise ValueError(f"synth_fill: {fmt} fills a C-contiguous {np.dtype(want)} array, got {out.dtype}")
    flat = out.reshape(out.size)
    n = flat.shape[0]
    if fmt == "q4_K" and (k is None or k % QK_K or n % Q4K_BLOCK_BYTES):
        raise ValueError(f"synth_fill: q4_K needs k % {QK_K} == 0 and whole {Q4K_BLOCK_BYTES}-byte blocks")
    if fmt in ("bits", "e4m3", "q4_K"):
        if n % 4:
            raise ValueError(f"synth_fill: {fmt} writes uint32 words; {n} bytes is not a multiple of 4")
        flat = flat.view(np.uint32)
        n = flat.shape[0]
    if fmt == "q8_0" and (k is None or k % QK8_0 or n % Q8_0_BLOCK_BYTES):
        raise ValueError(f"synth_fill: Q8_0 needs k % {QK8_0} == 0 and whole {Q8_0_BLOCK_BYTES}-byte blocks")
    if n >= 1 << 32:
        raise ValueError(f"synth_fill: {n} elements; the hash indexes fewer than 2^32")
    if n == 0:
        return out
    grid = (min(math.ceil(n / THREADS), MAX_BLOCKS), THREADS, stream)
    key = np.uint64(int(key) & M32)
    if fmt in ("bits", "e4m3"):
        fill_bits_kernel[grid](flat, key, np.uint64(M32 if fmt == "bits" else E4M3_SMALL_MASK))
    elif fmt == "q4_K":
        d = _f16_bits(sigma / (Q4K_SC_RMS * UNIFORM4_STD))
        dmin = _f16_bits(8 * float(np.array(d, np.uint16).view(np.float16)))
        fill_q4k_kernel[grid](flat, key, np.uint64(d | dmin << 16))
    elif fmt == "q8_0":
        fill_q8_0_kernel[grid](flat, key, _f16_bits(sigma / INT8_STD))
    elif fmt == "f32":
        fill_f32_kernel[grid](flat, key, np.float32(center), np.float32(sigma))
    elif fmt == "bf16":
        fill_bf16_kernel[grid](flat, key, np.float32(center), np.float32(sigma))
    else:
        e = round(math.log2(center / 1.5)) if center > 0 else -99
        if not -14 <= e <= 15:
            raise ValueError(f"synth_fill: f16 centre {center} out of the normal range")
        fill_f16_kernel[grid](flat, key, (e + 15) << 10)
    return out

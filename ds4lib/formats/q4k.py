"""q4_K (GGML's 4.5-bit k-quant) quantisation and dequantisation in NumPy, and the fallback for rows whose
length is not a multiple of 256.

Owns: `quantize_q4k` (our own quantizer: a vectorised port of llama.cpp's `quantize_row_q4_K_ref` with its
`make_qkx2_quants` scale/min search), `dequantize_q4k` (bit-exact with `gguf.quants.dequantize(..., Q4_K)`:
same float32 operations in the same order), `linear_type` (which GGML type a linear of a given row
length gets) and the Q8_0 / F16 fallbacks through the gguf package.

Shape legend: R rows, K row length (input features), NB = K/256 super-blocks per row, G quant block.

q4_K block of 256 weights, 144 bytes: d (f16), dmin (f16), 12 bytes of eight 6-bit scales and eight
6-bit mins, 128 bytes of 4-bit codes q. Sub-block s (32 weights) decodes as
    w = (d * sc[s]) * q - (dmin * m[s])                        (float32)
and bytes 32c..32c+31 of the codes hold sub-block 2c in the low nibble and 2c+1 in the high nibble.

Fallback (decided in `linear_type`): a row length that is not a multiple of 256 gets **Q8_0** (blocks of 32,
one f16 scale + 32 int8, 8.5 bits/weight) and, if not even a multiple of 32, F16. Why Q8_0: every row length
a valid V4.1 config allows is a multiple of 32 (ModelConfig checks dim, ranks, head and FFN widths), gguf
implements Q8_0 both ways so it is bit-exact by construction, and it is strictly more precise than q4_K,
so a fallback tensor never adds error that the q4_K plan would not have. The released V4.1 shapes need no
fallback at all; only scaled-down test models (rows of 128 or 192) use it, at a small size cost.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf import quants as _gq

__all__ = ["QK_K", "Q4K_BLOCK_BYTES", "QK8_0", "Q8_0_BLOCK_BYTES", "quantize_q4k", "dequantize_q4k",
           "quantize_q8_0", "dequantize_q8_0", "linear_type", "LINEAR_TYPES", "type_bytes"]

QK_K = 256
Q4K_BLOCK_BYTES = 144
QK8_0 = 32
Q8_0_BLOCK_BYTES = 34
LINEAR_TYPES = ("q4_K", "q8_0", "f16")
_CHUNK_BLOCKS = 1 << 14        # super-blocks per vectorised step (4 M weights, ~100 MB of temporaries)


def linear_type(row_length: int) -> str:
    """GGML type of a quantised linear with this row length: q4_K, else Q8_0, else F16 (module docstring)."""
    if row_length % QK_K == 0:
        return "q4_K"
    if row_length % QK8_0 == 0:
        return "q8_0"
    return "f16"


def type_bytes(kind: str, rows: int, row_length: int) -> int:
    """Stored bytes of a [rows, row_length] tensor in one of LINEAR_TYPES."""
    if kind == "q4_K":
        return rows * (row_length // QK_K) * Q4K_BLOCK_BYTES
    if kind == "q8_0":
        return rows * (row_length // QK8_0) * Q8_0_BLOCK_BYTES
    if kind == "f16":
        return rows * row_length * 2
    raise ValueError(f"unknown linear type {kind!r}")


def _nearest_int(x):
    return np.rint(x).astype(np.int32)          # llama.cpp's nearest_int: round half to even


def _make_qkx2(x, w, nmax=15, rmin=-1.0, rdelta=0.1, nstep=20):
    """Vectorised make_qkx2_quants over sub-blocks x [S, 32] with weights w [S, 32] (float32).
    Returns (scale [S], the_min [S] >= 0, L [S, 32] uint8)."""
    f32 = np.float32
    mn = np.minimum(x.min(axis=1), f32(0))
    mx = x.max(axis=1)
    sum_w = w.sum(axis=1, dtype=f32)
    sum_x = (w * x).sum(axis=1, dtype=f32)
    flat = mx == mn
    rng = np.where(flat, f32(1), mx - mn).astype(f32)
    iscale = (f32(nmax) / rng).astype(f32)
    scale = (f32(1) / iscale).astype(f32)
    xm = x - mn[:, None]
    L = np.clip(_nearest_int(iscale[:, None] * xm), 0, nmax)
    diff = scale[:, None] * L.astype(f32) + mn[:, None] - x
    best = (w * diff * diff).sum(axis=1, dtype=f32)
    best_scale, best_min = scale.copy(), mn.copy()
    with np.errstate(divide="ignore", invalid="ignore"):
        for step in range(nstep + 1):
            isc = (f32(rmin + rdelta * step + nmax) / rng).astype(f32)
            la = np.clip(_nearest_int(isc[:, None] * xm), 0, nmax)
            lf = la.astype(f32)
            sum_l = (w * lf).sum(axis=1, dtype=f32)
            sum_l2 = (w * lf * lf).sum(axis=1, dtype=f32)
            sum_xl = (w * lf * x).sum(axis=1, dtype=f32)
            D = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            pos = this_min > 0
            this_min = np.where(pos, f32(0), this_min)
            this_scale = np.where(pos, sum_xl / sum_l2, this_scale)
            d2 = this_scale[:, None] * lf + this_min[:, None] - x
            mad = (w * d2 * d2).sum(axis=1, dtype=f32)
            better = (D > 0) & (mad < best) & ~flat
            L = np.where(better[:, None], la, L)
            best = np.where(better, mad, best)
            best_scale = np.where(better, this_scale, best_scale)
            best_min = np.where(better, this_min, best_min)
    best_scale = np.where(flat, f32(0), best_scale).astype(f32)
    L = np.where(flat[:, None], 0, L)
    return best_scale, (-best_min).astype(f32), L.astype(np.uint8)


def _pack_scales(ls, lm):
    """6-bit scales/mins [NB, 8] -> 12 bytes per super-block (GGML's get_scale_min_k4 layout)."""
    out = np.zeros((ls.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    out[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    return out


def _unpack_scales(sc12):
    d, m, md = sc12[:, 0:4], sc12[:, 4:8], sc12[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc, mn


def _quantize_blocks(x):
    """x [NB, 256] float32 -> uint8 [NB, 144]."""
    f32 = np.float32
    nb = x.shape[0]
    sub = x.reshape(nb * 8, 32)
    av_x = np.sqrt((sub * sub).sum(axis=1, dtype=f32) / f32(32)).astype(f32)
    weights = av_x[:, None] + np.abs(sub)
    scales, mins, _ = _make_qkx2(sub, weights)
    scales, mins = scales.reshape(nb, 8), mins.reshape(nb, 8)
    max_scale, max_min = scales.max(axis=1), mins.max(axis=1)
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, f32(63) / max_scale, f32(0)).astype(f32)
        inv_min = np.where(max_min > 0, f32(63) / max_min, f32(0)).astype(f32)
    ls = np.minimum(63, _nearest_int(inv_scale[:, None] * scales)).astype(np.uint8)
    lm = np.minimum(63, _nearest_int(inv_min[:, None] * mins)).astype(np.uint8)
    d16 = (max_scale / f32(63)).astype(np.float16)
    dmin16 = (max_min / f32(63)).astype(np.float16)
    # A super-block whose scale underflows f16 (|w| below ~1e-5, a limit of the format) would decode to the
    # bare mins (-dmin*m), worse than zero: store it as exact zeros instead.
    dead = d16 == 0
    dmin16 = np.where(dead, np.float16(0), dmin16)
    lm = np.where(dead[:, None], 0, lm).astype(np.uint8)
    dq = d16.astype(f32)[:, None] * ls.astype(f32)                  # [NB, 8]
    dm = dmin16.astype(f32)[:, None] * lm.astype(f32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = _nearest_int((x.reshape(nb, 8, 32) + dm[..., None]) / dq[..., None])
    q = np.where(dq[..., None] == 0, 0, np.clip(q, 0, 15)).astype(np.uint8)      # [NB, 8, 32]
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(nb, 128)          # sub-blocks (2c, 2c+1) share 32 bytes
    out = np.empty((nb, Q4K_BLOCK_BYTES), dtype=np.uint8)
    out[:, 0:2] = d16.reshape(nb, 1).view(np.uint8)
    out[:, 2:4] = dmin16.reshape(nb, 1).view(np.uint8)
    out[:, 4:16] = _pack_scales(ls, lm)
    out[:, 16:] = qs
    return out


def quantize_q4k(w) -> np.ndarray:
    """float weight [R, K] (K a multiple of 256) -> q4_K bytes uint8 [R, K/256*144]."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % QK_K:
        raise ValueError(f"quantize_q4k: shape {w.shape}: rows must be a multiple of {QK_K} long")
    if not np.isfinite(w).all():
        raise ValueError("quantize_q4k: non-finite weight")
    rows, k = w.shape
    blocks = w.reshape(-1, QK_K)
    out = np.empty((blocks.shape[0], Q4K_BLOCK_BYTES), dtype=np.uint8)
    for s in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        out[s:s + _CHUNK_BLOCKS] = _quantize_blocks(blocks[s:s + _CHUNK_BLOCKS])
    return out.reshape(rows, (k // QK_K) * Q4K_BLOCK_BYTES)


def dequantize_q4k(data) -> np.ndarray:
    """q4_K bytes [..., NB*144] -> float32 [..., NB*256], bit-exact with gguf's dequantizer."""
    raw = np.asarray(data).view(np.uint8)
    if raw.shape[-1] % Q4K_BLOCK_BYTES:
        raise ValueError(f"dequantize_q4k: last dimension {raw.shape[-1]} is not a multiple of {Q4K_BLOCK_BYTES}")
    lead = raw.shape[:-1]
    blk = raw.reshape(-1, Q4K_BLOCK_BYTES)
    nb = blk.shape[0]
    d = np.ascontiguousarray(blk[:, 0:2]).view(np.float16).astype(np.float32)           # [NB, 1]
    dmin = np.ascontiguousarray(blk[:, 2:4]).view(np.float16).astype(np.float32)
    sc, mn = _unpack_scales(blk[:, 4:16])
    dd = (d * sc.astype(np.float32)).reshape(nb, 8, 1)
    dm = (dmin * mn.astype(np.float32)).reshape(nb, 8, 1)
    qs = blk[:, 16:].reshape(nb, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & np.uint8(0x0F)).reshape(nb, 8, 32).astype(np.float32)
    return (dd * q - dm).reshape(*lead, (raw.shape[-1] // Q4K_BLOCK_BYTES) * QK_K)


def quantize_q8_0(w) -> np.ndarray:
    """float weight [R, K] (K a multiple of 32) -> Q8_0 bytes [R, K/32*34] (gguf's reference quantizer)."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % QK8_0:
        raise ValueError(f"quantize_q8_0: shape {w.shape}: rows must be a multiple of {QK8_0} long")
    return _gq.quantize(w, GGMLQuantizationType.Q8_0)


def dequantize_q8_0(data) -> np.ndarray:
    return _gq.dequantize(np.asarray(data).view(np.uint8), GGMLQuantizationType.Q8_0)

"""DQV3: the 8-dimensional vector-quantised routed-expert format of the ds4 base file (docs/formats.md).

Owns: the constants of the format, packing and unpacking of the index stream and of the 13th-bit plane,
the E4M3 codebook and f16 gain encodings, and `dequant_matrix`, the one definition of the decoded
weight. It does not own codebook training (ds4lib.solvers.vq) or the GGUF container (ds4lib.formats.gguf).

Shape legend: E experts, C codewords (2^bits), R rows (output features) of an expert matrix, J = in/8
vectors per row, N = R*J indices per expert matrix, B = ceil(N/256) index blocks.

The decoded weight. Vectors run along the input (row) dimension:

    w[r, 8j:8j+8] = float32(g[r]) * float32(C[idx[r, j]])       (one float32 multiply per weight)

with g[r] an f16 row gain and C an E4M3 codebook [C, 8] shared by every expert and by the three matrices
(w1, w2, w3) of one layer. w1/w3 are [F, D] and w2 is [D, F], so all three have N = F*D/8 indices.

The index stream of one expert matrix: idx flattened row-major (stream position p = r*J + j), padded with
index 0 to B*256 positions, cut into blocks of 256 indices. Block b occupies exactly 384 bytes (three full
128-byte lines) at byte 384*b and is read by one warp as 96 little-endian uint32 words, lane l (0..31)
owning the 8 indices i_k = idx[256b + 8l + k], k = 0..7:

    word[l]      = lo8(i_0) | lo8(i_1) << 8 | lo8(i_2) << 16 | lo8(i_3) << 24       (line 0)
    word[32 + l] = lo8(i_4) | lo8(i_5) << 8 | lo8(i_6) << 16 | lo8(i_7) << 24       (line 1)
    word[64 + l] = sum_k  bits8..11(i_k) << 4k                                     (line 2)

so each line is one fully coalesced 32-bit load per lane. 13-bit layers keep exactly this 12-bit stream
(bits 0..11) and add a separate plane of bit 12: 32 bytes per block, plane byte 32*b + l holding
bit 12 of i_k at bit k (equivalently: the LSB-first bit string of bit 12 over the stream positions).
Layout name: `INDEX_LAYOUT`.

In the file (see ds4lib.formats.gguf) a layer's payload is one tensor [E, 3, S] with S = 384*B bytes per
expert matrix (matrices in the order w1, w2, w3), so each expert's payload starts on a 128-byte boundary
(S*3 is a multiple of 384 and the tensor itself is 128-byte aligned); the plane tensor is [E, 3, P] with
P = 32*B rounded up to a multiple of 128.
"""
from __future__ import annotations

import numpy as np

from ds4lib.formats.fp8 import e4m3_decode, e4m3_encode

__all__ = [
    "VQ_DIM", "VQ_MAGIC", "FORMAT_VERSION", "KNOWN_FORMAT_VERSIONS", "VQ_BITS", "MAIN_BITS", "BLOCK_INDICES",
    "BLOCK_BYTES", "LINE_BYTES", "PLANE_BLOCK_BYTES", "PAYLOAD_ALIGN", "INDEX_LAYOUT", "EXPERT_MATRICES",
    "n_blocks", "index_bytes", "plane_bytes", "pack_indices", "unpack_indices", "encode_codebook",
    "decode_codebook", "encode_gains", "dequant_matrix",
]

VQ_DIM = 8                       # weights per vector (a compile-time constant in every kernel)
VQ_MAGIC = "DQV3"                # payload magic of this format version
FORMAT_VERSION = 3               # ds4.format_version written by this code
KNOWN_FORMAT_VERSIONS = (3,)     # the reader's whitelist
VQ_BITS = (12, 13)               # index widths a file may hold
MAIN_BITS = 12                   # width of the main stream (13-bit layers add the 1-bit plane)
BLOCK_INDICES = 256
BLOCK_BYTES = 384                # 256 * 12 bits
LINE_BYTES = 128
PLANE_BLOCK_BYTES = 32           # 256 * 1 bit
PAYLOAD_ALIGN = 128              # every expert payload (and every tensor of the file) starts on this
INDEX_LAYOUT = "dqv3-warp32x8-lo8lo8hi4+plane1"
EXPERT_MATRICES = ("w1", "w2", "w3")


def n_blocks(n_indices: int) -> int:
    return -(-int(n_indices) // BLOCK_INDICES)


def index_bytes(n_indices: int) -> int:
    """Bytes of the 12-bit stream of one expert matrix (a multiple of 384, hence of 128)."""
    return n_blocks(n_indices) * BLOCK_BYTES


def plane_bytes(n_indices: int) -> int:
    """Bytes of the 13th-bit plane of one expert matrix, rounded up to a multiple of 128."""
    raw = n_blocks(n_indices) * PLANE_BLOCK_BYTES
    return -(-raw // PAYLOAD_ALIGN) * PAYLOAD_ALIGN


def pack_indices(idx, bits: int):
    """Indices (any integer array, flattened row-major) -> (stream uint8 [index_bytes(N)],
    plane uint8 [plane_bytes(N)] or None for 12-bit)."""
    if bits not in VQ_BITS:
        raise ValueError(f"pack_indices: bits={bits} is not one of {VQ_BITS}")
    flat = np.asarray(idx).reshape(-1)
    if flat.size and (flat.min() < 0 or flat.max() >= (1 << bits)):
        raise ValueError(f"pack_indices: indices outside [0, {1 << bits})")
    n = flat.size
    nb = n_blocks(n)
    pad = np.zeros(nb * BLOCK_INDICES, dtype=np.uint16)
    pad[:n] = flat
    blk = pad.reshape(nb, 32, 8)                               # [B, lane, k]
    lo = (blk & 0xFF).astype(np.uint8)
    hi = ((blk >> 8) & 0xF).astype(np.uint8)
    out = np.empty((nb, 3, 32, 4), dtype=np.uint8)             # [B, line, lane, byte of the word]
    out[:, 0] = lo[:, :, :4]
    out[:, 1] = lo[:, :, 4:]
    out[:, 2] = hi[:, :, 0::2] | (hi[:, :, 1::2] << 4)
    stream = out.reshape(-1)
    if bits == MAIN_BITS:
        return stream, None
    plane = np.zeros(plane_bytes(n), dtype=np.uint8)
    plane[: nb * PLANE_BLOCK_BYTES] = np.packbits(((pad >> 12) & 1).astype(np.uint8), bitorder="little")
    return stream, plane


def unpack_indices(stream, n_indices: int, plane=None) -> np.ndarray:
    """Inverse of `pack_indices`: uint16 [n_indices]. `plane` given -> 13-bit indices."""
    n = int(n_indices)
    nb = n_blocks(n)
    s = np.asarray(stream).view(np.uint8).reshape(-1)
    if s.size < nb * BLOCK_BYTES:
        raise ValueError(f"unpack_indices: stream has {s.size} bytes, {n} indices need {nb * BLOCK_BYTES}")
    lines = s[: nb * BLOCK_BYTES].reshape(nb, 3, 32, 4)        # [B, line, lane, byte]
    out = np.empty((nb, 32, 8), dtype=np.uint16)
    out[:, :, :4] = lines[:, 0]
    out[:, :, 4:] = lines[:, 1]
    hi = lines[:, 2].astype(np.uint16)
    out[:, :, 0::2] |= (hi & 0xF) << 8
    out[:, :, 1::2] |= (hi >> 4) << 8
    flat = out.reshape(-1)
    if plane is not None:
        p = np.asarray(plane).view(np.uint8).reshape(-1)
        if p.size < nb * PLANE_BLOCK_BYTES:
            raise ValueError(f"unpack_indices: plane has {p.size} bytes, {n} indices need {nb * PLANE_BLOCK_BYTES}")
        bit = np.unpackbits(p[: nb * PLANE_BLOCK_BYTES], bitorder="little").astype(np.uint16)
        flat |= bit << 12
    return flat[:n]


def encode_codebook(codebook) -> np.ndarray:
    """float codebook [C, 8] -> E4M3 codes uint8 [C, 8] (round to nearest even, saturating at +-448)."""
    cb = np.asarray(codebook, dtype=np.float32)
    if cb.ndim != 2 or cb.shape[1] != VQ_DIM:
        raise ValueError(f"encode_codebook: shape {cb.shape}, expected [C, {VQ_DIM}]")
    if not np.isfinite(cb).all():
        raise ValueError("encode_codebook: non-finite codeword")
    return e4m3_encode(cb, saturate=True)


def decode_codebook(codes) -> np.ndarray:
    """E4M3 codes [C, 8] -> float32 [C, 8] (exact)."""
    return e4m3_decode(np.asarray(codes).view(np.uint8))


def encode_gains(gains) -> np.ndarray:
    """float row gains -> float16 (round to nearest even); a gain that overflows f16 is an error."""
    g = np.asarray(gains, dtype=np.float32).astype(np.float16)
    if not np.isfinite(g).all():
        raise ValueError("encode_gains: a row gain does not fit in f16")
    return g


def dequant_matrix(codebook_f32, gains_f16, idx) -> np.ndarray:
    """Decoded expert matrix: codebook float32 [C, 8], gains f16 [R], idx [R, J] -> float32 [R, 8J].
    This is the engine's value of every weight, by definition."""
    cb = np.asarray(codebook_f32, dtype=np.float32)
    g = np.asarray(gains_f16).view(np.float16).astype(np.float32)
    idx = np.asarray(idx)
    rows, j = idx.shape
    if g.shape != (rows,):
        raise ValueError(f"dequant_matrix: {g.shape[0]} gains for {rows} rows")
    return (cb[idx] * g[:, None, None]).reshape(rows, j * VQ_DIM)      # [R, J, 8] -> [R, 8J]

"""DQV3 index packing (12-bit stream + 13th-bit plane), E4M3 codebooks and the decoded-weight definition."""
import numpy as np
import pytest

from ds4lib.formats.fp8 import e4m3_decode
from ds4lib.formats.vq import (BLOCK_BYTES, BLOCK_INDICES, PAYLOAD_ALIGN, decode_codebook, dequant_matrix,
                               encode_codebook, index_bytes, pack_indices, plane_bytes, unpack_indices)


@pytest.mark.parametrize("bits", [12, 13])
@pytest.mark.parametrize("n", [1, 255, 256, 257, 1000, 6144])
def test_pack_round_trip_is_bit_exact(bits, n):
    idx = np.random.default_rng(n + bits).integers(0, 1 << bits, n)
    stream, plane = pack_indices(idx, bits)
    assert stream.dtype == np.uint8 and stream.size == index_bytes(n) == -(-n // 256) * 384
    assert (plane is None) == (bits == 12)
    if plane is not None:
        assert plane.size == plane_bytes(n) and plane.size % PAYLOAD_ALIGN == 0
    back = unpack_indices(stream, n, plane)
    assert back.dtype == np.uint16 and np.array_equal(back, idx)
    # all 2^bits values survive, including the extremes
    full = np.arange(1 << bits)
    s, p = pack_indices(full, bits)
    assert np.array_equal(unpack_indices(s, full.size, p), full)


def test_block_is_three_full_lines_with_the_documented_lane_layout():
    idx = np.random.default_rng(0).integers(0, 1 << 13, 512)
    stream, plane = pack_indices(idx, 13)
    assert BLOCK_BYTES == 3 * 128 and stream.size == 2 * BLOCK_BYTES
    words = stream.view("<u4").reshape(2, 96)                 # [block, word]
    for b in range(2):
        blk = idx[b * BLOCK_INDICES:(b + 1) * BLOCK_INDICES]
        for lane in (0, 7, 31):
            i = blk[8 * lane:8 * lane + 8]
            w0 = sum(int(i[k] & 0xFF) << (8 * k) for k in range(4))
            w1 = sum(int(i[4 + k] & 0xFF) << (8 * k) for k in range(4))
            w2 = sum(int((i[k] >> 8) & 0xF) << (4 * k) for k in range(8))
            assert (words[b, lane], words[b, 32 + lane], words[b, 64 + lane]) == (w0, w1, w2)
            # the 12+1 plane: byte 32*b + lane holds bit 12 of the lane's 8 indices, index k at bit k
            assert plane[32 * b + lane] == sum(int((i[k] >> 12) & 1) << k for k in range(8))
    # the 12-bit stream of a 13-bit layer is exactly the 12-bit packing of the low 12 bits
    s12, _ = pack_indices(idx & 0xFFF, 12)
    assert np.array_equal(s12, stream)
    assert np.array_equal(plane[:64], np.packbits(((idx >> 12) & 1).astype(np.uint8), bitorder="little"))


def test_padding_and_bad_input():
    s, _ = pack_indices(np.full(3, 4095), 12)
    assert np.array_equal(unpack_indices(s, 256), np.r_[np.full(3, 4095), np.zeros(253)])
    with pytest.raises(ValueError):
        pack_indices(np.array([4096]), 12)
    with pytest.raises(ValueError):
        pack_indices(np.array([-1]), 13)
    with pytest.raises(ValueError):
        pack_indices(np.array([1]), 14)
    with pytest.raises(ValueError):
        unpack_indices(s[:100], 10)


def test_codebook_is_e4m3_and_dequant_is_one_float32_product():
    rng = np.random.default_rng(1)
    cb = rng.standard_normal((16, 8)).astype(np.float32)
    codes = encode_codebook(cb)
    dec = decode_codebook(codes)
    assert codes.dtype == np.uint8 and np.array_equal(dec, e4m3_decode(codes))
    assert np.all(np.abs(dec - cb) <= np.abs(cb) / 16 + 2.0 ** -10)      # 3 mantissa bits, nearest
    g = (rng.random(5) + 0.5).astype(np.float16)
    idx = rng.integers(0, 16, (5, 3))
    w = dequant_matrix(dec, g, idx)
    assert w.shape == (5, 24) and w.dtype == np.float32
    want = np.array([[np.float32(g[r]) * dec[idx[r, j], i] for j in range(3) for i in range(8)] for r in range(5)],
                    dtype=np.float32)
    assert np.array_equal(w, want)
    with pytest.raises(ValueError):
        encode_codebook(np.full((2, 8), np.nan))

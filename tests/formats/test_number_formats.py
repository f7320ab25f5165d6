"""Bit-exact number formats: every E4M3 and E2M1 code, UE8M0 extremes, ties, saturation, NaN, BF16."""
import numpy as np
import pytest

from ds4lib.formats import fp4, fp8
from ds4lib.formats.floats import bf16_bits_to_f32, f32_to_bf16_bits, round_bf16


def _e4m3_by_formula(code):
    s = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 7
    if e == 15 and m == 7:
        return np.nan
    return s * (m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


def test_e4m3_all_256_codes_decode_and_round_trip():
    for code in range(256):
        v = fp8.e4m3_decode(np.uint8(code))
        want = _e4m3_by_formula(code)
        if np.isnan(want):
            assert np.isnan(v)
            assert fp8.e4m3_encode(v) & 0x7F == 0x7F
            continue
        assert v == want, code
        assert fp8.e4m3_encode(v) == code, code            # includes -0 (0x80)
    finite = fp8.E4M3_VALUES[~np.isnan(fp8.E4M3_VALUES)]
    assert finite.max() == 448.0 and finite.min() == -448.0
    assert np.min(finite[finite > 0]) == 2.0 ** -9


def test_e4m3_ties_round_to_even_code():
    pos = np.unique(fp8.E4M3_VALUES[(fp8.E4M3_VALUES >= 0) & ~np.isnan(fp8.E4M3_VALUES)])
    mids = (pos[:-1].astype(np.float64) + pos[1:]) / 2
    codes = fp8.e4m3_encode(mids)
    lo, hi = fp8.e4m3_encode(pos[:-1]), fp8.e4m3_encode(pos[1:])
    want = np.where(lo % 2 == 0, lo, hi)
    np.testing.assert_array_equal(codes, want)
    # just off the midpoint goes to the nearer neighbour
    np.testing.assert_array_equal(fp8.e4m3_encode(mids * (1 - 1e-9)), lo)
    np.testing.assert_array_equal(fp8.e4m3_encode(mids * (1 + 1e-9)), hi)


def test_e4m3_saturation_and_nan():
    assert fp8.e4m3_round(1e6) == 448.0 and fp8.e4m3_round(-500.0) == -448.0
    assert np.isnan(fp8.e4m3_round(1e6, saturate=False))
    assert fp8.e4m3_round(464.0) == 448.0                   # midpoint to the next binade saturates
    assert np.isnan(fp8.e4m3_round(np.nan))
    assert fp8.e4m3_round(2.0 ** -10) == 0.0                # half the smallest subnormal: tie to even (0)
    assert fp8.e4m3_round(3 * 2.0 ** -11) == 2.0 ** -9


def test_ue8m0_extremes():
    np.testing.assert_array_equal(fp8.ue8m0_decode(np.array([0, 127, 254], np.uint8)),
                                  np.array([2.0 ** -127, 1.0, 2.0 ** 127], np.float32))
    assert np.isnan(fp8.ue8m0_decode(np.uint8(255)))
    np.testing.assert_array_equal(fp8.ue8m0_encode([2.0 ** -127, 1.0, 2.0 ** 127]), [0, 127, 254])
    with pytest.raises(ValueError):
        fp8.ue8m0_encode([3.0])
    np.testing.assert_array_equal(fp8.pow2_ceil_exponent(np.float32([1.0, 1.5, 2.0, 0.75, 448.0])), [0, 1, 1, 0, 9])


def test_e2m1_all_16_codes():
    mags = [0, .5, 1, 1.5, 2, 3, 4, 6]
    for code in range(16):
        v = fp4.e2m1_decode(np.uint8(code))
        want = (-1 if code & 8 else 1) * mags[code & 7]
        assert v == want and np.signbit(v) == bool(code & 8)
        assert fp4.e2m1_encode(v) == code
    # ties: to the even code
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    np.testing.assert_array_equal(fp4.e2m1_round(ties), [0, 1, 1, 2, 2, 4, 4])
    np.testing.assert_array_equal(fp4.e2m1_round([7.0, -100.0]), [6, -6])
    assert np.isnan(fp4.e2m1_round(np.nan))
    with pytest.raises(ValueError):
        fp4.e2m1_encode([np.nan])


def test_nibble_order_low_is_even():
    codes = np.array([[1, 2, 3, 4]], np.uint8)
    packed = fp4.pack_nibbles(codes)
    np.testing.assert_array_equal(packed, [[0x21, 0x43]])
    np.testing.assert_array_equal(fp4.unpack_nibbles(packed), codes)
    np.testing.assert_array_equal(fp4.unpack_nibbles(packed.view(np.int8)), codes)


def test_fp4_weight_round_trip():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    packed, scale = fp4.fp4_weight_quantize(w)
    d = fp4.fp4_weight_dequant(packed, scale)
    np.testing.assert_array_equal(fp4.fp4_weight_dequant(*fp4.fp4_weight_quantize(d)), d)   # values idempotent
    assert np.abs(d - w).max() <= np.repeat(fp8.ue8m0_decode(scale), 32, -1).max()


def test_fp8_weight_block_scales():
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((40, 70)) * 3).astype(np.float32)      # ragged blocks
    codes, scale = fp8.fp8_weight_quantize(w, 32)
    assert scale.shape == (2, 3)
    d = fp8.fp8_weight_dequant(codes, scale, 32)
    assert np.abs(d - w).max() / np.abs(w).max() < 0.07
    np.testing.assert_array_equal(fp8.fp8_weight_dequant(*fp8.fp8_weight_quantize(d, 32), 32), d)


def test_bf16_rounding():
    x = np.array([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -9, 3.4e38, -0.0, np.inf], np.float32)
    np.testing.assert_array_equal(round_bf16(x), np.array([1.0, 1.0, 1 + 2 ** -7, np.inf, -0.0, np.inf], np.float32))
    b = f32_to_bf16_bits(np.float32(np.nan))
    assert np.isnan(bf16_bits_to_f32(b))
    allbits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    v = bf16_bits_to_f32(allbits)
    ok = ~np.isnan(v)
    np.testing.assert_array_equal(f32_to_bf16_bits(v[ok]), allbits[ok])

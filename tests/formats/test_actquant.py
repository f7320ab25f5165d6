"""Activation quantise-dequantise rules (docs/architecture.md §11.3): scales, exact representability, idempotence."""
import numpy as np

from ds4lib.formats.actquant import act_quant_fp4_e4m3, act_quant_fp4_pow2, act_quant_fp8
from ds4lib.formats.floats import round_bf16
from ds4lib.formats.fp4 import e2m1_round
from ds4lib.formats.fp8 import e4m3_round


def _x(n=4, k=64, seed=0):
    return round_bf16(np.random.default_rng(seed).standard_normal((n, k)) * 3)


def test_fp8_block_scale_is_pow2_and_values_on_grid():
    x = _x()
    q = act_quant_fp8(x, 32)
    for row, qrow in zip(x.reshape(-1, 32), q.reshape(-1, 32)):
        amax = np.abs(row).max()
        s = 2.0 ** np.ceil(np.log2(np.float32(amax) * np.float32(1 / 448)))
        np.testing.assert_array_equal(qrow, e4m3_round(row / s) * s)
        assert np.abs(qrow / s).max() <= 448
    np.testing.assert_array_equal(act_quant_fp8(q, 32), q)      # idempotent
    np.testing.assert_array_equal(round_bf16(q), q)              # fits a BF16 holder


def test_fp8_amax_floor():
    x = np.zeros((1, 32), np.float32)
    x[0, 0] = 1e-7
    q = act_quant_fp8(x, 32)
    s = 2.0 ** np.ceil(np.log2(np.float32(1e-4) * np.float32(1 / 448)))
    assert q[0, 0] == e4m3_round(1e-7 / s) * s


def test_fp4_pow2_block32():
    x = _x(seed=2)
    q = act_quant_fp4_pow2(x, 32)
    for row, qrow in zip(x.reshape(-1, 32), q.reshape(-1, 32)):
        s = 2.0 ** np.ceil(np.log2(np.float32(np.abs(row).max()) * np.float32(1 / 6)))
        np.testing.assert_array_equal(qrow, e2m1_round(row / s) * s)
    np.testing.assert_array_equal(act_quant_fp4_pow2(q, 32), q)


def test_fp4_e4m3_scale_block16_clamps():
    x = _x(seed=3)
    q = act_quant_fp4_e4m3(x, 16)
    for row, qrow in zip(x.reshape(-1, 16), q.reshape(-1, 16)):
        s = e4m3_round(np.float32(np.abs(row).max()) / np.float32(6))
        np.testing.assert_array_equal(qrow, e2m1_round(np.clip(row / s, -6, 6)) * s)
        assert np.abs(qrow).max() <= 6 * s        # the scale can round down: values saturate at 6 s (N3)
    np.testing.assert_array_equal(round_bf16(q), q)

"""Our q4_K quantizer: gguf's dequantizer reads its bytes exactly as ours does; the fallback rule."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants

from ds4lib.formats.q4k import (dequantize_q4k, dequantize_q8_0, linear_type, quantize_q4k, quantize_q8_0,
                                type_bytes)


def _cases():
    rng = np.random.default_rng(0)
    yield "normal", rng.standard_normal((33, 512)).astype(np.float32)
    yield "zeros", np.zeros((4, 256), np.float32)
    yield "constant", np.full((4, 256), 0.37, np.float32)
    yield "negative", -np.abs(rng.standard_normal((4, 256))).astype(np.float32)
    yield "positive offset", (np.abs(rng.standard_normal((4, 256))) + 3).astype(np.float32)
    yield "large", (rng.standard_normal((4, 768)) * 1e3).astype(np.float32)
    yield "small", (rng.standard_normal((4, 256)) * 1e-3).astype(np.float32)
    yield "f16 underflow", (rng.standard_normal((4, 256)) * 1e-7).astype(np.float32)
    w = rng.standard_normal((4, 256)).astype(np.float32)
    w[:, 32:64] = 0
    w[:, 100] = 50
    yield "outlier and empty sub-block", w


@pytest.mark.parametrize("name,w", list(_cases()), ids=[c[0] for c in _cases()])
def test_q4k_is_bit_exact_with_gguf_and_accurate(name, w):
    q = quantize_q4k(w)
    assert q.shape == (w.shape[0], w.shape[1] // 256 * 144) and q.nbytes == type_bytes("q4_K", *w.shape)
    ours = dequantize_q4k(q)
    theirs = quants.dequantize(q, T.Q4_K)
    assert ours.shape == w.shape and np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
    den = float((w.astype(np.float64) ** 2).sum())
    if den:
        rel = np.sqrt(((ours - w).astype(np.float64) ** 2).sum() / den)
        bound = {"f16 underflow": 1.0, "outlier and empty sub-block": 0.15}.get(name, 0.09)
        assert rel <= bound, rel          # 4.5 bits/weight: ~0.072 on Gaussian rows; never worse than zero


def test_fallback_rule_and_q8_0():
    assert [linear_type(k) for k in (256, 5120, 1280, 192, 128, 96, 40)] == \
        ["q4_K", "q4_K", "q4_K", "q8_0", "q8_0", "q8_0", "f16"]
    w = np.random.default_rng(2).standard_normal((8, 192)).astype(np.float32)
    q = quantize_q8_0(w)
    assert q.nbytes == type_bytes("q8_0", 8, 192)
    assert np.array_equal(dequantize_q8_0(q), quants.dequantize(q, T.Q8_0))
    assert np.sqrt(((dequantize_q8_0(q) - w) ** 2).sum() / (w ** 2).sum()) < 0.01
    with pytest.raises(ValueError):
        quantize_q4k(np.zeros((2, 192), np.float32))

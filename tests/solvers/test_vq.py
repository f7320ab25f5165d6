"""Lloyd for 8-dimensional VQ (CPU path): the assignment and update rules, exactness, determinism."""
import hashlib

import numba
import numpy as np
import pytest

from ds4lib.formats.fp8 import e4m3_round
from ds4lib.solvers.vq import (CpuLloyd, assign_reference, equidistant, finalize_update, matrix_error,
                               normalize_rows, prepare_codebook, round_sig12, row_gains, to_fixed, train_codebook)
from ds4lib.formats.vq import dequant_matrix


def _sha(*arrays):
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def test_round_sig12_keeps_12_significant_bits_and_makes_products_exact():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(4096) * np.exp(rng.uniform(-20, 20, 4096))).astype(np.float32)
    r = round_sig12(x)
    assert np.all((r.view(np.uint32) & 0xFFF) == 0)
    assert np.all(np.abs(r.astype(np.float64) - x) <= np.abs(x.astype(np.float64)) * 2.0 ** -12)
    assert round_sig12(np.float32([1 + 2 ** -12]))[0] == 1.0                       # tie -> even
    assert round_sig12(np.float32([1 + 3 * 2 ** -12]))[0] == np.float32(1 + 2 ** -10)
    assert round_sig12(np.float32([2.0 ** -61, -2.0 ** -70]))[0] == 0.0
    a, b = round_sig12(x[:2048]), round_sig12(x[2048:])
    exact = a.astype(np.float64) * b.astype(np.float64)
    assert np.array_equal((a * b).astype(np.float64), exact)                        # 24 bits: exact in f32


def test_cpu_assignment_matches_the_rule_and_breaks_ties_low():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3001, 8)).astype(np.float32)
    cb = rng.standard_normal((700, 8)).astype(np.float32)
    cb[5] = cb[3]                                        # duplicate codeword: index 3 must win
    p = prepare_codebook(cb)
    be = CpuLloyd()
    got = be.fetch(be.assign(be.put(x), p))
    assert np.array_equal(got, assign_reference(x, p))
    assert not np.any(got == 5)
    # the rule is nearest-codeword up to the 12-bit rounding: distances within 1e-3 relative of the true min
    d = ((x[:, None, :].astype(np.float64) - round_sig12(cb)[None].astype(np.float64)) ** 2).sum(-1)
    assert np.all(d[np.arange(len(x)), got] <= d.min(1) * (1 + 1e-3) + 1e-6)


def test_update_is_exact_integer_sums():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5000, 8)).astype(np.float32)
    idx = rng.integers(0, 37, 5000).astype(np.int32)
    idx[idx == 7] = 8                                   # codeword 7 empty
    be = CpuLloyd()
    sums, counts = be.accumulate(be.put(x), idx, 40)
    want = np.zeros((40, 8), np.int64)
    np.add.at(want, idx, to_fixed(x))
    assert np.array_equal(sums, want) and np.array_equal(counts, np.bincount(idx, minlength=40))
    prev = np.full((40, 8), 9.0, np.float32)
    new = finalize_update(sums, counts, prev)
    assert np.array_equal(new[7], prev[7]) and np.array_equal(new[37:], prev[37:])
    assert np.allclose(new[0], x[idx == 0].mean(0), atol=1e-6)


def test_lloyd_is_deterministic_across_thread_counts_and_improves():
    rng = np.random.default_rng(3)
    pool = rng.standard_normal((20000, 8)).astype(np.float32)
    assert np.array_equal(equidistant(10, 4), [0, 2, 5, 7])
    old = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        a = train_codebook(pool, 256, 4, history=True)
        numba.set_num_threads(old)
        b = train_codebook(pool, 256, 4, history=True)
    finally:
        numba.set_num_threads(old)
    assert _sha(a.codebook, a.codebook_f32) == _sha(b.codebook, b.codebook_f32)
    assert np.all(np.diff(a.history) <= 0) and a.history[-1] < 0.33      # 1 bit/dim: D(R) = 0.25
    assert np.array_equal(a.codebook, e4m3_round(a.codebook_f32))


def test_gains_normalisation_and_engine_error():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((6, 32)).astype(np.float32) * np.float32([[0.5], [2], [0], [1], [3], [0.01]])
    g = row_gains(w)
    assert g.dtype == np.float16 and g[2] == 0
    x = normalize_rows(w, g)
    assert x.shape == (24, 8) and np.all(x[8:12] == 0) and np.isfinite(x).all()
    cb = e4m3_round(rng.standard_normal((16, 8)))
    idx = rng.integers(0, 16, (6, 4)).astype(np.int32)
    sse, ssw = matrix_error(w, cb, g, idx)
    what = dequant_matrix(cb, g, idx).astype(np.float64)
    assert sse == pytest.approx(((w - what) ** 2).sum(), rel=1e-12)
    assert ssw == pytest.approx((w.astype(np.float64) ** 2).sum(), rel=1e-12)


def test_numba_rounding_matches_the_numpy_spec():
    from ds4lib.solvers.vq import _round_sig12_bits
    rng = np.random.default_rng(8)
    x = np.concatenate([(rng.standard_normal(500) * np.exp(rng.uniform(-40, 40, 500))).astype(np.float32),
                        np.float32([0, -0.0, 1 + 2 ** -12, 1 + 3 * 2 ** -12, -(1 + 2 ** -12), 2.0 ** -61, 2.0 ** -60])])
    got = np.array([_round_sig12_bits(u) for u in x.view(np.uint32)], dtype=np.uint32)
    assert np.array_equal(got, round_sig12(x).view(np.uint32))


@pytest.mark.parametrize("k", [1, 3, 4, 5, 703])
def test_cpu_assignment_blocks_of_four_and_the_tail_keep_the_rule(k):
    """The CPU kernel compares four codewords per pass and the last k % 4 one by one: ties inside a block,
    across blocks and in the tail all go to the lowest index, and every index equals the NumPy rule."""
    rng = np.random.default_rng(k)
    x = rng.standard_normal((1000, 8)).astype(np.float32)
    x[:50] = 0.0                                          # all-zero vectors: every d is |c|^2
    x[50:60] = 1e-30                                      # flushed to zero by the 12-bit rounding
    cb = rng.standard_normal((k, 8)).astype(np.float32)
    if k >= 4:
        cb[k - 1] = cb[k - 2]                             # a tie in the tail or the last block
        cb[1] = cb[0]                                     # a tie inside the first block
        x[60:200] = cb[0] + np.float32(1e-3) * rng.standard_normal((140, 8)).astype(np.float32)
    p = prepare_codebook(cb)
    be = CpuLloyd()
    got = be.fetch(be.assign(be.put(x), p))
    assert np.array_equal(got, assign_reference(x, p))
    if k >= 4:
        assert not np.any(got == 1) and not np.any(got == k - 1)

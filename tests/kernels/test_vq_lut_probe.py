"""bench/dev/vq_lut.py, the lookup-table probe of the decode gate / up GEMV (not used by the engine): its kernels
against the float64 sums of the same codes (tiny shapes; the simulator's MMA is the ideal one), whatever the grid,
and its refusals."""
import numpy as np
import pytest

from bench.dev import vq_lut


def _run(cuda, n_cw, n_chunks, n_rows, n_cc, n_rr, seed=0):
    rng = np.random.default_rng(seed)
    codes, x_codes, scales, idx_jr = vq_lut.make_inputs(rng, n_cw, n_chunks, n_rows, n_cc)
    gains = rng.uniform(0.5, 2.0, n_rows).astype(np.float32)
    cb32, xw, idx = vq_lut.device_operands(codes, x_codes, idx_jr, n_cc)
    part = cuda.device_array(n_cc * n_rows, np.float32)
    out = cuda.device_array(n_rows, np.float32)
    vq_lut.vq_lut_gemv(cuda.to_device(cb32), n_cw, cuda.to_device(xw), cuda.to_device(scales), cuda.to_device(idx),
                       n_rows, n_cc, n_rr, part, cuda.to_device(gains), out)
    got = out.copy_to_host()
    return got, vq_lut.max_error(got, codes, x_codes, scales, idx_jr, gains, np.arange(n_rows))


def test_table_sums_match_the_codes_sums(cuda_ready):
    """Two chunk ranges of two passes, three row ranges whose last is short: every row within FP32 rounding."""
    got, err = _run(cuda_ready, n_cw=64, n_chunks=16, n_rows=70, n_cc=2, n_rr=3)
    assert np.isfinite(got).all() and err < 1e-5


def test_the_grid_changes_no_sum_it_is_not_meant_to(cuda_ready):
    """One chunk range against two: the sums of a row are the same terms (a mis-placed chunk or pass changes them)."""
    a, err_a = _run(cuda_ready, n_cw=32, n_chunks=16, n_rows=40, n_cc=1, n_rr=1, seed=3)
    b, err_b = _run(cuda_ready, n_cw=32, n_chunks=16, n_rows=40, n_cc=2, n_rr=2, seed=3)
    assert err_a < 1e-5 and err_b < 1e-5
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(a).max())


def test_refusals():
    for n_cw in (48, 16384):
        with pytest.raises(ValueError, match=f"{n_cw} codewords"):
            vq_lut.vq_lut_gemv(None, n_cw, None, None, None, 40, 1, 1, None, None, None)
    with pytest.raises(ValueError, match="are not 3 ranges of whole passes of 4"):
        vq_lut.geometry(16, 40, 3, 1)
    most = vq_lut.ROWS_T * vq_lut.THREADS
    assert vq_lut.geometry(640, 2 * most, 32, 2) == (5, most)
    with pytest.raises(ValueError, match="more row ranges"):
        vq_lut.geometry(640, 2 * most + 1, 32, 2)
    assert vq_lut.smem_bytes(8192) <= vq_lut.SMEM_LIMIT

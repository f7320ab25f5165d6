"""The low-rank ablation's fitting math (bench/sidecar_lowrank.py) on synthetic data: a planted rank-r correction is
recovered exactly, the reduced-rank fit beats truncating the full solution when the inputs are correlated, and
the FP8-rounded factors keep nearly all of the float fit."""
import numpy as np

from bench.sidecar_lowrank import factor_bytes, fit_reduced_rank, round_factors, solve_layer


def _correlated(rng, n, d):
    return rng.standard_normal((n, d)) @ (rng.standard_normal((d, d)) * np.linspace(2.0, 0.05, d))


def test_planted_low_rank_correction_is_recovered_exactly():
    rng = np.random.default_rng(0)
    n, d, r = 400, 24, 3
    x = _correlated(rng, n, d)
    b = rng.standard_normal((d, r)) @ rng.standard_normal((r, d))                       # [D, D] rank 3
    for rank in (3, 5):                                  # the planted rank and a larger one
        a, w = fit_reduced_rank(x, x @ b, rank=rank, lam=0.0)
        assert a.shape == (rank, d) and w.shape == (rank, d)
        np.testing.assert_allclose(a.T @ w, b, atol=1e-8 * np.abs(b).max())
    np.testing.assert_allclose(w @ w.T, np.eye(5), atol=1e-10)


def test_reduced_rank_beats_truncating_the_full_solution():
    rng = np.random.default_rng(1)
    n, d, r = 600, 20, 2
    x = _correlated(rng, n, d)
    resid = x @ rng.standard_normal((d, d)) + 0.1 * rng.standard_normal((n, d))
    a, w = fit_reduced_rank(x, resid, rank=r, lam=0.0)
    err_rrr = ((resid - x @ a.T @ w) ** 2).sum()
    b = np.linalg.lstsq(x, resid, rcond=None)[0]
    u, s, vt = np.linalg.svd(b)
    err_trunc = ((resid - x @ (u[:, :r] * s[:r]) @ vt[:r]) ** 2).sum()
    assert err_rrr < 0.95 * err_trunc
    # no rank-r matrix does better: the error equals the sum of the discarded eigenvalues of the fitted values
    fitted = x @ b
    ev = np.linalg.eigvalsh(fitted.T @ fitted)[::-1]
    assert np.isclose(err_rrr, ((resid - fitted) ** 2).sum() + ev[r:].sum(), rtol=1e-9)


def test_fp8_factors_and_layer_solve():
    rng = np.random.default_rng(2)
    n, d, r = 512, 64, 4
    x = rng.standard_normal((n, d)).astype(np.float32)
    b = (rng.standard_normal((d, r)) @ rng.standard_normal((r, d)) / d).astype(np.float32)
    y = rng.standard_normal((n, d)).astype(np.float32)
    target = y + x @ b
    a, w = fit_reduced_rank(x, target - y, rank=r, lam=0.0)
    aq, wq = round_factors(x, target - y, a, w, lam=0.0)
    err = ((target - y - x @ aq.T @ wq) ** 2).sum() / ((target - y) ** 2).sum()
    assert err < 2e-3                                  # E4M3 keeps about 3 significant bits per value
    train = np.arange(n) % 4 != 3
    aq, wq, row = solve_layer(x, y, target, train, rank=r)
    assert row["heldout_gain"] > 0.99 and len(row["rho_rows"]) == 6
    assert factor_bytes(13, 256) == 6864

"""The lattice-direct Gauss–Seidel gain solve (ds4lib.solvers.gains) on synthetic layers with known gains."""
import numpy as np

from ds4lib.formats.sidecar import dequantize_gains, quantize_gains
from ds4lib.solvers.gains import choose_lambda, heldout_gain, make_problem, solve_gains


def _layer(seed=0, T=600, E=6, K=2, D=64, noise=0.02, spread=0.3):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)])
    c = rng.normal(0, 1, (T, K, D)).astype(np.float32)
    ysh = rng.normal(0, 1, (T, D)).astype(np.float32)
    true = (1 + rng.normal(0, spread, (E, D))).astype(np.float32)
    target = (c * true[ids]).sum(1) + ysh + rng.normal(0, noise, (T, D))
    train = np.arange(T) % 4 != 3
    return make_problem(c=c, ids=ids, ysh=ysh, target=target, train=train, n_experts=E), true


def test_float_solve_recovers_known_gains():
    p, true = _layer()
    sol = solve_gains(p, 1e-4, sweeps=10, lattice=False)
    # rounded once to the FP4 lattice at the end: compare with the truth's own rounding error
    lattice_err = np.abs(dequantize_gains(quantize_gains(true - 1)) - true).mean()
    assert np.abs(sol.gains - true).mean() < 1.5 * lattice_err + 0.005
    assert sol.heldout_gain > 0.95
    assert all(b <= a + 1e-9 for a, b in zip(sol.sweeps, sol.sweeps[1:])), sol.sweeps


def test_lattice_direct_stores_what_it_used_and_beats_rounding_afterwards():
    p, _ = _layer(seed=1, spread=0.05, noise=0.01)
    direct = solve_gains(p, 0.01)
    rounded = solve_gains(p, 0.01, lattice=False)
    np.testing.assert_array_equal(dequantize_gains(direct.blocks), direct.gains)
    assert direct.train_gain > rounded.train_gain
    assert direct.heldout_gain > 0


def test_huge_ridge_keeps_gains_at_one_and_gain_zero():
    p, _ = _layer(seed=2)
    sol = solve_gains(p, 1e9)
    assert np.abs(sol.gains - 1).max() < 0.02
    assert abs(heldout_gain(p, np.ones((p.n_experts, p.c.shape[-1])))) == 0.0


def test_unrouted_expert_stays_at_one():
    p, _ = _layer(seed=3, E=8)
    p.ids[p.ids == 7] = 0            # expert 7 never routed (0 may appear twice in a row: still a valid sum)
    sol = solve_gains(p, 0.1)
    np.testing.assert_array_equal(sol.gains[7], np.ones(p.c.shape[-1], np.float32))


def test_lambda_chosen_on_heldout_rows():
    p, _ = _layer(seed=4, T=120, noise=1.0, spread=0.05)
    best, rows = choose_lambda(p, (0.001, 1.0, 1000.0))
    assert best.heldout_gain == max(r["heldout_gain"] for r in rows)
    assert [r["lam"] for r in rows] == [0.001, 1.0, 1000.0]


def test_shared_ridge_tames_rare_experts():
    """An expert routed on a handful of rows: with its own energy as ridge scale it fits noise on held-out."""
    rng = np.random.default_rng(5)
    p, _ = _layer(seed=5, T=400, E=6, noise=0.5, spread=0.0)
    rare = np.nonzero((p.ids == 5).any(1))[0]
    for t in rare[6:]:
        p.ids[t][p.ids[t] == 5] = rng.choice([e for e in range(5) if e not in p.ids[t]])
    shared = solve_gains(p, 1.0, lattice=False)
    own = solve_gains(p, 1.0, lattice=False, shared_ridge=False)
    assert np.abs(shared.gains[5] - 1).mean() < np.abs(own.gains[5] - 1).mean()

"""The ③ post-training margin solve (ds4lib.solvers.margins) on small synthetic rows checked against dense algebra."""
import numpy as np
import pytest

import ds4lib.solvers.margins as margins_mod
from ds4lib.formats.sidecar import dequantize_gains
from ds4lib.solvers.margins import (block_preconditioner, make_problem, matvec, predict, rmatvec, row_diagonal,
                                    ordinary_ridge, row_gram, solve_cg, solve_dense, solve_margins, stack_problems)


def _tiny(seed=0, E=5, K=2, D=32, N=12):
    """Rows with experts repeated across rows, and one row listing the same expert twice."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(N)])
    ids[:4] = [[1, 3]] * 4           # the same pair on several rows
    ids[5] = [2, 2]                  # one expert twice in a row: its coefficients add up
    R = rng.normal(0, 1, (N, K, D))
    kind = np.arange(N) % 3 != 0
    m = np.where(kind, -rng.uniform(0.2, 1.0, N), rng.uniform(0.1, 1.0, N))
    return make_problem(ids=ids, R=R, m=m, kind=kind, n_experts=E)


def _dense(p):
    """A [N, E·D] built entry by entry (δ flattened row-major: column e·D + d)."""
    N, K, D = p.R.shape
    A = np.zeros((N, p.n_experts * D))
    for i in range(N):
        for k in range(K):
            e = p.ids[i, k]
            A[i, e * D:(e + 1) * D] += p.R[i, k]
    return A


def _random(seed, E=8, K=2, D=32, nd=30, nc=30, behind=(0.5, 1.5), ahead=(0.2, 2.0)):
    """nd decision points `behind` (a uniform range) their runner-up and nc constraint rows `ahead` of theirs."""
    rng = np.random.default_rng(seed)
    N = nd + nc
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(N)])
    kind = np.arange(N) < nd
    m = np.where(kind, -rng.uniform(*behind, N), rng.uniform(*ahead, N))
    return make_problem(ids=ids, R=rng.normal(0, 1, (N, K, D)), m=m, kind=kind, n_experts=E)


def test_matvec_and_rmatvec_are_adjoint_and_equal_the_dense_matrix(monkeypatch):
    p = _tiny()
    A = _dense(p)
    rng = np.random.default_rng(1)
    x = rng.normal(0, 1, (p.n_experts, 32))
    v = rng.normal(0, 1, p.R.shape[0])
    np.testing.assert_allclose(matvec(p, x), A @ x.ravel(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(rmatvec(p, v).ravel(), A.T @ v, rtol=1e-12, atol=1e-12)
    assert np.isclose(matvec(p, x) @ v, np.vdot(x, rmatvec(p, v)), rtol=1e-12)
    # chunked over rows (3 rows per chunk here) gives the same values
    w = rng.uniform(0.5, 2.0, p.R.shape[0])
    full = matvec(p, x), rmatvec(p, v), row_diagonal(p, w, 0.3)
    monkeypatch.setattr(margins_mod, "_CHUNK_VALUES", 3 * 2 * 32)
    for a, b in zip(full, (matvec(p, x), rmatvec(p, v), row_diagonal(p, w, 0.3))):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_cg_equals_the_dense_normal_equations_and_row_diagonal_is_exact():
    p = _tiny(seed=2)
    A = _dense(p)
    rng = np.random.default_rng(3)
    w = rng.uniform(0.1, 3.0, p.R.shape[0])
    b = rng.normal(0, 1, p.R.shape[0])
    lam = 0.05
    H = A.T @ (w[:, None] * A) + lam * np.eye(A.shape[1])
    want = np.linalg.solve(H, A.T @ (w * b))
    np.testing.assert_allclose(row_diagonal(p, w, lam), np.diag((w[:, None] * A) @ A.T) + lam, rtol=1e-12)
    got, iters, res = solve_cg(p, w, b, lam, tol=1e-12)
    assert 0 < iters <= 200 and res < 1e-10
    np.testing.assert_allclose(got.ravel(), want, rtol=0, atol=1e-8 * np.abs(want).max())


def test_planted_problem_flips_every_decision_and_keeps_every_constraint():
    """Rows built around a known δ*: it lifts every decision point to 1.5τ and leaves constraint rows untouched,
    so the weighted equations are consistent and a small ridge must reach them."""
    rng = np.random.default_rng(4)
    E, K, D, nd, nc, tau = 6, 2, 32, 20, 20, 0.2
    N = nd + nc
    star = rng.normal(0, 0.1, (E, D))
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(N)])
    R = rng.normal(0, 1, (N, K, D))
    kind = np.arange(N) < nd
    for j in np.nonzero(~kind)[0]:               # constraint rows orthogonal to δ* on their experts
        s = star[ids[j]]
        R[j] -= (R[j] * s).sum() / (s * s).sum() * s
    change = np.einsum("nkd,nkd->n", R, star[ids])
    R[kind] *= (rng.uniform(1.0, 3.0, nd) / change[kind])[:, None, None]     # δ* lifts each by 1 to 3
    change = np.einsum("nkd,nkd->n", R, star[ids])
    m = np.where(kind, 1.5 * tau - change, rng.uniform(0.05, 1.0, N))
    assert (m[kind] < 0).all() and np.abs(change[~kind]).max() < 1e-12
    p = make_problem(ids=ids, R=R, m=m, kind=kind, n_experts=E)
    np.testing.assert_allclose(predict(p, star)[kind], 1.5 * tau)

    sol = solve_margins(p, tau, 1e4, 1e-4, rounds=1)
    mf = sol.float_margins
    assert (mf[kind] > tau - 1e-4).all()          # every decision point lifted to τ
    assert (mf[~kind] > 0).all()
    assert np.abs(mf[~kind] - m[~kind]).max() < 1e-3
    loose = solve_margins(p, tau, 1e-4, 1e-4, rounds=1).float_margins
    assert np.abs(loose[~kind] - m[~kind]).max() > 10 * np.abs(mf[~kind] - m[~kind]).max()


def test_lattice_solution_decodes_exactly_and_predictions_use_it():
    p = _random(5)
    sol = solve_margins(p, 0.3, 1.0, 8.0, rounds=3)
    gains = dequantize_gains(sol.blocks)
    assert sol.delta.dtype == np.float32 and sol.delta.shape == (8, 32)
    assert np.array_equal(gains, sol.gains)
    assert np.array_equal(gains - np.float32(1.0), sol.delta)
    assert np.array_equal(sol.margins, p.m + matvec(p, sol.delta))
    assert np.array_equal(sol.margins, predict(p, sol.delta))
    assert sol.flipped == int((sol.margins[p.kind] > 0).sum())
    assert sol.reached_tau == int((sol.margins[p.kind] >= 0.3).sum()) <= sol.flipped
    assert sol.kept == int((sol.margins[~p.kind] > 0).sum())
    assert sol.flipped_share == sol.flipped / 30 and sol.kept_share == sol.kept / 30
    assert np.abs(sol.delta).max() > 0 and not np.array_equal(sol.float_margins, sol.margins)


def test_active_set_recovers_points_the_rounding_lost():
    """The float solve flips nearly all decision points; the FP4 lattice loses some; boosting the weights of the
    points still below τ brings them back."""
    p = _random(0)
    n_dec, tau, boost = int(p.kind.sum()), 0.3, 4.0
    one = solve_margins(p, tau, 1.0, 8.0, rounds=1)
    sol = solve_margins(p, tau, 1.0, 8.0, rounds=4, boost=boost)
    first = sol.rounds[0]
    assert (first["flipped"], first["kept"]) == (one.flipped, one.kept)     # round 0 is the plain solve
    assert first["flipped"] < first["float_flipped"]          # rounding cost flips
    assert sol.flipped > one.flipped and sol.flipped == n_dec
    assert sol.round >= 1 and sol.kept >= one.kept - 1
    below = p.kind & (one.margins < tau)
    assert sol.rounds[1]["active"] == int(below.sum()) == n_dec - first["reached_tau"]
    assert (sol.weights[below] >= boost).all()
    free = ~p.kind & ~sol.held                                # constraint rows outside the kept active set
    assert (sol.weights[free] == 1.0).all() and (sol.weights[sol.held] >= boost).all()
    for seed in (1, 2, 3):                                    # never worse than one round
        q = _random(seed)
        assert solve_margins(q, tau, 1.0, 8.0).flipped >= solve_margins(q, tau, 1.0, 8.0, rounds=1).flipped


def _ill_conditioned(seed, E=16, D=64, K=2, N=40):
    """Coefficients spanning four decades across channels (many channels touched only weakly) and half the rows
    weighted 1,000 times the others: the primal system's Jacobi-preconditioned CG stalls at its cap here."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(N)])
    R = rng.normal(0, 1, (N, K, D)) * 10.0 ** rng.uniform(-3, 1, (N, K, D))
    kind = np.arange(N) < N // 2
    m = np.where(kind, -rng.uniform(0.5, 1.5, N), rng.uniform(0.2, 2.0, N))
    return make_problem(ids=ids, R=R, m=m, kind=kind, n_experts=E)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cg_converges_on_an_ill_conditioned_system(seed):
    """The primal Jacobi CG this replaced needed the full 1,000-step cap on these systems and stopped at relative
    residuals 4e-5 .. 5e-4; in row space it converges in a few dozen steps to the dense solution."""
    p = _ill_conditioned(seed)
    N = p.R.shape[0]
    A = _dense(p)
    w = np.where(p.kind, 1.0, 1e3)
    b = np.where(p.kind, 1.0 - p.m, 0.0)
    lam = 1e-4
    M = A.T @ (w[:, None] * A) + lam * np.eye(A.shape[1])
    rhs = A.T @ (w * b)
    want = np.linalg.solve(M, rhs)
    got, iters, res = solve_cg(p, w, b, lam, max_iter=1000)
    assert iters <= 2 * N and res < 1e-6
    # the normal equations hold to 1e-6, and the solution is the dense one up to what their conditioning allows
    # (the dense solve's own error differs between BLAS builds and thread counts at the 1e-6 level)
    assert np.linalg.norm(M @ got.ravel() - rhs) <= 1e-6 * np.linalg.norm(rhs)
    np.testing.assert_allclose(got.ravel(), want, rtol=0, atol=1e-5 * np.abs(want).max())


def _tight(seed):
    """Constraint rows barely above their runner-up (margins 0.01 .. 0.05) on the experts the decision points need."""
    return _random(seed, E=6, K=2, D=64, nd=12, nc=48, behind=(1.0, 3.0), ahead=(0.01, 0.05))


@pytest.mark.parametrize("seed", [0, 3])
def test_kept_active_set_holds_rows_the_rounding_would_break(seed):
    """The float solve keeps every constraint row (it asks for no change), but the FP4 lattice's own noise pushes
    many of these near-ties below zero. Boosting their weight alone (κ = 0: the target stays "no change") does not
    help; holding them at κ lifts them out of reach of the noise, and every decision point still flips."""
    p = _tight(seed)
    n_dec, n_con = int(p.kind.sum()), int((~p.kind).sum())
    plain = solve_margins(p, 1.0, 1.0, 1e-3, rounds=1)
    assert plain.flipped == n_dec and plain.kept < n_con - 5
    assert (plain.float_margins[~p.kind] > 0).all()            # lost on the lattice, not by the float solve
    boosted = solve_margins(p, 1.0, 1.0, 1e-3, kappa=0.0, rounds=6)
    assert boosted.kept < n_con
    sol = solve_margins(p, 1.0, 1.0, 1e-3, kappa=0.25, rounds=6)
    assert sol.flipped == n_dec and sol.kept == n_con and sol.kept_share == 1.0
    assert sol.round >= 1 and sol.held.any() and not sol.held[p.kind].any()
    assert sol.rounds[sol.round]["held"] == int(sol.held.sum())
    # held rows are solved towards κ (their float margins sit at κ up to the ridge); rows not held keep their margin
    np.testing.assert_allclose(sol.float_margins[sol.held], 0.25, atol=1e-3)
    free = ~p.kind & ~sol.held
    assert np.abs(sol.float_margins[free] - p.m[free]).max() < 0.05


def test_groups_count_a_position_only_when_all_its_rows_hold():
    """Several rows per position (a against each rival): a decision point is flipped only when every row of its
    group is above 0, a constraint position kept only when every row is; shares are per group."""
    p = _random(7)
    N = len(p.m)
    group = np.arange(N) // 3                                  # three rows per position; 30 + 30 rows -> 10 + 10
    q = make_problem(ids=p.ids, R=p.R, m=p.m, kind=p.kind, n_experts=p.n_experts, group=group)
    sol = solve_margins(q, 0.3, 1.0, 8.0, rounds=1)
    above = (sol.margins > 0).reshape(-1, 3).all(1)
    dec = q.kind[::3]
    assert sol.n_decisions == 10 and sol.n_constraints == 10
    assert sol.flipped == int(above[dec].sum()) and sol.kept == int(above[~dec].sum())
    assert sol.flipped_share == sol.flipped / 10 and sol.kept_share == sol.kept / 10
    flat = solve_margins(p, 0.3, 1.0, 8.0, rounds=1)           # the same rows, one group each: the same δ
    assert np.array_equal(flat.margins, sol.margins)
    assert flat.flipped == int((sol.margins[q.kind] > 0).sum()) >= sol.flipped
    # labels are renumbered by first appearance; a group must not mix kinds
    r = make_problem(ids=p.ids, R=p.R, m=p.m, kind=p.kind, n_experts=p.n_experts, group=100 - group)
    np.testing.assert_array_equal(r.group, group)
    with pytest.raises(ValueError, match="mixes decision and constraint rows"):
        make_problem(ids=p.ids, R=p.R, m=p.m, kind=p.kind, n_experts=p.n_experts, group=(np.arange(N) + 1) // 3)
    with pytest.raises(ValueError, match="group must be"):
        make_problem(ids=p.ids, R=p.R, m=p.m, kind=p.kind, n_experts=p.n_experts, group=group[:-1])


def test_nothing_to_do_leaves_gains_exactly_one():
    p = _random(6)
    p.m[p.kind] = 0.5                     # every decision point already above τ: all targets are 0
    delta, iters, res = solve_cg(p, np.ones(60), np.zeros(60), 1.0)
    assert iters == 0 and res == 0.0 and not delta.any()
    sol = solve_margins(p, 0.3, 1.0, 1.0)
    assert np.array_equal(sol.gains, np.ones((8, 32), np.float32)) and not sol.delta.any()
    assert np.array_equal(sol.margins, p.m) and len(sol.rounds) == 1


def test_bad_input_is_refused_with_the_reason():
    p = _tiny()
    ok = dict(ids=p.ids, R=p.R, m=p.m, kind=p.kind, n_experts=5)
    cases = [
        (dict(ids=p.ids[:, 0]), "ids must be"),
        (dict(ids=p.ids.astype(float)), "integers"),
        (dict(R=p.R[:, :1]), "R must be"),
        (dict(R=p.R[:-1]), "R must be"),
        (dict(m=p.m[:-1]), "m must be"),
        (dict(kind=p.kind[:-1]), "kind must be"),
        (dict(kind=p.kind.astype(float)), "kind must be bool"),
        (dict(n_experts=3), "out of range"),
        (dict(ids=np.where(p.ids == 0, -1, p.ids)), "out of range"),
        (dict(R=np.where(np.arange(12)[:, None, None] == 7, np.nan, p.R)), "R has non-finite.*row 7"),
        (dict(m=np.where(np.arange(12) == 4, np.inf, p.m)), "m has non-finite.*row 4"),
        (dict(R=p.R[..., :16]), "multiple of 32"),
        (dict(R=np.concatenate([p.R, p.R[..., :8]], -1)), "multiple of 32"),
        (dict(m=np.where(p.kind, p.m, -0.1)), "constraint row 0"),
        (dict(n_experts=0), "n_experts"),
    ]
    for change, msg in cases:
        with pytest.raises(ValueError, match=msg):
            make_problem(**{**ok, **change})
    with pytest.raises(ValueError, match="delta must be"):
        matvec(p, np.zeros((5, 64)))
    with pytest.raises(ValueError, match="weights must be finite"):
        solve_cg(p, -np.ones(12), np.zeros(12), 1.0)
    with pytest.raises(ValueError, match="tau"):
        solve_margins(p, 0.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="kappa"):
        solve_margins(p, 1.0, 1.0, 1.0, kappa=-0.1)
    with pytest.raises(ValueError, match="lam must be finite and > 0"):
        solve_cg(p, np.ones(12), np.ones(12), 0.0)
    with pytest.raises(ValueError, match="max_iter"):
        solve_cg(p, np.ones(12), np.ones(12), 1.0, max_iter=-1)


# ---------------------------------------------------------------------------------------------------- block-Jacobi
def _correlated(seed, E=12, K=3, D=64, positions=16, M=8, spread=0.1):
    """Positions of M rows each, as the capture builds them: one position's rows share its experts, routing weights
    and expert outputs (c [K, D]) and differ only in the head difference u = W_a − W_b, here a common part plus
    `spread` of noise (rivals of one token have similar head rows), so a group's rows are strongly correlated."""
    rng = np.random.default_rng(seed)
    N = positions * M
    group = np.repeat(np.arange(positions), M)
    pos_ids = np.stack([rng.choice(E, K, replace=False) for _ in range(positions)])
    c = rng.normal(0, 1, (positions, K, D)) * rng.uniform(0.2, 3.0, (positions, 1, 1))
    u = rng.normal(0, 1, (positions, 1, D)) + spread * rng.normal(0, 1, (positions, M, D))
    R = (u.reshape(N, 1, D) * c[group]).reshape(N, K, D)
    kind = np.repeat(np.arange(positions) < positions // 4, M)
    m = np.where(kind, -rng.uniform(0.5, 2.0, N), rng.uniform(0.1, 2.0, N))
    return make_problem(ids=pos_ids[group], R=R, m=m, kind=kind, n_experts=E, group=group)


def _row_space(p, w, lam):
    A = _dense(p)
    s = np.sqrt(w)
    return (s[:, None] * A) @ (A.T * s[None, :]) + lam * np.eye(len(w))


def test_block_preconditioner_inverts_each_groups_block():
    p = _correlated(0, positions=6, M=4)
    rng = np.random.default_rng(1)
    w = rng.uniform(0.5, 4.0, len(p.m))
    lam = 1e-2
    S = _row_space(p, w, lam)
    pre = block_preconditioner(p, w, lam)
    assert pre.idx.shape == (6, 4) and pre.inv.shape == (6, 4, 4)
    r = rng.normal(0, 1, len(p.m))
    want = np.zeros_like(r)
    for g in range(6):
        rows = np.nonzero(p.group == g)[0]
        np.testing.assert_array_equal(pre.idx[g], rows)
        want[rows] = np.linalg.solve(S[np.ix_(rows, rows)], r[rows])
    np.testing.assert_allclose(pre.apply(r), want, rtol=1e-9, atol=1e-12 * np.abs(want).max())
    # one row per group: exactly the Jacobi diagonal
    q = make_problem(ids=p.ids, R=p.R, m=p.m, kind=p.kind, n_experts=p.n_experts)
    np.testing.assert_allclose(block_preconditioner(q, w, lam).apply(r), r / row_diagonal(q, w, lam), rtol=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
def test_block_jacobi_cg_reaches_the_dense_solution_in_fewer_steps(seed):
    p = _correlated(seed)
    N = len(p.m)
    w = np.where(p.kind, 1.0, 10.0)
    b = np.where(p.kind, 1.0 - p.m, 0.0)
    lam = 1e-3
    A = _dense(p)
    H = A.T @ (w[:, None] * A) + lam * np.eye(A.shape[1])
    rhs = A.T @ (w * b)
    want = np.linalg.solve(H, rhs)
    got, it_block, res = solve_cg(p, w, b, lam, precond="block")
    ref, it_jacobi, res_j = solve_cg(p, w, b, lam, precond="jacobi")
    plain = solve_cg(p, w, b, lam, precond="jacobi", max_iter=it_block)[0]      # Jacobi stopped at block's count
    assert res < 1e-7 and res_j < 1e-7
    assert np.linalg.norm(H @ got.ravel() - rhs) <= 1e-6 * np.linalg.norm(rhs)
    np.testing.assert_allclose(got.ravel(), want, rtol=0, atol=1e-5 * np.abs(want).max())
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    assert it_block <= 0.6 * it_jacobi and it_block < N
    assert np.abs(plain - ref).max() > 10 * np.abs(got - ref).max()


def test_block_preconditioner_survives_singular_and_badly_scaled_blocks():
    """A group with two identical rows (a rival listed twice: its block is singular but for λ), groups whose rows
    are scaled by 1e±6, and a row with weight 0: the preconditioner stays finite and symmetric positive definite,
    and CG still converges to the dense solution."""
    p = _correlated(2, positions=8, M=4)
    R, m, kind = p.R.copy(), p.m.copy(), p.kind
    R[1] = R[0]
    m[1] = m[0]
    R[p.group == 3] *= 1e6
    R[p.group == 4] *= 1e-6
    R[p.group == 5, :, :] *= 10.0 ** np.arange(-3, 1)[:, None, None]      # four decades inside one block
    q = make_problem(ids=p.ids, R=R, m=m, kind=kind, n_experts=p.n_experts, group=p.group)
    w = np.ones(len(m))
    w[9] = 0.0
    lam = 1e-9
    pre = block_preconditioner(q, w, lam)
    assert np.isfinite(pre.inv).all()
    for blk in pre.inv:
        np.testing.assert_allclose(blk, blk.T, rtol=1e-9, atol=0)
        assert np.linalg.eigvalsh(blk).min() > 0
    b = np.where(kind, 1.0 - m, 0.0)
    S = _row_space(q, w, lam)
    y = np.linalg.solve(S, np.sqrt(w) * b)
    want = rmatvec(q, np.sqrt(w) * y)
    got, iters, _ = solve_cg(q, w, b, lam, precond="block", tol=1e-10)
    jacobi_iters = solve_cg(q, w, b, lam, precond="jacobi", tol=1e-10)[1]
    assert iters < min(len(m), jacobi_iters)
    # the rows' changes A·δ are what the solve is for; the normal equations' own residual is limited here by the
    # 1e12 spread of the rows' scales (rounding), not by CG
    np.testing.assert_allclose(matvec(q, got), matvec(q, want), rtol=0, atol=1e-7 * np.abs(matvec(q, want)).max())
    with pytest.raises(ValueError, match="precond must be one of"):
        solve_cg(q, w, b, lam, precond="cholesky")


def test_dense_row_space_solve_equals_cg_and_the_dense_normal_equations():
    """row_gram is A Aᵀ (an expert listed twice in a row included); solve_dense solves the same system as CG."""
    p = _tiny(seed=2)
    A = _dense(p)
    np.testing.assert_allclose(row_gram(p), A @ A.T, rtol=1e-12, atol=1e-12)
    q = _correlated(3)
    rng = np.random.default_rng(4)
    w = rng.uniform(0.5, 8.0, len(q.m))
    b = np.where(q.kind, 1.0 - q.m, 0.0)
    A = _dense(q)
    H = A.T @ (w[:, None] * A) + 1e-3 * np.eye(A.shape[1])
    want = np.linalg.solve(H, A.T @ (w * b))
    got, iters, res = solve_dense(q, w, b, 1e-3)
    assert iters == 0 and res < 1e-9
    np.testing.assert_allclose(got.ravel(), want, rtol=0, atol=1e-7 * np.abs(want).max())
    cg = solve_cg(q, w, b, 1e-3)[0]
    np.testing.assert_allclose(got, cg, rtol=0, atol=1e-5 * np.abs(cg).max())
    dense = solve_margins(q, 1.0, 1.0, 1e-3, method="dense")
    by_cg = solve_margins(q, 1.0, 1.0, 1e-3, method="cg")
    assert [r["method"] for r in dense.rounds] == ["dense"] * len(dense.rounds)
    assert by_cg.rounds[0]["method"] == "cg/block" and by_cg.rounds[0]["iterations"] > 0
    assert solve_margins(q, 1.0, 1.0, 1e-3).rounds[0]["method"] == "dense"          # auto: few rows
    np.testing.assert_allclose(dense.rounds[0]["float_flipped"], by_cg.rounds[0]["float_flipped"])
    assert abs(dense.flipped - by_cg.flipped) <= 1 and abs(dense.kept - by_cg.kept) <= 1
    with pytest.raises(ValueError, match="method must be one of"):
        solve_margins(q, 1.0, 1.0, 1e-3, method="lu")


def test_stack_problems_keeps_each_problems_positions_apart():
    a, b = _correlated(5, positions=3, M=2, E=12), _correlated(6, positions=4, M=3, E=12)
    s = stack_problems([a, b])
    assert len(s.m) == len(a.m) + len(b.m)
    np.testing.assert_array_equal(s.group, np.r_[a.group, b.group + 3])
    np.testing.assert_array_equal(s.R, np.concatenate([a.R, b.R]))
    np.testing.assert_array_equal(s.kind, np.r_[a.kind, b.kind])
    with pytest.raises(ValueError, match="different shapes"):
        stack_problems([a, _correlated(5, positions=3, M=2, E=12, D=32)])
    with pytest.raises(ValueError, match="no problems"):
        stack_problems([])


def test_weighted_ridge_solves_the_weighted_normal_equations():
    """ridge[e, d] weighs λ‖δ‖² per gain: the float solution is the dense one of (AᵀWA + λ·diag(ridge))δ = AᵀWb;
    ordinary_ridge is 1 + (ρ/λ)·diag(A_oᵀA_o)/positions (an expert listed twice in a row included)."""
    p = _correlated(7, positions=10, M=3, E=8, K=2, D=32)
    A = _dense(p)
    o = _tiny(seed=3, E=8)                               # "ordinary" rows: one expert twice in row 5
    Ao = _dense(o)
    ridge = ordinary_ridge(o, 0.01, 0.5)
    np.testing.assert_allclose(ridge.ravel(), 1 + 50 * (Ao * Ao).sum(0) / 12, rtol=1e-12)
    tau, lam = 1.0, 0.01
    sol = solve_margins(p, tau, 1.0, lam, rounds=1, ridge=ridge)
    w = np.ones(len(p.m))
    b = np.where(p.kind, np.maximum(tau - p.m, 0), 0.0)
    want = np.linalg.solve(A.T @ A + lam * np.diag(ridge.ravel()), A.T @ (w * b))
    np.testing.assert_allclose(sol.float_margins, p.m + A @ want, rtol=0, atol=1e-8)
    plain = solve_margins(p, tau, 1.0, lam, rounds=1)
    assert not np.allclose(plain.float_margins, sol.float_margins)
    same = solve_margins(p, tau, 1.0, lam, rounds=1, ridge=np.ones((8, 32)))
    np.testing.assert_allclose(same.float_margins, plain.float_margins, rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="ridge must be"):
        solve_margins(p, tau, 1.0, lam, ridge=np.zeros((8, 32)))

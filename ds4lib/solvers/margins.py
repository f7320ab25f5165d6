"""The ③ post-training solve of the last MoE layer (docs/design.md §4): per-expert gain deltas δ on the down
projection's output channels, fitted so that chosen decision points flip while every other captured position keeps
its top choice.

With the final norm factor held fixed, a logit margin is linear in the last layer's gains. Row i (a captured
position, its K routed experts e_ik and coefficients R_i [K, D] computed by the caller) changes its margin by

    r_i · δ = Σ_k Σ_d R_i[k, d] · δ[e_ik, d]        (stored gain s_e = 1 + δ_e; δ = 0 changes nothing)

Two kinds of rows, with current margin m_i:
    decision point  (ℓ_a − ℓ_b, usually < 0): want m_i + r_i·δ ≥ τ   ->  r_i·δ = b_i = max(τ − m_i, 0), weight 1
    constraint row  (top-1 − top-2, ≥ 0):     keep m_j + r_j·δ > 0   ->  r_j·δ = 0,                 weight ρ
(a decision point already at or above τ gets b = 0: it is kept where it is, never pulled down to τ).

Objective:  Σ_i w_i (r_i·δ − b_i)² + λ ‖δ‖²,  i.e. the normal equations (AᵀWA + λI) δ = AᵀWb over E·D unknowns,
solved matrix-free by conjugate gradient with a Jacobi preconditioner (the exact diagonal of AᵀWA + λI, computed
from R). A·δ is a gather of δ at the rows' experts; Aᵀ·v a bincount scatter back to [E, D]; rows are processed
in chunks so no temporary grows past a few million values, and no matrix over the E·D unknowns is ever formed.

FP4-aware active set: each round solves in float, rounds δ to the stored lattice (FP4 E2M1, one power-of-two
scale per 32 channels: ds4lib.formats.sidecar.quantize_gains), predicts every row's margin with the lattice
values, and multiplies by `boost` the weight of each decision point still predicted below τ before the next
round. The best lattice solution wins: most decision points predicted flipped (margin > 0), ties to fewest
constraint rows predicted broken (margin no longer > 0), then to the earlier round.

No files, no model objects. Shapes: N rows, K active experts, E experts, D hidden (a multiple of 32),
G = D/32 blocks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ds4lib.formats.sidecar import GROUP, dequantize_gains, quantize_gains

__all__ = ["MarginProblem", "MarginSolution", "make_problem", "matvec", "rmatvec", "jacobi_diagonal", "solve_cg",
           "solve_margins", "predict"]

_CHUNK_VALUES = 1 << 22          # rows per chunk = this // (K·D): temporaries of ~32 MB at most


@dataclass
class MarginProblem:
    """One layer's rows, float64: ids [N, K] routed experts, R [N, K, D] margin coefficients, m [N] current
    margins, kind [N] bool (True = decision point, False = constraint row)."""
    ids: np.ndarray
    R: np.ndarray
    m: np.ndarray
    kind: np.ndarray
    n_experts: int


@dataclass
class MarginSolution:
    delta: np.ndarray            # [E, D] float32 lattice δ = gains − 1 (what the engine applies)
    gains: np.ndarray            # [E, D] float32 s = dequantize_gains(blocks)
    blocks: np.ndarray           # uint8 [E, G, 17] the stored form of δ (sidecar.write_layer_files)
    margins: np.ndarray          # [N] predicted margins with the lattice δ
    float_margins: np.ndarray    # [N] predicted margins with the same round's float δ
    flipped: int                 # decision points with predicted margin > 0
    flipped_share: float         # flipped / decision points (0 when there are none)
    reached_tau: int             # decision points with predicted margin ≥ τ
    kept: int                    # constraint rows with predicted margin > 0
    kept_share: float            # kept / constraint rows (1 when there are none)
    n_decisions: int
    n_constraints: int
    round: int                   # the round whose lattice solution was chosen
    weights: np.ndarray          # [N] the row weights of that round's solve
    rounds: list = field(default_factory=list)   # per round: {round, active, iterations, residual,
    #                                              float_flipped, flipped, reached_tau, kept}


def make_problem(*, ids, R, m, kind, n_experts: int) -> MarginProblem:
    """Validate and convert. ids [N, K] integers in [0, E); R [N, K, D] finite, D a positive multiple of 32;
    m [N] finite (constraint rows ≥ 0); kind [N] bool. Raises ValueError naming what is wrong."""
    ids, R, m, kind = np.asarray(ids), np.asarray(R), np.asarray(m), np.asarray(kind)
    if isinstance(n_experts, (bool, np.bool_)) or not isinstance(n_experts, (int, np.integer)) or n_experts < 1:
        raise ValueError(f"n_experts must be a positive integer, got {n_experts!r}")
    E = int(n_experts)
    if ids.ndim != 2 or ids.shape[1] < 1:
        raise ValueError(f"ids must be [N, K] with K ≥ 1, got shape {list(ids.shape)}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"ids must be integers, got dtype {ids.dtype}")
    N, K = ids.shape
    if R.ndim != 3 or R.shape[:2] != (N, K):
        raise ValueError(f"R must be [N, K, D] = [{N}, {K}, D], got shape {list(R.shape)}")
    D = R.shape[2]
    if D < GROUP or D % GROUP:
        raise ValueError(f"D = {D} channels is not a positive multiple of {GROUP} (one FP4 scale per {GROUP})")
    if m.shape != (N,):
        raise ValueError(f"m must be [N] = [{N}], got shape {list(m.shape)}")
    if kind.shape != (N,):
        raise ValueError(f"kind must be [N] = [{N}], got shape {list(kind.shape)}")
    if kind.dtype != bool:
        if not np.issubdtype(kind.dtype, np.integer) or not np.isin(kind, (0, 1)).all():
            raise ValueError(f"kind must be bool (True = decision point), got dtype {kind.dtype}")
        kind = kind.astype(bool)
    ids = ids.astype(np.int64)
    if N and (ids.min() < 0 or ids.max() >= E):
        bad = ids[(ids < 0) | (ids >= E)][0]
        raise ValueError(f"ids out of range: expert {bad} with n_experts = {E}")
    if not np.issubdtype(R.dtype, np.number) or not np.issubdtype(m.dtype, np.number):
        raise ValueError(f"R and m must be numeric, got dtypes {R.dtype}, {m.dtype}")
    R, m = R.astype(np.float64), m.astype(np.float64)
    if not np.isfinite(R).all():
        i = int(np.nonzero(~np.isfinite(R).all((1, 2)))[0][0])
        raise ValueError(f"R has non-finite values (first in row {i})")
    if not np.isfinite(m).all():
        i = int(np.nonzero(~np.isfinite(m))[0][0])
        raise ValueError(f"m has non-finite values (first in row {i})")
    if (m[~kind] < 0).any():
        i = int(np.nonzero(~kind & (m < 0))[0][0])
        raise ValueError(f"constraint row {i} has margin {m[i]} < 0 (top-1 − top-2 cannot be negative)")
    return MarginProblem(ids=ids, R=R, m=m, kind=kind, n_experts=E)


def _chunks(p: MarginProblem):
    N, K, D = p.R.shape
    step = max(1, _CHUNK_VALUES // (K * D))
    for a in range(0, N, step):
        yield slice(a, min(N, a + step))


def _scatter(p: MarginProblem, rows: slice, vals) -> np.ndarray:
    """Σ of vals [n, K, D] into flat [E·D] at (ids[rows, k], d)."""
    E, D = p.n_experts, p.R.shape[2]
    flat = (p.ids[rows][:, :, None] * D + np.arange(D)).ravel()
    return np.bincount(flat, weights=vals.ravel(), minlength=E * D)


def _check_delta(p: MarginProblem, delta) -> np.ndarray:
    delta = np.asarray(delta, np.float64)
    if delta.shape != (p.n_experts, p.R.shape[2]):
        raise ValueError(f"delta must be [E, D] = [{p.n_experts}, {p.R.shape[2]}], got {list(delta.shape)}")
    return delta


def matvec(p: MarginProblem, delta) -> np.ndarray:
    """A·δ: each row's margin change r_i·δ -> [N] float64."""
    delta = _check_delta(p, delta)
    out = np.empty(p.R.shape[0])
    for rows in _chunks(p):
        out[rows] = np.einsum("nkd,nkd->n", p.R[rows], delta[p.ids[rows]])
    return out


def rmatvec(p: MarginProblem, v) -> np.ndarray:
    """Aᵀ·v: Σ_i v_i R_i scattered to the rows' experts -> [E, D] float64."""
    v = np.asarray(v, np.float64)
    if v.shape != (p.R.shape[0],):
        raise ValueError(f"v must be [N] = [{p.R.shape[0]}], got {list(v.shape)}")
    E, D = p.n_experts, p.R.shape[2]
    out = np.zeros(E * D)
    for rows in _chunks(p):
        out += _scatter(p, rows, v[rows, None, None] * p.R[rows])
    return out.reshape(E, D)


def jacobi_diagonal(p: MarginProblem, weights, lam: float) -> np.ndarray:
    """diag(AᵀWA + λI) -> [E, D]: Σ_i w_i (Σ_{k: e_ik = e} R_i[k, d])² + λ. An expert listed twice in one row
    has its coefficients summed before squaring (exact for any ids)."""
    w = _check_weights(p, weights)
    E, D = p.n_experts, p.R.shape[2]
    out = np.zeros(E * D)
    for rows in _chunks(p):
        ids = p.ids[rows]
        same = ids[:, :, None] == ids[:, None, :]                                      # [n, K, K]
        first = ~np.tril(same, -1).any(-1)                                             # [n, K] first occurrence
        S = np.einsum("nkj,njd->nkd", same.astype(np.float64), p.R[rows])              # merged coefficients
        out += _scatter(p, rows, (w[rows, None] * first)[:, :, None] * S * S)
    return out.reshape(E, D) + float(lam)


def _check_weights(p: MarginProblem, weights) -> np.ndarray:
    w = np.asarray(weights, np.float64)
    if w.shape != (p.R.shape[0],):
        raise ValueError(f"weights must be [N] = [{p.R.shape[0]}], got {list(w.shape)}")
    if not np.isfinite(w).all() or (w < 0).any():
        raise ValueError("weights must be finite and ≥ 0")
    return w


def predict(p: MarginProblem, delta) -> np.ndarray:
    """Predicted margins m + A·δ -> [N] float64."""
    return p.m + matvec(p, delta)


def solve_cg(p: MarginProblem, weights, b, lam: float, *, tol: float = 1e-8, max_iter: int = 1000, x0=None):
    """Jacobi-preconditioned CG on (AᵀWA + λI) δ = AᵀWb, from x0 (default 0). Stops when the recursive residual
    ‖AᵀWb − (AᵀWA + λI)δ‖ / ‖AᵀWb‖ ≤ tol or after max_iter updates. Returns (δ [E, D] float64, iterations, the
    true relative residual recomputed at the end)."""
    w = _check_weights(p, weights)
    b = np.asarray(b, np.float64)
    if b.shape != w.shape or not np.isfinite(b).all():
        raise ValueError(f"b must be [N] = [{w.shape[0]}] finite values")
    if not np.isfinite(lam) or lam < 0:
        raise ValueError(f"lam must be finite and ≥ 0, got {lam}")

    def op(x):
        return rmatvec(p, w * matvec(p, x)) + lam * x

    rhs = rmatvec(p, w * b)
    bnorm = float(np.linalg.norm(rhs))
    if bnorm == 0.0:
        return np.zeros_like(rhs), 0, 0.0
    diag = jacobi_diagonal(p, w, lam)
    inv = np.where(diag > 0, 1.0 / np.where(diag > 0, diag, 1.0), 1.0)
    x = np.zeros_like(rhs) if x0 is None else _check_delta(p, x0).copy()
    r = rhs - op(x) if x0 is not None else rhs.copy()
    z = inv * r
    d = z.copy()
    rz = float(np.vdot(r, z))
    it = 0
    while it < max_iter and np.linalg.norm(r) > tol * bnorm:
        q = op(d)
        dq = float(np.vdot(d, q))
        if dq <= 0.0:                      # a null direction of a singular system (λ = 0): nothing left to gain
            break
        alpha = rz / dq
        x += alpha * d
        r -= alpha * q
        it += 1
        z = inv * r
        rz_new = float(np.vdot(r, z))
        d = z + (rz_new / rz) * d
        rz = rz_new
    return x, it, float(np.linalg.norm(rhs - op(x)) / bnorm)


def _counts(p: MarginProblem, margins, tau: float) -> dict:
    dec, con = p.kind, ~p.kind
    return {"flipped": int((margins[dec] > 0).sum()), "reached_tau": int((margins[dec] >= tau).sum()),
            "kept": int((margins[con] > 0).sum())}


def solve_margins(p: MarginProblem, tau: float, rho: float, lam: float, *, rounds: int = 4, boost: float = 4.0,
                  tol: float = 1e-8, max_iter: int = 1000) -> MarginSolution:
    """Up to `rounds` float solves, each rounded to the FP4 lattice; between rounds the weight of every decision
    point predicted below τ (on the lattice) is multiplied by `boost` (weights raised earlier stay raised). Stops
    early once every decision point reaches τ. Each solve starts from the previous float δ."""
    if not np.isfinite(tau) or tau <= 0:
        raise ValueError(f"tau must be a finite target margin > 0, got {tau}")
    if not np.isfinite(rho) or rho < 0:
        raise ValueError(f"rho must be finite and ≥ 0, got {rho}")
    if rounds < 1 or not np.isfinite(boost) or boost < 1:
        raise ValueError(f"need rounds ≥ 1 and boost ≥ 1, got rounds={rounds}, boost={boost}")
    dec = p.kind
    w = np.where(dec, 1.0, float(rho))
    b = np.where(dec, np.maximum(tau - p.m, 0.0), 0.0)
    n_dec, n_con = int(dec.sum()), int((~dec).sum())
    x, active, history, best = None, 0, [], None
    for rnd in range(rounds):
        x, it, res = solve_cg(p, w, b, lam, tol=tol, max_iter=max_iter, x0=x)
        blocks = quantize_gains(x.astype(np.float32))
        gains = dequantize_gains(blocks)
        delta = gains - np.float32(1.0)
        mq, mf = predict(p, delta), predict(p, x)
        c = _counts(p, mq, tau)
        history.append({"round": rnd, "active": active, "iterations": it, "residual": res,
                        "float_flipped": int((mf[dec] > 0).sum()), **c})
        key = (c["flipped"], c["kept"])            # more kept = fewer constraint rows broken
        if best is None or key > best[0]:
            best = (key, rnd, delta, gains, blocks, mq, mf, c, w.copy())
        below = dec & (mq < tau)
        if not below.any():
            break
        active = int(below.sum())
        w = np.where(below, w * boost, w)
    _, rnd, delta, gains, blocks, mq, mf, c, wb = best
    return MarginSolution(delta=delta, gains=gains, blocks=blocks, margins=mq, float_margins=mf,
                          flipped=c["flipped"], flipped_share=c["flipped"] / n_dec if n_dec else 0.0,
                          reached_tau=c["reached_tau"], kept=c["kept"],
                          kept_share=c["kept"] / n_con if n_con else 1.0, n_decisions=n_dec, n_constraints=n_con,
                          round=rnd, weights=wb, rounds=history)

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

Groups. One position can give several rows: the right (or top-1) token a against each of its strongest rivals, since
a pair's margin says nothing about a third token overtaking both (on ds4-tiny's day 1, with one row per position, 8
of 25 decision points whose right token beat the written one in a real forward were overtaken by a third token).
`group` [N] names the position of each row; a decision point counts as flipped (reached τ) when every row of its
group is > 0 (≥ τ), a constraint position as kept when every row of its group is > 0. The counts and shares are
per group; the equations and the active set stay per row.

Objective:  Σ_i w_i (r_i·δ − b_i)² + λ ‖δ‖²  (λ > 0),  i.e. the normal equations (AᵀWA + λI) δ = AᵀWb over the E·D
unknowns. A·δ is a gather of δ at the rows' experts; Aᵀ·v a bincount scatter back to [E, D]; rows are processed in
chunks so no temporary grows past a few million values, and no matrix over the E·D unknowns is ever formed.

Conjugate gradient in row space. The rows are few (N ≪ E·D: the seed's 3,341 rows against 1.97M gains), so the
solve runs on the N×N system (S A Aᵀ S + λI) y = S b, S = W^½, and returns δ = Aᵀ S y: the same δ, because
(AᵀWA + λI) AᵀS = AᵀS (S A Aᵀ S + λI). It is still matrix-free (each step one A·δ and one Aᵀ·v, as in the primal)
and Jacobi-preconditioned, with the exact diagonal w_i ‖r_i‖² + λ (row_diagonal). Why not the primal system with
its own Jacobi diagonal: AᵀWA + λI is rank N plus λI, so plain CG on it needs about N steps, but dividing by its
diagonal turns λI into λ·diag⁻¹, thousands of distinct eigenvalues (the diagonal of ds4-tiny's day 1 spans
1e-3 .. 11.9 because many channels are touched by one weak row), and CG then took 1,760 steps to 1e-8 at ρ = 1 and
stopped at its 1,000-step cap at ρ = 10 (BENCHMARKS.md, issue 14). In row space the Jacobi diagonal cancels the row
weights: 81, 83, 87 steps at ρ = 1, 10, 100 on the same rows.

Block-Jacobi (`precond="block"`, the default). The rows of one position (one group: a against each of its M rivals)
share its routed experts, their routing weights and expert outputs, and differ only in the head difference W_a − W_b,
so they are strongly correlated: the diagonal sees none of that, and with 16 rivals per position on ds4-tiny's days
(2,400–3,000 rows) Jacobi CG ran into its 1,000-step cap. The block preconditioner inverts each group's own M×M block
of S A Aᵀ S + λI (block_preconditioner): computed once per solve from the rows' [M·K, M·K] Gram products, scaled to a
unit diagonal and inverted through its eigendecomposition with the eigenvalues floored at `BLOCK_FLOOR` of the
largest, so a block that is singular to rounding (two rivals with the same head row) or badly scaled (rows whose
norms differ by many decades, a zero weight) still gives a symmetric positive definite preconditioner. One row per
group makes it the Jacobi diagonal exactly.

Dense row space (`method="dense"`; "auto" picks it up to DENSE_MAX_ROWS rows). Block-Jacobi cut the condition number
of day 1's 2,960-row system (τ = 2, 16 rivals, λ = 1e-3) from 1.5e5 (Jacobi) to 1.5e4, and CG still needed ~700 steps
a round. But N×N is small at that size: A Aᵀ, formed expert by expert (Σ_e Y_e Y_eᵀ, Y_e the rows' coefficients on
expert e's channels), costs Σ_e N_e²·D ≈ 1.7 GFlop there (0.9 s), and one LU solve of S A Aᵀ S + λI per lattice
round is exact. It is the same system and the same δ = Aᵀ S y as CG's; CG stays for more rows than fit in memory.

Weighted ridge (`ridge`). λ‖δ‖² treats every gain alike, but the gains differ in how much ordinary text depends on
them: a channel that many positions route through at large amplitude moves their logits when scaled. With ridge[e, d]
the penalty is λ Σ ridge·δ², e.g. 1 + (ρ_o/λ)·diag(A_oᵀA_o)/n_o from ordinary-text rows A_o (their normal matrix's
diagonal: each ordinary row's squared change with the cross-channel terms dropped; ds4lib.posttrain.keep). It is the
plain ridge in the variable ridge^½·δ, i.e. the same solvers on rows scaled by ridge^-½ per channel.

FP4-aware active set: each round solves in float, rounds δ to the stored lattice (FP4 E2M1, one power-of-two
scale per 32 channels: ds4lib.formats.sidecar.quantize_gains) and predicts every row's margin with the lattice
values. Rounding moves margins by a noise of its own (on day 1: std 0.07, up to 0.31 on the constraint rows), which
the float solve cannot see, so two kinds of rows join the active set for the next round:
    a decision point still predicted below τ: its weight × `boost` (weights raised earlier stay raised);
    a constraint row pushed down below the floor κ (lattice margin ≤ 0, or < min(κ, m_j)): it becomes an explicit
    row like a decision point, r_j·δ = max(κ − m_j, 0) with weight max(w_j, 1) × `boost` (once held, it stays
    held and its weight keeps growing while it is still below). The kept condition is an inequality (margin > 0),
    not "no change": a row that sits barely above its runner-up is lifted to κ, out of reach of the rounding noise.
The best lattice solution wins: fewest rows on the wrong side (decision points not flipped, i.e. margin ≤ 0, plus
constraint rows broken, margin no longer > 0), ties to more decision points flipped, then to the earlier round.

No files, no model objects. Shapes: N rows, K active experts, E experts, D hidden (a multiple of 32),
G = D/32 blocks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ds4lib.formats.sidecar import GROUP, dequantize_gains, quantize_gains

__all__ = ["MarginProblem", "MarginSolution", "make_problem", "stack_problems", "group_kinds", "matvec", "rmatvec", "row_diagonal",
           "block_preconditioner", "BlockPreconditioner", "PRECONDITIONERS", "row_gram", "solve_dense", "solve_cg",
           "ordinary_ridge", "solve_margins", "predict"]

_CHUNK_VALUES = 1 << 22          # rows per chunk = this // (K·D): temporaries of ~32 MB at most
PRECONDITIONERS = ("jacobi", "block")
METHODS = ("auto", "dense", "cg")
DENSE_MAX_ROWS = 8192            # "auto" forms the N×N row-space matrix up to here (N² float64: 512 MB at 8,192)
BLOCK_FLOOR = 1e-12              # smallest eigenvalue of a unit-diagonal block kept, relative to its largest


@dataclass
class MarginProblem:
    """One layer's rows, float64: ids [N, K] routed experts, R [N, K, D] margin coefficients, m [N] current
    margins, kind [N] bool (True = decision point, False = constraint row), group [N] int64 the position each row
    belongs to, numbered 0 .. groups − 1 in order of first appearance."""
    ids: np.ndarray
    R: np.ndarray
    m: np.ndarray
    kind: np.ndarray
    n_experts: int
    group: np.ndarray = None


@dataclass
class MarginSolution:
    delta: np.ndarray            # [E, D] float32 lattice δ = gains − 1 (what the engine applies)
    gains: np.ndarray            # [E, D] float32 s = dequantize_gains(blocks)
    blocks: np.ndarray           # uint8 [E, G, 17] the stored form of δ (sidecar.write_layer_files)
    margins: np.ndarray          # [N] predicted margins with the lattice δ
    float_margins: np.ndarray    # [N] predicted margins with the same round's float δ
    flipped: int                 # decision points (groups) with every predicted margin > 0
    flipped_share: float         # flipped / decision points (0 when there are none)
    reached_tau: int             # decision points with every predicted margin ≥ τ
    kept: int                    # constraint positions (groups) with every predicted margin > 0
    kept_share: float            # kept / constraint positions (1 when there are none)
    n_decisions: int             # decision groups
    n_constraints: int           # constraint groups
    round: int                   # the round whose lattice solution was chosen
    weights: np.ndarray          # [N] the row weights of that round's solve
    held: np.ndarray             # [N] bool: constraint rows held at κ in that round's solve
    rounds: list = field(default_factory=list)   # per round: {round, active, held, iterations, residual,
    #                                              float_flipped, flipped, reached_tau, kept}


def make_problem(*, ids, R, m, kind, n_experts: int, group=None) -> MarginProblem:
    """Validate and convert. ids [N, K] integers in [0, E); R [N, K, D] finite, D a positive multiple of 32;
    m [N] finite (constraint rows ≥ 0); kind [N] bool; group [N] integer labels (None: one group per row; the
    rows of a group must share their kind), renumbered 0 .. groups − 1 by first appearance. Raises ValueError
    naming what is wrong."""
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
    return MarginProblem(ids=ids, R=R, m=m, kind=kind, n_experts=E, group=_groups(group, kind))


def stack_problems(problems) -> MarginProblem:
    """Several problems of one layer as one: rows in the order given, each problem's groups after the previous
    problem's (a problem's positions stay its own)."""
    problems = list(problems)
    if not problems:
        raise ValueError("no problems to stack")
    E = problems[0].n_experts
    if any(q.n_experts != E or q.R.shape[1:] != problems[0].R.shape[1:] for q in problems):
        raise ValueError("problems of different shapes (experts, K, D) cannot be stacked")
    offs = np.cumsum([0] + [int(q.group.max()) + 1 if len(q.group) else 0 for q in problems[:-1]])
    return make_problem(ids=np.concatenate([q.ids for q in problems]), R=np.concatenate([q.R for q in problems]),
                        m=np.concatenate([q.m for q in problems]), kind=np.concatenate([q.kind for q in problems]),
                        n_experts=E, group=np.concatenate([q.group + o for q, o in zip(problems, offs)]))

def _groups(group, kind) -> np.ndarray:
    N = len(kind)
    if group is None:
        return np.arange(N, dtype=np.int64)
    group = np.asarray(group)
    if group.shape != (N,) or (N and not np.issubdtype(group.dtype, np.integer)):
        raise ValueError(f"group must be [N] = [{N}] integers, got shape {list(group.shape)}, dtype {group.dtype}")
    _, first, inverse = np.unique(group, return_index=True, return_inverse=True)
    order = np.argsort(np.argsort(first, kind="stable"), kind="stable")         # label -> rank of first row
    out = order[inverse].astype(np.int64)
    mixed = np.nonzero(kind != kind[first[inverse]])[0]
    if len(mixed):
        raise ValueError(f"group {group[mixed[0]]} mixes decision and constraint rows (row {int(mixed[0])})")
    return out


def _all_by_group(p: MarginProblem, ok) -> np.ndarray:
    """[groups] bool: every row of the group satisfies ok [N]."""
    n = int(p.group.max()) + 1 if len(p.group) else 0
    return np.bincount(p.group, weights=(~np.asarray(ok, bool)).astype(np.float64), minlength=n) == 0


def group_kinds(p: MarginProblem) -> np.ndarray:
    """[groups] bool: True for a decision point's group."""
    n = int(p.group.max()) + 1 if len(p.group) else 0
    out = np.zeros(n, bool)
    out[p.group] = p.kind
    return out


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


def row_diagonal(p: MarginProblem, weights, lam: float) -> np.ndarray:
    """diag(S A Aᵀ S + λI) -> [N]: w_i ‖r_i‖² + λ, r_i the row over all E·D unknowns (an expert listed twice in
    one row has its coefficients summed: Σ over k, j with e_ik = e_ij of R_i[k]·R_i[j])."""
    w = _check_weights(p, weights)
    out = np.empty(p.R.shape[0])
    for rows in _chunks(p):
        ids = p.ids[rows]
        same = (ids[:, :, None] == ids[:, None, :]).astype(np.float64)                 # [n, K, K]
        gram = np.einsum("nkd,njd->nkj", p.R[rows], p.R[rows])                         # [n, K, K]
        out[rows] = (same * gram).sum((1, 2))
    return w * out + float(lam)


@dataclass
class BlockPreconditioner:
    """The inverse of each group's block of S A Aᵀ S + λI. idx [groups, M] the rows of each group (padded with N),
    inv [groups, M, M] the inverse blocks (zero on the padding)."""
    idx: np.ndarray
    inv: np.ndarray

    def apply(self, r) -> np.ndarray:
        """P⁻¹ r -> [N]."""
        N = len(r)
        padded = np.append(np.asarray(r, np.float64), 0.0)[self.idx]                   # [groups, M]
        out = np.zeros(N + 1)
        out[self.idx] = np.einsum("gij,gj->gi", self.inv, padded)
        return out[:N]


def _group_rows(p: MarginProblem) -> np.ndarray:
    """[groups, M] row indices per group, in row order, padded with N (M = the largest group)."""
    N = len(p.group)
    counts = np.bincount(p.group)
    order = np.argsort(p.group, kind="stable")
    start = np.concatenate([[0], np.cumsum(counts)[:-1]])
    slot = np.arange(N) - np.repeat(start, counts)                                      # rank inside the group
    idx = np.full((len(counts), int(counts.max())), N, np.int64)
    idx[p.group[order], slot] = order
    return idx


def block_preconditioner(p: MarginProblem, weights, lam: float) -> BlockPreconditioner:
    """Per group, the inverse of its block of S A Aᵀ S + λI (module docstring, "Block-Jacobi"):
    B_ij = s_i s_j Σ_{k,l: e_ik = e_jl} R_i[k]·R_j[l] + λ δ_ij, inverted as D^-½ (D^-½ B D^-½)⁻¹ D^-½ with
    D = diag(B) and the eigenvalues of the unit-diagonal block floored at BLOCK_FLOOR of its largest."""
    w = _check_weights(p, weights)
    if not np.isfinite(lam) or lam <= 0:
        raise ValueError(f"lam must be finite and > 0, got {lam}")
    N, K, D = p.R.shape
    if N == 0:
        return BlockPreconditioner(idx=np.zeros((0, 1), np.int64), inv=np.zeros((0, 1, 1)))
    idx = _group_rows(p)
    G, M = idx.shape
    s = np.append(np.sqrt(w), 0.0)
    ids = np.append(p.ids, np.full((1, K), -1), axis=0)                                 # padding: no expert
    inv = np.zeros((G, M, M))
    step = max(1, _CHUNK_VALUES // (M * K * D))
    for a in range(0, G, step):
        g = idx[a:a + step]                                                             # [n, M]
        n = len(g)
        Rg = np.zeros((n, M, K, D))
        real = g < N
        Rg[real] = p.R[g[real]]
        flat = Rg.reshape(n, M * K, D)
        dots = np.matmul(flat, flat.transpose(0, 2, 1)).reshape(n, M, K, M, K)          # [n, M, K, M, K]
        e = ids[g]                                                                      # [n, M, K]
        same = e[:, :, :, None, None] == e[:, None, None, :, :]
        gram = (dots * same).sum((2, 4))                                                # [n, M, M]
        sg = s[g]
        B = sg[:, :, None] * gram * sg[:, None, :]
        B += np.where(real, float(lam), 1.0)[:, :, None] * np.eye(M)                    # padding: identity
        d = np.sqrt(np.diagonal(B, axis1=1, axis2=2))                                   # ≥ √λ > 0
        U = B / (d[:, :, None] * d[:, None, :])
        ev, V = np.linalg.eigh(U)
        ev = np.maximum(ev, BLOCK_FLOOR * ev[:, -1:])
        Ui = np.einsum("nik,nk,njk->nij", V, 1.0 / ev, V)
        blk = Ui / (d[:, :, None] * d[:, None, :])
        blk *= (real[:, :, None] & real[:, None, :])
        inv[a:a + step] = blk
    return BlockPreconditioner(idx=idx, inv=inv)


def _check_weights(p: MarginProblem, weights) -> np.ndarray:
    w = np.asarray(weights, np.float64)
    if w.shape != (p.R.shape[0],):
        raise ValueError(f"weights must be [N] = [{p.R.shape[0]}], got {list(w.shape)}")
    if not np.isfinite(w).all() or (w < 0).any():
        raise ValueError("weights must be finite and ≥ 0")
    return w


def ordinary_ridge(p: MarginProblem, lam: float, rho: float) -> np.ndarray:
    """The weighted ridge of ordinary-text rows `p` (module docstring, "Weighted ridge") -> [E, D] float64:
    1 + (ρ/λ)·diag(AᵀA)/positions, so that λ·ridge = λ + ρ·(each gain's squared coefficient summed over a position's
    rows, averaged over the positions)."""
    if not np.isfinite(lam) or lam <= 0 or not np.isfinite(rho) or rho < 0:
        raise ValueError(f"need lam > 0 and rho ≥ 0, got lam={lam}, rho={rho}")
    N, K, D = p.R.shape
    E = p.n_experts
    diag = np.zeros(E * D)
    for rows in _chunks(p):
        ids, R = p.ids[rows], p.R[rows]
        diag += _scatter(p, rows, R * R)
        for k in range(K):                                   # an expert listed twice: its coefficients add up first
            for j in range(k + 1, K):
                same = ids[:, k] == ids[:, j]
                if same.any():
                    flat = (ids[same, k][:, None] * D + np.arange(D)).ravel()
                    diag += np.bincount(flat, weights=(2 * R[same, k] * R[same, j]).ravel(), minlength=E * D)
    positions = int(p.group.max()) + 1 if N else 1
    return 1.0 + (float(rho) / float(lam)) * diag.reshape(E, D) / positions

def predict(p: MarginProblem, delta) -> np.ndarray:
    """Predicted margins m + A·δ -> [N] float64."""
    return p.m + matvec(p, delta)


def row_gram(p: MarginProblem) -> np.ndarray:
    """A Aᵀ -> [N, N] float64, formed expert by expert: rows' coefficients on expert e's channels Y_e [N_e, D]
    (a row listing e twice has them summed), A Aᵀ = Σ_e P_eᵀ Y_e Y_eᵀ P_e."""
    N, K, D = p.R.shape
    G = np.zeros((N, N))
    for e in np.unique(p.ids):
        rows, ks = np.nonzero(p.ids == e)
        u, at = np.unique(rows, return_inverse=True)
        Y = np.zeros((len(u), D))
        np.add.at(Y, at, p.R[rows, ks])
        G[np.ix_(u, u)] += Y @ Y.T
    return G


def solve_dense(p: MarginProblem, weights, b, lam: float, *, gram=None):
    """The row-space system (S A Aᵀ S + λI) y = S b solved directly (LU) on the N×N matrix (row_gram; pass `gram`
    to reuse it across calls); δ = Aᵀ S y. Returns (δ [E, D] float64, 0 iterations, the relative residual of the
    normal equations as solve_cg reports it)."""
    w = _check_weights(p, weights)
    b = np.asarray(b, np.float64)
    if b.shape != w.shape or not np.isfinite(b).all():
        raise ValueError(f"b must be [N] = [{w.shape[0]}] finite values")
    if not np.isfinite(lam) or lam <= 0:
        raise ValueError(f"lam must be finite and > 0, got {lam}")
    s = np.sqrt(w)
    rhs = rmatvec(p, w * b)
    bnorm = float(np.linalg.norm(rhs))
    if bnorm == 0.0:
        return np.zeros_like(rhs), 0, 0.0
    G = row_gram(p) if gram is None else gram
    M = G * s[:, None]
    M *= s[None, :]
    M[np.diag_indices_from(M)] += lam
    y = np.linalg.solve(M, s * b)
    del M
    x = rmatvec(p, s * y)
    return x, 0, float(np.linalg.norm(rhs - rmatvec(p, w * matvec(p, x)) - lam * x) / bnorm)


def solve_cg(p: MarginProblem, weights, b, lam: float, *, tol: float = 1e-8, max_iter: int = 1000,
             precond: str = "block"):
    """Preconditioned CG in row space (module docstring; precond "block": block-Jacobi over each group's rows,
    "jacobi": the diagonal): (S A Aᵀ S + λI) y = S b, S = W^½, λ > 0, from
    y = 0; δ = Aᵀ S y solves (AᵀWA + λI) δ = AᵀWb. Stops when ‖S b − (S A Aᵀ S + λI) y‖ ≤ tol·‖S b‖ or after
    max_iter updates. Returns (δ [E, D] float64, iterations, the relative residual of the normal equations
    ‖AᵀWb − (AᵀWA + λI)δ‖ / ‖AᵀWb‖ recomputed at the end)."""
    w = _check_weights(p, weights)
    b = np.asarray(b, np.float64)
    if b.shape != w.shape or not np.isfinite(b).all():
        raise ValueError(f"b must be [N] = [{w.shape[0]}] finite values")
    if not np.isfinite(lam) or lam <= 0:
        raise ValueError(f"lam must be finite and > 0 (the ridge keeps the row-space system regular when rows are "
                         f"linearly dependent), got {lam}")
    if isinstance(max_iter, bool) or not isinstance(max_iter, (int, np.integer)) or max_iter < 0:
        raise ValueError(f"max_iter must be an integer ≥ 0, got {max_iter!r}")
    if precond not in PRECONDITIONERS:
        raise ValueError(f"precond must be one of {', '.join(PRECONDITIONERS)}, got {precond!r}")
    s = np.sqrt(w)
    rhs = rmatvec(p, w * b)                                   # AᵀWb: the normal equations' right-hand side
    bnorm = float(np.linalg.norm(rhs))
    if bnorm == 0.0:                                          # then δ = 0 solves them exactly
        return np.zeros_like(rhs), 0, 0.0

    def op(y):                                                # (S A Aᵀ S + λI) y
        return s * matvec(p, rmatvec(p, s * y)) + lam * y

    if precond == "block":
        apply = block_preconditioner(p, w, lam).apply
    else:
        inv = 1.0 / row_diagonal(p, w, lam)                   # ≥ λ > 0 everywhere
        apply = inv.__mul__
    y = np.zeros_like(b)
    r = s * b
    stop = tol * float(np.linalg.norm(r))
    z = apply(r)
    d = z.copy()
    rz = float(np.vdot(r, z))
    it = 0
    while it < max_iter and np.linalg.norm(r) > stop:
        q = op(d)
        dq = float(np.vdot(d, q))
        if dq <= 0.0:                                         # d = 0 to rounding: nothing left to gain
            break
        alpha = rz / dq
        y += alpha * d
        r -= alpha * q
        it += 1
        z = apply(r)
        rz_new = float(np.vdot(r, z))
        d = z + (rz_new / rz) * d
        rz = rz_new
    x = rmatvec(p, s * y)
    return x, it, float(np.linalg.norm(rhs - rmatvec(p, w * matvec(p, x)) - lam * x) / bnorm)


def _counts(p: MarginProblem, margins, tau: float) -> dict:
    dec = group_kinds(p)
    above, at_tau = _all_by_group(p, margins > 0), _all_by_group(p, margins >= tau)
    return {"flipped": int(above[dec].sum()), "reached_tau": int(at_tau[dec].sum()), "kept": int(above[~dec].sum())}


def solve_margins(p: MarginProblem, tau: float, rho: float, lam: float, *, kappa: float = 0.25, rounds: int = 4,
                  boost: float = 4.0, tol: float = 1e-8, max_iter: int = 1000, precond: str = "block",
                  method: str = "auto", ridge=None) -> MarginSolution:
    """Up to `rounds` float solves, each rounded to the FP4 lattice, with the active set of the module docstring
    between rounds (decision points below τ boosted; constraint rows pushed below κ held at κ, boosted). Stops early
    once every decision point reaches τ and no constraint row is pushed below κ. method "auto" solves each round
    densely (solve_dense, one row_gram for all rounds) up to DENSE_MAX_ROWS rows, else by CG with `precond`.
    ridge [E, D] (> 0; None: all ones) weighs the ridge per gain: λ Σ ridge[e, d] δ[e, d]² (module docstring,
    "Weighted ridge"); solved as the plain ridge on rows scaled by ridge^-½, δ scaled back before the lattice."""
    for name, v, ok in (("tau", tau, tau > 0), ("rho", rho, rho >= 0), ("kappa", kappa, kappa >= 0)):
        if not np.isfinite(v) or not ok:
            raise ValueError(f"{name} must be finite and {'> 0' if name == 'tau' else '≥ 0'}, got {v}")
    if rounds < 1 or not np.isfinite(boost) or boost < 1:
        raise ValueError(f"need rounds ≥ 1 and boost ≥ 1, got rounds={rounds}, boost={boost}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    dense, gram = method == "dense" or (method == "auto" and len(p.m) <= DENSE_MAX_ROWS), None
    scale, q = None, p
    if ridge is not None:
        ridge = np.asarray(ridge, np.float64)
        if ridge.shape != (p.n_experts, p.R.shape[2]) or not np.isfinite(ridge).all() or (ridge <= 0).any():
            raise ValueError(f"ridge must be [E, D] = [{p.n_experts}, {p.R.shape[2]}] finite values > 0")
        scale = 1.0 / np.sqrt(ridge)
        q = MarginProblem(ids=p.ids, R=p.R * scale[p.ids], m=p.m, kind=p.kind, n_experts=p.n_experts, group=p.group)
    dec, con = p.kind, ~p.kind
    w = np.where(dec, 1.0, float(rho))
    b = np.where(dec, np.maximum(tau - p.m, 0.0), 0.0)
    held = np.zeros_like(dec)
    floor = np.minimum(kappa, p.m)
    gk = group_kinds(p)
    n_dec, n_con = int(gk.sum()), int((~gk).sum())
    active, history, best = 0, [], None
    for rnd in range(rounds):
        if dense:
            gram = row_gram(q) if gram is None else gram             # the same for every round
            x, it, res = solve_dense(q, w, b, lam, gram=gram)
        else:
            x, it, res = solve_cg(q, w, b, lam, tol=tol, max_iter=max_iter, precond=precond)
        if scale is not None:
            x = x * scale
        blocks = quantize_gains(x.astype(np.float32))
        gains = dequantize_gains(blocks)
        delta = gains - np.float32(1.0)
        mq, mf = predict(p, delta), predict(p, x)
        c = _counts(p, mq, tau)
        history.append({"round": rnd, "method": "dense" if dense else f"cg/{precond}", "active": active,
                        "held": int(held.sum()), "iterations": it,
                        "residual": res, "float_flipped": int((mf[dec] > 0).sum()), **c})
        key = (-(n_dec - c["flipped"] + n_con - c["kept"]), c["flipped"])
        if best is None or key > best[0]:
            best = (key, rnd, delta, gains, blocks, mq, mf, c, w.copy(), held.copy())
        below = dec & (mq < tau)
        pushed = con & ((mq <= 0) | (mq < floor))
        if not below.any() and not pushed.any():
            break
        active = int(below.sum())
        w = np.where(below, w * boost, w)
        w = np.where(pushed, np.maximum(w, 1.0) * boost, w)
        held |= pushed
        b = np.where(held, np.maximum(kappa - p.m, 0.0), b)
    _, rnd, delta, gains, blocks, mq, mf, c, wb, hb = best
    return MarginSolution(delta=delta, gains=gains, blocks=blocks, margins=mq, float_margins=mf,
                          flipped=c["flipped"], flipped_share=c["flipped"] / n_dec if n_dec else 0.0,
                          reached_tau=c["reached_tau"], kept=c["kept"],
                          kept_share=c["kept"] / n_con if n_con else 1.0, n_decisions=n_dec, n_constraints=n_con,
                          round=rnd, weights=wb, held=hb, rounds=history)

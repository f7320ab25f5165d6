"""The ② gain solve of one layer (docs/sidecar.md): per-expert multiplicative gains
on the down projection's output channels, fitted so the quantised MoE block reproduces the original's output.

Model of the engine's MoE sum for token i with its K routed slots (e_ik, rw_ik) and shared expert ysh_i:

    y_i = Σ_k s_{e_ik} ⊙ c_ik + ysh_i,        c_ik = rw_ik · ye_ik   (the weighted expert output)

Objective on the training rows:  Σ_i ‖y_i − y_i^orig‖² + λ Σ_d d̄_d Σ_e (s_e[d] − 1)²,
d̄_d = the mean over experts of each expert's energy Σ c² on channel d (one ridge scale per channel shared by
all experts: an expert's own energy would let rarely routed experts run to extremes).

Solved by per-expert Gauss–Seidel: each step takes one expert, removes its current contribution from the
residual, solves its D independent scalar ridge problems in closed form over only the rows routed to it,
and puts the new contribution back (the residual is updated in place; no E×E system is ever formed).
Lattice-direct (the default): the step projects s_e − 1 onto FP4 E2M1 with one power-of-two scale per 32
channels (the stored sidecar format, ds4lib.formats.sidecar.quantize_gains), keeps the stored blocks, and
updates the residual with the lattice values, so the rounding error of expert e is absorbed by the experts
solved after it. `lattice=False` solves in float and rounds once at the end (the ablation).

No files, no model objects. Shapes: T tokens, K active experts, E experts, D hidden, G = D/32 blocks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ds4lib.formats.sidecar import dequantize_gains, quantize_gains

__all__ = ["GainProblem", "GainSolution", "make_problem", "solve_gains", "heldout_gain", "choose_lambda",
           "LAMBDAS"]

LAMBDAS = (0.01, 0.1, 1.0, 10.0, 100.0, 1000.0)


@dataclass
class GainProblem:
    """One layer's rows, float64: c [T, K, D] weighted expert outputs, ids [T, K], base [T, D] = the engine's sum
    with all gains 1 (Σ c + ysh), target [T, D] = the original's block output, train [T] bool (held-out = ~train)."""
    c: np.ndarray
    ids: np.ndarray
    base: np.ndarray
    target: np.ndarray
    train: np.ndarray
    n_experts: int


@dataclass
class GainSolution:
    lam: float
    gains: np.ndarray            # [E, D] float32 s (lattice values when solved lattice-direct)
    blocks: np.ndarray           # uint8 [E, G, 17] the stored form of s − 1
    train_gain: float            # 1 − err/err0 on the training rows
    heldout_gain: float          # same on the held-out rows
    sweeps: list = field(default_factory=list)   # training objective after each sweep


def make_problem(*, c, ids, ysh, target, train, n_experts: int) -> GainProblem:
    """c [T, K, D] the weighted routed-expert outputs (rw·ye as the engine sums them), ids [T, K], ysh [T, D]."""
    c = np.asarray(c, np.float64)
    base = c.sum(1) + np.asarray(ysh, np.float64)
    return GainProblem(c=c, ids=np.asarray(ids, np.int64), base=base, target=np.asarray(target, np.float64),
                       train=np.asarray(train, bool), n_experts=int(n_experts))


def _rows_by_expert(ids, rows_mask, E):
    """For each expert, (token, slot) arrays of its rows among the masked tokens."""
    tok, slot = np.nonzero(rows_mask[:, None] & np.ones_like(ids, dtype=bool))
    e = ids[tok, slot]
    order = np.argsort(e, kind="stable")
    tok, slot, e = tok[order], slot[order], e[order]
    bounds = np.searchsorted(e, np.arange(E + 1))
    return [(tok[bounds[x]:bounds[x + 1]], slot[bounds[x]:bounds[x + 1]]) for x in range(E)]


def _apply(p: GainProblem, gains, rows):
    """The model's sum with gains [E, D] on the masked rows -> [n, D]."""
    s = np.asarray(gains, np.float64)[p.ids[rows]]                                       # [n, K, D]
    return (p.c[rows] * s).sum(1) + (p.base[rows] - p.c[rows].sum(1))


def heldout_gain(p: GainProblem, gains, rows=None) -> float:
    """1 − ‖y(gains) − y_orig‖² / ‖y(1) − y_orig‖² on `rows` (default: held-out rows)."""
    rows = ~p.train if rows is None else rows
    if not rows.any():
        return 0.0
    e0 = float(((p.base[rows] - p.target[rows]) ** 2).sum())
    e1 = float(((_apply(p, gains, rows) - p.target[rows]) ** 2).sum())
    return 1.0 - e1 / e0 if e0 > 0 else 0.0


def solve_gains(p: GainProblem, lam: float, *, sweeps: int = 3, lattice: bool = True,
                shared_ridge: bool = True) -> GainSolution:
    """Gauss–Seidel over experts in ascending id, `sweeps` times. `shared_ridge=False` scales the ridge by each
    expert's own energy (the ablation the seed warns about)."""
    E, D = p.n_experts, p.c.shape[-1]
    rows = _rows_by_expert(p.ids, p.train, E)
    energy = np.zeros((E, D))
    for e, (tok, slot) in enumerate(rows):
        energy[e] = (p.c[tok, slot] ** 2).sum(0)
    ridge = lam * (np.broadcast_to(energy.mean(0), (E, D)) if shared_ridge else energy)
    s = np.ones((E, D))
    blocks = quantize_gains(np.zeros((E, D), np.float32))
    resid = p.target - p.base                       # target − model with s = 1, all tokens (only train rows used)
    history = []
    for _ in range(sweeps):
        for e, (tok, slot) in enumerate(rows):
            if len(tok) == 0:
                continue
            ce = p.c[tok, slot]                                                            # [n, D]
            t = resid[tok] + ce * (s[e] - 1.0)          # residual without expert e's gain correction
            num = (ce * t).sum(0)                       # Σ c (t) for the correction δ = s − 1
            den = energy[e] + ridge[e]
            delta = np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)
            if lattice:
                blocks[e] = quantize_gains(delta[None].astype(np.float32))[0]
                new = dequantize_gains(blocks[e:e + 1])[0].astype(np.float64)
            else:
                new = 1.0 + delta
            resid[tok] = t - ce * (new - 1.0)
            s[e] = new
        history.append(float((resid[p.train] ** 2).sum() + (ridge * (s - 1.0) ** 2).sum()))
    if not lattice:
        blocks = quantize_gains((s - 1.0).astype(np.float32))
        s = dequantize_gains(blocks).astype(np.float64)
    gains = s.astype(np.float32)
    return GainSolution(lam=float(lam), gains=gains, blocks=blocks, train_gain=heldout_gain(p, gains, p.train),
                        heldout_gain=heldout_gain(p, gains), sweeps=history)


def choose_lambda(p: GainProblem, lambdas=LAMBDAS, **kw):
    """Solve for every λ; the best by held-out gain (ties: the larger λ, the more conservative). Returns
    (best GainSolution, rows [{lam, train_gain, heldout_gain}])."""
    sols = [solve_gains(p, lam, **kw) for lam in lambdas]
    best = max(sols, key=lambda x: (x.heldout_gain, x.lam))
    return best, [{"lam": x.lam, "train_gain": x.train_gain, "heldout_gain": x.heldout_gain} for x in sols]

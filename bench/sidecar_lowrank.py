"""Ablation of issue 11: an additive low-rank correction of the MoE block, of the default sidecar's bytes, in place
of the ② sidecar (per-expert FP4 gains + router bias). Solved and scored like bench/sidecar_ablations.sh's rows:
solved on the first W windows of the domain's fitting slice, scored on every window of its judging slice and of
general English, against the same teacher.

    .venv/bin/python bench/sidecar_lowrank.py [--domain finance] [--windows 8] [--rank 13] [--bare] [--out FILE]
        [--diagnose] [--factors FILE.npz] [--no-judge]

Results: bench/results/sidecar_lowrank_<domain>.json, {"lowrank": row, "bare": {"eval": ...}} (the row's fields as in
bench/results/sidecar_ablations_<domain>.json, plus per-layer ρ, gains and the full-rank ceiling), and the row of
the ablation table (bench/sidecar_ablation_table.py's format) on stdout.

The correction of layer l, on the deployment path:  y ← round_bf16(y + (x Aᵀ) W),  x [N, D] the engine's MoE
input (the router's input), y its MoE output, A [r, D] and W [r, D] stored as E4M3 with one UE8M0 scale per 32
values of a row (the FP8 activation rule, ds4lib.formats.actquant.act_quant_fp8). Bytes per mounted layer:
2 · (r·D + r·D/32); at D = 256 and r = 13 that is 6,864, or 54,912 for 8 layers (the default finance sidecar:
53,376 bytes of layer files + a 1,683-byte manifest = 55,059).

Fit per layer (the same fixture, targets y_orig, held-out rule and 0.5 % gate as ds4lib.sidecar.solve): reduced-
rank ridge regression of the residual R = y_orig − y on x over the training rows,
    min_B ‖R − x B‖² + λ‖B‖²  s.t. rank B ≤ r,
whose solution is B_λ V_r V_rᵀ with B_λ the ridge solution and V_r the top r eigenvectors of B_λᵀ xᵀR
(the fitted values of the ridge-augmented problem; Mukherjee & Zhu 2011, reduced-rank ridge regression; with
λ = 0 the classical reduced-rank regression). Then rounding with error feedback: W is rounded to FP8, A refitted
given the rounded W and rounded, W refitted given the rounded A and rounded. λ = ρ · mean diag(xᵀx), ρ chosen on
held-out rows. Layers are solved first to last, each captured with the layers before it corrected.

The engine has no mount point for such a correction, so this is a bench-only path: the correction is applied by
the CPU backend's observer (ds4lib.ref.model), which writes the corrected values into the "moe_out" array in
place before the block goes on. Nothing in ds4lib changes; the script checks that the observer path without
corrections gives the engine's logits bit for bit.

Shapes: N rows, D hidden, r rank, L backbone layers.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from ds4lib.formats.actquant import act_quant_fp8
from ds4lib.formats.floats import round_bf16

RIDGES = (1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0)
BLOCK = 32


def factor_bytes(rank: int, dim: int) -> int:
    """Stored bytes of one layer's correction: A and W, each r·D E4M3 codes + r·D/32 UE8M0 scales."""
    return 2 * (rank * dim + rank * dim // BLOCK)


def fit_reduced_rank(x, resid, *, rank: int, lam: float):
    """x [N, D], resid [N, Do] -> (A [r, D], W [r, Do]) minimising ‖resid − x Aᵀ W‖² + λ‖Aᵀ W‖² over
    rank-r products (float64; W has orthonormal rows)."""
    x, resid = np.asarray(x, np.float64), np.asarray(resid, np.float64)
    xtr = x.T @ resid                                                                  # [D, Do]
    b = np.linalg.solve(x.T @ x + lam * np.eye(x.shape[1]), xtr)                       # [D, Do] ridge solution
    m = b.T @ xtr                                         # = bᵀ (xᵀx + λI) b, the augmented fitted values' Gram
    _, vecs = np.linalg.eigh((m + m.T) / 2)
    v = vecs[:, ::-1][:, :rank]                                                        # [Do, r]
    return (b @ v).T, v.T


def round_factors(x, resid, a, w, *, lam: float):
    """FP8-round W, refit A given it (ridge λ), round A, refit W given it, round W: each rounding's error is seen by
    the next refit. Returns the stored values (A [r, D], W [r, Do]) as float32."""
    x, resid = np.asarray(x, np.float64), np.asarray(resid, np.float64)
    w = act_quant_fp8(w.astype(np.float32), BLOCK).astype(np.float64)
    # A given W: min ‖R − x Aᵀ W‖² + λ‖Aᵀ W‖²  ->  Aᵀ = (xᵀx + λI)⁻¹ xᵀR Wᵀ (W Wᵀ)⁻¹
    g = w @ w.T
    at = np.linalg.solve(x.T @ x + lam * np.eye(x.shape[1]), x.T @ resid @ w.T) @ np.linalg.pinv(g)
    a = act_quant_fp8(at.T.astype(np.float32), BLOCK).astype(np.float64)
    z = x @ a.T                                                                        # [N, r]
    w = np.linalg.lstsq(z, resid, rcond=None)[0]                                       # [r, Do]
    w = act_quant_fp8(w.astype(np.float32), BLOCK)
    return a.astype(np.float32), w


def apply_correction(x, y, a, w) -> np.ndarray:
    """The mounted correction, float32 as the engine would hold it: round_bf16(y + (x Aᵀ) W)."""
    x = np.asarray(x, np.float32)
    return round_bf16(np.asarray(y, np.float32) + (x @ a.T) @ w)


def gain(x, y, target, a, w, rows) -> float:
    """1 − ‖y' − y_orig‖² / ‖y − y_orig‖² on `rows`, y' the mounted correction's output."""
    e0 = float(((y[rows].astype(np.float64) - target[rows]) ** 2).sum())
    e1 = float(((apply_correction(x[rows], y[rows], a, w).astype(np.float64) - target[rows]) ** 2).sum())
    return 1.0 - e1 / e0 if e0 > 0 else 0.0


def solve_layer(x, y, target, train, *, rank: int, ridges=RIDGES):
    """One layer: every ρ of the grid fitted on training rows and rounded; the best held-out gain kept (ties: the
    larger ρ). Returns (A, W, row) with the per-ρ gains."""
    resid = np.asarray(target, np.float64) - y
    scale = float(np.mean((x[train].astype(np.float64) ** 2).sum(0)))
    best, rows = None, []
    for rho in ridges:
        a, w = fit_reduced_rank(x[train], resid[train], rank=rank, lam=rho * scale)
        a, w = round_factors(x[train], resid[train], a, w, lam=rho * scale)
        r = {"rho": rho, "train_gain": gain(x, y, target, a, w, train),
             "heldout_gain": gain(x, y, target, a, w, ~train)}
        rows.append(r)
        if best is None or (r["heldout_gain"], rho) > (best[2]["heldout_gain"], best[2]["rho"]):
            best = (a, w, r)
    # the ceiling of any linear correction of x at the chosen ρ: the full-rank ridge solution, float, unrounded
    lam = best[2]["rho"] * scale
    b = np.linalg.solve(x[train].T.astype(np.float64) @ x[train] + lam * np.eye(x.shape[1]), x[train].T @ resid[train])
    e0 = (resid[~train] ** 2).sum()
    full = 1.0 - float(((resid[~train] - x[~train] @ b) ** 2).sum() / e0) if e0 > 0 else 0.0
    return best[0], best[1], {**best[2], "full_rank_heldout_gain": full, "rho_rows": rows}


class _Stop(Exception):
    pass


def corrected(corrections, then=None):
    """An observer that applies {layer: (A, W)} to the block's "moe_out" in place (x from the same call's
    "moe_in"), then passes every observation on to `then`."""
    x_in = {}

    def observe(l, name, value):
        if name == "moe_in" and l in corrections:
            x_in[l] = np.array(value, np.float32)
        elif name == "moe_out" and l in corrections:
            value[...] = apply_correction(x_in.pop(l), value, *corrections[l])
        if then is not None:
            then(l, name, value)
    return observe


def capture_io(engine, seqs, layer, corrections):
    """(x [N, D], y [N, D]) of `layer`'s MoE over every sequence, the layers before it corrected."""
    xs, ys, seen = [], [], [0]

    def record(l, name, value):
        if l == layer and name == "moe_in":
            xs.append(np.array(value, np.float32))
        elif l == layer and name == "moe_out":
            ys.append(np.array(value, np.float32))
            seen[0] += len(value)
            if seen[0] >= need:
                raise _Stop
    for s in seqs:
        seen[0], need = 0, len(s)
        try:
            engine.prefill(engine.new_session(), s, observer=corrected(corrections, record))
        except _Stop:
            pass
    return np.concatenate(xs), np.concatenate(ys)


class CorrectedEngine:
    """What ds4lib.eval.evaluate_windows calls (`logits`), with the corrections applied through the observer."""

    def __init__(self, engine, corrections):
        self.engine, self.corrections = engine, corrections

    def logits(self, tokens, split=None):
        return self.engine.logits(tokens, split, observer=corrected(self.corrections))


def forward_moe_outs(engine, seqs, corrections) -> dict:
    """{layer: [N, D]} every layer's MoE output (after its correction, if any) over whole forwards of `seqs`."""
    got = {}

    def record(l, name, value):
        if name == "moe_out":
            got.setdefault(l, []).append(np.array(value, np.float32))
    for s in seqs:
        engine.prefill(engine.new_session(), s, observer=corrected(corrections, record))
    return {l: np.concatenate(v) for l, v in got.items()}


def check_in_path(engine, fix, corrections, train) -> list:
    """Per layer, with every correction mounted at once against none: 1 − ‖y − y_orig‖² / ‖y_bare − y_orig‖² on
    the training and the held-out rows of the fitting windows (does the corrected stack's block output move towards
    the original's at every depth, as the sequential fit intends?)."""
    bare, corr = forward_moe_outs(engine, fix.seqs, {}), forward_moe_outs(engine, fix.seqs, corrections)
    rows = []
    for l in sorted(bare):
        t = fix.layer(l)["y"].astype(np.float64)
        e0, e1 = (bare[l] - t) ** 2, (corr[l] - t) ** 2
        rows.append({"layer": l, **{k: 1.0 - float(e1[m].sum() / e0[m].sum()) for k, m in
                                    (("train_gain", train), ("heldout_gain", ~train))}})
    return rows


def run(*, domain="finance", windows=8, rank=13, gate=0.005, base="models/ds4-tiny-base.gguf",
        judge=None, out=None, diagnose=False, factors=None, bare=False):
    """Solve, optionally diagnose, score; merges {"lowrank": row} (and {"bare": {"eval": ...}} with `bare`, the
    stack without corrections on the same slices) into the JSON file `out`."""
    from ds4lib.config import Env
    from ds4lib.corpus.slices import load_slice
    from ds4lib.engine import Engine
    from ds4lib.engine.engine import find_engram_checkpoint
    from ds4lib.eval import Teacher, evaluate_slice, evaluate_windows
    from ds4lib.formats.gguf import BaseFile
    from ds4lib.sidecar import build_fixture, heldout_mask

    checkpoint = find_engram_checkpoint(BaseFile.open(base), None)
    toks = load_slice(f"{domain}/fit").tokens[:windows]
    t0 = time.perf_counter()
    fix = build_fixture(checkpoint, toks, Env.read().cache_dir)
    t_fix = time.perf_counter() - t0
    train = ~heldout_mask(len(fix.seqs), fix.seqs.shape[1])
    eng = Engine(base, engram_dir=checkpoint, prefill_block=max(512, fix.seqs.shape[1]))
    # the observer path with nothing to apply must be the engine's own forward, bit for bit
    probe = [int(t) for t in fix.seqs[0][:96]]
    same = np.array_equal(eng.logits(probe), CorrectedEngine(eng, {}).logits(probe))
    if not same:
        raise SystemExit("the observer path changes the engine's logits without any correction")
    corrections, layers = {}, []
    for l in range(fix.n_layers):
        t1 = time.perf_counter()
        x, y = capture_io(eng, fix.seqs, l, corrections)
        a, w, row = solve_layer(x, y, fix.layer(l)["y"], train, rank=rank)
        row.update(layer=l, mounted=row["heldout_gain"] > gate, seconds=time.perf_counter() - t1)
        if row["mounted"]:
            corrections[l] = (a, w)
        layers.append(row)
        print(f"layer {l}: rho {row['rho']:g} held-out gain {100 * row['heldout_gain']:.2f}% "
              f"(train {100 * row['train_gain']:.2f}%, full rank {100 * row['full_rank_heldout_gain']:.2f}%) "
              f"mounted {row['mounted']}", file=sys.stderr)
    solve_s = time.perf_counter() - t0
    if factors:
        np.savez(factors, **{f"{k}_L{l:02d}": v for l, (a, w) in corrections.items() for k, v in (("A", a), ("W", w))})
    teacher = Teacher(Path(checkpoint), Env.read().cache_dir / "teacher")
    diag = {}
    if diagnose:
        diag["in_path"] = check_in_path(eng, fix, corrections, train)
        for r in diag["in_path"]:
            print(f"in path, all mounted: layer {r['layer']} train {100 * r['train_gain']:.2f}% held-out "
                  f"{100 * r['heldout_gain']:.2f}%", file=sys.stderr)
        for label, c in (("bare", {}), ("lowrank", corrections)):
            comp, _ = evaluate_windows(CorrectedEngine(eng, c), teacher, toks)
            diag[f"fit_windows_{label}"] = comp.as_dict()
            print(f"fitting windows, {label}:", json.dumps(comp.as_dict()), file=sys.stderr)
    slices, slices_bare, t2 = {}, {}, time.perf_counter()
    for name in (judge if judge is not None else (f"{domain}/judge", "english/judge")):
        comp, _ = evaluate_slice(CorrectedEngine(eng, corrections), teacher, name)
        slices[name] = comp.as_dict()
        print(name, json.dumps(slices[name]), file=sys.stderr)
        if bare:
            slices_bare[name] = evaluate_slice(eng, teacher, name)[0].as_dict()
    D = eng.cfg.dim
    res = {"eval": {"slices": slices, "seconds": time.perf_counter() - t2, "original": str(checkpoint)},
           "wall_seconds": solve_s, "fixture_seconds": t_fix, "bytes": factor_bytes(rank, D) * len(corrections),
           "mounted": sorted(corrections), "biased": [], "heldout_gain": [round(r["heldout_gain"], 4) for r in layers],
           "layers": layers, "observer_check_bit_exact": bool(same), "diagnostics": diag,
           "params": {"domain": domain, "fit": [f"{domain}/fit"], "windows": int(len(toks)), "rank": rank,
                      "ridges": list(RIDGES), "gate": gate, "storage": "E4M3 + UE8M0 per 32 of a row",
                      "input": "moe_in", "heldout": "(quarter + window) % 4 == 3"}}
    if out:
        doc = json.loads(Path(out).read_text()) if Path(out).exists() else {}
        doc["lowrank"] = res
        if bare:
            doc["bare"] = {"eval": {"slices": slices_bare, "original": str(checkpoint)}}
        Path(out).write_text(json.dumps(doc, indent=1) + "\n")
    return res


def table_row(res, bare) -> str:
    """The row of bench/sidecar_ablation_table.py's table; `bare` = its "bare" entry's slices."""
    sl = res["eval"]["slices"]
    cells = " | ".join(f"{100 * sl[n]['same_top1']:.2f} % ({100 * (sl[n]['same_top1'] - bare[n]['same_top1']):+.2f} "
                       f"pp) | {sl[n]['kl_mean']:.3f} ({100 * (sl[n]['kl_mean'] / bare[n]['kl_mean'] - 1):+.1f} %)"
                       for n in bare)
    label = f"additive low-rank x→y, rank {res['params']['rank']}, FP8 factors (no gains, no Δb)"
    return f"| {label} | {res['bytes']:,} | {len(res['mounted'])} / 0 | {res['wall_seconds']:.0f} | {cells} |"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--domain", default="finance")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--rank", type=int, default=13)
    p.add_argument("--out", default=None)
    p.add_argument("--factors", default=None, help="also save the stored factors (A_Lxx, W_Lxx) to this .npz")
    p.add_argument("--diagnose", action="store_true", help="also: per-layer in-path gains with every correction "
                   "mounted, and the five numbers on the fitting windows themselves (bare and corrected)")
    p.add_argument("--no-judge", action="store_true", help="skip the judging slices")
    p.add_argument("--bare", action="store_true", help="also score the bare base on the judging slices")
    a = p.parse_args(argv)
    out = a.out or f"bench/results/sidecar_lowrank_{a.domain}.json"
    res = run(domain=a.domain, windows=a.windows, rank=a.rank, out=out, diagnose=a.diagnose, factors=a.factors,
              judge=() if a.no_judge else None, bare=a.bare)
    print("wrote", out)
    doc = json.loads(Path(out).read_text())
    if "bare" in doc and res["eval"]["slices"]:
        print(table_row(res, doc["bare"]["eval"]["slices"]))


if __name__ == "__main__":
    main()

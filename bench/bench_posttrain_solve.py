"""The ③ margin solve alone on a day's real rows: seconds and CG iterations per solver and preconditioner.

    set -a; . scripts/numerics.env; set +a
    .venv/bin/python bench/bench_posttrain_solve.py --base models/ds4-tiny-base.gguf \
        --zchain models/sidecars/finance --requests data/posttrain/general/day-1.jsonl --rivals 16 --tau 2 \
        [--solver cg/jacobi --solver cg/block --solver dense] [--keep-positions N [--keep-slice finance/fit]] [--lam L]
        [--probe-slice english/fit --probe-windows 1,5,12,18] [--rows-dir cache/posttrain_rows] [--capture-only]

The rows come from ds4lib.posttrain.solve.collect_rows (generation and capture, as `ds4 posttrain` runs them) and,
with --keep-positions, ds4lib.posttrain.keep.keep_rows (ordinary text, the sidecar's fit slice unless --keep-slice);
both are kept in --rows-dir as .npz files keyed by what made them (requests file and its sha256 or the slices and
positions, the stack, the rivals), so a second run measures the solve alone. The day's counts (flipped, kept) are
over its own positions; "ordinary kept" over the ordinary ones. --probe-slice: positions of other windows (128 a
window, top-1 against 16 rivals, not solved on) whose predicted top-1 the solution keeps: a linear proxy of what
the ③ does to text it was not given (choose windows the keep rows do not use). Each --solver (dense, or cg/<preconditioner>) runs
ds4lib.solvers.margins.solve_margins with the CLI's defaults otherwise and prints one JSON line: CG iterations and
residual per lattice round, solve seconds, predicted flipped / kept.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def _cached(path: Path, make):
    """(MarginProblem, seconds spent making it or 0 when read back from path)."""
    import numpy as np

    from ds4lib.solvers.margins import make_problem
    if path.is_file():
        z = np.load(path)
        return make_problem(ids=z["ids"], R=z["R"], m=z["m"], kind=z["kind"], n_experts=int(z["n_experts"]),
                            group=z["group"]), 0.0
    t0 = time.perf_counter()
    p = make()
    seconds = time.perf_counter() - t0
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".partial.npz")
    np.savez(tmp, ids=p.ids, R=p.R, m=p.m, kind=p.kind, n_experts=p.n_experts, group=p.group)
    os.replace(tmp, path)
    return p, seconds


def load_rows(*, base, zchain, requests, rivals: int, rows_dir, engram_dir=None, keep_positions: int = 0,
              keep_slices=None):
    """(day's MarginProblem, ordinary text's MarginProblem or None, seconds spent capturing)."""
    from ds4lib.engine import Engine
    from ds4lib.posttrain.keep import keep_rows
    from ds4lib.posttrain.solve import collect_rows, read_requests
    from ds4lib.quant import file_sha256
    engine = Engine(base, zchain=zchain, engram_dir=engram_dir)
    fnv = engine.sidecar.fingerprint
    key = f"{Path(requests).stem}-{file_sha256(requests)[:12]}-{fnv}-r{rivals}"
    day, s1 = _cached(Path(rows_dir) / f"{key}.npz",
                      lambda: collect_rows(engine, read_requests(requests), rivals=rivals).problem)
    if not keep_positions:
        return day, None, s1
    names = "+".join(s.replace("/", "_") for s in keep_slices) if keep_slices else "fit"
    keep, s2 = _cached(Path(rows_dir) / f"keep-{names}-{keep_positions}-{fnv}-r{rivals}.npz",
                       lambda: keep_rows(engine, positions=keep_positions, slices=keep_slices, rivals=rivals).problem)
    return day, keep, s1 + s2


def load_probe(*, base, zchain, engram_dir, rows_dir, slice_name: str, windows):
    from ds4lib.corpus.slices import load_slice
    from ds4lib.engine import Engine
    from ds4lib.posttrain.keep import keep_rows
    engine = Engine(base, zchain=zchain, engram_dir=engram_dir)
    toks = load_slice(slice_name).tokens[windows]
    key = f"probe-{slice_name.replace('/', '_')}-{'_'.join(map(str, windows))}-{engine.sidecar.fingerprint}"
    return _cached(Path(rows_dir) / f"{key}.npz",
                   lambda: keep_rows(engine, positions=128 * len(windows), windows={slice_name: toks}, rivals=16,
                                     per_window=128).problem)[0]


def _kept_share(q, delta) -> float:
    import numpy as np

    from ds4lib.solvers.margins import predict
    ok = np.bincount(q.group, weights=(predict(q, delta) <= 0).astype(np.float64)) == 0
    return round(float(ok.mean()), 5)


def main(argv=None) -> int:
    from ds4lib.posttrain.solve import KAPPA, LAM, RHO, RIVALS, ROUNDS, TAU
    import numpy as np

    from ds4lib.solvers.margins import group_kinds, solve_margins, stack_problems
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True)
    ap.add_argument("--zchain", required=True)
    ap.add_argument("--requests", required=True)
    ap.add_argument("--engram-dir", default=None)
    ap.add_argument("--rivals", type=int, default=RIVALS)
    ap.add_argument("--tau", type=float, default=TAU)
    ap.add_argument("--rho", type=float, default=RHO)
    ap.add_argument("--lam", type=float, default=LAM)
    ap.add_argument("--kappa", type=float, default=KAPPA)
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--max-iter", type=int, default=1000)
    ap.add_argument("--solver", action="append", default=None, help="dense | cg/jacobi | cg/block (repeatable)")
    ap.add_argument("--keep-positions", type=int, default=0)
    ap.add_argument("--keep-slice", action="append", default=None)
    ap.add_argument("--probe-slice", action="append", default=None)
    ap.add_argument("--probe-windows", default="1,5,12,18")
    ap.add_argument("--rows-dir", default="cache/posttrain_rows")
    ap.add_argument("--capture-only", action="store_true")
    a = ap.parse_args(argv)
    day, keep, cap_s = load_rows(base=a.base, zchain=a.zchain, requests=a.requests, rivals=a.rivals,
                                 rows_dir=a.rows_dir, engram_dir=a.engram_dir, keep_positions=a.keep_positions,
                                 keep_slices=a.keep_slice)
    p = day if keep is None else stack_problems([day, keep])
    probes = {name: load_probe(base=a.base, zchain=a.zchain, engram_dir=a.engram_dir, rows_dir=a.rows_dir,
                               slice_name=name, windows=[int(w) for w in a.probe_windows.split(",")])
              for name in a.probe_slice or []}
    n_day = len(day.m)
    head = {"requests": a.requests, "rivals": a.rivals, "rows": int(len(p.m)), "day_rows": n_day,
            "positions": int(p.group.max()) + 1, "keep_positions": a.keep_positions, "keep_slice": a.keep_slice,
            "capture_seconds": round(cap_s, 1)}
    if a.capture_only:
        print(json.dumps(head), flush=True)
        return 0
    for solver in a.solver or ["dense"]:
        method, _, pre = solver.partition("/")
        t0 = time.perf_counter()
        sol = solve_margins(p, a.tau, a.rho, a.lam, kappa=a.kappa, rounds=a.rounds, max_iter=a.max_iter,
                            method=method, precond=pre or "block")
        s = time.perf_counter() - t0
        ok = np.bincount(p.group, weights=(sol.margins <= 0).astype(np.float64)) == 0      # [positions]
        gk = group_kinds(p)
        ordinary = np.zeros(len(ok), bool)
        ordinary[p.group[n_day:]] = True
        print(json.dumps({**head, "solver": solver, "tau": a.tau, "rho": a.rho, "lam": a.lam,
                          "iterations": [r["iterations"] for r in sol.rounds],
                          "residual": [float(f"{r['residual']:.2e}") for r in sol.rounds],
                          "seconds": round(s, 2), "flipped": sol.flipped, "decisions": sol.n_decisions,
                          "kept": int(ok[~gk & ~ordinary].sum()), "constraints": int((~gk & ~ordinary).sum()),
                          "ordinary_kept": int(ok[ordinary].sum()), "ordinary": int(ordinary.sum()),
                          "round": sol.round, "delta_max_abs": float(np.abs(sol.delta).max()),
                          "delta_rms": float(np.sqrt(np.mean(np.square(sol.delta, dtype=np.float64)))),
                          "probe_kept": {n: _kept_share(q, sol.delta) for n, q in probes.items()}}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

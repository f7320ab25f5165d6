"""The ③ margin solve alone on a day's real rows: seconds and CG iterations per solver and preconditioner.

    set -a; . scripts/numerics.env; set +a
    .venv/bin/python bench/bench_posttrain_solve.py --base models/ds4-tiny-base.gguf \
        --zchain models/sidecars/finance --requests data/posttrain/general/day-1.jsonl --rivals 16 --tau 2 \
        [--solver cg/jacobi --solver cg/block --solver dense] [--lam L[,L...]] [--keep-positions N
        [--keep-slice finance/fit] [--keep-rivals 4] [--keep-rho R[,R...]] [--keep-as-rows]]
        [--probe-slice english/fit --probe-windows 1,4,19,22] [--rows-dir cache/posttrain_rows] [--capture-only]

The rows come from ds4lib.posttrain.solve.collect_rows (generation and capture, as `ds4 posttrain` runs them) and,
with --keep-positions, ds4lib.posttrain.keep.keep_rows (ordinary text, the sidecar's fit slice unless --keep-slice);
both are kept in --rows-dir as .npz files keyed by what made them (requests file and its sha256 or the slices and
positions, the stack, the rivals; ordinary rows are captured with 16 rivals and cut to --keep-rivals), so a second
run measures the solve alone. The ordinary rows weigh the ridge (ordinary_ridge, --keep-rho) as `ds4 posttrain` does,
or with --keep-as-rows join the rows. The day's counts (flipped, kept) are over its own positions; "ordinary kept" is
the predicted kept share of the ordinary positions solved on. --probe-slice: the predicted kept share of positions
of other windows (128 a window, top-1 against 16 rivals, not solved on): a linear proxy of what the ③ does to text
it was not given (choose windows the ordinary rows do not use; 1,024 positions of a 24-window slice use windows 0, 2,
3, 5, 6, 8, 9, 11, 12, 14, 15, 17, 18, 20, 21, 23). Each --solver (dense, or cg/<preconditioner>) × --lam × --keep-rho
runs ds4lib.solvers.margins.solve_margins with the CLI's defaults otherwise and prints one JSON line: CG iterations
and residual per lattice round, solve seconds, predicted flipped / kept. The rows alone carry no capture, so the
rival pass (ds4lib.posttrain.rivals, `ds4 posttrain --rival-passes`) is not run here: its figures need the CLI.
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
              keep_slices=None, keep_captured: int = 16):
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
    keep, s2 = _cached(Path(rows_dir) / f"keep-{names}-{keep_positions}-{fnv}-r{keep_captured}.npz",
                       lambda: keep_rows(engine, positions=keep_positions, slices=keep_slices,
                                         rivals=keep_captured).problem)
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


def _subset_rivals(q, rivals: int, captured: int):
    """The first `rivals` rows of each position of rows captured with `captured` rivals (the strongest first)."""
    import numpy as np

    from ds4lib.solvers.margins import make_problem
    sel = np.nonzero(np.arange(len(q.m)) % captured < rivals)[0]
    return make_problem(ids=q.ids[sel], R=q.R[sel], m=q.m[sel], kind=q.kind[sel], n_experts=q.n_experts,
                        group=q.group[sel])


def main(argv=None) -> int:
    import numpy as np

    from ds4lib.posttrain.solve import KAPPA, KEEP_RHO, KEEP_RIVALS, LAM, RHO, RIVALS, ROUNDS, TAU
    from ds4lib.solvers.margins import group_kinds, ordinary_ridge, solve_margins, stack_problems
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True)
    ap.add_argument("--zchain", required=True)
    ap.add_argument("--requests", required=True)
    ap.add_argument("--engram-dir", default=None)
    ap.add_argument("--rivals", type=int, default=RIVALS)
    ap.add_argument("--tau", type=float, default=TAU)
    ap.add_argument("--rho", type=float, default=RHO)
    ap.add_argument("--lam", default=str(LAM), help="comma-separated values: one solve each")
    ap.add_argument("--kappa", type=float, default=KAPPA)
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--max-iter", type=int, default=1000)
    ap.add_argument("--solver", action="append", default=None, help="dense | cg/jacobi | cg/block (repeatable)")
    ap.add_argument("--keep-positions", type=int, default=0)
    ap.add_argument("--keep-slice", action="append", default=None)
    ap.add_argument("--keep-rivals", type=int, default=KEEP_RIVALS, help="≤ 16 (the rows are captured with 16)")
    ap.add_argument("--keep-rho", default=str(KEEP_RHO), help="comma-separated values: one solve each")
    ap.add_argument("--keep-as-rows", action="store_true")
    ap.add_argument("--probe-slice", action="append", default=None)
    ap.add_argument("--probe-windows", default="1,4,19,22")
    ap.add_argument("--rows-dir", default="cache/posttrain_rows")
    ap.add_argument("--capture-only", action="store_true")
    a = ap.parse_args(argv)
    day, keep, cap_s = load_rows(base=a.base, zchain=a.zchain, requests=a.requests, rivals=a.rivals,
                                 rows_dir=a.rows_dir, engram_dir=a.engram_dir, keep_positions=a.keep_positions,
                                 keep_slices=a.keep_slice, keep_captured=16)
    keep = None if keep is None else _subset_rivals(keep, a.keep_rivals, 16)
    probes = {name: load_probe(base=a.base, zchain=a.zchain, engram_dir=a.engram_dir, rows_dir=a.rows_dir,
                               slice_name=name, windows=[int(w) for w in a.probe_windows.split(",")])
              for name in a.probe_slice or []}
    p = stack_problems([day, keep]) if keep is not None and a.keep_as_rows else day
    head = {"requests": a.requests, "rivals": a.rivals, "rows": int(len(p.m)), "day_rows": len(day.m),
            "keep_positions": a.keep_positions, "keep_slice": a.keep_slice, "keep_rivals": a.keep_rivals,
            "keep_as_rows": a.keep_as_rows, "capture_seconds": round(cap_s, 1)}
    if a.capture_only:
        print(json.dumps(head), flush=True)
        return 0
    n_groups = int(day.group.max()) + 1
    for solver in a.solver or ["dense"]:
        method, _, pre = solver.partition("/")
        for lam in [float(x) for x in a.lam.split(",")]:
            for keep_rho in [float(x) for x in a.keep_rho.split(",")] if keep is not None else [0.0]:
                ridge = None if keep is None or a.keep_as_rows else ordinary_ridge(keep, lam, keep_rho)
                t0 = time.perf_counter()
                sol = solve_margins(p, a.tau, a.rho, lam, kappa=a.kappa, rounds=a.rounds, max_iter=a.max_iter,
                                    method=method, precond=pre or "block", ridge=ridge)
                s = time.perf_counter() - t0
                ok = np.bincount(p.group, weights=(sol.margins <= 0).astype(np.float64)) == 0      # [positions]
                gk = group_kinds(p)
                own = np.arange(len(ok)) < n_groups
                print(json.dumps({**head, "solver": solver, "tau": a.tau, "rho": a.rho, "lam": lam,
                                  "keep_rho": keep_rho, "iterations": [r["iterations"] for r in sol.rounds],
                                  "residual": [float(f"{r['residual']:.2e}") for r in sol.rounds],
                                  "seconds": round(s, 2), "flipped": int(ok[own & gk].sum()),
                                  "decisions": int((own & gk).sum()), "kept": int(ok[own & ~gk].sum()),
                                  "constraints": int((own & ~gk).sum()),
                                  "ordinary_kept": None if keep is None else _kept_share(keep, sol.delta),
                                  "round": sol.round, "delta_max_abs": float(np.abs(sol.delta).max()),
                                  "delta_rms": float(np.sqrt(np.mean(np.square(sol.delta, dtype=np.float64)))),
                                  "probe_kept": {n: _kept_share(q, sol.delta) for n, q in probes.items()}}),
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

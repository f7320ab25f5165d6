"""The ② sidecar solve of one domain (the math and gates: docs/sidecar.md): layer by layer,
first to last in one pass, each layer fitted with every layer before it already mounted.

Per backbone layer k:
  1. capture layer k on the engine (① base + the sidecar so far), ds4lib.sidecar.capture;
  2. router bias: the original's routing recomputed from the fixture's inputs (must match the original's own
     choices on ≥ 99% of rows), Δb solved, α chosen on held-out same-set rate, written only if it strictly
     improves; if written, mounted and layer k recaptured;
  3. gains: λ chosen on held-out rows (ds4lib.solvers.gains, lattice-direct FP4), the layer's gains written only
     if the held-out gain exceeds the gate (0.5%); the file is read back with the engine's reader and must
     decode to exactly the lattice values the solver used.
Held-out rows: the 128-token quarters q of window w with (q + w) % 4 == 3 (a quarter of the tokens; every
window and so every stratum on both sides; every context depth held out).

The output directory is a valid sidecar at every moment: each layer file is written to a temporary name and
renamed, and the manifest (also renamed into place) lists a layer only once its files are complete. A layer
is `done` in the manifest when solved; a rerun with the same parameters skips done layers (resumable per layer)
and re-solves a layer that was interrupted. Other parameters are refused rather than mixed into one directory.

Shapes: N rows, E experts, K active experts, D hidden, L backbone layers.
"""
from __future__ import annotations

import hashlib
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ds4lib.corpus.slices import load_slice
from ds4lib.formats.checkpoint import CheckpointReader
from ds4lib.formats.gguf import BaseFile
from ds4lib.engine.engine import find_engram_checkpoint
from ds4lib.formats.names import layer_prefix
from ds4lib.formats.sidecar import read_sidecar, write_layer_files, write_manifest
from ds4lib.quant import file_sha256
from ds4lib.ref.moe import route
from ds4lib.sidecar.capture import capture_layer, weighted_outputs
from ds4lib.sidecar.fixture import build_fixture
from ds4lib.solvers.gains import LAMBDAS, choose_lambda, make_problem
from ds4lib.solvers.router_bias import ALPHAS, MIN_EVENTS, solve_router_bias

__all__ = ["SolveError", "SidecarReport", "solve_sidecar", "heldout_mask", "GATE", "ROUTE_MATCH_MIN"]

GATE = 0.005
ROUTE_MATCH_MIN = 0.99
QUARTER = 128


class SolveError(RuntimeError):
    """A gate of the solve failed, or the output directory belongs to another solve."""


@dataclass
class SidecarReport:
    out: Path
    domain: str
    fit: list
    params: dict
    layers: list = field(default_factory=list)        # one row per backbone layer
    fixture_seconds: float = 0.0
    solve_seconds: float = 0.0
    bytes: int = 0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["out"] = str(self.out)
        return d

    @property
    def mounted(self) -> list:
        return [r["layer"] for r in self.layers if r["gains"]]

    @property
    def biased(self) -> list:
        return [r["layer"] for r in self.layers if r["bias"]]


def heldout_mask(n_windows: int, seq_len: int) -> np.ndarray:
    """[N] bool, True on held-out rows: quarter q of window w is held out iff (q + w) % 4 == 3."""
    q = np.arange(seq_len) // QUARTER
    w = np.arange(n_windows)[:, None]
    return (((q[None, :] + w) % 4) == 3).reshape(-1)


def _open_engine(base, checkpoint, out, mounted: bool, backend, prefill_block, tokenizer):
    from ds4lib.engine import Engine
    return Engine(base, zchain=out if mounted else None, engram_dir=checkpoint, backend=backend,
                  prefill_block=prefill_block, tokenizer_path=tokenizer)


def _prepare_out(out: Path, cfg, notes: dict, fresh: bool) -> dict:
    """The done layers of an earlier run with the same parameters, or {} for a new directory. --fresh keeps
    the previous directory as NAME.old; a non-empty directory that is not a sidecar is never touched."""
    import json
    man_path = out / "manifest.json"
    if out.exists() and any(out.iterdir()) and not man_path.exists():
        raise SolveError(f"{out} exists and is not a sidecar directory; choose another --out")
    if man_path.exists() and not fresh:
        man = json.loads(man_path.read_text())
        old = man.get("notes", {})
        diff = sorted(k for k in notes if k != "status" and old.get(k) != notes[k])
        if diff:
            raise SolveError(f"{out} holds a solve with other parameters ({', '.join(diff)}); pass --fresh to start "
                             f"over (the old directory is kept as {out.name}.old) or choose another --out")
        read_sidecar(out, cfg, expect_kind="sidecar")
        done = {int(k): v for k, v in man["layers"].items() if v.get("done")}
        if len(done) != len(man["layers"]):       # an interrupted layer (its Δb may be listed): unmount it first
            write_manifest(out, cfg, kind="sidecar", layers=done, notes=notes)
        return done
    if man_path.exists():
        old = out.with_name(out.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        out.rename(old)
    out.mkdir(parents=True, exist_ok=True)
    return {}


def _original_routing(reader, cfg, l, x, top_k):
    w = {n: reader.weight(layer_prefix(cfg, l) + n) for n in ("ffn.gate.weight", "ffn.gate.bias")}
    return route(x, w["ffn.gate.weight"], w["ffn.gate.bias"], cfg, top_k).ids


def _solve_layer(l, *, eng_for, out, cfg, fix, reader, train, layers, notes, lambdas, alphas, gate, sweeps,
                 min_events, router_bias, lattice, shared_ridge):
    t0 = time.perf_counter()
    E, K = cfg.moe_shape(l)
    teach = fix.layer(l)
    row = {"layer": l, "bias": False, "gains": False, "alpha": None}
    eng = eng_for(bool(layers))
    cap = capture_layer(eng, fix.seqs, l)
    row["capture_exact"] = cap.exact
    if router_bias:
        ids_orig = _original_routing(reader, cfg, l, teach["x"], K)
        match = float((ids_orig == teach["ids"]).all(-1).mean())
        row["route_match"] = match
        if match < ROUTE_MATCH_MIN:
            raise SolveError(f"layer {l}: the original routing recomputed from the fixture's inputs matches the "
                             f"original's choices on only {100 * match:.2f}% of rows (need ≥ 99%)")
        # the stack's own selection bias of layer k (no Δb of this layer is mounted yet)
        gate_bias = np.asarray(eng.base.tensor(layer_prefix(cfg, l) + "ffn.gate.bias"), np.float32)
        bs = solve_router_bias(scores=cap.scores, gate_bias=gate_bias, ids_orig=ids_orig, top_k=K, train=train,
                               alphas=alphas, min_events=min_events)
        row.update(alpha=bs.alpha, armed=bs.armed, same_set_before=bs.heldout_before,
                   same_set_after=bs.heldout_after, same_set_train_before=bs.train_before,
                   same_set_train_after=bs.train_after, alpha_rows=bs.rows)
        if bs.bias is not None:
            write_layer_files(out, cfg, l, bias=bs.bias)
            layers[l] = {"gains": False, "bias": True, "done": False}
            write_manifest(out, cfg, kind="sidecar", layers=layers, notes=notes)
            row["bias"] = True
            cap = capture_layer(eng_for(True), fix.seqs, l)
            row["capture_exact_after_bias"] = cap.exact
    prob = make_problem(c=weighted_outputs(cap.weights, cap.ye), ids=cap.ids, ysh=cap.ysh, target=teach["y"],
                        train=train, n_experts=E)
    best, lam_rows = choose_lambda(prob, lambdas, sweeps=sweeps, lattice=lattice, shared_ridge=shared_ridge)
    row.update(lam=best.lam, train_gain=best.train_gain, heldout_gain=best.heldout_gain, lambda_rows=lam_rows)
    entry = {"gains": False, "bias": row["bias"], "done": True, "lambda": best.lam,
             "heldout_gain": round(best.heldout_gain, 6), "alpha": row["alpha"]}
    if best.heldout_gain > gate:
        write_layer_files(out, cfg, l, gain_blocks=best.blocks)
        layers[l] = dict(entry, gains=True)
        write_manifest(out, cfg, kind="sidecar", layers=layers, notes=notes)
        back = read_sidecar(out, cfg, expect_kind="sidecar").gains.get(l)
        if back is None or not np.array_equal(back, best.gains):
            layers[l] = entry
            write_manifest(out, cfg, kind="sidecar", layers=layers, notes=notes)
            raise SolveError(f"layer {l}: the written gains do not decode to the solved lattice values")
        row["gains"] = True
    else:
        layers[l] = entry
        write_manifest(out, cfg, kind="sidecar", layers=layers, notes=notes)
    row["seconds"] = time.perf_counter() - t0
    return row


def solve_sidecar(*, base, out, domain: str, fit=("finance/fit",), checkpoint=None, lambdas=LAMBDAS,
                  alphas=ALPHAS, gate: float = GATE, sweeps: int = 3, min_events: int = MIN_EVENTS,
                  windows: int | None = None, backend: str = "cpu", cache_dir=None, tokenizer=None,
                  router_bias: bool = True, lattice: bool = True, shared_ridge: bool = True, fresh: bool = False,
                  tokens=None, progress: bool = True, n_layers: int | None = None) -> SidecarReport:
    """Solve (or resume) the sidecar of `domain` on the fitting slices `fit` into directory `out`. `tokens`
    [W, T] (or a .npy file of them) replaces the slices' windows (tests, or text that is not a committed slice).
    `n_layers` solves only the first n backbone layers (the manifest then stays "solving"; a rebuild check of a
    shipped sidecar's first layers, since layer k depends only on layers < k)."""
    from tqdm.auto import tqdm
    from ds4lib.config import Env
    out = Path(out)
    fit = [fit] if isinstance(fit, str) else list(fit)
    bf = BaseFile.open(base)
    cfg = bf.config
    # the engine's own lookup: a given checkpoint must carry the content hash the base records; without one,
    # the checkpoint beside the base with that hash (new base files record no path)
    checkpoint = find_engram_checkpoint(bf, checkpoint)
    reader = CheckpointReader.open(checkpoint, validate=False)
    if tokens is not None:
        toks = np.asarray(np.load(tokens) if isinstance(tokens, (str, Path)) else tokens, np.int64)[:windows]
        fit = [f"tokens:{hashlib.sha256(np.ascontiguousarray(toks).tobytes()).hexdigest()[:16]}"]
    else:
        toks = np.concatenate([load_slice(name).tokens[:windows] for name in fit])
    notes = {"domain": domain, "fit": fit, "windows": int(len(toks)), "base_sha256": file_sha256(base),
             "lambdas": [float(x) for x in lambdas], "alphas": [float(x) for x in alphas], "gate": float(gate),
             "sweeps": int(sweeps), "min_events": int(min_events), "router_bias": bool(router_bias),
             "lattice": bool(lattice), "shared_ridge": bool(shared_ridge), "heldout": "(quarter + window) % 4 == 3",
             "status": "solving"}
    layers = _prepare_out(out, cfg, notes, fresh)
    rep = SidecarReport(out=out, domain=domain, fit=fit, params={k: v for k, v in notes.items() if k != "status"})
    t0 = time.perf_counter()
    last = cfg.n_layers if n_layers is None else min(cfg.n_layers, n_layers)
    fix = build_fixture(checkpoint, toks, cache_dir or Env.read().cache_dir, n_layers=last)
    rep.fixture_seconds = time.perf_counter() - t0
    train = ~heldout_mask(len(fix.seqs), fix.seqs.shape[1])
    block = max(512, fix.seqs.shape[1])

    def eng_for(mounted):
        return _open_engine(base, checkpoint, out, mounted, backend, block, tokenizer)
    bar = tqdm(range(last), desc=f"ds4 sidecar {domain}", unit="layer", disable=not progress)
    for l in bar:
        if l in layers:
            rep.layers.append({"layer": l, "resumed": True, "gains": layers[l]["gains"], "bias": layers[l]["bias"],
                               "lam": layers[l].get("lambda"), "heldout_gain": layers[l].get("heldout_gain"),
                               "alpha": layers[l].get("alpha")})
            continue
        layers.pop(l, None)
        row = _solve_layer(l, eng_for=eng_for, out=out, cfg=cfg, fix=fix, reader=reader, train=train, layers=layers,
                           notes=notes, lambdas=lambdas, alphas=alphas, gate=gate, sweeps=sweeps,
                           min_events=min_events, router_bias=router_bias, lattice=lattice,
                           shared_ridge=shared_ridge)
        rep.layers.append(row)
        bar.set_postfix(gain=f"{100 * row['heldout_gain']:.1f}%", lam=row["lam"], mounted=row["gains"])
    if last < cfg.n_layers:                   # a partial solve: the manifest keeps saying "solving"
        rep.solve_seconds = time.perf_counter() - t0
        return rep
    notes["status"] = "complete"
    write_manifest(out, cfg, kind="sidecar", layers=layers, notes=notes)
    read_sidecar(out, cfg, expect_kind="sidecar")
    rep.solve_seconds = time.perf_counter() - t0
    rep.bytes = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    return rep

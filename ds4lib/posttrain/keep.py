""""Keep top-1" rows of ordinary text for the ③ solve (docs/posttrain.md "Ordinary text"): positions of a slice's
windows, teacher-forced through the engine's prefill (ds4lib.posttrain.capture.capture_text), each its top-1 against
its strongest rivals. ds4lib.posttrain.solve uses them as a per-gain ridge (solvers/margins.py ordinary_ridge, the
default) or as constraint rows beside the day's (`keep_as_rows`).

Why. A day's solve protects only the positions of that day's answers, and the gains it needs are large (on day 1 of
data/posttrain/general: last-layer channels scaled up to 5×); ② + ③ then lost 1.66 pp of Same top-1 on finance/judge
and 2.71 pp on english/judge against ② alone (BENCHMARKS.md). Rows from ordinary text price the gains' effect on
text the stack serves.

Which text. The ② sidecar's own fit slices (its manifest's notes "fit", finance/fit for the finance sidecar) and
english/fit unless given: text of the domain the stack serves and the general English every domain's text is
written in, both disjoint from the judging slices the gate measures on (domain/judge and english/judge). With
finance/fit alone day 1's ③ cost 0.19 pp on finance/judge but 0.56 pp on english/judge; adding english/fit raised the
predicted kept share of held-out english/fit windows from 0.943 to 0.969 (BENCHMARKS.md). Positions are
spread evenly over evenly spaced windows, `per_window` a window, so that every stratum of the slice is seen while the
capture stays a few prefills.

Shapes: W windows, T tokens per window, n positions, M rivals, N = n·M rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["KeepRows", "keep_rows", "keep_slices", "PER_WINDOW", "GENERAL"]

PER_WINDOW = 64                 # positions taken from one window (evenly spaced)
GENERAL = "english/fit"         # general text, added to the sidecar's own fit slices


@dataclass
class KeepRows:
    problem: object             # MarginProblem: constraint rows only, groups numbered 0 .. positions − 1
    slices: list                # the slice names the positions came from
    windows: list               # (slice, window index) per captured window
    positions: int
    seconds: float


def keep_slices(engine) -> list:
    """The fit slices the engine's ② sidecar was solved on (its manifest's notes), then GENERAL."""
    sc = engine.sidecar
    notes = (getattr(sc, "manifest", None) or {}).get("notes", {}) if sc is not None else {}
    fit = notes.get("fit") or []
    names = [str(f) for f in ([fit] if isinstance(fit, str) else fit)]
    return names + [GENERAL] * (GENERAL not in names)


def _plan(n_windows: int, T: int, n: int, per_window: int) -> list:
    """[(window, positions [k] in 1 .. T)]: ceil(n / per_window) windows evenly spaced, n positions spread."""
    used = min(n_windows, max(1, math.ceil(n / per_window)))
    wins = np.unique(np.linspace(0, n_windows - 1, used).round().astype(int))
    counts = np.full(len(wins), n // len(wins))
    counts[:n % len(wins)] += 1
    out = []
    for w, k in zip(wins, counts):
        k = int(min(k, T))
        pos = 1 + ((np.arange(k) + 0.5) * T / k).astype(np.int64)                    # distinct in 1 .. T
        out.append((int(w), pos))
    return out


def keep_rows(engine, *, positions: int, slices=None, windows=None, rivals: int = 4, norm: str = "linear",
              per_window: int = PER_WINDOW, progress: bool = False) -> KeepRows:
    """`positions` ordinary-text positions, split evenly over `slices` (default keep_slices(engine)), as constraint
    rows: (top-1, each of its `rivals` strongest others) on the ② stack the engine runs. `windows` {name: tokens
    [W, T]} stands in for the slice files (tests). Raises ValueError when there is no slice to take them from."""
    import time

    from ds4lib.corpus.slices import load_slice
    from ds4lib.eval.slices import BOS
    from ds4lib.formats.names import HEAD, NORM
    from ds4lib.posttrain.capture import _global, capture_text, rows_from_capture
    from ds4lib.solvers.margins import stack_problems
    if isinstance(positions, bool) or not isinstance(positions, (int, np.integer)) or positions < 1:
        raise ValueError(f"positions must be an integer ≥ 1, got {positions!r}")
    if windows is not None:
        texts = {str(k): np.asarray(v) for k, v in windows.items()}
    else:
        names = list(slices) if slices else keep_slices(engine)
        texts = {name: load_slice(name).tokens for name in names}
    t0 = time.perf_counter()
    cfg = engine.cfg
    head, gamma = _global(engine, HEAD), _global(engine, NORM)
    sc = engine.sidecar
    names = list(texts)
    share = np.full(len(names), positions // len(names))
    share[:positions % len(names)] += 1
    plans = [(name, w, pos) for name, k in zip(names, share) if k
             for w, pos in _plan(len(texts[name]), texts[name].shape[1], int(k), per_window)]
    if progress:
        from tqdm.auto import tqdm
        plans = tqdm(plans, desc="ds4 posttrain: ordinary text", unit="window")
    parts, used = [], []
    for name, w, pos in plans:
        toks = np.concatenate([[BOS], texts[name][w]]).astype(np.int64)
        cap = capture_text(engine, toks)
        prob, _ = rows_from_capture(cap, [], head=head, norm_weight=gamma, norm_eps=cfg.norm_eps, cfg=cfg,
                                    constraints=[int(p) for p in pos], norm=norm, rivals=rivals,
                                    sidecar_fnv=sc.fingerprint if sc is not None else None)
        parts.append(prob)
        used.append((name, w))
    problem = stack_problems(parts)
    return KeepRows(problem=problem, slices=names, windows=used, positions=int(problem.group.max()) + 1,
                    seconds=time.perf_counter() - t0)

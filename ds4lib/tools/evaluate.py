"""`ds4 eval --slice NAME [--slice NAME ...] -m base.gguf [--zchain DIR] [--original DIR] [--windows N]
[--score-split P] [--cuda] [--json]`: the five numbers (Same top-1; Σmin mean, median, p5; mean KL; PPL ratio) of a
stack against the original model on slices (e.g. finance/judge), as a table and JSON, scored by the engine on the
backend that serves (the CPU, or the GPU with --cuda); the backend and the domain are part of the report."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from ds4lib.tools.argtypes import int_at_least
from ds4lib.tools.engine_args import add_engine_args, open_engine

__all__ = ["register", "format_table"]


def format_table(rows: dict) -> str:
    head = f"{'slice':<18} {'Same top-1':>10} {'Σmin mean':>10} {'median':>8} {'p5':>8} {'mean KL':>8} " \
           f"{'PPL orig':>9} {'PPL ratio':>9} {'positions':>9}"
    lines = [head]
    for name, c in rows.items():
        lines.append(f"{name:<18} {100 * c['same_top1']:>9.2f}% {c['sigma_min_mean']:>10.3f} "
                     f"{c['sigma_min_median']:>8.3f} {c['sigma_min_p5']:>8.3f} {c['kl_mean']:>8.3f} "
                     f"{c['ppl_original']:>9.3f} {c['ppl_ratio']:>9.3f} {c['n']:>9}")
    return "\n".join(lines)


def _windows(a, path: str):
    if a.ndim != 2 or a.shape[1] < 2 or a.dtype.kind not in "iu":
        raise ValueError(f"{path}: expected integer token windows [W, N >= 2], got {a.dtype} {list(a.shape)}")
    return a


def _run(args) -> int:
    import numpy as np

    from ds4lib.config import Env
    from ds4lib.corpus.slices import SliceError, load_slice
    from ds4lib.engine import EngineError
    from ds4lib.eval import Teacher, evaluate_windows
    if not (args.slice or args.windows_file):
        print("ds4 eval: give --slice or --windows-file", file=sys.stderr)
        return 2
    inputs = {}
    try:                                       # every input is checked before the (slow) engine load
        for name in args.slice or []:
            inputs[name] = load_slice(name).tokens
        for f in args.windows_file or []:
            inputs[f] = _windows(np.load(f, allow_pickle=False), f)
    except (SliceError, OSError, ValueError) as e:
        print(f"ds4 eval: {e}", file=sys.stderr)
        return 2
    try:
        engine = open_engine(args)
        original = Path(args.original or engine.engram_dir)
        teacher = Teacher(original, Env.read().cache_dir / "teacher")
    except (EngineError, ValueError) as e:
        print(f"ds4 eval: {e}", file=sys.stderr)
        return 2
    rows, t0 = {}, time.time()
    for name, windows in inputs.items():
        comp, _ = evaluate_windows(engine, teacher, windows[:args.windows], split=args.score_split)
        rows[name] = comp.as_dict()
        print(format_table({name: rows[name]}).splitlines()[-1] if not args.json else "", file=sys.stderr)
    out = {"stack": engine.describe(), "original": str(original), "slices": rows, "seconds": time.time() - t0}
    print(json.dumps(out, indent=1) if args.json else format_table(rows) +
          f"\n({engine.backend.name} backend, domain {engine.domain}, {out['seconds']:.1f} s)")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


def register(sub):
    p = sub.add_parser("eval", help="the five quality numbers of a stack vs the original on slices")
    add_engine_args(p)
    p.add_argument("--slice", action="append", help="e.g. finance/judge (repeatable)")
    p.add_argument("--windows-file", action="append", help="a .npy of token windows [W, N] (repeatable)")
    p.add_argument("--original", default=None, help="original checkpoint (default: the Engram directory)")
    p.add_argument("--windows", type=int_at_least(1), default=None, help="first N windows of each slice only")
    p.add_argument("--score-split", type=int_at_least(0), default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.set_defaults(func=_run)

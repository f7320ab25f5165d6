"""`ds4 posttrain --base FILE --zchain DIR --requests FILE --out DIR [--engram-dir DIR] [--tau T] [--rho R] [--lam L]
[--kappa K] [--rivals M] [--rounds N] [--min-flip F] [--min-kept K] [--cuda] [--quiet]`: solve a ③ post-training
directory from requests with right answers (ds4lib.posttrain.solve: the requests format, decision points, gates,
where files go).

Exit status: 0 the candidate passed its gates and is installed as --out (a previous --out kept as --out.old);
1 it failed a gate and was written to <out parent>/rejected/<out name>-<timestamp>/ instead (--out untouched);
2 the inputs were refused (a one-line message, nothing written), including "every answer is already right".
"""
from __future__ import annotations

import sys

from ds4lib.tools.argtypes import finite_float, int_at_least

__all__ = ["register", "main"]


def _run(args) -> int:
    from ds4lib.engine import EngineError
    from ds4lib.formats.sidecar import SidecarError
    from ds4lib.posttrain.capture import CaptureError
    from ds4lib.posttrain.solve import PosttrainError, format_report, solve_posttrain
    try:
        rep = solve_posttrain(base=args.base, zchain=args.zchain, requests=args.requests, out=args.out,
                              engram_dir=args.engram_dir, tau=args.tau, rho=args.rho, lam=args.lam,
                              kappa=args.kappa, rivals=args.rivals, rounds=args.rounds, min_flip=args.min_flip,
                              min_kept=args.min_kept,
                              backend="cuda" if args.cuda else "cpu", progress=not args.quiet)
    except (PosttrainError, EngineError, SidecarError, CaptureError) as e:
        print(f"ds4 posttrain: {e}", file=sys.stderr)
        return 2
    print(format_report(rep))
    return 0 if rep.installed else 1


def register(sub):
    from ds4lib.posttrain.solve import KAPPA, LAM, MIN_FLIP, MIN_KEPT, RHO, RIVALS, ROUNDS, TAU
    p = sub.add_parser("posttrain", help="solve a ③ post-training file from requests with right answers")
    p.add_argument("--base", required=True, help="the ① base GGUF file")
    p.add_argument("--zchain", required=True, help="the ② sidecar directory the ③ stacks on")
    p.add_argument("--requests", required=True, help='JSON lines: {"id": ..., "prompt": text, "answer": text}')
    p.add_argument("--out", required=True, help="the ③ directory to write (an existing one is kept as OUT.old)")
    p.add_argument("--engram-dir", default=None, help="original checkpoint directory holding the Engram tables "
                                                      "(default: the one beside the base with its content hash)")
    p.add_argument("--tau", type=finite_float(0.0, lo_open=True), default=TAU,
                   help=f"target margin of a decision point (default {TAU:g})")
    p.add_argument("--rho", type=finite_float(0.0), default=RHO, help=f"constraint row weight (default {RHO:g})")
    p.add_argument("--lam", type=finite_float(0.0, lo_open=True), default=LAM,
                   help=f"ridge on the gains, > 0 (default {LAM:g})")
    p.add_argument("--kappa", type=finite_float(0.0), default=KAPPA,
                   help=f"margin a constraint row pushed down by the FP4 rounding is held at (default {KAPPA:g})")
    p.add_argument("--rivals", type=int_at_least(1), default=RIVALS,
                   help=f"rows per position: the right (or top) token against its M strongest others "
                        f"(default {RIVALS})")
    p.add_argument("--rounds", type=int_at_least(1), default=ROUNDS, help=f"FP4 lattice rounds (default {ROUNDS})")
    p.add_argument("--min-flip", type=finite_float(0.0), default=MIN_FLIP,
                   help=f"gate: predicted flipped share of the decision points (default {MIN_FLIP:g})")
    p.add_argument("--min-kept", type=finite_float(0.0), default=MIN_KEPT,
                   help=f"gate: predicted kept share of the constraint rows (default {MIN_KEPT:g})")
    p.add_argument("--cuda", action="store_true", help="generate and capture on the CUDA backend")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_run)


def main(argv=None) -> int:
    """`ds4 posttrain ARGS` (the same as ds4lib.tools.cli.main(["posttrain", *ARGS]))."""
    from ds4lib.tools.cli import main as ds4_main
    return ds4_main(["posttrain", *(sys.argv[1:] if argv is None else argv)])

"""`ds4 posttrain --base FILE --zchain DIR --requests FILE --out DIR [--engram-dir DIR] [--tau T] [--rho R] [--lam L]
[--kappa K] [--rivals M] [--rounds N] [--min-flip F] [--min-kept K] [--keep-positions N] [--keep-slice NAME ...]
[--keep-rivals M] [--keep-rho R] [--keep-as-rows] [--judge-slice NAME ...] [--max-top1-drop PP] [--original DIR] [--cuda] [--quiet]`: solve a ③
post-training directory from requests with right answers (ds4lib.posttrain.solve: the requests format, decision
points, ordinary-text rows, gates, where files go). --judge-slice (e.g. finance/judge and english/judge) adds the
judging-slice gate: about two minutes a slice on the 2-core dev box, so it is off unless asked; the nightly notebook
asks for it.

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
                              min_kept=args.min_kept, keep_positions=args.keep_positions,
                              keep_slices=args.keep_slice, keep_rivals=args.keep_rivals, keep_rho=args.keep_rho,
                              keep_as_rows=args.keep_as_rows, rival_passes=args.rival_passes,
                              judge_slices=args.judge_slice or (), max_top1_drop=args.max_top1_drop / 100,
                              original=args.original, backend="cuda" if args.cuda else "cpu", progress=not args.quiet)
    except (PosttrainError, EngineError, SidecarError, CaptureError) as e:
        print(f"ds4 posttrain: {e}", file=sys.stderr)
        return 2
    print(format_report(rep))
    return 0 if rep.installed else 1


def register(sub):
    from ds4lib.posttrain.solve import (KAPPA, KEEP_POSITIONS, KEEP_RHO, KEEP_RIVALS, LAM, MAX_TOP1_DROP, MIN_FLIP, MIN_KEPT,
                                        RHO, RIVAL_PASSES, RIVALS, ROUNDS, TAU)
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
    p.add_argument("--rival-passes", type=int_at_least(0), default=RIVAL_PASSES,
                   help=f"passes that add the tokens the solved gains are predicted to bring within reach of a "
                        f"position's token as rows of that position, then re-solve (default {RIVAL_PASSES}; 0: none)")
    p.add_argument("--rounds", type=int_at_least(1), default=ROUNDS, help=f"FP4 lattice rounds (default {ROUNDS})")
    p.add_argument("--min-flip", type=finite_float(0.0), default=MIN_FLIP,
                   help=f"gate: predicted flipped share of the decision points (default {MIN_FLIP:g})")
    p.add_argument("--min-kept", type=finite_float(0.0), default=MIN_KEPT,
                   help=f"gate: predicted kept share of the constraint rows (default {MIN_KEPT:g})")
    p.add_argument("--keep-positions", type=int_at_least(0), default=KEEP_POSITIONS,
                   help=f"ordinary-text positions whose 'keep top-1' rows weigh the ridge (default {KEEP_POSITIONS}; "
                        f"0: none)")
    p.add_argument("--keep-slice", action="append", default=None,
                   help="slice the ordinary positions come from (repeatable; default the sidecar's fit slices and "
                        "english/fit)")
    p.add_argument("--keep-rivals", type=int_at_least(1), default=KEEP_RIVALS,
                   help=f"rows per ordinary position (default {KEEP_RIVALS})")
    p.add_argument("--keep-rho", type=finite_float(0.0), default=KEEP_RHO,
                   help=f"weight of the ordinary rows' squared changes in the ridge (default {KEEP_RHO:g})")
    p.add_argument("--keep-as-rows", action="store_true",
                   help="solve the ordinary rows as constraint rows of weight --rho instead (slower; measured worse "
                        "on held-out text: docs/posttrain.md)")
    p.add_argument("--judge-slice", action="append", default=None,
                   help="gate: Same top-1 of ② + ③ against ② alone on this slice (repeatable; off by default: "
                        "about two minutes a slice)")
    p.add_argument("--max-top1-drop", type=finite_float(0.0), default=100 * MAX_TOP1_DROP,
                   help=f"the judging gate's bound in percentage points (default {100 * MAX_TOP1_DROP:g})")
    p.add_argument("--original", default=None,
                   help="original checkpoint for the judging gate's teacher (default: the Engram directory)")
    p.add_argument("--cuda", action="store_true", help="generate and capture on the CUDA backend")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_run)


def main(argv=None) -> int:
    """`ds4 posttrain ARGS` (the same as ds4lib.tools.cli.main(["posttrain", *ARGS]))."""
    from ds4lib.tools.cli import main as ds4_main
    return ds4_main(["posttrain", *(sys.argv[1:] if argv is None else argv)])

"""`ds4 sidecar --base FILE --domain NAME --fit SLICE [--fit SLICE ...] --out DIR [--cuda] [--original DIR]
[--lambdas L,L,..] [--alphas A,A,..] [--gate G] [--windows N] [--no-router-bias] [--float-then-round] [--own-ridge]
[--fresh] [--quiet] [--json FILE]`: solve the ②
sidecar of one domain against the original (ds4lib.sidecar.solve_sidecar; the math and gates: docs/sidecar.md).

Resumable per layer: rerunning the same command after an interruption keeps every layer already written and
continues with the next; a directory solved with other parameters is refused (--fresh starts over and keeps
the previous directory as DIR.old). Prints one row per layer (router bias α and same-set rate, λ, held-out
gain, mounted or not) and the wall time.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

__all__ = ["register", "format_layers"]


def _floats(text: str, flag: str):
    try:
        vals = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag} must be a comma list of numbers, got {text!r}") from None
    if not vals or any(v < 0 for v in vals):
        raise ValueError(f"{flag} must list at least one non-negative number, got {text!r}")
    return vals


def format_layers(rows) -> str:
    lines = [f"{'layer':>5} {'Δb':>3} {'α':>5} {'same-set before→after':>22} {'λ':>8} {'held-out gain':>13} "
             f"{'gains':>6}"]
    for r in rows:
        a = "-" if r.get("alpha") is None else f"{r['alpha']:g}"
        ss = (f"{100 * r['same_set_before']:.2f}% → {100 * r['same_set_after']:.2f}%"
              if "same_set_before" in r else "(resumed)" if r.get("resumed") else "-")
        lam = "-" if r.get("lam") is None else f"{r['lam']:g}"
        gain = "-" if r.get("heldout_gain") is None else f"{100 * r['heldout_gain']:.2f}%"
        lines.append(f"{r['layer']:>5} {'yes' if r['bias'] else 'no':>3} {a:>5} {ss:>22} {lam:>8} {gain:>13} "
                     f"{'yes' if r['gains'] else 'no':>6}")
    return "\n".join(lines)


def _run(args) -> int:
    from ds4lib.corpus.slices import SliceError
    from ds4lib.engine import EngineError
    from ds4lib.formats.checkpoint import CheckpointError
    from ds4lib.formats.gguf import BaseFileError
    from ds4lib.formats.sidecar import SidecarError
    from ds4lib.sidecar import CaptureError, SolveError, solve_sidecar
    from ds4lib.solvers import ALPHAS, LAMBDAS
    try:
        lambdas = _floats(args.lambdas, "--lambdas") if args.lambdas is not None else LAMBDAS
        alphas = _floats(args.alphas, "--alphas") if args.alphas is not None else ALPHAS
        if not 0 <= args.gate < 1:
            raise ValueError(f"--gate must be in [0, 1), got {args.gate}")
        if not Path(args.base).is_file():
            raise ValueError(f"{args.base}: no such base file")
        rep = solve_sidecar(base=args.base, out=args.out, domain=args.domain, fit=args.fit,
                            checkpoint=args.original, lambdas=lambdas, alphas=alphas, gate=args.gate,
                            windows=args.windows, backend="cuda" if args.cuda else "cpu", fresh=args.fresh,
                            router_bias=not args.no_router_bias, lattice=not args.float_then_round,
                            shared_ridge=not args.own_ridge, progress=not args.quiet)
    except (ValueError, SliceError, EngineError, CheckpointError, BaseFileError, SidecarError, SolveError,
            CaptureError, FileNotFoundError) as e:
        print(f"ds4 sidecar: {e}", file=sys.stderr)
        return 2
    print(format_layers(rep.layers))
    print(f"\nwrote {rep.out}: gains on {len(rep.mounted)} of {len(rep.layers)} layers {rep.mounted}, router bias on "
          f"{len(rep.biased)} {rep.biased}; {rep.bytes:,} bytes; teacher fixture {rep.fixture_seconds:.1f} s, "
          f"solve {rep.solve_seconds:.1f} s in all")
    if args.json:
        from ds4lib.report import to_jsonable
        Path(args.json).write_text(json.dumps(to_jsonable(rep.as_dict()), indent=1) + "\n")
    return 0


def register(sub):
    p = sub.add_parser("sidecar", help="solve a domain's ② sidecar (per-expert FP4 gains + router bias)")
    p.add_argument("--base", required=True, help="the ① base GGUF file")
    p.add_argument("--domain", required=True, help="the domain's name (recorded in the manifest)")
    p.add_argument("--fit", action="append", required=True, help="fitting slice, e.g. finance/fit (repeatable)")
    p.add_argument("--out", required=True, help="the sidecar directory to write (resumed if it exists)")
    p.add_argument("--original", default=None,
                   help="original checkpoint (default: the checkpoint beside the base with the content hash it records)")
    p.add_argument("--cuda", action="store_true", help="capture on the CUDA backend")
    p.add_argument("--lambdas", default=None, help="ridge grid, comma list (default 0.01,0.1,1,10,100,1000)")
    p.add_argument("--alphas", default=None, help="router-bias scale grid, comma list (default 0.5,1,1.5,2.5)")
    p.add_argument("--gate", type=float, default=0.005, help="mount a layer only above this held-out gain")
    p.add_argument("--windows", type=int, default=None, help="first N windows of each slice only")
    p.add_argument("--no-router-bias", action="store_true", help="ablation: gains only, no Δb")
    p.add_argument("--float-then-round", action="store_true",
                   help="ablation: solve gains in float and round to FP4 once at the end (not lattice-direct)")
    p.add_argument("--own-ridge", action="store_true",
                   help="ablation: scale each expert's ridge by its own energy instead of the shared mean")
    p.add_argument("--fresh", action="store_true", help="start over (the old directory is kept as DIR.old)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", default=None, help="also write the report as JSON here")
    p.set_defaults(func=_run)

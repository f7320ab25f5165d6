"""`ds4 quantize --checkpoint DIR --out FILE [--bits-plan SPEC] [--rounds N] [--cuda] [--quiet]`:
an official-format checkpoint -> the ds4 base GGUF file (ds4lib.quant.quantize_checkpoint).
`ds4 quantize --checkpoint DIR --verify FILE [--layers all|L,L,...]`: rebuild FILE from DIR with the plan and rounds
stored in it and compare byte for byte, writing nothing (ds4lib.quant.verify_base); `--layers` limits the
routed-expert rebuild (Lloyd, the slow part) to those layers. Exit 0 when identical, 1 when not.

Prints the per-layer relative error of the routed experts, the size table (also stored in the file's
metadata) and the SHA-256 of the file. --bits-plan: `auto` (default: the seed's 14 of 40 shallowest layers
at 13 bits, scaled to the model's depth), a count N of shallowest 13-bit layers, or a comma list of 12/13
per backbone layer; DSpark stages are always 12-bit.
"""
from __future__ import annotations

from ds4lib.config import ConfigError
from ds4lib.formats.checkpoint import CheckpointError
from ds4lib.tools.argtypes import int_at_least

__all__ = ["register"]


def _verify(args) -> int:
    from ds4lib.quant import verify_base
    layers = None
    if args.layers != "all":
        try:
            layers = [int(v) for v in args.layers.split(",")]
        except ValueError:
            print(f"ds4 quantize: --layers must be 'all' or a comma list of layer numbers, got {args.layers!r}")
            return 2
    try:
        rep = verify_base(checkpoint=args.checkpoint, base=args.verify, vq_layers=layers,
                          device="cuda" if args.cuda else "cpu", progress=not args.quiet)
    except (CheckpointError, ConfigError, ValueError, OSError) as e:
        print(f"ds4 quantize: {e}")
        return 2
    print(f"verified {rep.path}: header {'same' if rep.header_ok else 'DIFFERENT'}, size "
          f"{'same' if rep.size_ok else 'DIFFERENT'}, {len(rep.checked) - len(rep.mismatched)} of {len(rep.checked)} "
          f"tensors the same (routed experts of layers {','.join(map(str, rep.vq_layers))}) in {rep.seconds:.1f} s")
    for name in rep.mismatched:
        print(f"  differs: {name}")
    return 0 if rep.ok else 1


def _run(args) -> int:
    from ds4lib.quant import DEFAULT_ROUNDS, format_size_table, quantize_checkpoint
    if args.verify is not None:
        return _verify(args)
    if args.out is None:
        print("ds4 quantize: --out FILE is required (or --verify FILE to check an existing base)")
        return 2
    try:
        rep = quantize_checkpoint(checkpoint=args.checkpoint, out=args.out, bits_plan=args.bits_plan,
                                  rounds=DEFAULT_ROUNDS if args.rounds is None else args.rounds,
                                  device="cuda" if args.cuda else "cpu", progress=not args.quiet)
    except (CheckpointError, ConfigError, ValueError) as e:
        print(f"ds4 quantize: {e}")
        return 2
    print(f"{'layer':>5} {'kind':<9} {'bits':>4} {'w1':>8} {'w2':>8} {'w3':>8} {'all':>8} {'bits/w':>7}")
    for r in rep.layer_rows():
        print(f"{r['layer']:>5} {r['kind']:<9} {r['bits']:>4} {r['w1']:>8.5f} {r['w2']:>8.5f} {r['w3']:>8.5f} "
              f"{r['all']:>8.5f} {r['bits_per_weight']:>7.4f}")
    print()
    print(format_size_table(rep.size_table))
    print()
    print(f"wrote {rep.path} ({rep.size_table['total_bytes']:,} bytes, bit plan {rep.bits_plan}, {rep.rounds} "
          f"Lloyd rounds, {rep.device}) in {rep.seconds:.1f} s")
    print(f"sha256 {rep.sha256}")
    return 0


def register(sub):
    p = sub.add_parser("quantize", help="quantize a checkpoint into the ds4 base GGUF (VQ experts, q4_K linears)")
    p.add_argument("--checkpoint", required=True, help="official-format checkpoint directory")
    p.add_argument("--out", default=None, help="output .gguf file")
    p.add_argument("--verify", default=None, metavar="FILE", help="rebuild FILE and compare byte for byte instead")
    p.add_argument("--layers", default="all", help="with --verify: routed-expert layers to rebuild (default all)")
    p.add_argument("--bits-plan", default="auto", help="auto | N (13-bit shallowest layers) | comma list of 12/13")
    p.add_argument("--rounds", type=int_at_least(1), default=None, help="Lloyd rounds per codebook (default 32)")
    p.add_argument("--cuda", action="store_true", help="run Lloyd and the assignment on the GPU (same bytes)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_run)

"""`ds4 tiny --out DIR --seed N [--config PRESET_OR_JSON]`: a seeded random checkpoint in the official format."""
from __future__ import annotations

from pathlib import Path

from ds4lib.config import ConfigError, ModelConfig
from ds4lib.synth import write_random_checkpoint

__all__ = ["register"]


def _run(args) -> int:
    try:
        cfg = ModelConfig.from_json(args.config) if Path(args.config).exists() else ModelConfig.preset(args.config)
    except ConfigError as e:
        print(f"ds4 tiny: {e}")
        return 2
    out = write_random_checkpoint(args.out, cfg, seed=args.seed)
    print(f"wrote a random {args.config} checkpoint (seed {args.seed}) to {out}")
    return 0


def register(sub):
    p = sub.add_parser("tiny", help="write a seeded random checkpoint of the tiny config in the official format")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", default="tiny", help="preset name or config.json (default: tiny)")
    p.set_defaults(func=_run)

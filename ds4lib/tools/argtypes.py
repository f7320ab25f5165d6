"""argparse value types for the command lines: a bad value is argparse's usage error (exit 2, one line naming the
flag and the value), never a traceback from deep inside the engine.

Owns: `int_at_least(lo)`, `seed`, `finite_float(lo, hi, lo_open=False)`. argparse shows the ValueError's message
only for ArgumentTypeError, so each type raises that.
"""
from __future__ import annotations

import argparse
import math

__all__ = ["int_at_least", "seed", "finite_float", "SEED_LIMIT"]

SEED_LIMIT = 1 << 64                # the sampler keys Philox with the seed as a 64-bit word


def int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"{value} is below the minimum of {lo}")
        return value
    parse.__name__ = f"integer >= {lo}"
    return parse


def seed(text: str) -> int:
    value = int_at_least(0)(text)
    if value >= SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"{value} does not fit the sampler's 64-bit seed (0 .. 2^64 - 1)")
    return value


def finite_float(lo: float = -math.inf, hi: float = math.inf, *, lo_open: bool = False):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if value < lo or value > hi or (lo_open and value == lo):
            lo_b = "(" if lo_open else "["
            raise argparse.ArgumentTypeError(f"{value} is outside {lo_b}{lo}, {hi}]")
        return value
    parse.__name__ = "number"
    return parse

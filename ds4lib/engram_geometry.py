"""Engram hash geometry derived from a config: primes, offsets, multipliers, table rows.

Nothing here is typed in: the released table sizes (384,006,168 and 384,016,682 rows) follow
from `engram_vocab_size`, the layer list, the n-gram order and the head count
(docs/architecture.md §8.3).

Shapes: Le Engram layers, O = max_ngram - 1 n-gram orders (2-gram first), Hh heads per order,
C = O * Hh hash columns per layer (order-major: column = (n-2) * Hh + head).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["EngramGeometry", "engram_geometry", "is_prime", "multiplier_bound"]


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for 64-bit integers."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in small:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def multiplier_bound(compressed_vocab: int) -> int:
    """Largest multiplier half-range so that compressed_id * multiplier fits in int64."""
    return max(1, ((2**63 - 1) // compressed_vocab) // 2)


@dataclass(frozen=True)
class EngramGeometry:
    layer_ids: tuple          # backbone layer ids with Engram
    primes: tuple             # [Le][C] prime moduli, order-major
    offsets: tuple            # [Le][C] exclusive prefix sums of primes
    multipliers: tuple        # [Le][max_ngram] odd int64 multipliers, lookback k = 0..max_ngram-1
    table_rows: tuple         # [Le] sum of primes
    n_heads: int
    max_ngram: int

    @property
    def n_cols(self) -> int:
        return (self.max_ngram - 1) * self.n_heads

    def arrays(self):
        """(primes, offsets, multipliers) as int64 arrays [Le, C], [Le, C], [Le, max_ngram]."""
        return (np.array(self.primes, dtype=np.int64), np.array(self.offsets, dtype=np.int64),
                np.array(self.multipliers, dtype=np.int64))


def engram_geometry(cfg) -> EngramGeometry:
    """Primes: for each layer, order and head, the smallest unused prime above a running candidate
    that restarts at engram_vocab_size - 1 for every order (global 'seen' set across layers)."""
    seen: set[int] = set()
    primes, offsets, mults, rows = [], [], [], []
    bound = multiplier_bound(cfg.engram_compressed_vocab_size) if cfg.engram_compressed_vocab_size > 0 else 1
    for layer in cfg.engram_layer_ids:
        cols = []
        for _order in range(cfg.engram_max_ngram_size - 1):
            cand = cfg.engram_vocab_size - 1
            for _head in range(cfg.engram_n_heads):
                cand += 1
                while not is_prime(cand) or cand in seen:
                    cand += 1
                seen.add(cand)
                cols.append(cand)
        primes.append(tuple(cols))
        offsets.append(tuple(int(x) for x in np.cumsum([0] + cols[:-1])))
        rows.append(int(sum(cols)))
        rng = np.random.default_rng(10007 * layer)
        vals = rng.integers(low=0, high=bound, size=(cfg.engram_max_ngram_size,), dtype=np.int64)
        mults.append(tuple(int(v) * 2 + 1 for v in vals))
    return EngramGeometry(tuple(cfg.engram_layer_ids), tuple(primes), tuple(offsets), tuple(mults),
                          tuple(rows), cfg.engram_n_heads, cfg.engram_max_ngram_size)

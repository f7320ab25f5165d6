"""Per-sequence state of the reference forward (docs/architecture.md §10.4, §10.5).

What persists between calls: the window rows of every layer (last W, in position order; the DSpark
stages' rings hold context rows), each compressor's incomplete group, the compressed KV and index-key
caches of KV-source layers, the Engram n-gram history and the position. Top-k lists, candidate masks,
the HC state and DSpark features are recomputed every call.

Speculative verification (engine/speculative.py) feeds 1 + k rows and keeps only the first n: `mark()` before the
call records what a rollback needs (references to the window rings, which a call replaces rather than mutates, the
cache row counts, the Engram history, and it opens each compressor's row log), and `rollback(mark, n, ...)` then
leaves the state exactly as if only those n rows had been fed: rings rebuilt from the marked rows plus the kept
ones, cache rows cut to the groups complete at the new position, incomplete groups rebuilt from the log.
Shapes: W window, Dh latent width, dI index head dim.
"""
from __future__ import annotations

import copy

import numpy as np

from dataclasses import dataclass

from ds4lib.ref.compressor import Pending

__all__ = ["GrowRows", "State", "Mark"]


class GrowRows:
    """Rows appended over time; capacity doubles, so appends are amortised O(rows)."""

    def __init__(self, width: int):
        self._buf = np.zeros((16, width), dtype=np.float32)
        self.n = 0

    def append(self, rows):
        rows = np.asarray(rows, dtype=np.float32)
        need = self.n + len(rows)
        if need > len(self._buf):
            cap = len(self._buf)
            while cap < need:
                cap *= 2
            buf = np.zeros((cap, self._buf.shape[1]), dtype=np.float32)
            buf[:self.n] = self._buf[:self.n]
            self._buf = buf
        self._buf[self.n:need] = rows
        self.n = need

    def view(self):
        return self._buf[:self.n]

    def truncate(self, n: int):
        if not 0 <= n <= self.n:
            raise ValueError(f"cannot truncate {self.n} rows to {n}")
        self._buf[n:self.n] = 0               # as if never written (a snapshot compares whole buffers)
        self.n = n


@dataclass
class Mark:
    """What State.rollback needs from before a call (State.mark)."""
    pos: int
    win_kv: list
    win_pos: list
    engram_hist: np.ndarray


class State:
    def __init__(self, cfg, roles, history_len: int):
        self.pos = 0
        dh = cfg.head_dim
        self.win_kv = [np.zeros((0, dh), dtype=np.float32) for _ in roles]
        self.win_pos = [np.zeros(0, dtype=np.int64) for _ in roles]
        self.pending = [Pending(dh) if r.owns_compressor and r.ratio > 1 else None for r in roles]
        self.ckv = {r.layer: GrowRows(dh) for r in roles if r.owns_compressor}
        self.idxk = {r.layer: GrowRows(cfg.index_head_dim) for r in roles if r.indexer_owns_k}
        self.engram_hist = np.full(history_len, -2, dtype=np.int64)

    def copy(self) -> "State":
        return copy.deepcopy(self)

    def mark(self) -> Mark:
        """Mark the state before a call whose rows may be partly rolled back; opens the compressors' row logs."""
        for p in self.pending:
            if p is not None:
                p.log = []
        return Mark(self.pos, list(self.win_kv), list(self.win_pos), self.engram_hist)

    def rollback(self, mark: Mark, n: int, ratios, engram_hist) -> None:
        """Keep the first n rows fed since `mark` (ratios: layer -> compress ratio of the cache owners; the Engram
        history after the kept tokens, which the model recomputes) and close the row logs. Only the layers the calls
        touched change; the window of a call of T rows must not exceed W."""
        if not 0 <= n <= self.pos - mark.pos:
            raise ValueError(f"rollback keeps {n} rows but {self.pos - mark.pos} were fed since the mark")
        end = mark.pos + n
        for l, (kv, pos) in enumerate(zip(self.win_kv, self.win_pos)):
            if pos is mark.win_pos[l] or np.array_equal(pos, mark.win_pos[l]):
                continue                      # a layer the calls did not touch (the DSpark rings)
            keep = (pos >= mark.pos) & (pos < end)
            if int(keep.sum()) != n:
                raise ValueError(f"layer {l}: the window no longer holds the {n} kept rows (call longer than W)")
            W = max(len(pos), len(mark.win_pos[l]))
            self.win_kv[l] = np.concatenate([mark.win_kv[l], kv[keep]])[-W:]
            self.win_pos[l] = np.concatenate([mark.win_pos[l], pos[keep]])[-W:]
        for l, rows in self.ckv.items():
            rows.truncate(min(rows.n, end // ratios[l]))
        for l, rows in self.idxk.items():
            rows.truncate(min(rows.n, end // ratios[l]))
        for l, p in enumerate(self.pending):
            if p is None:
                continue
            if p.log is None:
                raise ValueError(f"layer {l}: rollback without a mark (the compressor's row log is closed)")
            start = end // ratios[l] * ratios[l]
            for first, kv, score in p.log:
                if first <= start and end <= first + len(kv):
                    p.kv, p.score = kv[start - first:end - first].copy(), score[start - first:end - first].copy()
                    break
            else:
                if p.log:                     # an empty log: nothing was fed, the incomplete group stands
                    raise ValueError(f"layer {l}: no logged call covers positions {start}..{end - 1}")
            p.log = None
        self.engram_hist = engram_hist
        self.pos = end

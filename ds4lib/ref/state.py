"""Per-sequence state of the reference forward (docs/architecture.md §10.4, §10.5).

What persists between calls: the window rows of every layer (last W, in position order; the DSpark
stages' rings hold context rows), each compressor's incomplete group, the compressed KV and index-key
caches of KV-source layers, the Engram n-gram history and the position. Top-k lists, candidate masks,
the HC state and DSpark features are recomputed every call.
Shapes: W window, Dh latent width, dI index head dim.
"""
from __future__ import annotations

import copy

import numpy as np

from ds4lib.ref.compressor import Pending

__all__ = ["GrowRows", "State"]


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

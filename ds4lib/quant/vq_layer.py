"""One layer's routed experts through the base quantizer, streamed expert matrix by expert matrix.

Owns the two passes over a layer (never more than one expert matrix of float weights in memory, plus the
training pool):
  pass 1 `collect_layer`: f16 row gains of every expert matrix and the training pool, the vectors at
         equidistant positions of the layer's vector sequence (expert-major, then w1, w2, w3, then
         row-major), at most POOL_PER_CODEWORD per codeword;
  train  `train_codebook` (ds4lib.solvers.vq) on the pool;
  pass 2 `assign_layer`: the final assignment of every vector against the E4M3 codebook with the f16 gains,
         yielding indices and the exact engine error per expert matrix.
Does not own: the file (ds4lib.quant.base_file) or the math (ds4lib.solvers.vq).

Shape legend: E experts, R rows, K row length, J = K/8, N = R*J vectors per matrix, P pool vectors.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ds4lib.formats.names import layer_prefix
from ds4lib.formats.vq import EXPERT_MATRICES, VQ_DIM
from ds4lib.solvers.vq import (POOL_PER_CODEWORD, equidistant, matrix_error, normalize_rows, pool_size,
                               prepare_codebook, row_gains)

__all__ = ["LayerPool", "expert_weight", "collect_layer", "assign_layer", "layer_vectors"]


def expert_weight(reader, layer: int, expert: int, mat: str) -> np.ndarray:
    """float32 [out, in] of one routed-expert matrix from the checkpoint."""
    return reader.weight(f"{layer_prefix(reader.cfg, layer)}ffn.experts.{expert}.{mat}.weight")


def layer_vectors(cfg, layer: int) -> int:
    """Vectors per expert matrix (the same for w1, w2, w3: F*D/8)."""
    return cfg.moe_inter_dim * cfg.dim // VQ_DIM


@dataclass
class LayerPool:
    gains: dict              # mat -> float16 [E', rows] (E' = len(experts))
    pool: np.ndarray         # float32 [P, 8]
    experts: tuple
    n_vectors: int           # total vectors of the selected experts


def collect_layer(reader, layer: int, n_codewords: int, experts=None,
                  per_codeword: int = POOL_PER_CODEWORD, progress=None) -> LayerPool:
    """Pass 1 over `experts` (default all) of one layer: gains and the equidistant training pool."""
    cfg = reader.cfg
    experts = tuple(range(cfg.moe_shape(layer)[0])) if experts is None else tuple(experts)
    n_mat = layer_vectors(cfg, layer)
    total = len(experts) * len(EXPERT_MATRICES) * n_mat
    sel = equidistant(total, pool_size(total, n_codewords, per_codeword))
    pool = np.empty((sel.size, VQ_DIM), dtype=np.float32)
    gains = {m: [] for m in EXPERT_MATRICES}
    for ei, e in enumerate(experts):
        for mi, m in enumerate(EXPERT_MATRICES):
            w = expert_weight(reader, layer, e, m)
            g = row_gains(w)
            gains[m].append(g)
            base = (ei * len(EXPERT_MATRICES) + mi) * n_mat
            lo, hi = np.searchsorted(sel, [base, base + n_mat])
            if hi > lo:
                pool[lo:hi] = normalize_rows(w, g)[sel[lo:hi] - base]
            if progress:
                progress()
    return LayerPool(gains={m: np.stack(v) for m, v in gains.items()}, pool=pool, experts=experts,
                     n_vectors=total)


def assign_layer(reader, layer: int, gains: dict, codebook, backend, experts=None, progress=None):
    """Pass 2: for each expert (in order) and matrix (w1, w2, w3) yield
    (expert, mat, idx int32 [R, J], sse, ssw) with sse/ssw the exact engine error (float64).
    `codebook` holds the stored (E4M3) values; `gains` the stored f16 gains, indexed like `experts`."""
    cfg = reader.cfg
    experts = tuple(range(cfg.moe_shape(layer)[0])) if experts is None else tuple(experts)
    cb = np.ascontiguousarray(codebook, dtype=np.float32)
    prepared = prepare_codebook(cb)
    n_mat = layer_vectors(cfg, layer)
    for ei, e in enumerate(experts):
        ws = [expert_weight(reader, layer, e, m) for m in EXPERT_MATRICES]
        x = np.concatenate([normalize_rows(w, gains[m][ei]) for w, m in zip(ws, EXPERT_MATRICES)])
        idx_all = backend.fetch(backend.assign(backend.put(x), prepared))       # one call for w1, w2, w3
        for mi, (w, m) in enumerate(zip(ws, EXPERT_MATRICES)):
            idx = idx_all[mi * n_mat:(mi + 1) * n_mat].reshape(w.shape[0], w.shape[1] // VQ_DIM)
            sse, ssw = matrix_error(w, cb, gains[m][ei], idx)
            if progress:
                progress()
            yield e, m, idx, sse, ssw

"""Measurements of the base quantizer that the quantize notebook reports (issue 4 "Measure").

Owns: `bitwidth_curve` (one shared codebook per layer at 10..14 bits), `shared_vs_per_expert` (one codebook
per layer vs one per expert at equal index width), `file_errors` (relative error of every quantised tensor
recomputed from the base file against the checkpoint, next to what the quantizer reported: the
error-equals-engine-error check) and `default_layers`. Everything streams one layer at a time from the
checkpoint and writes nothing; rows are plain dicts for ds4lib.report.

Bits per weight of a VQ scheme count indices, f16 gains and E4M3 codebooks over the routed weights measured.
"""
from __future__ import annotations

import numpy as np

from ds4lib.formats.checkpoint import CheckpointReader
from ds4lib.formats.gguf import BaseFile
from ds4lib.formats.vq import EXPERT_MATRICES, VQ_DIM
from ds4lib.quant.base_file import DEFAULT_ROUNDS
from ds4lib.quant.cuda_backend import make_backend
from ds4lib.quant.vq_layer import assign_layer, collect_layer, expert_weight, layer_vectors
from ds4lib.solvers.vq import train_codebook

__all__ = ["default_layers", "bitwidth_curve", "shared_vs_per_expert", "file_errors", "vq_layer_error"]


def default_layers(cfg) -> list[int]:
    """First, middle and last backbone layer."""
    return sorted({0, cfg.n_layers // 2, cfg.n_layers - 1})


def _rel(stats) -> dict:
    s = np.asarray(stats, dtype=np.float64)
    rel = np.sqrt(s[:, 0] / np.where(s[:, 1] > 0, s[:, 1], 1.0))
    return {"w1": float(rel[0]), "w2": float(rel[1]), "w3": float(rel[2]),
            "all": float(np.sqrt(s[:, 0].sum() / max(s[:, 1].sum(), 1e-300)))}


def vq_layer_error(reader, layer: int, bits: int, rounds: int, backend, experts=None) -> tuple[np.ndarray, int]:
    """Quantize (in memory) `experts` of one layer with one shared codebook of 2^bits codewords.
    Returns (stats [3, 2] = (sum sq. error, sum sq. weight) per matrix, pool size)."""
    k = 1 << bits
    lp = collect_layer(reader, layer, k, experts=experts)
    tr = train_codebook(lp.pool, k, rounds, backend)
    stats = np.zeros((3, 2), dtype=np.float64)
    for _, m, _, sse, ssw in assign_layer(reader, layer, lp.gains, tr.codebook, backend, experts=experts):
        stats[EXPERT_MATRICES.index(m)] += (sse, ssw)
    return stats, lp.pool.shape[0]


def _bpw(cfg, layer, bits, n_experts, n_codebooks) -> float:
    n_w = 3 * cfg.dim * cfg.moe_inter_dim * n_experts
    gains = 16 * n_experts * (2 * cfg.moe_inter_dim + cfg.dim)
    return (bits * n_w / VQ_DIM + gains + n_codebooks * 8 * VQ_DIM * (1 << bits)) / n_w


def bitwidth_curve(*, checkpoint, layers=None, bits=(10, 11, 12, 13, 14), rounds: int = DEFAULT_ROUNDS,
                   device: str = "cpu") -> list[dict]:
    """Relative error of `layers` (default: first, middle, last) with one shared codebook per layer, per width."""
    reader = CheckpointReader.open(checkpoint)
    backend = make_backend(device)
    cfg = reader.cfg
    rows = []
    for layer in (default_layers(cfg) if layers is None else layers):
        n_exp = cfg.moe_shape(layer)[0]
        for b in bits:
            stats, pool = vq_layer_error(reader, layer, int(b), rounds, backend)
            rows.append({"layer": layer, "bits": int(b), "codewords": 1 << int(b), "pool": pool,
                         "vectors_per_codeword": round(pool / (1 << int(b)), 2),
                         "bits_per_weight": _bpw(cfg, layer, int(b), n_exp, 1), **_rel(stats)})
    reader.close()
    return rows


def shared_vs_per_expert(*, checkpoint, layers=None, bits: int = 12, rounds: int = DEFAULT_ROUNDS,
                         device: str = "cpu") -> list[dict]:
    """One codebook per layer (shared by all experts and matrices) vs one codebook per expert (shared by its
    three matrices), same index width. Rows: layer, scheme, relative errors, codebooks, bits per weight."""
    reader = CheckpointReader.open(checkpoint)
    backend = make_backend(device)
    cfg = reader.cfg
    rows = []
    for layer in (default_layers(cfg) if layers is None else layers):
        n_exp = cfg.moe_shape(layer)[0]
        shared, pool = vq_layer_error(reader, layer, bits, rounds, backend)
        per = np.zeros((3, 2), dtype=np.float64)
        for e in range(n_exp):
            s, _ = vq_layer_error(reader, layer, bits, rounds, backend, experts=(e,))
            per += s
        per_pool = min(3 * layer_vectors(cfg, layer), 1024 << bits)
        rows.append({"layer": layer, "scheme": "shared per layer", "bits": bits, "codebooks": 1,
                     "vectors_per_codeword": round(pool / (1 << bits), 2),
                     "bits_per_weight": _bpw(cfg, layer, bits, n_exp, 1), **_rel(shared)})
        rows.append({"layer": layer, "scheme": "one per expert", "bits": bits, "codebooks": n_exp,
                     "vectors_per_codeword": round(per_pool / (1 << bits), 2),
                     "bits_per_weight": _bpw(cfg, layer, bits, n_exp, n_exp), **_rel(per)})
    reader.close()
    return rows


def file_errors(*, base, checkpoint) -> dict:
    """Recompute every quantised tensor's error from the base file (the engine's values) against the checkpoint.
    Returns {"vq": rows per layer and matrix with `reported` and `recomputed` relative errors and their
    difference, "linears": rows per q4_K / Q8_0 / F16 tensor, "max_abs_diff": the largest difference}."""
    bf = BaseFile.open(base)
    reader = CheckpointReader.open(checkpoint)
    cfg = bf.config
    vq_rows = []
    for layer in range(cfg.n_all_layers):
        stats = np.zeros((3, 2), dtype=np.float64)
        for e in range(cfg.moe_shape(layer)[0]):
            for mi, m in enumerate(EXPERT_MATRICES):
                w = expert_weight(reader, layer, e, m).astype(np.float64)
                d = w - bf.dequant_expert(layer, e, m)
                stats[mi] += ((d * d).sum(), (w * w).sum())
        rep = bf.stats[layer]
        for mi, m in enumerate(EXPERT_MATRICES):
            r_rep = float(np.sqrt(rep[mi, 0] / rep[mi, 1]))
            r_new = float(np.sqrt(stats[mi, 0] / stats[mi, 1]))
            vq_rows.append({"layer": layer, "bits": bf.bits[layer], "matrix": m, "reported": r_rep,
                            "recomputed": r_new, "abs_diff": abs(r_rep - r_new)})
    lin_rows = []
    for t in bf.layout.values():
        if t.kind in ("q4_K", "q8_0", "f16"):
            w = reader.weight(t.source).astype(np.float64)
            d = w - bf.tensor(t.name)
            lin_rows.append({"tensor": t.name, "type": t.kind, "shape": list(t.shape),
                             "rel_error": float(np.sqrt((d * d).sum() / max((w * w).sum(), 1e-300)))})
    reader.close()
    bf.close()
    return {"vq": vq_rows, "linears": lin_rows, "max_abs_diff": max((r["abs_diff"] for r in vq_rows), default=0.0)}

"""Synthetic device weights at a config's true shapes, made on the GPU directly: what the real-size benchmark
(bench/bench_v41_decode.py) decodes with, since the V4.1 checkpoint is not at hand and its ~110 GB of weights
must never exist on the host (which has 128 GB).

Owns:
- `synthetic_plan(cfg, bits)`: every device array `upload_base` (ds4lib.engine.cuda_weights) would make for a base
  file of `cfg` with per-layer VQ widths `bits` (ds4lib.formats.gguf.base_file_layout), with its key, Lin kind,
  shape, dtype and value distribution; host-only, so sizes can be planned without a GPU.
- `synthetic_weights(cfg, bits, seed)`: that plan filled on the device by kernels.synth_fill: the same
  `CudaWeights` (same keys in the same order, Lin kinds, shapes, dtypes and `nbytes`; `vq_scale` None, no router
  deltas) with deterministic pseudo-random contents, chosen so a forward stays finite (module docstring of
  kernels.synth_fill for the formats).
- `SyntheticEngramTables`: the host side of the Engram gather (`reader.raw(name)[rows]` with row ids up to the real
  table sizes) over tables shrunk to `rows` rows, indexed modulo their size; `synthetic_token_map(cfg)`.
Does not own: the base file's layout (formats.gguf), the device structure (cuda_weights), the backend.

Value distributions follow the official test vectors' (ds4lib.synth's docstring), as uniform laws of the same
mean and deviation: projections fan_in^-1/2, the embedding 1, norm weights and Engram q/k weights 1 +- 0.1,
hc_*_fn 0.02, hc_*_base 0.2, hc_*_scale U(0.5, 1), attention sinks 0.5, router biases 0.1. VQ codebooks: E4M3 codes
of magnitude < 2; row gains fan_in^-1/2 / (the codebook's RMS), within a factor 2; index streams and 13th-bit
planes uniform random bytes (every index is a valid codeword), sized as the device layout of kernels.vq_gemv
(at V4.1's shapes the same bytes as the file's: no padding). Engram tables: E4M3 codes without the NaN codes,
each 32 scaled by 2^-7 (values within +-3.5, as an N(0, 1) table quantised the official way).

Shape legend: L layers, E experts, C codewords, D dim, F expert FFN width, S / P index / plane bytes per expert
matrix, R rows, K row length.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import cuda

from ds4lib.engine.cuda_weights import GEMV_WEIGHTS, CudaWeights, Lin, join_shared_gate_up
from ds4lib.formats.gguf import base_file_layout
from ds4lib.formats.names import EMBED, HEAD, NORM, layer_prefix
from ds4lib.formats.vq import EXPERT_MATRICES
from ds4lib.synth import synthetic_token_map as _token_map_list
from kernels import vq_gemv
from kernels.synth_fill import E4M3_SMALL_RMS, synth_fill, synth_key

__all__ = ["SynthTensor", "synthetic_plan", "synthetic_weights", "SyntheticEngramTables", "synthetic_token_map"]

_GLOBAL_KEYS = {EMBED: "embed", HEAD: "head", NORM: "norm"}
_VQ_KEYS = {"vq_codebook": "vq_cb", "vq_index": "vq_index", "vq_plane": "vq_plane", "vq_gain": "vq_gains"}
_ENGRAM_SCALE_BYTE = 127 - 7            # UE8M0 2^-7


@dataclass(frozen=True)
class SynthTensor:
    """One device array of the plan. `lin`: the Lin kind, or None for a plain array; `part`: the matrix index of a
    VQ gain (w1, w2, w3); `fmt`, `center`, `sigma`, `k`: how kernels.synth_fill fills it. A codebook is planned
    as its E4M3 codes (uint8 [C, 8], counted in `nbytes` as upload_base counts it), kept as `vq_cb` uint64 [C]."""
    layer: int
    key: str
    fmt: str
    shape: tuple
    dtype: type
    lin: str | None = None
    rows: int = 0
    k: int = 0
    center: float = 0.0
    sigma: float = 1.0
    part: int = -1

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def _vector_law(rel: str, shape) -> tuple[float, float]:
    """(mean, deviation) of a float32 vector or mHC matrix (module docstring)."""
    if rel.endswith("_fn"):
        return 0.0, 0.02
    if rel.endswith("_base"):
        return 0.0, 0.2
    if rel.startswith("hc_") and rel.endswith("_scale"):
        return 0.75, 0.5 / math.sqrt(12)
    if rel.endswith("attn_sink"):
        return 0.0, 0.5
    if rel.endswith("gate.bias") or rel.endswith("gate.bias_vl"):
        return 0.0, 0.1
    if rel.endswith("norm.weight") or rel.endswith("q_weight") or rel.endswith("k_weight"):
        return 1.0, 0.1
    return 0.0, shape[-1] ** -0.5


def _linear(t, layer, key, sigma) -> SynthTensor:
    """A linear exactly as cuda_weights._lin stores it for a real file (stored BF16 / E4M3 values are BF16-exact)."""
    rows, k = t.shape[0], t.shape[-1]
    if t.kind in ("q4_K", "q8_0"):
        return SynthTensor(layer, key, t.kind, t.byte_shape, np.uint8, t.kind, rows, k, sigma=sigma)
    if t.kind == "f16" or t.ggml.name == "F32":
        return SynthTensor(layer, key, "f32", t.shape, np.float32, "f32", rows, k, sigma=sigma)
    return SynthTensor(layer, key, "bf16", t.shape, np.uint16, "bf16", rows, k, sigma=sigma)


def _vq_block(cfg, layer, tensors) -> list[SynthTensor]:
    out = []
    d, f = cfg.dim, cfg.moe_inter_dim
    fan_in = {"w1": d, "w2": f, "w3": d}
    for t in tensors:
        key = _VQ_KEYS[t.kind]
        if t.kind == "vq_codebook":
            out.append(SynthTensor(layer, key, "e4m3", t.shape, np.uint8))
        elif t.kind in ("vq_index", "vq_plane"):                 # random bytes, sized as the device layout
            s_len, p_len = vq_gemv.device_stream_bytes((f, d), (d, f))
            shape = (t.shape[0], t.shape[1], s_len if t.kind == "vq_index" else p_len)
            out.append(SynthTensor(layer, key, "bits", shape, np.uint8))
        else:
            m = next(m for m in EXPERT_MATRICES if t.name.endswith(f".{m}.vq_gain"))
            out.append(SynthTensor(layer, key, "f16", t.shape, np.uint16, center=fan_in[m] ** -0.5 / E4M3_SMALL_RMS,
                                   part=EXPERT_MATRICES.index(m)))
    return sorted(out, key=lambda s: (list(_VQ_KEYS.values()).index(s.key), s.part))


def synthetic_plan(cfg, bits) -> list[SynthTensor]:
    """Every device array of `upload_base` for a base file of `cfg` with VQ widths `bits` (one per layer, DSpark
    stages included, as base_file_layout takes them), in upload order: embed, head, norm, then per backbone layer its
    tensors in file order and its VQ payload (vq_cb, vq_index, vq_plane, vq_gains w1 w2 w3)."""
    layout = base_file_layout(cfg, bits)
    by_name = {t.name: t for t in layout}
    plan = [_linear(by_name[EMBED], -1, "embed", 1.0), _linear(by_name[HEAD], -1, "head", cfg.dim ** -0.5),
            SynthTensor(-1, "norm", "f32", by_name[NORM].shape, np.float32, center=1.0, sigma=0.1)]
    if plan[0].lin not in ("q4_K", "q8_0"):
        raise ValueError(f"the embedding is {plan[0].lin}, expected q4_K or Q8_0 blocks")
    for l in range(cfg.n_layers):
        p = layer_prefix(cfg, l)
        mine = [t for t in layout if t.name.startswith(p)]
        for t in mine:
            if t.name.endswith(".scale") or t.kind.startswith("vq_"):
                continue
            rel = t.name[len(p):]
            if t.kind in ("q4_K", "q8_0", "f16") or rel in GEMV_WEIGHTS:
                plan.append(_linear(t, l, rel, t.shape[-1] ** -0.5))
            else:
                c, s = _vector_law(rel, t.shape)
                plan.append(SynthTensor(l, rel, "f32", t.shape, np.float32, center=c, sigma=s))
        plan.extend(_vq_block(cfg, l, [t for t in mine if t.kind.startswith("vq_")]))
    return plan


def synthetic_weights(cfg, bits, seed: int = 0, stream=0) -> CudaWeights:
    """`synthetic_plan(cfg, bits)` made on the device (module docstring); returns when every fill has run.
    Tensor i of the plan is filled from synth_key(seed, i) alone; nothing of weight size touches the host."""
    W = CudaWeights({}, [{} for _ in range(cfg.n_layers)])
    gains = [[None] * len(EXPERT_MATRICES) for _ in range(cfg.n_layers)]
    for i, t in enumerate(synthetic_plan(cfg, bits)):
        d = cuda.device_array(t.shape, t.dtype, stream=stream)
        synth_fill(d, t.fmt, key=synth_key(seed, i), center=t.center, sigma=t.sigma, k=t.k, stream=stream)
        W.nbytes += t.nbytes
        if t.key == "vq_cb":
            d = vq_gemv.vq_codebook(d, stream=stream)            # the same bytes as uint64 [C]
        value = Lin(t.lin, d, t.rows, t.k) if t.lin else d
        if t.layer < 0:
            W.g[t.key] = value
        elif t.key == "vq_gains":
            gains[t.layer][t.part] = d
        else:
            W.L[t.layer][t.key] = value
    for l, w in enumerate(W.L):
        w.setdefault("vq_plane", None)                           # 12-bit layers: after vq_index, as upload_base
        w["vq_gains"] = tuple(gains[l])
        w["vq_scale"] = None
        w["vq_experts"] = cfg.moe_shape(l)[0]
        join_shared_gate_up(w, stream=stream)                    # as upload_base
    if stream:
        stream.synchronize()
    else:
        cuda.synchronize()
    return W


def synthetic_token_map(cfg) -> np.ndarray:
    """int64 [vocab] compressed Engram ids < engram_compressed_vocab_size (ds4lib.synth.synthetic_token_map)."""
    return np.asarray(_token_map_list(cfg), dtype=np.int64)


class _ModuloRows:
    """A table of the real shape whose rows repeat a small host array: a[rows] = data[rows % len(data)]."""

    def __init__(self, data, real_rows):
        self.data, self.shape, self.dtype = data, (int(real_rows),) + data.shape[1:], data.dtype

    def __getitem__(self, rows):
        rows = np.asarray(rows)
        if rows.size and (rows.min() < 0 or rows.max() >= self.shape[0]):
            raise IndexError(f"Engram row ids outside [0, {self.shape[0]})")
        return self.data[rows % self.data.shape[0]]


class SyntheticEngramTables:
    """Engram tables for the host gather: `raw(name)` for `{layer prefix}engram.embed.weight` (E4M3 codes
    uint8 [R, hd]) and `.scale` (UE8M0 bytes [R, hd/32]) takes row ids up to the real table size and returns
    rows of a table shrunk to `rows` rows (module docstring), made on the host from `seed`."""

    def __init__(self, cfg, rows: int = 1 << 20, seed: int = 0):
        self._t = {}
        hd = cfg.engram_head_dim
        for i, l in enumerate(cfg.engram_layer_ids):
            real = cfg.engram_num_embeddings[i]
            n = min(int(rows), real)
            codes = np.random.default_rng([seed, l]).integers(0, 256, (n, hd), dtype=np.uint8)
            codes[(codes & 0x7F) == 0x7F] ^= 1                   # never the NaN codes 0x7F / 0xFF
            scale = np.full((n, hd // 32), _ENGRAM_SCALE_BYTE, np.uint8)
            p = layer_prefix(cfg, l) + "engram.embed."
            self._t[p + "weight"] = _ModuloRows(codes, real)
            self._t[p + "scale"] = _ModuloRows(scale, real)

    def has(self, name) -> bool:
        return name in self._t

    def raw(self, name):
        return self._t[name]

    @property
    def nbytes(self) -> int:
        return sum(t.data.nbytes for t in self._t.values())

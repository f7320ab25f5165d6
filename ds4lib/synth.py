"""Seeded synthetic weights in the official formats: the random tiny checkpoint (`ds4 tiny`) and
real-shape layers for speed measurements.

Distributions follow the official test vectors' README (σ = standard deviation): projections
N(0, fan_in^-1/2); embeddings, the Markov embedding and Engram tables N(0, 1); norm weights and
Engram q/k weights 1 + N(0, 0.1); hc_*_fn σ 0.02, hc_*_base σ 0.2, hc_*_scale U(0.5, 1);
attn_sink σ 0.5; gate bias σ 0.1. In every indexer wq_b, query head 2j+1 is the negation of head 2j,
so an index score is never exactly 0 just because every ReLU vanished. Each tensor has its own
generator seeded by (seed, crc32(name)), so any subset can be produced alone and in any order.
"""
from __future__ import annotations

import json
import zlib

import numpy as np

from ds4lib.formats.checkpoint import TOKEN_MAP_FILE, CheckpointWriter
from ds4lib.formats.floats import f32_to_bf16_bits
from ds4lib.formats.fp4 import fp4_weight_quantize
from ds4lib.formats.fp8 import e4m3_encode, fp8_weight_quantize, pow2_ceil_exponent
from ds4lib.formats.names import DT_BF16, DT_E4M3, DT_F32, DT_FP4
from ds4lib.inventory import tensor_inventory

__all__ = ["random_float", "random_stored", "store_float", "write_random_checkpoint", "synthetic_token_map"]


def _rng(seed: int, name: str):
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def random_float(spec, seed: int, cfg) -> np.ndarray:
    """Float32 master value of one (non-scale) tensor."""
    g = _rng(seed, spec.name)
    shape, n = spec.logical, spec.name
    if n.endswith("hc_attn_fn") or n.endswith("hc_ffn_fn"):
        return (g.standard_normal(shape) * 0.02).astype(np.float32)
    if n.endswith("_base"):
        return (g.standard_normal(shape) * 0.2).astype(np.float32)
    if n.endswith("_scale") and "hc_" in n:
        return g.uniform(0.5, 1.0, shape).astype(np.float32)
    if n.endswith("attn_sink"):
        return (g.standard_normal(shape) * 0.5).astype(np.float32)
    if n.endswith("gate.bias") or n.endswith("gate.bias_vl"):
        return (g.standard_normal(shape) * 0.1).astype(np.float32)
    if n.endswith("norm.weight") or n.endswith("q_weight") or n.endswith("k_weight"):
        return (1 + g.standard_normal(shape) * 0.1).astype(np.float32)
    if n == "embed.weight" or n.endswith("markov_head.embed.weight") or n.endswith("engram.embed.weight"):
        return g.standard_normal(shape).astype(np.float32)
    w = (g.standard_normal(shape) * shape[-1] ** -0.5).astype(np.float32)
    if n.endswith("indexer.wq_b.weight"):
        nI, dI = cfg.index_n_heads, cfg.index_head_dim
        w = w.reshape(nI, dI, -1)
        w[1::2] = -w[0::2]
        w = w.reshape(shape)
    return w


def random_stored(spec, seed: int, cfg) -> dict:
    """{name: stored array} for a weight spec and its scale (if any)."""
    return store_float(spec, random_float(spec, seed, cfg), cfg)


def store_float(spec, w, cfg) -> dict:
    """Quantise a float32 master value into the spec's stored format: {name: array, [scale name: array]}.
    FP8 linears use 32x32 blocks, FP4 experts groups of 32, Engram tables one scale per row and 32
    columns; every scale is 2^ceil(log2(amax / max)) (the official convention)."""
    w = np.asarray(w, dtype=np.float32)
    if tuple(w.shape) != tuple(spec.logical):
        raise ValueError(f"{spec.name}: value shape {list(w.shape)}, expected {list(spec.logical)}")
    base = spec.name[: -len(".weight")] if spec.name.endswith(".weight") else spec.name
    if spec.dtype == DT_BF16:
        return {spec.name: f32_to_bf16_bits(w)}
    if spec.dtype == DT_F32:
        return {spec.name: w}
    if spec.dtype == DT_FP4:
        packed, scale = fp4_weight_quantize(w)
        return {spec.name: packed, base + ".scale": scale}
    if spec.dtype == DT_E4M3 and spec.name.endswith("engram.embed.weight"):
        g = w.reshape(w.shape[0], -1, 32)
        exp = np.clip(pow2_ceil_exponent(np.maximum(np.abs(g).max(-1), 1e-30) / np.float32(448)), -127, 127)
        codes = e4m3_encode(g / np.ldexp(np.float32(1), exp)[..., None]).reshape(w.shape)
        return {spec.name: codes, base + ".scale": (exp + 127).astype(np.uint8)}
    if spec.dtype == DT_E4M3:
        codes, scale = fp8_weight_quantize(w, cfg.fp8_block)
        return {spec.name: codes, base + ".scale": scale}
    raise ValueError(f"no generator for {spec.name} ({spec.dtype})")


def synthetic_token_map(cfg) -> list[int]:
    """A tokenizer-free Engram token map with exactly engram_compressed_vocab_size ids: ids from the DSpark
    noise token up keep unique ids, the rest fold as 3 + (id - 3) mod m (ids 0-2 and the first m+3 map to
    themselves). For the tiny config this is the official test vectors' map. When the special tail does not
    fit, every id above 2 folds."""
    V, C = cfg.vocab_size, cfg.engram_compressed_vocab_size
    tail_start = cfg.dspark_noise_token_id if cfg.n_mtp_layers else V
    n_tail = V - tail_start
    m = C - n_tail - 3
    if m <= 0 or tail_start < 3:          # no room for a unique special tail: fold every id above 2
        return [t if t < 3 else 3 + (t - 3) % (C - 3) for t in range(V)]
    out = []
    for t in range(V):
        if t < 3:
            out.append(t)
        elif t < tail_start:
            out.append(3 + (t - 3) % m)
        else:
            out.append(C - n_tail + (t - tail_start))
    return out


def write_random_checkpoint(out, cfg, seed: int = 0, progress=None):
    """Write a seeded random checkpoint of `cfg` in the official format, one tensor at a time."""
    inv = tensor_inventory(cfg)
    writer = CheckpointWriter(out, cfg, shard_bytes=512 << 20, metadata={"generator": f"ds4 tiny --seed {seed}"})
    pending = {}
    for spec in inv.values():
        if spec.is_scale:
            writer.add(spec.name, pending.pop(spec.name))
            continue
        arrays = random_stored(spec, seed, cfg)
        writer.add(spec.name, arrays.pop(spec.name))
        pending.update(arrays)
        if progress:
            progress(spec.name)
    extra = {}
    if cfg.engram_layer_ids:
        extra[TOKEN_MAP_FILE] = json.dumps({"token_map": synthetic_token_map(cfg),
                                            "compressed_vocab_size": cfg.engram_compressed_vocab_size}) + "\n"
    return writer.close(extra)

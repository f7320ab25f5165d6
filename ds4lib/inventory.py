"""Tensor inventory of the official V4.1 checkpoint layout, derived from a config (docs/architecture.md §12.2),
and the parameter counts that follow from it (docs/architecture.md §12.4).

Each `TensorSpec` gives the stored name, safetensors dtype and stored shape, plus the logical shape
(FP4 weights store two values per byte), the component it belongs to and its layer. Counts are
logical weight elements; block scales are counted separately. Vision tensors are outside this
inventory (the vision tower is out of scope); a checkpoint may carry them and they are skipped.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from ds4lib.formats.names import (DT_BF16, DT_E4M3, DT_E8M0, DT_F32, DT_FP4, EMBED, HEAD, NORM,
                                  layer_prefix)
from ds4lib.roles import layer_roles

__all__ = ["TensorSpec", "tensor_inventory", "parameter_counts", "IGNORED_PREFIXES"]

IGNORED_PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple           # stored shape
    logical: tuple         # logical element shape (FP4: in * 2)
    component: str
    layer: int             # -1 for global tensors
    is_scale: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for s in self.logical:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * {DT_BF16: 2, DT_F32: 4, DT_E4M3: 1, DT_E8M0: 1, DT_FP4: 1}[self.dtype]


def _cdiv(a, b):
    return -(-a // b)


class _Builder:
    def __init__(self, cfg):
        self.cfg = cfg
        self.specs: list[TensorSpec] = []

    def plain(self, name, dtype, shape, comp, layer):
        self.specs.append(TensorSpec(name, dtype, tuple(shape), tuple(shape), comp, layer))

    def fp8(self, name, out, inp, comp, layer):
        b = self.cfg.fp8_block
        self.specs.append(TensorSpec(name + ".weight", DT_E4M3, (out, inp), (out, inp), comp, layer))
        self.specs.append(TensorSpec(name + ".scale", DT_E8M0, (_cdiv(out, b), _cdiv(inp, b)),
                                     (_cdiv(out, b), _cdiv(inp, b)), comp, layer, True))

    def fp4(self, name, out, inp, comp, layer):
        self.specs.append(TensorSpec(name + ".weight", DT_FP4, (out, inp // 2), (out, inp), comp, layer))
        self.specs.append(TensorSpec(name + ".scale", DT_E8M0, (out, inp // 32), (out, inp // 32), comp, layer,
                                     True))


def _layer(b: _Builder, role):
    cfg, l = b.cfg, role.layer
    p = layer_prefix(cfg, l)
    D, H, Dh, qr, ol, G = cfg.dim, cfg.n_heads, cfg.head_dim, cfg.q_lora_rank, cfg.o_lora_rank, cfg.o_groups
    mix, hcd = (2 + cfg.hc_mult) * cfg.hc_mult, cfg.hc_mult * D
    if role.engram:
        e = p + "engram."
        rows = cfg.engram_num_embeddings[role.engram_index]
        hd, ncol = cfg.engram_head_dim, (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        b.plain(e + "embed.weight", DT_E4M3, (rows, hd), "engram_table", l)
        b.specs.append(TensorSpec(e + "embed.scale", DT_E8M0, (rows, hd // 32), (rows, hd // 32), "engram_table",
                                  l, True))
        b.plain(e + "q_weight", DT_BF16, (cfg.hc_mult, D), "engram_proj", l)
        b.plain(e + "k_weight", DT_BF16, (cfg.hc_mult, D), "engram_proj", l)
        b.fp8(e + "wkv", D * (cfg.hc_mult + 1), ncol * hd, "engram_proj", l)
    for sub in ("attn", "ffn"):
        b.plain(f"{p}hc_{sub}_fn", DT_F32, (mix, hcd), "mhc", l)
        b.plain(f"{p}hc_{sub}_base", DT_F32, (mix,), "mhc", l)
        b.plain(f"{p}hc_{sub}_scale", DT_F32, (3,), "mhc", l)
    b.plain(p + "attn_norm.weight", DT_BF16, (D,), "norms", l)
    b.plain(p + "ffn_norm.weight", DT_BF16, (D,), "norms", l)
    a = p + "attn."
    b.fp8(a + "wq_a", qr, D, "attention", l)
    b.plain(a + "q_norm.weight", DT_BF16, (qr,), "attention", l)
    b.fp8(a + "wq_b", H * Dh, qr, "attention", l)
    b.fp8(a + "wkv", Dh, D, "attention", l)
    b.plain(a + "kv_norm.weight", DT_BF16, (Dh,), "attention", l)
    b.plain(a + "attn_sink", DT_F32, (H,), "attention", l)
    b.fp8(a + "wo_a", G * ol, H * Dh // G, "attention", l)
    b.fp8(a + "wo_b", D, G * ol, "attention", l)
    if role.owns_compressor:
        b.plain(a + "compressor.wkv.weight", DT_BF16, (Dh, D), "compressor", l)
        if role.compressor_gate:
            b.plain(a + "compressor.wgate.weight", DT_BF16, (Dh, D), "compressor", l)
        b.plain(a + "compressor.norm.weight", DT_BF16, (Dh,), "compressor", l)
    if role.owns_indexer:
        b.fp8(a + "indexer.wq_b", cfg.index_n_heads * cfg.index_head_dim, qr, "indexer", l)
        b.plain(a + "indexer.weights_proj.weight", DT_BF16, (cfg.index_n_heads, D), "indexer", l)
        if role.indexer_owns_k:
            b.plain(a + "indexer.wk.weight", DT_BF16, (cfg.index_head_dim, Dh), "indexer", l)
            b.plain(a + "indexer.k_norm.weight", DT_BF16, (cfg.index_head_dim,), "indexer", l)
    f = p + "ffn."
    E, F = role.n_experts, cfg.moe_inter_dim
    b.plain(f + "gate.weight", DT_BF16, (E, D), "router", l)
    b.plain(f + "gate.bias", DT_F32, (E,), "router", l)
    if cfg.vision_enabled:
        b.plain(f + "gate.bias_vl", DT_F32, (E,), "router", l)
    for e in range(E):
        b.fp4(f"{f}experts.{e}.w1", F, D, "routed_experts", l)
        b.fp4(f"{f}experts.{e}.w2", D, F, "routed_experts", l)
        b.fp4(f"{f}experts.{e}.w3", F, D, "routed_experts", l)
    b.fp8(f + "shared_experts.w1", F, D, "shared_expert", l)
    b.fp8(f + "shared_experts.w2", D, F, "shared_expert", l)
    b.fp8(f + "shared_experts.w3", F, D, "shared_expert", l)
    if role.is_dspark and role.stage == 0:
        b.fp8(p + "main_proj", D, D * len(cfg.dspark_target_layer_ids), "dspark_heads", l)
        b.plain(p + "main_norm.weight", DT_BF16, (D,), "dspark_heads", l)
    if role.is_dspark and role.stage == cfg.n_mtp_layers - 1:
        V, R = cfg.vocab_size, cfg.dspark_markov_rank
        b.plain(p + "norm.weight", DT_BF16, (D,), "dspark_heads", l)
        b.plain(p + "markov_head.embed.weight", DT_BF16, (V, R), "dspark_heads", l)
        b.plain(p + "markov_head.head.weight", DT_BF16, (V, R), "dspark_heads", l)
        b.plain(p + "confidence_head.proj.weight", DT_BF16, (1, D + R), "dspark_heads", l)


def tensor_inventory(cfg) -> "OrderedDict[str, TensorSpec]":
    """Every tensor of the checkpoint, in a stable order: globals, then layers 0.., then DSpark stages."""
    b = _Builder(cfg)
    b.plain(EMBED, DT_BF16, (cfg.vocab_size, cfg.dim), "embed", -1)
    for role in layer_roles(cfg):
        _layer(b, role)
    b.plain(NORM, DT_BF16, (cfg.dim,), "norms", -1)
    b.plain(HEAD, DT_BF16, (cfg.vocab_size, cfg.dim), "head", -1)
    return OrderedDict((s.name, s) for s in b.specs)


def parameter_counts(cfg) -> dict:
    """Logical weight counts: total, by component (backbone and DSpark apart), Engram, active per token."""
    inv = tensor_inventory(cfg)
    by_comp: dict[str, int] = {}
    scales = 0
    for s in inv.values():
        if s.is_scale:
            scales += s.numel
            continue
        key = ("dspark." + s.component) if s.layer >= cfg.n_layers else s.component
        by_comp[key] = by_comp.get(key, 0) + s.numel
    total = sum(by_comp.values())
    engram_tables = by_comp.get("engram_table", 0)
    engram = engram_tables + by_comp.get("engram_proj", 0)
    dspark = sum(v for k, v in by_comp.items() if k.startswith("dspark."))
    routed = by_comp.get("routed_experts", 0)
    n_rows_gathered = len(cfg.engram_layer_ids) * (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads \
        * cfg.engram_head_dim
    active = (total - dspark - engram_tables - by_comp.get("embed", 0)
              - routed + routed * cfg.n_activated_experts // cfg.n_routed_experts
              + n_rows_gathered + cfg.dim)
    return {
        "total": total,
        "total_without_engram_tables": total - engram_tables,
        "engram_tables": engram_tables,
        "engram_total": engram,
        "dspark": dspark,
        "active_per_token": active,
        "scale_elements": scales,
        "stored_bytes": sum(s.nbytes for s in inv.values()),
        "n_tensors": len(inv),
        "by_component": dict(sorted(by_comp.items())),
    }

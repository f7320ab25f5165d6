"""Per-layer roles of a V4.1 model, derived from its config (docs/architecture.md §3).

A layer with ratio > 0 reads the compressed KV of kv_src(l) = max{s in kv_source_layers: s <= l}
and the top-k of idx_src(l) = max{s in index_source_layers: s <= l}. It owns a compressor iff it
is a KV source (with a gate iff ratio > 1), an indexer iff it is an index source, and the
indexer's key projection (wk, k_norm) iff it is both. The candidate source publishes its
two-level candidate blocks; index sources after it consume them. DSpark stages (ids n_layers..)
have ratio 0 and own no compressed state.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LayerRole", "layer_roles"]


@dataclass(frozen=True)
class LayerRole:
    layer: int                 # 0..n_layers-1 backbone, n_layers.. DSpark stages
    is_dspark: bool
    stage: int                 # DSpark stage index, -1 for backbone layers
    ratio: int                 # compression ratio (0 = sliding window only)
    rope_base: float
    yarn: bool                 # YaRN frequency interpolation on (compressed layers only)
    kv_src: int                # layer whose compressed KV this layer reads (-1 if none)
    idx_src: int               # layer whose top-k list this layer uses (-1 if none)
    owns_compressor: bool
    compressor_gate: bool      # ratio > 1 compressors have wgate (softmax pooling)
    owns_indexer: bool
    indexer_owns_k: bool       # indexer has wk/k_norm and writes the index-key cache
    publishes_candidates: bool
    consumes_candidates: bool
    engram: bool
    engram_index: int          # position in engram_layer_ids, -1 if none
    dspark_target: bool        # state entering this layer feeds the DSpark features
    n_experts: int
    top_k: int

    @property
    def kind(self) -> str:
        if self.is_dspark:
            return f"dspark stage {self.stage}"
        if self.ratio == 0:
            return "SWA"
        parts = []
        if self.owns_compressor:
            parts.append("KV source")
        if self.owns_indexer:
            parts.append("index source" + ("" if self.indexer_owns_k else " (no wk)"))
        if self.publishes_candidates:
            parts.append("publishes candidates")
        if self.consumes_candidates:
            parts.append("consumes candidates")
        return ", ".join(parts) if parts else "consumer"


def layer_roles(cfg) -> list[LayerRole]:
    roles = []
    kv, ix = cfg.kv_source_layers, cfg.index_source_layers
    cand = cfg.candidate_source_layer
    for l in range(cfg.n_all_layers):
        dspark = l >= cfg.n_layers
        r = cfg.compress_ratios[l]
        kv_src = max((s for s in kv if s <= l), default=-1) if r else -1
        idx_src = max((s for s in ix if s <= l), default=-1) if r else -1
        owns_c = (not dspark) and l in kv
        owns_i = (not dspark) and l in ix
        ne, k = cfg.moe_shape(l)
        roles.append(LayerRole(
            layer=l, is_dspark=dspark, stage=l - cfg.n_layers if dspark else -1, ratio=r,
            rope_base=cfg.compress_rope_theta if r else cfg.rope_theta, yarn=bool(r),
            kv_src=kv_src, idx_src=idx_src, owns_compressor=owns_c, compressor_gate=owns_c and r > 1,
            owns_indexer=owns_i, indexer_owns_k=owns_i and owns_c,
            publishes_candidates=owns_i and l == cand, consumes_candidates=owns_i and 0 <= cand < l,
            engram=l in cfg.engram_layer_ids,
            engram_index=cfg.engram_layer_ids.index(l) if l in cfg.engram_layer_ids else -1,
            dspark_target=(not dspark) and l in cfg.dspark_target_layer_ids,
            n_experts=ne, top_k=k))
    return roles

"""Every tensor name and on-disk dtype id of the official checkpoint layout (ARCHITECTURE.md §3.4).

Names follow the official module paths: `embed.weight`, `layers.{l}.attn.wq_a.weight`,
`mtp.{s}.main_proj.weight`, `layers.{l}.engram.embed.weight`, ... A quantised linear `X` is stored
as `X.weight` plus `X.scale`.
"""
from __future__ import annotations

__all__ = [
    "EMBED", "HEAD", "NORM", "layer_prefix", "ATTN_FP8_LINEARS", "SHARED_EXPERT", "EXPERT_MATS",
    "DT_BF16", "DT_F32", "DT_E4M3", "DT_E8M0", "DT_FP4", "DT_I64", "DT_I32", "DT_U8", "DT_F16",
]

EMBED = "embed.weight"
HEAD = "head.weight"
NORM = "norm.weight"

# safetensors dtype strings as they appear in the official checkpoint
DT_BF16 = "BF16"
DT_F32 = "F32"
DT_F16 = "F16"
DT_E4M3 = "F8_E4M3"
DT_E8M0 = "F8_E8M0"
DT_FP4 = "I8"        # float4_e2m1fn_x2: two E2M1 codes per byte, stored as I8
DT_I64 = "I64"
DT_I32 = "I32"
DT_U8 = "U8"

ATTN_FP8_LINEARS = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")
SHARED_EXPERT = "ffn.shared_experts"
EXPERT_MATS = ("w1", "w2", "w3")   # w1 = gate, w2 = down, w3 = up


def layer_prefix(cfg, layer: int) -> str:
    """`layers.{l}.` for backbone layers, `mtp.{s}.` for DSpark stages."""
    if layer < cfg.n_layers:
        return f"layers.{layer}."
    return f"mtp.{layer - cfg.n_layers}."

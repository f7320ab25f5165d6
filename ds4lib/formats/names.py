"""Every tensor name and on-disk dtype id of the official checkpoint layout (docs/architecture.md §12.2).

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


# ---------------------------------------------------------------------------------------------------------
# The ds4 base GGUF file (ds4lib.formats.gguf, ds4lib.formats.vq, ds4lib.formats.q4k). Appended for issue 4.
# Non-expert tensors keep their official names (`layers.3.attn.wq_a.weight`); the VQ routed experts of one
# layer (prefix `layers.{l}.` or `mtp.{s}.`) are stored as the tensors named below.
# ---------------------------------------------------------------------------------------------------------
__all__ += [
    "GGUF_ARCH", "KEY_FORMAT_VERSION", "KEY_VQ_MAGIC", "KEY_VQ_DIM", "KEY_VQ_BITS", "KEY_VQ_BITS_PLAN",
    "KEY_VQ_ROUNDS", "KEY_VQ_POOL", "KEY_VQ_CODEBOOK_FORMAT", "KEY_VQ_LAYOUT", "KEY_MODEL_CONFIG",
    "KEY_SOURCE_HASH", "KEY_SOURCE_DIR", "KEY_SIZE_TABLE", "KEY_QUANTIZER", "KEY_Q4K_FALLBACK",
    "VQ_CODEBOOK", "VQ_INDEX", "VQ_PLANE", "VQ_STATS", "vq_gain_name", "Q4K_LINEARS", "ROUTED_EXPERT_MARK",
    "ENGRAM_TABLE_MARK",
]

GGUF_ARCH = "ds4-v41"                               # general.architecture of the base file
KEY_FORMAT_VERSION = "ds4.format_version"           # uint32, whitelisted by the reader
KEY_VQ_MAGIC = "ds4.vq.magic"                       # string "DQV3"
KEY_VQ_DIM = "ds4.vq.dim"                           # uint32, 8
KEY_VQ_BITS = "ds4.vq.bits"                         # int array [n_layers + n_mtp_layers]: 12 or 13
KEY_VQ_BITS_PLAN = "ds4.vq.bits_plan"               # the plan spec as given (e.g. "auto")
KEY_VQ_ROUNDS = "ds4.vq.rounds"                     # uint32 Lloyd rounds
KEY_VQ_POOL = "ds4.vq.pool_per_codeword"            # uint32 training vectors per codeword (upper bound)
KEY_VQ_CODEBOOK_FORMAT = "ds4.vq.codebook_format"   # string "e4m3"
KEY_VQ_LAYOUT = "ds4.vq.index_layout"               # string naming the index layout (formats/vq.py)
KEY_MODEL_CONFIG = "ds4.model.config"               # JSON string, ModelConfig.to_hf_dict()
KEY_SOURCE_HASH = "ds4.source.content_hash"         # CheckpointReader.content_hash() of the source
KEY_SOURCE_DIR = "ds4.source.checkpoint_dir"        # legacy: an absolute path older quantizers wrote; not written now
KEY_SIZE_TABLE = "ds4.size_table"                   # JSON string, the size table
KEY_QUANTIZER = "ds4.quantizer"                     # string, quantizer name and version
KEY_Q4K_FALLBACK = "ds4.q4k.fallback"               # string: the type used where a row is not a multiple of 256

VQ_CODEBOOK = "ffn.experts.vq_codebook"   # I8 (E4M3 codes) [C, 8]
VQ_INDEX = "ffn.experts.vq_index"         # I8 (bytes) [E, 3, S]: 12-bit index stream per expert matrix
VQ_PLANE = "ffn.experts.vq_plane"         # I8 (bytes) [E, 3, P]: 13th-bit plane (13-bit layers only)
VQ_STATS = "ds4.vq.stats"                 # F64 [n_layers + n_mtp_layers, 3, 2]: (sum sq. error, sum sq. weight)
ROUTED_EXPERT_MARK = ".ffn.experts."      # official routed-expert tensors contain this
ENGRAM_TABLE_MARK = ".engram.embed."      # Engram tables (never copied into the base file)

# linears quantised to q4_K (suffix after the layer prefix, or a global name)
Q4K_LINEARS = (
    "attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight",
    "ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.weight", "ffn.shared_experts.w3.weight",
    "engram.wkv.weight", "main_proj.weight", "markov_head.embed.weight", "markov_head.head.weight",
    EMBED, HEAD,
)


def vq_gain_name(prefix: str, mat: str) -> str:
    """Row gains (F16 [E, rows of `mat`]) of one expert matrix kind of a layer: `layers.3.ffn.experts.w2.vq_gain`."""
    return f"{prefix}ffn.experts.{mat}.vq_gain"

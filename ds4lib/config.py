"""Model configuration of DeepSeek V4.1 Flash and the process environment.

Owns: `ModelConfig` (every architecture field, validated), reading it from an HF-style
`config.json` (V4.1 `text_config` keys) or from the flat inference keys (the official
`ModelArgs` names), the two presets `v41_flash()` and `tiny()`, and `Env`, the only place
that reads `os.environ`.

Does not own: per-layer roles (`ds4lib.roles`), Engram geometry (`ds4lib.engram_geometry`),
the tensor inventory (`ds4lib.inventory`).

Spec: docs/architecture.md §2.1–§2.2 (keys and released values), §2.3 (validation), §2.4 (tiny configuration).
Field names follow the flat inference keys; `HF_KEYS` maps the HF spellings onto them.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ConfigError", "ModelConfig", "Env", "HF_KEYS", "CONFIG_DIR"]

CONFIG_DIR = Path(__file__).with_name("configs")


class ConfigError(ValueError):
    """A config file or value that does not describe a valid V4.1 model."""


# HF `text_config` key -> ModelConfig field (docs/architecture.md §2.1). Keys absent here that share
# the field name (e.g. `vocab_size`, `head_dim`) are read under their own name.
HF_KEYS = {
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "qk_rope_head_dim": "rope_head_dim",
    "rms_norm_eps": "norm_eps",
    "n_routed_experts": "n_routed_experts",
    "num_experts_per_tok": "n_activated_experts",
    "moe_intermediate_size": "moe_inter_dim",
    "scoring_func": "score_func",
    "routed_scaling_factor": "route_scale",
    "sliding_window": "window_size",
    "kv_source_layer_ids": "kv_source_layers",
    "index_source_layer_ids": "index_source_layers",
    "candidate_source_layer_id": "candidate_source_layer",
    "engram_pad_token_id": "engram_pad_id",
    "num_nextn_predict_layers": "n_mtp_layers",
    "dspark_num_experts_per_tok": "dspark_n_activated_experts",
}

# HF keys that are read for validation only (they must hold the one value V4.1 supports).
_HF_FIXED = {
    "num_key_value_heads": 1,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "topk_method": "noaux_tc",
}
# Keys that may appear in a config and carry nothing the text model needs.
_IGNORED = {
    "architectures", "model_type", "dtype", "torch_dtype", "transformers_version", "vision_config",
    "quantization_config", "rope_scaling", "auto_map", "use_cache", "initializer_range",
    "max_batch_size", "max_seq_len", "temperature", "bos_token_id", "eos_token_id",
    "pad_token_id", "attention_bias", "attention_dropout", "text_config",
}


def _int_tuple(name, value):
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ConfigError(f"config field {name!r} must be a list of integers, got {value!r}")
    return tuple(value)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of one V4.1-family model. Every field is validated in `__post_init__`."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    n_routed_experts: int
    n_shared_experts: int
    n_activated_experts: int
    moe_inter_dim: int
    window_size: int
    compress_ratios: tuple
    kv_source_layers: tuple
    index_source_layers: tuple
    candidate_source_layer: int
    candidate_topk_blocks: int
    candidate_block_size: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    engram_layer_ids: tuple
    engram_num_embeddings: tuple
    engram_max_ngram_size: int
    engram_vocab_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_compressed_vocab_size: int
    n_mtp_layers: int
    dspark_block_size: int
    dspark_noise_token_id: int
    dspark_target_layer_ids: tuple
    dspark_markov_rank: int
    dspark_n_routed_experts: int
    dspark_n_activated_experts: int
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    norm_eps: float = 1e-20
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    original_seq_len: int = 65536
    rope_factor: float = 16.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_pad_id: int = 2
    image_token_id: int = 129264
    bos_token_id: int = 0
    eos_token_id: int = 1
    max_position_embeddings: int = 1048576
    fp8_block: int = 32
    expert_dtype: str = "fp4"
    vision_enabled: bool = False
    extra_keys: tuple = field(default=(), compare=False)

    # ------------------------------------------------------------------ validation
    def __post_init__(self):
        ints = [f.name for f in dataclasses.fields(self) if f.type == "int"]
        for name in ints:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ConfigError(f"config field {name!r} must be an integer, got {v!r}")
        for name in ("route_scale", "swiglu_limit", "gate_temp", "norm_eps", "rope_theta", "compress_rope_theta",
                     "rope_factor", "beta_fast", "beta_slow", "hc_eps"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise ConfigError(f"config field {name!r} must be a finite number, got {v!r}")
            object.__setattr__(self, name, float(v))
        for name in ("compress_ratios", "kv_source_layers", "index_source_layers", "engram_layer_ids",
                     "engram_num_embeddings", "dspark_target_layer_ids"):
            object.__setattr__(self, name, _int_tuple(name, getattr(self, name)))
        self._check_positive()
        self._check_attention()
        self._check_sparse()
        self._check_moe()
        self._check_engram()
        self._check_dspark()

    def _fail(self, msg):
        raise ConfigError(msg)

    def _check_positive(self):
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "head_dim", "rope_head_dim", "q_lora_rank",
                     "o_lora_rank", "o_groups", "n_routed_experts", "n_activated_experts", "moe_inter_dim",
                     "window_size", "index_n_heads", "index_head_dim", "index_topk", "hc_mult",
                     "hc_sinkhorn_iters", "fp8_block", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                self._fail(f"config field {name!r} must be > 0, got {getattr(self, name)}")
        for name in ("norm_eps", "hc_eps", "rope_theta", "compress_rope_theta", "rope_factor", "gate_temp",
                     "route_scale"):
            if getattr(self, name) <= 0:
                self._fail(f"config field {name!r} must be > 0, got {getattr(self, name)}")
        if self.swiglu_limit < 0:
            self._fail(f"config field 'swiglu_limit' must be >= 0, got {self.swiglu_limit}")

    def _check_attention(self):
        b = self.fp8_block
        if self.dim % b:
            self._fail(f"dim={self.dim} must be a multiple of the FP8 block {b}")
        if self.rope_head_dim % 2 or self.rope_head_dim >= self.head_dim:
            self._fail(f"rope_head_dim={self.rope_head_dim} must be even and < head_dim={self.head_dim}")
        if self.head_dim % 32:
            self._fail(f"head_dim={self.head_dim} must be a multiple of 32 (FP8 KV blocks, FP4 latent blocks)")
        if self.n_heads % self.o_groups:
            self._fail(f"n_heads={self.n_heads} must be divisible by o_groups={self.o_groups}")
        if self.q_lora_rank % b or self.o_lora_rank % b:
            self._fail(f"q_lora_rank={self.q_lora_rank} and o_lora_rank={self.o_lora_rank} must be multiples of {b}")
        if self.index_head_dim % 32 or self.index_head_dim <= self.rope_head_dim:
            self._fail(f"index_head_dim={self.index_head_dim} must be a multiple of 32 and > rope_head_dim")
        if self.hc_mult < 1:
            self._fail("hc_mult must be >= 1")
        if self.score_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
            self._fail(f"score_func={self.score_func!r} is not one of sqrtsoftplus, sigmoid, softmax")
        if self.expert_dtype != "fp4":
            self._fail(f"expert_dtype={self.expert_dtype!r}: only 'fp4' experts are supported")

    def _check_sparse(self):
        n_all = self.n_layers + self.n_mtp_layers
        if len(self.compress_ratios) != n_all:
            self._fail(f"compress_ratios has {len(self.compress_ratios)} entries; expected n_layers + n_mtp_layers "
                       f"= {n_all}")
        for l, r in enumerate(self.compress_ratios):
            if r not in (0, 1, 2):
                self._fail(f"compress_ratios[{l}]={r}: V4.1 supports ratios 0, 1 and 2 only")
            if l >= self.n_layers and r != 0:
                self._fail(f"compress_ratios[{l}]={r}: DSpark stages must have ratio 0")
        kv, ix = self.kv_source_layers, self.index_source_layers
        for name, ids in (("kv_source_layers", kv), ("index_source_layers", ix)):
            if list(ids) != sorted(set(ids)):
                self._fail(f"{name}={list(ids)} must be strictly increasing")
            for l in ids:
                if not 0 <= l < self.n_layers or self.compress_ratios[l] == 0:
                    self._fail(f"{name} contains layer {l}, which is not a backbone layer with ratio > 0")
        for l in range(self.n_layers):
            r = self.compress_ratios[l]
            if r == 0:
                continue
            srcs = [s for s in kv if s <= l]
            if not srcs:
                self._fail(f"layer {l} has ratio {r} but no KV source at or before it")
            if self.compress_ratios[srcs[-1]] != r:
                self._fail(f"layer {l} (ratio {r}) reads KV source {srcs[-1]} of ratio {self.compress_ratios[srcs[-1]]}")
            isrc = [s for s in ix if s <= l]
            if not isrc or self.compress_ratios[isrc[-1]] != r:
                self._fail(f"layer {l} (ratio {r}) has no index source of the same ratio at or before it")
            if isrc[-1] < srcs[-1]:
                self._fail(f"layer {l}: index source {isrc[-1]} lies before its KV source {srcs[-1]}")
        c = self.candidate_source_layer
        if c >= 0:
            if c not in ix or c not in kv:
                self._fail(f"candidate_source_layer={c} must be both a KV source and an index source")
            if self.candidate_block_size <= 0 or self.candidate_topk_blocks <= 0:
                self._fail("candidate_block_size and candidate_topk_blocks must be > 0 with a candidate source")
            if (self.candidate_topk_blocks - 1) * self.candidate_block_size + 1 < self.index_topk:
                self._fail("(candidate_topk_blocks - 1) * candidate_block_size + 1 must be >= index_topk "
                           "(docs/architecture.md §1.2, erratum N1)")

    def _check_moe(self):
        if self.n_activated_experts > self.n_routed_experts:
            self._fail(f"n_activated_experts={self.n_activated_experts} > n_routed_experts={self.n_routed_experts}")
        if self.n_shared_experts != 1:
            self._fail(f"n_shared_experts={self.n_shared_experts}: V4.1 has exactly one shared expert")
        if self.moe_inter_dim % 32:
            self._fail(f"moe_inter_dim={self.moe_inter_dim} must be a multiple of 32 (FP4 scale groups)")

    def _check_engram(self):
        ids = self.engram_layer_ids
        if not ids:
            if self.engram_num_embeddings:
                self._fail("engram_num_embeddings given without engram_layer_ids")
            return
        if list(ids) != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= self.n_layers:
            self._fail(f"engram_layer_ids={list(ids)} must be increasing backbone layer ids")
        if self.engram_max_ngram_size < 2 or self.engram_n_heads <= 0 or self.engram_head_dim <= 0:
            self._fail("engram_max_ngram_size must be >= 2 and engram_n_heads, engram_head_dim > 0")
        if self.engram_head_dim % 32:
            self._fail(f"engram_head_dim={self.engram_head_dim} must be a multiple of 32 (FP8 row scales)")
        if self.engram_compressed_vocab_size <= 0:
            self._fail("engram_compressed_vocab_size must be > 0 when Engram layers exist")
        if self.engram_vocab_size < 2:
            self._fail("engram_vocab_size (the prime search start) must be >= 2")
        from ds4lib.engram_geometry import engram_geometry  # derived, never typed in
        geo = engram_geometry(self)
        if len(self.engram_num_embeddings) != len(ids):
            self._fail(f"engram_num_embeddings has {len(self.engram_num_embeddings)} entries for {len(ids)} "
                       f"Engram layers")
        if tuple(self.engram_num_embeddings) != geo.table_rows:
            self._fail(f"engram_num_embeddings={list(self.engram_num_embeddings)} disagrees with the rows "
                       f"computed from the primes: {list(geo.table_rows)}")

    def _check_dspark(self):
        if self.n_mtp_layers == 0:
            return
        if self.dspark_block_size < 2:
            self._fail(f"dspark_block_size={self.dspark_block_size} must be >= 2")
        if not self.dspark_target_layer_ids:
            self._fail("DSpark stages need dspark_target_layer_ids")
        for l in self.dspark_target_layer_ids:
            if not 0 <= l < self.n_layers:
                self._fail(f"dspark_target_layer_ids contains {l}, not a backbone layer")
        if not 0 <= self.dspark_noise_token_id < self.vocab_size:
            self._fail(f"dspark_noise_token_id={self.dspark_noise_token_id} is outside the vocabulary")
        if self.dspark_n_activated_experts > self.dspark_n_routed_experts or self.dspark_n_routed_experts <= 0:
            self._fail("dspark experts: need 0 < dspark_n_activated_experts <= dspark_n_routed_experts")
        if self.dspark_markov_rank <= 0:
            self._fail("dspark_markov_rank must be > 0")

    # ------------------------------------------------------------------ derived
    @property
    def n_all_layers(self) -> int:
        """Backbone layers followed by the DSpark stages (ids n_layers .. n_layers+n_mtp_layers-1)."""
        return self.n_layers + self.n_mtp_layers

    def moe_shape(self, layer: int) -> tuple[int, int]:
        """(routed experts, active experts) of a layer; DSpark stages have their own counts."""
        if layer < self.n_layers:
            return self.n_routed_experts, self.n_activated_experts
        return self.dspark_n_routed_experts, self.dspark_n_activated_experts

    # ------------------------------------------------------------------ I/O
    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        """Build from either spelling: HF (`text_config` or top-level HF keys) or flat inference keys."""
        if not isinstance(raw, dict):
            raise ConfigError("config must be a JSON object")
        src = dict(raw)
        if isinstance(raw.get("text_config"), dict):
            src = {**{k: v for k, v in raw.items() if k != "text_config"}, **raw["text_config"]}
        known = {f.name for f in dataclasses.fields(cls)} - {"extra_keys"}
        kw, extra = {}, []
        for key, value in src.items():
            if key in _HF_FIXED:
                if value != _HF_FIXED[key]:
                    raise ConfigError(f"config key {key!r}={value!r}: V4.1 requires {_HF_FIXED[key]!r}")
                continue
            name = HF_KEYS.get(key, key)
            if name in known:
                kw[name] = value
            elif key not in _IGNORED:
                extra.append(key)
        rope = src.get("rope_scaling")
        if isinstance(rope, dict):
            if rope.get("type", rope.get("rope_type")) not in ("yarn", None):
                raise ConfigError(f"rope_scaling type {rope.get('type')!r}: only YaRN is supported")
            kw.setdefault("rope_factor", rope.get("factor", 16))
            kw.setdefault("beta_fast", rope.get("beta_fast", 32))
            kw.setdefault("beta_slow", rope.get("beta_slow", 1))
            kw.setdefault("original_seq_len", rope.get("original_max_position_embeddings", 65536))
        q = src.get("quantization_config")
        if isinstance(q, dict):
            blk = q.get("weight_block_size", [32, 32])
            if not (isinstance(blk, list) and len(blk) == 2 and blk[0] == blk[1]):
                raise ConfigError(f"quantization_config.weight_block_size={blk!r} must be a square block")
            kw.setdefault("fp8_block", blk[0])
            if q.get("scale_fmt", "ue8m0") != "ue8m0":
                raise ConfigError(f"quantization_config.scale_fmt={q.get('scale_fmt')!r}: only ue8m0 is supported")
            kw.setdefault("expert_dtype", q.get("expert_dtype", "fp4"))
        if src.get("vision_config") or src.get("vision_n_layers", 0):
            kw["vision_enabled"] = True
        for key in ("bos_token_id", "eos_token_id"):
            if isinstance(src.get(key), int):
                kw[key] = src[key]
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                   and f.name not in kw]
        if missing:
            raise ConfigError(f"config lacks required field(s): {', '.join(missing)}")
        return cls(**kw, extra_keys=tuple(sorted(extra)))

    @classmethod
    def from_json(cls, path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config file at {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        try:
            return cls.from_dict(raw)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    def to_hf_dict(self) -> dict:
        """The HF-style `config.json` layout (architecture keys under `text_config`)."""
        inv = {v: k for k, v in HF_KEYS.items()}
        text = {"model_type": "deepseek_v41_text"}
        skip = {"rope_factor", "beta_fast", "beta_slow", "original_seq_len", "fp8_block", "expert_dtype",
                "vision_enabled", "extra_keys"}
        for f in dataclasses.fields(self):
            if f.name in skip:
                continue
            v = getattr(self, f.name)
            text[inv.get(f.name, f.name)] = list(v) if isinstance(v, tuple) else v
        text.update(num_key_value_heads=1, hidden_act="silu", tie_word_embeddings=False, topk_method="noaux_tc")
        text["rope_scaling"] = {"type": "yarn", "factor": self.rope_factor, "beta_fast": self.beta_fast,
                                "beta_slow": self.beta_slow,
                                "original_max_position_embeddings": self.original_seq_len}
        qc = {"quant_method": "fp8", "activation_scheme": "dynamic",
              "weight_block_size": [self.fp8_block, self.fp8_block], "scale_fmt": "ue8m0",
              "expert_dtype": self.expert_dtype}
        text["quantization_config"] = qc
        return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "dtype": "bfloat16",
                "quantization_config": qc, "text_config": dict(sorted(text.items()))}

    def to_flat_dict(self) -> dict:
        """The flat inference keys (official `ModelArgs` names)."""
        out = {}
        for f in dataclasses.fields(self):
            if f.name == "extra_keys":
                continue
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ presets
    @classmethod
    def v41_flash(cls) -> "ModelConfig":
        """The released DeepSeek-V4.1-Flash configuration (docs/architecture.md §2.2)."""
        return cls.from_json(CONFIG_DIR / "v41_flash.json")

    @classmethod
    def tiny(cls) -> "ModelConfig":
        """The random-weight test model of docs/architecture.md §2.4; it covers every V4.1 layer role."""
        return cls.from_json(CONFIG_DIR / "tiny.json")

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        presets = {"v41-flash": cls.v41_flash, "v41_flash": cls.v41_flash, "tiny": cls.tiny}
        if name not in presets:
            raise ConfigError(f"unknown preset {name!r}; known: {', '.join(sorted(presets))}")
        return presets[name]()


@dataclass(frozen=True)
class Env:
    """Process environment, read once. The only code in ds4lib that calls os.getenv.

    `kernel_cache_dir`: the root of numba-cuda's on-disk kernel cache (kernels/__init__.py keeps one subdirectory
    per version of the kernel sources under it): DS4_KERNEL_CACHE, else NUMBA_CACHE_DIR, else
    $XDG_CACHE_HOME/ds4/numba (an absolute XDG_CACHE_HOME only, as the XDG spec asks), else ~/.cache/ds4/numba.
    `cuda_graphs`: the CUDA backend replays decode steps from CUDA graphs (DS4_CUDA_GRAPHS, default on; 0 keeps the
    same launches eager).
    `cuda_pdl`: those graphs' kernel-to-kernel edges are programmatic ones (kernels.pdl; DS4_CUDA_PDL, default on;
    0 keeps default edges: the same kernels, launched only when their predecessors have finished).
    `cuda_priority`: the CUDA backend's main stream at the device's highest stream priority and its side stream at
    the lowest, and its graphs run their kernel nodes at the priorities captured from those streams, so that when
    both have blocks waiting for an SM the critical path's go first (DS4_CUDA_PRIORITY, default off: on an H100 it
    made a V4.1 step 0.14-0.22 ms slower, BENCHMARKS.md, thirtieth session; the same kernels, the same bits)."""

    require_cuda: bool
    cache_dir: Path
    cudasim: bool
    kernel_cache_dir: Path
    cuda_graphs: bool = True
    cuda_pdl: bool = True
    cuda_priority: bool = False

    @classmethod
    def read(cls) -> "Env":
        root = Path(__file__).resolve().parent.parent
        xdg = os.getenv("XDG_CACHE_HOME", "")
        user_cache = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
        explicit = os.getenv("DS4_KERNEL_CACHE") or os.getenv("NUMBA_CACHE_DIR")
        return cls(
            require_cuda=os.getenv("DS4_REQUIRE_CUDA", "0") not in ("", "0"),
            cache_dir=Path(os.getenv("DS4_CACHE_DIR", str(root / "cache"))),
            cudasim=os.getenv("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"),
            kernel_cache_dir=Path(explicit).expanduser().absolute() if explicit else user_cache / "ds4" / "numba",
            cuda_graphs=os.getenv("DS4_CUDA_GRAPHS", "1") not in ("", "0"),
            cuda_pdl=os.getenv("DS4_CUDA_PDL", "1") not in ("", "0"),
            cuda_priority=os.getenv("DS4_CUDA_PRIORITY", "0") not in ("", "0"),
        )

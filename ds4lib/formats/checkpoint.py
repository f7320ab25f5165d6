"""Official-format checkpoint directories: a lazy validating reader and a streaming writer.

A directory holds `config.json` (HF style), one or more `*.safetensors` shards, optionally
`model.safetensors.index.json` ({"weight_map": {name: shard}}), and the Engram compressed token
map source (`engram_token_map.json`, or `tokenizer.json` to derive it from).

The reader parses shard headers only; every tensor is read on demand through a memory map, so
nothing loads a whole checkpoint. Opening validates the directory against the tensor inventory
of its config and names every missing, extra or mis-shaped tensor. The writer takes tensors one at
a time in inventory order and flushes a shard whenever it is full, so it never holds more than one
shard in memory.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from ds4lib.config import ConfigError, ModelConfig
from ds4lib.formats.floats import bf16_bits_to_f32, f32_to_bf16_bits
from ds4lib.formats.fp4 import fp4_weight_dequant
from ds4lib.formats.fp8 import e4m3_decode, fp8_weight_dequant, ue8m0_decode
from ds4lib.formats.names import DT_BF16, DT_E4M3, DT_E8M0, DT_F32, DT_FP4
from ds4lib.formats.safetensors import SafetensorsError, SafetensorsFile, write_safetensors
from ds4lib.inventory import IGNORED_PREFIXES, tensor_inventory

__all__ = ["CheckpointError", "CheckpointReader", "CheckpointWriter", "INDEX_FILE", "TOKEN_MAP_FILE"]

INDEX_FILE = "model.safetensors.index.json"
TOKEN_MAP_FILE = "engram_token_map.json"
_LIST = 12


class CheckpointError(ValueError):
    """A checkpoint directory that does not match its config's tensor inventory."""


def _names(items):
    items = sorted(items)
    more = f" (+{len(items) - _LIST} more)" if len(items) > _LIST else ""
    return ", ".join(items[:_LIST]) + more


class CheckpointReader:
    """Lazy view of one checkpoint directory. `raw(name)` gives stored bytes, `weight(name)` float32."""

    def __init__(self, root, cfg: ModelConfig, files: dict, where: dict):
        self.root, self.cfg, self._files, self._where = Path(root), cfg, files, where
        self.inventory = tensor_inventory(cfg)

    @classmethod
    def open(cls, root, validate: bool = True) -> "CheckpointReader":
        root = Path(root)
        if not root.is_dir():
            raise CheckpointError(f"checkpoint directory {root} does not exist")
        try:
            cfg = ModelConfig.from_json(root / "config.json")
        except ConfigError as e:
            raise CheckpointError(str(e)) from None
        index = root / INDEX_FILE
        if index.exists():
            try:
                wmap = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a valid index file ({e})") from None
            shard_names = sorted(set(wmap.values()))
        else:
            wmap = None
            shard_names = sorted(p.name for p in root.glob("*.safetensors"))
        if not shard_names:
            raise CheckpointError(f"{root}: no *.safetensors shards")
        files, where = {}, {}
        for s in shard_names:
            try:
                files[s] = SafetensorsFile(root / s)
            except SafetensorsError as e:
                raise CheckpointError(str(e)) from None
            for name in files[s].entries:
                if name in where:
                    raise CheckpointError(f"tensor {name!r} appears in both {where[name]} and {s}")
                where[name] = s
        if wmap is not None:
            wrong = [n for n, s in wmap.items() if where.get(n) != s]
            if wrong:
                raise CheckpointError(f"{index}: weight_map disagrees with the shards for: {_names(wrong)}")
        reader = cls(root, cfg, files, where)
        if validate:
            reader.validate()
        return reader

    def validate(self):
        inv = self.inventory
        present = set(self._where)
        missing = [n for n in inv if n not in present]
        extra = [n for n in present if n not in inv and not n.startswith(IGNORED_PREFIXES)]
        bad = []
        for n in present & set(inv):
            f = self._files[self._where[n]]
            spec = inv[n]
            if f.dtype(n) != spec.dtype or tuple(f.shape(n)) != spec.shape:
                bad.append(f"{n} ({f.dtype(n)} {list(f.shape(n))}, expected {spec.dtype} {list(spec.shape)})")
        problems = []
        if missing:
            problems.append(f"missing tensors: {_names(missing)}")
        if extra:
            problems.append(f"unexpected tensors: {_names(extra)}")
        if bad:
            problems.append(f"mis-shaped tensors: {_names(bad)}")
        if problems:
            raise CheckpointError(f"{self.root}: " + "; ".join(problems))

    # ------------------------------------------------------------------ access
    def has(self, name) -> bool:
        return name in self._where

    def raw(self, name) -> np.ndarray:
        """The stored array (read-only memory-mapped view)."""
        try:
            return self._files[self._where[name]].array(name)
        except KeyError:
            raise CheckpointError(f"{self.root}: no tensor {name!r}") from None

    def dtype(self, name) -> str:
        return self._files[self._where[name]].dtype(name)

    def weight(self, name) -> np.ndarray:
        """Dequantised float32 value of `name` (a `.weight`, `.scale`-less plain tensor, or a linear
        whose `.scale` sits beside it)."""
        dt = self.dtype(name)
        a = self.raw(name)
        if dt == DT_BF16:
            return bf16_bits_to_f32(a)
        if dt == DT_F32:
            return np.array(a, dtype=np.float32)
        if dt in (DT_E4M3, DT_FP4):
            base = name[: -len(".weight")] if name.endswith(".weight") else name
            scale = self.raw(base + ".scale")
            if dt == DT_FP4:
                return fp4_weight_dequant(a, scale)
            if name.endswith("engram.embed.weight"):
                return self.engram_rows(name, np.arange(a.shape[0]))
            return fp8_weight_dequant(a, scale, self.cfg.fp8_block)
        if dt == DT_E8M0:
            return ue8m0_decode(a)
        return np.array(a)

    def engram_rows(self, name, rows) -> np.ndarray:
        """Dequantise selected rows of an FP8 Engram table (one UE8M0 scale per 32 columns)."""
        base = name[: -len(".weight")]
        codes = self.raw(name)[rows]
        s = ue8m0_decode(self.raw(base + ".scale")[rows])
        return e4m3_decode(codes) * np.repeat(s, 32, axis=-1)

    def layer_names(self, layer: int) -> list[str]:
        return [s.name for s in self.inventory.values() if s.layer == layer]

    def content_hash(self) -> str:
        """SHA-256 over config and every inventory tensor's bytes, streamed tensor by tensor."""
        h = hashlib.sha256(json.dumps(self.cfg.to_flat_dict(), sort_keys=True).encode())
        for name in self.inventory:
            h.update(name.encode())
            h.update(memoryview(np.ascontiguousarray(self.raw(name))).cast("B"))
        return h.hexdigest()

    def close(self):
        for f in self._files.values():
            f.close()


class CheckpointWriter:
    """Write a checkpoint in the official layout, one tensor at a time, in inventory order."""

    def __init__(self, root, cfg: ModelConfig, shard_bytes: int = 2 * 1024**3, metadata=None):
        self.root, self.cfg, self.shard_bytes = Path(root), cfg, shard_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        self.inventory = tensor_inventory(cfg)
        self._order = list(self.inventory)
        self._next = 0
        self._pending: list = []
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self._metadata = {"format": "pt", **(metadata or {})}

    def add(self, name: str, array) -> None:
        if self._next >= len(self._order):
            raise CheckpointError(f"tensor {name!r} is beyond the inventory (all {len(self._order)} written)")
        expect = self._order[self._next]
        if name != expect:
            raise CheckpointError(f"tensor {name!r} written out of order; next expected is {expect!r}")
        spec = self.inventory[name]
        a = np.ascontiguousarray(array)
        if tuple(a.shape) != spec.shape:
            raise CheckpointError(f"tensor {name!r} has shape {list(a.shape)}, expected {list(spec.shape)}")
        want = {DT_BF16: np.uint16, DT_F32: np.float32, DT_E4M3: np.uint8, DT_E8M0: np.uint8, DT_FP4: np.uint8}
        if a.dtype == np.int8:
            a = a.view(np.uint8)
        if a.dtype != want[spec.dtype]:
            raise CheckpointError(f"tensor {name!r} is {a.dtype}, expected the {spec.dtype} storage "
                                  f"{np.dtype(want[spec.dtype]).name}")
        self._next += 1
        if self._pending and self._pending_bytes + a.nbytes > self.shard_bytes:
            self._flush()          # a shard never exceeds shard_bytes unless one tensor alone does
        self._pending.append((name, spec.dtype, a))
        self._pending_bytes += a.nbytes

    def add_float(self, name: str, value) -> None:
        """Convenience for plain tensors: BF16 or F32 storage from float values."""
        spec = self.inventory[name]
        if spec.dtype == DT_BF16:
            self.add(name, f32_to_bf16_bits(value))
        elif spec.dtype == DT_F32:
            self.add(name, np.asarray(value, dtype=np.float32))
        else:
            raise CheckpointError(f"add_float: {name!r} is stored as {spec.dtype}, quantise it first")

    def _flush(self):
        if not self._pending:
            return
        idx = len(self._shards)
        fname = f"model-{idx:05d}.safetensors"
        write_safetensors(self.root / fname, self._pending, metadata=self._metadata)
        self._shards.append([n for n, _, _ in self._pending])
        self._pending, self._pending_bytes = [], 0

    def close(self, extra_files: dict | None = None) -> Path:
        """Flush, then write the index and config. `extra_files` maps file names to str/bytes contents."""
        if self._next != len(self._order):
            missing = self._order[self._next:]
            raise CheckpointError(f"checkpoint incomplete: missing tensors: {_names(missing)}")
        self._flush()
        n = len(self._shards)
        weight_map = {}
        for i, names in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.root / f"model-{i:05d}.safetensors").rename(self.root / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": sum(s.nbytes for s in self.inventory.values())},
                 "weight_map": weight_map}
        (self.root / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        (self.root / "config.json").write_text(json.dumps(self.cfg.to_hf_dict(), indent=2) + "\n")
        for fname, content in (extra_files or {}).items():
            p = self.root / fname
            p.write_bytes(content if isinstance(content, bytes) else content.encode())
        return self.root

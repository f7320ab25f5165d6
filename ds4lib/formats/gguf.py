"""The ds4 base GGUF file: its tensor layout, a streaming writer and the one strict, zero-copy reader (`BaseFile`).

Owns: which official tensor becomes which stored tensor (`tensor_format`, `base_file_layout`), the metadata
keys (constants in ds4lib.formats.names), `GGUFStreamWriter` (header first, then tensor data in layout order,
piece by piece, so a quantizer can stream one layer at a time), and `BaseFile` (validates and exposes
everything). Does not own: the VQ payload bit layout (ds4lib.formats.vq), q4_K (ds4lib.formats.q4k), the
quantizer (ds4lib.quant).

Shape legend: E experts, C codewords, D dim, F expert FFN width, S stream bytes per expert matrix,
P plane bytes per expert matrix, L layers (backbone then DSpark stages).

Container. GGUF v3 written with the `gguf` package (GGUFWriter serialises header, metadata and tensor infos),
`general.architecture` = "ds4-v41", `general.alignment` = 128: every tensor starts on a 128-byte boundary.
Metadata (all `ds4.`): format_version (uint32, the reader's whitelist is vq.KNOWN_FORMAT_VERSIONS),
vq.magic "DQV3", vq.dim 8, vq.bits (int array, one per layer), vq.bits_plan, vq.rounds,
vq.pool_per_codeword, vq.codebook_format "e4m3", vq.index_layout, model.config (ModelConfig.to_hf_dict()
as JSON), source.content_hash (CheckpointReader.content_hash(): what identifies the source checkpoint; no path
is recorded), size_table (JSON), quantizer, q4k.fallback.

Tensors, in the checkpoint inventory's order (ds4lib.inventory), names as in the official checkpoint:
- routed experts of layer prefix P (`layers.{l}.` / `mtp.{s}.`) -> the VQ block, in place of the first
  expert tensor: `P ffn.experts.vq_codebook` I8 [C, 8] (E4M3 codes), `P ffn.experts.{w1,w2,w3}.vq_gain`
  F16 [E, F] / [E, D] / [E, F], `P ffn.experts.vq_index` I8 [E, 3, S], and for 13-bit layers
  `P ffn.experts.vq_plane` I8 [E, 3, P] (ds4lib.formats.vq: layout, S, P);
- the linears of names.Q4K_LINEARS (attention projections, shared experts, embedding, output head, DSpark
  main_proj and Markov head, Engram wkv) -> `X.weight` as Q4_K (row length % 256 == 0), else Q8_0, else F16
  (q4k.linear_type); their `.scale` is folded in and not stored;
- Engram tables (`*.engram.embed.weight/.scale`) -> not copied; the engine reads them from the original
  checkpoint, given by --engram-dir or found beside the base file by its content hash;
- everything else (router, norms, mHC, sinks, biases, compressor and indexer projections, confidence head)
  -> as stored: BF16 as BF16, F32 as F32, FP8 E4M3 codes and their UE8M0 `.scale` as I8 bytes;
- last, `ds4.vq.stats` F64 [L, 3, 2]: per layer and matrix (w1, w2, w3) the quantizer's sum of squared
  error and sum of squared weight over all experts (relative error = sqrt(err / weight)).
"""
from __future__ import annotations

import io
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as GT
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.gguf_writer import WriterState
from gguf.quants import quant_shape_to_byte_shape

from ds4lib.config import ConfigError, ModelConfig
from ds4lib.formats import names as N
from ds4lib.formats.floats import bf16_bits_to_f32
from ds4lib.formats.fp8 import fp8_weight_dequant, ue8m0_decode
from ds4lib.formats.q4k import dequantize_q4k, dequantize_q8_0, linear_type, type_bytes
from ds4lib.formats.vq import (EXPERT_MATRICES, KNOWN_FORMAT_VERSIONS, PAYLOAD_ALIGN, VQ_BITS, VQ_DIM,
                               VQ_MAGIC, decode_codebook, dequant_matrix, index_bytes, plane_bytes,
                               unpack_indices)
from ds4lib.inventory import tensor_inventory

__all__ = ["BaseFileError", "BaseFile", "VQLayer", "PlannedTensor", "GGUFStreamWriter", "tensor_format",
           "base_file_layout", "header_bytes", "file_bytes", "data_offsets", "ALIGNMENT"]

ALIGNMENT = PAYLOAD_ALIGN
_PREFIX = re.compile(r"^(layers|mtp)\.\d+\.")
_GGML_OF_STORED = {N.DT_BF16: GT.BF16, N.DT_F32: GT.F32, N.DT_E4M3: GT.I8, N.DT_E8M0: GT.I8}
_GGML_OF_LINEAR = {"q4_K": GT.Q4_K, "q8_0": GT.Q8_0, "f16": GT.F16}
_PLAIN = {GT.F16: np.float16, GT.F32: np.float32, GT.F64: np.float64, GT.I8: np.int8}


class BaseFileError(ValueError):
    """A file that is not a complete ds4 base file of a known format version."""


def _is_q4k_linear(name: str) -> bool:
    return _PREFIX.sub("", name) in N.Q4K_LINEARS


def tensor_format(spec) -> str:
    """What the base file does with one official tensor: 'vq', 'q4_K', 'q8_0', 'f16', 'stored' or 'dropped'."""
    name = spec.name
    if N.ENGRAM_TABLE_MARK in name:
        return "dropped"
    if N.ROUTED_EXPERT_MARK in name:
        return "vq"
    if spec.is_scale:
        return "dropped" if _is_q4k_linear(name[: -len(".scale")] + ".weight") else "stored"
    if _is_q4k_linear(name):
        return linear_type(spec.logical[-1])
    return "stored"


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    ggml: GT
    shape: tuple           # element shape, NumPy order (what the reader reports, reversed GGUF dims)
    nbytes: int
    kind: str              # vq_codebook | vq_gain | vq_index | vq_plane | q4_K | q8_0 | f16 | stored | stats
    layer: int             # -1 for globals
    source: str = ""       # the official tensor it comes from ("" for VQ and stats tensors)

    @property
    def byte_shape(self) -> tuple:
        return tuple(quant_shape_to_byte_shape(self.shape, self.ggml)) if self.ggml not in _PLAIN \
            else tuple(self.shape)


def _vq_block(cfg, layer: int, bits: int) -> list[PlannedTensor]:
    p = N.layer_prefix(cfg, layer)
    e, _ = cfg.moe_shape(layer)
    d, f = cfg.dim, cfg.moe_inter_dim
    n_idx = f * d // VQ_DIM
    rows = {"w1": f, "w2": d, "w3": f}
    out = [PlannedTensor(p + N.VQ_CODEBOOK, GT.I8, (1 << bits, VQ_DIM), (1 << bits) * VQ_DIM, "vq_codebook", layer)]
    for m in EXPERT_MATRICES:
        out.append(PlannedTensor(N.vq_gain_name(p, m), GT.F16, (e, rows[m]), e * rows[m] * 2, "vq_gain", layer))
    s = index_bytes(n_idx)
    out.append(PlannedTensor(p + N.VQ_INDEX, GT.I8, (e, 3, s), e * 3 * s, "vq_index", layer))
    if bits == 13:
        pb = plane_bytes(n_idx)
        out.append(PlannedTensor(p + N.VQ_PLANE, GT.I8, (e, 3, pb), e * 3 * pb, "vq_plane", layer))
    return out


def base_file_layout(cfg: ModelConfig, bits) -> list[PlannedTensor]:
    """Every tensor of the base file of `cfg` with per-layer VQ widths `bits` (len n_layers + n_mtp_layers)."""
    bits = tuple(int(b) for b in bits)
    if len(bits) != cfg.n_all_layers or any(b not in VQ_BITS for b in bits):
        raise ValueError(f"bits must give one of {VQ_BITS} for each of the {cfg.n_all_layers} layers, got {bits}")
    out, vq_done = [], set()
    for spec in tensor_inventory(cfg).values():
        fmt = tensor_format(spec)
        if fmt == "dropped":
            continue
        if fmt == "vq":
            if spec.layer not in vq_done:
                vq_done.add(spec.layer)
                out.extend(_vq_block(cfg, spec.layer, bits[spec.layer]))
            continue
        if fmt == "stored":
            g = _GGML_OF_STORED[spec.dtype]
            out.append(PlannedTensor(spec.name, g, spec.shape, spec.nbytes, "stored", spec.layer, spec.name))
            continue
        rows, k = spec.logical
        out.append(PlannedTensor(spec.name, _GGML_OF_LINEAR[fmt], (rows, k), type_bytes(fmt, rows, k), fmt,
                                 spec.layer, spec.name))
    out.append(PlannedTensor(N.VQ_STATS, GT.F64, (cfg.n_all_layers, 3, 2), cfg.n_all_layers * 48, "stats", -1))
    return out


def _pad(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def _writer_for(layout, kv) -> GGUFWriter:
    w = GGUFWriter(None, N.GGUF_ARCH)
    w.add_custom_alignment(ALIGNMENT)
    for key, value, vtype in kv:
        w.add_key_value(key, value, vtype, GGUFValueType.INT32 if vtype == GGUFValueType.ARRAY
                        and value and isinstance(value[0], int) else None)
    for t in layout:
        if t.ggml in _PLAIN:
            w.add_tensor_info(t.name, t.shape, np.dtype(_PLAIN[t.ggml]), t.nbytes)
        else:
            w.add_tensor_info(t.name, t.byte_shape, np.dtype(np.uint8), t.nbytes, raw_dtype=t.ggml)
    return w


def header_bytes(layout, kv) -> bytes:
    """GGUF header + metadata + tensor infos, padded to the alignment (what precedes the tensor data)."""
    w = _writer_for(layout, kv)
    buf = io.BytesIO()
    w.fout, w.path, w.state = [buf], None, WriterState.EMPTY
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    raw = buf.getvalue()
    return raw + b"\0" * (_pad(len(raw)) - len(raw))


def file_bytes(layout, header_len: int) -> int:
    return header_len + sum(_pad(t.nbytes) for t in layout)


def data_offsets(layout, header_len: int) -> dict:
    """{tensor name: (file offset of its data, its byte count)} of a file written in layout order."""
    out, off = {}, header_len
    for t in layout:
        out[t.name] = (off, t.nbytes)
        off += _pad(t.nbytes)
    return out


class GGUFStreamWriter:
    """Writes the header at once, then tensor data strictly in layout order, whole or in parts.
    Output goes to `<path>.partial`, renamed on `close()` so an interrupted run never leaves a plausible file."""

    def __init__(self, path, layout, kv):
        self.path = Path(path)
        self.layout = list(layout)
        self._tmp = self.path.with_name(self.path.name + ".partial")
        self._f = open(self._tmp, "wb")
        self._f.write(header_bytes(self.layout, kv))
        self._next = 0
        self._open = None            # (PlannedTensor, bytes written so far)

    def begin(self, name: str) -> None:
        if self._open is not None:
            raise ValueError(f"tensor {self._open[0].name!r} is still open")
        if self._next >= len(self.layout):
            raise ValueError(f"tensor {name!r} is beyond the layout")
        t = self.layout[self._next]
        if t.name != name:
            raise ValueError(f"tensor {name!r} written out of order; next is {t.name!r}")
        self._open = (t, 0)

    def write_bytes(self, array) -> None:
        t, done = self._open
        a = np.ascontiguousarray(array)
        if done + a.nbytes > t.nbytes:
            raise ValueError(f"tensor {t.name!r}: {done + a.nbytes} bytes written, it has {t.nbytes}")
        self._f.write(memoryview(a).cast("B"))
        self._open = (t, done + a.nbytes)

    def end(self) -> None:
        t, done = self._open
        if done != t.nbytes:
            raise ValueError(f"tensor {t.name!r}: {done} bytes written, it has {t.nbytes}")
        self._f.write(b"\0" * (_pad(t.nbytes) - t.nbytes))
        self._open = None
        self._next += 1

    def write(self, name: str, array) -> None:
        self.begin(name)
        self.write_bytes(array)
        self.end()

    def close(self) -> Path:
        if self._open is not None or self._next != len(self.layout):
            missing = [t.name for t in self.layout[self._next:]][:5]
            self.abort()
            raise ValueError(f"base file incomplete; next missing tensors: {missing}")
        self._f.close()
        os.replace(self._tmp, self.path)
        return self.path

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()
        self._tmp.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- reader
class _Header(GGUFReader):
    """GGUFReader that parses header and tensor infos but defers mapping tensor data (truncation check first)."""

    def _build_tensors(self, start_offs, fields):
        self._deferred = (start_offs, fields)


@dataclass(frozen=True)
class VQLayer:
    """Zero-copy views of one layer's VQ payload (the arrays kernels consume)."""
    layer: int
    bits: int
    n_experts: int
    codebook_codes: np.ndarray     # uint8 [C, 8] E4M3
    gains: dict                    # mat -> float16 [E, rows]
    index: np.ndarray              # uint8 [E, 3, S]
    plane: np.ndarray | None       # uint8 [E, 3, P] (13-bit layers)
    shapes: dict                   # mat -> (rows, in)

    @property
    def n_indices(self) -> int:
        r, k = self.shapes["w1"]
        return r * k // VQ_DIM


def _field(reader, key):
    f = reader.get_field(key)
    return None if f is None else f.contents()


class BaseFile:
    """A ds4 base file, memory-mapped. Open with `BaseFile.open(path)`; every array it returns for stored
    data is a read-only view into the map (no copy) unless the method says it decodes."""

    def __init__(self, path, reader, cfg, bits, layout):
        self.path, self._r, self.config, self.bits = Path(path), reader, cfg, tuple(bits)
        self.layout = {t.name: t for t in layout}
        self._tensors = {t.name: t for t in reader.tensors}
        self._inventory = tensor_inventory(cfg)
        self.metadata = {k: _field(reader, k) for k in reader.fields if k.startswith("ds4.")}

    # ------------------------------------------------------------------ opening and validation
    @classmethod
    def open(cls, path) -> "BaseFile":
        path = Path(path)
        if not path.is_file():
            raise BaseFileError(f"{path}: no such file")
        size = path.stat().st_size
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise BaseFileError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
        try:
            r = _Header(path)
        except Exception as e:  # noqa: BLE001 - gguf raises bare ValueError/IndexError on a cut header
            raise BaseFileError(f"{path}: truncated or corrupt GGUF header ({type(e).__name__}: {e})") from None
        arch = _field(r, "general.architecture")
        if arch != N.GGUF_ARCH:
            raise BaseFileError(f"{path}: general.architecture is {arch!r}, not a ds4 base file ({N.GGUF_ARCH!r})")
        version = _field(r, N.KEY_FORMAT_VERSION)
        if version not in KNOWN_FORMAT_VERSIONS:
            raise BaseFileError(f"{path}: unknown ds4 format version {version!r} ({N.KEY_FORMAT_VERSION}); "
                                f"this reader knows {list(KNOWN_FORMAT_VERSIONS)}")
        magic_vq = _field(r, N.KEY_VQ_MAGIC)
        if magic_vq != VQ_MAGIC:
            raise BaseFileError(f"{path}: wrong VQ payload magic {magic_vq!r} ({N.KEY_VQ_MAGIC}), "
                                f"expected {VQ_MAGIC!r}")
        start, fields = r._deferred
        for fld in fields:
            _, name, _, dims, gtype, off = fld.parts
            name = bytes(name).decode()
            g = GT(int(gtype[0]))
            bs, ts = GGML_QUANT_SIZES[g]
            end = int(start) + int(off[0]) + int(np.prod(dims.astype(np.int64))) * ts // bs
            if end > size:
                raise BaseFileError(f"{path}: truncated: tensor {name!r} ends at byte {end} but the file has "
                                    f"{size} bytes")
        try:
            cfg = ModelConfig.from_dict(json.loads(_field(r, N.KEY_MODEL_CONFIG) or "null"))
        except (ConfigError, json.JSONDecodeError) as e:
            raise BaseFileError(f"{path}: bad {N.KEY_MODEL_CONFIG}: {e}") from None
        bits = _field(r, N.KEY_VQ_BITS)
        try:
            layout = base_file_layout(cfg, bits or ())
        except ValueError as e:
            raise BaseFileError(f"{path}: bad {N.KEY_VQ_BITS}: {e}") from None
        GGUFReader._build_tensors(r, start, fields)
        cls._check_tensors(path, r, layout)
        return cls(path, r, cfg, bits, layout)

    @staticmethod
    def _check_tensors(path, r, layout):
        have = {t.name: t for t in r.tensors}
        want = {t.name: t for t in layout}
        missing = [n for n in want if n not in have]
        extra = [n for n in have if n not in want]
        bad = [f"{n} ({have[n].tensor_type.name} {list(have[n].data.shape)}, expected {t.ggml.name} "
               f"{list(t.byte_shape)})" for n, t in want.items()
               if n in have and (have[n].tensor_type != t.ggml or tuple(have[n].data.shape) != t.byte_shape)]
        problems = [f"{what}: {', '.join(v[:8])}{' ...' if len(v) > 8 else ''}"
                    for what, v in (("missing tensors", missing), ("unknown tensors", extra),
                                    ("mis-typed tensors", bad)) if v]
        if problems:
            raise BaseFileError(f"{path}: " + "; ".join(problems))

    # ------------------------------------------------------------------ metadata
    @property
    def format_version(self) -> int:
        return int(self.metadata[N.KEY_FORMAT_VERSION])

    @property
    def source_hash(self) -> str:
        return self.metadata.get(N.KEY_SOURCE_HASH, "")

    @property
    def size_table(self) -> dict:
        return json.loads(self.metadata[N.KEY_SIZE_TABLE])

    @property
    def stats(self) -> np.ndarray:
        """float64 [L, 3, 2]: (sum sq. error, sum sq. weight) per layer and matrix, as the quantizer reported."""
        return self._tensors[N.VQ_STATS].data

    def relative_errors(self) -> np.ndarray:
        """float64 [L, 3]: sqrt(error / weight) per layer and matrix (w1, w2, w3)."""
        s = self.stats
        return np.sqrt(s[..., 0] / np.where(s[..., 1] > 0, s[..., 1], 1.0))

    def names(self) -> list[str]:
        return list(self._tensors)

    # ------------------------------------------------------------------ raw and decoded tensors
    def ggml_type(self, name) -> GT:
        return self._get(name).tensor_type

    def _get(self, name):
        try:
            return self._tensors[name]
        except KeyError:
            raise BaseFileError(f"{self.path}: no tensor {name!r}") from None

    def raw(self, name) -> np.ndarray:
        """The stored array, zero-copy: uint8 bytes for I8 and quantised types, float16/32/64 otherwise."""
        t = self._get(name)
        return t.data.view(np.uint8) if t.tensor_type == GT.I8 else t.data

    def tensor(self, name) -> np.ndarray:
        """float32 value of a non-VQ tensor (q4_K, Q8_0, F16 decoded; stored BF16/F32/FP8 as the checkpoint
        reader would give it)."""
        t = self._get(name)
        g = t.tensor_type
        if g == GT.Q4_K:
            return dequantize_q4k(t.data)
        if g == GT.Q8_0:
            return dequantize_q8_0(t.data)
        if g in (GT.F16, GT.F32, GT.F64):
            return np.asarray(t.data, dtype=np.float32)
        if g == GT.BF16:
            return bf16_bits_to_f32(t.data.view(np.uint16))
        spec = self._inventory.get(name)
        if g == GT.I8 and spec is not None and spec.dtype == N.DT_E4M3:
            base = name[: -len(".weight")] if name.endswith(".weight") else name
            return fp8_weight_dequant(t.data.view(np.uint8), self.raw(base + ".scale"), self.config.fp8_block)
        if g == GT.I8 and spec is not None and spec.dtype == N.DT_E8M0:
            return ue8m0_decode(t.data.view(np.uint8))
        raise BaseFileError(f"{self.path}: {name!r} ({g.name}) has no float value; use vq_layer() or raw()")

    # ------------------------------------------------------------------ VQ experts
    def vq_layer(self, layer: int) -> VQLayer:
        cfg = self.config
        if not 0 <= layer < cfg.n_all_layers:
            raise BaseFileError(f"layer {layer} is outside 0..{cfg.n_all_layers - 1}")
        p = N.layer_prefix(cfg, layer)
        d, f = cfg.dim, cfg.moe_inter_dim
        bits = self.bits[layer]
        return VQLayer(layer=layer, bits=bits, n_experts=cfg.moe_shape(layer)[0],
                       codebook_codes=self.raw(p + N.VQ_CODEBOOK),
                       gains={m: self.raw(N.vq_gain_name(p, m)) for m in EXPERT_MATRICES},
                       index=self.raw(p + N.VQ_INDEX),
                       plane=self.raw(p + N.VQ_PLANE) if bits == 13 else None,
                       shapes={"w1": (f, d), "w2": (d, f), "w3": (f, d)})

    def codebook(self, layer: int) -> np.ndarray:
        """float32 [C, 8] (decoded E4M3)."""
        return decode_codebook(self.vq_layer(layer).codebook_codes)

    def gains(self, layer: int, mat: str) -> np.ndarray:
        """float16 [E, rows] row gains of matrix `mat` of every expert (zero-copy)."""
        return self.vq_layer(layer).gains[mat]

    def packed_indices(self, layer: int, expert: int, mat: str):
        """(stream uint8 [S], plane uint8 [P] or None): zero-copy views of one expert matrix's payload, as a
        kernel reads it (ds4lib.formats.vq layout); the stream starts on a 128-byte boundary."""
        v = self.vq_layer(layer)
        m = EXPERT_MATRICES.index(mat)
        return v.index[expert, m], (v.plane[expert, m] if v.plane is not None else None)

    def expert_indices(self, layer: int, expert: int, mat: str) -> np.ndarray:
        """uint16 [rows, in/8] codeword indices of one expert matrix (unpacked)."""
        rows, k = self.vq_layer(layer).shapes[mat]
        stream, plane = self.packed_indices(layer, expert, mat)
        return unpack_indices(stream, rows * k // VQ_DIM, plane).reshape(rows, k // VQ_DIM)

    def dequant_expert(self, layer: int, expert: int, mat: str) -> np.ndarray:
        """float32 [out, in]: the engine's value of one routed-expert matrix."""
        v = self.vq_layer(layer)
        return dequant_matrix(decode_codebook(v.codebook_codes), v.gains[mat][expert],
                              self.expert_indices(layer, expert, mat))

    def close(self):
        mm = getattr(self._r, "data", None)
        if mm is not None and hasattr(mm, "_mmap") and mm._mmap is not None:
            try:
                mm._mmap.close()
            except BufferError:
                pass        # a view handed out earlier is still alive; the map closes with it

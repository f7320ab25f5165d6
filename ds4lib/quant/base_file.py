"""`quantize_checkpoint`: an official-format checkpoint directory -> the ds4 base GGUF file (docs/design.md §2).

Owns the orchestration: bit plan, layout and metadata, then one pass over the layout in file order,
streaming one layer at a time (VQ experts through ds4lib.quant.vq_layer, q4_K / Q8_0 linears through
ds4lib.formats.q4k, everything else copied as stored), the statistics tensor last, and the report.
The same function backs `ds4 quantize` and notebooks/quantize.ipynb.

Determinism: the output depends only on the checkpoint bytes, the bit plan and the number of rounds; not on
the checkpoint's folder, the device (CPU and CUDA paths give identical indices, see ds4lib.solvers.vq), the
thread count or the time. The metadata therefore holds no path, device, timestamp or host name: the source
checkpoint is identified by its content hash (`ds4.source.content_hash`), and the engine finds the Engram
tables by that hash (ds4lib.engine.engine.find_engram_checkpoint), so the same build in any two folders
gives the same bytes.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFValueType as VT

from ds4lib.config import ModelConfig
from ds4lib.formats import names as N
from ds4lib.formats.checkpoint import CheckpointReader
from ds4lib.formats.gguf import BaseFile, GGUFStreamWriter, base_file_layout, data_offsets, header_bytes
from ds4lib.formats.q4k import quantize_q4k, quantize_q8_0
from ds4lib.formats.vq import (EXPERT_MATRICES, FORMAT_VERSION, INDEX_LAYOUT, VQ_DIM, VQ_MAGIC, encode_codebook,
                               pack_indices)
from ds4lib.quant.cuda_backend import make_backend
from ds4lib.quant.plan import parse_bits_plan, size_table
from ds4lib.quant.vq_layer import assign_layer, collect_layer
from ds4lib.solvers.vq import DEFAULT_ROUNDS, POOL_PER_CODEWORD, train_codebook

__all__ = ["DEFAULT_ROUNDS", "QUANTIZER_ID", "QuantReport", "VerifyReport", "quantize_checkpoint", "verify_base",
           "file_sha256", "layer_rows"]

QUANTIZER_ID = "ds4 quantize (vq8 shared per-layer codebooks, q4_K) v1"


@dataclass
class QuantReport:
    path: str
    sha256: str
    bits: tuple
    bits_plan: str
    rounds: int
    device: str
    stats: np.ndarray                 # float64 [L, 3, 2] (sum sq. error, sum sq. weight), as stored in the file
    size_table: dict
    source_hash: str
    seconds: float
    config: ModelConfig

    def layer_rows(self) -> list[dict]:
        return layer_rows(self.config, self.bits, self.stats)


def layer_rows(cfg, bits, stats) -> list[dict]:
    """One dict per layer: relative error of w1, w2, w3 and of the layer, bits per routed weight."""
    out = []
    for l, b in enumerate(bits):
        s = np.asarray(stats[l])
        rel = np.sqrt(s[:, 0] / np.where(s[:, 1] > 0, s[:, 1], 1.0))
        tot = float(np.sqrt(s[:, 0].sum() / max(s[:, 1].sum(), 1e-300)))
        e, _ = cfg.moe_shape(l)
        n_w = 3 * cfg.dim * cfg.moe_inter_dim * e
        rows = 2 * cfg.moe_inter_dim + cfg.dim
        bpw = (b * n_w / VQ_DIM + 16 * e * rows + 8 * VQ_DIM * (1 << b)) / n_w
        out.append({"layer": l, "kind": "backbone" if l < cfg.n_layers else f"dspark {l - cfg.n_layers}",
                    "bits": b, "w1": float(rel[0]), "w2": float(rel[1]), "w3": float(rel[2]), "all": tot,
                    "bits_per_weight": bpw})
    return out


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def _metadata(cfg, plan, rounds, source_hash):
    return [
        (N.KEY_FORMAT_VERSION, FORMAT_VERSION, VT.UINT32),
        (N.KEY_VQ_MAGIC, VQ_MAGIC, VT.STRING),
        (N.KEY_VQ_DIM, VQ_DIM, VT.UINT32),
        (N.KEY_VQ_BITS, list(plan.bits), VT.ARRAY),
        (N.KEY_VQ_BITS_PLAN, plan.spec, VT.STRING),
        (N.KEY_VQ_ROUNDS, int(rounds), VT.UINT32),
        (N.KEY_VQ_POOL, POOL_PER_CODEWORD, VT.UINT32),
        (N.KEY_VQ_CODEBOOK_FORMAT, "e4m3", VT.STRING),
        (N.KEY_VQ_LAYOUT, INDEX_LAYOUT, VT.STRING),
        (N.KEY_MODEL_CONFIG, json.dumps(cfg.to_hf_dict(), sort_keys=True), VT.STRING),
        (N.KEY_SOURCE_HASH, source_hash, VT.STRING),
        (N.KEY_QUANTIZER, QUANTIZER_ID, VT.STRING),
        (N.KEY_Q4K_FALLBACK, "q8_0 (f16 if not a multiple of 32)", VT.STRING),
    ]


def _with_size_table(cfg, layout, kv, bits):
    """Metadata plus the size table, whose total must count the header that contains it (fixed point)."""
    hl = 0
    for _ in range(8):
        table = size_table(cfg, layout, hl, bits)
        full = kv + [(N.KEY_SIZE_TABLE, json.dumps(table, sort_keys=True), VT.STRING)]
        n = len(header_bytes(layout, full))
        if n == hl:
            return full, table
        hl = n
    raise RuntimeError("size table did not reach a fixed point")


def _write_vq_layer(writer, reader, layer, bits, rounds, backend, tick):
    """Codebook, gains, index stream (expert by expert) and plane of one layer; returns stats [3, 2]."""
    k = 1 << bits
    lp = collect_layer(reader, layer, k, progress=tick)
    tr = train_codebook(lp.pool, k, rounds, backend, on_round=tick)
    p = N.layer_prefix(reader.cfg, layer)
    writer.write(p + N.VQ_CODEBOOK, encode_codebook(tr.codebook))
    for m in EXPERT_MATRICES:
        writer.write(N.vq_gain_name(p, m), lp.gains[m])
    stats = np.zeros((3, 2), dtype=np.float64)
    planes = []
    writer.begin(p + N.VQ_INDEX)
    for e, m, idx, sse, ssw in assign_layer(reader, layer, lp.gains, tr.codebook, backend, progress=tick):
        mi = EXPERT_MATRICES.index(m)
        stream, plane = pack_indices(idx, bits)
        writer.write_bytes(stream)
        if plane is not None:
            planes.append(plane)
        stats[mi, 0] += sse
        stats[mi, 1] += ssw
    writer.end()
    if bits == 13:
        writer.write(p + N.VQ_PLANE, np.concatenate(planes))
    return stats


def _stream_tensors(writer, reader, layout, plan, rounds, backend, tick, bar, stats, vq_layers):
    """Every tensor of the layout, in order, into `writer`; the VQ tensors only of `vq_layers` (None: all), the
    statistics of the layers written (rows of the others stay 0)."""
    for t in layout:
        if t.kind == "vq_codebook":
            if vq_layers is not None and t.layer not in vq_layers:
                continue
            bar.set_postfix_str(f"layer {t.layer} ({plan.bits[t.layer]}-bit VQ)")
            stats[t.layer] = _write_vq_layer(writer, reader, t.layer, plan.bits[t.layer], rounds, backend, tick)
        elif t.kind.startswith("vq_"):
            continue                              # written by _write_vq_layer
        elif t.kind == "stats":
            writer.write(t.name, stats)
            tick()
        elif t.kind == "stored":
            writer.write(t.name, reader.raw(t.source))
            tick()
        else:
            w = reader.weight(t.source)
            q = {"q4_K": quantize_q4k, "q8_0": quantize_q8_0}.get(t.kind)
            writer.write(t.name, q(w) if q else w.astype(np.float16))
            tick()


def quantize_checkpoint(*, checkpoint, out, bits_plan="auto", rounds: int = DEFAULT_ROUNDS, device: str = "cpu",
                        progress: bool = True) -> QuantReport:
    """Quantize the checkpoint directory `checkpoint` into the base file `out` (see module docstring)."""
    from tqdm.auto import tqdm
    t0 = time.perf_counter()
    reader = CheckpointReader.open(checkpoint)
    cfg = reader.cfg
    plan = parse_bits_plan(bits_plan, cfg)
    if rounds < 0:
        raise ValueError("rounds must be >= 0")
    backend = make_backend(device)
    layout = base_file_layout(cfg, plan.bits)
    source_hash = reader.content_hash()
    kv, table = _with_size_table(cfg, layout, _metadata(cfg, plan, rounds, source_hash), plan.bits)
    n_vq = sum(2 * 3 * cfg.moe_shape(l)[0] + rounds for l in range(cfg.n_all_layers))
    bar = tqdm(total=n_vq + sum(1 for t in layout if not t.kind.startswith("vq_")), unit="step",
               desc="ds4 quantize", disable=not progress)
    tick = (lambda n=1: bar.update(n))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFStreamWriter(out, layout, kv)
    stats = np.zeros((cfg.n_all_layers, 3, 2), dtype=np.float64)
    try:
        _stream_tensors(writer, reader, layout, plan, rounds, backend, tick, bar, stats, vq_layers=None)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
        reader.close()
    return QuantReport(path=str(out), sha256=file_sha256(out), bits=plan.bits, bits_plan=plan.spec, rounds=rounds,
                       device=device, stats=stats, size_table=table, source_hash=source_hash,
                       seconds=time.perf_counter() - t0, config=cfg)


@dataclass
class VerifyReport:
    """`verify_base`'s result: `ok` when the header and every checked tensor equal the rebuild byte for byte."""
    path: str
    header_ok: bool
    size_ok: bool
    vq_layers: list
    checked: list
    mismatched: list
    seconds: float

    @property
    def ok(self) -> bool:
        return self.header_ok and self.size_ok and not self.mismatched and bool(self.checked)


class _CompareWriter:
    """Stands in for GGUFStreamWriter: each tensor streamed to it is compared with the same tensor's bytes in an
    existing file (located by name through the layout), nothing is written. `rows`: {tensor name: (row indices,
    bytes per row)} compares only those rows of a tensor (the statistics of the layers rebuilt)."""

    def __init__(self, path, layout, header, rows):
        self.data = np.memmap(path, dtype=np.uint8, mode="r")
        self.offsets = data_offsets(layout, len(header))
        end = max((o + n for o, n in self.offsets.values()), default=len(header))
        self.size_ok = len(self.data) >= end
        self.header_ok = len(self.data) >= len(header) and bytes(self.data[:len(header)]) == header
        self.rows, self.checked, self.mismatched = rows, [], []
        self._cur = None

    def begin(self, name):
        self._cur = [name, bytearray()]

    def write_bytes(self, array):
        self._cur[1] += memoryview(np.ascontiguousarray(array)).cast("B")

    def end(self):
        name, got = self._cur
        off, n = self.offsets[name]
        have = bytes(self.data[off:off + n]) if self.size_ok else b""
        got = bytes(got)
        if name in self.rows:
            rows, width = self.rows[name]
            same = len(got) == n and all(got[r * width:(r + 1) * width] == have[r * width:(r + 1) * width]
                                         for r in rows)
        else:
            same = got == have
        self.checked.append(name)
        if not same:
            self.mismatched.append(name)
        self._cur = None

    def write(self, name, array):
        self.begin(name)
        self.write_bytes(array)
        self.end()


def verify_base(*, checkpoint, base, vq_layers=None, device: str = "cpu", progress: bool = False) -> VerifyReport:
    """Rebuild the base file `base` from `checkpoint` with the bit plan and Lloyd rounds stored in it and compare,
    byte for byte, its header and every tensor; the routed-expert tensors (the costly part: Lloyd per layer) only of
    `vq_layers` (None: every layer), and the statistics rows of those layers. Each layer's VQ tensors depend only on
    that layer's weights (module docstring), so a subset checks exactly what a full rebuild would for those layers.
    Nothing is written."""
    from tqdm.auto import tqdm
    t0 = time.perf_counter()
    shipped = BaseFile.open(base)
    try:
        bits = list(shipped.bits)
        rounds = int(shipped.metadata[N.KEY_VQ_ROUNDS])
        spec = str(shipped.metadata[N.KEY_VQ_BITS_PLAN])
    finally:
        shipped.close()
    reader = CheckpointReader.open(checkpoint)
    cfg = reader.cfg
    if len(bits) != cfg.n_all_layers:
        reader.close()
        raise ValueError(f"{base}: {len(bits)} VQ layers, the checkpoint has {cfg.n_all_layers}")
    layers = sorted(range(cfg.n_all_layers) if vq_layers is None else {int(v) for v in vq_layers})
    if not layers or layers[0] < 0 or layers[-1] >= cfg.n_all_layers:
        reader.close()
        raise ValueError(f"vq_layers must lie in 0..{cfg.n_all_layers - 1}, got {vq_layers}")
    plan = parse_bits_plan(spec, cfg)                     # the spec as stored, so the metadata is the same
    if list(plan.bits) != bits:
        reader.close()
        raise ValueError(f"{base}: bit plan {spec!r} gives {list(plan.bits)} for this checkpoint, the file has {bits}")
    backend = make_backend(device)
    layout = base_file_layout(cfg, plan.bits)
    kv, _ = _with_size_table(cfg, layout, _metadata(cfg, plan, rounds, reader.content_hash()), plan.bits)
    stats_name = next(t.name for t in layout if t.kind == "stats")
    writer = _CompareWriter(base, layout, header_bytes(layout, kv), {stats_name: (layers, 3 * 2 * 8)})
    n_vq = sum(2 * 3 * cfg.moe_shape(l)[0] + rounds for l in layers)
    bar = tqdm(total=n_vq + sum(1 for t in layout if not t.kind.startswith("vq_")), unit="step",
               desc="ds4 quantize --verify", disable=not progress)
    stats = np.zeros((cfg.n_all_layers, 3, 2), dtype=np.float64)
    try:
        _stream_tensors(writer, reader, layout, plan, rounds, backend, lambda n=1: bar.update(n), bar, stats,
                        vq_layers=set(layers))
    finally:
        bar.close()
        reader.close()
    return VerifyReport(path=str(base), header_ok=writer.header_ok, size_ok=writer.size_ok, vq_layers=layers,
                        checked=writer.checked, mismatched=writer.mismatched, seconds=time.perf_counter() - t0)

"""A lazy, validating safetensors reader and a deterministic writer (our own; no torch, no copies).

File layout: u64 little-endian header length N, N bytes of JSON header
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the data
buffer; offsets are relative to its start. The reader memory-maps the file and hands out one
tensor at a time as a read-only NumPy view; FP8, E8M0 and packed FP4 come back as raw bytes
(uint8), BF16 as uint16 bit patterns.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from pathlib import Path

import numpy as np

__all__ = ["SafetensorsError", "SafetensorsFile", "write_safetensors", "NUMPY_DTYPES", "DTYPE_BYTES"]

NUMPY_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.uint8, "U8": np.uint8,
    "U16": np.uint16, "U32": np.uint32, "U64": np.uint64, "BOOL": np.uint8,
    "F8_E4M3": np.uint8, "F8_E5M2": np.uint8, "F8_E8M0": np.uint8,
}
DTYPE_BYTES = {k: np.dtype(v).itemsize for k, v in NUMPY_DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsError(ValueError):
    """A file that is not a complete, well-formed safetensors file."""


class SafetensorsFile:
    """Header parsed at open; data read lazily through one read-only memory map."""

    def __init__(self, path):
        self.path = Path(path)
        try:
            size = os.path.getsize(self.path)
        except OSError as e:
            raise SafetensorsError(f"{self.path}: cannot open ({e.strerror})") from None
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsError(f"{self.path}: truncated (no header length)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise SafetensorsError(f"{self.path}: truncated or corrupt header (length {n}, file {size} bytes)")
            raw = f.read(n)
        try:
            header = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SafetensorsError(f"{self.path}: header is not JSON ({e})") from None
        if not isinstance(header, dict):
            raise SafetensorsError(f"{self.path}: header is not a JSON object")
        self.metadata = header.pop("__metadata__", {}) or {}
        self.header_bytes = n
        self.data_start = 8 + n
        self.file_size = size
        self.entries = {}
        for name, e in header.items():
            try:
                dt, shape, (b, end) = e["dtype"], tuple(int(s) for s in e["shape"]), e["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise SafetensorsError(f"{self.path}: malformed header entry for {name!r}") from None
            if dt not in NUMPY_DTYPES:
                raise SafetensorsError(f"{self.path}: tensor {name!r} has unsupported dtype {dt!r}")
            need = int(np.prod(shape, dtype=np.int64)) * DTYPE_BYTES[dt]
            if end - b != need or b < 0:
                raise SafetensorsError(f"{self.path}: tensor {name!r} spans {end - b} bytes, shape {list(shape)} "
                                       f"{dt} needs {need}")
            if self.data_start + end > size:
                raise SafetensorsError(f"{self.path}: truncated: tensor {name!r} ends at byte "
                                       f"{self.data_start + end} of a {size}-byte file")
            self.entries[name] = (dt, shape, int(b), int(end))
        self._mm = None

    def _map(self):
        if self._mm is None:
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if self.file_size else b""
        return self._mm

    def keys(self):
        return list(self.entries)

    def dtype(self, name) -> str:
        return self.entries[name][0]

    def shape(self, name) -> tuple:
        return self.entries[name][1]

    def array(self, name) -> np.ndarray:
        """Read-only view of one tensor (no copy)."""
        dt, shape, b, e = self.entries[name]
        buf = self._map()
        arr = np.frombuffer(buf, dtype=NUMPY_DTYPES[dt], count=(e - b) // DTYPE_BYTES[dt],
                            offset=self.data_start + b)
        return arr.reshape(shape)

    def raw_bytes(self, name) -> bytes:
        dt, shape, b, e = self.entries[name]
        return bytes(self._map()[self.data_start + b:self.data_start + e])

    def close(self):
        if isinstance(self._mm, mmap.mmap):
            try:
                self._mm.close()
            except BufferError:
                pass   # a view handed out earlier is still alive; the map closes with it
        self._mm = None


def write_safetensors(path, tensors, metadata=None):
    """Write [(name, dtype, array)] in the given order. The header is compact JSON padded with spaces to a
    multiple of 8 bytes, so the same input always gives the same bytes. Written to a temporary name and
    renamed, so an interrupted write never leaves a plausible partial file."""
    path = Path(path)
    header, offset, arrays = {}, 0, []
    for name, dt, arr in tensors:
        if dt not in NUMPY_DTYPES:
            raise SafetensorsError(f"cannot write dtype {dt!r} for {name!r}")
        a = np.ascontiguousarray(arr)
        if a.dtype.itemsize != DTYPE_BYTES[dt]:
            raise SafetensorsError(f"{name!r}: array itemsize {a.dtype.itemsize} does not match dtype {dt}")
        header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    if metadata:
        header = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}, **header}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for a in arrays:
            f.write(a.tobytes())
    os.replace(tmp, path)

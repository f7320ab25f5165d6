"""Read character vectors out of an R lazy-load database (`*.rdx` index + `*.rdb` objects).

Owns: a minimal reader of R's XDR serialization format (versions 2 and 3) that covers the object
types data packages use for text: NULL, symbols, pairlists, CHARSXP, logical/integer/double/
character vectors and lists, and back-references. Anything else raises `RDataError`, so an
unexpected object fails loudly instead of being skipped.

Used for the Jane Austen novels of the Debian package r-cran-janeaustenr, so the build needs neither
R nor the `rdata` package (and its pandas/xarray dependencies).

Reference: R Internals, "Serialization formats"; R source `src/main/serialize.c`, `lazyload.R`.
"""
from __future__ import annotations

import gzip
import lzma
import bz2
import struct
import zlib
from pathlib import Path

__all__ = ["RDataError", "read_lazyload_strings"]

_NILVALUE, _REF, _SYM, _LIST, _LANG, _CHAR = 254, 255, 1, 2, 6, 9
_LGL, _INT, _REAL, _STR, _VEC, _EXPR = 10, 13, 14, 16, 19, 20
_SINGLETONS = {242, 241, 253, 251, 252, 250}     # empty env, base env, global env, missing, unbound, base ns


class RDataError(ValueError):
    pass


class _Reader:
    def __init__(self, buf: bytes):
        self.buf, self.pos, self.refs = buf, 0, []

    def int(self) -> int:
        (v,) = struct.unpack_from(">i", self.buf, self.pos)
        self.pos += 4
        return v

    def header(self) -> None:
        if self.buf[:2] != b"X\n":
            raise RDataError(f"not XDR serialization (starts {self.buf[:2]!r})")
        self.pos = 2
        version = self.int()
        self.int(), self.int()                  # writer R version, minimal reader version
        if version == 3:
            n = self.int()                      # native encoding name
            self.pos += n
        elif version != 2:
            raise RDataError(f"serialization version {version} unsupported")

    def length(self) -> int:
        n = self.int()
        if n == -1:                             # long vector: two 32-bit halves
            n = (self.int() << 32) + self.int()
        return n

    def item(self):
        flags = self.int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind == _NILVALUE or kind in _SINGLETONS:
            return None
        if kind == _REF:
            idx = flags >> 8 or self.int()
            return self.refs[idx - 1]
        if kind == _SYM:
            sym = ("symbol", self.item())
            self.refs.append(sym)
            return sym
        if kind in (_LIST, _LANG):
            if has_attr:
                self.item()                     # pairlist attributes carry nothing we use
            tag = self.item() if has_tag else None
            out = [(tag[1] if tag else None, self.item())]
            rest = self.item()
            return out + (rest if isinstance(rest, list) else [])
        if kind == _CHAR:
            n = self.int()
            if n == -1:
                return None
            s = self.buf[self.pos:self.pos + n].decode("utf-8")
            self.pos += n
            return s
        if kind in (_LGL, _INT, _REAL, _STR, _VEC, _EXPR):
            n = self.length()
            if kind in (_LGL, _INT):
                v = list(struct.unpack_from(f">{n}i", self.buf, self.pos))
                self.pos += 4 * n
            elif kind == _REAL:
                v = list(struct.unpack_from(f">{n}d", self.buf, self.pos))
                self.pos += 8 * n
            else:
                v = [self.item() for _ in range(n)]
            attrs = dict(self.item()) if has_attr else {}
            names = attrs.get("names")
            return {"values": v, "names": names["values"] if names else None}
        raise RDataError(f"R object type {kind} is not supported by this reader")


def _unserialize(buf: bytes):
    r = _Reader(buf)
    r.header()
    return r.item()


def _decompress(chunk: bytes, compressed: int) -> bytes:
    if compressed == 1:
        return zlib.decompress(chunk[4:])
    method, body = chunk[4:5], chunk[5:]
    if method == b"Z":
        return lzma.decompress(body)
    if method == b"2":
        return bz2.decompress(body)
    if method == b"1":
        return zlib.decompress(body)
    if method == b"0":
        return body
    raise RDataError(f"unknown lazy-load compression {method!r}")


def read_lazyload_strings(rdx: Path, rdb: Path) -> dict[str, list[str]]:
    """Every character vector of a lazy-load database, by object name."""
    raw = Path(rdx).read_bytes()
    index = _unserialize(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else zlib.decompress(raw[4:]))
    parts = dict(zip(index["names"], index["values"]))
    variables, compressed = parts["variables"], int(parts["compressed"]["values"][0])
    blob = Path(rdb).read_bytes()
    out = {}
    for name, loc in zip(variables["names"], variables["values"]):
        offset, size = (int(x) for x in loc["values"])
        obj = _unserialize(_decompress(blob[offset:offset + size], compressed))
        if isinstance(obj, dict) and all(isinstance(s, (str, type(None))) for s in obj["values"]):
            out[name] = ["" if s is None else s for s in obj["values"]]
    return out

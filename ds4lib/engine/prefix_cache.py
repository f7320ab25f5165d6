"""Prefix KV reuse: recent sessions' states kept so that a request extending a cached token prefix resumes from it.

Owns: `PrefixCache` (an LRU of finished sessions' states keyed by the tokens they hold, under a byte budget, with
an optional disk tier), `KvDiskStore` (the disk tier: one checksummed file per entry, a size cap), and the state
snapshot walk (`state_arrays`, `load_state_arrays`) that turns a backend state of plain objects and NumPy arrays
into named arrays and back.

Exactness: a resumed session holds exactly the state a cold prefill of its tokens would have built, because the
CPU backend's forward is invariant to how tokens are split into calls (tests/engine/test_engine_cpu.py
`test_decode_path_equals_prefill_path`, `test_chunked_prefill_equals_single`). So the logits after resuming equal
those of a cold prefill bit for bit (tests/engine/test_prefix_cache.py). A cached entry never covers the whole
prompt: the last prompt token is always fed again, which gives its logits.

Entries: the memory tier owns each stored session (the engine hands over a session it no longer uses) and hands
out copies, so one prefix serves many requests (a shared system prompt, a regenerated turn). A session whose
forward failed midway is never stored (the engine stores only after a clean stop).

Disk tier (`--kv-disk-dir`): `<sha256 of fingerprint and tokens>.ds4kv` files, written to a temporary name and
renamed. Layout: magic `DS4KV001`, u64 header length, UTF-8 JSON header {fingerprint, n_tokens, arrays: [{name,
dtype, shape, offset, nbytes}], sha256}, then the int32 tokens and the arrays; `sha256` covers everything after
the header. An entry whose magic, header, sizes, fingerprint (another model stack: stale) or checksum does not
match, or whose arrays do not fit this backend's state, is ignored and deleted, never trusted. The arrays are the
state's own tree of host arrays (`state_arrays`; the CPU backend) or what the backend's `state_to_arrays` gives (the
CUDA backend's host snapshot of a device state). Oldest-used entries go first when the directory passes its cap.

Does not own: when sessions are stored or resumed (engine.py), the backend's state layout.
Shapes: T tokens.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

__all__ = ["PrefixCache", "KvDiskStore", "CacheEntry", "state_arrays", "load_state_arrays", "KvCacheError",
           "verify_entry"]

log = logging.getLogger("ds4.engine")
MAGIC = b"DS4KV001"
SUFFIX = ".ds4kv"
_MAX_HEADER = 64 << 20


class KvCacheError(ValueError):
    """A disk entry that cannot be trusted (corrupt, truncated, stale or not one of ours)."""


# ---------------------------------------------------------------------------------------------- state snapshots
def _walk(obj, path: str, out: dict):
    if isinstance(obj, np.ndarray):
        out[path] = obj
    elif isinstance(obj, (bool, np.bool_)):
        out[path] = np.asarray(obj, dtype=np.bool_)
    elif isinstance(obj, (int, np.integer)):
        out[path] = np.asarray(obj, dtype=np.int64)
    elif isinstance(obj, (float, np.floating)):
        out[path] = np.asarray(obj, dtype=np.float64)
    elif obj is None:
        return
    elif isinstance(obj, (list, tuple)):
        for i, x in enumerate(obj):
            _walk(x, f"{path}[{i}]", out)
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            _walk(obj[k], f"{path}{{{k}}}", out)
    elif hasattr(obj, "__dict__"):
        for k in sorted(vars(obj)):
            _walk(getattr(obj, k), f"{path}.{k}", out)
    else:
        raise TypeError(f"state snapshot: {path} holds a {type(obj).__name__}, which is not an array or a number")


def state_arrays(state) -> dict:
    """{path: array} of every array and number in `state` (views, not copies); None leaves are skipped."""
    out: dict = {}
    _walk(state, "", out)
    return out


def _restore(obj, path: str, arrays: dict, used: set):
    """`obj` with its leaves replaced from `arrays` (containers updated in place)."""
    if isinstance(obj, np.ndarray) or isinstance(obj, (bool, int, float, np.generic)):
        if path not in arrays:
            raise KvCacheError(f"state snapshot lacks {path}")
        used.add(path)
        a = arrays[path]
        if isinstance(obj, np.ndarray):
            if a.dtype != obj.dtype or a.ndim != obj.ndim:
                raise KvCacheError(f"state snapshot {path}: {a.dtype}{list(a.shape)} does not fit {obj.dtype} "
                                   f"with {obj.ndim} dims")
            return np.array(a)                      # writable and owned
        return type(obj)(a.item())
    if obj is None:
        return None
    if isinstance(obj, list):
        obj[:] = [_restore(x, f"{path}[{i}]", arrays, used) for i, x in enumerate(obj)]
        return obj
    if isinstance(obj, tuple):
        return tuple(_restore(x, f"{path}[{i}]", arrays, used) for i, x in enumerate(obj))
    if isinstance(obj, dict):
        for k in list(obj):
            obj[k] = _restore(obj[k], f"{path}{{{k}}}", arrays, used)
        return obj
    for k in sorted(vars(obj)):
        setattr(obj, k, _restore(getattr(obj, k), f"{path}.{k}", arrays, used))
    return obj


def load_state_arrays(template, arrays: dict):
    """Fill a fresh state `template` (from the backend's new_state) with a snapshot; every path must match."""
    used: set = set()
    state = _restore(template, "", arrays, used)
    extra = set(arrays) - used
    if extra:
        raise KvCacheError(f"state snapshot has paths this state does not: {sorted(extra)[:3]}")
    return state


# ---------------------------------------------------------------------------------------------- entries
class CacheEntry:
    """One stored session: the tokens its state holds, the state, the DSpark features of its prefill calls."""
    __slots__ = ("tokens", "state", "features", "nbytes")

    def __init__(self, tokens, state, features, state_bytes: int | None = None):
        """`state_bytes`: the state's size where it is not a tree of host arrays (a device state); else summed from
        its arrays."""
        self.tokens, self.state, self.features = tuple(tokens), state, list(features)
        if state_bytes is None:
            state_bytes = sum(a.nbytes for a in state_arrays(state).values())
        self.nbytes = int(state_bytes) + sum(np.asarray(f).nbytes for f in self.features) + 8 * len(self.tokens)


def _key(fingerprint: str, tokens) -> str:
    h = hashlib.sha256(fingerprint.encode())
    h.update(np.asarray(tokens, dtype=np.int32).tobytes())
    return h.hexdigest()


def _parse_header(path: Path):
    """(header, offset of the payload) of an entry whose magic, header and size are sound (any fingerprint)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(len(MAGIC) + 8)
        if len(head) < len(MAGIC) + 8 or head[:len(MAGIC)] != MAGIC:
            raise KvCacheError("not a ds4 kv entry (magic)")
        (n,) = struct.unpack("<Q", head[len(MAGIC):])
        if n > min(_MAX_HEADER, size):
            raise KvCacheError("header length beyond the file")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
            header["fingerprint"], n_tokens = str(header["fingerprint"]), int(header["n_tokens"])
            end = max([n_tokens * 4] + [int(a["offset"]) + int(a["nbytes"]) for a in header["arrays"]])
        except (ValueError, KeyError, TypeError) as e:
            raise KvCacheError(f"unreadable header ({e})") from None
    start = len(MAGIC) + 8 + n
    if start + end != size:
        raise KvCacheError(f"size {size} does not match its header ({start + end})")
    return header, start


def verify_entry(path) -> dict:
    """The header of the disk entry at `path` once its magic, sizes and checksum are checked (whatever model stack
    wrote it); KvCacheError if it cannot be trusted. Changes nothing (a soak checks a killed server's files)."""
    path = Path(path)
    header, start = _parse_header(path)
    with open(path, "rb") as f:
        f.seek(start)
        if hashlib.sha256(f.read()).hexdigest() != header.get("sha256"):
            raise KvCacheError("checksum mismatch")
    return header


class KvDiskStore:
    """The disk tier: checksummed entry files under `root`, at most `max_bytes` in all (oldest use first out)."""

    def __init__(self, root, *, fingerprint: str, max_bytes: int, to_arrays=None):
        """`to_arrays(state)`: the named host arrays written for a state (default `state_arrays`, for states that
        are trees of host arrays; the CUDA backend passes its device snapshot)."""
        self.root, self.fingerprint, self.max_bytes = Path(root), fingerprint, int(max_bytes)
        self._to_arrays = to_arrays or state_arrays
        self.root.mkdir(parents=True, exist_ok=True)
        self.lengths: dict = {}                       # key -> n_tokens of the entries found valid-looking
        for p in self.root.glob("*" + SUFFIX):
            try:
                self.lengths[p.stem] = self._read_header(p)[0]["n_tokens"]
            except KvCacheError as e:
                self._drop(p, str(e))
        for p in self.root.glob(".*.partial"):           # a writer killed mid-file
            self._drop(p, "left by an interrupted write")

    def _drop(self, path: Path, why: str):
        log.warning("kv disk cache: removing %s (%s)", path.name, why)
        path.unlink(missing_ok=True)
        self.lengths.pop(path.stem, None)

    def forget(self, key: str, why: str):
        """Remove an entry that verified but does not load into this stack's state (another layout)."""
        self._drop(self.root / (key + SUFFIX), why)

    def _read_header(self, path: Path):
        header, start = _parse_header(path)
        if header["fingerprint"] != self.fingerprint:
            raise KvCacheError("stale: written for another model stack")
        return header, start

    def lookup(self, tokens) -> tuple:
        """(n, key) of the longest entry whose tokens are a proper prefix of `tokens`, else (0, None)."""
        want = len(tokens) - 1
        for n in sorted({n for n in self.lengths.values() if 0 < n <= want}, reverse=True):
            key = _key(self.fingerprint, tokens[:n])
            if self.lengths.get(key) == n:
                return n, key
        return 0, None

    def load(self, key: str, tokens_prefix):
        """(state arrays, features) of an entry, fully verified; KvCacheError (and the file removed) otherwise."""
        path = self.root / (key + SUFFIX)
        try:
            header, start = self._read_header(path)
            blob = path.read_bytes()[start:]
            if hashlib.sha256(blob).hexdigest() != header.get("sha256"):
                raise KvCacheError("checksum mismatch")
            n = header["n_tokens"]
            toks = np.frombuffer(blob[:4 * n], dtype=np.int32)
            if toks.tolist() != list(tokens_prefix):
                raise KvCacheError("its tokens are not the ones its name promises")
            arrays, features = {}, {}
            for a in header["arrays"]:
                raw = blob[int(a["offset"]):int(a["offset"]) + int(a["nbytes"])]
                arr = np.frombuffer(raw, dtype=np.dtype(a["dtype"])).reshape(a["shape"])
                (features if a["name"].startswith("features/") else arrays)[a["name"]] = arr
        except FileNotFoundError:
            self.lengths.pop(key, None)
            raise KvCacheError("gone") from None
        except (KvCacheError, ValueError, KeyError, TypeError) as e:
            self._drop(path, str(e))
            raise KvCacheError(str(e)) from None
        os.utime(path)                                     # the eviction order is the order of use
        feats = [features[k] for k in sorted(features, key=lambda k: int(k.split("/")[1]))]
        return arrays, feats

    def save(self, entry: CacheEntry) -> None:
        key = _key(self.fingerprint, entry.tokens)
        if key in self.lengths:
            os.utime(self.root / (key + SUFFIX))
            return
        arrays = dict(self._to_arrays(entry.state))
        arrays.update({f"features/{i}": np.asarray(f) for i, f in enumerate(entry.features)})
        tokens = np.asarray(entry.tokens, dtype=np.int32).tobytes()
        table, offset = [], len(tokens)
        for name, a in arrays.items():
            a = np.ascontiguousarray(a)
            table.append({"name": name, "dtype": a.dtype.str, "shape": list(a.shape), "offset": offset,
                          "nbytes": a.nbytes})
            offset += a.nbytes
        h = hashlib.sha256(tokens)
        for a in arrays.values():
            h.update(np.ascontiguousarray(a).tobytes())
        header = json.dumps({"fingerprint": self.fingerprint, "n_tokens": len(entry.tokens), "arrays": table,
                             "sha256": h.hexdigest()}).encode()
        if len(MAGIC) + 8 + len(header) + offset > self.max_bytes:
            return                                        # larger than the whole cap: not worth a file
        fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".partial", dir=self.root)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + struct.pack("<Q", len(header)) + header + tokens)
                for a in arrays.values():
                    f.write(np.ascontiguousarray(a).tobytes())
            os.replace(tmp, self.root / (key + SUFFIX))
        except OSError as e:
            Path(tmp).unlink(missing_ok=True)
            log.warning("kv disk cache: could not write an entry: %s", e)
            return
        self.lengths[key] = len(entry.tokens)
        self._trim()

    def _trim(self):
        files = [(p.stat().st_mtime_ns, p) for p in self.root.glob("*" + SUFFIX)]
        total = sum(p.stat().st_size for _, p in files)
        for _, p in sorted(files, key=lambda x: x[0]):
            if total <= self.max_bytes:
                break
            total -= p.stat().st_size
            p.unlink(missing_ok=True)
            self.lengths.pop(p.stem, None)


class PrefixCache:
    """LRU of finished sessions' states under `max_bytes`, optionally backed by a KvDiskStore.

    `new_state()` makes a fresh backend state (the template a disk snapshot is loaded into), `copy_state(s)` a deep
    copy, `state_nbytes(s)` (optional) a state's size where it is not a tree of host arrays, and `from_arrays(arrays)`
    (optional) a state from a disk entry's arrays where loading them into `new_state()` by name does not apply (the
    CUDA backend's device states, with the disk tier's `to_arrays`). Thread-safe (one lock), though the engine calls
    it from one thread."""

    def __init__(self, *, max_bytes: int, new_state, copy_state, disk: KvDiskStore | None = None,
                 state_nbytes=None, from_arrays=None):
        self.max_bytes, self.disk = int(max_bytes), disk
        self._new_state, self._copy_state, self._state_nbytes = new_state, copy_state, state_nbytes
        self._from_arrays = from_arrays or (lambda arrays: load_state_arrays(self._new_state(), arrays))
        self._entries: OrderedDict = OrderedDict()         # tokens tuple -> CacheEntry, least recently used first
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = self.misses = self.tokens_reused = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, tokens):
        """(state copy, features copy, n) for the longest cached proper prefix of `tokens`; (None, [], 0) if none."""
        tokens = tuple(int(t) for t in tokens)
        with self._lock:
            best = None
            for key, e in self._entries.items():
                n = len(key)
                if n < len(tokens) and (best is None or n > len(best.tokens)) and tokens[:n] == key:
                    best = e
            n_disk, disk_key = self.disk.lookup(tokens) if self.disk is not None else (0, None)
            if disk_key is not None and n_disk > (len(best.tokens) if best else 0):
                try:
                    arrays, feats = self.disk.load(disk_key, tokens[:n_disk])
                    try:
                        state = self._from_arrays(arrays)
                    except ValueError as e:                  # another layout: not ours to trust
                        self.disk.forget(disk_key, str(e))
                        raise KvCacheError(str(e)) from None
                    best = CacheEntry(tokens[:n_disk], state, feats,
                                      None if self._state_nbytes is None else self._state_nbytes(state))
                    self._put(best)
                except KvCacheError as e:
                    log.warning("kv disk cache: entry for %d tokens not used: %s", n_disk, e)
            if best is None:
                self.misses += 1
                return None, [], 0
            self.hits += 1
            self.tokens_reused += len(best.tokens)
            if best.tokens not in self._entries:           # loaded from disk, too big for memory: hand it over
                return best.state, best.features, len(best.tokens)
            self._entries.move_to_end(best.tokens)
            return (self._copy_state(best.state), [np.array(f) for f in best.features], len(best.tokens))

    def store(self, tokens, state, features=()) -> None:
        """Take ownership of a finished session's state holding `tokens`."""
        if not tokens:
            return
        entry = CacheEntry(tokens, state, features,
                           None if self._state_nbytes is None else self._state_nbytes(state))
        with self._lock:
            self._put(entry)
        if self.disk is not None:
            self.disk.save(entry)

    def _put(self, entry: CacheEntry) -> None:
        old = self._entries.pop(entry.tokens, None)
        if old is not None:
            self.bytes -= old.nbytes
        if entry.nbytes > self.max_bytes:
            return
        self._entries[entry.tokens] = entry
        self.bytes += entry.nbytes
        while self.bytes > self.max_bytes:
            _, ev = self._entries.popitem(last=False)
            self.bytes -= ev.nbytes

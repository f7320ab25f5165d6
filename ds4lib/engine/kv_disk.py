"""The prefix cache's disk tier (`--kv-disk-dir`): finished sessions' states as checksummed files that survive a
restart, in a directory that servers of different model stacks (a CPU and a CUDA server, DSpark on and off, other
model files) may share without touching each other's entries.

Owns: the state snapshot walk (`state_arrays`, `load_state_arrays`: a backend state of plain objects and NumPy
arrays to named arrays and back), the entry file format (`verify_entry`), and `KvDiskStore` (one model stack's
entries in a shared directory, under a size cap). Does not own: which sessions are stored or resumed
(prefix_cache.py, engine.py), the backend's state layout, what a fingerprint covers (Engine.fingerprint).

Directory: one subdirectory per fingerprint, `DIR/<32 hex digits of sha256(fingerprint)>/`, holding a `FINGERPRINT`
text file (the full fingerprint, so that a person can tell whose it is) and `<sha256 of fingerprint and
tokens>.ds4kv` entries. A store reads, writes, evicts and cleans its own subdirectory only: the entries of another
fingerprint are never used and never deleted. Entries of the first layout (`DIR/*.ds4kv`, before subdirectories) are
moved into their own fingerprint's subdirectory by the first store of that fingerprint that opens DIR, so they stay
readable; a store leaves the others' where they are.

File: magic `DS4KV001`, u64 header length, UTF-8 JSON header {fingerprint, n_tokens, arrays: [{name, dtype, shape,
offset, nbytes}], sha256}, then the int32 tokens and the arrays; `sha256` covers everything after the header. The
arrays are the state's own tree of host arrays (`state_arrays`; the CPU backend) or what the backend's
`state_to_arrays` gives (the CUDA backend's host snapshot of a device state).

Trust: an entry of this store's subdirectory whose magic, header, sizes, checksum or tokens do not match, whose header
names another fingerprint (a misplaced file), or whose arrays do not fit this backend's state (PrefixCache calls
`forget`) is ignored and deleted, never used. So is a first-layout entry that cannot be parsed (it is nobody's).

Cap: `max_bytes` bounds this fingerprint's subdirectory (per fingerprint, not the whole DIR): each stack keeps its
own entries under its own cap, oldest use first out (a load touches the file). A stack no longer served keeps its
subdirectory until someone deletes it; opening a store logs the other subdirectories and their sizes.

Sharing with other processes: an entry is written to `.<key>.<random>.partial` under an exclusive `flock` and renamed
into place while still locked, so readers and evicting processes only ever see complete entries, and eviction only
lists complete `*.ds4kv` files. A `.partial` is removed only when no process holds its lock (its writer died, e.g.
a server killed mid-write), or, on a file system without `flock`, once untouched for 10 minutes; a writer whose file
was swept before it took the lock gives up that entry. Two processes of one fingerprint share its entries: a store
lists its subdirectory again when its mtime changed or is under a second old, an entry the other process evicted is a
miss, and each process trims to the cap after its own writes (the entries in flight, one per process, may pass it).

Shapes: T tokens.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import struct
import tempfile
import time
from pathlib import Path

import numpy as np

__all__ = ["KvDiskStore", "KvCacheError", "state_arrays", "load_state_arrays", "verify_entry", "fingerprint_dirname",
           "MAGIC", "SUFFIX", "PARTIAL", "FINGERPRINT_FILE"]

log = logging.getLogger("ds4.engine")
MAGIC = b"DS4KV001"
SUFFIX = ".ds4kv"
PARTIAL = ".partial"
FINGERPRINT_FILE = "FINGERPRINT"
_MAX_HEADER = 64 << 20
_MTIME_SETTLED_NS = 1_000_000_000
_UNLOCKABLE_STALE_S = 600.0     # a .partial on a file system without flock: its writer is gone after this long


class KvCacheError(ValueError):
    """A disk entry that cannot be trusted (corrupt, truncated, misplaced, another layout or not one of ours)."""


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


# ---------------------------------------------------------------------------------------------- entry files
def fingerprint_dirname(fingerprint: str) -> str:
    """The subdirectory of DIR that holds `fingerprint`'s entries."""
    return hashlib.sha256(fingerprint.encode()).hexdigest()[:32]


def _key(fingerprint: str, tokens) -> str:
    h = hashlib.sha256(fingerprint.encode())
    h.update(np.asarray(tokens, dtype=np.int32).tobytes())
    return h.hexdigest()


def _raw(a: np.ndarray) -> np.ndarray:
    """The bytes of a C-contiguous array as a uint8 view (any dtype, 0-d included), what `tobytes` would copy."""
    return a.reshape(-1).view(np.uint8)


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except FileNotFoundError:                 # evicted by its own process meanwhile
        return 0


def _parse_header(f, size: int):
    """(header, offset of the payload) of the open entry `f` of `size` bytes whose magic, header and size are sound
    (any fingerprint); KvCacheError otherwise."""
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


def _read_entry(path: Path, *, payload: bool):
    """(header, payload bytes or None) of the entry at `path`, read through one open file (an entry another process
    evicts meanwhile stays readable); with `payload`, its checksum is verified."""
    with open(path, "rb") as f:
        header, start = _parse_header(f, os.fstat(f.fileno()).st_size)
        if not payload:
            return header, None
        f.seek(start)
        blob = f.read()
    if hashlib.sha256(blob).hexdigest() != header.get("sha256"):
        raise KvCacheError("checksum mismatch")
    return header, blob


def verify_entry(path) -> dict:
    """The header of the disk entry at `path` once its magic, sizes and checksum are checked (whatever model stack
    wrote it); KvCacheError if it cannot be trusted. Changes nothing (a soak checks a killed server's files)."""
    return _read_entry(Path(path), payload=True)[0]


def _write_locked(folder: Path, prefix: str, chunks, dest: Path) -> bool:
    """Write `chunks` to a `.partial` file in `folder`, locked while written, and rename it to `dest`. False (nothing
    left behind) if a sweep took the file before its lock: its name was free to take."""
    fd, tmp = tempfile.mkstemp(prefix=f".{prefix}.", suffix=PARTIAL, dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            except OSError as e:
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                    raise
            if os.fstat(f.fileno()).st_nlink == 0:
                return False
            for c in chunks:
                f.write(c)
            f.flush()
            os.replace(tmp, dest)          # still locked: a sweep never takes a finished file for an abandoned one
        return True
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _sweep_partial(path: Path) -> bool:
    """Remove `path`, a `.partial`, if its writer is gone: no process holds its lock (or, without flock, it has not
    been touched for a while). True if removed."""
    try:
        fd = os.open(path, os.O_RDWR)       # writable: NFS emulates flock with write locks
    except OSError:                         # gone, or another user's: not ours to judge
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False                    # a live writer
        except OSError:
            if time.time() - os.fstat(fd).st_mtime < _UNLOCKABLE_STALE_S:
                return False
        try:
            path.unlink(missing_ok=True)    # under the lock: a writer that locks after this sees st_nlink == 0
        except OSError:
            return False
        return True
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------- the store
class KvDiskStore:
    """One fingerprint's checksummed entries under `root/<fingerprint_dirname>/`, at most `max_bytes` of them (oldest
    use first out); the rest of `root` is left alone (module docstring)."""

    def __init__(self, root, *, fingerprint: str, max_bytes: int, to_arrays=None):
        """`to_arrays(state)`: the named host arrays written for a state (default `state_arrays`, for states that
        are trees of host arrays; the CUDA backend passes its device snapshot)."""
        self.root, self.fingerprint, self.max_bytes = Path(root), fingerprint, int(max_bytes)
        self.dir = self.root / fingerprint_dirname(fingerprint)
        self._to_arrays = to_arrays or state_arrays
        self.dir.mkdir(parents=True, exist_ok=True)
        if not (self.dir / FINGERPRINT_FILE).is_file():
            _write_locked(self.dir, "fingerprint", [fingerprint.encode()], self.dir / FINGERPRINT_FILE)
        self.lengths: dict = {}                       # key -> n_tokens of the entries found valid-looking
        self._seen = None                             # the subdirectory's mtime at the last scan
        for folder in (self.dir, self.root):          # writers killed mid-file (root: the first layout's)
            for p in folder.glob(".*" + PARTIAL):
                if _sweep_partial(p):
                    log.warning("kv disk cache: removed %s (left by an interrupted write)", p.name)
        self._adopt_first_layout()
        self._scan()
        self._trim()
        self._log_others()

    def _adopt_first_layout(self):
        """Move this fingerprint's entries of the first layout (`root/*.ds4kv`) into its subdirectory."""
        for p in self.root.glob("*" + SUFFIX):
            try:
                fingerprint = _read_entry(p, payload=False)[0]["fingerprint"]
            except FileNotFoundError:
                continue
            except (KvCacheError, OSError) as e:
                self._drop(p, str(e))
                continue
            if fingerprint == self.fingerprint:
                try:
                    os.replace(p, self.dir / p.name)
                except FileNotFoundError:              # another process of this fingerprint moved it first
                    pass

    def _log_others(self):
        others = [d for d in self.root.iterdir() if d != self.dir and (d / FINGERPRINT_FILE).is_file()]
        if others:
            mb = sum(_size(p) for d in others for p in d.glob("*" + SUFFIX)) / (1 << 20)
            log.info("kv disk cache: %s also holds the entries of %d other model stack(s) (%.1f MB): kept, not used "
                     "(each subdirectory's FINGERPRINT names its stack; delete one by hand once unused)",
                     self.root, len(others), mb)

    def _drop(self, path: Path, why: str):
        log.warning("kv disk cache: removing %s (%s)", path.name, why)
        try:
            path.unlink(missing_ok=True)
        except OSError as e:                          # another user's file: ignored all the same
            log.warning("kv disk cache: could not remove %s: %s", path.name, e)
        self.lengths.pop(path.stem, None)

    def _scan(self):
        """Index this fingerprint's entries, again whenever the subdirectory changed (another process's writes)."""
        try:
            seen = self.dir.stat().st_mtime_ns
        except FileNotFoundError:                     # removed by hand while serving
            self.lengths, self._seen = {}, None
            return
        if seen == self._seen:
            return
        # Trusted only once older than a coarse timestamp tick (or an NFS server's): a change within the same tick
        # as this listing would leave the mtime as it is, so a fresh one is listed again next time.
        self._seen = seen if time.time_ns() - seen > _MTIME_SETTLED_NS else None
        lengths = {}
        for name in os.listdir(self.dir):             # not Path.glob: this runs per request while the mtime is fresh
            key = name[:-len(SUFFIX)]
            if not name.endswith(SUFFIX) or name.startswith("."):
                continue
            if key in self.lengths:
                lengths[key] = self.lengths[key]
                continue
            try:
                lengths[key] = self._read(self.dir / name, payload=False)[0]["n_tokens"]
            except FileNotFoundError:
                continue
            except KvCacheError as e:
                self._drop(self.dir / name, str(e))
        self.lengths = lengths

    def forget(self, key: str, why: str):
        """Remove an entry that verified but does not load into this stack's state (another layout)."""
        self._drop(self.dir / (key + SUFFIX), why)

    def _read(self, path: Path, *, payload: bool):
        header, blob = _read_entry(path, payload=payload)
        if header["fingerprint"] != self.fingerprint:
            raise KvCacheError("misplaced: its header names another model stack")
        return header, blob

    def lookup(self, tokens) -> tuple:
        """(n, key) of the longest entry whose tokens are a proper prefix of `tokens`, else (0, None)."""
        self._scan()
        want = len(tokens) - 1
        for n in sorted({n for n in self.lengths.values() if 0 < n <= want}, reverse=True):
            key = _key(self.fingerprint, tokens[:n])
            if self.lengths.get(key) == n:
                return n, key
        return 0, None

    def load(self, key: str, tokens_prefix):
        """(state arrays, features) of an entry, fully verified; KvCacheError (and the file removed) otherwise."""
        path = self.dir / (key + SUFFIX)
        try:
            header, blob = self._read(path, payload=True)
            n = header["n_tokens"]
            toks = np.frombuffer(blob[:4 * n], dtype=np.int32)
            if toks.tolist() != list(tokens_prefix):
                raise KvCacheError("its tokens are not the ones its name promises")
            arrays, features = {}, {}
            for a in header["arrays"]:
                raw = blob[int(a["offset"]):int(a["offset"]) + int(a["nbytes"])]
                arr = np.frombuffer(raw, dtype=np.dtype(a["dtype"])).reshape(a["shape"])
                (features if a["name"].startswith("features/") else arrays)[a["name"]] = arr
        except FileNotFoundError:                     # evicted by another process
            self.lengths.pop(key, None)
            raise KvCacheError("gone") from None
        except (KvCacheError, ValueError, KeyError, TypeError) as e:
            self._drop(path, str(e))
            raise KvCacheError(str(e)) from None
        try:
            os.utime(path)                            # the eviction order is the order of use
        except OSError:
            pass
        feats = [features[k] for k in sorted(features, key=lambda k: int(k.split("/")[1]))]
        return arrays, feats

    def save(self, entry) -> None:
        """Write a CacheEntry (tokens, state, features) unless this fingerprint already has it."""
        key = _key(self.fingerprint, entry.tokens)
        path = self.dir / (key + SUFFIX)
        if key in self.lengths:
            try:
                os.utime(path)
                return
            except FileNotFoundError:                 # evicted by another process: write it again
                self.lengths.pop(key, None)
        arrays = dict(self._to_arrays(entry.state))
        arrays.update({f"features/{i}": np.asarray(f) for i, f in enumerate(entry.features)})
        tokens = np.asarray(entry.tokens, dtype=np.int32).tobytes()
        arrays = {name: np.ascontiguousarray(a) for name, a in arrays.items()}      # the bytes tobytes would give
        table, offset = [], len(tokens)
        for name, a in arrays.items():
            table.append({"name": name, "dtype": a.dtype.str, "shape": list(a.shape), "offset": offset,
                          "nbytes": a.nbytes})
            offset += a.nbytes
        h = hashlib.sha256(tokens)
        for a in arrays.values():
            h.update(_raw(a))
        header = json.dumps({"fingerprint": self.fingerprint, "n_tokens": len(entry.tokens), "arrays": table,
                             "sha256": h.hexdigest()}).encode()
        if len(MAGIC) + 8 + len(header) + offset > self.max_bytes:
            return                                    # larger than the whole cap: not worth a file
        chunks = [MAGIC + struct.pack("<Q", len(header)) + header + tokens] + [_raw(a) for a in arrays.values()]
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            if not _write_locked(self.dir, key, chunks, path):
                return
        except OSError as e:
            log.warning("kv disk cache: could not write an entry: %s", e)
            return
        self.lengths[key] = len(entry.tokens)
        self._trim()

    def _trim(self):
        """Evict this fingerprint's oldest-used complete entries until its subdirectory is within the cap."""
        files = []
        for p in self.dir.glob("*" + SUFFIX):
            try:
                st = p.stat()
            except FileNotFoundError:                 # evicted by another process meanwhile
                continue
            files.append((st.st_mtime_ns, st.st_size, p))
        total = sum(size for _, size, _ in files)
        for _, size, p in sorted(files):
            if total <= self.max_bytes:
                break
            p.unlink(missing_ok=True)
            total -= size
            self.lengths.pop(p.stem, None)

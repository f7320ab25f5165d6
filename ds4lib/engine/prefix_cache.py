"""Prefix KV reuse: recent sessions' states kept so that a request extending a cached token prefix resumes from it.

Owns: `PrefixCache` (an LRU of finished sessions' states keyed by the tokens they hold, under a byte budget, with
an optional disk tier) and `CacheEntry`. The disk tier (`KvDiskStore`: checksummed files, one subdirectory per model
stack, a size cap, safe to share between servers) and the state snapshot walk live in kv_disk.py.

Exactness: a resumed session holds exactly the state a cold prefill of its tokens would have built, because the
CPU backend's forward is invariant to how tokens are split into calls (tests/engine/test_engine_cpu.py
`test_decode_path_equals_prefill_path`, `test_chunked_prefill_equals_single`). So the logits after resuming equal
those of a cold prefill bit for bit (tests/engine/test_prefix_cache.py). A cached entry never covers the whole
prompt: the last prompt token is always fed again, which gives its logits.

Entries: the memory tier owns each stored session (the engine hands over a session it no longer uses) and hands
out copies, so one prefix serves many requests (a shared system prompt, a regenerated turn). A session whose
forward failed midway is never stored (the engine stores only after a clean stop).

Disk tier: a memory miss looks in the KvDiskStore for a longer prefix and loads it into a fresh state; an entry
that verifies on disk but does not fit this backend's state (another layout) is removed through `forget`.

Does not own: when sessions are stored or resumed (engine.py), the backend's state layout.
Shapes: T tokens.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import numpy as np

from ds4lib.engine.kv_disk import KvCacheError, KvDiskStore, load_state_arrays, state_arrays

# KvDiskStore, KvCacheError and state_arrays are kv_disk.py's, listed here for the cache's callers (engine.py)
__all__ = ["PrefixCache", "CacheEntry", "KvDiskStore", "KvCacheError", "state_arrays"]

log = logging.getLogger("ds4.engine")


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

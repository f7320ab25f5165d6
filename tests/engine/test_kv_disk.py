"""The prefix cache's disk tier (ds4lib/engine/kv_disk.py) on its own, with small host-array states (fast, no model):
servers of different stacks sharing one --kv-disk-dir keep each other's entries and each reads only its own; a
corrupt or misplaced entry of its own is removed; the cap holds per fingerprint; a `.partial` some live writer holds
is never removed; entries of the first layout (no subdirectories) stay readable; two processes of one stack see each
other's writes and evictions."""
import fcntl
import os
import tempfile

import numpy as np
import pytest

from ds4lib.engine.kv_disk import FINGERPRINT_FILE, PARTIAL, SUFFIX, KvCacheError, KvDiskStore, fingerprint_dirname
from ds4lib.engine.prefix_cache import CacheEntry, PrefixCache

CPU, CUDA = "base.gguf|123|cpu|snapshot 1", "base.gguf|123|cuda|snapshot 1|dspark"
T1, T2 = list(range(10, 30)), list(range(40, 52))


def _state(n: int, seed: int) -> dict:
    return {"k": np.random.default_rng(seed).standard_normal((n, 4)).astype(np.float32), "pos": n}


def _store(root, fingerprint=CPU, max_bytes=1 << 30) -> KvDiskStore:
    return KvDiskStore(root, fingerprint=fingerprint, max_bytes=max_bytes)


def _cache(disk: KvDiskStore) -> PrefixCache:
    return PrefixCache(max_bytes=1 << 30, disk=disk, copy_state=lambda s: s,
                       new_state=lambda: {"k": np.zeros((0, 4), np.float32), "pos": 0})


def _save(store: KvDiskStore, tokens, seed: int) -> dict:
    st = _state(len(tokens), seed)
    store.save(CacheEntry(tokens, st, [np.full(3, seed, np.float32)]))
    return st


def _files(store: KvDiskStore) -> list:
    return sorted(store.dir.glob("*" + SUFFIX))


def test_two_stacks_share_a_directory_and_keep_each_others_entries(tmp_path):
    cpu, cuda = _store(tmp_path, CPU), _store(tmp_path, CUDA)
    cpu_t1 = _save(cpu, T1, 1)
    cuda_t1, cuda_t2 = _save(cuda, T1, 2), _save(cuda, T2, 3)
    assert cpu.dir != cuda.dir and len(_files(cpu)) == 1 and len(_files(cuda)) == 2
    assert (cpu.dir / FINGERPRINT_FILE).read_text() == CPU and cpu.dir.name == fingerprint_dirname(CPU)
    cpu, cuda = _store(tmp_path, CPU), _store(tmp_path, CUDA)      # restarts: each sweeps and scans DIR
    assert len(_files(cpu)) == 1 and len(_files(cuda)) == 2
    assert cpu.lookup(T2 + [1]) == (0, None)                       # the other stack's entry is not used ...
    state, feats, n = _cache(cpu).lookup(T1 + [1])
    assert n == len(T1) and feats[0][0] == 1                       # ... and each reads its own state
    np.testing.assert_array_equal(state["k"], cpu_t1["k"])
    state, _, n = _cache(cuda).lookup(T1 + [1])
    np.testing.assert_array_equal(state["k"], cuda_t1["k"])
    state, _, n = _cache(cuda).lookup(T2 + [7, 8])
    assert n == len(T2) and state["pos"] == cuda_t2["pos"]
    assert len(_files(cpu)) == 1 and len(_files(cuda)) == 2        # ... and nothing was deleted


@pytest.mark.parametrize("damage", ["flip", "truncate", "magic", "misplaced"])
def test_a_corrupt_entry_is_ignored_and_removed(tmp_path, damage):
    store = _store(tmp_path)
    _save(store, T1, 1)
    other = _store(tmp_path, CUDA)
    _save(other, T2, 2)
    (path,) = _files(store)
    if damage == "misplaced":                                      # the other stack's file under this one's name
        os.replace(_files(other)[0], path)
    else:
        raw = bytearray(path.read_bytes())
        if damage == "flip":
            raw[-5] ^= 0x40                                        # payload: only the checksum can tell
        elif damage == "truncate":
            raw = raw[:-7]
        else:
            raw[:4] = b"GGUF"
        path.write_bytes(bytes(raw))
    assert _cache(_store(tmp_path)).lookup(T1 + [1]) == (None, [], 0)
    assert not path.exists() and not _files(_store(tmp_path))
    assert len(_files(other)) == (0 if damage == "misplaced" else 1)


def test_an_entry_of_another_layout_is_removed(tmp_path):
    store = _store(tmp_path)
    store.save(CacheEntry(T1, {"k": np.zeros((3, 4), np.float64), "pos": 3}, []))
    assert _cache(_store(tmp_path)).lookup(T1 + [1]) == (None, [], 0)
    assert not _files(store)


def test_the_cap_holds_per_stack_and_leaves_the_others_alone(tmp_path):
    other = _store(tmp_path, CUDA)
    for k in range(3):
        _save(other, [90 + k] + T2, k)
    store = _store(tmp_path)
    _save(store, T1, 0)
    size = _files(store)[0].stat().st_size
    os.utime(_files(store)[0], ns=(0, 0))
    store = _store(tmp_path, max_bytes=int(2.5 * size))
    for k in range(4):
        tokens = [20 + k] + T1
        _save(store, tokens, k)
        assert sum(p.stat().st_size for p in _files(store)) <= store.max_bytes
        _, key = store.lookup(tokens + [5])
        os.utime(store.dir / (key + SUFFIX), ns=(k + 1, k + 1))    # use order, whatever the clock's tick
    assert len(_files(store)) == 2 and len(_files(other)) == 3
    assert store.lookup([23] + T1 + [5])[0] == len(T1) + 1           # the most recent stayed
    assert store.lookup(T1 + [5]) == (0, None)


def test_a_partial_being_written_is_kept_and_an_abandoned_one_removed(tmp_path):
    store = _store(tmp_path)
    live, dead = store.dir / (".live.x" + PARTIAL), store.dir / (".dead.y" + PARTIAL)
    other = _store(tmp_path, CUDA).dir / (".theirs.z" + PARTIAL)
    legacy = tmp_path / (".old.w" + PARTIAL)
    for p in (live, dead, other, legacy):
        p.write_bytes(b"DS4KV001 cut short")
    with open(live, "rb+") as f:                                   # a writer in another process holds its lock
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        _store(tmp_path)
        _save(_store(tmp_path), T1, 1)                             # writing and evicting leave it alone as well
        assert live.exists() and not dead.exists() and not legacy.exists()
        assert other.exists()                                      # another stack's: its own store's to judge
    _store(tmp_path)                                               # the writer died: its lock went with it
    assert not live.exists() and other.exists()


def test_first_layout_entries_are_moved_into_their_stack_and_stay_readable(tmp_path):
    mine, theirs = _store(tmp_path / "a"), _store(tmp_path / "b", CUDA)
    want = _save(mine, T1, 1)
    _save(theirs, T2, 2)
    old_mine, old_theirs = tmp_path / _files(mine)[0].name, tmp_path / _files(theirs)[0].name
    os.replace(_files(mine)[0], old_mine)                          # DIR/<key>.ds4kv, as before subdirectories
    os.replace(_files(theirs)[0], old_theirs)
    junk = tmp_path / ("0" * 64 + SUFFIX)
    junk.write_bytes(b"not an entry")
    store = _store(tmp_path)
    assert not old_mine.exists() and old_theirs.exists() and not junk.exists()
    state, _, n = _cache(store).lookup(T1 + [1])
    assert n == len(T1)
    np.testing.assert_array_equal(state["k"], want["k"])


def test_two_processes_of_one_stack_see_each_others_writes_and_evictions(tmp_path):
    a, b = _store(tmp_path), _store(tmp_path)
    _save(a, T1, 1)
    assert b.lookup(T1 + [1])[0] == len(T1)                        # written by a after b opened
    _, key = a.lookup(T1 + [1])
    b.max_bytes = 1
    b._trim()                                                      # b evicts a's entry (as after a write of its own)
    with pytest.raises(KvCacheError, match="gone"):
        a.load(key, T1)
    assert a.lookup(T1 + [1]) == (0, None)
    _save(a, T1, 1)                                                # written again, not taken as present
    assert len(_files(a)) == 1


def test_a_writer_whose_partial_was_swept_before_its_lock_gives_up(tmp_path, monkeypatch):
    """The one window a sweep can take a live writer's file in (created, not yet locked): the write is dropped,
    nothing half-written is left or renamed into place, and the next write goes through."""
    store = _store(tmp_path)
    real = tempfile.mkstemp

    def swept_at_once(**kw):
        fd, name = real(**kw)
        os.unlink(name)
        return fd, name
    monkeypatch.setattr(tempfile, "mkstemp", swept_at_once)
    _save(store, T1, 1)
    assert not _files(store) and not list(store.dir.glob(".*")) and store.lookup(T1 + [1]) == (0, None)
    monkeypatch.undo()
    _save(store, T1, 1)
    assert len(_files(store)) == 1 and store.lookup(T1 + [1])[0] == len(T1)

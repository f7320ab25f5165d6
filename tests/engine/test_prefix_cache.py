"""Prefix KV reuse (ds4lib/engine/prefix_cache.py) on the CPU backend: a resumed session gives exactly the logits
of a cold prefill, the memory tier stays within its budget, and the disk tier survives a restart, never trusts a
corrupt, truncated or half-written entry, and keeps (unused) another stack's entries in the same directory
(the disk tier on its own: tests/engine/test_kv_disk.py)."""
from pathlib import Path

import numpy as np
import pytest

from ds4lib.engine import Engine, SamplingParams
from ds4lib.engine.kv_disk import PARTIAL, SUFFIX, KvCacheError, KvDiskStore, verify_entry
from ds4lib.engine.prefix_cache import CacheEntry

TOK = Path(__file__).resolve().parents[2] / "data" / "tokenizer" / "tokenizer.json"
P1 = [int(t) for t in np.random.default_rng(11).integers(9, 1000, 23)]
MORE = [int(t) for t in np.random.default_rng(12).integers(9, 1000, 9)]
GREEDY = SamplingParams(temperature=0, max_tokens=5)


def _engine(tiny_stack, **kw):
    ckpt, base = tiny_stack
    return Engine(base, engram_dir=ckpt, tokenizer_path=TOK, **kw)


@pytest.fixture(scope="module")
def cold(tiny_stack):
    return _engine(tiny_stack)


def test_second_turn_resumes_with_the_logits_of_a_cold_prefill(tiny_stack, cold):
    e = _engine(tiny_stack, prefix_cache_mb=64, prefill_block=8)
    out = list(e.generate_ids(P1, GREEDY))
    assert len(e.prefix_cache) == 1
    p2 = P1 + out + MORE                             # the next turn: the reply and a new message
    s = e.resume(p2)
    assert s.reused == s.position == len(P1) + len(out) - 1      # the last sampled token was never fed
    warm = e.prefill(s, p2[s.position:])
    np.testing.assert_array_equal(warm, cold.logits(p2)[-1])
    again = e.resume(p2)                             # the entry was copied out, not consumed or changed
    np.testing.assert_array_equal(e.prefill(again, p2[again.position:]), warm)
    sampled = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=6, seed=5)
    assert list(e.generate_ids(p2, sampled)) == list(cold.generate_ids(p2, sampled))
    events = list(e.generate(p2, GREEDY))
    assert events[-1]["cached_tokens"] >= len(p2) - 1 - len(MORE) and e.prefix_cache.hits >= 3
    assert [ev.get("id") for ev in events] == [ev.get("id") for ev in cold.generate(p2, GREEDY)]


def test_no_proper_prefix_no_resume_and_an_exact_repeat_refeeds_one_token(tiny_stack):
    e = _engine(tiny_stack, prefix_cache_mb=64)
    list(e.generate_ids(P1, SamplingParams(temperature=0, max_tokens=1)))      # stores P1 exactly
    assert e.resume(MORE).reused == 0
    s = e.resume(P1)
    assert s.reused == 0 or s.reused < len(P1)
    assert e.resume(P1 + MORE).reused == len(P1)


def test_memory_tier_stays_within_its_budget(tiny_stack):
    e = _engine(tiny_stack, prefix_cache_mb=64)
    list(e.generate_ids(P1, SamplingParams(temperature=0, max_tokens=1)))
    one = e.prefix_cache.bytes
    e.prefix_cache.max_bytes = int(2.5 * one)
    for k in range(5):
        list(e.generate_ids([9 + k] + P1, SamplingParams(temperature=0, max_tokens=1)))
        assert e.prefix_cache.bytes <= e.prefix_cache.max_bytes
    assert len(e.prefix_cache) == 2
    assert e.resume([13] + P1 + MORE).reused == len(P1) + 1          # the most recent ones stayed


def test_a_failed_forward_is_never_cached(tiny_stack, monkeypatch):
    e = _engine(tiny_stack, prefix_cache_mb=64)
    real, calls = e.backend.forward, []

    def flaky(state, tokens, last_only=False, observer=None):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("forward failed midway")
        return real(state, tokens, last_only=last_only, observer=observer)

    monkeypatch.setattr(e.backend, "forward", flaky)
    with pytest.raises(RuntimeError):
        list(e.generate_ids(P1, GREEDY))
    assert len(e.prefix_cache) == 0
    gen = e.generate(P1, GREEDY)                     # a client that goes away after one token: cached
    next(gen)
    gen.close()
    assert len(e.prefix_cache) == 1


def test_disk_tier_survives_a_restart(tiny_stack, cold, tmp_path):
    e = _engine(tiny_stack, kv_disk_dir=tmp_path, kv_disk_mb=64)
    out = list(e.generate_ids(P1, GREEDY))
    files = list(e.prefix_cache.disk.dir.glob("*" + SUFFIX))
    assert len(files) == 1 and not list(e.prefix_cache.disk.dir.glob(".*"))
    p2 = P1 + out + MORE
    e2 = _engine(tiny_stack, kv_disk_dir=tmp_path, kv_disk_mb=64)     # a new process would do the same
    s = e2.resume(p2)
    assert s.reused == len(P1) + len(out) - 1
    np.testing.assert_array_equal(e2.prefill(s, p2[s.position:]), cold.logits(p2)[-1])


def _one_entry(tiny_stack, tmp_path):
    e = _engine(tiny_stack, kv_disk_dir=tmp_path, kv_disk_mb=64)
    out = list(e.generate_ids(P1, GREEDY))
    (path,) = e.prefix_cache.disk.dir.glob("*" + SUFFIX)
    return e, path, P1 + out + MORE


@pytest.mark.parametrize("damage", ["flip", "truncate", "append", "magic", "header"])
def test_a_damaged_entry_is_ignored_and_removed(tiny_stack, cold, tmp_path, damage):
    _, path, p2 = _one_entry(tiny_stack, tmp_path)
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-100] ^= 0x40                            # payload: only the checksum can tell
    elif damage == "truncate":
        raw = raw[:-7]
    elif damage == "append":
        raw += b"\0"
    elif damage == "magic":
        raw[:4] = b"GGUF"
    else:
        raw[20:30] = b"}{garbage}"
    path.write_bytes(bytes(raw))
    e = _engine(tiny_stack, kv_disk_dir=tmp_path, kv_disk_mb=64)
    s = e.resume(p2)
    assert s.reused == 0 and not path.exists()
    np.testing.assert_array_equal(e.prefill(s, p2), cold.logits(p2)[-1])


def test_another_stacks_entries_are_kept_and_half_written_ones_removed(tiny_stack, tmp_path):
    """Another stack (a CUDA server, DSpark off, other files) sharing --kv-disk-dir: its entry for the same tokens
    is neither used nor deleted; a .partial no process is writing any more is removed."""
    e, path, p2 = _one_entry(tiny_stack, tmp_path)
    other = KvDiskStore(tmp_path, fingerprint="another stack", max_bytes=1 << 30)
    other.save(CacheEntry(p2[:-1], e.resume(P1 + MORE).state, []))           # would be the longer prefix
    (theirs,) = other.dir.glob("*" + SUFFIX)
    partial = e.prefix_cache.disk.dir / (".abc" + PARTIAL)
    partial.write_bytes(b"DS4KV001 cut short")
    e2 = _engine(tiny_stack, kv_disk_dir=tmp_path, kv_disk_mb=64)
    assert theirs.exists() and not partial.exists() and path.exists()
    assert e2.resume(p2).reused == len(p2) - len(MORE) - 1                    # its own entry, not the other's
    assert theirs.exists()


def test_disk_tier_keeps_to_its_size_cap(tiny_stack, tmp_path):
    e, path, _ = _one_entry(tiny_stack, tmp_path)
    size = path.stat().st_size
    e.prefix_cache.disk.max_bytes = int(2.5 * size)
    for k in range(4):
        list(e.generate_ids([20 + k] + P1, SamplingParams(temperature=0, max_tokens=1)))
        assert sum(p.stat().st_size for p in path.parent.glob("*" + SUFFIX)) <= e.prefix_cache.disk.max_bytes
    assert len(list(path.parent.glob("*" + SUFFIX))) == 2


@pytest.mark.parametrize("damage", [None, "flip", "truncate", "magic"])
def test_verify_entry_checks_an_entry_without_touching_it(tiny_stack, tmp_path, damage):
    """What a soak uses on a killed server's directory: a sound entry passes with its header, a damaged one raises
    KvCacheError, and neither is removed (the server, not the check, decides)."""
    _, path, _ = _one_entry(tiny_stack, tmp_path)
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-100] ^= 0x40
    elif damage == "truncate":
        raw = raw[:-7]
    elif damage == "magic":
        raw[:4] = b"GGUF"
    path.write_bytes(bytes(raw))
    if damage is None:
        assert verify_entry(path)["n_tokens"] > len(P1)
    else:
        with pytest.raises(KvCacheError):
            verify_entry(path)
    assert path.exists()

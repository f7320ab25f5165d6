"""Session states of the CUDA backend beyond a forward: the deferred DSpark context rows of speculative decoding
(ds4lib.engine.cuda_dspark.CudaDraft.defer / flush; issue 13) and device copies for the prefix cache
(CudaBackend.copy_state / state_nbytes / park_state; issue 15).

- Deferred rows: a plain decode step inside speculative decoding copies its features aside instead of appending them
  (about ten launches a step), and the pending rows are appended before a proposal reads the rings. Deferred then
  flushed must leave the rings exactly as appending every row at once.
- Prefix cache: a stored state is copied out whole (live content array for array, no shared buffer), budgeted at its
  device bytes; its host snapshot round-trips through the disk tier, and an entry of another layout is refused and
  removed; a second turn, and one after a restart from the disk tier, resumes with exactly a cold prefill's logits
  (GPU tier, ds4-tiny).
The `test_micro_*` tests run under the simulator in CI (no backbone forward: appends, proposals, synthetic states) on
the micro model with a DSpark stage; `test_gpu_*` need a real GPU.
"""
import numpy as np
import pytest

from ds4lib.engine import Engine, EngineError, SamplingParams, cuda_state
from ds4lib.engine.prefix_cache import PrefixCache
from tests.engine.test_engine_cuda import TOKENIZER, gpu, tiny_or_random  # noqa: F401
from tests.engine.test_speculative_cuda import spec_micro_config


@pytest.fixture(scope="module")
def micro_stack(tmp_path_factory):
    """(base file, checkpoint, CUDA backend) of the micro model with a DSpark stage."""
    from ds4lib.quant.base_file import quantize_checkpoint
    from ds4lib.synth import write_random_checkpoint
    root = tmp_path_factory.mktemp("defer_micro")
    ckpt = write_random_checkpoint(root / "ckpt", spec_micro_config(), seed=1)
    quantize_checkpoint(checkpoint=ckpt, out=root / "base.gguf", bits_plan="1", rounds=1, progress=False)
    be = Engine(root / "base.gguf", engram_dir=ckpt, tokenizer_path=TOKENIZER, backend="cuda").backend
    return root / "base.gguf", ckpt, be


@pytest.fixture(scope="module")
def draft_backend(micro_stack):
    return micro_stack[2]


def _rings(be, st):
    a = cuda_state.host_arrays(st, be._ratios)
    return {k: v for k, v in a.items() if k.startswith("dring") or k.startswith("dpend") or k == "dfeat_pend"}


def _two_states(be, *, seed, n, prompt):
    """(features [n, F] of positions 0..n-1, a device row [1, F] for deferring, two states whose rings hold the
    first `prompt` rows appended at once)."""
    from numba import cuda
    feats = np.random.default_rng(seed).standard_normal((n, be.n_feat)).astype(np.float32)
    states = be.new_state(), be.new_state()
    for st in states:
        be.draft.append_context(st, feats[:prompt], np.arange(prompt))
    return (feats, cuda.device_array((1, be.n_feat), np.float32)) + states


def test_micro_deferred_rows_flush_to_the_rings_of_one_append(draft_backend, monkeypatch):
    """A prompt's rows appended at once, then decode-step rows deferred one by one across the ring's wrap (W = 8:
    positions 5..17 wrap at 8 and 16): after a flush, rings and positions equal those of appending the rows
    directly. A proposal flushes before it reads the rings, and a verify call's rows appended after deferred ones keep
    position order (the pending rows go first)."""
    be = draft_backend
    feats, row, direct, lazy = _two_states(be, seed=0, n=24, prompt=5)
    be.draft.append_context(direct, feats[5:18], np.arange(5, 18))
    for p in range(5, 18):
        row.copy_to_device(feats[p:p + 1])
        be.draft.defer(lazy, row, p)                     # the source buffer is overwritten by the next step
    assert lazy.dpend == list(range(5, 18))
    assert _rings(be, direct)["dring_pos"].tolist() != _rings(be, lazy)["dring_pos"].tolist()

    class Read(Exception):
        pass

    def hidden_body(st, observer=None):                  # what a proposal reads first: the rings
        assert st.dpend == []
        for k, v in _rings(be, direct).items():
            np.testing.assert_array_equal(_rings(be, st)[k], v, err_msg=k)
        raise Read
    monkeypatch.setattr(be.draft, "_hidden_body", hidden_body)
    monkeypatch.setattr(be, "graphs", False)              # (a capture would run the check with no kernel run)
    with pytest.raises(Read):
        be.propose(lazy, 3, 17)
    monkeypatch.undo()
    for p in (18, 19):                                   # deferred rows, then a verify call's rows
        row.copy_to_device(feats[p:p + 1])
        be.draft.defer(lazy, row, p)
    be.draft.append_context(direct, feats[18:23], np.arange(18, 23))
    be.append_context(lazy, feats[20:23], [20, 21, 22])   # a host array: appended at once, after the pending
    for k, v in _rings(be, direct).items():
        np.testing.assert_array_equal(_rings(be, lazy)[k], v, err_msg=k)


def test_micro_a_gap_in_deferred_positions_flushes_first(draft_backend):
    """Deferred positions must be consecutive: a later position after a gap (a round's rows went straight to the
    rings) flushes what is pending before it is kept."""
    be = draft_backend
    feats, row, direct, lazy = _two_states(be, seed=1, n=12, prompt=3)
    for p in (3, 4, 9):
        be.draft.append_context(direct, feats[p:p + 1], [p])
        row.copy_to_device(feats[p:p + 1])
        be.draft.defer(lazy, row, p)
    assert lazy.dpend == [9]
    be.draft.flush(lazy)
    for k, v in _rings(be, direct).items():
        np.testing.assert_array_equal(_rings(be, lazy)[k], v, err_msg=k)


def test_micro_no_dspark_leaves_the_stages_off_the_device(micro_stack):
    """`--no-dspark` (Engine(dspark=False)): no stage weights uploaded, no context features computed, no rings, and
    the engine decodes plainly."""
    base, ckpt, be = micro_stack
    e = Engine(base, engram_dir=ckpt, tokenizer_path=TOKENIZER, backend="cuda", dspark=False)
    off = e.backend
    assert off.draft is None and off.n_feat == 0 and not off.can_draft and not e.speculative
    assert off.new_state().dwin_all is None
    assert be.draft is not None and off.weight_bytes < be.weight_bytes
    assert off.memory_plan().state < be.memory_plan().state
    on = Engine(base, engram_dir=ckpt, tokenizer_path=TOKENIZER, backend="cuda")
    assert e.fingerprint() != on.fingerprint()          # disk entries of the other layout count as stale


# ------------------------------------------------------------------------------------------------- prefix cache
def _live(be, st):
    return cuda_state.host_arrays(st, be._ratios)


def test_micro_stored_states_are_copied_out_whole_and_budgeted(draft_backend):
    """A state with content in every part (synthetic rings and caches, pending draft rows) stored in the prefix cache
    and looked up: the copy has the same live content and shares no buffer (writing the copy leaves the stored
    state as it was); the entry is budgeted at the state's device bytes, and the LRU keeps within its budget."""
    be = draft_backend
    from numba import cuda
    st = be.synthetic_state(13, seed=3)
    row = cuda.device_array((1, be.n_feat), np.float32)
    row.copy_to_device(np.random.default_rng(2).standard_normal((1, be.n_feat)).astype(np.float32))
    be.draft.defer(st, row, 13)
    want = _live(be, st)
    n = cuda_state.nbytes(st)
    assert n >= sum(a.nbytes for k, a in want.items() if k.startswith(("ring", "ckv", "dring")))
    cache = PrefixCache(max_bytes=3 * n, new_state=be.new_state, copy_state=be.copy_state,
                        state_nbytes=be.state_nbytes)
    tokens = list(range(5, 19))
    be.park_state(st)
    cache.store(tokens, st)
    assert cache.bytes == n + 8 * len(tokens)
    got, _, reused = cache.lookup(tokens + [7, 8])
    assert reused == len(tokens) and got is not st
    for k, v in want.items():
        np.testing.assert_array_equal(_live(be, got)[k], v, err_msg=k)
    from kernels import step
    for a in (got.win_all, got.dwin_all):                                       # the copy is written ...
        step.fill_bits(a.reshape(a.shape[0], -1), 99, 1.0)
    got.dfeat_pend.copy_to_device(np.zeros(got.dfeat_pend.shape, np.float32))
    be.draft.flush(got)
    for k, v in want.items():                                                   # ... the stored state is not
        np.testing.assert_array_equal(_live(be, st)[k], v, err_msg=k)
    for i in range(4):                                                          # an LRU of 3 entries' bytes
        cache.store([100 + i] * (i + 1), be.synthetic_state(5 + i, seed=i))
    assert cache.bytes <= cache.max_bytes and len(cache) <= 3


def test_micro_pooled_states_come_back_empty_or_as_exact_copies(draft_backend):
    """A released state (CudaBackend.release_state) is handed out again by new_state reset in place, with the live
    content of a new state, and by copy_state as a copy of another state with that state's live content, keeping
    its own buffers (its captured graphs stay valid); detach_state gives the prefix cache a copy sharing nothing and
    pools the original; the pool holds at most pool_size states."""
    be = draft_backend
    from numba import cuda
    fresh = _live(be, be.new_state())
    st = be.synthetic_state(13, seed=4)
    row = cuda.device_array((1, be.n_feat), np.float32)
    row.copy_to_device(np.random.default_rng(5).standard_normal((1, be.n_feat)).astype(np.float32))
    be.draft.defer(st, row, 13)
    want = _live(be, st)
    be._pool.clear()
    kept = be.detach_state(st)                                   # the cache's copy; st goes to the pool
    assert be._pool == [st] and kept is not st and kept.win_all is not st.win_all
    for k, v in want.items():
        np.testing.assert_array_equal(_live(be, kept)[k], v, err_msg=k)
    buf = st.win_all
    again = be.new_state()
    assert again is st and again.win_all is buf and not be._pool
    got = _live(be, again)
    assert got.keys() == fresh.keys() and (got["ring_pos"] == -1).all()
    for k, v in fresh.items():
        if k != "ring":                                          # rows of empty slots are never read
            np.testing.assert_array_equal(got[k], v, err_msg=k)
    be.release_state(again)
    copy = be.copy_state(kept)
    assert copy is st and not be._pool
    for k, v in want.items():
        np.testing.assert_array_equal(_live(be, copy)[k], v, err_msg=k)
    extra = [be.synthetic_state(3, seed=i) for i in range(be.pool_size + 2)]
    limit = be.pool_bytes
    try:
        be.pool_bytes = 1 << 40
        for x in extra:
            be.release_state(x)
        assert len(be._pool) == be.pool_size                     # at most pool_size states ...
        be._pool.clear()
        be.pool_bytes = 2 * cuda_state.nbytes(extra[0])
        for x in extra:
            be.release_state(x)
        assert len(be._pool) == 2                                # ... and at most pool_bytes
    finally:
        be.pool_bytes = limit
        be._pool.clear()


def test_micro_snapshots_round_trip_through_the_disk_tier(micro_stack, tmp_path):
    """The disk tier on this backend (`--kv-disk-dir`): a state's host snapshot written by KvDiskStore, read back by a
    new cache (a restarted server) into a fresh device state with the same live content; an entry whose arrays do not
    fit this backend's state (another layout) is refused and removed, never used."""
    from ds4lib.engine.prefix_cache import CacheEntry, KvDiskStore
    base, ckpt, be = micro_stack
    from numba import cuda
    st = be.synthetic_state(11, seed=5)
    row = cuda.device_array((1, be.n_feat), np.float32)
    row.copy_to_device(np.random.default_rng(4).standard_normal((1, be.n_feat)).astype(np.float32))
    be.draft.defer(st, row, 11)
    want = _live(be, st)
    back = be.state_from_arrays(be.state_to_arrays(st))
    for k, v in want.items():
        np.testing.assert_array_equal(_live(be, back)[k], v, err_msg=k)
    tokens = list(range(3, 14))
    disk = KvDiskStore(tmp_path, fingerprint="micro", max_bytes=1 << 30, to_arrays=be.state_to_arrays)
    disk.save(CacheEntry(tokens, st, [], be.state_nbytes(st)))
    cache = PrefixCache(max_bytes=1 << 30, new_state=be.new_state, copy_state=be.copy_state, state_nbytes=be.state_nbytes,
                        disk=KvDiskStore(tmp_path, fingerprint="micro", max_bytes=1 << 30,
                                         to_arrays=be.state_to_arrays),
                        from_arrays=be.state_from_arrays)
    got, _, n = cache.lookup(tokens + [9])
    assert n == len(tokens)
    for k, v in want.items():
        np.testing.assert_array_equal(_live(be, got)[k], v, err_msg=k)

    def other_layout(state):
        a = be.state_to_arrays(state)
        a["ring"] = a["ring"][:, :-1]
        return a
    odd = KvDiskStore(tmp_path / "odd", fingerprint="micro", max_bytes=1 << 30, to_arrays=other_layout)
    odd.save(CacheEntry(tokens, st, [], be.state_nbytes(st)))
    assert len(list(odd.dir.glob("*.ds4kv"))) == 1
    cache = PrefixCache(max_bytes=1 << 30, new_state=be.new_state, copy_state=be.copy_state,
                        disk=KvDiskStore(tmp_path / "odd", fingerprint="micro", max_bytes=1 << 30,
                                         to_arrays=be.state_to_arrays),
                        state_nbytes=be.state_nbytes, from_arrays=be.state_from_arrays)
    assert cache.lookup(tokens + [9]) == (None, [], 0)
    assert not list(odd.dir.glob("*.ds4kv"))
    with pytest.raises(ValueError, match="open mark"):
        mk = be.mark(st)
        try:
            be.state_to_arrays(st)
        finally:
            be.rollback(st, mk, [])


P1_TEXT = "The capital of France is Paris. The capital of Germany is"
MORE_TEXT = " Berlin. And the capital of Italy is"


def _texts(e):
    """(first turn, new message) as ids: the texts on ds4-tiny, random ids of the random tiny stack's vocabulary."""
    if e.cfg.vocab_size >= 8192:
        return [0] + e.encode(P1_TEXT), e.encode(MORE_TEXT)
    rng = np.random.default_rng(3)
    return [0] + [int(t) for t in rng.integers(9, e.cfg.vocab_size - 1, 14)], \
        [int(t) for t in rng.integers(9, e.cfg.vocab_size - 1, 7)]


@pytest.fixture(scope="module")
def tiny_engines(gpu, request):  # noqa: F811
    """(cold CUDA engine, CUDA engine with a prefix cache) of ds4-tiny when present, else of the random tiny stack."""
    base, ckpt = tiny_or_random(request)
    return (Engine(base, engram_dir=ckpt, tokenizer_path=TOKENIZER, backend="cuda"),
            Engine(base, engram_dir=ckpt, tokenizer_path=TOKENIZER, backend="cuda", prefix_cache_mb=256,
                   prefill_block=8))


@pytest.mark.cuda
def test_gpu_second_turn_resumes_with_the_logits_of_a_cold_prefill(tiny_engines):
    """The CPU test's contract (tests/engine/test_prefix_cache.py) on the CUDA backend: a greedy first turn (decoded
    speculatively, the default) is stored; the next turn (its reply and a new message) resumes from it, and the
    logits after the rest of the prompt equal a cold prefill's bit for bit; the entry is copied out, not consumed;
    seeded sampled and greedy generations equal the cold engine's."""
    cold, e = tiny_engines
    p1, more = _texts(e)
    out = list(e.generate_ids(p1, SamplingParams(temperature=0, max_tokens=6)))
    assert len(e.prefix_cache) == 1
    p2 = p1 + out + more
    s = e.resume(p2)
    assert s.reused == s.position == len(p1) + len(out) - 1
    warm = e.backend.to_host(e.prefill(s, p2[s.position:]))
    np.testing.assert_array_equal(warm, cold.logits(p2)[-1])
    again = e.resume(p2)
    np.testing.assert_array_equal(e.backend.to_host(e.prefill(again, p2[again.position:])), warm)
    for params in (SamplingParams(temperature=1.0, top_p=0.9, max_tokens=6, seed=5),
                   SamplingParams(temperature=0, max_tokens=8)):
        assert list(e.generate_ids(p2, params)) == list(cold.generate_ids(p2, params))
    assert e.prefix_cache.hits >= 3


@pytest.mark.cuda
def test_gpu_a_restarted_engine_resumes_from_the_disk_tier(tiny_engines, tmp_path):
    """--kv-disk-dir on the CUDA backend: a first engine stores its finished session on disk; a second engine on the
    same directory (a restarted server, nothing in memory) resumes the next turn from it with a cold prefill's logits."""
    cold, e = tiny_engines
    base, ckpt = e.base.path, e.engram_dir
    first = Engine(base, engram_dir=ckpt, tokenizer_path=TOKENIZER, backend="cuda", prefix_cache_mb=64,
                   kv_disk_dir=tmp_path)
    p1, more = _texts(first)
    out = list(first.generate_ids(p1, SamplingParams(temperature=0, max_tokens=5)))
    assert len(list(tmp_path.rglob("*.ds4kv"))) == 1
    again = Engine(base, engram_dir=ckpt, tokenizer_path=TOKENIZER, backend="cuda", prefix_cache_mb=64,
                   kv_disk_dir=tmp_path)
    p2 = p1 + out + more
    s = again.resume(p2)
    assert s.reused == len(p1) + len(out) - 1
    np.testing.assert_array_equal(again.backend.to_host(again.prefill(s, p2[s.position:])), cold.logits(p2)[-1])

"""ds4lib.engine.warmup on a stand-in engine: the calls a warm-up makes, and "compiled" versus "loaded" read off the
kernel cache directory. The CPU engine's warm-up is tested in test_engine_cpu.py; the CUDA one, that after it a
request compiles nothing, in test_engine_cuda.py (GPU)."""
from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest

from ds4lib.engine.warmup import warm_up


class _Backend:
    """Records what the warm-up runs; a forward "compiles" by writing the cache data files listed in `writes`."""

    def __init__(self, name):
        self.name, self.writes, self.calls = name, [], []

    def compile(self):
        for p in self.writes:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(b"cubin")
            t = p.stat().st_mtime_ns + 10 ** 9        # coarse file clocks: make a rewrite visible
            os.utime(p, ns=(t, t))
        self.writes = []

    def sample(self, logits, params, seed, step, mask=None):
        self.calls.append(("sample", params.temperature, params.top_k, params.top_p, mask is not None))
        return 2


class _Engine:
    def __init__(self, backend, ratios=(0, 1, 2, 2)):
        self.backend = backend
        self.cfg = SimpleNamespace(compress_ratios=ratios, n_layers=len(ratios), vocab_size=100)

    def new_session(self):
        return SimpleNamespace(tokens=[])

    def prefill(self, session, tokens, all_logits=False):
        self.backend.compile()
        self.backend.calls.append(("prefill", len(tokens), all_logits, session.tokens == []))
        session.tokens += tokens
        return np.zeros((len(tokens), self.cfg.vocab_size), np.float32)

    def decode(self, session, token):
        self.backend.calls.append(("decode", len(session.tokens)))
        session.tokens.append(token)
        return np.zeros(self.cfg.vocab_size, np.float32)

    def decode_batch(self, pending):
        self.backend.calls.append(("decode_batch", [len(p.session.tokens) for p in pending]))
        for p in pending:
            p.session.tokens.append(p.token)
            p.fulfil(np.zeros(self.cfg.vocab_size, np.float32))


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    root = tmp_path / "kernel-cache"
    monkeypatch.setenv("DS4_KERNEL_CACHE", str(root))
    return root


def test_warm_up_runs_prefill_decode_and_both_samplers():
    """Prefill 3r - 1 tokens with every position's logits (r the largest compression ratio: two groups
    completed), greedy sample of the last, then decode at
    3r - 1 (completes a group) and 3r (does not), each sampled with temperature, top-k, top-p and a mask; then a
    batched decode step of that session and a second one, both rows sampled unmasked."""
    b = _Backend("cpu")
    report = warm_up(_Engine(b), quiet=True)
    assert b.calls == [("prefill", 5, True, True), ("sample", 0.0, 0, 1.0, False),
                       ("decode", 5), ("sample", 1.0, 2, 0.9, True), ("decode", 6), ("sample", 1.0, 2, 0.9, True),
                       ("prefill", 2, False, True), ("decode_batch", [7, 2]), ("sample", 0.0, 0, 1.0, False),
                       ("sample", 1.0, 2, 0.9, False)]
    assert report.backend == "cpu" and report.compiled is None and report.cache_dir is None
    assert "nothing to compile" in report.message
    b = _Backend("cpu")
    warm_up(_Engine(b, ratios=(0, 1, 1)), quiet=True)
    assert b.calls[0] == ("prefill", 2, True, True)


def test_first_run_says_compiled_and_later_runs_say_loaded(cache_root, capsys):
    b = _Backend("cuda")
    e = _Engine(b)
    sub = cache_root / "kernels-0123" / "kernels_abc"
    b.writes = [sub / "gemv.gemv_kernel-65.py311.1.nbc", sub / "rope.rope_kernel-24.py311.1.nbc"]
    first = warm_up(e)
    line = capsys.readouterr().err
    assert line.count("\n") == 1 and line.startswith("ds4: warming up the cuda backend ... compiled 2 kernels in ")
    assert first.compiled == 2 and first.cached == 2 and first.cache_dir == cache_root and "first run" in line
    second = warm_up(e)
    line = capsys.readouterr().err
    assert second.compiled == 0 and second.cached == 2
    assert line.count("\n") == 1 and f"kernels loaded from the cache {cache_root} in " in line
    b.writes = [sub / "rope.rope_kernel-24.py311.1.nbc"]       # a stale entry rewritten under the same name
    assert warm_up(e, quiet=True).compiled == 1
    assert capsys.readouterr().err == ""


def test_a_cache_that_keeps_nothing_is_not_reported_as_loaded(cache_root):
    report = warm_up(_Engine(_Backend("cuda")), quiet=True)
    assert report.compiled == 0 and report.cached == 0
    assert "nothing was written to the cache" in report.message and "loaded" not in report.message


def test_a_simulated_backend_is_not_run(capsys):
    """The CUDA backend under the simulator compiles nothing: warm_up says so and runs no forward (one would take
    minutes there)."""
    b = _Backend("cuda")
    b.simulated = True
    e = _Engine(b)
    report = warm_up(e)
    assert report.compiled is None and report.seconds == 0.0
    assert "simulator" in capsys.readouterr().err
    assert not b.calls

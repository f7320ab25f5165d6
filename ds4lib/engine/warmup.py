"""Warm-up: before the first request, run every kernel a request uses once, so that numba-cuda compiles them (the
first run of a kernel source version) or loads them from its on-disk cache (every later run) at start-up and not
inside a request. `Engine.warm_up()` calls `warm_up`; `ds4 ... --cuda` and `ds4-server` call that.

What runs, on a throwaway session that is never stored in the prefix cache: a prefill of 3r - 1 tokens, r being
the largest compression ratio (5 for V4.1's ratio 2), with the logits of every position (scoring's head over
several rows; a generation's head over one row runs in the decode steps), then two decode steps; the prefill's last
logits are sampled greedily and each decode step's with temperature, top-k, top-p, min-p and an all-allowing token
mask (a constrained request's path); then one batched decode step of that session and a second one (the server's
interleaved requests, Engine.decode_batch), its rows sampled without a mask. With speculative decoding on the CUDA backend, a greedy and a sampled speculative
request and a rollback (`_run_speculative`; the engine's speculative counts are left as they were). The CUDA backend launches some kernels only at certain positions, hence those
lengths: the indexer once a compressed row exists, the compressed-row projections for two rows when a prefill
completes two groups (tokens 0..2r-1), for one row when a decode step completes a group (position 3r - 1) and not
at all when it does not (position 3r); the GEMVs have one-token and several-token variants. A kernel is compiled
per array dtype, rank and layout and scalar type, never per length, so a longer prompt needs nothing more.

"Compiled" or "loaded" is read off the cache directory, not guessed from the time: numba-cuda writes a `.nbc` data
file only after it compiled something; the files written under Env.kernel_cache_dir during the warm-up are counted.
The CPU backend has nothing to compile; it warms up the same way (cheap) and says so. A backend whose `simulated` is
true (the CUDA backend under the CUDA simulator) compiles nothing either and is not run: a simulated forward takes
minutes.

Shapes: V vocab.
"""
from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ds4lib.config import Env

__all__ = ["WarmUp", "warm_up"]

DECODE_STEPS = 2


@dataclass(frozen=True)
class WarmUp:
    """What a warm-up did: `compiled` cache entries written (0: everything came from the cache; None on the CPU
    backend), `cached` entries found in the cache afterwards, in `cache_dir`."""
    backend: str
    seconds: float
    compiled: int | None
    cached: int | None
    cache_dir: Path | None

    @property
    def outcome(self) -> str:
        s = f"{self.seconds:.1f} s"
        if self.compiled is None:
            return f"{s} (nothing to compile on the {self.backend} backend)"
        if self.compiled:
            return (f"compiled {self.compiled} kernels in {s} (first run of these kernel sources) and cached them in "
                    f"{self.cache_dir}; later runs load them")
        if self.cached:
            return f"kernels loaded from the cache {self.cache_dir} in {s}"
        return (f"kernels ready in {s}, but nothing was written to the cache {self.cache_dir} (not writable?): the "
                f"next run compiles again")

    @property
    def message(self) -> str:
        return f"{self.backend} warm-up: {self.outcome}"


def _entries(root: Path | None) -> dict:
    """{cache data file: mtime_ns} under `root`."""
    if root is None or not root.is_dir():
        return {}
    out = {}
    for p in root.rglob("*.nbc"):
        try:
            out[p] = p.stat().st_mtime_ns
        except OSError:                   # removed meanwhile (another process rewriting its entry)
            pass
    return out


def _run(engine) -> None:
    from ds4lib.engine.engine import PendingDecode, SamplingParams
    cfg, backend = engine.cfg, engine.backend
    r = max(1, max(cfg.compress_ratios[:cfg.n_layers], default=1))
    V = cfg.vocab_size
    toks = [2 + i % max(1, V - 2) for i in range(3 * r - 1 + DECODE_STEPS)]   # plain ids: not BOS (0), not EOS (1)
    mask = np.full(-(-V // 32), -1, dtype=np.int32)
    if V % 32:
        mask[-1] = np.int32((1 << (V % 32)) - 1)
    greedy = SamplingParams(temperature=0.0)
    drawn = SamplingParams(temperature=1.0, top_k=2, top_p=0.9, min_p=0.01)
    session = engine.new_session()
    logits = engine.prefill(session, toks[:3 * r - 1], all_logits=True)
    backend.sample(logits[-1], greedy, 0, 0)
    for step, tok in enumerate(toks[3 * r - 1:], start=1):
        logits = engine.decode(session, tok)
        backend.sample(logits, drawn, 0, step, mask=mask)
    other = engine.new_session()                  # a batched decode step (the server's interleaved requests)
    engine.prefill(other, toks[:2])
    pending = [PendingDecode(session, toks[0]), PendingDecode(other, toks[2])]
    policy = getattr(backend, "batch_capture", None)
    if policy is not None:                        # the batched launches now, not a first set's rows one by one
        backend.batch_capture = "now"
    try:
        engine.decode_batch(pending)
    finally:
        if policy is not None:
            backend.batch_capture = policy
    backend.sample(pending[0].logits(), greedy, 0, 0)
    backend.sample(pending[1].logits(), drawn, 0, 1)
    for s in (session, other):                    # throwaway sessions: their batched graph goes
        if hasattr(backend, "release_batches"):
            backend.release_batches(s.state)
    if getattr(engine, "speculative", False) and backend.name == "cuda":      # the CPU has nothing to compile
        _run_speculative(engine, toks[:3 * r - 1])


def _run_speculative(engine, prompt) -> None:
    """Speculative decoding's own launches: a greedy request of the scheduler's (its first round drafts the whole
    block and verifies 1 + B rows, the next step is a plain one with its context row), a sampled request with fixed
    k (drafts picked on the host), and a rollback that rejects a row (the ring restore), on throwaway sessions."""
    from ds4lib.engine.engine import SamplingParams
    backend, B = engine.backend, engine.cfg.dspark_block_size
    counts = (copy.deepcopy(engine.spec_stats), engine.last_spec_stats)      # requests' counts only (/metrics)
    priors = dict(engine.spec_priors)            # the warm-up's costs include compiling: no request starts from them
    for params in (SamplingParams(temperature=0.0, max_tokens=B + 3),
                   SamplingParams(temperature=1.0, top_k=2, top_p=0.9, min_p=0.01, max_tokens=3, seed=0, draft_k=1)):
        list(engine.generate_ids(prompt, params, session=engine.new_session()))
    session = engine.new_session()
    engine.prefill(session, prompt)
    mark = backend.mark(session.state)
    backend.forward(session.state, prompt[:2])
    backend.rollback(session.state, mark, prompt[:1])
    engine.spec_stats, engine.last_spec_stats = counts
    engine.spec_priors = priors


def warm_up(engine, *, quiet: bool = False) -> WarmUp:
    """Run the warm-up on `engine`; unless `quiet`, one line on stderr (begun before the work and ended after it,
    since a first run takes a minute)."""
    out = None if quiet else sys.stderr
    if getattr(engine.backend, "simulated", False):     # the CUDA simulator compiles nothing: a warm-up only costs
        report = WarmUp(engine.backend.name + " (simulator)", 0.0, None, None, None)
        if out is not None:
            out.write(f"ds4: {report.outcome}\n")
            out.flush()
        return report
    root = Env.read().kernel_cache_dir if engine.backend.name == "cuda" else None
    if out is not None:
        out.write(f"ds4: warming up the {engine.backend.name} backend ... ")
        out.flush()
    before = _entries(root)
    t0 = time.perf_counter()
    _run(engine)
    seconds = time.perf_counter() - t0
    after = _entries(root)
    compiled = sum(1 for p, t in after.items() if before.get(p) != t) if root is not None else None
    report = WarmUp(engine.backend.name, seconds, compiled, len(after) if root is not None else None, root)
    if out is not None:
        out.write(report.outcome + "\n")
        out.flush()
    return report

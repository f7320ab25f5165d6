"""Speculative decoding with the DSpark stages (issue 13) on the CPU backend and the shipped ds4-tiny: exact rollback of
rejected rows, greedy output token-identical to plain greedy for every k, and the distribution gate for sampled
decoding (speculative vs plain over 2,000 seeds, chi-square on the first tokens verification decides; the same test
on an always-accept rule must fail)."""
import copy
import hashlib
import math
from pathlib import Path

import numpy as np
import pytest

from ds4lib.engine import Engine, SamplingParams, Session
from ds4lib.engine import speculative as spec
from ds4lib.engine.prefix_cache import state_arrays
from ds4lib.ref import dspark as dsp

ROOT = Path(__file__).resolve().parents[2]
TINY_BASE = ROOT / "models" / "ds4-tiny-base.gguf"
TEXTS = ("The capital of France is Paris. The capital of Germany is",
         "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
         "In 1905, Albert Einstein published four papers that")


@pytest.fixture(scope="module")
def engine():
    return Engine(TINY_BASE)


def _prompt(engine, text):
    return [0] + engine.encode(text)


def _assert_states_equal(a, b):
    A, B = state_arrays(a), state_arrays(b)
    assert A.keys() == B.keys()
    for k in A:
        x, y = A[k], B[k]
        if k.endswith("._buf"):           # growable caches: same rows in use, zeros past them (capacity may differ)
            n = min(len(x), len(y))
            assert not x[n:].any() and not y[n:].any(), k
            x, y = x[:n], y[:n]
        np.testing.assert_array_equal(x, y, err_msg=k)


@pytest.mark.parametrize("length", [5, 18, 23])
def test_rollback_equals_feeding_only_the_kept_tokens(engine, length):
    """Prompts shorter and longer than the window (16), odd and even (the ratio-2 compressor's incomplete group),
    keeping 0 .. all rows of a 5-row verify call."""
    model = engine.backend.model
    rng = np.random.default_rng(length)
    base = model.new_state()
    model.forward(rng.integers(9, 1000, length), base)
    rows = rng.integers(9, 1000, 5)
    for n in range(len(rows) + 1):
        a = base.copy()
        mark = engine.backend.mark(a)
        model.forward(rows, a)
        engine.backend.rollback(a, mark, rows[:n])
        b = base.copy()
        for t in rows[:n]:
            model.forward([t], b)
        _assert_states_equal(a, b)
        # the rolled-back state goes on exactly as the other
        nxt = rng.integers(9, 1000, 3)
        np.testing.assert_array_equal(model.forward(nxt, a).logits, model.forward(nxt, b).logits)


def test_rollback_refuses_without_a_mark(engine):
    model = engine.backend.model
    st = model.new_state()
    model.forward([5, 6, 7], st)
    mark = st.mark()
    model.forward([8, 9], st)
    model.rollback(st, mark, [8])
    with pytest.raises(ValueError, match="without a mark"):
        model.rollback(st, mark, [])
    with pytest.raises(ValueError, match="keeps 3 rows"):
        st2 = model.new_state()
        m2 = st2.mark()
        model.forward([1, 2], st2)
        model.rollback(st2, m2, [1, 2, 3])


@pytest.mark.parametrize("text", TEXTS)
def test_greedy_is_token_identical_to_plain_for_every_k(engine, text):
    ids = _prompt(engine, text)
    plain = list(engine.generate_ids(ids, SamplingParams(temperature=0, max_tokens=14, draft_k=0)))
    for k in (1, 2, 4, None):
        got = list(engine.generate_ids(ids, SamplingParams(temperature=0, max_tokens=14, draft_k=k)))
        assert got == plain, f"k={k}"
        st = engine.last_spec_stats
        if k is not None:                           # the scheduler (k None) may measure that plain steps win
            assert st.rounds > 0 and st.drafted > 0, f"k={k}"
    assert engine.spec_stats.accepted > 0           # the accept path ran, not only rejections


def test_drafts_that_are_right_or_wrong_at_every_position(engine, monkeypatch):
    """Drafts forced to the target's own greedy tokens with one wrong token injected at position j (or none): every
    number of kept rows, output identical to plain greedy, the counts as forced."""
    ids = _prompt(engine, TEXTS[0])
    N = 12
    plain = list(engine.generate_ids(ids, SamplingParams(temperature=0, max_tokens=N, draft_k=0)))
    B = engine.cfg.dspark_block_size
    real = engine.backend.propose
    for wrong in list(range(B)) + [None]:
        def propose(state, anchor, start_pos, pick=None, wrong=wrong):
            prop = real(state, anchor, start_pos, pick)
            P = start_pos + 1 - len(ids)       # generated tokens before the anchor
            want = (plain + [1] * (B + 2))[P + 1:P + 1 + B]
            prop.tokens[1:] = want
            if wrong is not None:
                prop.tokens[1 + wrong] = (want[wrong] + 1) % engine.cfg.vocab_size
            return prop
        monkeypatch.setattr(engine.backend, "propose", propose)
        got = list(engine.generate_ids(ids, SamplingParams(temperature=0, max_tokens=N, draft_k=B)))
        assert got == plain, f"wrong at {wrong}"
        acc = engine.last_spec_stats.accepted_at
        if wrong is not None:
            assert acc[wrong] == 0 and all(acc[j] > 0 for j in range(wrong))
    monkeypatch.undo()


def test_seeded_sampled_request_without_draft_k_is_plain_decoding(engine):
    """A seeded sampled request with draft_k None decodes plainly (reproducible whatever the machine's timings):
    the same tokens as draft_k=0, and no speculative round; with draft_k given it speculates."""
    ids = [0] + engine.encode("The court held that")
    p = SamplingParams(temperature=1.0, top_k=8, max_tokens=8, seed=3)
    engine.last_spec_stats = None
    auto = list(engine.generate_ids(ids, p))
    assert engine.last_spec_stats is None
    plain = list(engine.generate_ids(ids, SamplingParams(temperature=1.0, top_k=8, max_tokens=8, seed=3, draft_k=0)))
    assert auto == plain
    list(engine.generate_ids(ids, SamplingParams(temperature=1.0, top_k=8, max_tokens=8, seed=3, draft_k=2)))
    assert engine.last_spec_stats is not None and engine.last_spec_stats.rounds > 0


def test_scheduler_picks_from_measured_costs():
    s = spec.Scheduler(4)
    assert s.want_draft(4) and s.choose(np.zeros(4), 4) == 4         # warm-up: the longest block first
    s.observe_draft(0.01, np.full(4, 5.0))
    s.observe_verify(5, 0.05, np.full(4, 5.0), 4)
    assert not s.want_draft(4)                                        # then a plain step for the line's 2nd point
    s.observe_plain(0.02)
    c_v1, c_tok = s.line()
    assert c_v1 == pytest.approx(0.0125) and c_tok == pytest.approx(0.0075)
    assert s.choose(np.full(4, 8.0), 4) == 4                          # confident drafts: the whole block
    assert s.choose(np.array([8.0, -8.0, -8.0, -8.0]), 4) == 1        # the 2nd draft hopeless: k = 1
    slow = spec.Scheduler(4)
    slow.observe_draft(1.0, np.full(4, -5.0))                         # a draft costing 50 plain steps
    slow.observe_verify(5, 0.05, np.full(4, -5.0), 0)
    slow.observe_plain(0.02)
    assert not slow.want_draft(4)
    assert spec.Scheduler(4, fixed_k=2).choose(np.zeros(4), 4) == 2
    assert not spec.Scheduler(4, fixed_k=0).want_draft(4)


def test_one_slow_step_does_not_decide_the_request():
    """Costs are the least of the recent observations: a first plain step that captured a CUDA graph (or compiled a
    kernel) at 8 times the steady cost must not make drafting look cheaper for the rest of the request, and one slow
    verify call must not make it look dearer."""
    s = spec.Scheduler(4)
    s.observe_draft(0.01, np.zeros(4))
    s.observe_verify(5, 0.05, np.zeros(4), 1)
    s.observe_plain(0.08)                                             # the step that captured the graph
    assert not s.want_draft(4)                                        # warm-up: MIN_PLAIN plain steps first
    s.observe_plain(0.01)
    s.observe_plain(0.01)
    assert not s.want_draft(4)                # best k: 1.67 tokens per 0.03 s < 1 per 0.01 s (a mean: 1 per 0.033 s)
    assert s._cost(s.plain_s) == 0.01
    fast = spec.Scheduler(4)
    fast.observe_draft(0.001, np.full(4, 8.0))
    fast.observe_verify(5, 0.012, np.full(4, 8.0), 4)
    for _ in range(spec.Scheduler.MIN_PLAIN):
        fast.observe_plain(0.01)
    assert fast.want_draft(4)
    fast.observe_verify(5, 1.0, np.full(4, 8.0), 4)                  # one stalled verify call
    assert fast.line()[1] == pytest.approx(0.0005) and fast.want_draft(4)
    fast.plain_s = [0.01] * 9 + [0.02]                               # only the last RECENT observations count
    assert fast._cost(fast.plain_s) == 0.01
    fast.plain_s = [0.001] + [0.02] * 8
    assert fast._cost(fast.plain_s) == 0.02


def test_a_first_miss_does_not_end_drafting():
    """rho keeps a prior pseudo-hit, and plain steps worth `explore` one-draft rounds trigger a round anyway; the
    interval doubles while first drafts keep failing and resets on a hit."""
    s = spec.Scheduler(4)
    s.observe_draft(0.01, np.zeros(4))
    s.observe_verify(5, 0.05, np.zeros(4), 0)                        # the first draft rejected
    assert 0 < s.rho < 1
    s.observe_plain(0.02)
    c_v1, c_tok = s.line()
    round1 = 0.01 + c_v1 + 2 * c_tok
    s.hits, s.sigma0 = 0, 1e6                                         # pretend drafting has failed for long
    assert not s.want_draft(4)
    steps = 0
    while not s.want_draft(4):
        s.observe_plain(0.02)
        steps += 1
    assert s.plain_since >= s.explore * round1 and steps <= s.explore * round1 / 0.02 + 1
    s.observe_draft(0.01, np.zeros(4))
    s.observe_verify(2, 0.03, np.zeros(4), 0)                         # the exploring round missed: wait twice as long
    assert s.plain_since == 0.0 and not s.want_draft(4)
    explore = s.explore
    s.observe_draft(0.01, np.zeros(4))
    s.observe_verify(2, 0.03, np.zeros(4), 1)                         # a hit: back to the first interval
    assert s.explore == s.EXPLORE < explore


def test_no_exploring_where_perfect_acceptance_would_still_lose():
    """A round costing ten plain steps cannot pay off with a block of 4 even if every draft were accepted: after the
    warm-up only plain steps follow, however long the request (exploring there would only cost time)."""
    s = spec.Scheduler(4)
    s.observe_draft(0.02, np.full(4, 8.0))
    s.observe_verify(5, 0.08, np.full(4, 8.0), 4)                    # a hit: rho stays high
    steps = 0
    while steps < 1000 and not s.want_draft(4):
        s.observe_plain(0.01)
        steps += 1
    assert steps == 1000
    cheap = spec.Scheduler(4)                                          # the same acceptance with a cheaper round
    cheap.observe_draft(0.002, np.full(4, 8.0))
    cheap.observe_verify(5, 0.012, np.full(4, 8.0), 4)
    for _ in range(spec.Scheduler.MIN_PLAIN):
        cheap.observe_plain(0.01)
    assert cheap.want_draft(4)


def test_a_request_starts_from_the_previous_requests_costs():
    """With the previous request's scheduler as its prior, a request skips the warm-up round where the costs are known:
    on a backend whose rounds lose even with every draft accepted it never drafts, where rounds pay it drafts at once;
    the prior's survival counts weigh as at most PRIOR_ROUNDS rounds, so this request's own hits soon decide rho."""
    lose = spec.Scheduler(4)
    lose.observe_draft(0.02, np.full(4, 8.0))
    lose.observe_verify(5, 0.08, np.full(4, 8.0), 4)
    for _ in range(spec.Scheduler.MIN_PLAIN):
        lose.observe_plain(0.01)
    assert spec.Scheduler(4).want_draft(4)                               # no prior: the warm-up round
    nxt = spec.Scheduler(4, prior=lose)
    assert not any(nxt.want_draft(4) or nxt.observe_plain(0.01) for _ in range(1000))
    win = spec.Scheduler(4)
    conf = np.full(4, 8.0)
    for _ in range(40):                                                 # a long request: 40 rounds, all kept
        win.observe_draft(0.002, conf)
        win.observe_verify(5, 0.012, conf, 4)
    for _ in range(spec.Scheduler.MIN_PLAIN):
        win.observe_plain(0.01)
    nxt = spec.Scheduler(4, prior=win)
    assert nxt.want_draft(4) and nxt.rounds == pytest.approx(spec.Scheduler.PRIOR_ROUNDS)
    assert nxt.rho == pytest.approx(win.rho, rel=0.01)
    for _ in range(8):                                                  # this request's first drafts all fail
        nxt.observe_draft(0.002, conf)
        nxt.observe_verify(5, 0.012, conf, 0)
    assert nxt.rho < 0.5 * win.rho
    assert spec.Scheduler(4, fixed_k=2, prior=win).rounds == 0          # a fixed k takes nothing from a prior


def test_the_engine_hands_each_request_the_last_ones_scheduler(engine, monkeypatch):
    """Each speculative request stores its scheduler for the next one of its kind. Scheduler.hopeless is held False
    here: whether this box's wall-clock costs make drafting hopeless (then the next request decodes plainly and stores
    nothing: test_requests_decode_plainly_where_no_round_could_pay) depends on its load, and a fresh clone's suite
    run beside other work failed this test that way."""
    monkeypatch.setattr(spec.Scheduler, "hopeless", lambda self: False)
    ids = [0] + engine.encode("The ledger shows")
    engine.spec_priors = {}
    list(engine.generate_ids(ids, SamplingParams(temperature=0, max_tokens=6)))
    first = engine.spec_priors[True]
    list(engine.generate_ids(ids, SamplingParams(temperature=0, max_tokens=6)))
    second = engine.spec_priors[True]
    assert second is not first and False not in engine.spec_priors
    assert len(second.plain_s) >= len(first.plain_s)                   # the second request began with the first's
    list(engine.generate_ids(ids, SamplingParams(temperature=0, max_tokens=6, draft_k=2)))   # fixed k: not a prior
    assert engine.spec_priors[True] is second


def test_requests_decode_plainly_where_no_round_could_pay(engine):
    """A prior whose rounds lose even with every draft accepted (Scheduler.hopeless) sends the next requests down the
    plain path (no rounds, no per-step scheduling), all but every RECHECK-th, which runs the scheduler again; the
    greedy tokens are the same either way."""
    ids = [0] + engine.encode("The ledger shows")
    lose = spec.Scheduler(engine.cfg.dspark_block_size)
    lose.observe_draft(0.02, np.full(4, 8.0))
    lose.observe_verify(5, 0.08, np.full(4, 8.0), 4)
    for _ in range(spec.Scheduler.MIN_PLAIN):
        lose.observe_plain(0.01)
    assert lose.hopeless() and not spec.Scheduler(4).hopeless()
    plain = list(engine.generate_ids(ids, SamplingParams(temperature=0, max_tokens=5, draft_k=0)))
    engine.spec_priors, engine._hopeless_runs = {True: lose}, 0
    ran = 0
    for _ in range(engine.RECHECK):
        assert list(engine.generate_ids(ids, SamplingParams(temperature=0, max_tokens=5))) == plain
        ran += engine.last_spec_stats is not None
        engine.spec_priors[True] = lose                                 # (a recheck stores its own scheduler)
    assert ran == 1 and engine._hopeless_runs == engine.RECHECK
    engine.spec_priors = {}


def test_rho_follows_the_hits_of_underconfident_heads_within_a_few_rounds():
    """ds4-tiny's confidence heads say sigmoid(c_1) ~ 0.2 where half the first drafts are kept (BENCHMARKS.md,
    "Speculative decoding"): after 4 rounds with 2 hits rho is within 20 % of the observed 2.5 (the prior pseudo-round
    weighs as one round at the request's own confidence), and a first miss leaves it above 0."""
    s = spec.Scheduler(4)
    conf = np.full(4, np.log(0.2 / 0.8))                             # sigmoid(c_j) = 0.2
    for hit in (1, 0, 1, 0):
        s.observe_draft(0.01, conf)
        s.observe_verify(5, 0.05, conf, hit)
    assert s.rho == pytest.approx(2.5, rel=0.2)                       # (2 + 0.2) / (0.8 + 0.2) = 2.2
    miss = spec.Scheduler(4)
    miss.observe_draft(0.01, conf)
    miss.observe_verify(5, 0.05, conf, 0)
    assert 0 < miss.rho < 1


def test_draft_k_is_validated():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="draft_k"):
            SamplingParams(draft_k=bad)


# ------------------------------------------------------------------------------------------------ distribution gate
class _Memo:
    """Caches the model's forward, draft stages and context appends per state history: every state carries a key
    naming the calls that built it from the prompt's state (copies keep it), so the gate's 2,000 seeds, which revisit
    few distinct (state, inputs) pairs, pay each distinct call once; a hit leaves the state exactly as the call would.
    Rollbacks run for real and extend the key. The draft's FP32 products (ref.dspark's linear_f32: the head over the
    collapsed state, the Markov head over a drafted token's embedding, the confidence head) are cached per weight and
    input bytes: the drafted tokens depend on the seed, but the products only on which of a few tokens and states
    they see. Test-only speed-up; every call still goes through the engine's code."""

    def __init__(self, engine):
        self.backend, self.model, self.cache = engine.backend, engine.backend.model, {}
        self.forward, self.hidden, self.append = self.model.forward, self.model.dspark_hidden, self.model.dspark_append
        self.rollback = self.backend.rollback
        self.linear_f32 = dsp.linear_f32

    @staticmethod
    def _key(state, *inputs):
        h = hashlib.sha1(state.__dict__.get("memo_key", "root").encode())
        for x in inputs:
            h.update(np.asarray(x).tobytes() if not isinstance(x, str) else x.encode())
        return h.hexdigest()

    def _mutating(self, name, call, state, *inputs):
        logs = "".join("1" if p is not None and p.log is not None else "0" for p in state.pending)
        key = self._key(state, name, logs, *inputs)
        if key not in self.cache:
            out = call()
            post = copy.deepcopy({k: v for k, v in state.__dict__.items() if k != "memo_key"})
            self.cache[key] = (out, post)
        out, post = self.cache[key]
        state.__dict__.update(copy.deepcopy(post))
        state.memo_key = key
        return out

    def install(self, monkeypatch):
        m = self.model

        def forward(ids, state, **kw):
            return self._mutating("forward", lambda: self.forward(ids, state, **kw), state, ids, repr(sorted(kw.items())))

        def append(state, f, p):
            return self._mutating("append", lambda: self.append(state, f, p), state, f, p)

        def hidden(state, anchor, start_pos, observer=None):
            key = self._key(state, "hidden", int(anchor), int(start_pos))
            if key not in self.cache:
                self.cache[key] = self.hidden(state, anchor, start_pos)
            return self.cache[key]

        def rollback(state, mark, kept):
            self.rollback(state, mark, kept)
            state.memo_key = self._key(state, "rollback", np.asarray(kept, dtype=np.int64))
        monkeypatch.setattr(m, "forward", forward)
        monkeypatch.setattr(m, "dspark_append", append)
        monkeypatch.setattr(m, "dspark_hidden", hidden)
        monkeypatch.setattr(self.backend, "rollback", rollback)

        def linear_f32(x, w):
            x = np.asarray(x)
            key = ("linear_f32", id(w), x.dtype.str, x.shape, x.tobytes())
            if key not in self.cache:
                self.cache[key] = (w, self.linear_f32(x, w))       # w kept, so that its id is never reused
            return self.cache[key][1].copy()
        monkeypatch.setattr(dsp, "linear_f32", linear_f32)


N_SEEDS = 2000


def _first_tokens(engine, prompt, params, seeds, speculative):
    """Per seed, the first three generated tokens: speculatively (the engine's rounds, k = 2) or by plain decoding."""
    s0 = engine.new_session()
    logits0 = engine.prefill(s0, prompt, draft_context=True)
    B = engine.cfg.dspark_block_size
    out = []
    for seed in seeds:
        s = Session(engine, engine.backend.copy_state(s0.state), list(s0.tokens))
        if speculative:
            gen = spec.generate_speculative(engine, s, logits0, params, seed, spec.Scheduler(B, 2), spec.SpecStats(B))
            out.append(list(gen))
        else:
            toks, logits = [], logits0
            for step in range(params.max_tokens):
                toks.append(engine.backend.sample(logits, params, seed, step))
                if step < params.max_tokens - 1:
                    logits = engine.decode(s, toks[-1])
            out.append(toks)
    return np.array(out)


def _chi2_sf(x: float, dof: int) -> float:
    """P(chi2_dof >= x): the regularised upper incomplete gamma Q(dof/2, x/2) (series below a + 1, continued
    fraction above; Numerical Recipes 6.2)."""
    a, z = dof / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    lead = math.exp(-z + a * math.log(z) - math.lgamma(a))
    if z < a + 1:
        term = total = 1.0 / a
        n = a
        while abs(term) > 1e-15 * abs(total):
            n += 1
            term *= z / n
            total += term
        return max(0.0, 1.0 - lead * total)
    b, c, d = z + 1 - a, 1e300, 1 / (z + 1 - a)
    h = d
    for i in range(1, 10000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1 / (d if abs(d) > 1e-300 else 1e-300)
        c = b + an / c
        c = c if abs(c) > 1e-300 else 1e-300
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return lead * h


def _chi2_pvalue(a, b):
    """Two-sample chi-square test of homogeneity of token samples a, b; tokens seen under 10 times pooled."""
    cats, counts = np.unique(np.concatenate([a, b]), return_counts=True)
    big = cats[counts >= 10]
    table = np.array([[np.sum(x == c) for c in big] + [np.sum(~np.isin(x, big))] for x in (a, b)], dtype=np.float64)
    table = table[:, table.sum(0) > 0]
    if table.shape[1] < 2:
        return 1.0
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    return _chi2_sf(float(((table - expected) ** 2 / expected).sum()), table.shape[1] - 1)


@pytest.mark.slow
def test_sampled_distribution_gate(engine, monkeypatch):
    """2,000 seeds, temperature 1.0 with top_k 8: the marginals of the 2nd and 3rd generated tokens (the first two that
    verification decides; the 1st is plain decoding's own token) agree between speculative and plain decoding, and an
    always-accept rule is caught."""
    _Memo(engine).install(monkeypatch)
    prompt = _prompt(engine, "Once upon a time, there was a")
    params = SamplingParams(temperature=1.0, top_k=8, max_tokens=3, seed=0)
    seeds = range(N_SEEDS)
    plain = _first_tokens(engine, prompt, params, seeds, speculative=False)
    good = _first_tokens(engine, prompt, params, seeds, speculative=True)
    np.testing.assert_array_equal(good[:, 0], plain[:, 0])
    p_good = [_chi2_pvalue(good[:, i], plain[:, i]) for i in (1, 2)]
    monkeypatch.setattr(spec, "accept_draft", lambda p, q, d, u: True)
    bad = _first_tokens(engine, prompt, params, seeds, speculative=True)
    p_bad = [_chi2_pvalue(bad[:, i], plain[:, i]) for i in (1, 2)]
    print("gate p-values: rejection sampling", p_good, "always accept", p_bad)
    assert min(p_good) > 0.01
    assert min(p_bad) < 1e-4


def test_chi2_tail_matches_known_values():
    assert _chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-6)
    assert _chi2_sf(18.307038053275146, 10) == pytest.approx(0.05, rel=1e-6)
    assert _chi2_sf(2.0, 30) == pytest.approx(1.0, abs=1e-9)
    assert _chi2_sf(100.0, 3) < 1e-20


def test_a_plain_request_does_not_report_the_previous_requests_rounds(engine):
    """last_spec_stats belongs to the last request: after a speculative request, a request on the plain path (here
    draft_k=0) reports None, not the previous one's rounds (H200 bench of 2026-12-04: every greedy row showed the
    sampled request's rounds before it)."""
    ids = [0] + engine.encode("The ledger shows")
    list(engine.generate_ids(ids, SamplingParams(temperature=0, max_tokens=6, draft_k=2)))
    assert engine.last_spec_stats is not None and engine.last_spec_stats.rounds > 0
    list(engine.generate_ids(ids, SamplingParams(temperature=0, max_tokens=6, draft_k=0)))
    assert engine.last_spec_stats is None

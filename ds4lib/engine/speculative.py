"""Speculative decoding with the DSpark draft stages (docs/design.md §6.2, docs/architecture.md §9; issue 13):
draft a block, verify 1 + k rows through the target in one forward, keep the accepted rows, roll the rest back
exactly.

A round, with the target having fed positions < F and `a` the pending token for position F:
  1. propose: the draft stages over [a, noise...] give draft logits and a confidence logit c_j per block position;
     the drafts d_1..d_B are their argmax (greedy) or are drawn from the draft distribution q_j at the request's
     temperature and truncation (`DraftDraw`: the sampler of ds4lib.ref.sampling, Gumbel-max over the kept tokens,
     whose distribution is ds4lib.ref.sampling.probabilities) with the Markov bias following the drawn token.
  2. k from the Scheduler (never changes a greedy token: any k gives plain greedy's output).
  3. mark the state, forward [a, d_1..d_k] at F..F+k: target rows p_0..p_k.
  4. greedy: d_j kept while it is the argmax of p_{j-1}; the first mismatch yields that argmax instead. Sampled:
     d_j kept with probability min(1, p_{j-1}(d_j) / q_j(d_j)); on the first rejection a token drawn from
     normalise(max(0, p_{j-1} - q_j)) replaces it (`verify_rows`, `residual_token`). All k kept: one more token from
     p_k. A backend with `accept_rows` decides this where the rows are (the CUDA backend: on the device).
  5. roll the state back to the kept rows (a, d_1..d_n) and append their DSpark context rows (erratum E2: accepted
     positions only). The last token becomes the next round's `a`.
Every random number is a uniform of (seed, position, purpose): `stream_uniform` for the acceptance (ACCEPT), the
per-token uniforms of step purpose << 56 | position (ds4lib.ref.sampling.uniforms) for the drafts (DRAFT), the
residual draw (RESIDUAL) and the bonus token (BONUS); the first token after the prompt is plain decoding's own
(step 0), so it is the same token for a seed with or without speculation.

The backend contract (`supports`): propose(state, anchor, start_pos, draw) -> Proposal (draw None: greedy; a
`DraftDraw`: sampled drafts, drawn by the backend where the logits are), mark(state),
rollback(state, mark, kept_tokens), append_context(state, features, positions), plus forward / to_host / sample. A
backend without them decodes plainly; a backend may verify with its own multi-row kernels behind `forward`. The CPU
backend runs the reference; the CUDA backend drafts on the device (cuda_dspark), rolls its device state back
(cuda_state) and verifies through its multi-row forward, and decides acceptance on the device (`accept_rows`,
kernels.spec_accept: the host's semantics); all of a round's device work (proposal with its sampled drafts drawn by
the device sampler, mark, verify call, acceptance, rollback, context rows) is replayed from captured graphs, and the
host reads back the drafts, the confidences and two integers.

Shapes: B block size, k drafted tokens verified, V vocab.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ds4lib.ref.sampling import probabilities, uniforms
from ds4lib.ref.sampling import sample as ref_sample

__all__ = ["SPEC_METHODS", "supports", "stream_uniform", "draw", "accept_draft", "residual", "residual_token",
           "verify_rows", "DraftDraw", "SpecStats", "Scheduler", "generate_speculative", "DRAFT", "ACCEPT", "RESIDUAL",
           "BONUS"]

SPEC_METHODS = ("propose", "mark", "rollback", "append_context")
DRAFT, ACCEPT, RESIDUAL, BONUS = 1, 2, 3, 4
_PURPOSE_SHIFT = 56               # plain decoding uses steps < 2^56 with purpose 0: the streams never meet


def supports(backend, cfg) -> bool:
    """The backend can draft, roll back and keep DSpark context rows, and the model has draft stages (and the
    backend holds them: `can_draft`, where a backend may run without them)."""
    return cfg.n_all_layers > cfg.n_layers and all(callable(getattr(backend, m, None)) for m in SPEC_METHODS) \
        and bool(getattr(backend, "can_draft", True))


def stream_uniform(seed: int, position: int, purpose: int) -> float:
    """The uniform in (0, 1) of (seed, position, purpose): Philox counter (0, position | purpose << 56)."""
    return float(uniforms(seed, (int(purpose) << _PURPOSE_SHIFT) | int(position), 1)[0])


def draw(prob, u: float) -> int:
    """The token of `prob` [V] (sums to 1 up to rounding) at cumulative mass u: inverse-CDF sampling."""
    c = np.cumsum(prob)
    i = int(np.searchsorted(c, u * c[-1], side="right"))
    i = min(i, len(c) - 1)
    while prob[i] <= 0:              # u * total landed on the flat tail of rounding: the last token with mass
        i -= 1
    return i


def accept_draft(p, q, d: int, u: float) -> bool:
    """Accept draft d (drawn from q) with probability min(1, p[d] / q[d])."""
    return u * q[d] < p[d]


def residual(p, q):
    """normalise(max(0, p - q)); p itself where p == q (then no draft is ever rejected)."""
    r = np.maximum(p - q, 0.0)
    s = r.sum()
    return r / s if s > 0 else p


def residual_token(row, p, q, params, seed: int, position: int) -> int:
    """The token that replaces a draft rejected at `position`: a draw from residual(p, q) by Gumbel-max over
    r = p - q > 0 with the per-token uniforms of step RESIDUAL << 56 | position (argmax of log r_i - log(-log u_i),
    the lowest index on ties); where no r_i is positive (p == q), the sampler's own draw from p (`row` the target
    logits) with those uniforms. The CUDA backend's acceptance kernel (kernels.spec_accept) computes the same."""
    step = (RESIDUAL << _PURPOSE_SHIFT) | int(position)
    r = p - q
    pos = r > 0
    if not pos.any():
        return int(ref_sample(row, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                              min_p=params.min_p, seed=seed, step=step))
    u = uniforms(seed, step, len(p))
    with np.errstate(divide="ignore"):
        g = np.where(pos, np.log(np.where(pos, r, 1.0)) - np.log(-np.log(u)), -np.inf)
    return int(np.argmax(g))


def verify_rows(target, drafts, q_rows, params, seed: int, first_pos: int, sample_bonus):
    """(number of drafts kept, next token) for target rows p_0..p_k [k+1, V] and drafts d_1..d_k at positions
    first_pos..first_pos+k-1. `q_rows[j]`: the draft distribution d_{j+1} was drawn from (unused when greedy).
    `sample_bonus(row, position)`: the token after k kept drafts."""
    k = len(drafts)
    for j in range(k):
        pos = first_pos + j
        if params.temperature == 0:
            best = int(np.argmax(target[j]))
            if drafts[j] != best:
                return j, best
            continue
        p = probabilities(target[j], temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                          min_p=params.min_p)
        if not accept_draft(p, q_rows[j], drafts[j], stream_uniform(seed, pos, ACCEPT)):
            return j, residual_token(target[j], p, q_rows[j], params, seed, pos)
    return k, sample_bonus(target[k], first_pos + k)


@dataclass(frozen=True)
class DraftDraw:
    """How a sampled request's drafts are drawn: the token of block row i of a proposal after start_pos (it predicts
    position start_pos + 2 + i) is ds4lib.ref.sampling.sample of the row's draft logits at the request's temperature
    and truncation, seed `seed`, step `step(start_pos + 2 + i)`: Gumbel-max over the kept tokens, i.e. a draw from
    q = probabilities(row). The CPU backend draws on the host (`host_pick`), the CUDA backend with its device sampler
    (the same semantics, the same token)."""
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int

    @classmethod
    def of(cls, params, seed: int) -> "DraftDraw":
        return cls(float(params.temperature), int(params.top_k), float(params.top_p), float(params.min_p), int(seed))

    @staticmethod
    def step(position: int) -> int:
        return (DRAFT << _PURPOSE_SHIFT) | int(position)

    def host_pick(self, start_pos: int):
        """pick(row) -> token for ds4lib.ref.dspark.draft_tokens, rows in block order."""
        rows = []

        def pick(row):
            rows.append(None)
            return ref_sample(row, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              min_p=self.min_p, seed=self.seed, step=self.step(start_pos + 1 + len(rows)))
        return pick


@dataclass
class SpecStats:
    """Counts of one request (or summed over requests): rounds, drafted and accepted tokens, per draft position."""
    block: int
    rounds: int = 0
    plain_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0                # tokens the rounds produced (kept drafts + one per round)
    drafted_at: list = field(default_factory=list)
    accepted_at: list = field(default_factory=list)

    def __post_init__(self):
        self.drafted_at = self.drafted_at or [0] * self.block
        self.accepted_at = self.accepted_at or [0] * self.block

    def observe_round(self, k: int, n: int) -> None:
        self.rounds += 1
        self.drafted += k
        self.accepted += n
        self.tokens += n + 1
        for j in range(k):
            self.drafted_at[j] += 1
            self.accepted_at[j] += int(j < n)

    def add(self, other: "SpecStats") -> None:
        for name in ("rounds", "plain_steps", "drafted", "accepted", "tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for j in range(min(self.block, other.block)):
            self.drafted_at[j] += other.drafted_at[j]
            self.accepted_at[j] += other.accepted_at[j]

    @property
    def tokens_per_round(self) -> float:
        return self.tokens / self.rounds if self.rounds else float("nan")

    def acceptance(self) -> list:
        """Share of drafts kept at each draft position (NaN where none was drafted)."""
        return [a / d if d else float("nan") for a, d in zip(self.accepted_at, self.drafted_at)]

    def summary(self) -> dict:
        return {"rounds": self.rounds, "plain_steps": self.plain_steps, "drafted": self.drafted,
                "accepted": self.accepted, "tokens_per_round": round(self.tokens_per_round, 4),
                "acceptance": [round(a, 4) for a in self.acceptance()]}


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-np.asarray(x, dtype=np.float64)))


class Scheduler:
    """Chooses k per round: k* = argmax_k (1 + sum_{j<=k} a_j) / (c_draft + c_v1 + c_tok * (1 + k)), survival
    a_j = rho * prod_{i<=j} sigmoid(c_i) (clipped to 1), against a plain step (rate 1 / c_plain; no draft).

    All costs are this request's wall clock, each the least of its last RECENT observations (a step's cost is a
    floor plus one-off delays: the first step of a new cache bucket captures a CUDA graph, a kernel compiles, the
    collector runs; a mean let one such step make plain decoding look slow for the rest of a request): c_draft of
    the draft rounds, c_plain of the plain steps, and the line c_v1 + c_tok * rows fitted by least squares to the
    verify time at each row count (a round's whole cost after its proposal: mark, verify call, acceptance, rollback
    and the kept rows' context; a plain step counts as one row). rho = (first-position hits + m) / (sum of
    sigmoid(c_1) over the request's rounds + m), m the request's mean sigmoid(c_1): one pseudo-round at the request's
    own confidence keeps a first miss from setting rho to 0 for good and weighs as one round (a pseudo-round of
    confidence 1 weighed 1 / m rounds, 2-6 with ds4-tiny's underconfident heads, and held rho near 1 for the few
    rounds a request drafts). Warm-up: the first round verifies the longest block,
    then MIN_PLAIN plain steps give the line its second point (several: the first plain step of a session captures
    its CUDA graph, and a lone outlier would be c_plain for as long as drafting kept winning, since drafting rounds
    add no plain observations). Exploration: once the plain steps since the last round have
    cost `explore` times a one-draft round, a round is drafted anyway (rho would otherwise never be measured again
    after the rate turns against drafting); `explore` starts at EXPLORE, doubles after each round whose first draft
    is rejected and resets on a hit, so exploring costs at most 1 / (1 + EXPLORE) of the time and less and less while
    drafts keep failing. No exploring where the costs alone decide: when a round whose every draft were accepted
    would still be slower than plain steps (a backend whose verify call costs many plain steps), only plain steps
    follow the warm-up. `fixed_k` bypasses all of it (0 = plain decoding). Timing only ever changes k, and k never
    changes a greedy token.

    `prior`: the scheduler of the engine's previous request of the same kind (greedy or sampled). A request starts
    from its cost observations (the last RECENT of each) and its exploration interval, and from its survival counts
    scaled down to at most PRIOR_ROUNDS pseudo-rounds, so that a few rounds of this request's own outweigh them: no
    warm-up round where the costs are already known (on a backend where drafting loses, each request paid one; 60-80
    ms on the H200 with ds4-tiny), while rho and the costs keep following this request's own observations."""

    EXPLORE = 4.0
    EXPLORE_MAX = 1024.0
    RECENT = 8
    MIN_PLAIN = 3
    PRIOR_ROUNDS = 4.0

    def __init__(self, block: int, fixed_k: int | None = None, prior: "Scheduler | None" = None):
        self.block, self.fixed_k = block, fixed_k
        self.plain_s, self.draft_s = [], []
        self.verify_s: dict = {}
        self.hits, self.sigma0 = 0.0, 0.0
        self.prod_sum = np.zeros(block)      # sum over rounds of prod_{i<=j} sigmoid(c_i), for the pre-draft guess
        self.rounds = 0.0
        self.plain_since = 0.0               # seconds of plain steps since the last draft round
        self.explore = self.EXPLORE
        if prior is not None and fixed_k is None and prior.block == block and prior.draft_s:
            self.plain_s, self.draft_s = list(prior.plain_s[-self.RECENT:]), list(prior.draft_s[-self.RECENT:])
            self.verify_s = {r: list(v[-self.RECENT:]) for r, v in prior.verify_s.items()}
            w = min(1.0, self.PRIOR_ROUNDS / prior.rounds) if prior.rounds else 0.0
            self.hits, self.sigma0 = w * prior.hits, w * prior.sigma0
            self.prod_sum, self.rounds = w * prior.prod_sum, w * prior.rounds
            self.explore = prior.explore
            self.plain_since = prior.plain_since

    # -------------------------------------------------------------- observations
    def observe_plain(self, seconds: float) -> None:
        self.plain_s.append(seconds)
        self.verify_s.setdefault(1, []).append(seconds)
        self.plain_since += seconds

    def observe_draft(self, seconds: float, conf) -> None:
        self.draft_s.append(seconds)
        self.prod_sum = self.prod_sum + np.cumprod(_sigmoid(conf))[:self.block]
        self.rounds += 1
        self.plain_since = 0.0

    def observe_verify(self, rows: int, seconds: float, conf, kept: int) -> None:
        self.verify_s.setdefault(rows, []).append(seconds)
        if rows > 1:
            self.sigma0 += float(_sigmoid(conf[0]))
            self.hits += int(kept > 0)
            self.explore = self.EXPLORE if kept > 0 else min(2.0 * self.explore, self.EXPLORE_MAX)

    # -------------------------------------------------------------- model
    def _cost(self, samples) -> float:
        """The least of the last RECENT observations (class docstring)."""
        return float(min(samples[-self.RECENT:]))

    @property
    def rho(self) -> float:
        if not self.rounds:
            return 1.0
        m = float(self.prod_sum[0]) / self.rounds          # mean sigmoid(c_1) of the drafted rounds
        return (self.hits + m) / (self.sigma0 + m)

    def survival(self, conf) -> np.ndarray:
        return np.minimum(self.rho * np.cumprod(_sigmoid(conf)), 1.0)

    def line(self):
        """(c_v1, c_tok) from the verify times, or None before two row counts were seen."""
        if len(self.verify_s) < 2:
            return None
        rows = np.array(sorted(self.verify_s), dtype=np.float64)
        t = np.array([self._cost(self.verify_s[r]) for r in sorted(self.verify_s)])
        w = np.array([min(len(self.verify_s[r]), self.RECENT) for r in sorted(self.verify_s)], dtype=np.float64)
        A = np.stack([np.ones_like(rows), rows], axis=1) * np.sqrt(w)[:, None]
        c_v1, c_tok = np.linalg.lstsq(A, t * np.sqrt(w), rcond=None)[0]
        return max(float(c_v1), 0.0), max(float(c_tok), 1e-9)

    def _best(self, a, kmax: int, line=None):
        """(k, tokens per second) of the best k in 1..kmax for survival a (`line`: self.line(), if already formed)."""
        c_v1, c_tok = line or self.line()
        c_draft = self._cost(self.draft_s)
        ks = np.arange(1, kmax + 1)
        rate = (1 + np.cumsum(a[:kmax])) / (c_draft + c_v1 + c_tok * (1 + ks))
        i = int(np.argmax(rate))
        return int(ks[i]), float(rate[i])

    # -------------------------------------------------------------- decisions
    def _perfect_round_loses(self, line, kmax: int) -> bool:
        """Even with every draft accepted, no round of up to kmax drafts beats plain steps on the measured costs."""
        return self._best(np.ones(self.block), kmax, line)[1] <= 1.0 / self._cost(self.plain_s)

    def hopeless(self) -> bool:
        """A round of the whole block would lose to plain steps even with every draft accepted, on the measured
        costs (after the warm-up): a request starting from this scheduler would only take plain steps."""
        if self.fixed_k is not None or not self.draft_s or len(self.plain_s) < self.MIN_PLAIN:
            return False
        line = self.line()
        return line is not None and self._perfect_round_loses(line, self.block)

    def want_draft(self, kmax: int) -> bool:
        """Draft this round, or take a plain step (before the draft is paid for, so on past rounds' survival)."""
        if kmax < 1:
            return False
        if self.fixed_k is not None:
            return self.fixed_k > 0
        if not self.draft_s:
            return True
        line = self.line() if len(self.plain_s) >= self.MIN_PLAIN else None    # (one least-squares fit a step)
        if line is None:
            return False
        c_v1, c_tok = line
        a = np.minimum(self.rho * self.prod_sum / self.rounds, 1.0)
        if self._best(a, kmax, line)[1] > 1.0 / self._cost(self.plain_s):    # (plain_s holds MIN_PLAIN or more)
            return True
        if self._perfect_round_loses(line, kmax):
            return False                     # every draft accepted would still lose: nothing to explore for
        round1 = self._cost(self.draft_s) + c_v1 + 2.0 * c_tok           # a one-draft round
        return self.plain_since >= self.explore * round1

    def choose(self, conf, kmax: int) -> int:
        """k in 1..kmax for this round's confidence logits."""
        if self.fixed_k is not None:
            return max(1, min(self.fixed_k, kmax))
        if self.line() is None:
            return kmax
        return self._best(self.survival(conf), kmax)[0]


def _now():
    return time.perf_counter()


def generate_speculative(engine, s, logits, params, seed: int, sched: Scheduler, stats: SpecStats):
    """Yield the tokens after the prompt whose logits are `logits` (session `s` has fed the prompt and holds its
    DSpark context rows), by speculative rounds and plain steps, up to params.max_tokens, stopping after EOS."""
    from ds4lib.engine.engine import EOS
    backend, cfg = engine.backend, engine.cfg
    tok = backend.sample(logits, params, seed, 0)
    emitted = 1
    yield tok
    while tok != EOS and emitted < params.max_tokens:
        kmax = min(cfg.dspark_block_size, params.max_tokens - emitted - 1, engine.context_length - s.position - 1)
        if not sched.want_draft(kmax):
            engine._check_room(s, 1)
            t0 = _now()
            out = backend.forward(s.state, [tok], last_only=True)
            row = out.logits[-1]                   # sampled where it lives, as plain decoding does (no host copy)
            pos, fed = s.position, tok
            tok = backend.sample(row, params, seed, emitted) if params.temperature == 0 else \
                _bonus(backend, params, seed)(row, pos + 1)
            sched.observe_plain(_now() - t0)       # the step's cost up to its token (sampling waits for the step)
            backend.append_context(s.state, out.features, [pos])
            s.tokens.append(fed)
            stats.plain_steps += 1
            emitted += 1
            yield tok
            continue
        new = yield from _round(engine, s, tok, params, seed, sched, stats, kmax)
        emitted += len(new)
        tok = new[-1]


def _bonus(backend, params, seed):
    def sample_bonus(row, position):
        return backend.sample(row, params, seed, (BONUS << _PURPOSE_SHIFT) | int(position))
    return sample_bonus


def _round(engine, s, anchor, params, seed, sched, stats, kmax):
    """One round (module docstring); yields its tokens and returns them."""
    from ds4lib.engine.engine import EOS
    backend = engine.backend
    F = s.position
    sampled = params.temperature != 0
    t0 = _now()
    prop = backend.propose(s.state, anchor, F - 1, DraftDraw.of(params, seed) if sampled else None)
    conf = np.asarray(prop.confidence, dtype=np.float64)
    sched.observe_draft(_now() - t0, conf)
    k = sched.choose(conf, kmax)
    drafts = [int(t) for t in prop.tokens[1:1 + k]]
    rows = [int(anchor)] + drafts
    engine._check_tokens(rows)
    engine._check_room(s, len(rows))
    t0 = _now()                                    # the verify cost: mark to the kept rows' context, all of it
    mark = backend.mark(s.state)
    out = backend.forward(s.state, rows)
    if callable(getattr(backend, "accept_rows", None)):   # decided where the rows are (the CUDA backend's device)
        n, nxt = backend.accept_rows(out.logits, prop, drafts, params, seed, F + 1)
    else:
        q_rows = []
        if sampled and k:                          # the distributions the drafts were drawn from
            draft_logits = backend.to_host(prop.logits)
            q_rows = [probabilities(draft_logits[j], temperature=params.temperature, top_k=params.top_k,
                                    top_p=params.top_p, min_p=params.min_p) for j in range(k)]
        bonus = _bonus(backend, params, seed)
        n, nxt = verify_rows(backend.to_host(out.logits), drafts, q_rows, params, seed, F + 1,
                             lambda row, position: bonus(out.logits[k], position))   # the row where it lives
    kept = rows[:1 + n]
    backend.rollback(s.state, mark, kept)
    backend.append_context(s.state, out.features[:1 + n], np.arange(F, F + 1 + n))
    sched.observe_verify(len(rows), _now() - t0, conf, n)
    s.tokens.extend(kept)
    stats.observe_round(k, n)
    new = drafts[:n] + [int(nxt)]
    for i, t in enumerate(new):
        yield t
        if t == EOS:
            return new[:i + 1]
    return new


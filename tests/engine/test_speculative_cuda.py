"""Speculative decoding on the CUDA backend (issue 13): the device state's exact rollback (ds4lib.engine.cuda_state).

Two tiers, as tests/engine/test_engine_cuda.py:
- `test_micro_*` run under the CUDA simulator in CI on a micro model with a DSpark stage (`spec_micro_config`: window
  8, two backbone layers sharing one ratio-2 compressor and indexer, candidates, an Engram layer, one stage, block 4).
  ds4-tiny is out of reach there: one 5-token ds4-tiny prefill did not finish in 4 minutes under the simulator,
  and a micro call takes 12-36 s.
- `test_gpu_*` need a real GPU and run on ds4-tiny: the same contracts over more prompt lengths and every kept count.
"""
import numpy as np
import pytest

from ds4lib.engine import Engine, cuda_state
from ds4lib.formats.floats import bf16_bits_to_f32, round_bf16
from tests.engine.test_engine_cuda import TOKENIZER, gpu, micro_config, tiny_or_random  # noqa: F401
from tests.kernels.tolerances import assert_matches

MICRO_PROMPT = [5, 9, 11, 40, 2, 17, 33]
ROLLBACK_ROWS = [20, 21, 22, 23, 24]          # one verify call: the anchor and 4 drafts
NEXT = 30


def spec_micro_config():
    """micro_config with a DSpark stage and a window that holds a whole verify call (1 + block rows)."""
    return micro_config().replace(window_size=8, compress_ratios=(2, 2, 0), kv_source_layers=(0,),
                                  index_source_layers=(0, 1), candidate_source_layer=0, n_mtp_layers=1,
                                  dspark_target_layer_ids=(0, 1), dspark_block_size=4, dspark_markov_rank=32,
                                  dspark_n_routed_experts=4, dspark_n_activated_experts=2)


@pytest.fixture(scope="module")
def spec_micro(tmp_path_factory):
    from ds4lib.quant.base_file import quantize_checkpoint
    from ds4lib.synth import write_random_checkpoint
    root = tmp_path_factory.mktemp("spec_micro")
    ckpt = write_random_checkpoint(root / "ckpt", spec_micro_config(), seed=0)
    quantize_checkpoint(checkpoint=ckpt, out=root / "base.gguf", bits_plan="1", rounds=1, progress=False)
    cpu = Engine(root / "base.gguf", engram_dir=ckpt, tokenizer_path=TOKENIZER)
    cuda = Engine(root / "base.gguf", engram_dir=ckpt, tokenizer_path=TOKENIZER, backend="cuda")
    return cpu, cuda


@pytest.fixture(scope="module")
def spec_micro_prompt(spec_micro):
    """One simulated prefill of MICRO_PROMPT on the CUDA backend (~60 s under the simulator), shared by the rollback and
    draft tests: (the state after it, which tests clone and never feed; its DSpark features on the host; the
    observer's `block_in` of every layer). The observer only copies to the host: the state is the plain forward's."""
    _, cuda = spec_micro
    be = cuda.backend
    st = be.new_state()
    seen = {}
    out = be.forward(st, MICRO_PROMPT, last_only=True,
                     observer=lambda l, name, v: seen.__setitem__(l, v) if name == "block_in" else None)
    return st, be.to_host(out.features).copy(), seen       # the features buffer is reused by the next call


def _assert_live_equal(be, a, b, what):
    A, B = cuda_state.host_arrays(a, be._ratios), cuda_state.host_arrays(b, be._ratios)
    assert A.keys() == B.keys(), what
    for k in A:
        np.testing.assert_array_equal(A[k], B[k], err_msg=f"{what}: {k}")


def _check_rollback(be, prompt, rows, nxt, logits_for, prefilled=None):
    """forward(rows) + rollback(m) leaves the state of feeding only rows[:m] (live content array for array), for
    every m; for m in `logits_for` the next decode step's logits equal those after feeding the kept rows, bit for
    bit. The state of feeding only rows[:m] comes from feeding rows one at a time (== one call, the backend's
    prefill/decode identity). `prefilled`: a state that has been fed `prompt` and nothing else (cloned, never fed
    here), instead of a prefill of its own."""
    s = be.stream
    if prefilled is None:
        prefilled = be.new_state()
        be.forward(prefilled, prompt, last_only=True)
    assert prefilled.pos == len(prompt) and prefilled.log is None
    st = cuda_state.clone(prefilled, s)
    chain = [cuda_state.clone(st, s)]
    chain_logits = []
    ref = cuda_state.clone(st, s)
    # chain[len(rows) + 1] and the logits of nxt after all rows are read only when len(rows) is in logits_for: a
    # simulated decode step less otherwise
    for t in list(rows) + ([nxt] if len(rows) in logits_for else []):
        chain_logits.append(be.to_host(be.forward(ref, [t], last_only=True).logits).copy())
        chain.append(cuda_state.clone(ref, s))
    # chain[m]: after the prompt and rows[:m]; chain_logits[m]: the logits of feeding (rows + [nxt])[m] after it
    mark = be.mark(st)
    be.forward(st, rows)
    for m in range(len(rows) + 1):
        a = cuda_state.clone(st, s)
        be.rollback(a, mark, rows[:m])
        _assert_live_equal(be, a, chain[m], f"prompt {len(prompt)}, kept {m}")
        if m in logits_for:
            t = (list(rows) + [nxt])[m]
            got = be.to_host(be.forward(a, [t], last_only=True).logits)
            np.testing.assert_array_equal(got, chain_logits[m], err_msg=f"prompt {len(prompt)}, kept {m}")
            _assert_live_equal(be, a, chain[m + 1], f"prompt {len(prompt)}, kept {m}, then {t}")


@pytest.mark.slow
def test_micro_rollback_equals_feeding_only_the_kept_rows(spec_micro, spec_micro_prompt):
    """Prompt of 7 tokens, a 5-row verify call at positions 7..11: the ratio-2 compressor has a pending row at the
    mark and completes groups at 8 and 10, the ring (W = 8) wraps, and the slots of rejected rows held rows that the
    next query still reads. Every kept count 0..5; the next logits for 2 kept (a simulated forward costs ~30 s of
    CI: the GPU tier checks the next logits of every kept count). The prompt's prefill is the module's shared one."""
    _, cuda = spec_micro
    _check_rollback(cuda.backend, MICRO_PROMPT, ROLLBACK_ROWS, NEXT, logits_for=(2,),
                    prefilled=spec_micro_prompt[0])


def test_micro_rollback_refuses_misuse(spec_micro):
    _, cuda = spec_micro
    be = cuda.backend
    st = be.new_state()
    with pytest.raises(ValueError, match="without a mark"):
        be.rollback(st, cuda_state.CudaMark(0, None, 5), [])
    mark = be.mark(st)
    be.rollback(st, mark, [])                            # nothing fed: nothing to undo
    assert st.pos == 0 and st.log is None
    with pytest.raises(ValueError, match="without a mark"):
        be.rollback(st, mark, [])
    mark = be.mark(st)
    with pytest.raises(ValueError, match="keeps 1 rows but 0"):
        be.rollback(st, mark, [3])


def _check_draft(cpu, cuda, prompt, anchor, with_pick, prefilled=None):
    """The CUDA forward's DSpark features against its own states entering the target layers (exact: the backbone's
    CUDA-vs-CPU drift is test_engine_cuda's subject, and ds4-tiny's forward is chaotic); then context rings and
    proposals of the CUDA backend against the CPU backend's on the same context (both appended from the CPU's
    features): ring rows within TOL["dspark_draft"] and proposals within it (TOL["dspark_draft_trained"] on ds4-tiny's
    weights), greedy drafts equal wherever the CPU's top-1 leads its runner-up
    clearly and the previous drafts agree. Returns the number of draft positions compared. `prefilled`: (state fed
    `prompt` only, its features on the host, the observer's block_in per layer), as spec_micro_prompt gives, instead
    of a prefill of its own; the state is cloned, never changed."""
    cb, gb = cpu.backend, cuda.backend
    cfg = cpu.cfg
    n = len(prompt)
    tol_op = "dspark_draft_trained" if cfg.vocab_size >= 8192 else "dspark_draft"      # ds4-tiny: tolerances.py
    cs = cb.new_state()
    out_c = cb.forward(cs, prompt)
    if prefilled is None:
        gs = gb.new_state()
        seen = {}
        out_g = gb.forward(gs, prompt, last_only=True,
                           observer=lambda l, name, v: seen.__setitem__(l, v) if name == "block_in" else None)
        feats = gb.to_host(out_g.features)
    else:
        st0, feats, seen = prefilled
        assert st0.pos == n and st0.log is None
        gs = cuda_state.clone(st0, gb.stream)
    want = np.concatenate([round_bf16(seen[l].mean(axis=1, dtype=np.float32))
                           for l in sorted(cfg.dspark_target_layer_ids)], axis=1)
    assert_matches("dspark_features", feats, want)
    cb.append_context(cs, out_c.features, np.arange(n))
    gb.draft.append_context(gs, out_c.features, np.arange(n))
    W = cfg.window_size
    order = np.argsort(gs.dring_host[gs.dring_host >= 0])
    for i, l in enumerate(gb.draft.stages):
        np.testing.assert_array_equal(np.sort(gs.dring_host[gs.dring_host >= 0]), cs.win_pos[l])
        rows = bf16_bits_to_f32(gs.dwin_all.copy_to_host()[i, :W][gs.dring_host >= 0][order])
        assert_matches("dspark_draft", rows, cs.win_kv[l])
    before = cuda_state.host_arrays(gs, gb._ratios)
    pc = cb.propose(cs, anchor, n - 1)
    pg = gb.draft.propose(gs, anchor, n - 1)
    after = cuda_state.host_arrays(gs, gb._ratios)
    for k in before:                                           # the rings are read, not written
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)
    assert_matches(tol_op, gb.to_host(pg.base_logits), pc.base_logits)
    B = cfg.dspark_block_size
    same = 1
    while same <= B and pg.tokens[same - 1] == pc.tokens[same - 1]:
        same += 1                                              # rows 0 .. same - 2 saw the same previous token
    rows = same - 1
    assert_matches(tol_op, gb.to_host(pg.logits)[:rows], pc.logits[:rows])
    assert_matches(tol_op, pg.confidence[:rows], pc.confidence[:rows])
    compared = 0
    for i in range(rows):
        top2 = np.sort(pc.logits[i])[-2:]
        if top2[1] - top2[0] >= 1e-3 * np.abs(pc.logits[i]).max():
            assert pg.tokens[i + 1] == pc.tokens[i + 1], f"draft {i}: CUDA {pg.tokens[i + 1]}, CPU {pc.tokens[i + 1]}"
            compared += 1
    if with_pick:                                              # the host-pick path (sampled drafts) with argmax
        seen = []
        pp = gb.draft.propose(gs, anchor, n - 1, pick=lambda row: seen.append(row) or int(np.argmax(row)))
        np.testing.assert_array_equal(pp.tokens, pg.tokens)
        assert len(seen) == B
        np.testing.assert_array_equal(np.stack(seen), gb.to_host(pg.logits))
        # sampled drafts drawn by the device sampler: each the reference sampler's token of the same draft row
        from ds4lib.engine.speculative import DraftDraw
        from ds4lib.ref.sampling import sample as ref_sample
        draw = DraftDraw(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0, seed=5)
        ps = gb.draft.propose(gs, anchor, n - 1, pick=draw)
        rows = gb.to_host(ps.logits)
        for i in range(B):
            assert ps.tokens[i + 1] == ref_sample(rows[i], temperature=1.0, top_p=0.9, seed=5,
                                                  step=draw.step(n + 1 + i)), f"sampled draft {i}"
        np.testing.assert_array_equal(gb.to_host(ps.base_logits), gb.to_host(pg.base_logits))
    return compared


@pytest.mark.slow
def test_micro_draft_matches_cpu(spec_micro, spec_micro_prompt):
    """The stage weights uploaded from the base file (VQ-12 experts), the DSpark features of the forward, the context
    rows, and the proposal (head, Markov bias, confidence, greedy drafts and the host-pick path). The prompt's
    prefill is the module's shared one."""
    cpu, cuda = spec_micro
    assert cuda.base.bits[cuda.cfg.n_layers] == 12
    assert _check_draft(cpu, cuda, MICRO_PROMPT, 21, with_pick=True, prefilled=spec_micro_prompt) >= 1


# --------------------------------------------------------------------------------------------- real GPU only
@pytest.fixture(scope="module")
def tiny_pair(gpu, request):  # noqa: F811
    """(CPU engine, CUDA engine) of ds4-tiny when present, else of the random tiny stack (as test_engine_cuda)."""
    base, ckpt = tiny_or_random(request)
    return (Engine(base, engram_dir=ckpt, tokenizer_path=TOKENIZER),
            Engine(base, engram_dir=ckpt, tokenizer_path=TOKENIZER, backend="cuda"))


@pytest.fixture(scope="module")
def tiny_cuda(tiny_pair):
    return tiny_pair[1]


TEXTS = ("The capital of France is Paris. The capital of Germany is",
         "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
         "In 1905, Albert Einstein published four papers that")


def _prompt(e, i):
    """Prompt i: TEXTS[i] encoded (ds4-tiny), or random ids of the random tiny stack's vocabulary."""
    if e.cfg.vocab_size >= 8192:
        return [0] + e.encode(TEXTS[i])
    return [0] + [int(t) for t in np.random.default_rng(i).integers(9, e.cfg.vocab_size - 1, 14)]


@pytest.mark.cuda
@pytest.mark.parametrize("length", [5, 18, 23, 64, 127])
def test_gpu_rollback_equals_feeding_only_the_kept_rows(tiny_cuda, length):
    """ds4-tiny (W = 64, a ratio-2 and a ratio-1 compressor, Engram): prompts shorter and longer than the window, odd
    and even, every kept count of a 5-row call, the next logits for every kept count."""
    rng = np.random.default_rng(length)
    V = tiny_cuda.cfg.vocab_size - 1
    prompt = [0] + [int(t) for t in rng.integers(9, V, length - 1)]
    rows = [int(t) for t in rng.integers(9, V, 5)]
    _check_rollback(tiny_cuda.backend, prompt, rows, 77, logits_for=range(6))


@pytest.mark.cuda
def test_gpu_draft_matches_cpu(tiny_pair):
    """ds4-tiny (or the random tiny stack): features, rings and proposals against the CPU backend on three prompts
    (judging-slice texts on ds4-tiny); greedy drafts equal where the CPU's margins are clear."""
    cpu, cuda = tiny_pair
    compared = 0
    for i, n in enumerate((40, 70, 130)):
        if cuda.cfg.vocab_size >= 8192:
            from ds4lib.corpus.slices import load_slice
            toks = [0] + [int(t) for t in load_slice(f"{('english', 'code', 'law')[i]}/judge").tokens[0][:n]]
        else:
            toks = [0] + [int(t) for t in np.random.default_rng(i).integers(9, cuda.cfg.vocab_size - 1, n)]
        compared += _check_draft(cpu, cuda, toks[:-1], toks[-1], with_pick=(i == 0))
    assert compared >= 3


# ------------------------------------------------------------------------------------ generation through the engine
def _forced(engine, monkeypatch, ids, plain, wrong):
    """engine.backend.propose returning the target's own greedy tokens, with a wrong one at draft position `wrong`
    (or none): every number of kept rows is reached on purpose."""
    real = engine.backend.propose
    B = engine.cfg.dspark_block_size

    def propose(state, anchor, start_pos, pick=None):
        prop = real(state, anchor, start_pos, pick)
        P = start_pos + 1 - len(ids)                 # generated tokens before the anchor
        want = (list(plain) + [1] * (B + 2))[P + 1:P + 1 + B]
        prop.tokens[1:] = want
        if wrong is not None:
            prop.tokens[1 + wrong] = (want[wrong] + 1) % engine.cfg.vocab_size
        return prop
    monkeypatch.setattr(engine.backend, "propose", propose)


@pytest.mark.cuda
def test_micro_greedy_speculative_equals_plain(gpu, spec_micro, monkeypatch):  # noqa: F811
    """Through Engine.generate_ids on the micro model: a round of 4 verified rows (the stages' real proposal with its
    drafts forced to plain greedy's, the third wrong) keeps 3 (rollback, the correction token), then a plain step with
    its context row: plain greedy's tokens. (Real drafts for k = 1, 2, 4 and the scheduler on three prompts:
    test_gpu_greedy_*.) GPU tier only: under the simulator it took 268 s of CI's 30 minutes; CI keeps the pieces it
    composes (rollback and drafts above, the engine's speculative loop on the CPU backend)."""
    from ds4lib.engine import SamplingParams
    _, cuda = spec_micro
    assert cuda.speculative
    ids = [0, 5, 9, 11, 40]
    plain = list(cuda.generate_ids(ids, SamplingParams(temperature=0, max_tokens=5, draft_k=0)))
    _forced(cuda, monkeypatch, ids, plain, wrong=2)
    got = list(cuda.generate_ids(ids, SamplingParams(temperature=0, max_tokens=5, draft_k=4)))
    st = cuda.last_spec_stats
    assert got == plain and st.rounds == 1 and st.accepted_at[:3] == [1, 1, 0] and st.plain_steps == 1
    monkeypatch.undo()


@pytest.mark.cuda
@pytest.mark.parametrize("i", range(3))
def test_gpu_greedy_is_byte_identical_to_plain_for_every_k(tiny_cuda, i):
    from ds4lib.engine import SamplingParams
    e = tiny_cuda
    assert e.speculative
    ids = _prompt(e, i)
    plain = list(e.generate_ids(ids, SamplingParams(temperature=0, max_tokens=40, draft_k=0)))
    for k in (1, 2, 4, None):
        got = list(e.generate_ids(ids, SamplingParams(temperature=0, max_tokens=40, draft_k=k)))
        assert got == plain, f"k={k}"
        if k is not None:                          # the scheduler (k None) may measure that plain steps win
            assert e.last_spec_stats.rounds > 0, f"k={k}"
    if e.cfg.vocab_size >= 8192:                   # trained drafts (the random stack's are rarely right)
        assert e.spec_stats.accepted > 0


@pytest.mark.cuda
def test_gpu_forced_drafts_right_or_wrong_at_every_position(tiny_cuda, monkeypatch):
    from ds4lib.engine import SamplingParams
    e = tiny_cuda
    ids = _prompt(e, 0)
    plain = list(e.generate_ids(ids, SamplingParams(temperature=0, max_tokens=16, draft_k=0)))
    B = e.cfg.dspark_block_size
    for wrong in list(range(B)) + [None]:
        _forced(e, monkeypatch, ids, plain, wrong)
        got = list(e.generate_ids(ids, SamplingParams(temperature=0, max_tokens=16, draft_k=B)))
        monkeypatch.undo()
        assert got == plain, f"wrong at {wrong}"
        acc = e.last_spec_stats.accepted_at
        if wrong is not None:
            assert acc[wrong] == 0 and all(acc[j] > 0 for j in range(wrong))


@pytest.mark.cuda
def test_gpu_sampled_speculative_runs_and_keeps_plain_first_token(tiny_cuda):
    """Sampled speculative decoding on the device (drafts picked on the host from the draft distribution, acceptance
    and residual by speculative.verify_rows on host copies of the target rows, the bonus by the device sampler):
    reproducible for a seed and k, its first token plain decoding's own, and drafts accepted."""
    from ds4lib.engine import SamplingParams
    e = tiny_cuda
    ids = _prompt(e, 2)
    acc = 0
    for seed in range(6):
        p = dict(temperature=1.0, top_k=8, max_tokens=12, seed=seed)
        a = list(e.generate_ids(ids, SamplingParams(draft_k=2, **p)))
        acc += e.last_spec_stats.accepted
        assert a == list(e.generate_ids(ids, SamplingParams(draft_k=2, **p)))
        assert a[0] == list(e.generate_ids(ids, SamplingParams(draft_k=0, **p)))[0]
    assert acc > 0 or e.cfg.vocab_size < 8192


@pytest.mark.cuda
def test_gpu_verify_calls_and_proposals_replay_their_graphs_bit_for_bit(tiny_cuda):
    """A speculative round's two device calls replayed from captured graphs: a marked verify call of T = 1 .. B + 1
    rows (bounded compressor rows, bucketed views) gives the eager launches' logits and features bit for bit, and the
    logits of an unmarked call of the same rows; a greedy and a sampled proposal (whole, the drafts drawn by the device
    sampler) and one with a host pick (its stages and base logits) give the eager drafts, confidences and draft
    logits; a rollback keeping any number of rows, and a context append, leave the state of the eager path. Each graph
    is captured once and then replayed."""
    from ds4lib.engine.cuda_state import clone
    be = tiny_cuda.backend
    assert be.graphs, "CUDA graphs are not available on this machine"
    cfg, s, B = tiny_cuda.cfg, be.stream, tiny_cuda.cfg.dspark_block_size
    prompt = _prompt(tiny_cuda, 1)
    base = be.new_state()
    out = be.forward(base, prompt, last_only=True)
    be.append_context(base, out.features, np.arange(len(prompt)))
    rng = np.random.default_rng(7)
    replays0 = dict(be.stats)
    try:
        for T in range(1, B + 2):
            rows = [int(t) for t in rng.integers(9, cfg.vocab_size - 1, T)]
            be.graphs = False
            st = clone(base, s)
            mk = be.mark(st)
            got = be.forward(st, rows)
            want_lg, want_ft = be.to_host(got.logits).copy(), be.to_host(got.features).copy()
            be.rollback(st, mk, rows[:0])
            be.graphs = True
            st = clone(base, s)
            for keep in range(T + 1):
                kept = clone(base, s)                  # the state of feeding only the kept rows (an unmarked call)
                if keep:
                    be.forward(kept, rows[:keep])
                for rep in range(2):                   # capture (lazy mark, verify, rollback), then replays
                    cuda_state.copy_into(st, base, s)  # in place: the state's graphs stay
                    mk = be.mark(st)
                    got = be.forward(st, rows)
                    what = f"T={T} keep {keep} rep {rep}"
                    np.testing.assert_array_equal(be.to_host(got.logits), want_lg, err_msg=what)
                    np.testing.assert_array_equal(be.to_host(got.features), want_ft, err_msg=what)
                    be.rollback(st, mk, rows[:keep])
                    _assert_live_equal(be, st, kept, what)
            plain = clone(base, s)
            np.testing.assert_array_equal(be.to_host(be.forward(plain, rows).logits), want_lg, err_msg=f"T={T} chunk")
        grew = {k: be.stats[k] - replays0[k] for k in ("verify_graph_replays", "rollback_graph_replays")}
        assert grew["verify_graph_replays"] >= sum(2 * T + 1 for T in range(1, B + 2)), grew
        assert grew["rollback_graph_replays"] >= sum(T for T in range(1, B + 2)), grew

        def pick(row):                                 # a deterministic host draw: the second-best token
            return int(np.argsort(row, kind="stable")[-2])
        from ds4lib.engine.speculative import DraftDraw
        for draw in (None, pick, DraftDraw(temperature=0.8, top_k=40, top_p=0.95, min_p=0.0, seed=3)):
            want = []
            for mode in (False, True, True, True):
                be.graphs = mode
                st = clone(base, s) if mode is False or not want[1:] else st
                prop = be.propose(st, 77, len(prompt) - 1, draw)
                want.append((prop.tokens.copy(), np.asarray(prop.confidence).copy(), be.to_host(prop.logits).copy()))
            for i, (tok, conf, lg) in enumerate(want[1:]):
                np.testing.assert_array_equal(tok, want[0][0], err_msg=f"{draw} rep {i}")
                np.testing.assert_array_equal(conf, want[0][1], err_msg=f"{draw} rep {i}")
                np.testing.assert_array_equal(lg, want[0][2], err_msg=f"{draw} rep {i}")
        assert be.stats["draft_graph_replays"] - replays0["draft_graph_replays"] >= 6
        # context rows of a round's kept rows (T <= B + 1) replay their graphs; the rings equal an eager append's
        feats = be.to_host(be.forward(clone(base, s), [5] * (B + 1)).features).copy()
        P = np.arange(len(prompt), len(prompt) + B + 1)
        for T in (1, B + 1):
            be.graphs = False
            want_st = clone(base, s)
            be.append_context(want_st, feats[:T], P[:T])
            be.graphs = True
            st = clone(base, s)
            for rep in range(2):
                cuda_state.copy_into(st, base, s)
                be.append_context(st, feats[:T], P[:T])
                _assert_live_equal(be, st, want_st, f"context rows T={T} rep {rep}")
        assert be.stats["ctx_graph_replays"] - replays0["ctx_graph_replays"] >= 2
    finally:
        be.graphs = True


@pytest.mark.cuda
def test_gpu_device_acceptance_gives_the_host_rounds_tokens(tiny_cuda, monkeypatch):
    """The rounds decided on the device (CudaBackend.accept_rows, kernels.spec_accept) give the tokens of the host's
    verify_rows over copies of the same rows: greedy and sampled (with truncation), several seeds, k = 2 and 4."""
    from ds4lib.engine import SamplingParams
    e = tiny_cuda
    ids = _prompt(e, 0)
    runs = []
    for device in (True, False):
        if not device:
            monkeypatch.setattr(type(e.backend), "accept_rows", None)     # speculative._round's host path
        got = []
        for seed in range(4):
            for p in (dict(temperature=0.0), dict(temperature=1.0, top_k=40, top_p=0.9)):
                params = SamplingParams(max_tokens=24, seed=seed, draft_k=2 + 2 * (seed % 2), **p)
                got.append(list(e.generate_ids(ids, params)))
        runs.append(got)
        if device:
            assert e.backend.stats["accept_graph_replays"] > 0
    monkeypatch.undo()
    assert runs[0] == runs[1]

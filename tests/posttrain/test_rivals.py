"""The rival pass of the ③ solve (ds4lib.posttrain.rivals) on the micro stack: the whole-vocabulary prediction agrees
with the rows' own prediction for every captured pair, and the pairs it adds are the tokens outside a position's rows
that come within the margin, nearest first, each once."""
import numpy as np
import pytest

from ds4lib.engine import Engine
from ds4lib.formats.names import HEAD, NORM
from ds4lib.posttrain.capture import _global, capture_positions, pair_coefficients, rows_from_capture
from ds4lib.posttrain.rivals import logit_change, rival_pairs
from ds4lib.solvers.margins import make_problem, predict
from tests.engine.test_engine_cuda import TOKENIZER
from tests.sidecar.test_solve import micro_config

CFG = micro_config()
E, D, V = CFG.n_routed_experts, CFG.dim, CFG.vocab_size
_rng = np.random.default_rng(5)
PROMPT = _rng.integers(9, 60, 16)
GEN = _rng.integers(2, V, 12)
P, G = len(PROMPT), len(GEN)


@pytest.fixture(scope="module")
def rows(micro_stack):
    eng = Engine(micro_stack["base"], zchain=micro_stack["sc"], engram_dir=micro_stack["ckpt"],
                 tokenizer_path=TOKENIZER)
    cap = capture_positions(eng, PROMPT, GEN)
    head, gamma = _global(eng, HEAD), _global(eng, NORM)
    pts = [(P + 2, int(np.argsort(-cap.logits[2], kind="stable")[1]))]
    prob, meta = rows_from_capture(cap, pts, head=head, norm_weight=gamma, norm_eps=CFG.norm_eps, cfg=CFG,
                                   rivals=3)
    return cap, prob, meta, head, gamma


@pytest.mark.parametrize("norm", ["linear", "fixed"])
def test_logit_change_agrees_with_the_rows(rows, norm):
    """Δℓ_a − Δℓ_b of the whole-vocabulary prediction is the row's A·δ for every captured pair and any pair."""
    cap, _, meta, head, gamma = rows
    delta = np.random.default_rng(0).uniform(-0.3, 0.3, (E, D))
    R, m, _, _, _ = pair_coefficients(cap, meta.row, meta.a, meta.b, head=head, norm_weight=gamma,
                                      norm_eps=CFG.norm_eps, norm=norm)
    prob = make_problem(ids=cap.ids[meta.row], R=R, m=m, kind=meta.kind, n_experts=E, group=meta.group)
    dl = logit_change(cap, meta.row, delta, head=head, norm_weight=gamma, norm=norm)       # [N, V]
    n = np.arange(len(meta.row))
    np.testing.assert_allclose(dl[n, meta.a] - dl[n, meta.b], predict(prob, delta) - prob.m, rtol=1e-9, atol=1e-9)
    b = np.random.default_rng(1).integers(0, V, len(n))                                    # any other token
    R2, m2, _, _, _ = pair_coefficients(cap, meta.row, meta.a, b, head=head, norm_weight=gamma,
                                        norm_eps=CFG.norm_eps, norm=norm)
    np.testing.assert_allclose(np.einsum("nkd,nkd->n", R2, delta[cap.ids[meta.row]]), dl[n, meta.a] - dl[n, b],
                               rtol=1e-9, atol=1e-9)


def test_rival_pairs_adds_the_near_tokens_outside_the_rows_once(rows):
    cap, prob, meta, head, gamma = rows
    delta = np.random.default_rng(2).uniform(-0.5, 0.5, (E, D))
    first = np.r_[True, meta.group[1:] != meta.group[:-1]]
    after = cap.logits[meta.row[first]] + logit_change(cap, meta.row[first], delta, head=head, norm_weight=gamma)
    a = meta.a[first]
    margin = float(np.median(after[np.arange(len(a)), a][:, None] - after))          # about half of the vocabulary
    taken = {}
    row, aa, b, kind, grp = rival_pairs(cap, meta, taken, delta, head=head, norm_weight=gamma, margin=margin,
                                        limit=5)
    assert len(b) and set(taken) == set(range(int(meta.group.max()) + 1))
    for k in range(int(meta.group.max()) + 1):
        mine = grp == k
        rivals = set(meta.b[meta.group == k].tolist())
        x = after[k, a[k]] - after[k]                                                      # [V] predicted ℓ_a − ℓ_t
        want = [t for t in np.argsort(x, kind="stable") if x[t] < margin and t != a[k] and t not in rivals][:5]
        assert b[mine].tolist() == want
        assert (row[mine] == meta.row[first][k]).all() and (aa[mine] == a[k]).all()
        assert (kind[mine] == meta.kind[first][k]).all()
        assert taken[k] == rivals | set(want)
    again = rival_pairs(cap, meta, taken, delta, head=head, norm_weight=gamma, margin=margin, limit=5)
    assert not set(zip(again[4].tolist(), again[2].tolist())) & set(zip(grp.tolist(), b.tolist()))   # each once
    none = rival_pairs(cap, meta, {}, delta, head=head, norm_weight=gamma, margin=-1e9)
    assert all(len(x) == 0 for x in none)

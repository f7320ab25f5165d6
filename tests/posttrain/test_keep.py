""""Keep top-1" rows of ordinary text (ds4lib.posttrain.keep, capture.capture_text) on the micro stack: the text's
prefill observes the same rows as the deployment path's prefill + decode, and the rows are top-1 against rivals."""
import numpy as np
import pytest

from ds4lib.engine import Engine
from ds4lib.posttrain import (capture_positions, capture_text, format_report, keep_rows, keep_slices,
                             solve_posttrain)
from ds4lib.posttrain.keep import _plan
from tests.engine.test_engine_cuda import TOKENIZER
from tests.posttrain.test_posttrain_cli import MICRO, MIN_KEPT, _write_jsonl, cases, stack  # noqa: F401  (fixtures)
from tests.sidecar.test_solve import micro_config

CFG = micro_config()
V = CFG.vocab_size
_rng = np.random.default_rng(21)
WINDOWS = _rng.integers(2, V, (3, 40))          # three "windows" of ordinary text (no BOS)


@pytest.fixture(scope="module")
def factory(micro_stack):
    def make(**kw):
        return Engine(micro_stack["base"], zchain=micro_stack["sc"], engram_dir=micro_stack["ckpt"],
                      tokenizer_path=TOKENIZER, **kw)
    return make


def test_capture_text_is_the_deployment_paths_rows_in_one_prefill(factory):
    """On the CPU backend one prefill of BOS + text observes, row for row, what prefill + decode steps observe, and
    a prefill cut in blocks of 7 accumulates the same rows."""
    eng = factory()
    seq = np.r_[0, WINDOWS[0]]
    text = capture_text(eng, seq)
    steps = capture_positions(eng, seq[:1], seq[1:])
    assert (text.path == "prefill").all() and len(text.positions) == len(seq) - 1
    np.testing.assert_array_equal(text.positions, steps.positions)
    np.testing.assert_array_equal(text.logits, eng.logits(seq[:-1]))
    for name in ("logits", "ids", "weights", "ye", "z", "pre", "post", "alpha", "inv"):
        np.testing.assert_array_equal(getattr(text, name), getattr(steps, name), err_msg=name)
    blocks = capture_text(factory(prefill_block=7), seq)
    for name in ("logits", "ids", "ye", "z", "inv"):
        np.testing.assert_array_equal(getattr(blocks, name), getattr(text, name), err_msg=name)
    with pytest.raises(ValueError, match="at least 2"):
        capture_text(eng, seq[:1])


def test_keep_rows_are_each_positions_top1_against_its_rivals(factory):
    eng = factory()
    kr = keep_rows(eng, positions=10, windows={"a": WINDOWS[:2], "b": WINDOWS[2:]}, rivals=3, per_window=4)
    p = kr.problem
    assert kr.positions == 10 and len(p.m) == 30 and not p.kind.any()
    assert kr.slices == ["a", "b"] and [w for _, w in kr.windows] == [0, 1, 0]      # 5 + 5 positions: 2 + 1 windows
    np.testing.assert_array_equal(p.group, np.repeat(np.arange(10), 3))
    assert (p.m >= 0).all()
    # the first window's rows: its top-1 against the 3 strongest others, at the planned positions
    cap = capture_text(eng, np.r_[0, WINDOWS[0]])
    pos = _plan(2, WINDOWS.shape[1], 5, 4)[0][1]
    lg = cap.logits[pos - 1].astype(np.float64)
    top = np.sort(lg, axis=1)[:, ::-1]
    want = (top[:, :1] - top[:, 1:4]).ravel()
    np.testing.assert_allclose(p.m[:len(want)], want, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="positions must be"):
        keep_rows(eng, positions=0, windows={"a": WINDOWS})
    assert keep_slices(eng) == ["english/fit"]      # the micro sidecar's manifest names no fit slice
    with pytest.raises(ValueError, match="outside the vocabulary"):       # english/fit's tokens: vocabulary 8,192
        keep_rows(eng, positions=4)


def test_plan_spreads_positions_over_windows():
    plan = _plan(24, 512, 512, 64)
    assert [w for w, _ in plan] == [0, 3, 7, 10, 13, 16, 20, 23]
    assert sum(len(p) for _, p in plan) == 512
    assert all(len(p) == 64 and p.min() >= 1 and p.max() <= 512 and len(np.unique(p)) == 64 for _, p in plan)
    small = _plan(3, 10, 50, 64)                    # more positions than a window has: every position, once
    assert [w for w, _ in small] == [0] and list(small[0][1]) == list(range(1, 11))


def test_solve_posttrain_adds_ordinary_rows_and_gates_on_the_days_own(stack, cases, tmp_path):  # noqa: F811
    """Ordinary positions join the solve as constraint groups after the day's; the gates and the day's counts are
    the day's own positions, the ordinary ones are reported beside them."""
    reqs = _write_jsonl(tmp_path / "r.jsonl", cases[0])
    kw = dict(base=stack["base"], zchain=stack["sc"], requests=reqs, engram_dir=stack["ckpt"], min_kept=MIN_KEPT,
              rounds=2, verify=False, **MICRO)
    alone = solve_posttrain(out=tmp_path / "a", keep_positions=0, **kw)
    rep = solve_posttrain(out=tmp_path / "b", keep_positions=12, keep_slices={"text": WINDOWS}, keep_rivals=2,
                          keep_rho=1.0, **kw)
    rows = solve_posttrain(out=tmp_path / "c", keep_positions=12, keep_slices={"text": WINDOWS}, keep_rivals=2,
                           keep_as_rows=True, **kw)
    for r in (rep, rows):
        p = r.predicted
        assert p["ordinary_positions"] == 12 and p["ordinary_rows"] == 24 and 0 <= p["ordinary_kept"] <= 12
        assert p["rows"] == alone.predicted["rows"]                                  # the day's rows
        assert r.decision_points == alone.decision_points and r.constraint_rows == alone.constraint_rows
        assert len(r.margins["predicted"]) == len(alone.margins["predicted"])        # the day's rows only
        assert r.params["keep_slices"] == ["text"] and r.params["keep_positions"] == 12
        assert r.fingerprint != alone.fingerprint                                    # the ordinary rows moved δ
    assert alone.predicted["ordinary_positions"] == 0
    assert not rep.params["keep_as_rows"] and rows.params["keep_as_rows"]
    assert "weighing the ridge" in format_report(rep) and "as rows" in format_report(rows)
    with pytest.raises(ValueError, match="ordinary text: .*outside the vocabulary"):
        solve_posttrain(out=tmp_path / "d", keep_positions=4, **kw)

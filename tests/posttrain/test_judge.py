"""The judging-slice gate (ds4lib.posttrain.judge) on the micro stack: Same top-1 of ② + ③ against ② alone, the ②
numbers cached, and a candidate that fails it goes to rejected/ with the figures in its report."""
import json

import numpy as np
import pytest

import ds4lib.posttrain.judge as judge_mod
from ds4lib.engine import Engine
from ds4lib.formats.sidecar import read_sidecar, write_sidecar
from ds4lib.posttrain.judge import judge_candidate
from tests.posttrain.test_posttrain_cli import MIN_KEPT, _run, _write_jsonl, cases, stack  # noqa: F401  (fixtures)

_rng = np.random.default_rng(31)


def _opener(stack):
    def open_engine(posttrain=None):
        return Engine(stack["base"], zchain=stack["sc"], posttrain=posttrain, engram_dir=stack["ckpt"])
    return open_engine


def _posttrain(stack, path, delta):
    cfg = stack["cfg"]
    return write_sidecar(path, cfg, kind="posttrain", gain_deltas={cfg.n_layers - 1: delta},
                         base=read_sidecar(stack["sc"], cfg))


def test_judge_candidate_measures_same_top1_against_the_sidecar_alone(stack, tmp_path, monkeypatch):  # noqa: F811
    cfg = stack["cfg"]
    E, D, V = cfg.n_routed_experts, cfg.dim, cfg.vocab_size
    texts = {"t": _rng.integers(2, V, (2, 24))}
    kw = dict(open_engine=_opener(stack), slices=texts, cache_dir=tmp_path / "cache", base_key="k", max_drop=0.0)
    zero = judge_candidate(candidate=_posttrain(stack, tmp_path / "zero", np.zeros((E, D))), **kw)
    j = zero["slices"]["t"]
    assert zero["passed"] and j["drop_pp"] == 0.0 and j["base"] == j["candidate"] and j["base"]["n"] == 48
    assert (tmp_path / "cache" / "posttrain_judge" / "k-t-wall-cpu.json").is_file()
    calls = []
    real = judge_mod._evaluate
    monkeypatch.setattr(judge_mod, "_evaluate", lambda *a: calls.append(a[0]) or real(*a))
    big = judge_candidate(candidate=_posttrain(stack, tmp_path / "big", _rng.choice([-0.9, 5.0], (E, D))), **kw)
    assert len(calls) == 1 and calls[0].posttrain is not None         # ② alone read back from the cache
    b = big["slices"]["t"]
    assert b["base"] == j["base"] and b["candidate"] != j["candidate"]
    assert b["drop_pp"] == pytest.approx(100 * (b["base"]["same_top1"] - b["candidate"]["same_top1"]))
    assert big["passed"] == (b["drop_pp"] <= 0) and big["passed"] == (not big["reasons"])


def test_a_candidate_failing_the_judging_gate_goes_to_rejected(stack, cases, tmp_path, monkeypatch):  # noqa: F811
    """The solve's wiring: the gate runs on the verified candidate before installing; its numbers are in the report."""
    seen = []

    def fake(engine, teacher, tokens, windows):
        seen.append(engine.posttrain is not None)
        return {"same_top1": 0.5 - 0.01 * (engine.posttrain is not None), "n": 1}
    monkeypatch.setattr(judge_mod, "_evaluate", fake)
    reqs = _write_jsonl(tmp_path / "r.jsonl", cases[0])
    out = tmp_path / "pt"
    texts = {"j": np.zeros((1, 4), np.int64)}
    rep = _run(stack, out, reqs, judge_slices=texts, max_top1_drop=0.002, cache_dir=tmp_path / "c", min_kept=0.0)
    assert seen == [False, True]
    assert rep.status == "rejected" and not out.exists() and rep.out.parent == tmp_path / "rejected"
    assert rep.judge["slices"]["j"]["drop_pp"] == pytest.approx(1.0) and not rep.judge["passed"]
    assert rep.gate["reasons"] == ["j: Same top-1 49.00% against ② alone 50.00% (-1.00 pp, more than the 0.20 pp "
                                  "allowed)"]
    saved = json.loads((rep.out / "report.json").read_text())
    assert saved["judge"]["slices"]["j"]["candidate"]["same_top1"] == pytest.approx(0.49)
    ok = _run(stack, tmp_path / "pt2", reqs, judge_slices=texts, max_top1_drop=0.011, cache_dir=tmp_path / "c",
              min_kept=0.0)
    assert ok.installed and ok.judge["passed"] and seen == [False, True, True]      # ② alone cached

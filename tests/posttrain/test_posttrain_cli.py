"""`ds4 posttrain` (ds4lib.posttrain.solve, ds4lib.tools.posttrain) on the capture tests' micro stack: a random ②
sidecar on the micro base, requests built so that the right answer leaves the model's greedy output at a known token,
the ③ directory written and loadable with the report's counts and real numbers, the gates (rejected/), the previous
copy kept as .old, where a decision point sits when the model spells the right text with other tokens, refusals, and
the CLI's exit codes."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ds4lib.chat import encode_chat
from ds4lib.engine import Engine, SamplingParams
from ds4lib.formats.sidecar import directory_fingerprint, read_sidecar, write_sidecar
from ds4lib.posttrain.solve import RIVAL_PASSES, NoDecisionPoints, PosttrainError, read_requests, solve_posttrain
from ds4lib.tools.cli import main as ds4_main
from tests.engine.test_engine_cuda import TOKENIZER
from tests.sidecar.test_solve import micro_config

CFG = micro_config()
E, D, L, V = CFG.n_routed_experts, CFG.dim, CFG.n_layers, CFG.vocab_size
# short prompts whose characters are single tokens inside the micro model's 64-token vocabulary
PROMPTS = ["V5JP", "O9R2", "GLR,", ".L?:", "UHA=", "E:S:", "W8Q.", "8F2C", "VDWS", "K.0E", "BVI1", "GK;P", "2*3=",
           "W,V", "7;8", "1+1?", "QB=W", "N?J6"]
SPLIT = 2                      # the right answer leaves the greedy output at this index of the generated part
N_WRONG = 5
MIN_KEPT = 0.8                 # the micro stack keeps 13 of its 15 other positions in a real forward (predicted 14)


@pytest.fixture(scope="module")
def stack(micro_stack):
    """The shared micro stack (tests/posttrain/conftest.py) with an engine on ① + ②."""
    return dict(micro_stack, engine=Engine(micro_stack["base"], zchain=micro_stack["sc"],
                                           engram_dir=micro_stack["ckpt"]))


def _ids(eng, prompt, answer):
    """(prompt ids, the right answer's ids) as the solve encodes them: the answer's text tokens, then EOS."""
    user = [{"role": "user", "content": prompt}]
    p = encode_chat(eng.tokenizer, user)
    full = encode_chat(eng.tokenizer, user + [{"role": "assistant", "content": answer}], add_generation_prompt=False)
    assert full[:len(p)] == p
    return p, full[len(p):]


def _greedy(eng, ids, n):
    return list(eng.generate_ids(ids, SamplingParams(temperature=0, max_tokens=n, draft_k=0)))


@pytest.fixture(scope="module")
def cases(stack):
    """Requests built on this stack: N_WRONG whose right answer is the model's greedy prefix of SPLIT tokens and then
    a close alternative (the highest-ranked other token at that position that is one printable character), and one
    the model already answers right. -> (requests, expected {id: (j, right token, written token, (prompt ids,
    generated ids before j))})."""
    eng = stack["engine"]
    reqs, expect, right = [], {}, None
    for prompt in PROMPTS:
        p, _ = _ids(eng, prompt, "x")
        if max(p) >= V:
            continue
        g = _greedy(eng, p, 8)
        head = eng.tokenizer.decode(g[:SPLIT], skip_special_tokens=False)
        if right is None and g[-1] == 1 and 2 <= len(g) <= 6:
            text = eng.tokenizer.decode(g[:-1], skip_special_tokens=False)
            if _ids(eng, prompt, text)[1] == g:
                right = {"id": f"right-{prompt}", "prompt": prompt, "answer": text}
                continue
        if len(reqs) == N_WRONG or len(g) <= SPLIT or 1 in g[:SPLIT + 1]:
            continue
        lg = eng.logits(p + g[:SPLIT])[-1]
        for t in np.argsort(-lg, kind="stable"):
            t = int(t)
            if t == g[SPLIT] or not 9 <= t < V:
                continue
            text = head + eng.tokenizer.decode([t])
            if _ids(eng, prompt, text)[1] == g[:SPLIT] + [t, 1]:
                rid = len(reqs)
                reqs.append({"id": rid, "prompt": prompt, "answer": text})
                expect[rid] = (SPLIT, t, g[SPLIT], (p, g[:SPLIT]))
                break
    assert len(reqs) == N_WRONG and right is not None, "the micro stack gave too few usable prompts"
    return reqs + [right], expect


# the solve parameters the micro cases were built around (5 decision points a few tenths behind, 15 other positions);
# the defaults are chosen on ds4-tiny's request days (BENCHMARKS.md). Without the rival pass the real forward loses a
# kept position the prediction keeps (test (2) needs one); test_the_rival_pass_keeps_it runs the default pass.
MICRO = {"tau": 1.0, "rivals": 4, "lam": 1e-3, "rival_passes": 0}

def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(stack, out, requests, **kw):
    args = dict(base=stack["base"], zchain=stack["sc"], requests=requests, out=out, engram_dir=stack["ckpt"],
                min_kept=MIN_KEPT, keep_positions=0, **MICRO) | kw       # the micro sidecar names no fit slice
    return solve_posttrain(**args)


def _tree(d: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def solved(stack, cases, tmp_path_factory):
    out = tmp_path_factory.mktemp("solved") / "pt"
    reqs = _write_jsonl(out.parent / "requests.jsonl", cases[0])
    return _run(stack, out, reqs), out


# ---------------------------------------------------------------------------------------------------- (1)
def test_end_to_end_writes_a_loadable_posttrain_directory(stack, cases, solved):
    rep, out = solved
    reqs, expect = cases
    print(f"\n[posttrain e2e] decision points {rep.decision_points}, constraint rows {rep.constraint_rows}; predicted "
          f"flipped {rep.predicted['flipped']} kept {rep.predicted['kept']}; real flipped {rep.real['flipped']} "
          f"(pair {rep.real['flipped_pair']}) kept {rep.real['kept']} (pair {rep.real['kept_pair']}), corr "
          f"{rep.real['corr_change']:.4f}, answers right {rep.real['answers_right']}/{rep.n_requests}; "
          f"CG {rep.cg_iterations}; solve {rep.solve_seconds:.2f} s")
    for x in rep.requests:
        print("  ", {k: x.get(k) for k in ("id", "divergence", "margin", "predicted_margin", "real_margin", "flipped",
                                           "positions", "kept", "first_wrong_row", "divergence_after")})
    assert rep.status == "installed" and rep.installed and rep.out == out and rep.previous is None
    assert sorted(p.name for p in out.iterdir()) == ["base.fnv", f"gr_L{L - 1:02d}.bin", "manifest.json",
                                                     "report.json"]
    sc = stack["engine"].sidecar
    pt = read_sidecar(out, CFG, expect_kind="posttrain")
    assert pt.base_fnv == sc.fingerprint == rep.base_fnv
    assert (out / "base.fnv").read_text().strip() == sc.fingerprint
    assert list(pt.gains) == [L - 1] and not pt.bias                  # the last backbone layer's gains only
    assert (pt.gains[L - 1] != 1).any() and rep.predicted["channels_changed"] > 0
    eng = Engine(stack["base"], zchain=stack["sc"], posttrain=out, engram_dir=stack["ckpt"])
    assert eng.posttrain.fingerprint == rep.fingerprint == directory_fingerprint(out)
    # report.json is not listed: it changes neither the fingerprint nor what the engine reads
    (out / "stray.txt").write_text("a note")
    assert directory_fingerprint(out) == rep.fingerprint
    (out / "stray.txt").unlink()
    assert json.loads((out / "report.json").read_text()) == json.loads(json.dumps(rep.as_dict()))

    # counts: one decision point per wrong request, at the constructed position and token
    n_wrong = len(expect)
    assert rep.n_requests == len(reqs) and rep.right_before == 1 and rep.decision_points == n_wrong
    rows = {r["id"]: r for r in rep.requests}
    eng = stack["engine"]
    for rid, (j, a, b, (p, g)) in expect.items():
        r = rows[rid]
        assert (r["divergence"], r["right_token"], r["written_token"]) == (j, a, b)
        assert r["position"] == r["prompt_tokens"] + j and r["positions"] == j + 1 and r["margin"] < 0
        assert r["rows"] == r["positions"] * rep.params["rivals"]         # a against each of its strongest rivals
        # the decision row is the one generation computed: the prompt's prefill, then one-token decode steps
        lg = eng.logits(p + g, split=len(p))[-1]
        assert r["margin"] == float(lg[a]) - float(lg[b])
    right = rows[reqs[-1]["id"]]
    assert right["right_before"] and "divergence" not in right and right["positions"] == right["answer_tokens"]
    assert rep.constraint_rows == sum(r["positions"] for r in rep.requests) - n_wrong
    assert rep.predicted["rows"] == sum(r["rows"] for r in rep.requests)
    p = rep.predicted
    assert p["flipped_share"] == p["flipped"] / n_wrong and p["kept_share"] == p["kept"] / rep.constraint_rows
    assert p["reached_tau"] <= p["flipped"] <= n_wrong and p["kept"] <= rep.constraint_rows
    assert p["flipped_share"] >= 0.9 and p["kept_share"] >= 0.9 and rep.gate["passed"]
    assert len(rep.cg_iterations) == len(rep.rounds) >= 1
    assert all(r["method"] == "dense" and r["iterations"] == 0 for r in rep.rounds)   # few rows: the N×N solve
    assert rep.solve_seconds > 0
    # the real numbers: a real flip (a is the new top-1) implies a beats its runner-up; per-request flags add up
    r = rep.real
    assert 0 <= r["flipped"] <= r["flipped_pair"] <= n_wrong
    assert r["flipped"] == sum(bool(rows[i].get("flipped")) for i in expect)
    assert r["flipped_share"] == r["flipped"] / n_wrong
    assert 0 <= r["kept"] <= r["kept_pair"] <= rep.constraint_rows
    assert r["answers_right"] == sum(x["right_after"] for x in rep.requests)
    assert r["kept"] == sum(x["kept"] for x in rep.requests)
    # the re-captured rows and the regeneration agree: the new greedy output leaves the right answer exactly at the
    # first row whose real top-1 is not the right token (the capture is teacher-forced on the same prefix)
    for x in rep.requests:
        if x["first_wrong_row"] is not None:
            assert x["divergence_after"] == x["first_wrong_row"], x
        else:
            assert x["divergence_after"] is None or x["divergence_after"] > x.get("divergence", x["positions"]), x
    assert r["corr_change"] > 0.95          # the linear prediction of the margin changes against the real forward


# ---------------------------------------------------------------------------------------------------- (2)
def test_a_candidate_the_real_forward_fails_is_rejected(stack, cases, solved, tmp_path):
    """The gates hold for the verified numbers too: with min_kept between the real and the predicted kept share the
    candidate passes on the prediction, fails in the real forward, and goes to rejected/ with both."""
    rep0, _ = solved
    real, pred = rep0.real["kept_share"], rep0.predicted["kept_share"]
    assert real < pred, "the micro stack's real forward keeps as many positions as predicted: pick another case"
    out = tmp_path / "pt"
    reqs = _write_jsonl(tmp_path / "requests.jsonl", cases[0])
    rep = _run(stack, out, reqs, min_kept=(real + pred) / 2)
    assert rep.status == "rejected" and not rep.installed and not out.exists() and rep.previous is None
    assert rep.out.parent == tmp_path / "rejected" and (rep.out / "report.json").exists()
    assert rep.gate["reasons"] == [f"real kept share {real:.4f} < min_kept {(real + pred) / 2:g}"]
    assert rep.real is not None and rep.real["kept_share"] == real and rep.predicted["kept_share"] == pred
    assert json.loads((rep.out / "report.json").read_text())["status"] == "rejected"
    assert read_sidecar(rep.out, CFG, expect_kind="posttrain").fingerprint == rep.fingerprint


def test_the_rival_pass_keeps_it(stack, cases, solved, tmp_path):
    """The position the real forward loses without the rival pass is lost to a token outside its rows; the default
    pass adds the tokens the solved δ brings near as rows of their positions, and the real forward keeps every
    position while the flips stay."""
    rep0, _ = solved
    reqs = _write_jsonl(tmp_path / "requests.jsonl", cases[0])
    rep = _run(stack, tmp_path / "pt", reqs, rival_passes=RIVAL_PASSES)
    print(f"\n[rival pass] rows added per pass {rep.predicted['rival_rows']}; real kept {rep0.real['kept']} -> "
          f"{rep.real['kept']}/{rep.constraint_rows}, flipped {rep0.real['flipped']} -> {rep.real['flipped']}")
    assert rep0.real["kept_pair"] == rep0.constraint_rows > rep0.real["kept"]     # every captured pair held
    assert rep.predicted["rival_rows"][0] > 0 and rep.params["rival_passes"] == RIVAL_PASSES
    assert rep.predicted["rows"] == rep0.predicted["rows"]                          # the day's own rows unchanged
    assert rep.real["kept"] == rep.constraint_rows and rep.real["flipped"] >= rep0.real["flipped"]
    assert rep.installed


def test_gate_failure_goes_to_rejected_and_leaves_out_untouched(stack, cases, solved, tmp_path):
    _, installed = solved
    out = tmp_path / "pt"
    shutil.copytree(installed, out)
    before = _tree(out)
    reqs = _write_jsonl(tmp_path / "r.jsonl", cases[0])
    reps = [_run(stack, out, reqs, min_flip=1.01) for _ in range(2)]
    assert _tree(out) == before and not out.with_name("pt.old").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pt", "r.jsonl", "rejected"]
    got = sorted((tmp_path / "rejected").iterdir())
    assert len(got) == 2 and [r.out for r in reps] != [reps[0].out] * 2      # the first is never overwritten
    for rep in reps:
        assert rep.status == "rejected" and not rep.installed and rep.real is None
        assert rep.out.parent == tmp_path / "rejected" and rep.out.name.startswith("pt-")
        assert any("min_flip 1.01" in s for s in rep.gate["reasons"]) and not rep.gate["passed"]
        saved = json.loads((rep.out / "report.json").read_text())
        assert saved["status"] == "rejected" and saved["gate"]["reasons"] == rep.gate["reasons"]
        assert read_sidecar(rep.out, CFG, expect_kind="posttrain").fingerprint == rep.fingerprint
    # with no --out at all, a rejection creates none
    fresh = tmp_path / "new" / "pt"
    rep = _run(stack, fresh, reqs, min_kept=1.01)
    assert rep.status == "rejected" and not fresh.exists() and rep.out.parent == fresh.parent / "rejected"
    assert any("min_kept 1.01" in s for s in rep.gate["reasons"])


# ---------------------------------------------------------------------------------------------------- (3)
def test_rerun_keeps_the_previous_copy_as_old(stack, cases, solved, tmp_path, monkeypatch):
    _, installed = solved
    out = tmp_path / "pt"
    shutil.copytree(installed, out)
    first = _tree(out)
    reqs = _write_jsonl(tmp_path / "r.jsonl", cases[0])
    rep = _run(stack, out, reqs, tau=0.3, verify=False)
    assert rep.installed and rep.previous == tmp_path / "pt.old" and rep.real is None
    assert _tree(tmp_path / "pt.old") == first and _tree(out) != first
    assert directory_fingerprint(out) == rep.fingerprint != directory_fingerprint(tmp_path / "pt.old")
    second = _tree(out)
    # this time request 0 counts as skipped (as a generation cut while spelling the right text otherwise would)
    import ds4lib.posttrain.solve as solve_mod
    real_judge = solve_mod._judge

    def judge(engine, enc, generated, answer):
        v = real_judge(engine, enc, generated, answer)
        if answer == skip_ids and v.a is not None:
            return solve_mod._Verdict(v.j, skip="test: skipped")
        return v
    skip_ids = _ids(stack["engine"], cases[0][0]["prompt"], cases[0][0]["answer"])[1]
    monkeypatch.setattr(solve_mod, "_judge", judge)
    rep = _run(stack, out, reqs, tau=0.4)
    assert _tree(tmp_path / "pt.old") == second           # the copy older than that is gone once this one is in
    row = rep.requests[0]
    assert rep.skipped == 1 and row["status"] == "skipped" and row["rows"] == 0 and row["skip"] == "test: skipped"
    assert rep.decision_points == len(cases[1]) - 1 and "right_after" in row and "kept" not in row
    assert rep.real["flipped"] <= rep.decision_points
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pt", "pt.old", "r.jsonl"]
    for d in (out, tmp_path / "pt.old"):
        Engine(stack["base"], zchain=stack["sc"], posttrain=d, engram_dir=stack["ckpt"])


def test_decision_points_follow_the_text_not_one_spelling():
    """_judge on the real tokenizer: 'dividend' is 'd'+'ivid'+'end' to the tokenizer, and ds4-tiny writes it
    'div'+'id'+'end'. Another spelling of the right text is right; a decision point sits where the text leaves the
    right text, with the right answer's own token while the tokens agree, else the first token of the rest."""
    from types import SimpleNamespace

    from tokenizers import Tokenizer

    from ds4lib.posttrain.solve import _judge
    from ds4lib.tokenizer import TextEncoder
    tok = Tokenizer.from_file(str(TOKENIZER))
    enc, eng = TextEncoder(tok), SimpleNamespace(tokenizer=tok)
    ids = lambda text: enc.encode_pieces([(text, False)])                           # noqa: E731
    EOS = 1
    div, i_d, end, ing = (tok.token_to_id(t) for t in ("div", "id", "end", "ing"))
    answer = ids("dividend, n.") + [EOS]
    assert answer[:3] == [tok.token_to_id(t) for t in ("d", "ivid", "end")]
    other = [div, i_d, end] + answer[3:]
    judge = lambda g: _judge(eng, enc, g, answer)                                    # noqa: E731
    assert judge(answer).j is None and judge(other).j is None                       # the same text, then EOS
    v = judge([div, i_d, ing])                                   # 'divid' is on the right text, 'dividing' is not
    assert (v.j, v.a, v.skip) == (2, end, None)
    v = judge(answer[:4] + [ing])                                # the tokens agree so far: the answer's own token
    assert (v.j, v.a, v.skip) == (4, answer[4], None)
    v = judge(answer[:3] + [EOS])                                # ends too early
    assert (v.j, v.a) == (3, answer[3])
    v = judge(other[:-1] + ids(" c"))                            # goes on after the right text: EOS is right
    assert (v.j, v.a) == (len(other) - 1, EOS)
    v = judge([div, i_d])                                        # cut by the budget while on the right text
    assert v.j == 2 and v.a is None and "stopped" in v.skip


# ---------------------------------------------------------------------------------------------------- (4)
def test_requests_file_refusals_name_the_line(tmp_path):
    good = '{"id": 1, "prompt": "A", "answer": "B"}\n'
    cases = [
        (good + '{"id": 2, "prompt": "A", \n', r"line 2: not JSON"),
        (good + "\n" + '{"id": 2, "prompt": "A"}\n', r"line 3: missing field answer"),
        (good + '{"prompt": "A"}\n', r"line 2: missing fields id, answer"),
        (good + '{"id": 2, "prompt": "", "answer": "B"}\n', r"line 2: prompt must be a non-empty string"),
        (good + '{"id": 2, "prompt": "A", "answer": 7}\n', r"line 2: answer must be a non-empty string"),
        (good + '[1, 2]\n', r"line 2: expected a JSON object"),
        (good + '{"id": true, "prompt": "A", "answer": "B"}\n', r"line 2: id must be a string or an integer"),
        (good + good, r"line 2: id 1 was already given on line 1"),
        ("\n\n", r"no requests"),
    ]
    for text, msg in cases:
        f = tmp_path / "r.jsonl"
        f.write_text(text)
        with pytest.raises(PosttrainError, match=msg):
            read_requests(f)
    with pytest.raises(PosttrainError, match="no such requests file"):
        read_requests(tmp_path / "missing.jsonl")
    f.write_text(good + '{"id": "x", "prompt": "A", "answer": "C"}\n')
    assert [(r.id, r.line) for r in read_requests(f)] == [(1, 1), ("x", 2)]


def test_refusals_write_nothing(stack, cases, tmp_path, monkeypatch):
    reqs = _write_jsonl(tmp_path / "r.jsonl", cases[0])
    out = tmp_path / "o" / "pt"

    def refused(msg, **kw):
        with pytest.raises(PosttrainError, match=msg):
            _run(stack, kw.pop("out", out), kw.pop("requests", reqs), **kw)

    refused("no such base file", base=tmp_path / "none.gguf")
    refused("no such sidecar directory", zchain=tmp_path / "none")
    refused("no such requests file", requests=tmp_path / "none.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(cases[0][0]) + "\n{oops\n")
    refused(f"{bad} line 2: not JSON", requests=bad)
    # a --zchain of another model, of another base file, a ③ given as --zchain, an unfinished sidecar
    other = write_sidecar(tmp_path / "other", CFG.replace(norm_eps=CFG.norm_eps * 2), kind="sidecar",
                          gain_deltas={0: np.zeros((E, D))})
    refused("solved for another model", zchain=other)
    wrong_base = write_sidecar(tmp_path / "wb", CFG, kind="sidecar", notes={"base_sha256": "0" * 64})
    refused("solved against base 0000000000000000", zchain=wrong_base)
    solving = write_sidecar(tmp_path / "solving", CFG, kind="sidecar", notes={"status": "solving"})
    refused("still being solved", zchain=solving)
    pt = write_sidecar(tmp_path / "pt3", CFG, kind="posttrain", gain_deltas={L - 1: np.zeros((E, D))},
                       base=stack["engine"].sidecar)
    refused("is a 'posttrain' directory, not a ② sidecar", zchain=pt)
    # an --out that exists and is not a ③ directory of this model
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "keep.txt").write_text("mine")
    refused("exists and is not a ③ post-training directory", out=plain)
    assert (plain / "keep.txt").read_text() == "mine"
    refused(r"exists and is not a ③ post-training directory of this model \(.*expected 'posttrain'\)", out=solving)
    refused("is the --zchain directory", out=stack["sc"])
    (tmp_path / "file").write_text("x")
    refused("exists and is not a directory", out=tmp_path / "file")
    # a prompt the micro model cannot take (its vocabulary is 64 tokens), named by line
    far = _write_jsonl(tmp_path / "far.jsonl", [cases[0][0], {"id": "w", "prompt": "What?", "answer": "A"}])
    refused(r"request 'w' \(line 2\): the prompt encodes to token id \d+, outside the model's vocabulary \[0, 64\)",
            requests=far)
    # every answer already right: say so, write nothing
    right = _write_jsonl(tmp_path / "right.jsonl", [cases[0][-1]])
    with pytest.raises(NoDecisionPoints, match="all 1 answers are already right"):
        _run(stack, out, right)
    assert not (tmp_path / "o").exists()
    with pytest.raises(NoDecisionPoints, match="all 1 answers are already right"):     # requests given from Python
        _run(stack, out, [cases[0][-1]])
    with pytest.raises(PosttrainError, match="request 1: id 0 was already given on request 0"):
        _run(stack, out, [cases[0][0], cases[0][0]])
    with pytest.raises(PosttrainError, match="request 0: missing field answer"):
        _run(stack, out, [{"id": 0, "prompt": "A"}])
    assert not (tmp_path / "o").exists()
    # a capture that does not reproduce the generation stops the solve (here: a generation tampered with)
    import ds4lib.posttrain.solve as solve_mod
    real_greedy = solve_mod._greedy

    def tampered(engine, ids, n):
        g = real_greedy(engine, ids, n)
        return [g[0] + 1] + g[1:]
    monkeypatch.setattr(solve_mod, "_greedy", tampered)
    with pytest.raises(PosttrainError, match=r"request 0 \(line 1\): the capture does not reproduce the generation"):
        _run(stack, out, reqs)
    monkeypatch.undo()
    with pytest.raises(PosttrainError, match="tau must be a finite number > 0"):
        _run(stack, out, reqs, tau=0.0)
    with pytest.raises(PosttrainError, match="lam must be a finite number > 0"):
        _run(stack, out, reqs, lam=0.0)
    with pytest.raises(PosttrainError, match="kappa must be a finite number ≥ 0"):
        _run(stack, out, reqs, kappa=-0.5)
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------------------------- (5)
def _argv(stack, requests, out, *extra):
    return ["posttrain", "--base", str(stack["base"]), "--zchain", str(stack["sc"]), "--requests", str(requests),
            "--out", str(out), "--engram-dir", str(stack["ckpt"]), "--quiet", "--keep-positions", "0",
            *(a for k, v in MICRO.items() for a in (f"--{k.replace('_', '-')}", str(v))), *extra]


def test_cli_exit_codes(stack, cases, tmp_path, capsys):
    reqs = _write_jsonl(tmp_path / "r.jsonl", cases[0])
    out = tmp_path / "pt"
    assert ds4_main(_argv(stack, reqs, out, "--min-kept", str(MIN_KEPT), "--rounds", "2")) == 0
    text = capsys.readouterr().out
    assert f"installed {out}" in text and "decision points" in text and "real: flipped" in text
    rep = json.loads((out / "report.json").read_text())
    assert rep["status"] == "installed" and rep["params"]["rounds"] == 2 and len(rep["cg_iterations"]) <= 2
    assert ds4_main(_argv(stack, reqs, out, "--min-flip", "1.01")) == 1          # rejected: --out untouched
    assert "REJECTED" in capsys.readouterr().out
    assert json.loads((out / "report.json").read_text()) == rep and len(list((tmp_path / "rejected").iterdir())) == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(cases[0][0]) + "\n" + '{"id": 9, "prompt": "A"}\n')
    assert ds4_main(_argv(stack, bad, tmp_path / "x")) == 2
    err = capsys.readouterr().err
    assert err.startswith("ds4 posttrain: ") and "line 2: missing field answer" in err and "Traceback" not in err
    right = _write_jsonl(tmp_path / "right.jsonl", [cases[0][-1]])
    assert ds4_main(_argv(stack, right, tmp_path / "x")) == 2
    assert "already right" in capsys.readouterr().err and not (tmp_path / "x").exists()
    with pytest.raises(SystemExit) as ex:                                       # argparse's usage error
        ds4_main(_argv(stack, reqs, out, "--tau", "0"))
    assert ex.value.code == 2
    assert "--tau" in capsys.readouterr().err
    with pytest.raises(SystemExit) as ex:
        ds4_main(_argv(stack, reqs, out, "--lam", "0"))
    assert ex.value.code == 2 and "--lam" in capsys.readouterr().err


def test_console_entry_refuses_without_a_traceback(tmp_path):
    """The `ds4` entry point in a fresh interpreter: a missing base file is a one-line refusal, exit status 2."""
    req = _write_jsonl(tmp_path / "r.jsonl", [{"id": 1, "prompt": "A", "answer": "B"}])
    env = dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "ds4lib.tools.cli", "posttrain", "--base", str(tmp_path / "no.gguf"),
                        "--zchain", str(tmp_path), "--requests", str(req), "--out", str(tmp_path / "pt")],
                       capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2], env=env, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip() == f"ds4 posttrain: {tmp_path / 'no.gguf'}: no such base file"
    assert not (tmp_path / "pt").exists()

"""The comparator's five numbers on known inputs, and `ds4 eval` / `ds4 score` / `ds4 -p` on a tiny stack."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ds4lib.eval import compare, merge, per_position

ROOT = Path(__file__).resolve().parents[2]
TOK = ROOT / "data" / "tokenizer" / "tokenizer.json"


def test_identical_distributions():
    rng = np.random.default_rng(0)
    lg = rng.standard_normal((50, 30)).astype(np.float32)
    t = rng.integers(0, 30, 50)
    c = compare(lg, lg, t)
    assert c.same_top1 == 1 and abs(c.sigma_min_mean - 1) < 1e-12 and abs(c.kl_mean) < 1e-12 and c.ppl_ratio == 1


def test_known_two_token_case():
    p = np.log(np.array([[0.75, 0.25]]))
    q = np.log(np.array([[0.25, 0.75]]))
    c = compare(p, q, [0])
    assert c.same_top1 == 0
    assert abs(c.sigma_min_mean - 0.5) < 1e-12
    assert abs(c.kl_mean - (0.75 * np.log(3) + 0.25 * np.log(1 / 3))) < 1e-12
    assert abs(c.ppl_ratio - 3.0) < 1e-9
    both = merge([per_position(p, q, [0]), per_position(p, p, [0])])
    assert both.n == 2 and abs(both.sigma_min_mean - 0.75) < 1e-12


def _run(args, **kw):
    return subprocess.run([sys.executable, "-m", "ds4lib.tools.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, **kw)


def test_score_and_generate_cli(tiny_stack):
    ckpt, base = tiny_stack
    (ckpt / "tokenizer.json").write_bytes(TOK.read_bytes())     # the random model's stack needs a tokenizer
    p = _run(["score", "-m", str(base), "--tokens", "0,10,20,30,40,50", "--json"])
    assert p.returncode == 0, p.stderr
    rec = json.loads(p.stdout)
    assert len(rec["logprobs"]) == 5 and all(x < 0 for x in rec["logprobs"])
    p2 = _run(["score", "-m", str(base), "--tokens", "0,10,20,30,40,50", "--json", "--score-split", "2"])
    assert json.loads(p2.stdout)["logprobs"] == rec["logprobs"]
    # byte tokens of control characters have ids below the random model's 1024
    g = _run(["-m", str(base), "-p", "\x05\x06\x07", "--temp", "0", "-n", "5", "--raw"])
    assert g.returncode == 0, g.stderr
    g2 = _run(["-m", str(base), "-p", "\x05\x06\x07", "--temp", "0", "-n", "5", "--raw"])
    assert g.stdout == g2.stdout
    oov = _run(["-m", str(base), "-p", "hello world", "--temp", "0", "-n", "5", "--raw"])
    assert oov.returncode == 2 and "outside the model's vocabulary" in oov.stderr
    bad = _run(["score", "-m", str(base.with_name("missing.gguf")), "--tokens", "1,2"])
    assert bad.returncode == 2 and "no such file" in bad.stderr


def test_eval_cli_reports_five_numbers(tiny_stack, tmp_path):
    ckpt, base = tiny_stack
    (ckpt / "tokenizer.json").write_bytes(TOK.read_bytes())
    env = {**__import__("os").environ, "DS4_CACHE_DIR": str(tmp_path)}
    # the committed slices are ds4-tiny tokens (vocab 8192): this random model (vocab 1024) gets its own windows
    win = tmp_path / "windows.npy"
    np.save(win, np.random.default_rng(1).integers(9, 1000, (2, 64)))
    p = _run(["eval", "-m", str(base), "--windows-file", str(win), "--json"], env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    rec = json.loads(p.stdout)
    c = rec["slices"][str(win)]
    assert c["n"] == 128 and 0 < c["sigma_min_mean"] <= 1 and c["kl_mean"] >= 0 and 0 <= c["same_top1"] <= 1


@pytest.mark.slow
def test_eval_cli_on_the_cuda_backend(tmp_path, monkeypatch, capsys):
    """`ds4 eval --cuda` scores on the CUDA backend (the simulator here, in-process with its warp shim; the GPU on
    the device machine) and gives the CPU backend's five numbers within the backends' agreement."""
    from ds4lib.quant.base_file import quantize_checkpoint
    from ds4lib.synth import write_random_checkpoint
    from ds4lib.tools.cli import main
    from tests.sidecar.test_solve import micro_config
    ck = write_random_checkpoint(tmp_path / "ck", micro_config(), seed=0)
    (ck / "tokenizer.json").write_bytes(TOK.read_bytes())
    base = tmp_path / "b.gguf"
    quantize_checkpoint(checkpoint=ck, out=base, bits_plan="1", rounds=1, progress=False)
    monkeypatch.setenv("DS4_CACHE_DIR", str(tmp_path))
    win = tmp_path / "windows.npy"
    np.save(win, np.random.default_rng(1).integers(9, 60, (1, 8)))
    got = {}
    for flag in ([], ["--cuda"]):
        assert main(["eval", "-m", str(base), "--windows-file", str(win), "--json", *flag]) == 0
        rec = json.loads(capsys.readouterr().out)
        got[rec["stack"]["backend"]] = rec["slices"][str(win)]
    assert set(got) == {"cpu", "cuda"} and got["cuda"]["n"] == 8
    assert abs(got["cuda"]["kl_mean"] - got["cpu"]["kl_mean"]) < 0.05 + 0.2 * got["cpu"]["kl_mean"]


def test_teacher_cache_is_written_by_rename_and_ignores_other_writers(tiny_stack, tmp_path, monkeypatch):
    """The teacher's logits cache: an entry is written under a temporary name of this process's own (two reports
    filling one cache at once must not write one temporary file) and renamed; it equals a fresh computation
    (float16), and another process's unfinished temporary file beside it neither breaks nor replaces it."""
    import os
    import ds4lib.eval.teacher as teacher_mod
    from ds4lib.eval.teacher import Teacher
    ckpt, _ = tiny_stack
    t = Teacher(ckpt, tmp_path)
    toks = [1, 5, 9, 2]
    key_files = lambda: sorted(p.name for p in t.cache.iterdir())                               # noqa: E731
    saved = []
    real_save = teacher_mod.np.save
    monkeypatch.setattr(teacher_mod.np, "save", lambda f, a: (saved.append(Path(f).name), real_save(f, a)))
    first = t.logits(toks)
    monkeypatch.undo()
    assert len(saved) == 1 and f".{os.getpid()}." in saved[0] and saved[0] not in key_files()
    (entry,) = key_files()
    stranger = t.cache / entry.replace(".npy", f".{os.getpid() + 1}.partial.npy")
    stranger.write_bytes(b"half a file from another process")
    again = t.logits(toks)
    np.testing.assert_array_equal(first, again)
    np.testing.assert_array_equal(first, t.model.logits(np.asarray(toks)).astype(np.float16).astype(np.float32))
    assert sorted(key_files()) == sorted([entry, stranger.name])

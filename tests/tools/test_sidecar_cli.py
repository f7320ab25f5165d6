"""`ds4 sidecar`: bad input gives a one-line message and status 2 (no traceback). Solves themselves are tested in
tests/sidecar; the CLI calls the same solve_sidecar."""
from ds4lib.tools.cli import main


def _run(capsys, *args):
    rc = main(["sidecar", *args])
    err = capsys.readouterr()
    return rc, err.out, err.err


def test_bad_input_is_a_message(capsys, tmp_path):
    rc, _, err = _run(capsys, "--base", str(tmp_path / "nope.gguf"), "--domain", "x", "--fit", "finance/fit",
                      "--out", str(tmp_path / "o"))
    assert rc == 2 and "no such base file" in err and "Traceback" not in err
    (tmp_path / "b.gguf").write_bytes(b"GGUF")
    for extra, want in ((["--lambdas", "1,x"], "--lambdas must be a comma list"),
                        (["--alphas", ""], "--alphas must list"), (["--gate", "1.5"], "--gate must be in")):
        rc, _, err = _run(capsys, "--base", str(tmp_path / "b.gguf"), "--domain", "x", "--fit", "finance/fit",
                          "--out", str(tmp_path / "o"), *extra)
        assert rc == 2 and want in err and "Traceback" not in err
    rc, _, err = _run(capsys, "--base", str(tmp_path / "b.gguf"), "--domain", "x", "--fit", "finance/fit",
                      "--out", str(tmp_path / "o"))
    assert rc == 2 and "ds4 sidecar:" in err and "Traceback" not in err      # a cut GGUF header


def test_unknown_slice_and_foreign_directory(capsys, tmp_path):
    from tests.sidecar.test_solve import micro_config
    from ds4lib.quant.base_file import quantize_checkpoint
    from ds4lib.synth import write_random_checkpoint
    ck = write_random_checkpoint(tmp_path / "ck", micro_config(), seed=0)
    quantize_checkpoint(checkpoint=ck, out=tmp_path / "b.gguf", bits_plan="1", rounds=1, progress=False)
    rc, _, err = _run(capsys, "--base", str(tmp_path / "b.gguf"), "--domain", "x", "--fit", "nowhere/fit",
                      "--original", str(ck), "--out", str(tmp_path / "o"))
    assert rc == 2 and "no slice 'nowhere/fit'" in err
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "a.txt").write_text("x")
    rc, _, err = _run(capsys, "--base", str(tmp_path / "b.gguf"), "--domain", "x", "--fit", "finance/fit",
                      "--original", str(ck), "--out", str(tmp_path / "mine"))
    assert rc == 2 and "not a sidecar directory" in err


def test_ablation_flags_reach_the_solve(capsys, tmp_path, monkeypatch):
    import ds4lib.sidecar as sc
    seen = {}

    def fake(**kw):
        seen.update(kw)
        raise sc.SolveError("stop here")
    monkeypatch.setattr(sc, "solve_sidecar", fake)
    (tmp_path / "b.gguf").write_bytes(b"GGUF")
    rc, _, err = _run(capsys, "--base", str(tmp_path / "b.gguf"), "--domain", "x", "--fit", "finance/fit",
                      "--out", str(tmp_path / "o"), "--no-router-bias", "--float-then-round", "--own-ridge",
                      "--gate", "0", "--lambdas", "1,10")
    assert rc == 2 and "stop here" in err
    assert (seen["router_bias"], seen["lattice"], seen["shared_ridge"], seen["gate"], seen["lambdas"]) == \
        (False, False, False, 0.0, (1.0, 10.0))

"""The ② sidecar solver end to end on a micro model (tests/engine/test_engine_cuda.micro_config): capture on the
engine's prefill with the bit-exact gate (CPU backend, and the CUDA backend under the simulator), the teacher
fixture, the sequential solve, resuming per layer, the gates, and refusals."""
import json

import numpy as np
import pytest

from ds4lib.engine import Engine
from ds4lib.formats.sidecar import directory_fingerprint, read_sidecar
from ds4lib.sidecar import CaptureError, SolveError, build_fixture, capture_layer, heldout_mask, reconstruct
from ds4lib.sidecar import solve as solve_mod
from ds4lib.sidecar import solve_sidecar
from tests.engine.test_engine_cuda import TOKENIZER
from tests.engine.test_engine_cuda import micro_config as _engine_micro


def micro_config():
    """The engine tests' micro model with both compressed layers at ratio 1: its ratio-2 layer consumes the
    ratio-1 layer's candidate mask, which only decode-length calls survive (ref shape mismatch on prefill)."""
    return _engine_micro().replace(compress_ratios=(1, 1))


TOKENS = np.random.default_rng(3).integers(9, 60, (4, 48))


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    from ds4lib.quant.base_file import quantize_checkpoint
    from ds4lib.synth import write_random_checkpoint
    root = tmp_path_factory.mktemp("sidecar_micro")
    ckpt = write_random_checkpoint(root / "ckpt", micro_config(), seed=0)
    quantize_checkpoint(checkpoint=ckpt, out=root / "base.gguf", bits_plan="1", rounds=1, progress=False)
    return ckpt, root / "base.gguf"


def _solve(micro, out, **kw):
    ckpt, base = micro
    return solve_sidecar(base=base, out=out, domain="test", tokens=TOKENS, checkpoint=ckpt, tokenizer=TOKENIZER,
                         cache_dir=out.parent / "cache", progress=False, **kw)


def test_capture_is_bit_exact_on_cpu(micro):
    ckpt, base = micro
    eng = Engine(base, engram_dir=ckpt, tokenizer_path=TOKENIZER)
    cap = capture_layer(eng, TOKENS[:2], 1)
    assert cap.exact == 1.0
    np.testing.assert_array_equal(reconstruct(cap.ids, cap.weights, cap.ye, cap.ysh), cap.out)
    assert cap.ye.shape == (2 * TOKENS.shape[1], 2, micro_config().dim)


def test_capture_in_blocks_equals_one_block(micro):
    """Prefill in blocks (or a backend's own chunks): the capture waits for every row of the sequence."""
    ckpt, base = micro
    one = capture_layer(Engine(base, engram_dir=ckpt, tokenizer_path=TOKENIZER), TOKENS[:2], 1)
    blocks = capture_layer(Engine(base, engram_dir=ckpt, tokenizer_path=TOKENIZER, prefill_block=20), TOKENS[:2], 1)
    for name in ("scores", "ids", "weights", "ye", "ysh", "out"):
        np.testing.assert_array_equal(getattr(blocks, name), getattr(one, name))


def test_capture_stops_the_run_when_not_exact(micro):
    ckpt, base = micro
    eng = Engine(base, engram_dir=ckpt, tokenizer_path=TOKENIZER)

    class Tampered:            # an engine whose hook reports ye off by 1%
        def new_session(self):
            return eng.new_session()

        def prefill(self, s, toks, observer):
            return eng.prefill(s, toks, observer=lambda l, n, v: observer(l, n, v * 1.01 if n == "ye" else v))
    with pytest.raises(CaptureError, match=r"only \d+\.\d+% of values"):
        capture_layer(Tampered(), TOKENS[:1], 0)


@pytest.mark.slow
def test_capture_on_cuda_backend_matches_cpu(micro):
    ckpt, base = micro
    cpu = capture_layer(Engine(base, engram_dir=ckpt, tokenizer_path=TOKENIZER), TOKENS[:1, :4], 1)
    cuda = capture_layer(Engine(base, engram_dir=ckpt, tokenizer_path=TOKENIZER, backend="cuda"), TOKENS[:1, :4], 1)
    assert cuda.exact >= 0.9999
    np.testing.assert_array_equal(cuda.ids, cpu.ids)
    np.testing.assert_allclose(cuda.out, cpu.out, atol=0.05 * np.abs(cpu.out).max())


def test_heldout_is_a_rotating_quarter():
    m = heldout_mask(4, 512).reshape(4, 4, 128)
    assert m.mean() == 0.25
    assert [int(np.nonzero(m[w, :, 0])[0][0]) for w in range(4)] == [3, 2, 1, 0]


def test_fixture_is_reused(micro, tmp_path):
    ckpt, _ = micro
    fix = build_fixture(ckpt, TOKENS[:2], tmp_path)
    stamp = {p.name: p.stat().st_mtime_ns for p in fix.root.iterdir()}
    again = build_fixture(ckpt, TOKENS[:2], tmp_path)
    assert again.root == fix.root and {p.name: p.stat().st_mtime_ns for p in again.root.iterdir()} == stamp
    lay = fix.layer(1)
    assert lay["x"].shape == lay["y"].shape == (2 * TOKENS.shape[1], micro_config().dim)
    assert build_fixture(ckpt, TOKENS[:3], tmp_path).root != fix.root


def test_fixture_of_the_first_layers_equals_a_whole_builds(micro, tmp_path):
    """build_fixture(n_layers=1), as a partial solve calls it: layer 0 only, the same arrays as a whole build's, and no
    meta.json; a whole build in the same place completes it."""
    ckpt, _ = micro
    part = build_fixture(ckpt, TOKENS[:2], tmp_path / "part", n_layers=1)
    assert sorted(p.name for p in part.root.iterdir()) == ["L00.npz"]
    whole = build_fixture(ckpt, TOKENS[:2], tmp_path / "whole")
    for k, v in whole.layer(0).items():
        np.testing.assert_array_equal(part.layer(0)[k], v, err_msg=k)
    again = build_fixture(ckpt, TOKENS[:2], tmp_path / "part")
    assert sorted(p.name for p in again.root.iterdir()) == sorted(p.name for p in whole.root.iterdir())


def test_solve_writes_what_the_engine_reads_and_resumes(micro, tmp_path):
    ckpt, base = micro
    out = tmp_path / "sc"
    rep = _solve(micro, out, gate=0.0)
    cfg = micro_config()
    sc = read_sidecar(out, cfg, expect_kind="sidecar")
    man = json.loads((out / "manifest.json").read_text())
    assert man["notes"]["status"] == "complete" and all(v["done"] for v in man["layers"].values())
    assert len(rep.layers) == cfg.n_layers and rep.mounted == sorted(sc.gains)
    assert rep.mounted, "gate 0: every layer with a positive held-out gain is mounted"
    for r in rep.layers:
        assert r["capture_exact"] == 1.0 and r["route_match"] >= 0.99
        assert r["heldout_gain"] == max(x["heldout_gain"] for x in r["lambda_rows"])
    fp = directory_fingerprint(out)
    again = _solve(micro, out, gate=0.0)
    assert all(r.get("resumed") for r in again.layers) and directory_fingerprint(out) == fp
    with pytest.raises(SolveError, match="other parameters"):
        _solve(micro, out, gate=0.5)
    bare = Engine(base, engram_dir=ckpt, tokenizer_path=TOKENIZER).logits(TOKENS[0, :16])
    mounted = Engine(base, zchain=out, engram_dir=ckpt, tokenizer_path=TOKENIZER).logits(TOKENS[0, :16])
    assert not np.array_equal(bare, mounted)


def test_interrupted_solve_keeps_finished_layers(micro, tmp_path, monkeypatch):
    out = tmp_path / "sc"
    real = solve_mod.capture_layer

    def stop_at_layer_1(engine, seqs, layer, **kw):
        if layer == 1:
            raise KeyboardInterrupt
        return real(engine, seqs, layer, **kw)
    monkeypatch.setattr(solve_mod, "capture_layer", stop_at_layer_1)
    with pytest.raises(KeyboardInterrupt):
        _solve(micro, out, gate=0.0)
    man = json.loads((out / "manifest.json").read_text())
    assert list(man["layers"]) == ["0"] and man["notes"]["status"] == "solving"
    monkeypatch.setattr(solve_mod, "capture_layer", real)
    rep = _solve(micro, out, gate=0.0)
    assert rep.layers[0].get("resumed") and not rep.layers[1].get("resumed")


def test_resume_unmounts_an_interrupted_layer(micro, tmp_path, monkeypatch):
    """Interrupted after layer 1's Δb was mounted but before its gains: the rerun must not capture layer 1 with that
    stale Δb in place."""
    out = tmp_path / "sc"
    _solve(micro, out, gate=0.0, alphas=(1.0,))
    man = json.loads((out / "manifest.json").read_text())
    man["layers"]["1"] = {"gains": False, "bias": True, "done": False}
    (out / "rb_L01.bin").write_bytes(np.full(micro_config().n_routed_experts, 50.0, "<f4").tobytes())
    (out / "manifest.json").write_text(json.dumps(man))
    seen = []
    real = solve_mod.capture_layer

    def spy(engine, seqs, layer, **kw):
        seen.append((layer, 1 in getattr(engine.sidecar, "bias", {})))
        return real(engine, seqs, layer, **kw)
    monkeypatch.setattr(solve_mod, "capture_layer", spy)
    _solve(micro, out, gate=0.0, alphas=(1.0,))
    assert seen and seen[0] == (1, False)


def test_gate_keeps_layers_out(micro, tmp_path):
    out = tmp_path / "sc"
    rep = _solve(micro, out, gate=0.999, router_bias=False)
    assert rep.mounted == [] and not list(out.glob("gr_*.bin"))
    man = json.loads((out / "manifest.json").read_text())
    assert all(v["done"] and not v["gains"] and v["heldout_gain"] <= 0.999 for v in man["layers"].values())


def test_refuses_a_directory_that_is_not_a_sidecar(micro, tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "precious.txt").write_text("keep me")
    with pytest.raises(SolveError, match="not a sidecar directory"):
        _solve(micro, tmp_path / "x")
    assert (tmp_path / "x" / "precious.txt").read_text() == "keep me"


def test_the_original_is_found_beside_the_base_by_content_hash(micro, tmp_path):
    """Without `checkpoint` the solve takes the checkpoint beside the base whose content hash the base records
    (base files record no path); a checkpoint with another hash is refused."""
    from ds4lib.engine import EngineError
    from ds4lib.synth import write_random_checkpoint
    ckpt, base = micro
    solve_sidecar(base=base, out=tmp_path / "found", domain="test", tokens=TOKENS, tokenizer=TOKENIZER,
                          cache_dir=tmp_path / "cache", progress=False)
    given = _solve(micro, tmp_path / "given")
    for f in sorted(p.name for p in (tmp_path / "given").iterdir()):
        assert (tmp_path / "found" / f).read_bytes() == (tmp_path / "given" / f).read_bytes(), f
    other = write_random_checkpoint(tmp_path / "other", micro_config(), seed=1)
    with pytest.raises(EngineError, match="was built from checkpoint"):
        solve_sidecar(base=base, out=tmp_path / "refused", domain="test", tokens=TOKENS, checkpoint=other,
                      tokenizer=TOKENIZER, cache_dir=tmp_path / "cache", progress=False)

"""The ds4-tiny trainer on the CPU (PyTorch, training only): the dense MoE equals the reference's routed
MoE, and a run split across calls resumes exactly (weights, optimiser moments, data cursor)."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ds4lib.config import ModelConfig                         # noqa: E402
from ds4lib.formats.floats import round_bf16                  # noqa: E402
from ds4lib.ref.moe import moe as ref_moe                     # noqa: E402
from training import train as T                               # noqa: E402
from training.model import MoE                                # noqa: E402

CONFIG = "training/ds4_tiny_config.json"
TOKENIZER = "data/tokenizer/tokenizer.json"


def test_dense_moe_matches_reference_routed_moe():
    cfg = ModelConfig.from_json(CONFIG)
    torch.manual_seed(0)
    m = MoE(cfg, cfg.n_routed_experts, cfg.n_activated_experts, qat=True, out_std=0.05)
    with torch.no_grad():
        m.gate.bias.copy_(torch.randn(cfg.n_routed_experts) * 0.05)
    x = torch.from_numpy(round_bf16(np.random.default_rng(1).standard_normal((96, cfg.dim)).astype(np.float32)))
    with torch.no_grad():
        y, load = m(x)
        w = {"ffn.gate.weight": m.gate.weight.numpy(), "ffn.gate.bias": m.gate.bias.numpy()}
        for name in ("w1", "w2", "w3"):
            stacked = m._stacked(name).numpy()                # the FP4 values QAT computes with
            for e in range(cfg.n_routed_experts):
                w[f"ffn.experts.{e}.{name}.weight"] = stacked[e]
            w[f"ffn.shared_experts.{name}.weight"] = T.torch.Tensor.numpy(
                getattr(m.shared_experts, name).eff_weight())
    ref = ref_moe(x.numpy(), w, cfg, cfg.n_activated_experts, quant_sim=True)
    got = y.numpy()
    assert load.sum().item() == 96 * cfg.n_activated_experts
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    # same routing, same quantisers; only FP32 summation orders differ (GEMM vs the reference's exact
    # per-block sums), which moves a few values by one BF16 ulp
    assert rel < 5e-3, rel
    assert np.mean(got == ref) > 0.9


def _shipped_model():
    """models/ds4-tiny in the training model (what its perplexities are computed with)."""
    from tokenizers import Tokenizer
    from ds4lib.tokenmap import compressed_token_map
    from training.export import load_model
    return load_model("models/ds4-tiny", compressed_token_map(Tokenizer.from_file(TOKENIZER))[0])


def _tiny_data(tmp_path, vocab=8192):
    rng = np.random.default_rng(0)
    data = tmp_path / "data"
    data.mkdir()
    parts = {}
    for name, n in (("english", 20_000), ("chat", 12_000)):
        np.save(data / f"{name}.npy", rng.integers(9, vocab, n).astype(np.uint16))
        parts[name] = {"weight": 0.5, "tokens": n}
    (data / "manifest.json").write_text(json.dumps({"parts": parts}))
    return data


def _args(data, tmp_path, run, *extra):
    return ["--data", str(data), "--config", CONFIG, "--tokenizer", TOKENIZER, "--out", str(tmp_path / run / "out"),
            "--state", str(tmp_path / run / "state"), "--tokens", str(4 * 2 * 64), "--batch", "2", "--seq", "64",
            "--anchors", "2", "--warmup", "2", "--no-compile", "--no-export", *extra]


def _state(tmp_path, run):
    return torch.load(tmp_path / run / "state" / T.STATE_FILE, weights_only=False)


@pytest.mark.slow
def test_split_run_resumes_exactly(tmp_path):
    torch.set_num_threads(1)
    data = _tiny_data(tmp_path)
    T.main(_args(data, tmp_path, "straight"))
    T.main(_args(data, tmp_path, "split", "--stop-at", "2"))
    assert _state(tmp_path, "split")["step"] == 2
    T.main(_args(data, tmp_path, "split"))
    a, b = _state(tmp_path, "straight"), _state(tmp_path, "split")
    assert a["step"] == b["step"] == 4 and a["tokens"] == b["tokens"]
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    for (ka, sa), (kb, sb) in zip(a["opt"]["state"].items(), b["opt"]["state"].items()):
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sa[name], sb[name]), (ka, name)
    assert [r["loss"] for r in a["log"]["steps"]] == [r["loss"] for r in b["log"]["steps"]]
    # a later call with other knobs is refused instead of mixed into the saved run
    with pytest.raises(SystemExit, match="planned differently"):
        T.main(_args(data, tmp_path, "split", "--lr", "1e-3"))


def test_plan_schedule_and_anchors():
    plan = T.RunPlan(total_steps=100, batch=2, seq=64, lr=1e-3, warmup=10, min_lr_frac=0.1, wd=0.1, anchors=2,
                     balance_rate=1e-3, seed=0, weights=(), data_sha256="", config_sha256="")
    assert plan.lr_at(0) == pytest.approx(1e-4) and plan.lr_at(9) == pytest.approx(1e-3)
    assert plan.lr_at(99) == pytest.approx(1e-4, rel=1e-2)
    a = T.draw_anchors(0, 5, 2, 3, 64, 4)
    assert np.array_equal(a, T.draw_anchors(0, 5, 2, 3, 64, 4)) and a.max() < 64 - 4 - 1
    assert not np.array_equal(a, T.draw_anchors(0, 6, 2, 3, 64, 4))


def test_engine_toolchain_and_server_never_import_torch():
    import subprocess
    import sys
    code = ("import sys, ds4lib.engine, ds4lib.quant, ds4lib.ref, ds4lib.eval, ds4lib.tools.cli, server.app; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.slow
def test_training_model_on_the_shipped_weights_agrees_with_the_reference():
    """models/ds4-tiny loaded back into the training model (what the trainer computed with) against ds4lib.ref
    on the same FP4/FP8 weights: the same function up to summation order and its rounding-boundary flips."""
    from ds4lib.corpus.slices import load_slice
    from ds4lib.ref import ReferenceModel
    ckpt = "models/ds4-tiny"
    ref = ReferenceModel.load(ckpt)
    m = _shipped_model()
    win = load_slice("english/judge").tokens[0][:96].astype(np.int64)
    with torch.no_grad():
        lt = m(torch.from_numpy(win)[None])[0][0].numpy()
    lr = ref.logits(win)
    rel = np.linalg.norm(lt - lr) / np.linalg.norm(lr)
    agree = np.mean(lt.argmax(-1) == lr.argmax(-1))
    assert rel < 0.05 and agree > 0.9, (rel, agree)


@pytest.mark.slow
def test_judge_ppl_scores_a_window_of_the_shipped_model(tmp_path):
    from training import judge_ppl
    from ds4lib.corpus.slices import load_slice
    m = _shipped_model()
    win = load_slice("english/judge").tokens[:2, :65]
    r = judge_ppl.judge(m, win, batch=1)
    assert r["tokens"] == 2 * 64 and 1 < r["ppl"] < 8192 and r["median_top1_margin"] > 0


def test_fit_steps_must_be_two_increasing_integers(tmp_path, capsys):
    for bad in ("10", "a,b", "30,10", "-1,3"):
        with pytest.raises(SystemExit):
            T.parse_args(_args(tmp_path, tmp_path, "x", "--fit-steps", bad))
        assert "--fit-steps" in capsys.readouterr().err
    assert T.parse_args(_args(tmp_path, tmp_path, "x")).fit_steps == (10, 30)


@pytest.mark.slow
def test_deadline_fits_the_plan_and_snapshots_are_whole_checkpoints(tmp_path):
    """`--deadline` shortens a new run's plan to end in time; `--snapshot-every` exports loadable
    checkpoints in the background while training goes on."""
    torch.set_num_threads(1)
    from ds4lib.formats.checkpoint import CheckpointReader
    data = _tiny_data(tmp_path)
    args = _args(data, tmp_path, "dl", "--tokens", str(1000 * 2 * 64), "--deadline", "1e-3", "--fit-steps", "2,4",
                 "--snapshot", str(tmp_path / "snap"), "--snapshot-every", "0.01")
    tr = T.main(args)
    # a deadline already past at the fitting step (4) leaves the plan at that step + 1
    assert tr.plan.total_steps == 5 and tr.step == 5
    calls = _state(tmp_path, "dl")["log"]["calls"]
    assert calls[-1]["snapshots"], "no background snapshot was written"
    r = CheckpointReader.open(tmp_path / "snap")
    assert r.has("embed.weight")
    assert not (tmp_path / "snap.tmp").exists()

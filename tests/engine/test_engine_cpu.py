"""Engine gates on the CPU backend (issue 5 item 7) and load-time refusals, on a random tiny stack."""
import json
import shutil

import numpy as np
import pytest

from ds4lib.engine import Engine, EngineError, SamplingParams
from ds4lib.formats.sidecar import read_sidecar, write_sidecar


@pytest.fixture(scope="module")
def engine(tiny_stack):
    ckpt, base = tiny_stack
    return Engine(base, engram_dir=ckpt, tokenizer_path=None) if (ckpt / "tokenizer.json").exists() \
        else Engine(base, engram_dir=ckpt, tokenizer_path=_tok())


def _tok():
    from pathlib import Path
    return Path(__file__).resolve().parents[2] / "data" / "tokenizer" / "tokenizer.json"


PROMPT = list(np.random.default_rng(5).integers(9, 1000, 40))


def test_greedy_is_byte_identical_across_runs(engine):
    p = SamplingParams(temperature=0, max_tokens=12)
    a = [e for e in engine.generate(PROMPT, p)]
    b = [e for e in engine.generate(PROMPT, p)]
    assert [e.get("id") for e in a] == [e.get("id") for e in b]
    assert a[-1]["text"] == b[-1]["text"] and a[-1]["type"] == "done"


def test_seeded_sampling_is_reproducible(engine):
    p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=3)
    assert list(engine.generate_ids(PROMPT, p)) == list(engine.generate_ids(PROMPT, p))


def test_decode_path_equals_prefill_path(engine):
    full = engine.logits(PROMPT)
    mixed = engine.logits(PROMPT, split=15)
    one = engine.logits(PROMPT, split=0)
    np.testing.assert_array_equal(mixed, full)
    np.testing.assert_array_equal(one, full)
    np.testing.assert_array_equal(engine.score(PROMPT, split=20), engine.score(PROMPT))


def test_chunked_prefill_equals_single(engine, tiny_stack):
    ckpt, base = tiny_stack
    small = Engine(base, engram_dir=ckpt, tokenizer_path=_tok(), prefill_block=7)
    np.testing.assert_array_equal(small.logits(PROMPT), engine.logits(PROMPT))


class _FileValues:
    """The reference model's weights as the base file defines them, decoded without the engine: every tensor the
    file quantises (q4_K, Q8_0, F16) by gguf's own public `quants.dequantize`, routed experts from the file's VQ
    codes, everything the file stores unchanged from the original checkpoint."""

    def __init__(self, ckpt, base, engine):
        from gguf import GGMLQuantizationType as GT
        from gguf import GGUFReader, quants

        from ds4lib.formats.checkpoint import CheckpointReader
        from ds4lib.ref.weights import RefWeights
        self.ref = RefWeights(CheckpointReader.open(ckpt))
        self.engine, self.cfg = engine, engine.cfg
        self.decoded = {t.name: quants.dequantize(t.data, t.tensor_type).astype(np.float32)
                        for t in GGUFReader(base).tensors if t.tensor_type in (GT.Q4_K, GT.Q8_0, GT.F16)}

    def global_(self, name):
        return self.decoded.get(name, self.ref.global_(name))

    def layer(self, l):
        from ds4lib.formats.names import layer_prefix
        p = layer_prefix(self.cfg, l)
        out = {}
        for k, v in self.ref.layer(l).items():
            if ".experts." in k:
                e, mat = k.split(".")[2], k.split(".")[3]
                out[k] = self.engine.base.dequant_expert(l, int(e), mat)
            else:
                out[k] = self.decoded.get(p + k, v)
        return out

    def engram_rows(self, l, hashes):
        return self.ref.engram_rows(l, hashes)


def test_engine_is_the_reference_forward_over_the_files_values(engine, tiny_stack):
    """The CPU engine must equal, bit for bit, the reference model run on the base file's values decoded outside
    the engine (gguf's dequantizer for the linears, the checkpoint for stored tensors); and those values must be
    the quantised ones: the full-precision checkpoint gives different, but close, logits."""
    from ds4lib.formats.checkpoint import CheckpointReader
    from ds4lib.ref import ReferenceModel
    from ds4lib.ref.weights import RefWeights
    ckpt, base = tiny_stack
    want = ReferenceModel(engine.cfg, _FileValues(ckpt, base, engine), engine.token_map, quant_sim=True)
    got = engine.logits(PROMPT)
    np.testing.assert_array_equal(got, want.logits(PROMPT))
    full = ReferenceModel(engine.cfg, RefWeights(CheckpointReader.open(ckpt)), engine.token_map, quant_sim=True)
    fp = full.logits(PROMPT)
    assert not np.array_equal(got, fp)
    p, q = (np.exp(x - x.max(-1, keepdims=True)) for x in (fp.astype(np.float64), got.astype(np.float64)))
    p, q = p / p.sum(-1, keepdims=True), q / q.sum(-1, keepdims=True)
    kl = float(np.mean(np.sum(p * (np.log(p) - np.log(q)), -1)))
    assert 0 < kl < 0.5, kl


def test_identity_sidecar_equals_no_sidecar(engine, tiny_stack, tmp_path):
    ckpt, base = tiny_stack
    cfg = engine.cfg
    sc = write_sidecar(tmp_path / "sc", cfg, kind="sidecar",
                       gain_deltas={l: np.zeros((cfg.moe_shape(l)[0], cfg.dim)) for l in range(cfg.n_layers)},
                       bias={l: np.zeros(cfg.moe_shape(l)[0]) for l in range(cfg.n_layers)})
    e2 = Engine(base, zchain=sc, engram_dir=ckpt, tokenizer_path=_tok())
    np.testing.assert_array_equal(e2.logits(PROMPT), engine.logits(PROMPT))


def test_sidecar_changes_output_and_posttrain_pairing(engine, tiny_stack, tmp_path):
    ckpt, base = tiny_stack
    cfg = engine.cfg
    rng = np.random.default_rng(0)
    sc = write_sidecar(tmp_path / "sc", cfg, kind="sidecar",
                       gain_deltas={2: rng.normal(0, 0.2, (cfg.moe_shape(2)[0], cfg.dim))},
                       bias={2: rng.normal(0, 0.5, cfg.moe_shape(2)[0])})
    e2 = Engine(base, zchain=sc, engram_dir=ckpt, tokenizer_path=_tok())
    assert not np.array_equal(e2.logits(PROMPT[:10]), engine.logits(PROMPT[:10]))
    side = read_sidecar(sc, cfg)
    pt = write_sidecar(tmp_path / "pt", cfg, kind="posttrain", gain_deltas={7: np.zeros((32, cfg.dim))}, base=side)
    Engine(base, zchain=sc, posttrain=pt, engram_dir=ckpt, tokenizer_path=_tok())     # the right pair loads
    other = write_sidecar(tmp_path / "sc2", cfg, kind="sidecar", bias={1: np.ones(32)})
    with pytest.raises(EngineError, match="refusing the mismatched pair"):
        Engine(base, zchain=other, posttrain=pt, engram_dir=ckpt, tokenizer_path=_tok())
    with pytest.raises(EngineError, match="stacks on a sidecar"):
        Engine(base, posttrain=pt, engram_dir=ckpt, tokenizer_path=_tok())


def test_sidecar_files_are_validated(engine, tmp_path):
    cfg = engine.cfg
    sc = write_sidecar(tmp_path / "sc", cfg, kind="sidecar", gain_deltas={2: np.zeros((32, cfg.dim))})
    f = sc / "gr_L02.bin"
    f.write_bytes(f.read_bytes()[:-5])
    with pytest.raises(Exception, match="truncated"):
        read_sidecar(sc, cfg)
    man = json.loads((sc / "manifest.json").read_text())
    man["version"] = 99
    (sc / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(Exception, match="format version 99"):
        read_sidecar(sc, cfg)


def test_missing_engram_table_is_an_error_at_load(tiny_stack, tmp_path):
    ckpt, base = tiny_stack
    with pytest.raises(EngineError, match="does not exist"):
        Engine(base, engram_dir=tmp_path / "nowhere", tokenizer_path=_tok())
    empty = tmp_path / "no_tables"
    empty.mkdir()
    shutil.copy(ckpt / "config.json", empty / "config.json")
    with pytest.raises(EngineError, match="Engram tables"):
        Engine(base, engram_dir=empty, tokenizer_path=_tok())


def test_memory_budget_refusal_names_the_figures(tiny_stack):
    ckpt, base = tiny_stack
    with pytest.raises(EngineError, match=r"does not fit --mem-budget-mb 1: weights .* MB"):
        Engine(base, engram_dir=ckpt, tokenizer_path=_tok(), mem_budget_mb=1)


def test_context_bound_and_bad_requests(engine):
    s = engine.new_session()
    with pytest.raises(EngineError, match="context"):
        engine.prefill(s, [5] * (engine.context_length + 1))
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(EngineError, match="empty"):
        list(engine.generate_ids([], SamplingParams()))


def test_stop_strings_are_cut(engine):
    p = SamplingParams(temperature=0, max_tokens=20)
    full = [e for e in engine.generate(PROMPT, p)][-1]["text"]
    if len(full) < 4:
        pytest.skip("the random model produced too little text to cut")
    stop = full[2:4]
    out = [e for e in engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, stop=(stop,)))]
    assert out[-1]["finish_reason"] == "stop"
    assert out[-1]["text"] == full[:full.find(stop)]
    assert "".join(e["text"] for e in out if e["type"] == "token") == out[-1]["text"]


def test_interleaved_generations_batch_their_decodes_and_match_alone(engine):
    """Generations run as the server's worker runs them (batched=True: each token event carries the forward it asks
    for; Engine.decode_batch runs a round's forwards together) give each prompt the tokens it gets alone, greedy and
    seeded; a generation resumed without its forward run makes it itself; a stop string leaves the forward off."""
    from ds4lib.engine import PendingDecode
    from tests.engine.test_engine_cuda import interleaved
    prompts = [PROMPT, PROMPT[:7], PROMPT[5:30]]
    for p in (SamplingParams(temperature=0, max_tokens=6, draft_k=0),
              SamplingParams(temperature=1.0, max_tokens=6, seed=4, draft_k=0),
              SamplingParams(temperature=0, max_tokens=6, draft_k=3)):       # speculative: decodes on its own (a
                                                                             # fixed k: None lets wall-clock costs
                                                                             # choose plain steps, as under load)
        alone = [[t for t in engine.generate_ids(q, p) if t != 1] for q in prompts]
        assert interleaved(engine, prompts, p) == alone
        events = list(engine.generate(prompts[1], p, batched=True))           # nobody runs the forwards
        tokens = [e for e in events if e["type"] == "token" and e["id"] is not None]
        assert [e["id"] for e in tokens] == alone[1]
        plain = p.draft_k == 0 or not engine.speculative
        assert all(isinstance(e.get("decode"), PendingDecode) == plain for e in tokens[:-1])
    full = [e for e in engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20))][-1]["text"]
    if len(full) >= 4:
        out = list(engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, stop=(full[2:4],),
                                                          draft_k=0), batched=True))
        assert "decode" not in [e for e in out if e["type"] == "token"][-1]
    s = engine.new_session()
    engine.prefill(s, PROMPT[:3])
    bad = PendingDecode(s, engine.cfg.vocab_size + 5)
    engine.decode_batch([bad])
    with pytest.raises(EngineError, match="outside the model's vocabulary"):
        bad.logits()


def test_batched_decode_rows_equal_their_own_decode_steps(engine):
    """The CPU backend's batched step (ReferenceModel.forward_rows: one call over the rows of three sessions at
    different positions, each session's attention per session) gives each row exactly its own decode step's logits,
    and leaves every state as its own steps do."""
    from ds4lib.engine import PendingDecode
    from tests.engine.test_engine_cuda import batched_against_single
    got, want, _ = batched_against_single(engine, [PROMPT[:3], PROMPT[:17], PROMPT], steps=3)
    np.testing.assert_array_equal(got, want)
    s = engine.new_session()
    engine.prefill(s, PROMPT[:3])
    with pytest.raises(ValueError, match="twice"):
        engine.backend.decode_batch([s.state, s.state], [5, 6])
    p = [PendingDecode(s, 5), PendingDecode(engine.new_session(), 6)]
    engine.prefill(p[1].session, PROMPT[:2])
    engine.decode_batch(p)
    assert [q.session.position for q in p] == [4, 3] and p[0].logits().shape == (engine.cfg.vocab_size,)


def test_engram_checkpoint_found_beside_the_base_by_content_hash(tiny_stack, tmp_path):
    from ds4lib.config import ModelConfig
    from ds4lib.synth import write_random_checkpoint
    ckpt, base = tiny_stack                      # base.gguf and ckpt/ share a folder
    found = Engine(base, tokenizer_path=_tok())
    assert found.engram_dir.resolve() == ckpt.resolve()
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    shutil.copy(base, moved / "base.gguf")
    shutil.copytree(ckpt, moved / "renamed-checkpoint")
    other = write_random_checkpoint(moved / "a-different-model", ModelConfig.tiny(), seed=1)
    e = Engine(moved / "base.gguf", tokenizer_path=_tok())
    assert e.engram_dir.name == "renamed-checkpoint"
    with pytest.raises(EngineError, match="holds checkpoint .* but .* was built from checkpoint"):
        Engine(moved / "base.gguf", engram_dir=other, tokenizer_path=_tok())
    shutil.rmtree(moved / "renamed-checkpoint")
    with pytest.raises(EngineError, match=r"no checkpoint with content hash .*checked a-different-model"):
        Engine(moved / "base.gguf", tokenizer_path=_tok())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_nan_logits_are_an_error_not_a_token(engine, monkeypatch, temperature):
    from ds4lib.ref.sampling import NonFiniteLogits
    real = engine.backend.forward

    def poisoned(state, tokens, last_only=False, observer=None):
        out = real(state, tokens, last_only=last_only, observer=observer)
        out.logits[..., 17] = np.nan
        return out

    monkeypatch.setattr(engine.backend, "forward", poisoned)
    with pytest.raises(NonFiniteLogits, match="NaN"):
        list(engine.generate_ids(PROMPT[:6], SamplingParams(temperature=temperature, max_tokens=2, seed=1)))


def test_warm_up_leaves_no_trace_and_says_so_on_stderr(tiny_stack, capsys):
    """The warm-up's session is thrown away: the prefix cache stays empty and a request after it gives what a
    fresh engine gives. The CPU backend has nothing to compile, and its one line says that."""
    ckpt, base = tiny_stack
    e = Engine(base, engram_dir=ckpt, tokenizer_path=_tok(), prefix_cache_mb=8)
    fresh = Engine(base, engram_dir=ckpt, tokenizer_path=_tok())
    report = e.warm_up()
    line = capsys.readouterr().err
    assert line.count("\n") == 1 and line.startswith("ds4: warming up the cpu backend ... ")
    assert "nothing to compile" in line and report.compiled is None and report.seconds > 0
    assert len(e.prefix_cache) == 0
    p = SamplingParams(temperature=0, max_tokens=6)
    assert list(e.generate_ids(PROMPT, p)) == list(fresh.generate_ids(PROMPT, p))
    assert e.warm_up(quiet=True).backend == "cpu" and capsys.readouterr().err == ""

"""Constrained decoding (ds4lib.engine.constrain): token masks of JSON Schemas over the real tokenizer on short token
sequences, then generation under them on the shipped ds4-tiny (CPU backend): JSON that parses and validates, greedy
and seeded, `length` when max_tokens cuts it, and unconstrained generation still the plain sampler."""
import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from ds4lib.chat import encode_chat
from ds4lib.engine import Engine, GrammarError, JsonFormat, SamplingParams
from ds4lib.engine.constrain import Constrainer
from ds4lib.ref.sampling import allowed_tokens, sample

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "data" / "tokenizer" / "tokenizer.json"
TINY_BASE = ROOT / "models" / "ds4-tiny-base.gguf"
TINY_CKPT = ROOT / "models" / "ds4-tiny"
V, EOS, END_THINK = 8192, 1, 6
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(str(TOKENIZER))


@pytest.fixture(scope="module")
def constrainer():
    return Constrainer(TOKENIZER.read_text(), n_vocab=V, eos=EOS)


def _ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False).ids


def _allowed(c, n=V):
    return allowed_tokens(c.mask(), n)


def test_mask_follows_the_grammar_and_eos_needs_acceptance(constrainer, tokenizer):
    c = constrainer.start(JsonFormat.from_schema(SCHEMA))
    a = _allowed(c)
    assert a[tokenizer.token_to_id("{")] and not a[tokenizer.token_to_id("[")] and not a[:9].any()   # specials never
    for t in _ids(tokenizer, '{"ok": true, "n": 7'):
        assert _allowed(c)[t] and not _allowed(c)[EOS] and not c.accepting
        c.advance(t)
    a = _allowed(c)
    assert a[tokenizer.token_to_id("}")] and not a[tokenizer.token_to_id(",")] and not a[EOS]      # no more keys
    assert not a[tokenizer.token_to_id("0")]                                                         # n <= 9
    c.advance(tokenizer.token_to_id("}"))
    assert c.accepting and c.finished
    assert np.flatnonzero(_allowed(c)).tolist() == [EOS]


def test_a_token_outside_the_mask_is_refused(constrainer, tokenizer):
    c = constrainer.start(JsonFormat.from_schema({"type": "object"}))
    with pytest.raises(GrammarError):
        c.advance(tokenizer.token_to_id("["))


def test_mask_spans_the_model_vocabulary(tokenizer):
    """Tokenizer ids >= V are dropped; model ids past the tokenizer are never allowed."""
    brace = tokenizer.token_to_id("{")                                  # 99: inside a 100-token vocabulary
    small = Constrainer(TOKENIZER.read_text(), n_vocab=100, eos=EOS).start(JsonFormat.from_schema({"type": "object"}))
    m = small.mask()
    assert m.shape == (4,) and np.flatnonzero(allowed_tokens(m, 100)).tolist() == [brace]
    big = Constrainer(TOKENIZER.read_text(), n_vocab=V + 40, eos=EOS).start(JsonFormat.from_schema({"type": "integer"}))
    a = allowed_tokens(big.mask(), V + 40)
    assert big.mask().shape == (258,) and a[:V].any() and not a[V:].any()


def test_after_token_leaves_the_thinking_section_free(constrainer, tokenizer):
    c = constrainer.start(JsonFormat.from_schema({"type": "object"}, after_token=END_THINK))
    a = _allowed(c)
    assert a.sum() == V - 1 and not a[EOS] and not c.started
    for t in _ids(tokenizer, "Some reasoning [x]"):
        c.advance(t)
    c.advance(END_THINK)
    a = _allowed(c)
    assert c.started and a[tokenizer.token_to_id("{")] and not a[tokenizer.token_to_id("[")] and not a[EOS]


@pytest.mark.parametrize("schema", [{"type": "strin"}, {"type": "object", "if": {}}, [1],
                                    {"properties": {"x": {"$ref": "#/definitions/nope"}}},
                                    {"type": "string", "pattern": "(["}])
def test_bad_schemas_are_refused_before_any_request(schema):
    with pytest.raises(GrammarError):
        JsonFormat.from_schema(schema)


# --------------------------------------------------------------------------------------------- generation, CPU
@pytest.fixture(scope="module")
def engine():
    return Engine(TINY_BASE, engram_dir=TINY_CKPT)


@pytest.fixture(scope="module")
def prompt(engine):
    return encode_chat(engine.tokenizer, [{"role": "user", "content": "Give the capital of France as JSON."}])


def _run(engine, prompt, **kw):
    return list(engine.generate(prompt, SamplingParams(**kw)))[-1]


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.8, seed=1),
                                      dict(temperature=0.9, top_p=0.9, top_k=40, seed=2)])
def test_json_object_output_parses(engine, prompt, sampling):
    done = _run(engine, prompt, max_tokens=40, json_format=JsonFormat.from_schema({"type": "object"}), **sampling)
    assert done["finish_reason"] == "stop", done
    assert isinstance(json.loads(done["text"]), dict)


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.8, seed=3)])
def test_json_schema_output_validates(engine, prompt, sampling):
    import jsonschema
    done = _run(engine, prompt, max_tokens=40, json_format=JsonFormat.from_schema(PERSON), **sampling)
    assert done["finish_reason"] == "stop", done
    jsonschema.validate(json.loads(done["text"]), PERSON)


def test_max_tokens_before_the_json_closes_is_length(engine, prompt):
    done = _run(engine, prompt, max_tokens=3, temperature=0, json_format=JsonFormat.from_schema(PERSON))
    assert done["finish_reason"] == "length" and done["completion_tokens"] == 3
    with pytest.raises(json.JSONDecodeError):
        json.loads(done["text"])


def test_constrained_greedy_is_the_best_allowed_token_and_plain_greedy_is_unchanged(engine, prompt):
    """Step by step against ds4lib.ref.sampling on the engine's own logits: with a mask, the argmax over the allowed
    tokens; without one, the plain sampler (greedy and seeded) exactly as before constrained decoding existed."""
    fmt = JsonFormat.from_schema(PERSON)
    got = list(engine.generate_ids(prompt, SamplingParams(temperature=0, max_tokens=4, json_format=fmt)))
    c = engine.constrainer.start(fmt)
    s = engine.new_session()
    logits = engine.prefill(s, prompt)
    want = []
    for _ in range(4):
        mask = c.mask()
        t = int(np.argmax(np.where(allowed_tokens(mask, V), logits, -np.inf)))
        assert t == sample(logits, temperature=0, mask=mask)
        want.append(t)
        c.advance(t)
        logits = engine.decode(s, t)
    assert got == want and got[0] != int(np.argmax(engine.logits(prompt)[-1]))      # the mask changed the choice
    for p in (SamplingParams(temperature=0, max_tokens=5), SamplingParams(temperature=0.8, seed=9, max_tokens=5)):
        got = list(engine.generate_ids(prompt, p))
        s = engine.new_session()
        logits, want = engine.prefill(s, prompt), []
        for step in range(5):
            want.append(sample(logits, temperature=p.temperature, seed=9, step=step))
            if want[-1] == EOS:
                break
            logits = engine.decode(s, want[-1])
        assert got == want

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


# --------------------------------------------------------------------------------------------- forced tool calls
WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string", "description": "a plain string: raw"}, "unit": {"type": "string", "enum": ["c", "f"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}, "hourly": {"type": "boolean"}},
    "required": ["city", "days"]}}
CLOCK = {"name": "get_time", "parameters": {"type": "object", "properties": {}}}
PING = {"name": "ping"}
LOOSE = {"name": "loose", "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                          "b": {"type": "array",
                                                                                "items": {"$ref": "#/$defs/n"}}},
                                         "$defs": {"n": {"type": "number"}}}}
ORDER_ID = {"name": "order", "parameters": {"type": "object", "properties": {
    "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "note": {"type": "string", "maxLength": 5},
    "tag": {"type": "string", "pattern": "^a|b$"}}, "required": ["id"]}}


def _call(name, **args):
    return {"name": name, "arguments": json.dumps(args)}


def _feed(c, tokenizer, text):
    """Feeds `text` token by token, each checked against the mask first; the index of the first refused token, or
    None when all pass."""
    for i, t in enumerate(_ids(tokenizer, text)):
        if not _allowed(c)[t]:
            return i
        c.advance(t)
    return None


def _block(calls):
    from ds4lib.dsml import render_tool_calls
    return "".join(text for text, _ in render_tool_calls(calls))


@pytest.mark.parametrize("calls", [
    [_call("get_weather", city="Paris", days=2)],
    [_call("get_weather", city="Lyon </b> <x>\nline two", unit="f", days=7, hourly=False)],
    [_call("get_weather", city="", days=1, hourly=True)],
    [_call("get_time"), _call("ping"), _call("get_weather", city="Nice", unit="c", days=3)],
    [_call("loose")], [_call("loose", b=[1, 2.5])], [_call("loose", a=-3, b=[])], [_call("loose", a=0)],
])
def test_rendered_tool_calls_are_accepted_token_by_token(constrainer, tokenizer, calls):
    from ds4lib.engine import ToolCallFormat
    c = constrainer.start(ToolCallFormat.from_tools([WEATHER, CLOCK, PING, LOOSE]))
    assert not _allowed(c)[EOS]
    assert _feed(c, tokenizer, _block(calls)) is None
    assert c.accepting and c.finished and np.flatnonzero(_allowed(c)).tolist() == [EOS]


def _refused_at(constrainer, tokenizer, fmt, text, bad: str, last: bool = False):
    """`text` is refused at the first character the grammar does not allow: the first character of `bad` (its first
    occurrence, or its last). The refused token holds it, or ends just before it where the tokenizer splits the text
    differently from what the grammar still allows (after `get`, only `_time` continues `get_time`, not `_`)."""
    c = constrainer.start(fmt)
    i = _feed(c, tokenizer, text)
    assert i is not None, "accepted"
    ids = _ids(tokenizer, text)
    at = text.rindex(bad) if last else text.index(bad)
    assert text.startswith(tokenizer.decode(ids[:i]))
    assert at - 4 <= len(tokenizer.decode(ids[:i])) <= at, (tokenizer.decode(ids[:i + 1]), bad)


@pytest.mark.parametrize("calls,bad", [
    ([_call("get_wetter", city="P", days=2)], "tter"),                             # not a tool
    ([_call("get_weather", days=2)], 'days"'),                                      # city is required
    ([_call("get_weather", city="P")], "/｜DSML｜invoke>"),                           # days is required
    ([_call("get_weather", city="P", days="2")], 'true">2'),                        # days is an integer: JSON
    ([_call("get_weather", city="P", days=9)], "9<"),                               # maximum 7
    ([_call("get_weather", city="P", unit="k", days=1)], "k<"),                     # enum
    ([_call("get_weather", days=2, city="P")], 'days"'),                            # schema order
    ([_call("get_weather", city="a</｜DSML｜invoke>", days=2)], "></｜DSML｜parameter>"),  # would end the call
    ([_call("loose", b=["x"])], '"x"'),                                             # $ref items: numbers
    ([_call("get_time", x=1)], "<｜DSML｜parameter"),                                # no parameters
])
def test_wrong_calls_are_refused_where_they_go_wrong(constrainer, tokenizer, calls, bad):
    from ds4lib.engine import ToolCallFormat
    _refused_at(constrainer, tokenizer, ToolCallFormat.from_tools([WEATHER, CLOCK, LOOSE]), _block(calls), bad)


def test_single_call_and_named_tool(constrainer, tokenizer):
    from ds4lib.engine import ToolCallFormat
    one = ToolCallFormat.from_tools([WEATHER, CLOCK], single=True)
    two = [_call("get_time"), _call("get_time")]
    _refused_at(constrainer, tokenizer, one, _block(two), "｜DSML｜invoke name=\"get_time\">", last=True)
    c = constrainer.start(one)
    assert _feed(c, tokenizer, _block(two[:1])) is None and c.finished
    named = ToolCallFormat.from_tools([CLOCK])
    _refused_at(constrainer, tokenizer, named, _block([_call("get_weather", city="P", days=2)]), "weather")
    c = constrainer.start(named)
    assert _feed(c, tokenizer, _block(two)) is None and c.finished                 # parallel calls of it


def test_every_allowed_text_reads_back_as_a_valid_call(constrainer, tokenizer):
    """Random walks under the mask (uniform over the allowed tokens) parse back into calls of the given tools whose
    arguments validate."""
    import jsonschema

    from ds4lib.dsml import TOOL_CALLS_START, parse_tool_calls
    from ds4lib.engine import ToolCallFormat
    tools = [WEATHER, CLOCK, LOOSE, ORDER_ID]
    schemas = {t["name"]: t.get("parameters", {}) for t in tools}
    fmt = ToolCallFormat.from_tools(tools)
    rng = np.random.default_rng(0)
    done = 0
    for _ in range(30):
        c, ids = constrainer.start(fmt), []
        while len(ids) < 400 and not c.finished:
            allowed = np.flatnonzero(_allowed(c))
            t = int(rng.choice(allowed))
            if t == EOS:
                break
            c.advance(t)
            ids.append(t)
        if not c.finished:
            continue
        text = tokenizer.decode(ids)
        assert text.startswith(TOOL_CALLS_START)
        calls = parse_tool_calls(text[len(TOOL_CALLS_START):])
        assert calls
        for call in calls:
            jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])
        done += 1
    assert done >= 5


@pytest.mark.parametrize("tools", [[], [{"name": "f", "parameters": {"type": "object", "anyOf": [{}]}}],
                                   [{"name": "f", "parameters": {"type": "array"}}],
                                   [{"name": "f", "parameters": {"properties": {"a": {"type": "strin"}}}}],
                                   [{"name": "f", "parameters": {"required": ["a"], "additionalProperties": False}}],
                                   [{"name": 'f"', "parameters": {}}]])
def test_tools_the_grammar_cannot_enforce_are_refused(tools):
    from ds4lib.engine import ToolCallFormat
    with pytest.raises(GrammarError):
        ToolCallFormat.from_tools(tools)


def test_a_forced_call_may_follow_free_reasoning(constrainer, tokenizer):
    from ds4lib.engine import ToolCallFormat
    c = constrainer.start(ToolCallFormat.from_tools([CLOCK], after_token=END_THINK))
    assert _feed(c, tokenizer, "thinking about <｜DSML｜invoke") is None and not c.started
    c.advance(END_THINK)
    assert _feed(c, tokenizer, _block([_call("get_time")])) is None and c.finished



def test_constrained_strings_may_be_written_raw_as_the_encoder_writes_them(constrainer, tokenizer):
    """A string with an anchored pattern and / or length limits is allowed raw (string="true", as render_tool_calls
    and the official encoder write every string) and as JSON; raw text outside the pattern or the length is refused;
    a pattern the raw form cannot say the same of (unanchored, top-level |) stays JSON only."""
    from ds4lib.engine import ToolCallFormat
    fmt = ToolCallFormat.from_tools([ORDER_ID])
    c = constrainer.start(fmt)
    assert _feed(c, tokenizer, _block([_call("order", id="ABC-1234", note="hi")])) is None and c.finished
    as_json = _block([_call("order", id="ABC-1234")]).replace('string="true">ABC-1234', 'string="false">"ABC-1234"')
    c = constrainer.start(fmt)
    assert _feed(c, tokenizer, as_json) is None and c.finished
    _refused_at(constrainer, tokenizer, fmt, _block([_call("order", id="AB-1234")]), "-1234")
    _refused_at(constrainer, tokenizer, fmt, _block([_call("order", id="ABC-1234", note="toolong")]), "ng<")
    _refused_at(constrainer, tokenizer, fmt, _block([_call("order", id="ABC-1234", tag="a")]), 'true">a', last=True)

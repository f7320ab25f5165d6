"""Forced tool calls through the server on the shipped ds4-tiny (CPU), in-process through the official SDKs over
httpx's WSGI transport: OpenAI tool_choice required / named (parallel_tool_calls; chat completions and responses,
streamed too), Anthropic tool_choice any / tool (disable_parallel_tool_use), thinking mode (the call after
</think>); every call names an allowed tool and its arguments validate; an unknown name and a forced choice with
response_format are 400s in each API's shape; auto is unchanged (the tiny model answers in prose)."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

WEATHER = {"name": "get_weather", "description": "Weather forecast for a city.", "parameters": {
    "type": "object", "properties": {"unit": {"type": "string", "enum": ["c", "f"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                     "hourly": {"type": "boolean"}},
    "required": ["unit", "days"], "additionalProperties": False}}
CLOCK = {"name": "get_time", "description": "The time now.", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"]}}
TOOLS = {t["name"]: t["parameters"] for t in (WEATHER, CLOCK)}
OA_TOOLS = [{"type": "function", "function": t} for t in (WEATHER, CLOCK)]
AN_TOOLS = [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]}
            for t in (WEATHER, CLOCK)]
Q = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def app(shipped_app):
    return shipped_app


@pytest.fixture(scope="module")
def http(app):
    return httpx.Client(transport=httpx.WSGITransport(app=app), base_url="http://ds4.test", timeout=300)


@pytest.fixture(scope="module")
def openai_sdk(http):
    import openai
    return openai.OpenAI(base_url="http://ds4.test/v1", api_key="unused", http_client=http, max_retries=0)


@pytest.fixture(scope="module")
def anthropic_sdk(app):
    import anthropic
    import httpx2                                            # the Anthropic SDK's own httpx
    client = httpx2.Client(transport=httpx2.WSGITransport(app=app), base_url="http://ds4.test", timeout=300)
    return anthropic.Anthropic(base_url="http://ds4.test", api_key="unused", http_client=client, max_retries=0)


def _check(calls, names):
    """[(name, arguments dict)]: each of an allowed tool, its arguments valid under its schema."""
    assert calls
    for name, args in calls:
        assert name in names
        jsonschema.validate(args, TOOLS[name])


@pytest.mark.parametrize("choice,names,parallel", [        # streamed too where parallel is None
    ("required", ("get_weather", "get_time"), None),
    ({"type": "function", "function": {"name": "get_time"}}, ("get_time",), False)])
def test_openai_forced_calls(openai_sdk, choice, names, parallel):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    r = openai_sdk.chat.completions.create(model="ds4", messages=Q, tools=OA_TOOLS, tool_choice=choice,
                                           max_tokens=200, temperature=0, **extra)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and not msg.content
    _check([(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls], names)
    if parallel is False:
        assert len(msg.tool_calls) == 1
        return
    chunks = list(openai_sdk.chat.completions.create(model="ds4", messages=Q, tools=OA_TOOLS, tool_choice=choice,
                                                     max_tokens=200, temperature=0, stream=True, **extra))
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [d.function.name for d in deltas if d.function.name] == [c.function.name for c in msg.tool_calls]


@pytest.mark.parametrize("choice,names", [({"type": "any"}, ("get_weather", "get_time")),
                                          ({"type": "tool", "name": "get_time", "disable_parallel_tool_use": True},
                                           ("get_time",))])
def test_anthropic_forced_tool_use(anthropic_sdk, choice, names):
    r = anthropic_sdk.messages.create(model="ds4", messages=Q, tools=AN_TOOLS, tool_choice=choice, max_tokens=200,
                                      extra_body={"temperature": 0})
    assert r.stop_reason == "tool_use" and {b.type for b in r.content} == {"tool_use"}
    _check([(b.name, b.input) for b in r.content], names)
    if choice.get("disable_parallel_tool_use"):
        assert len(r.content) == 1


RS_TOOLS = [dict(t, type="function") for t in (WEATHER, CLOCK)]


def test_responses_forced_call(openai_sdk, http):
    """/v1/responses: a named tool_choice makes a function_call output item (streamed: added, arguments delta and
    done, item done, in order); sending it back with its output as input items is accepted."""
    ask = dict(model="ds4", input="What time is it?", tools=RS_TOOLS, tool_choice={"type": "function",
                                                                                 "name": "get_time"},
               parallel_tool_calls=False, max_output_tokens=200, temperature=0)
    r = openai_sdk.responses.create(**ask)
    assert r.status == "completed" and r.tool_choice.name == "get_time" and r.parallel_tool_calls is False
    assert [t.name for t in r.tools] == ["get_weather", "get_time"]
    (call,) = r.output
    assert call.type == "function_call" and call.status == "completed" and call.name == "get_time"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    _check([(call.name, json.loads(call.arguments))], ("get_time",))
    events = list(openai_sdk.responses.create(**ask, stream=True))
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added, delta, done, item_done = events[2:6]
    assert added.item.status == "in_progress" and added.item.arguments == "" and added.item.name == "get_time"
    assert {added.output_index, delta.output_index, done.output_index, item_done.output_index} == {0}
    assert delta.item_id == done.item_id == added.item.id == item_done.item.id
    assert delta.delta == done.arguments == item_done.item.arguments == call.arguments       # greedy: the same call
    assert item_done.item.status == "completed" and events[-1].response.output[0].arguments == call.arguments
    follow = [{"role": "user", "content": "What time is it?"}, call.model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}]
    r2 = http.post("/v1/responses", json={"model": "ds4", "input": follow, "tools": RS_TOOLS, "max_output_tokens": 4,
                                          "temperature": 0})
    assert r2.status_code == 200, r2.json()
    assert r2.json()["output"][-1]["type"] == "message"


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": {"type": "function", "name": "get_wetter"}}, "tool_choice.name"),
    ({"tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
])
def test_responses_tool_refusals(http, body, param):
    r = http.post("/v1/responses", json={"input": "hi", "tools": RS_TOOLS, "max_output_tokens": 4, **body})
    assert r.status_code == 400, r.json()
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_thinking_reasons_freely_before_the_call(http, app, monkeypatch):
    """Thinking mode: the engine gets the call grammar starting after `</think>` (the tiny model's reasoning runs past
    any small max_tokens with tools in the prompt, so the grammar's hand-over is checked where it is decided)."""
    from ds4lib.chat import END_THINK
    from ds4lib.engine import ToolCallFormat
    engine = app.extensions["ds4"].worker.engine
    seen = []
    real = engine.generate

    def generate(prompt_ids, params, **kw):
        seen.append(params.json_format)
        return real(prompt_ids, params, **kw)

    monkeypatch.setattr(engine, "generate", generate)
    r = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "tools": OA_TOOLS, "max_tokens": 20, "temperature": 0,
        "think": True, "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["reasoning_content"]     # free reasoning
    (fmt,) = seen
    assert isinstance(fmt, ToolCallFormat) and fmt.after_token == engine.tokenizer.token_to_id(END_THINK)
    assert '"get_time' in fmt.lark and "get_weather" not in fmt.lark


def test_auto_is_unchanged(http):
    """auto: no grammar, the same greedy reply as before forced calls existed (the tiny model writes prose)."""
    body = {"messages": Q, "tools": OA_TOOLS, "max_tokens": 12, "temperature": 0}
    auto = http.post("/v1/chat/completions", json={**body, "tool_choice": "auto"}).json()["choices"][0]
    assert auto == http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert auto["finish_reason"] == "length" and "tool_calls" not in auto["message"]


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": {"type": "function", "function": {"name": "get_wetter"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}}, "response_format"),
    ({"tool_choice": "required", "tools": None}, "tool_choice"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "oneOf": [{"required": ["a"]}]}}}]}, "tools"),
])
def test_openai_refusals(http, body, param):
    r = http.post("/v1/chat/completions", json={"messages": Q, "tools": OA_TOOLS, "max_tokens": 4, **body})
    assert r.status_code == 400, r.json()
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


@pytest.mark.parametrize("body", [{"tool_choice": {"type": "tool", "name": "get_wetter"}},
                                  {"tool_choice": {"type": "any"},
                                   "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
                                  {"tool_choice": {"type": "tool"}}])
def test_anthropic_refusals(http, body):
    r = http.post("/v1/messages", json={"messages": Q, "tools": AN_TOOLS, "max_tokens": 4, **body})
    assert r.status_code == 400, r.json()
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]

"""Structured output through the server on the shipped ds4-tiny (models/ds4-tiny-base.gguf with models/ds4-tiny, CPU),
in-process: the official OpenAI SDK over httpx's WSGI transport and Flask's test client. response_format json_object
and json_schema (plain and streamed, greedy and seeded), /v1/responses text.format, Anthropic output_config.format,
thinking mode (the JSON starts after </think>), `length` when max_tokens cuts the JSON, 400s in the OpenAI error shape
for bad or unsupported formats, and a request without response_format unchanged."""
from __future__ import annotations

import json

import httpx
import pytest

USER = [{"role": "user", "content": "Give the capital of France as JSON."}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.fixture(scope="module")
def app(shipped_app):
    return shipped_app


@pytest.fixture(scope="module")
def client(app):
    return app.test_client()


@pytest.fixture(scope="module")
def sdk(app):
    import openai
    http = httpx.Client(transport=httpx.WSGITransport(app=app), base_url="http://ds4.test")
    return openai.OpenAI(base_url="http://ds4.test/v1", api_key="unused", http_client=http, max_retries=0)


def _validate(text: str, schema: dict):
    import jsonschema
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.8, seed=1)])
def test_json_object_parses(sdk, sampling):
    r = sdk.chat.completions.create(model="ds4", messages=USER, max_tokens=40, response_format={"type": "json_object"},
                                    **sampling)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.8, seed=3)])
def test_json_schema_validates_and_the_stream_is_the_same_json(sdk, sampling):
    r = sdk.chat.completions.create(model="ds4", messages=USER, max_tokens=40, response_format=JSON_SCHEMA, **sampling)
    assert r.choices[0].finish_reason == "stop"
    value = _validate(r.choices[0].message.content, PERSON)
    chunks = list(sdk.chat.completions.create(model="ds4", messages=USER, max_tokens=40, response_format=JSON_SCHEMA,
                                              stream=True, **sampling))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert json.loads(text) == value and chunks[-1].choices[0].finish_reason == "stop"


def test_sdk_parse_helper_gets_a_pydantic_object(sdk):
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int

    r = sdk.chat.completions.parse(model="ds4", messages=USER, max_tokens=40, temperature=0, response_format=Person)
    assert isinstance(r.choices[0].message.parsed, Person)


def test_max_tokens_before_the_json_closes_is_length(client):
    r = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 3, "temperature": 0,
                                                  "response_format": JSON_SCHEMA})
    assert r.status_code == 200 and r.json["choices"][0]["finish_reason"] == "length"
    r = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 3, "temperature": 0,
                                           "text": {"format": {"type": "json_schema", "name": "p", "schema": PERSON}}})
    assert r.json["status"] == "incomplete" and r.json["incomplete_details"] == {"reason": "max_output_tokens"}


def test_responses_text_format(client):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    r = client.post("/v1/responses", json={"input": USER[0]["content"], "max_output_tokens": 40, "temperature": 0,
                                           "text": {"format": fmt}})
    assert r.status_code == 200 and r.json["status"] == "completed" and r.json["text"]["format"] == fmt
    _validate(r.json["output"][-1]["content"][0]["text"], PERSON)


@pytest.mark.parametrize("field", [{"output_config": {"format": {"type": "json_schema", "schema": PERSON}}},
                                   {"output_format": {"type": "json_schema", "schema": PERSON}}])
def test_anthropic_output_format(client, field):
    r = client.post("/v1/messages", json={"max_tokens": 40, "temperature": 0, "messages": USER, **field})
    assert r.status_code == 200 and r.json["stop_reason"] == "end_turn"
    _validate(r.json["content"][0]["text"], PERSON)
    bad = {k: {"format": {"type": "json_schema", "schema": {"type": "strin"}}} if k == "output_config" else
           {"type": "json_schema", "schema": {"type": "strin"}} for k in field}
    r = client.post("/v1/messages", json={"max_tokens": 4, "messages": USER, **bad})
    assert r.status_code == 400 and r.json["type"] == "error" and r.json["error"]["type"] == "invalid_request_error"


def test_thinking_reasons_freely_then_answers_json(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 60,
                                                  "temperature": 0, "think": True,
                                                  "response_format": {"type": "json_object"}})
    msg = r.json["choices"][0]["message"]
    assert r.json["choices"][0]["finish_reason"] == "stop" and msg["reasoning_content"]
    assert isinstance(json.loads(msg["content"]), dict)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "if": {"required": ["a"]}}}}}, "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                          "schema": [1]}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format.type"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "response_format"),
    ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"$ref": "#/nope"}}}},
     "text.format.schema"),
])
def test_bad_formats_are_400_in_the_openai_shape(client, path, body, param):
    base = {"messages": USER} if path.endswith("completions") else {"input": "hi"}
    r = client.post(path, json={**base, "max_tokens": 4, **body})
    assert r.status_code == 400, r.json
    err = r.json["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_a_request_without_response_format_is_unchanged(client, app):
    """No format and {"type": "text"} are the same free-text request: the engine's plain greedy generation."""
    from ds4lib.engine import SamplingParams
    body = {"messages": USER, "max_tokens": 8, "temperature": 0}
    plain = client.post("/v1/chat/completions", json=body).json["choices"][0]["message"]["content"]
    text = client.post("/v1/chat/completions", json={**body, "response_format": {"type": "text"}}).json
    assert text["choices"][0]["message"]["content"] == plain
    engine = app.extensions["ds4"].worker.engine
    from ds4lib.chat import encode_chat
    done = list(engine.generate(encode_chat(engine.tokenizer, USER), SamplingParams(temperature=0, max_tokens=8)))[-1]
    assert done["text"] == plain

"""Bad requests against the live server: each is a 4xx with a JSON body in the calling API's own error shape,
and the process keeps serving afterwards."""
from __future__ import annotations

import pytest

CHAT = "/v1/chat/completions"
MSGS = "/v1/messages"
OK_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
OK_MSGS = {"model": "ds4-test", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}


def _openai_error(r, status=400):
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def _anthropic_error(r, status=400):
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize("path", [CHAT, "/v1/completions", "/v1/responses"])
def test_malformed_json_openai_shape(live_server, path):
    err = _openai_error(live_server.post(path, content=b'{"messages": [', headers={"content-type": "application/json"}))
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_json"


@pytest.mark.parametrize("path", [MSGS, "/v1/messages/count_tokens"])
def test_malformed_json_anthropic_shape(live_server, path):
    err = _anthropic_error(live_server.post(path, content=b"\xff\xfe not json"))
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("patch,param", [
    ({"temperature": "hot"}, "temperature"), ({"max_tokens": "ten"}, "max_tokens"), ({"top_p": 0}, "top_p"),
    ({"messages": "hi"}, "messages"), ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "c", "content": "x"}]},
     "messages"),
    ({"tool_choice": {"type": "function", "function": {"name": "g"}}, "tools": [{"type": "function",
                                                                                 "function": {"name": "f"}}]},
     "tool_choice.function.name"),
    ({"stop": 3}, "stop"),
    ({"stream": "yes"}, "stream"), ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"reasoning_effort": "medium"}, "reasoning_effort"),
    ({"thinking": {"type": "sometimes"}}, "thinking.type"), ({"n": 2}, "n"), ({"max_tokens": 0}, "max_tokens"),
    ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools[0].function.name"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
])
def test_wrong_types_and_unsupported_fields_openai(live_server, patch, param):
    err = _openai_error(live_server.post(CHAT, json={**OK_CHAT, **patch}))
    assert err["param"] == param


@pytest.mark.parametrize("raw", [b'{"temperature": NaN}', b'{"top_p": Infinity}', b'{"min_p": -Infinity}',
                                 b'{"temperature": 1e999}', b'{"seed": 1, "metadata": {"x": NaN}}'])
def test_non_finite_numbers_are_400_in_each_shape(live_server, raw):
    body = raw[:-1] + b', "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    for path in (CHAT, "/v1/completions", "/v1/responses"):
        err = _openai_error(live_server.post(path, content=body, headers={"content-type": "application/json"}))
        assert err["code"] == "invalid_number" and "finite" in err["message"]
    err = _anthropic_error(live_server.post(MSGS, content=body, headers={"content-type": "application/json"}))
    assert err["type"] == "invalid_request_error" and "finite" in err["message"]


def test_unknown_model_is_404_in_each_shape(live_server):
    for path, body in ((CHAT, OK_CHAT), ("/v1/completions", {"prompt": "x", "max_tokens": 1}),
                       ("/v1/responses", {"input": "hi", "max_output_tokens": 1})):
        err = _openai_error(live_server.post(path, json={**body, "model": "gpt-4o"}), status=404)
        assert err["code"] == "model_not_found" and err["param"] == "model" and "ds4-test" in err["message"]
    err = _anthropic_error(live_server.post(MSGS, json={**OK_MSGS, "model": "claude-opus"}), status=404)
    assert err["type"] == "not_found_error"
    _anthropic_error(live_server.post("/v1/messages/count_tokens", json={**OK_MSGS, "model": "x"}), status=404)
    for name in ("ds4-test", "deepseek-reasoner", "ds4-alias"):
        assert live_server.post(CHAT, json={**OK_CHAT, "model": name}).status_code == 200, name
    r = live_server.post(CHAT, json=OK_CHAT)                                    # no model: the served one
    assert r.status_code == 200 and r.json()["model"] == "ds4-test"
    assert "ds4-alias" in [m["id"] for m in live_server.get("/v1/models").json()["data"]]


def test_non_object_body_and_unknown_fields(live_server):
    _openai_error(live_server.post(CHAT, json=[1, 2]))
    r = live_server.post(CHAT, json={**OK_CHAT, "some_future_field": {"x": 1}, "user": "u1"})
    assert r.status_code == 200, "unknown fields are ignored, as the SDKs send fields a server may not know"


@pytest.mark.parametrize("patch", [{"max_tokens": None}, {"temperature": 1.5}, {"messages": []},
                                   {"messages": [{"role": "system", "content": "x"}]},
                                   {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
                                   {"stop_sequences": "x"}, {"system": 3}, {"thinking": {"budget_tokens": 5}}])
def test_wrong_types_anthropic(live_server, patch):
    _anthropic_error(live_server.post(MSGS, json={k: v for k, v in {**OK_MSGS, **patch}.items() if v is not None}))


def test_prompt_longer_than_context(live_server):
    long_text = "ledger " * 70_000                                       # > 65,536 tokens
    err = _openai_error(live_server.post(CHAT, json={**OK_CHAT, "messages": [{"role": "user", "content": long_text}]}))
    assert err["code"] == "context_length_exceeded"
    err = _anthropic_error(live_server.post(MSGS, json={**OK_MSGS, "messages": [{"role": "user",
                                                                                 "content": long_text}]}))
    assert "context" in err["message"]
    err = _openai_error(live_server.post("/v1/completions", json={"prompt": long_text, "max_tokens": 1}))
    assert err["code"] == "context_length_exceeded"


def test_max_tokens_beyond_context(live_server):
    err = _openai_error(live_server.post(CHAT, json={**OK_CHAT, "max_tokens": 70_000}))
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"


def test_unsupported_conversation_shape(live_server):
    err = _openai_error(live_server.post(CHAT, json={**OK_CHAT, "messages": [{"role": "assistant", "content": "x"}]}))
    assert "user message" in err["message"]
    err = _openai_error(live_server.post("/v1/responses", json={"input": "hi", "previous_response_id": "resp_1"}))
    assert err["param"] == "previous_response_id"


def test_unknown_route_and_method(live_server):
    _openai_error(live_server.post("/v1/nope", json={}), status=404)
    _openai_error(live_server.get(CHAT), status=405)
    _anthropic_error(live_server.get(MSGS), status=405)
    _openai_error(live_server.get("/v1/models/not-served"), status=404)


def test_server_survives_bad_requests(live_server):
    for body in (b"", b"null", b"[]", b'{"messages": null}', b"\x00" * 10):
        assert live_server.post(CHAT, content=body).status_code == 400
        assert live_server.post(MSGS, content=body).status_code == 400
    assert live_server.get("/health").status_code == 200
    r = live_server.post(CHAT, json=OK_CHAT)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert live_server.proc.poll() is None

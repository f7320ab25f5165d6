"""The live server driven by the official anthropic client: messages streamed and not, thinking blocks, stop
reasons, stop sequences, count_tokens and the model list.

The current SDK has no temperature argument any more; sampling knobs travel in extra_body, as its docs say
for parameters the SDK does not type."""
from __future__ import annotations

import anthropic
import pytest

Q = [{"role": "user", "content": "What does 'ledger' mean?"}]


GREEDY = {"temperature": 0}


def _create(client, **kw):
    kw.setdefault("messages", Q)
    kw.setdefault("model", "ds4-test")
    kw.setdefault("max_tokens", 6)
    return client.messages.create(**kw)


def test_message_greedy_and_usage(anthropic_client):
    a = _create(anthropic_client, extra_body=GREEDY)
    b = _create(anthropic_client, extra_body=GREEDY)
    assert [blk.type for blk in a.content] == ["text"]
    assert a.content[0].text and a.content[0].text == b.content[0].text
    assert a.stop_reason == "max_tokens" and a.stop_sequence is None
    assert a.usage.output_tokens == 6 and a.usage.input_tokens > 0
    assert a.role == "assistant" and a.type == "message" and a.model == "ds4-test"


def test_stream_helper_matches_non_stream(anthropic_client):
    ref = _create(anthropic_client, extra_body=GREEDY, system="You are terse.")
    with anthropic_client.messages.stream(model="ds4-test", max_tokens=6, messages=Q, extra_body=GREEDY,
                                          system=[{"type": "text", "text": "You are terse."}]) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == ref.content[0].text == final.content[0].text
    assert len(pieces) >= 2, "the text must arrive in several deltas"
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6
    assert final.usage.input_tokens == ref.usage.input_tokens


def test_raw_stream_event_order(anthropic_client):
    events = list(_create(anthropic_client, extra_body=GREEDY, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert events[0].message.usage.input_tokens > 0 and events[0].message.usage.output_tokens == 0
    assert events[-2].usage.output_tokens == 6 and events[-2].delta.stop_reason == "max_tokens"


def test_thinking_blocks_are_apart(anthropic_client):
    r = _create(anthropic_client, extra_body=GREEDY, max_tokens=8,
                thinking={"type": "enabled", "budget_tokens": 1024})
    assert [blk.type for blk in r.content] == ["thinking", "text"]
    assert r.content[0].thinking and "</think>" not in r.content[0].thinking
    with anthropic_client.messages.stream(model="ds4-test", max_tokens=8, messages=Q, extra_body=GREEDY,
                                          thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        thinking = "".join(e.thinking for e in stream if e.type == "thinking")
        final = stream.get_final_message()
    assert thinking == r.content[0].thinking == final.content[0].thinking
    assert [blk.type for blk in final.content] == ["thinking", "text"]


def test_other_switches_turn_thinking_on(anthropic_client):
    for kw in ({"model": "deepseek-reasoner"}, {"extra_body": {"think": True}}, {"thinking": {"type": "adaptive"}},
               {"output_config": {"effort": "max"}}):
        r = _create(anthropic_client, extra_body=dict(GREEDY, **kw.pop("extra_body", {})), **kw)
        assert r.content[0].type == "thinking"


def test_stop_sequence(anthropic_client):
    full = _create(anthropic_client, extra_body=GREEDY, max_tokens=12).content[0].text
    k = len(full) // 2
    stop = full[k:k + 2]
    r = _create(anthropic_client, extra_body=GREEDY, max_tokens=12, stop_sequences=["\u2603never", stop])
    assert r.content[0].text == full[:full.find(stop)]
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    with anthropic_client.messages.stream(model="ds4-test", max_tokens=12, messages=Q, extra_body=GREEDY,
                                          stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    assert final.content[0].text == r.content[0].text


def test_count_tokens_matches_usage(anthropic_client):
    n = anthropic_client.messages.count_tokens(model="ds4-test", messages=Q).input_tokens
    assert n == _create(anthropic_client, extra_body=GREEDY, max_tokens=1).usage.input_tokens


def test_assistant_prefill_is_continued(anthropic_client):
    msgs = Q + [{"role": "assistant", "content": "A ledger"}]
    r = _create(anthropic_client, extra_body=GREEDY, messages=msgs)
    assert r.content[0].text and r.usage.output_tokens == 6


def test_models_list(anthropic_client):
    ids = [m.id for m in anthropic_client.models.list().data]
    assert ids == ["ds4-test", "ds4-alias", "deepseek-reasoner"]


def test_sdk_raises_bad_request(anthropic_client):
    with pytest.raises(anthropic.BadRequestError) as e:
        _create(anthropic_client, extra_body={"temperature": 1.5})
    assert e.value.status_code == 400
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"

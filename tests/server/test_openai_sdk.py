"""The live server driven by the official openai client: chat completions, completions and responses, streamed
and not; greedy reproducibility, usage, stop sequences, finish reasons and thinking kept apart."""
from __future__ import annotations

import openai
import pytest

Q = [{"role": "user", "content": "What does 'ledger' mean?"}]


def _chat(client, **kw):
    kw.setdefault("messages", Q)
    kw.setdefault("model", "ds4-test")
    return client.chat.completions.create(**kw)


def test_models_list(openai_client):
    ids = [m.id for m in openai_client.models.list().data]
    assert ids[0] == "ds4-test" and "deepseek-reasoner" in ids


def test_chat_greedy_is_reproducible_and_counts_emitted_tokens(openai_client):
    a = _chat(openai_client, temperature=0, max_tokens=6)
    b = _chat(openai_client, temperature=0, max_tokens=6)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].message.content
    assert a.choices[0].finish_reason == "length"
    assert a.usage.completion_tokens == 6 and a.usage.prompt_tokens > 0
    assert a.usage.total_tokens == a.usage.prompt_tokens + 6
    assert a.model == "ds4-test" and a.object == "chat.completion"
    assert getattr(a.choices[0].message, "reasoning_content", None) is None      # non-thinking by default


def test_chat_stream_matches_non_stream_and_reports_usage(openai_client):
    ref = _chat(openai_client, temperature=0, max_tokens=6)
    chunks = list(_chat(openai_client, temperature=0, max_tokens=6, stream=True,
                        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == ref.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream_without_usage_sends_none(openai_client):
    chunks = list(_chat(openai_client, temperature=0, max_tokens=3, stream=True))
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)


def test_sampling_defaults_are_not_greedy_but_seeded_is_reproducible(openai_client):
    a = _chat(openai_client, max_tokens=6, seed=7)
    b = _chat(openai_client, max_tokens=6, seed=7)
    assert a.choices[0].message.content == b.choices[0].message.content
    greedy = _chat(openai_client, temperature=0, max_tokens=6).choices[0].message.content
    draws = {_chat(openai_client, max_tokens=6, seed=s).choices[0].message.content for s in (1, 2, 3)}
    assert draws != {greedy}, "temperature 1.0 by default: three seeds all equal to greedy is implausible"


def test_stop_sequence_cuts_and_reports_stop(openai_client):
    full = _chat(openai_client, temperature=0, max_tokens=12).choices[0].message.content
    k = len(full) // 2
    stop = full[k:k + 2]
    want = full[:full.find(stop)]
    r = _chat(openai_client, temperature=0, max_tokens=12, stop=[stop])
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens <= 12
    streamed = list(_chat(openai_client, temperature=0, max_tokens=12, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == want


@pytest.mark.parametrize("how", [{"reasoning_effort": "high"}, {"extra_body": {"thinking": {"type": "enabled"}}},
                                 {"extra_body": {"think": True}}, {"model": "deepseek-reasoner"},
                                 {"reasoning_effort": "max"}])
def test_thinking_per_request_keeps_reasoning_apart(openai_client, how):
    r = _chat(openai_client, temperature=0, max_tokens=8, **how)
    msg = r.choices[0].message
    reasoning = msg.reasoning_content
    assert isinstance(reasoning, str) and reasoning
    assert "</think>" not in reasoning and "</think>" not in msg.content
    assert r.usage.completion_tokens_details.reasoning_tokens >= 1


def test_thinking_stream_sends_reasoning_content_deltas(openai_client):
    ref = _chat(openai_client, temperature=0, max_tokens=8, reasoning_effort="high").choices[0].message
    chunks = list(_chat(openai_client, temperature=0, max_tokens=8, reasoning_effort="high", stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == ref.reasoning_content
    assert "".join(d.content or "" for d in deltas) == ref.content


def test_thinking_off_explicitly_beats_reasoner_model(openai_client):
    r = _chat(openai_client, model="deepseek-reasoner", temperature=0, max_tokens=4,
              extra_body={"thinking": {"type": "disabled"}})
    assert getattr(r.choices[0].message, "reasoning_content", None) is None


def test_completions(openai_client):
    a = openai_client.completions.create(model="ds4-test", prompt="The ledger", temperature=0, max_tokens=5)
    assert a.choices[0].text and a.choices[0].finish_reason == "length" and a.usage.completion_tokens == 5
    chunks = list(openai_client.completions.create(model="ds4-test", prompt="The ledger", temperature=0,
                                                   max_tokens=5, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == a.choices[0].text
    assert chunks[-1].usage.completion_tokens == 5
    default_len = openai_client.completions.create(model="ds4-test", prompt="The", temperature=0)
    assert default_len.usage.completion_tokens <= 16                      # OpenAI's default for completions


def test_responses(openai_client):
    r = openai_client.responses.create(model="ds4-test", input="What does 'ledger' mean?", temperature=0,
                                       max_output_tokens=6)
    assert r.output_text and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 6 and r.usage.input_tokens > 0
    events = list(openai_client.responses.create(model="ds4-test", input="What does 'ledger' mean?", temperature=0,
                                                 max_output_tokens=6, stream=True))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.usage.output_tokens == 6


def test_responses_stream_helper_and_reasoning(openai_client):
    # the SDK's helper accumulates the stream; a generation cut by max_output_tokens ends in response.incomplete
    # (get_final_response() only accepts response.completed, as with OpenAI's own API)
    with openai_client.responses.stream(model="ds4-test", input=[{"role": "user", "content": "Hi"}], temperature=0,
                                        max_output_tokens=6, reasoning={"effort": "high"},
                                        instructions="Be brief.") as stream:
        events = list(stream)
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning
    final = events[-1].response
    assert events[-1].type == "response.incomplete" and final.status == "incomplete"
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == reasoning
    assert final.usage.output_tokens_details.reasoning_tokens >= 1
    plain = openai_client.responses.create(model="ds4-test", input=[{"role": "user", "content": "Hi"}],
                                           temperature=0, max_output_tokens=6, reasoning={"effort": "high"},
                                           instructions="Be brief.")
    assert plain.output[0].content[0].text == reasoning and plain.output[1].content[0].text == final.output_text


def test_sdk_raises_bad_request_on_invalid_input(openai_client):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(openai_client, temperature=5, max_tokens=2)
    assert e.value.status_code == 400 and "temperature" in str(e.value)

"""Tool calling in V4.1's own encoding (ds4lib/dsml.py, ds4lib/chat.py): tool definitions, calls and results in the
prompt; generated calls parsed into OpenAI tool_calls (streamed deltas) and Anthropic tool_use blocks
(input_json_delta), through the official SDKs. The model's tokens are forced into a call at the sampler (the tiny
random model would not call a tool); prefill, decode, the worker, the parsers and the API shapes are the real ones."""
from __future__ import annotations

import json
import random
import threading

import pytest

from ds4lib.chat import ASSISTANT, BOS, END_THINK, EOS, THINK, USER, ChatError, render_chat, split_answer
from ds4lib.dsml import TOOL_CALLS_START, render_tool_calls, render_tools
from server.reply import split_events
from server.schemas import RequestError, parse_chat, parse_messages, parse_responses

D = "｜DSML｜"
TOOL = {"name": "get_weather", "description": "Weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}
CALL_TEXT = (f'\n\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Paris'
             f'</{D}parameter>\n<{D}parameter name="days" string="false">2</{D}parameter>\n</{D}invoke>\n'
             f'</{D}tool_calls>')
CALL = {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}


def test_tools_calls_and_results_render_as_the_official_encoding():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [dict(CALL, id="c1")]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    want = (f"{BOS}S\n\n{render_tools([TOOL])}{USER}Weather?{ASSISTANT}{END_THINK}{CALL_TEXT}{EOS}"
            f"{USER}<tool_result>sunny</tool_result>{ASSISTANT}{END_THINK}")
    assert render_chat(msgs, tools=[TOOL]) == want
    assert render_tools([TOOL]).startswith("## Tools\n\nYou have access to a set of tools")
    assert json.dumps(TOOL) in render_tools([TOOL])
    # thinking with tools keeps every turn's reasoning; without a system message one is made for the tools
    msgs = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
            {"role": "user", "content": "q2"}]
    assert render_chat(msgs, thinking=True, tools=[TOOL]) == (
        f"{BOS}\n\n{render_tools([TOOL])}{USER}q1{ASSISTANT}{THINK}r1{END_THINK}a1{EOS}{USER}q2{ASSISTANT}{THINK}")


def test_tool_results_follow_the_call_order_and_share_a_user_turn():
    msgs = [{"role": "user", "content": "both"},
            {"role": "assistant", "content": "", "tool_calls": [dict(CALL, id="a"), dict(CALL, id="b")]},
            {"role": "tool", "tool_call_id": "b", "content": "B"}, {"role": "tool", "tool_call_id": "a", "content": "A"},
            {"role": "user", "content": "and?"}]
    assert render_chat(msgs).endswith(
        f"{EOS}{USER}<tool_result>A</tool_result>\n\n<tool_result>B</tool_result>\n\nand?{ASSISTANT}{END_THINK}")
    with pytest.raises(ChatError):
        render_chat([{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "a", "content": "y"}])
    with pytest.raises(ChatError):
        render_chat([{"role": "user", "content": "x"}, {"role": "assistant", "content": "",
                                                        "tool_calls": [dict(CALL, arguments="[1]")]}])


def test_generated_calls_parse_back():
    two = [CALL, {"name": "noop", "arguments": "{}"}]
    text = "Checking." + "".join(t for t, _ in render_tool_calls(two))
    assert split_answer(text) == ("Checking.", two)
    cut = text[:text.rindex(f"<{D}invoke")]                              # max_tokens hit inside the second call
    assert split_answer(cut) == ("Checking.", [CALL])
    assert split_answer("x" + TOOL_CALLS_START + "\n<broken") == ("x" + TOOL_CALLS_START + "\n<broken", [])


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("text", ["Sure." + CALL_TEXT, CALL_TEXT + CALL_TEXT[2:], "r</think>ok" + CALL_TEXT,
                                  "no call\n\n<" + D, "plain answer", "x" + CALL_TEXT[:-30]])
def test_streamed_calls_agree_with_the_parser(text, thinking):
    from ds4lib.chat import parse_reply
    reasoning, answer = parse_reply(text, thinking=thinking)
    content, calls = split_answer(answer)
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 8))))
        deltas = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        got = {"reasoning": "", "answer": "", "tool_call": []}
        for kind, value in split_events([{"type": "token", "text": d} for d in deltas] + [{"type": "done"}],
                                        thinking, tools=True):
            if kind == "tool_call":
                got[kind].append({"name": value["name"], "arguments": value["arguments"]})
            elif kind != "done":
                got[kind] += value
        assert (got["reasoning"], got["answer"], got["tool_call"]) == (reasoning, content, calls), deltas


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("text", ["Sure." + CALL_TEXT, CALL_TEXT + CALL_TEXT[2:], "r</think>ok" + CALL_TEXT,
                                  "r</think>" + CALL_TEXT, "</think>" + CALL_TEXT, "plain answer", ""])
def test_responses_stream_ends_with_the_body(text, thinking):
    """/v1/responses: the streamed events rebuild the non-streamed body's output items (message, function_call
    items, the reasoning item in thinking mode), each item added and done at its own output_index."""
    from types import SimpleNamespace

    from server.openai_api import responses_body, responses_stream
    req = parse_responses({"input": "q", "tools": [dict(TOOL, type="function")], "think": thinking})
    done = {"type": "done", "finish_reason": "stop", "completion_tokens": 9, "reasoning_tokens": 0}
    rng = random.Random(len(text))
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 6)))
    deltas = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    job = SimpleNamespace(id="j", created=1, thinking_open=thinking, prompt_tokens=3,
                          params=SimpleNamespace(max_tokens=9),
                          events_iter=lambda _: iter([{"type": "token", "text": d} for d in deltas] + [done]))
    body = responses_body(req, job, "m", dict(done, text=text))
    events = [json.loads(f.split("data: ", 1)[1]) for f in responses_stream(req, job, "m", None)]
    assert events[-1]["type"] == "response.completed" and body["status"] == "completed"
    assert events[-1]["response"]["output"] == body["output"]
    opened = [(e["output_index"], e["item"]["id"]) for e in events if e["type"] == "response.output_item.added"]
    closed = [(e["output_index"], e["item"]) for e in events if e["type"] == "response.output_item.done"]
    assert opened == [(i, item["id"]) for i, item in enumerate(body["output"])] == [(i, c["id"]) for i, c in closed]
    kinds = [o["type"] for o in body["output"]]
    calls = [o for o in body["output"] if o["type"] == "function_call"]
    assert kinds[:1] == ["reasoning"] if thinking else "reasoning" not in kinds
    assert kinds[len(kinds) - len(calls):] == ["function_call"] * len(calls) and (calls or "message" in kinds)
    args = {e["item_id"]: e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"}
    assert args == {c["id"]: c["arguments"] for c in calls}


def test_request_forms():
    oa = parse_chat({"messages": [{"role": "user", "content": "q"},
                                  {"role": "assistant", "content": None, "tool_calls": [
                                      {"id": "c1", "type": "function",
                                       "function": {"name": "get_weather", "arguments": CALL["arguments"]}}]},
                                  {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
                     "tools": [{"type": "function", "function": TOOL}], "tool_choice": "auto"})
    assert oa.tools == (TOOL,) and oa.messages[1]["tool_calls"] == [dict(CALL, id="c1")]
    assert parse_chat({"messages": [{"role": "user", "content": "q"}], "tools": [{"type": "function",
                                                                                  "function": TOOL}],
                       "tool_choice": "none"}).tools == ()
    an = parse_messages({"max_tokens": 5, "tools": [{"name": TOOL["name"], "description": TOOL["description"],
                                                     "input_schema": TOOL["parameters"]}],
                         "messages": [{"role": "user", "content": "q"},
                                      {"role": "assistant", "content": [{"type": "text", "text": "ok"}, {
                                          "type": "tool_use", "id": "t1", "name": "get_weather",
                                          "input": {"city": "Paris", "days": 2}}]},
                                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                                    "content": [{"type": "text", "text": "sunny"}]},
                                                                   {"type": "text", "text": "thanks"}]}]})
    assert an.tools == (TOOL,)
    assert an.messages[1]["tool_calls"] == [dict(CALL, id="t1")]
    assert an.messages[2:] == ({"role": "tool", "tool_call_id": "t1", "content": "sunny"},
                               {"role": "user", "content": "thanks"})
    forced = parse_chat({"messages": [{"role": "user", "content": "q"}], "tools": [{"type": "function",
                                                                                    "function": TOOL}],
                         "tool_choice": "required"})
    assert forced.tools == (TOOL,) and forced.tool_format is not None and oa.tool_format is None
    assert parse_messages({"max_tokens": 5, "messages": [{"role": "user", "content": "q"}], "tools": [
        {"name": "get_weather", "input_schema": TOOL["parameters"]}], "tool_choice": {"type": "any"}}).tool_format
    for bad in ({"tool_choice": "bogus"}, {"tool_choice": {"type": "function", "function": {"name": "x"}}},
                {"tools": [{"type": "function", "function": dict(TOOL, name="bad name")}]},
                {"tools": [{"type": "function", "function": TOOL}] * 2}, {"tools": [{"type": "web_search"}]}):
        with pytest.raises(RequestError):
            parse_chat({"messages": [{"role": "user", "content": "q"}],
                        "tools": [{"type": "function", "function": TOOL}], **bad})
    with pytest.raises(RequestError):
        parse_messages({"max_tokens": 5, "messages": [{"role": "user", "content": "q"}],
                        "tools": [{"name": "get_weather", "input_schema": TOOL["parameters"]}],
                        "tool_choice": {"type": "tool", "name": "x"}})


def test_responses_round_trip_renders_as_the_chat_api():
    """The same conversation (a call, its result, a follow-up) through /v1/chat/completions and /v1/responses: the
    same messages and tools, so the same prompt."""
    oa = parse_chat({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "q"},
                                  {"role": "assistant", "content": "Let me check.", "tool_calls": [
                                      {"id": "c1", "type": "function",
                                       "function": {"name": "get_weather", "arguments": CALL["arguments"]}}]},
                                  {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                                  {"role": "user", "content": "thanks"}],
                     "tools": [{"type": "function", "function": TOOL}]})
    rs = parse_responses({"instructions": "S", "tools": [dict(TOOL, type="function")], "input": [
        {"role": "user", "content": "q"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me check."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": CALL["arguments"]},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"role": "user", "content": [{"type": "input_text", "text": "thanks"}]}]})
    assert rs.messages == oa.messages and rs.tools == oa.tools == (TOOL,)
    prompt = render_chat(list(rs.messages), tools=list(rs.tools))
    assert prompt == render_chat(list(oa.messages), tools=list(oa.tools))
    assert prompt.endswith(f"Let me check.{CALL_TEXT}{EOS}{USER}<tool_result>sunny</tool_result>\n\nthanks{ASSISTANT}"
                           f"{END_THINK}")


# ---------------------------------------------------------------------------------------------- through the SDKs
@pytest.fixture(scope="module")
def tool_server(tiny_stack):
    """An in-process ds4 server (waitress on loopback) whose engine samples a scripted reply: prose, then one call."""
    import waitress

    from ds4lib.engine import Engine
    from server import create_app
    base, ck = tiny_stack
    engine = Engine(base, engram_dir=ck, dspark=False)     # the scripted sampler follows plain decoding's steps
    forced = engine.tokenizer.encode("Let me check." + CALL_TEXT, add_special_tokens=False).ids + [1]
    engine.backend.sample = lambda logits, params, seed, step: forced[min(step, len(forced) - 1)]
    prompts = []
    real = engine.generate

    def generate(prompt_ids, params, **kw):
        prompts.append(engine.tokenizer.decode(list(prompt_ids), skip_special_tokens=False))
        return real(prompt_ids, params, **kw)

    engine.generate = generate
    app = create_app(engine, model_name="ds4-test")
    srv = waitress.create_server(app, host="127.0.0.1", port=0, threads=8, channel_request_lookahead=1)
    threading.Thread(target=srv.run, daemon=True).start()
    yield f"http://127.0.0.1:{srv.effective_port}", prompts
    srv.close()
    app.extensions["ds4"].worker.stop(timeout=5)


OA_TOOLS = [{"type": "function", "function": TOOL}]
AN_TOOLS = [{"name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["parameters"]}]
Q = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.mark.slow
def test_openai_sdk_tool_calls(tool_server):
    import openai
    url, prompts = tool_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.chat.completions.create(model="ds4-test", messages=Q, tools=OA_TOOLS, max_tokens=200)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content == "Let me check."
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    assert "## Tools" in prompts[-1] and json.dumps(TOOL) in prompts[-1]
    chunks = list(client.chat.completions.create(model="ds4-test", messages=Q, tools=OA_TOOLS, max_tokens=200,
                                                 stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert text == "Let me check." and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    follow = Q + [r.choices[0].message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    client.chat.completions.create(model="ds4-test", messages=follow, tools=OA_TOOLS, max_tokens=3)
    assert prompts[-1].endswith(f"{CALL_TEXT}{EOS}{USER}<tool_result>sunny, 21 C</tool_result>{ASSISTANT}"
                                f"{END_THINK}")
    assert "Let me check." + CALL_TEXT in prompts[-1]


@pytest.mark.slow
def test_openai_sdk_responses_function_calls(tool_server):
    """/v1/responses: prose then a call gives a message item then a function_call item, streamed in that order;
    the call sent back as input items renders as the chat API's round trip."""
    import openai
    url, prompts = tool_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    tools = [dict(TOOL, type="function")]
    r = client.responses.create(model="ds4-test", input="Weather in Paris?", tools=tools, max_output_tokens=200)
    msg, call = r.output
    assert r.status == "completed" and msg.type == "message" and msg.content[0].text == "Let me check."
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments) == {"city": "Paris", "days": 2}
    assert "## Tools" in prompts[-1] and json.dumps(TOOL) in prompts[-1]
    events = list(client.responses.create(model="ds4-test", input="Weather in Paris?", tools=tools,
                                          max_output_tokens=200, stream=True))
    kinds = [e.type for e in events]
    assert kinds[-8:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.output_item.added", "response.function_call_arguments.delta",
                          "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [(e.output_index, e.item.type) for e in added] == [(0, "message"), (1, "function_call")]
    final = events[-1].response
    assert [o.type for o in final.output] == ["message", "function_call"]
    assert final.output[1].arguments == call.arguments and final.output[0].content[0].text == "Let me check."
    follow = [{"role": "user", "content": "Weather in Paris?"}] + [o.model_dump(exclude_none=True) for o in r.output]
    follow.append({"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"})
    client.responses.create(model="ds4-test", input=follow, tools=tools, max_output_tokens=3)
    assert prompts[-1].endswith(f"Let me check.{CALL_TEXT}{EOS}{USER}<tool_result>sunny, 21 C</tool_result>"
                                f"{ASSISTANT}{END_THINK}")


@pytest.mark.slow
def test_anthropic_sdk_tool_use(tool_server):
    import anthropic
    url, prompts = tool_server
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)
    r = client.messages.create(model="ds4-test", messages=Q, tools=AN_TOOLS, max_tokens=200)
    assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["text", "tool_use"]
    assert r.content[0].text == "Let me check."
    use = r.content[1]
    assert use.name == "get_weather" and use.input == {"city": "Paris", "days": 2}
    with client.messages.stream(model="ds4-test", messages=Q, tools=AN_TOOLS, max_tokens=200) as s:
        kinds = [ev.type for ev in s]
        final = s.get_final_message()
    assert "input_json" in kinds or "content_block_delta" in kinds
    assert final.stop_reason == "tool_use" and final.content[1].input == use.input
    assert final.content[0].text == "Let me check."
    follow = Q + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
    client.messages.create(model="ds4-test", messages=follow, tools=AN_TOOLS, max_tokens=3)
    assert prompts[-1].endswith(f"{EOS}{USER}<tool_result>sunny</tool_result>{ASSISTANT}{END_THINK}")


def test_json_values_holding_closing_tags_parse_back_and_every_prefix_parses_to_a_prefix():
    """A string="false" value is read as one JSON value, so closing tags inside its JSON strings stay in it (the
    forced-call grammar allows them); a cut text gives the calls complete before the cut, never a wrong one."""
    from ds4lib.dsml import parse_tool_calls
    calls = [{"name": "f", "arguments": json.dumps({"a": "x", "b": [f"</{D}parameter>", f"\n</{D}invoke>"], "c": 3})},
             {"name": "g", "arguments": json.dumps({"s": f'say "</{D}invoke>"', "n": {"k": f"</{D}parameter>"}})},
             CALL]
    block = "".join(t for t, _ in render_tool_calls(calls))[len(TOOL_CALLS_START):]

    def parsed(text):
        return [(c["name"], json.loads(c["arguments"])) for c in parse_tool_calls(text)]
    want = [(c["name"], json.loads(c["arguments"])) for c in calls]
    assert parsed(block) == want
    for i in range(len(block)):
        got = parsed(block[:i])
        assert got == want[:len(got)], i
    # lines the reader does not follow fall back to the tags found by pattern
    sloppy = f'<{D}invoke name="f">\nnoise <{D}parameter name="a" string="false">1</{D}parameter>\n</{D}invoke>'
    assert parsed(sloppy) == [("f", {"a": 1})]

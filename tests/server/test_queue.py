"""One worker, many clients: admitted requests interleave token by token and each gets its own answer (the same as
alone); a full queue answers 429 with Retry-After; a client that goes away (mid-stream, or while a non-streamed
request is still running or queued) frees its slot at once; a few concurrent streaming clients for seconds see no
error."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.server.conftest import start_server, stop_server

CHAT = "/v1/chat/completions"
LONG = {"messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 2000, "temperature": 0}


@pytest.fixture(scope="module")
def one_slot_server(tiny_stack, tmp_path_factory):
    """A server that runs one request at a time with one waiting place: the queue's edges are reachable."""
    base, ck = tiny_stack
    log = tmp_path_factory.mktemp("one_slot") / "server.log"
    server = start_server(["-m", str(base), "--engram-dir", str(ck), "--alias", "ds4-test", "--max-running", "1",
                           "--max-queue", "1"], log)
    yield server
    assert stop_server(server) == 0, log.read_text()


def _ask(server, question: str, max_tokens: int = 5, **kw) -> str:
    r = server.post(CHAT, json={"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
                                "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_concurrent_requests_each_get_their_own_answer(live_server):
    questions = ["What is a ledger?", "Name a prime number.", "Describe the sea.", "Who wrote Hamlet?"]
    solo = [_ask(live_server, q) for q in questions]
    assert len(set(solo)) > 1, "the prompts must lead to different answers for this test to mean anything"
    with ThreadPoolExecutor(len(questions)) as pool:
        together = list(pool.map(lambda q: _ask(live_server, q), questions))
    assert together == solo


def test_concurrent_streams_interleave_nothing(live_server):
    questions = ["Tell me about ledgers.", "Tell me about rivers."]
    solo = [_ask(live_server, q, 6) for q in questions]

    def stream(q):
        body = {"messages": [{"role": "user", "content": q}], "max_tokens": 6, "temperature": 0, "stream": True}
        text = ""
        with httpx.stream("POST", live_server.url + CHAT, json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        text += c["delta"].get("content") or ""
        return text

    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(stream, questions)) == solo


def _wait_for(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


def test_disconnect_mid_stream_frees_the_worker(live_server):
    cancelled = live_server.metric("ds4_requests_cancelled_total")
    with httpx.stream("POST", live_server.url + CHAT, json=dict(LONG, stream=True), timeout=60) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 4:
                break                                   # leaving the block closes the connection mid-stream
    assert _wait_for(lambda: live_server.metric("ds4_requests_cancelled_total") > cancelled, 5)
    assert _wait_for(lambda: live_server.metric("ds4_requests_running") == 0, 10)
    t0 = time.monotonic()
    assert _ask(live_server, "hi", 2)
    assert time.monotonic() - t0 < 20, "2000 tokens would take minutes: the cancelled stream still held the worker"


def test_disconnect_while_waiting_non_streamed(live_server):
    cancelled = live_server.metric("ds4_requests_cancelled_total")
    body = {"messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 2000, "temperature": 0}
    try:
        httpx.post(live_server.url + CHAT, json=body, timeout=1.5)
    except httpx.ReadTimeout:
        pass                                            # the client gives up and closes the connection
    assert _wait_for(lambda: live_server.metric("ds4_requests_cancelled_total") > cancelled, 5)
    assert _wait_for(lambda: live_server.metric("ds4_requests_running") == 0, 10)
    assert _ask(live_server, "hi", 2)


def test_disconnect_while_queued_drops_the_job(one_slot_server):
    """B waits in the queue behind a long stream A; B's client gives up; when A goes too, B never runs."""
    srv = one_slot_server
    cancelled = srv.metric("ds4_requests_cancelled_total")
    generations = srv.metric("ds4_generations_total")
    with httpx.stream("POST", srv.url + CHAT, json=dict(LONG, stream=True), timeout=60) as a:
        lines = a.iter_lines()                          # keep the iterator: dropping it closes the response
        next(lines)
        assert _wait_for(lambda: srv.metric("ds4_requests_running") == 1, 10)      # A is running
        try:
            httpx.post(srv.url + CHAT, json=LONG, timeout=1.5)
        except httpx.ReadTimeout:
            pass                                        # B gave up while queued
        time.sleep(1.0)                                 # B's handler notices within its 0.2 s poll; then A goes
    assert _wait_for(lambda: srv.metric("ds4_requests_cancelled_total") == cancelled + 2, 10)
    assert srv.metric("ds4_generations_total") == generations + 1, "B must not have been generated"
    assert _wait_for(lambda: srv.metric("ds4_queue_depth") == 0, 5)


def test_full_queue_is_429_with_retry_after_for_the_sdks(one_slot_server):
    """A runs, B waits in the one place, C is refused: 429 with Retry-After, which the official SDK surfaces as
    RateLimitError (and would honour when retrying)."""
    srv = one_slot_server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    with httpx.stream("POST", srv.url + CHAT, json=dict(LONG, stream=True), timeout=60) as a:
        lines = a.iter_lines()                          # keep the iterator: dropping it closes the response
        next(lines)
        assert _wait_for(lambda: srv.metric("ds4_requests_running") == 1, 10)
        b = threading.Thread(target=lambda: httpx.post(srv.url + CHAT, json=dict(LONG, max_tokens=2), timeout=60))
        b.start()
        assert _wait_for(lambda: srv.metric("ds4_queue_depth") == 1, 5)
        r = httpx.post(srv.url + CHAT, json=dict(LONG, max_tokens=2), timeout=10)
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        assert 1 <= int(r.headers["Retry-After"]) <= 600
        r = httpx.post(srv.url + "/v1/messages", json=dict(LONG, max_tokens=2, model="ds4-test"), timeout=10)
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error" and r.headers["Retry-After"]
        with pytest.raises(openai.RateLimitError) as e:
            client.chat.completions.create(model="ds4-test", messages=LONG["messages"], max_tokens=2)
        assert e.value.response.headers["retry-after"]
    b.join(60)
    assert _ask(srv, "hi", 2)


def test_admitted_requests_interleave(live_server):
    """A long stream A is running when a short request B arrives: B is admitted and finishes while A goes on (one
    engine, token-by-token round-robin), and both answers are what each gets alone."""
    alone = _ask(live_server, "What is a ledger?", 4)
    t_b, a_tokens_after_b = [], []
    with httpx.stream("POST", live_server.url + CHAT, json=dict(LONG, stream=True), timeout=60) as a:
        lines = a.iter_lines()
        next(lines)
        b = threading.Thread(target=lambda: t_b.append((_ask(live_server, "What is a ledger?", 4), time.monotonic())))
        b.start()
        b.join(60)
        assert t_b and t_b[0][0] == alone
        assert live_server.metric("ds4_requests_running") == 1, "A is still running after B finished"
        for line in lines:
            if line.startswith("data: {"):
                a_tokens_after_b.append(line)
                if len(a_tokens_after_b) >= 3:
                    break
    assert len(a_tokens_after_b) == 3


def test_decoding_requests_share_batched_steps(live_server):
    """A long seeded stream (no drafting) is running when a greedy request arrives: admitted beside it, the greedy one
    decodes without drafting too, their forwards run as one step (Engine.decode_batch; /metrics counts more rows than
    steps), and it gets the text it gets alone (where it may draft: greedy output is the same either way)."""
    seeded = {"temperature": 1.0, "seed": 3}
    alone = _ask(live_server, "What is a ledger?", 6)
    steps0, rows0 = live_server.metric("ds4_decode_steps_total"), live_server.metric("ds4_decode_step_rows_total")
    got, a_after_b = [], 0
    with httpx.stream("POST", live_server.url + CHAT, json=dict(LONG, stream=True, **seeded), timeout=60) as a:
        lines = a.iter_lines()
        next(lines)
        b = threading.Thread(target=lambda: got.append(_ask(live_server, "What is a ledger?", 6)))
        b.start()
        b.join(60)
        for line in lines:
            if line.startswith("data: {"):
                a_after_b += 1
                if a_after_b >= 3:
                    break
    assert got == [alone]
    steps = live_server.metric("ds4_decode_steps_total") - steps0
    assert steps > 0 and live_server.metric("ds4_decode_step_rows_total") - rows0 > steps


@pytest.mark.slow
def test_load_a_few_streaming_clients_for_seconds(live_server):
    """CI-sized load: 4 streaming clients, each asking again and again for 8 s on loopback: 0 errors, every stream
    complete ([DONE] after a finish reason), every greedy answer the same as alone."""
    questions = ["What is a ledger?", "Name a prime number.", "Describe the sea.", "Who wrote Hamlet?"]
    solo = {q: _ask(live_server, q, 5) for q in questions}
    errors, answers, stop_at = [], [], time.monotonic() + 8.0

    def client(q):
        while time.monotonic() < stop_at:
            body = {"messages": [{"role": "user", "content": q}], "max_tokens": 5, "temperature": 0, "stream": True}
            text, finish, done = "", None, False
            try:
                with httpx.stream("POST", live_server.url + CHAT, json=body, timeout=60) as r:
                    if r.status_code != 200:
                        errors.append(r.status_code)
                        return
                    for line in r.iter_lines():
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data: {"):
                            for c in json.loads(line[6:])["choices"]:
                                text += c["delta"].get("content") or ""
                                finish = c["finish_reason"] or finish
            except httpx.HTTPError as e:
                errors.append(repr(e))
                return
            if not (done and finish):
                errors.append(f"incomplete stream for {q!r}")
            answers.append((q, text))

    with ThreadPoolExecutor(len(questions)) as pool:
        list(pool.map(client, questions))
    assert not errors, errors
    assert len(answers) >= len(questions) and all(text == solo[q] for q, text in answers)
    assert _wait_for(lambda: live_server.metric("ds4_requests_running") == 0, 10)


def test_metrics_count_requests_and_tokens(live_server):
    before = live_server.metric("ds4_generated_tokens_total")
    _ask(live_server, "hello", 3)
    text = live_server.get("/metrics").text
    assert live_server.metric("ds4_generated_tokens_total") == before + 3
    assert 'ds4_requests_total{endpoint="/v1/chat/completions",status="200"}' in text
    assert "ds4_time_to_first_token_seconds_count" in text and "ds4_tokens_per_second" in text
    assert live_server.metric("ds4_engine_loaded") == 1
    assert live_server.get("/metrics").headers["content-type"].startswith("text/plain")


def test_second_turn_reuses_the_first_turns_state(live_server):
    """The live server keeps finished sessions (--prefix-cache-mb, on by default): a follow-up turn reports the
    reused prompt tokens in each API's usage, and /metrics counts the hit."""
    hits = live_server.metric("ds4_prefix_cache_hits_total")
    first = [{"role": "user", "content": "Tell me about double-entry bookkeeping in detail."}]
    r1 = live_server.post(CHAT, json={"messages": first, "max_tokens": 4, "temperature": 0}).json()
    second = first + [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                      {"role": "user", "content": "And single-entry?"}]
    r2 = live_server.post(CHAT, json={"messages": second, "max_tokens": 2, "temperature": 0}).json()
    cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert r1["usage"]["prompt_tokens"] <= cached < r2["usage"]["prompt_tokens"]
    assert live_server.metric("ds4_prefix_cache_hits_total") > hits
    third = second + [{"role": "assistant", "content": r2["choices"][0]["message"]["content"]},
                      {"role": "user", "content": "Thanks."}]
    r3 = live_server.post("/v1/messages", json={"model": "ds4-test", "messages": third, "max_tokens": 2,
                                                "temperature": 0}).json()
    u = r3["usage"]
    assert u["cache_read_input_tokens"] >= r2["usage"]["prompt_tokens"] - 2 and u["input_tokens"] > 0

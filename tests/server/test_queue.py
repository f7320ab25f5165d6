"""One worker, many clients: concurrent requests queue and each gets its own answer; a client that goes away
(mid-stream, or while a non-streamed request is still running) frees the worker at once."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

CHAT = "/v1/chat/completions"


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
    body = {"messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 2000,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", live_server.url + CHAT, json=body, timeout=60) as r:
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


def test_disconnect_while_queued_drops_the_job(live_server):
    """B waits in the queue behind a long stream A; B's client gives up; when A goes too, B never runs."""
    cancelled = live_server.metric("ds4_requests_cancelled_total")
    generations = live_server.metric("ds4_generations_total")
    body = {"messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 2000, "temperature": 0}
    with httpx.stream("POST", live_server.url + CHAT, json=dict(body, stream=True), timeout=60) as a:
        lines = a.iter_lines()                          # keep the iterator: dropping it closes the response
        next(lines)                                     # A is running
        assert live_server.metric("ds4_requests_running") == 1
        try:
            httpx.post(live_server.url + CHAT, json=body, timeout=1.5)
        except httpx.ReadTimeout:
            pass                                        # B gave up while queued
        time.sleep(1.0)                                 # B's handler notices within its 0.2 s poll; then A goes
    assert _wait_for(lambda: live_server.metric("ds4_requests_cancelled_total") == cancelled + 2, 10)
    assert live_server.metric("ds4_generations_total") == generations + 1, "B must not have been generated"
    assert _wait_for(lambda: live_server.metric("ds4_queue_depth") == 0, 5)


def test_metrics_count_requests_and_tokens(live_server):
    before = live_server.metric("ds4_generated_tokens_total")
    _ask(live_server, "hello", 3)
    text = live_server.get("/metrics").text
    assert live_server.metric("ds4_generated_tokens_total") == before + 3
    assert 'ds4_requests_total{endpoint="/v1/chat/completions",status="200"}' in text
    assert "ds4_time_to_first_token_seconds_count" in text and "ds4_tokens_per_second" in text
    assert live_server.metric("ds4_engine_loaded") == 1
    assert live_server.get("/metrics").headers["content-type"].startswith("text/plain")

"""create_app in-process (Flask's test client, no sockets): health while loading, a failed load, a full queue,
an engine failure mid-generation (the worker survives), NaN logits and a grammar failure mid-generation (a 500 in
each API's shape, no traceback), and the chat page's static files."""
from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from ds4lib.engine import EngineError
from server import create_app

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
MSGS = {"model": "ds4", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _wait(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_health_is_503_while_loading_then_200(engine):
    release = threading.Event()

    def load():
        release.wait(30)
        return engine

    app = create_app(load=load, model_name="ds4-test", aliases=("ds4",))
    c = app.test_client()
    r = c.get("/health")
    assert r.status_code == 503 and r.json["status"] == "loading"
    r = c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 503 and r.json["error"]["code"] == "model_not_ready" and r.headers["Retry-After"]
    r = c.post("/v1/messages", json=MSGS)
    assert r.status_code == 503 and r.json["type"] == "error" and r.json["error"]["type"] == "overloaded_error"
    assert "ds4_engine_loaded 0" in c.get("/metrics").text
    release.set()
    _wait(lambda: c.get("/health").status_code == 200)
    assert c.get("/health").json["status"] == "ok"
    r = c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and r.json["usage"]["completion_tokens"] == 2
    app.extensions["ds4"].worker.stop(timeout=5)


class _SlowWarmUp:
    """The engine, with a warm-up that waits for `release`, then fails (`fail`) or runs the real one."""

    def __init__(self, engine, fail=False):
        self.engine, self.fail, self.release, self.calls = engine, fail, threading.Event(), 0
        self.tokenizer, self.context_length, self.backend = engine.tokenizer, engine.context_length, engine.backend

    def warm_up(self, *, quiet=False):
        self.calls += 1
        self.release.wait(30)
        if self.fail:
            raise RuntimeError("the kernels did not compile")
        return self.engine.warm_up(quiet=quiet)

    def generate(self, prompt_ids, params, **kw):
        return self.engine.generate(prompt_ids, params, **kw)


def test_health_is_503_warming_up_until_the_warm_up_ends(engine):
    """ds4-server listens at once and answers 503 until the kernels are compiled or loaded (a load balancer's
    readiness check keeps it out of rotation meanwhile); requests get a 503 that says why, with Retry-After."""
    slow = _SlowWarmUp(engine)
    app = create_app(load=lambda: slow, model_name="ds4-test", warm_up=True)
    c = app.test_client()
    _wait(lambda: c.get("/health").json["status"] == "warming_up")
    r = c.get("/health")
    assert r.status_code == 503 and r.json["model"] == "ds4-test"
    r = c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 503 and r.json["error"]["code"] == "model_not_ready" and r.headers["Retry-After"]
    assert "warming up" in r.json["error"]["message"]
    assert "ds4_engine_loaded 0" in c.get("/metrics").text
    slow.release.set()
    _wait(lambda: c.get("/health").status_code == 200)
    assert c.get("/health").json["status"] == "ok" and slow.calls == 1
    r = c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and r.json["usage"]["completion_tokens"] == 2
    app.extensions["ds4"].worker.stop(timeout=5)


def test_failed_warm_up_is_a_failed_load_and_no_warm_up_unless_asked(engine):
    fatal = []
    slow = _SlowWarmUp(engine, fail=True)
    slow.release.set()
    app = create_app(load=lambda: slow, on_fatal=fatal.append, warm_up=True)
    c = app.test_client()
    _wait(lambda: c.get("/health").json["status"] == "failed" and fatal)
    r = c.get("/health")
    assert r.status_code == 503 and "did not compile" in r.json["error"]
    assert "failed to load" in c.post("/v1/chat/completions", json=CHAT).json["error"]["message"]
    quiet = _SlowWarmUp(engine, fail=True)
    app = create_app(quiet)                       # an engine handed over as it is: served as it is
    c = app.test_client()
    _wait(lambda: c.get("/health").status_code == 200)
    assert quiet.calls == 0
    app.extensions["ds4"].worker.stop(timeout=5)


def test_failed_load_reports_and_calls_on_fatal():
    fatal = []

    def load():
        raise EngineError("no such base file")

    app = create_app(load=load, on_fatal=fatal.append)
    c = app.test_client()
    _wait(lambda: c.get("/health").json["status"] == "failed" and fatal)
    r = c.get("/health")
    assert r.status_code == 503 and "no such base file" in r.json["error"]
    assert len(fatal) == 1 and isinstance(fatal[0], EngineError)
    assert "failed to load" in c.post("/v1/chat/completions", json=CHAT).json["error"]["message"]


def test_full_queue_is_429_with_retry_after_in_each_shape(engine):
    app = create_app(engine, max_queue=0)
    c = app.test_client()
    _wait(lambda: c.get("/health").status_code == 200)
    r = c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 429 and r.json["error"]["code"] == "queue_full"
    assert int(r.headers["Retry-After"]) >= 1
    r = c.post("/v1/messages", json=MSGS)
    assert r.status_code == 429 and r.json["error"]["type"] == "rate_limit_error" and r.headers["Retry-After"]
    app.extensions["ds4"].worker.stop(timeout=5)


class _Exploding:
    """An engine whose generation fails after one token: the worker must answer 500 and keep serving."""

    def __init__(self, engine):
        self.engine, self.fail = engine, True
        self.tokenizer, self.context_length = engine.tokenizer, engine.context_length

    def generate(self, prompt_ids, params, **kw):
        for ev in self.engine.generate(prompt_ids, params, **kw):
            yield ev
            if self.fail:
                raise RuntimeError("kernel exploded")


def test_engine_failure_is_500_and_the_worker_survives(engine):
    boom = _Exploding(engine)
    app = create_app(boom)
    c = app.test_client()
    _wait(lambda: c.get("/health").status_code == 200)
    r = c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 500 and r.json["error"]["type"] == "server_error"
    assert "kernel exploded" in r.json["error"]["message"]
    r = c.post("/v1/messages", json=MSGS)
    assert r.status_code == 500 and r.json["error"]["type"] == "api_error"
    body = c.post("/v1/messages", json=dict(MSGS, stream=True)).get_data(as_text=True)
    assert "event: error" in body and "kernel exploded" in body
    body = c.post("/v1/chat/completions", json=dict(CHAT, stream=True)).get_data(as_text=True)
    errors = [json.loads(l[6:]) for l in body.splitlines() if l.startswith("data: {\"error\"")]
    assert errors and errors[0]["error"]["type"] == "server_error"
    boom.fail = False
    r = c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and r.json["choices"][0]["message"]["content"]
    app.extensions["ds4"].worker.stop(timeout=5)


def test_chat_page_and_static_files(engine):
    app = create_app(engine, model_name="ds4-test")
    c = app.test_client()
    page = c.get("/")
    assert page.status_code == 200 and b'<script src="/static/chat.js">' in page.data
    assert c.get("/static/chat.js").status_code == 200 and c.get("/static/chat.css").status_code == 200
    assert c.get("/nope").status_code == 404
    app.extensions["ds4"].worker.stop(timeout=5)


def test_create_app_needs_exactly_one_source(engine):
    with pytest.raises(ValueError):
        create_app()
    with pytest.raises(ValueError):
        create_app(engine, load=lambda: engine)


class _SlowPrefill:
    """An engine whose prefill takes `delay` seconds: streams must carry keep-alive comments meanwhile."""

    def __init__(self, engine, delay):
        self.engine, self.delay = engine, delay
        self.tokenizer, self.context_length = engine.tokenizer, engine.context_length

    def generate(self, prompt_ids, params, **kw):
        time.sleep(self.delay)
        yield from self.engine.generate(prompt_ids, params, **kw)


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "x",
                                       "max_tokens": 2}), ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
                                       ("/v1/messages", MSGS)])
def test_streams_send_keepalive_comments_while_waiting(engine, path, body):
    app = create_app(_SlowPrefill(engine, 0.6), keepalive_s=0.1)
    c = app.test_client()
    _wait(lambda: c.get("/health").status_code == 200)
    text = c.post(path, json=dict(body, stream=True)).get_data(as_text=True)
    frames = text.split("\n\n")
    keep = [i for i, f in enumerate(frames) if f == ": keep-alive"]
    tokens = [i for i, f in enumerate(frames) if any(m in f for m in ('"delta":{"content"', '"text_delta"',
                                                                     "output_text.delta", '"text_completion"'))]
    assert tokens and len([i for i in keep if i < min(tokens)]) >= 3, frames[:12]
    plain = c.post(path, json=body)
    assert plain.status_code == 200 and b"keep-alive" not in plain.data
    app.extensions["ds4"].worker.stop(timeout=5)


def test_health_and_models_name_the_domain(engine, tiny_stack, tmp_path):
    import numpy as np

    from ds4lib.engine import Engine
    from ds4lib.formats.sidecar import write_sidecar
    base, ck = tiny_stack
    apps = {"none": create_app(engine=engine, model_name="ds4-test")}
    E = engine.cfg.moe_shape(1)[0]
    sc = write_sidecar(tmp_path / "fin", engine.cfg, kind="sidecar", bias={1: np.zeros(E)}, notes={"domain": "finance"})
    apps["finance"] = create_app(engine=Engine(base, zchain=sc, engram_dir=ck), model_name="ds4-test")
    for domain, app in apps.items():
        c = app.test_client()
        _wait(lambda: c.get("/health").status_code == 200)
        assert c.get("/health").json["domain"] == domain
        assert {m["domain"] for m in c.get("/v1/models").json["data"]} == {domain}
        assert c.get("/v1/models/ds4-test").json["domain"] == domain
        app.extensions["ds4"].worker.stop(timeout=5)


# ---------------------------------------------------------------------------------------------- named failures
_STREAMED = [("/v1/chat/completions", dict(CHAT, max_tokens=6)),
             ("/v1/completions", {"prompt": "x", "max_tokens": 6, "temperature": 0}),
             ("/v1/responses", {"input": "hi", "max_output_tokens": 6, "temperature": 0}),
             ("/v1/messages", dict(MSGS, max_tokens=6, temperature=0))]
_JSON = {"/v1/chat/completions": {"response_format": {"type": "json_object"}},
         "/v1/responses": {"text": {"format": {"type": "json_object"}}},
         "/v1/messages": {"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}}


def _assert_named_failure(c, path, body, code, caplog):
    """Non-streamed: a 500 in the API's error shape naming the failure; streamed: a 200 whose stream ends in one
    error event of that shape after the tokens already sent; no traceback logged, and the worker serves on."""
    caplog.clear()
    r = c.post(path, json=body)
    if path == "/v1/messages":
        assert r.status_code == 500 and r.json["type"] == "error" and r.json["error"]["type"] == "api_error", r.json
    else:
        assert r.status_code == 500 and r.json["error"]["type"] == "server_error" and r.json["error"]["code"] == code
    message = r.json["error"]["message"]
    text = c.post(path, json=dict(body, stream=True)).get_data(as_text=True)
    frames = [f for f in text.split("\n\n") if f and not f.startswith(":")]
    data = [json.loads(f.split("data: ", 1)[1]) for f in frames]
    errors = [d for d in data if isinstance(d.get("error"), dict) or d.get("type") == "error"]
    assert len(errors) == 1 and data[-1] == errors[0] and len(data) >= 2, frames[-3:]   # after what was streamed
    err = errors[0].get("error") or errors[0]          # the Responses stream's error event is flat
    assert err["message"].split(":")[0] == message.split(":")[0] and "\n" not in err["message"] + message
    if path == "/v1/messages":
        assert frames[-1].startswith("event: error") and errors[0]["type"] == "error"
    else:
        assert err["code"] == code
    logged = [rec for rec in caplog.records if rec.name == "ds4.server" and rec.levelname == "ERROR"]
    assert logged and all(rec.exc_info is None for rec in logged), "a named failure logs one line, no traceback"
    return message, frames


def test_non_finite_logits_mid_generation_are_a_500_in_each_shape(engine, monkeypatch, caplog):
    """The forward yields NaN logits after the first token: the sampler raises (never token 0) and each API answers
    a 500 in its own shape; a stream that already sent a token ends in an error event."""
    real = engine.backend.forward

    def poisoned(state, tokens, last_only=False, observer=None):
        out = real(state, tokens, last_only=last_only, observer=observer)
        if len(tokens) == 1:                      # decode steps only: the first token comes out of the prefill
            out.logits[..., 5] = np.nan
        return out

    monkeypatch.setattr(engine.backend, "forward", poisoned)
    app = create_app(engine)
    c = app.test_client()
    _wait(lambda: c.get("/health").status_code == 200)
    for path, body in _STREAMED:
        message, frames = _assert_named_failure(c, path, body, "non_finite_logits", caplog)
        assert "NaN" in message
    monkeypatch.setattr(engine.backend, "forward", real)
    assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
    app.extensions["ds4"].worker.stop(timeout=5)


def test_grammar_failure_mid_generation_is_a_500_in_each_shape(engine, monkeypatch, caplog):
    """The real constraint, whose mask is turned into its complement after the first token, so that the sampler picks a
    token the grammar rejects: GrammarError out of the real advance(), answered as a 500 in each API's shape (an
    error event on a stream), never a traceback."""
    from ds4lib.engine.constrain import TokenConstraint
    from ds4lib.ref.sampling import allowed_tokens, token_mask
    real, counts = TokenConstraint.mask, {}
    V = engine.cfg.vocab_size

    def complement_after_one(self):
        words = real(self)
        counts[id(self)] = counts.get(id(self), 0) + 1
        if counts[id(self)] <= 1:                  # '{' first: the object cannot end at once
            return words
        return token_mask(~allowed_tokens(words, V) & (np.arange(V) >= 9))      # no special token either

    monkeypatch.setattr(TokenConstraint, "mask", complement_after_one)
    app = create_app(engine)
    c = app.test_client()
    _wait(lambda: c.get("/health").status_code == 200)
    for path, body in _STREAMED:
        if path in _JSON:
            message, _ = _assert_named_failure(c, path, dict(body, **_JSON[path]), "output_constraint_failed", caplog)
            assert "output constraint rejected token" in message and "doesn't satisfy the grammar" in message
    monkeypatch.setattr(TokenConstraint, "mask", real)
    r = c.post("/v1/chat/completions", json=dict(CHAT, max_tokens=3, **_JSON["/v1/chat/completions"]))
    assert r.status_code == 200
    app.extensions["ds4"].worker.stop(timeout=5)

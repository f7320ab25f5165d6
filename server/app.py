"""The Flask application: `create_app(engine)` wires the worker, the routes, the metrics and the error bodies.

Owns: `create_app` (takes a loaded Engine, or `load=` a callable the worker thread runs so that /health
answers 503 while the engine loads; `warm_up=True` keeps that 503 until `Engine.warm_up` has compiled or loaded
every kernel), `ServerState` (what the routes share: the worker, the metrics, the served
model name, the default generation length) and the error handlers, which answer every failure under /v1 in
the calling API's own error shape (Anthropic's under /v1/messages, OpenAI's elsewhere) and never let an
exception escape to the WSGI server.

Imports ds4lib.engine's public API (SamplingParams) and ds4lib.chat (through prompts.py, and END_THINK, where a
thinking reply's JSON or forced-call constraint starts); nothing imports server.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from flask import Flask, jsonify, request
from werkzeug.exceptions import HTTPException

from ds4lib.chat import END_THINK
from ds4lib.engine import SamplingParams

from server import anthropic_api, openai_api
from server.metrics import Metrics
from server.prompts import build_prompt, plan_max_tokens
from server.routes import bp
from server.schemas import REASONER_MODEL, GenerationRequest, RequestError
from server.worker import Job, JobError, Worker

__all__ = ["create_app", "ServerState", "STATIC_DIR"]

STATIC_DIR = Path(__file__).resolve().parent / "static"
log = logging.getLogger("ds4.server")
_MAX_TOKENS_PARAM = {"chat": "max_tokens", "completions": "max_tokens", "responses": "max_output_tokens",
                     "messages": "max_tokens"}
_HTTP_KINDS = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}


@dataclass
class ServerState:
    worker: Worker
    metrics: Metrics
    model_name: str
    default_max_tokens: int
    aliases: tuple = ()
    started: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_ids(self) -> list:
        """The names a request may ask for: the served name, its aliases, then the thinking-mode name."""
        return list(dict.fromkeys([self.model_name, *self.aliases, REASONER_MODEL]))

    def check_model(self, req: GenerationRequest) -> None:
        """A request naming a model this server does not serve is a 404 (no model name at all is the served one)."""
        if req.model is not None and req.model not in self.model_ids:
            raise RequestError(f"model {req.model!r} is not served here (served: {', '.join(self.model_ids)})",
                               status=404, kind="not_found_error", code="model_not_found", param="model")

    def prompt_tokens(self, req: GenerationRequest) -> int:
        self.check_model(req)
        self.worker.require_ready()
        return len(build_prompt(req, self.worker.encoder).ids)

    def submit(self, req: GenerationRequest) -> Job:
        """Tokenize on the request thread, check the context, then queue for the worker."""
        self.check_model(req)
        engine = self.worker.require_ready()
        prompt = build_prompt(req, self.worker.encoder)
        s = req.sampling
        n = plan_max_tokens(len(prompt.ids), s.max_tokens, default=self.default_max_tokens,
                            context=engine.context_length, param=_MAX_TOKENS_PARAM[req.api])
        fmt = req.json_format or req.tool_format        # never both (schemas.py refuses that)
        if fmt is not None and prompt.thinking_open:   # reason freely, then answer in JSON (or call) after </think>
            fmt = replace(fmt, after_token=engine.tokenizer.token_to_id(END_THINK))
        params = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
                                max_tokens=n, seed=s.seed, stop=s.stop, json_format=fmt)
        return self.worker.submit(prompt.ids, params, thinking_open=prompt.thinking_open)


def _is_anthropic() -> bool:
    return request.path.startswith("/v1/messages") or (request.path.startswith("/v1/models")
                                                       and "anthropic-version" in request.headers)


def _error_response(e: RequestError | JobError, status: int):
    body = anthropic_api.error_body(e) if _is_anthropic() else openai_api.error_body(e)
    response = jsonify(body)
    response.headers.update(getattr(e, "headers", None) or {})
    return response, status


def _register_errors(app: Flask) -> None:
    @app.errorhandler(RequestError)
    def request_error(e):
        return _error_response(e, e.status)

    @app.errorhandler(JobError)
    def job_error(e):
        return _error_response(e, e.status)

    @app.errorhandler(HTTPException)
    def http_error(e):
        if not request.path.startswith("/v1/"):
            return e
        err = RequestError(f"{e.name}: {request.method} {request.path}", status=e.code,
                           kind=_HTTP_KINDS.get(e.code, "invalid_request_error"), code=e.name.lower().replace(" ", "_"))
        return _error_response(err, e.code)

    @app.errorhandler(Exception)
    def unexpected(e):
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _error_response(RequestError(f"internal error: {type(e).__name__}: {e}", status=500,
                                            kind="api_error", code="internal_error"), 500)


def create_app(engine=None, *, load=None, model_name: str = "ds4", aliases=(), default_max_tokens: int = 4096,
               max_queue: int = 32, max_running: int = 4, on_fatal=None,
               keepalive_s: float | None = 15.0, warm_up: bool = False) -> Flask:
    """Exactly one of `engine` (loaded) or `load` (a callable returning one, run on the worker thread). With
    `warm_up`, the worker runs `Engine.warm_up()` after loading and only then reports ready (ds4-server does)."""
    if (engine is None) == (load is None):
        raise ValueError("pass exactly one of engine= or load=")
    app = Flask(__name__, static_folder=str(STATIC_DIR), static_url_path="/static")
    app.json.sort_keys = False
    app.json.ensure_ascii = False
    metrics = Metrics()
    worker = Worker(load if load is not None else (lambda: engine), metrics=metrics, max_queue=max_queue,
                    max_running=max_running, on_fatal=on_fatal, keepalive_s=keepalive_s, warm_up=warm_up).start()
    app.extensions["ds4"] = ServerState(worker, metrics, model_name, default_max_tokens, tuple(aliases))
    app.register_blueprint(bp)
    _register_errors(app)

    @app.after_request
    def count(response):
        if request.path.startswith("/v1/"):
            rule = request.url_rule.rule if request.url_rule is not None else "unmatched"
            metrics.count_request(rule, response.status_code)
        return response

    return app

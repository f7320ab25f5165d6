"""HTTP routes, thin: parse (schemas.py), submit (app.ServerState), answer (openai_api.py / anthropic_api.py).

POST /v1/chat/completions, /v1/completions, /v1/responses (OpenAI style), /v1/messages,
/v1/messages/count_tokens (Anthropic style); GET /v1/models, /health (503 while loading or warming up), /metrics
(Prometheus text) and / (the chat page).
"""
from __future__ import annotations

import json
import math
from datetime import datetime, timezone

from flask import Blueprint, Response, current_app, jsonify, request, send_from_directory

from server import anthropic_api, openai_api, sse
from server.schemas import (RequestError, parse_chat, parse_completion, parse_count_tokens,
                            parse_messages, parse_responses)

__all__ = ["bp"]

bp = Blueprint("ds4", __name__)
_CLIENT_GONE = 499                                  # nginx's code: nobody reads it, the log does


def _state():
    return current_app.extensions["ds4"]


def _never() -> bool:
    return False


def _reject_constant(name: str):
    raise RequestError(f"{name} is not a JSON number; every numeric field must be finite", code="invalid_number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise RequestError(f"the number {text[:40]} overflows a double; every numeric field must be finite",
                           code="invalid_number")
    return value


def _json():
    """The body as JSON. Python's parser accepts NaN, Infinity and -Infinity and turns 1e999 into inf; none of
    them is JSON or a usable number, so each is a 400 wherever it appears in the body."""
    try:
        return json.loads(request.get_data(cache=False), parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, UnicodeDecodeError) as e:
        if isinstance(e, RequestError):
            raise
        raise RequestError(f"malformed JSON body: {e}", code="invalid_json") from None


def _generate(parse, body_of, stream_of):
    state = _state()
    req = parse(_json())
    job = state.submit(req)
    model = req.model or state.model_name
    # waitress's callable (needs channel_request_lookahead > 0) says when the client has closed the connection
    disconnected = request.environ.get("waitress.client_disconnected", _never)
    if req.stream:
        return sse.stream(stream_of(req, job, model, disconnected), job)
    done = job.result(disconnected)
    if done is None:
        return Response(status=_CLIENT_GONE)
    return jsonify(body_of(req, job, model, done))


@bp.post("/v1/chat/completions")
def chat_completions():
    return _generate(parse_chat, openai_api.chat_body, openai_api.chat_stream)


@bp.post("/v1/completions")
def completions():
    return _generate(parse_completion, openai_api.completion_body, openai_api.completion_stream)


@bp.post("/v1/responses")
def responses():
    return _generate(parse_responses, openai_api.responses_body, openai_api.responses_stream)


@bp.post("/v1/messages")
def messages():
    return _generate(parse_messages, anthropic_api.message_body, anthropic_api.message_stream)


@bp.post("/v1/messages/count_tokens")
def count_tokens():
    return jsonify({"input_tokens": _state().prompt_tokens(parse_count_tokens(_json()))})


def _domain():
    """The domain the loaded stack serves ("none" = bare base); None while the engine is still loading."""
    engine = _state().worker.engine
    return getattr(engine, "domain", None)


def _model_ids() -> list:
    return _state().model_ids


@bp.get("/v1/models")
def models():
    state = _state()
    if "anthropic-version" in request.headers:
        created = datetime.fromtimestamp(state.started, timezone.utc).isoformat().replace("+00:00", "Z")
        return jsonify(anthropic_api.models_body(_model_ids(), created))
    return jsonify({"object": "list", "data": [{"id": m, "object": "model", "created": state.started,
                                                "owned_by": "ds4", "domain": _domain()} for m in _model_ids()]})


@bp.get("/v1/models/<path:model_id>")
def model(model_id):
    if model_id not in _model_ids():
        raise RequestError(f"model {model_id!r} is not served here (served: {', '.join(_model_ids())})", status=404,
                           kind="not_found_error", code="model_not_found", param="model")
    return jsonify({"id": model_id, "object": "model", "created": _state().started, "owned_by": "ds4",
                    "domain": _domain()})


@bp.get("/health")
def health():
    w = _state().worker
    body = {"status": {"ready": "ok"}.get(w.state, w.state), "model": _state().model_name, "domain": _domain(),
            "queue_depth": w.queue_depth, "running": w.running}
    if w.error:
        body["error"] = w.error
    return jsonify(body), 200 if w.ready else 503


@bp.get("/metrics")
def metrics():
    st = _state()
    engine = st.worker.engine if st.worker.ready else None
    text = st.metrics.render(queue_depth=st.worker.queue_depth, running=st.worker.running, loaded=st.worker.ready,
                             prefix_cache=getattr(engine, "prefix_cache", None),
                             speculative=getattr(engine, "spec_stats", None))
    return Response(text, mimetype="text/plain; version=0.0.4")


@bp.get("/")
def index():
    return send_from_directory(current_app.static_folder, "index.html")

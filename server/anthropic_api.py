"""Anthropic-style response bodies and SSE streams: messages, count_tokens, the model list; the error body.

Owns: the message a finished job becomes (`message_body`: a thinking block apart from the text block,
stop_reason end_turn | max_tokens | stop_sequence with the matched `stop_sequence`, usage of emitted tokens),
the streamed event sequence (`message_stream`: message_start, content_block_start / _delta / _stop per block,
message_delta with stop reason and output tokens, message_stop; an `error` event on failure), and the error
body {"type": "error", "error": {"type", "message"}}.

Does not own: validation (schemas.py) or generation (worker.py).
"""
from __future__ import annotations

import json

from ds4lib.chat import parse_reply, split_answer

from server.reply import ANSWER, KEEPALIVE, REASONING, TOOL_CALL, split_events
from server.schemas import RequestError
from server.sse import KEEPALIVE as SSE_KEEPALIVE
from server.sse import frame
from server.worker import JobError

__all__ = ["error_body", "message_body", "message_stream", "models_body"]


def error_body(e: RequestError | JobError) -> dict:
    if isinstance(e, JobError):
        return {"type": "error", "error": {"type": "api_error" if e.status >= 500 else "invalid_request_error",
                                           "message": e.message}}
    return {"type": "error", "error": {"type": e.kind, "message": e.message}}


def _stop(done: dict, called: bool = False) -> tuple:
    if done["finish_reason"] == "length":
        return "max_tokens", None
    if done.get("stop_sequence") is not None:
        return "stop_sequence", done["stop_sequence"]
    return ("tool_use" if called else "end_turn"), None


def _tool_use(job, call: dict, i: int, *, streamed: bool = False) -> dict:
    return {"type": "tool_use", "id": f"toolu_{job.id}_{i}", "name": call["name"],
            "input": {} if streamed else json.loads(call["arguments"])}


def _usage(job, output_tokens: int, cached: int = 0) -> dict:
    """Anthropic counts cache reads apart from input_tokens (input = uncached + read + created)."""
    return {"input_tokens": job.prompt_tokens - cached, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def message_body(req, job, model: str, done: dict) -> dict:
    reasoning, answer = parse_reply(done["text"], thinking=job.thinking_open)
    text, calls = split_answer(answer) if req.tools else (answer, [])
    content = [{"type": "thinking", "thinking": reasoning, "signature": ""}] if (req.thinking or reasoning) else []
    if text or not calls:
        content.append({"type": "text", "text": text})
    content += [_tool_use(job, c, i) for i, c in enumerate(calls)]
    stop_reason, stop_sequence = _stop(done, bool(calls))
    return {"id": f"msg_{job.id}", "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": _usage(job, done["completion_tokens"], done.get("cached_tokens", 0))}


def message_stream(req, job, model: str, disconnected):
    start = {"id": f"msg_{job.id}", "type": "message", "role": "assistant", "model": model, "content": [],
             "stop_reason": None, "stop_sequence": None, "usage": _usage(job, 0)}
    yield frame({"type": "message_start", "message": start}, event="message_start")
    yield frame({"type": "ping"}, event="ping")
    blocks = []                                        # kinds of the blocks opened so far; the last one is open

    def open_block(kind):
        if kind == ANSWER and req.thinking and not blocks:
            yield from open_block(REASONING)            # as the non-streamed body: a thinking block, maybe empty
        if blocks:
            yield frame({"type": "content_block_stop", "index": len(blocks) - 1}, event="content_block_stop")
        blocks.append(kind)
        block = ({"type": "thinking", "thinking": "", "signature": ""} if kind == REASONING else
                 {"type": "text", "text": ""})
        yield frame({"type": "content_block_start", "index": len(blocks) - 1, "content_block": block},
                    event="content_block_start")

    try:
        for kind, value in split_events(job.events_iter(disconnected), job.thinking_open, bool(req.tools)):
            if kind == KEEPALIVE:
                yield SSE_KEEPALIVE
                continue
            if kind == TOOL_CALL:
                if req.thinking and not blocks:
                    yield from open_block(REASONING)    # as the non-streamed body: a thinking block, maybe empty
                if blocks:
                    yield frame({"type": "content_block_stop", "index": len(blocks) - 1}, event="content_block_stop")
                blocks.append(TOOL_CALL)
                i = len(blocks) - 1
                yield frame({"type": "content_block_start", "index": i,
                             "content_block": _tool_use(job, value, value["index"], streamed=True)},
                            event="content_block_start")
                yield frame({"type": "content_block_delta", "index": i,
                             "delta": {"type": "input_json_delta", "partial_json": value["arguments"]}},
                            event="content_block_delta")
                continue
            if kind in (REASONING, ANSWER):
                if not blocks or blocks[-1] != kind:
                    yield from open_block(kind)
                delta = ({"type": "thinking_delta", "thinking": value} if kind == REASONING else
                         {"type": "text_delta", "text": value})
                yield frame({"type": "content_block_delta", "index": len(blocks) - 1, "delta": delta},
                            event="content_block_delta")
                continue
            called = TOOL_CALL in blocks
            if not called and (not blocks or blocks[-1] != ANSWER):
                yield from open_block(ANSWER)          # the text block always exists, even when empty
            yield frame({"type": "content_block_stop", "index": len(blocks) - 1}, event="content_block_stop")
            stop_reason, stop_sequence = _stop(value, called)
            usage = _usage(job, value["completion_tokens"], value.get("cached_tokens", 0))   # final, as unstreamed
            yield frame({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                         "usage": usage}, event="message_delta")
            yield frame({"type": "message_stop"}, event="message_stop")
    except JobError as e:
        yield frame(error_body(e), event="error")


def models_body(model_ids: list, created: str) -> dict:
    data = [{"type": "model", "id": m, "display_name": m, "created_at": created} for m in model_ids]
    return {"data": data, "has_more": False, "first_id": data[0]["id"], "last_id": data[-1]["id"]}

"""OpenAI-style response bodies and SSE streams: chat completions, completions, responses; the error body.

Owns: the JSON a finished job becomes (`chat_body`, `completion_body`, `responses_body`) and the event
sequences of a streamed job (`chat_stream`, `completion_stream`, `responses_stream`), including usage
(stream_options.include_usage; the responses API always reports it in response.completed) and reasoning kept
apart from the answer (`reasoning_content`; a `reasoning` output item with reasoning_text), and generated tool calls
(`tool_calls`; responses: `function_call` output items after the message, streamed as output_item.added,
function_call_arguments.delta / .done and output_item.done). Error body: {"error": {"message", "type", "param",
"code"}}.

Does not own: validation (schemas.py) or generation (worker.py).
"""
from __future__ import annotations

from ds4lib.chat import parse_reply, split_answer

from server.reply import ANSWER, DONE, KEEPALIVE, REASONING, TOOL_CALL, split_events
from server.schemas import RequestError
from server.sse import DONE as SSE_DONE
from server.sse import KEEPALIVE as SSE_KEEPALIVE
from server.sse import frame
from server.worker import JobError

__all__ = ["error_body", "chat_body", "chat_stream", "completion_body", "completion_stream", "responses_body",
           "responses_stream"]

_TYPES = {"not_found_error": "invalid_request_error", "overloaded_error": "server_error", "api_error": "server_error",
          "rate_limit_error": "rate_limit_exceeded"}


def error_body(e: RequestError | JobError) -> dict:
    if isinstance(e, JobError):
        return {"error": {"message": e.message, "type": "server_error" if e.status >= 500 else
                          "invalid_request_error", "param": None, "code": e.code}}
    return {"error": {"message": e.message, "type": _TYPES.get(e.kind, e.kind), "param": e.param, "code": e.code}}


def _usage(job, done) -> dict:
    n = done["completion_tokens"]
    return {"prompt_tokens": job.prompt_tokens, "completion_tokens": n, "total_tokens": job.prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": done.get("cached_tokens", 0)},
            "completion_tokens_details": {"reasoning_tokens": done["reasoning_tokens"]}}


# ---------------------------------------------------------------------------------------------- chat
def _call_id(job, i: int) -> str:
    return f"call_{job.id}_{i}"


def _finish(done: dict, called: bool) -> str:
    return "tool_calls" if called and done["finish_reason"] == "stop" else done["finish_reason"]


def chat_body(req, job, model: str, done: dict) -> dict:
    reasoning, answer = parse_reply(done["text"], thinking=job.thinking_open)
    content, calls = split_answer(answer) if req.tools else (answer, [])
    message = {"role": "assistant", "content": content if content or not calls else None}
    if req.thinking or reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [{"id": _call_id(job, i), "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}}
                                 for i, c in enumerate(calls)]
    return {"id": f"chatcmpl-{job.id}", "object": "chat.completion", "created": job.created, "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": _finish(done, bool(calls)),
                         "logprobs": None}],
            "usage": _usage(job, done), "system_fingerprint": None}


def chat_stream(req, job, model: str, disconnected):
    head = {"id": f"chatcmpl-{job.id}", "object": "chat.completion.chunk", "created": job.created, "model": model,
            "system_fingerprint": None}

    def chunk(delta, finish=None):
        c = dict(head, choices=[{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}])
        if req.include_usage:
            c["usage"] = None
        return frame(c)

    yield chunk({"role": "assistant", "content": ""})
    called = False
    try:
        for kind, value in split_events(job.events_iter(disconnected), job.thinking_open, bool(req.tools)):
            if kind == KEEPALIVE:
                yield SSE_KEEPALIVE
            elif kind == REASONING:
                yield chunk({"reasoning_content": value})
            elif kind == ANSWER:
                yield chunk({"content": value})
            elif kind == TOOL_CALL:                   # the call's head, then its arguments as one delta
                called, i = True, value["index"]
                yield chunk({"tool_calls": [{"index": i, "id": _call_id(job, i), "type": "function",
                                             "function": {"name": value["name"], "arguments": ""}}]})
                yield chunk({"tool_calls": [{"index": i, "function": {"arguments": value["arguments"]}}]})
            else:
                yield chunk({}, finish=_finish(value, called))
                if req.include_usage:
                    yield frame(dict(head, choices=[], usage=_usage(job, value)))
                yield SSE_DONE
    except JobError as e:
        yield frame(error_body(e))


# ---------------------------------------------------------------------------------------------- completions
def completion_body(req, job, model: str, done: dict) -> dict:
    return {"id": f"cmpl-{job.id}", "object": "text_completion", "created": job.created, "model": model,
            "choices": [{"index": 0, "text": done["text"], "finish_reason": done["finish_reason"], "logprobs": None}],
            "usage": _usage(job, done), "system_fingerprint": None}


def completion_stream(req, job, model: str, disconnected):
    head = {"id": f"cmpl-{job.id}", "object": "text_completion", "created": job.created, "model": model,
            "system_fingerprint": None}

    def chunk(text, finish=None):
        c = dict(head, choices=[{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}])
        if req.include_usage:
            c["usage"] = None
        return frame(c)

    try:
        for ev in job.events_iter(disconnected):
            if ev["type"] == "keepalive":
                yield SSE_KEEPALIVE
            elif ev["type"] == "token":
                if ev["text"]:
                    yield chunk(ev["text"])
            else:
                yield chunk("", finish=ev["finish_reason"])
                if req.include_usage:
                    yield frame(dict(head, choices=[], usage=_usage(job, ev)))
                yield SSE_DONE
    except JobError as e:
        yield frame(error_body(e))


# ---------------------------------------------------------------------------------------------- responses
def _response_usage(job, done) -> dict:
    n = done["completion_tokens"]
    return {"input_tokens": job.prompt_tokens, "input_tokens_details": {"cached_tokens": done.get("cached_tokens", 0)},
            "output_tokens": n, "output_tokens_details": {"reasoning_tokens": done["reasoning_tokens"]},
            "total_tokens": job.prompt_tokens + n}


def _response(req, job, model: str, *, status: str, output: list, done: dict | None) -> dict:
    s = req.sampling
    return {"id": f"resp_{job.id}", "object": "response", "created_at": job.created, "status": status,
            "model": model, "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.extras.get("instructions"), "max_output_tokens": job.params.max_tokens,
            "metadata": req.extras.get("metadata", {}), "temperature": s.temperature, "top_p": s.top_p,
            "parallel_tool_calls": req.extras.get("parallel_tool_calls", True),
            "tool_choice": req.extras.get("tool_choice", "auto"), "tools": req.extras.get("tools", []),
            "store": False, "background": False,
            "text": {"format": req.extras.get("text_format", {"type": "text"})},
            "reasoning": {"effort": req.extras.get("effort"), "summary": None},
            "usage": _response_usage(job, done) if done else None}


def _reasoning_item(job, text: str, status: str) -> dict:
    return {"id": f"rs_{job.id}", "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []}


def _message_item(job, text: str, status: str) -> dict:
    content = [] if status == "in_progress" else [{"type": "output_text", "text": text, "annotations": [],
                                                    "logprobs": []}]
    return {"id": f"msg_{job.id}", "type": "message", "role": "assistant", "status": status, "content": content}


def _call_item(job, call: dict, i: int, status: str) -> dict:
    return {"id": f"fc_{job.id}_{i}", "type": "function_call", "call_id": _call_id(job, i), "name": call["name"],
            "arguments": call["arguments"] if status != "in_progress" else "", "status": status}


def responses_body(req, job, model: str, done: dict) -> dict:
    """Output items: reasoning (thinking mode, or a stray think block), the message (left out when the reply is only
    tool calls), then one function_call item per call."""
    reasoning, answer = parse_reply(done["text"], thinking=job.thinking_open)
    content, calls = split_answer(answer) if req.tools else (answer, [])
    status = "incomplete" if done["finish_reason"] == "length" else "completed"
    output = ([_reasoning_item(job, reasoning, "completed")] if (req.thinking or reasoning) else [])
    if content or not calls:
        output.append(_message_item(job, content, status))
    output += [_call_item(job, c, i, "completed") for i, c in enumerate(calls)]
    return _response(req, job, model, status=status, output=output, done=done)


class _ResponsesEvents:
    """The responses API's event sequence: numbered events, output items opened lazily and closed in order."""

    def __init__(self, req, job, model):
        self.req, self.job, self.model = req, job, model
        self.seq = 0
        self.items = []                       # finished output items
        self.open = None                      # (kind, text so far) of the item being streamed
        self.called = False                   # a function_call item was streamed

    def emit(self, kind: str, **fields) -> str:
        ev = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return frame(ev, event=kind)

    def response(self, status, done=None) -> dict:
        return _response(self.req, self.job, self.model, status=status, output=list(self.items), done=done)

    def start(self, kind: str):
        if kind == ANSWER and self.req.thinking and not self.items:
            yield from self.start(REASONING)           # as the non-streamed body: a reasoning item, maybe empty
            yield from self.close("completed")
        idx, job = len(self.items), self.job
        item = _reasoning_item(job, "", "in_progress") if kind == REASONING else _message_item(job, "", "in_progress")
        part = ({"type": "reasoning_text", "text": ""} if kind == REASONING else
                {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        self.open = [kind, ""]
        yield self.emit("response.output_item.added", output_index=idx, item=item)
        yield self.emit("response.content_part.added", item_id=item["id"], output_index=idx, content_index=0,
                        part=part)

    def delta(self, kind: str, text: str):
        if self.open is not None and self.open[0] != kind:
            yield from self.close("completed")
        if self.open is None:
            yield from self.start(kind)
        self.open[1] += text
        idx = len(self.items)
        if kind == REASONING:
            yield self.emit("response.reasoning_text.delta", item_id=f"rs_{self.job.id}", output_index=idx,
                            content_index=0, delta=text)
        else:
            yield self.emit("response.output_text.delta", item_id=f"msg_{self.job.id}", output_index=idx,
                            content_index=0, delta=text, logprobs=[])

    def call(self, call: dict):
        """One function_call item: added (no arguments yet), its arguments as one delta, done."""
        if self.open is not None:
            yield from self.close("completed")
        if self.req.thinking and not self.items:
            yield from self.start(REASONING)           # as the non-streamed body: a reasoning item, maybe empty
            yield from self.close("completed")
        idx, i = len(self.items), call["index"]
        item = _call_item(self.job, call, i, "in_progress")
        yield self.emit("response.output_item.added", output_index=idx, item=item)
        yield self.emit("response.function_call_arguments.delta", item_id=item["id"], output_index=idx,
                        delta=call["arguments"])
        yield self.emit("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                        arguments=call["arguments"])
        item = _call_item(self.job, call, i, "completed")
        yield self.emit("response.output_item.done", output_index=idx, item=item)
        self.items.append(item)
        self.called = True

    def close(self, status: str):
        kind, text = self.open
        idx, job = len(self.items), self.job
        if kind == REASONING:
            item = _reasoning_item(job, text, "completed")
            yield self.emit("response.reasoning_text.done", item_id=item["id"], output_index=idx, content_index=0,
                            text=text)
        else:
            item = _message_item(job, text, status)
            yield self.emit("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0,
                            text=text, logprobs=[])
        yield self.emit("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0,
                        part=item["content"][0])
        yield self.emit("response.output_item.done", output_index=idx, item=item)
        self.items.append(item)
        self.open = None


def responses_stream(req, job, model: str, disconnected):
    ev = _ResponsesEvents(req, job, model)
    yield ev.emit("response.created", response=ev.response("in_progress"))
    yield ev.emit("response.in_progress", response=ev.response("in_progress"))
    try:
        for kind, value in split_events(job.events_iter(disconnected), job.thinking_open, bool(req.tools)):
            if kind == KEEPALIVE:
                yield SSE_KEEPALIVE
                continue
            if kind == TOOL_CALL:
                yield from ev.call(value)
                continue
            if kind != DONE:
                yield from ev.delta(kind, value)
                continue
            status = "incomplete" if value["finish_reason"] == "length" else "completed"
            if ev.open is not None and ev.open[0] != ANSWER:
                yield from ev.close("completed")
            if ev.open is None and not ev.called:
                yield from ev.start(ANSWER)           # the answer item exists, even when empty, unless calls replace it
            if ev.open is not None:
                yield from ev.close(status)
            yield ev.emit(f"response.{status}", response=ev.response(status, value))
    except JobError as e:
        yield ev.emit("error", code=e.code or ("server_error" if e.status >= 500 else "invalid_request_error"),
                      message=e.message, param=None)

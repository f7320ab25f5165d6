"""JSON -> typed requests for the served APIs: OpenAI chat completions, completions and responses, Anthropic
messages and messages/count_tokens.

Owns: the request dataclasses (`GenerationRequest`, `Sampling`) and their validation (field checks and
`RequestError` in fields.py, tools and tool results in tool_schemas.py; re-exported here). A field
of the wrong type or out of range is a 400; a field this server does not know is ignored, because the official
SDKs send fields a compatible server need not implement; a known feature this engine cannot honour (built-in
tools, images, logprobs, n > 1, penalties) is a 400 that says so rather than a silent no-op. Tools (OpenAI
function tools, nested on chat completions and flat on /v1/responses, Anthropic client tools), assistant tool calls
(responses: function_call input items) and tool results (responses: function_call_output items) are parsed into
ds4lib.chat's message form; a forced tool choice becomes the grammar of a call block (`tool_format`,
tool_schemas.py). Structured output (`response_format`, `text.format`, `output_config.format`) becomes a checked
JSON Schema (output_formats.py); with tools in the same request (a forced choice included) it is a 400, since the
grammar would forbid the tool-call markup. Also owns the resolution of thinking per request (docs/design.md §7:
non-thinking by default; `reasoning_effort`, `thinking: {"type": "enabled"}`, `think: true` or model
`deepseek-reasoner` turn it on). `reasoning_effort` is mapped as the V4.1 release encoder's normalisation maps it:
"none" is non-thinking; "low", "high" and "max" are the encoder's own levels (thinking, with the level's instruction
prefix, ds4lib.chat.REASONING_EFFORTS); "xhigh" is "max"; any other value is a 400 naming the accepted ones.
Anthropic's `thinking.budget_tokens` is validated but not enforced (the engine has no way to force `</think>`);
`max_tokens` bounds the reasoning and the answer together.

Does not own: tokenization, context checks and chat rendering (prompts.py), response shapes (openai_api.py,
anthropic_api.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from ds4lib.engine import JsonFormat, ToolCallFormat

from server.fields import JSON_TYPES as _TYPES
from server.fields import RequestError
from server.fields import body_object as _body
from server.fields import get_field as _get
from server.fields import in_range as _in_range
from server.fields import text_parts as _text_parts
from server.output_formats import anthropic_output_format, chat_response_format, responses_text_format
from server.tool_schemas import anthropic_tool_format as _anthropic_tool_format
from server.tool_schemas import anthropic_tools as _anthropic_tools
from server.tool_schemas import openai_tool_calls as _openai_tool_calls
from server.tool_schemas import openai_tool_format as _openai_tool_format
from server.tool_schemas import openai_tools as _openai_tools
from server.tool_schemas import responses_tool_call as _responses_tool_call
from server.tool_schemas import tool_result_text as _tool_result_text

__all__ = ["RequestError", "Sampling", "GenerationRequest", "parse_chat", "parse_completion", "parse_responses",
           "parse_messages", "parse_count_tokens", "REASONER_MODEL"]

REASONER_MODEL = "deepseek-reasoner"
# API value -> the encoder's effort level (None: non-thinking)
_EFFORTS = {"none": None, "low": "low", "high": "high", "max": "max", "xhigh": "max"}
_MAX_STOPS = 16
_SEED_MOD = 1 << 63


@dataclass(frozen=True)
class Sampling:
    """Sampling knobs as asked; `max_tokens` None means the server default (capped by the context)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple = ()


@dataclass(frozen=True)
class GenerationRequest:
    """One generation: chat `messages` (dicts role/content/reasoning_content for ds4lib.chat) or a raw `prompt`
    (text or token ids, /v1/completions only)."""
    api: str                                  # "chat" | "completions" | "responses" | "messages"
    model: str | None
    sampling: Sampling
    messages: tuple = ()
    prompt: str | tuple | None = None
    tools: tuple = ()                         # function definitions {"name", "description"?, "parameters"?}
    thinking: bool = False
    effort: str | None = None                 # the encoder's reasoning-effort level (thinking mode only)
    json_format: JsonFormat | None = None     # the reply must be JSON valid under this schema
    tool_format: ToolCallFormat | None = None   # a forced tool choice: the reply is exactly a call block
    stream: bool = False
    include_usage: bool = False
    extras: dict = field(default_factory=dict)   # values echoed back in the response (responses API)


# ---------------------------------------------------------------------------------------------- field checks
def _stops(value, name: str, allow_string: bool) -> tuple:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) and allow_string else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise RequestError(f"'{name}' must be {'a string or ' if allow_string else ''}an array of strings", param=name,
                           code="invalid_type")
    if len(items) > _MAX_STOPS:
        raise RequestError(f"'{name}' holds {len(items)} sequences; at most {_MAX_STOPS}", param=name,
                           code="invalid_value")
    return tuple(s for s in items if s)


def _sampling(body: dict, *, max_temperature: float, max_tokens_keys: tuple, stop_key: str,
              default_max_tokens: int | None = None, max_tokens_required: bool = False) -> Sampling:
    t = _in_range("temperature", _get(body, "temperature", "number"), 0.0, max_temperature)
    p = _in_range("top_p", _get(body, "top_p", "number"), 0.0, 1.0, lo_open=True)
    k = _in_range("top_k", _get(body, "top_k", "integer"), 0, 1 << 31)
    mp = _in_range("min_p", _get(body, "min_p", "number"), 0.0, 1.0)
    seed = _get(body, "seed", "integer")
    mt, mt_key = None, max_tokens_keys[0]
    for key in max_tokens_keys:                       # the first one given wins (max_completion_tokens first)
        if mt is None and body.get(key) is not None:
            mt, mt_key = _get(body, key, "integer"), key
    if mt is None and max_tokens_required:
        raise RequestError(f"'{mt_key}' is required", param=mt_key, code="missing_required_parameter")
    if mt is not None and mt < 1:
        raise RequestError(f"'{mt_key}' must be >= 1, got {mt}", param=mt_key, code="invalid_value")
    return Sampling(temperature=1.0 if t is None else t, top_p=1.0 if p is None else p, top_k=k or 0,
                    min_p=mp or 0.0, seed=None if seed is None else seed % _SEED_MOD,
                    max_tokens=default_max_tokens if mt is None else mt,
                    stop=_stops(body.get(stop_key), stop_key, allow_string=stop_key == "stop"))


_IGNORED_OPENAI = (("user", "string"), ("metadata", "object"), ("store", "boolean"), ("service_tier", "string"),
                   ("parallel_tool_calls", "boolean"))
_IGNORED_ANTHROPIC = (("metadata", "object"), ("service_tier", "string"))


def _check_ignored(body: dict, fields) -> None:
    """Fields accepted and ignored (no effect on a local single-model server) must still have their type."""
    for key, kinds in fields:
        kinds = (kinds,) if isinstance(kinds, str) else kinds
        value = body.get(key)
        if value is not None and not any(isinstance(value, _TYPES[k]) for k in kinds):
            raise RequestError(f"'{key}' must be {' or '.join(kinds)}, got {type(value).__name__}", param=key,
                               code="invalid_type")


def _refuse_openai_extras(body: dict) -> None:
    """Features of the OpenAI APIs this engine does not have: a 400 that names them, never a silent no-op."""
    _check_ignored(body, _IGNORED_OPENAI)
    n = _get(body, "n", "integer", 1)
    if n != 1:
        raise RequestError("only n = 1 is supported", param="n", code="unsupported_value")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") not in (None, 0):
        raise RequestError("logprobs are not supported by this server", param="logprobs", code="unsupported_value")
    for key in ("presence_penalty", "frequency_penalty"):
        if _get(body, key, "number", 0.0) != 0.0:
            raise RequestError(f"'{key}' is not supported (only 0)", param=key, code="unsupported_value")
    if _get(body, "logit_bias", "object"):
        raise RequestError("'logit_bias' is not supported", param="logit_bias", code="unsupported_value")


def _thinking(body: dict, model: str | None, *, effort: str | None = None, effort_param: str = "reasoning_effort"):
    """(thinking, effort level). docs/design.md §7: any explicit switch decides (on wins over off); otherwise the model
    name; otherwise off. A reasoning effort other than "none" is a switch to on."""
    votes, level = [], None
    if effort is not None:
        if effort not in _EFFORTS:
            raise RequestError(f"'{effort_param}' must be one of {', '.join(_EFFORTS)}, got {effort!r}",
                               param=effort_param, code="invalid_value")
        level = _EFFORTS[effort]
        votes.append(level is not None)
    th = _get(body, "thinking", "object")
    if th is not None:
        kind = _get(th, "type", "string", required=True, where="thinking.")
        if kind not in ("enabled", "disabled", "adaptive", "between_tools"):
            raise RequestError(f"'thinking.type' must be enabled, adaptive, between_tools or disabled, got {kind!r}",
                               param="thinking.type", code="invalid_value")
        _get(th, "budget_tokens", "integer", where="thinking.")
        votes.append(kind != "disabled")
    think = _get(body, "think", "boolean")
    if think is not None:
        votes.append(think)
    on = any(votes) if votes else model == REASONER_MODEL
    return on, (level if on else None)


def _thinking_fields(body: dict, model: str | None, **kw) -> dict:
    on, level = _thinking(body, model, **kw)
    return {"thinking": on, "effort": level}


# ---------------------------------------------------------------------------------------------- OpenAI
_OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def _openai_messages(raw, where: str = "messages") -> tuple:
    if not isinstance(raw, list) or not raw:
        raise RequestError(f"'{where}' must be a non-empty array", param=where, code="invalid_type")
    out = []
    for i, m in enumerate(raw):
        w = f"{where}[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"'{w}' must be an object", param=w, code="invalid_type")
        role = _get(m, "role", "string", required=True, where=f"{w}.")
        if role not in _OPENAI_ROLES:
            raise RequestError(f"'{w}.role' {role!r} is not supported (system, developer, user, assistant, tool)",
                               param=f"{w}.role", code="unsupported_value")
        msg = {"role": _OPENAI_ROLES[role],
               "content": _text_parts(m.get("content"), f"{w}.content", ("text", "input_text", "output_text"))}
        if m.get("tool_calls"):
            if role != "assistant":
                raise RequestError(f"'{w}.tool_calls' belong to assistant messages", param=f"{w}.tool_calls",
                                   code="invalid_value")
            msg["tool_calls"] = _openai_tool_calls(m["tool_calls"], f"{w}.tool_calls")
        if role == "tool":
            msg["tool_call_id"] = _get(m, "tool_call_id", "string", required=True, where=f"{w}.")
        reasoning = _get(m, "reasoning_content", "string", where=f"{w}.")
        if reasoning and role == "assistant":
            msg["reasoning_content"] = reasoning
        out.append(msg)
    return tuple(out)


def parse_chat(body) -> GenerationRequest:
    """POST /v1/chat/completions."""
    body = _body(body)
    model = _get(body, "model", "string")
    _refuse_openai_extras(body)
    tools = _openai_tools(body)
    json_format = _no_tools(chat_response_format(body), tools, "response_format")
    opts = _get(body, "stream_options", "object") or {}
    return GenerationRequest(
        api="chat", model=model, messages=_openai_messages(body.get("messages")), tools=tools,
        json_format=json_format, tool_format=_openai_tool_format(body, tools),
        sampling=_sampling(body, max_temperature=2.0, max_tokens_keys=("max_completion_tokens", "max_tokens"),
                           stop_key="stop"),
        **_thinking_fields(body, model, effort=_get(body, "reasoning_effort", "string")),
        stream=bool(_get(body, "stream", "boolean", False)),
        include_usage=bool(_get(opts, "include_usage", "boolean", False, where="stream_options.")))


def _no_tools(json_format, tools, param: str):
    if json_format is not None and tools:
        raise RequestError(f"'{param}' with tools is not supported: the JSON grammar would forbid tool calls",
                           param=param, code="unsupported_value")
    return json_format


def parse_completion(body) -> GenerationRequest:
    """POST /v1/completions: raw text after BOS (no chat template), OpenAI's default max_tokens of 16."""
    body = _body(body)
    _refuse_openai_extras(body)
    if _get(body, "tools", "array"):
        raise RequestError("tools need a chat: use /v1/chat/completions", param="tools", code="unsupported_value")
    for key in ("echo", "suffix"):
        if body.get(key):
            raise RequestError(f"'{key}' is not supported", param=key, code="unsupported_value")
    if _get(body, "best_of", "integer", 1) != 1:
        raise RequestError("only best_of = 1 is supported", param="best_of", code="unsupported_value")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                                   # a batch of one
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt = tuple(prompt)
    elif not isinstance(prompt, str):
        raise RequestError("'prompt' must be a string, an array of token ids, or a batch of one of those",
                           param="prompt", code="invalid_type")
    opts = _get(body, "stream_options", "object") or {}
    return GenerationRequest(
        api="completions", model=_get(body, "model", "string"), prompt=prompt,
        sampling=_sampling(body, max_temperature=2.0, max_tokens_keys=("max_tokens",), stop_key="stop",
                           default_max_tokens=16),
        stream=bool(_get(body, "stream", "boolean", False)),
        include_usage=bool(_get(opts, "include_usage", "boolean", False, where="stream_options.")))


def _responses_input(raw, instructions: str | None) -> tuple:
    """Input items -> chat messages. A `function_call` item is a call of an assistant turn: consecutive ones, and an
    assistant message right before them, make one turn (a turn with no message gets empty content); a
    `function_call_output` item is a tool result. A `reasoning` item goes to the assistant turn after it."""
    msgs = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(raw, str):
        return tuple(msgs + [{"role": "user", "content": raw}])
    if not isinstance(raw, list) or not raw:
        raise RequestError("'input' must be a string or a non-empty array of input items", param="input",
                           code="invalid_type")
    reasoning = ""
    in_turn = False                                   # the last message is an assistant turn calls may join
    for i, item in enumerate(raw):
        w = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"'{w}' must be an object", param=w, code="invalid_type")
        kind = _get(item, "type", "string", "message", where=f"{w}.")
        if kind == "reasoning":
            reasoning += _text_parts(item.get("content"), f"{w}.content", ("reasoning_text",))
            in_turn = in_turn and not reasoning
            continue
        if kind == "function_call":
            call = _responses_tool_call(item, w)
            if not in_turn:
                msgs.append({"role": "assistant", "content": ""})
                if reasoning:
                    msgs[-1]["reasoning_content"], reasoning = reasoning, ""
            msgs[-1].setdefault("tool_calls", []).append(call)
            in_turn = True
            continue
        if kind == "function_call_output":
            msgs.append({"role": "tool", "tool_call_id": _get(item, "call_id", "string", required=True, where=f"{w}."),
                         "content": _text_parts(item.get("output"), f"{w}.output", ("input_text",))})
            in_turn = False
            continue
        if kind != "message":
            raise RequestError(f"input item type {kind!r} is not supported (message, reasoning, function_call and "
                               f"function_call_output only)", param=f"{w}.type", code="unsupported_value")
        (msg,) = _openai_messages([{k: v for k, v in item.items() if k != "type"}], where=w)
        if msg["role"] == "assistant" and reasoning:
            msg["reasoning_content"], reasoning = reasoning, ""
        msgs.append(msg)
        in_turn = msg["role"] == "assistant" and "tool_calls" not in msg
    return tuple(msgs)


def _responses_echo(body: dict, tools: tuple) -> dict:
    """What a response echoes of the request's tools: the function tools, tool_choice, parallel_tool_calls."""
    strict = {t.get("name"): t.get("strict") for t in _get(body, "tools", "array") or [] if isinstance(t, dict)}
    return {"tools": [dict(t, type="function", strict=strict.get(t["name"])) for t in tools],
            "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": _get(body, "parallel_tool_calls", "boolean", True)}


def parse_responses(body) -> GenerationRequest:
    """POST /v1/responses (stateless: previous_response_id is refused, nothing is stored). Function tools (flat
    definitions), `tool_choice` (a forced choice is constrained as on chat completions) and `parallel_tool_calls`;
    calls and results come back in `input` as function_call and function_call_output items."""
    body = _body(body)
    model = _get(body, "model", "string")
    _check_ignored(body, _IGNORED_OPENAI)
    if body.get("previous_response_id") is not None:
        raise RequestError("previous_response_id is not supported: this server stores no responses; send the "
                           "conversation in 'input'", param="previous_response_id", code="unsupported_value")
    tools = _openai_tools(body, flat=True)
    reasoning = _get(body, "reasoning", "object") or {}
    effort = _get(reasoning, "effort", "string", where="reasoning.")
    instructions = _get(body, "instructions", "string")
    json_format, echo = responses_text_format(body)
    return GenerationRequest(
        api="responses", model=model, messages=_responses_input(body.get("input"), instructions), tools=tools,
        json_format=_no_tools(json_format, tools, "text.format"), tool_format=_openai_tool_format(body, tools, flat=True),
        sampling=_sampling(body, max_temperature=2.0, max_tokens_keys=("max_output_tokens",), stop_key="stop"),
        **_thinking_fields(body, model, effort=effort, effort_param="reasoning.effort"),
        stream=bool(_get(body, "stream", "boolean", False)),
        extras={"instructions": instructions, "effort": effort, "metadata": _get(body, "metadata", "object") or {},
                "text_format": echo, **_responses_echo(body, tools)})


# ---------------------------------------------------------------------------------------------- Anthropic
def _anthropic_content(content, role: str, where: str) -> list:
    """One Anthropic message -> chat messages: tool_result blocks become tool messages (before the user's text, as
    the API puts them first), tool_use blocks the assistant's tool calls."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise RequestError(f"'{where}' must be a string or an array of content blocks", param=where,
                           code="invalid_type")
    text, reasoning, calls, results = [], [], [], []
    for i, block in enumerate(content):
        w = f"{where}[{i}]"
        if not isinstance(block, dict):
            raise RequestError(f"'{w}' must be an object", param=w, code="invalid_type")
        kind = _get(block, "type", "string", required=True, where=f"{w}.")
        if kind == "text":
            text.append(_get(block, "text", "string", "", where=f"{w}."))
        elif kind == "thinking" and role == "assistant":
            reasoning.append(_get(block, "thinking", "string", "", where=f"{w}."))
        elif kind == "redacted_thinking" and role == "assistant":
            continue
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": _get(block, "id", "string", "", where=f"{w}."),
                          "name": _get(block, "name", "string", required=True, where=f"{w}."),
                          "arguments": json.dumps(_get(block, "input", "object", {}, where=f"{w}."),
                                                  ensure_ascii=False)})
        elif kind == "tool_result" and role == "user":
            results.append({"role": "tool", "tool_call_id": _get(block, "tool_use_id", "string", required=True,
                                                                 where=f"{w}."),
                            "content": _tool_result_text(block.get("content"), f"{w}.content")})
        else:
            raise RequestError(f"content block type {kind!r} is not supported in a {role} message (text"
                               f"{', thinking and tool_use' if role == 'assistant' else ' and tool_result'} only)",
                               param=f"{w}.type", code="unsupported_value")
    msg = {"role": role, "content": "".join(text)}
    if reasoning:
        msg["reasoning_content"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return results + ([msg] if not results or text else [])


def _anthropic_messages(body: dict) -> tuple:
    system = body.get("system")
    out = []
    if system is not None:
        if isinstance(system, list):
            system = _text_parts(system, "system", ("text",))
        if not isinstance(system, str):
            raise RequestError("'system' must be a string or an array of text blocks", param="system",
                               code="invalid_type")
        if system:
            out.append({"role": "system", "content": system})
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestError("'messages' must be a non-empty array", param="messages", code="invalid_type")
    for i, m in enumerate(raw):
        w = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"'{w}' must be an object", param=w, code="invalid_type")
        role = _get(m, "role", "string", required=True, where=f"{w}.")
        if role not in ("user", "assistant"):
            raise RequestError(f"'{w}.role' must be user or assistant, got {role!r}", param=f"{w}.role",
                               code="invalid_value")
        out += _anthropic_content(m.get("content"), role, f"{w}.content")
    return tuple(out)


def _anthropic_thinking(body: dict, model: str | None) -> dict:
    """`thinking` ({"type": "enabled" | "adaptive" | "between_tools" | "disabled"}), `output_config.effort` (high |
    max, as reasoning_effort), `think`, or the reasoner model name."""
    cfg = _get(body, "output_config", "object") or {}
    return _thinking_fields(body, model, effort=_get(cfg, "effort", "string", where="output_config."),
                            effort_param="output_config.effort")


def parse_messages(body) -> GenerationRequest:
    """POST /v1/messages: max_tokens is required, as in Anthropic's API; temperature in [0, 1]. The current SDK
    no longer has temperature/top_p/top_k arguments: clients send them through extra_body."""
    body = _body(body)
    model = _get(body, "model", "string")
    _check_ignored(body, _IGNORED_ANTHROPIC)
    tools = _anthropic_tools(body)
    json_format = _no_tools(anthropic_output_format(body), tools, "output_config.format")
    return GenerationRequest(
        api="messages", model=model, messages=_anthropic_messages(body), tools=tools, json_format=json_format,
        tool_format=_anthropic_tool_format(body, tools),
        sampling=_sampling(body, max_temperature=1.0, max_tokens_keys=("max_tokens",), stop_key="stop_sequences",
                           max_tokens_required=True),
        **_anthropic_thinking(body, model), stream=bool(_get(body, "stream", "boolean", False)))


def parse_count_tokens(body) -> GenerationRequest:
    """POST /v1/messages/count_tokens: the prompt as /v1/messages would encode it."""
    body = _body(body)
    model = _get(body, "model", "string")
    return GenerationRequest(api="messages", model=model, messages=_anthropic_messages(body), sampling=Sampling(),
                             tools=_anthropic_tools(body),
                             **_anthropic_thinking(body, model))

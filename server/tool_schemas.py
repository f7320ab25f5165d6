"""Tool definitions, tool calls and tool results in requests: OpenAI function tools, assistant `tool_calls` and
`tool_choice` (chat completions; /v1/responses: flat function tools, `function_call` input items, a flat named
`tool_choice`); Anthropic client tools, `tool_result` content and `tool_choice`. All become ds4lib.chat's form:
function definitions {"name", "description"?, "parameters"?} and calls {"id", "name", "arguments" (JSON object
text)}. "none" leaves the tools out; "auto" lets the model choose. A forced choice (OpenAI "required" or a named
function, Anthropic "any" or a named tool) becomes a ds4lib.engine.ToolCallFormat: the reply is then exactly a DSML
call block of the allowed tools (of the named one), one call where parallel calls are disabled
(`parallel_tool_calls: false`, `disable_parallel_tool_use: true`; they have no effect on "auto"), compiled here so
that an unknown name or a tool schema the grammar cannot enforce is a 400 before the request is queued.

Does not own: the messages around them (schemas.py), their encoding (ds4lib/dsml.py), the grammar
(ds4lib/engine/constrain.py).
"""
from __future__ import annotations

import json
import re

from ds4lib.engine import GrammarError, ToolCallFormat

from server.fields import RequestError, get_field as _get, text_parts as _text_parts

__all__ = ["openai_tools", "openai_tool_calls", "openai_tool_format", "responses_tool_call", "anthropic_tools",
           "anthropic_tool_format", "tool_result_text"]

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


def _openai_choice(choice, flat: bool = False):
    """"auto" | "none" | "required" | {"type": "function", "function": {"name"}} (flat, the responses API:
    {"type": "function", "name"}) -> (kind, name)."""
    if choice in (None, "auto", "none", "required"):
        return choice or "auto", None
    if isinstance(choice, dict) and choice.get("type") == "function":
        if flat:
            return "function", _get(choice, "name", "string", required=True, where="tool_choice.")
        fn = _get(choice, "function", "object", required=True, where="tool_choice.")
        return "function", _get(fn, "name", "string", required=True, where="tool_choice.function.")
    shape = '{"type": "function", "name": ...}' if flat else '{"type": "function", "function": {"name": ...}}'
    raise RequestError(f"'tool_choice' {json.dumps(choice)[:60]} is not supported: auto, none, required or {shape}",
                       param="tool_choice", code="unsupported_value")


def _forced(tools: tuple, name: str | None, single: bool, param: str) -> ToolCallFormat:
    """The grammar of a forced call: of any tool, or of the one named (`param` names the name's field)."""
    if not tools:
        raise RequestError(f"'{param}' forces a tool call but the request has no tools", param=param,
                           code="invalid_value")
    if name is not None:
        tools = tuple(t for t in tools if t["name"] == name)
        if not tools:
            raise RequestError(f"'{param}' {name[:60]!r} is not one of the request's tools", param=param,
                               code="invalid_value")
    try:
        return ToolCallFormat.from_tools(tools, single=single)
    except GrammarError as e:
        raise RequestError(f"'tools': a forced call cannot be constrained: {e}", param="tools",
                           code="invalid_value") from None


def _function(name, description, parameters, where: str) -> dict:
    if not _TOOL_NAME.match(name):
        raise RequestError(f"'{where}' {name[:40]!r} must be 1-128 of letters, digits, _ . : -", param=where,
                           code="invalid_value")
    d = {"name": name}
    if description is not None:
        d["description"] = description
    if parameters is not None:
        d["parameters"] = parameters
    return d


def _unique(tools: list) -> tuple:
    names = [t["name"] for t in tools]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise RequestError(f"tool names must be unique; repeated: {sorted(dup)}", param="tools", code="invalid_value")
    return tuple(tools)


def openai_tools(body: dict, flat: bool = False) -> tuple:
    """OpenAI function tools: nested {"type": "function", "function": {"name", "description"?, "parameters"?}} on chat
    completions; flat {"type": "function", "name", "description"?, "parameters"?, "strict"?} on /v1/responses
    (`flat`; strict is accepted: a forced call is constrained anyway, an auto one never is)."""
    tools = _get(body, "tools", "array")
    kind, _ = _openai_choice(body.get("tool_choice"), flat=flat)
    if not tools or kind == "none":
        return ()                                     # "none": the tools stay out of the prompt
    shape = "{'type': 'function', 'name': ...}); built-in tools are not supported" if flat else \
        "{'type': 'function', 'function': {...}})"
    out = []
    for i, t in enumerate(tools):
        w = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            raise RequestError(f"'{w}' must be a function tool ({shape}", param=w, code="unsupported_value")
        if flat:
            _get(t, "strict", "boolean", where=f"{w}.")
            fn, at = t, f"{w}."
        else:
            fn, at = _get(t, "function", "object", required=True, where=f"{w}."), f"{w}.function."
        out.append(_function(_get(fn, "name", "string", required=True, where=at),
                             _get(fn, "description", "string", where=at),
                             _get(fn, "parameters", "object", where=at), f"{at}name"))
    return _unique(out)


def openai_tool_format(body: dict, tools: tuple, flat: bool = False) -> ToolCallFormat | None:
    """`tool_choice` "required" or a named function (flat on /v1/responses: {"type": "function", "name"}), with
    `parallel_tool_calls`, over `openai_tools(body, flat)`; None for auto and none."""
    kind, name = _openai_choice(body.get("tool_choice"), flat=flat)
    if kind in ("auto", "none"):
        return None
    single = _get(body, "parallel_tool_calls", "boolean", True) is False
    param = "tool_choice" if name is None else ("tool_choice.name" if flat else "tool_choice.function.name")
    return _forced(tools, name, single, param)


def responses_tool_call(item: dict, where: str) -> dict:
    """A `function_call` input item {"call_id", "name", "arguments"} -> a call {"id", "name", "arguments"}."""
    args = _get(item, "arguments", "string", required=True, where=f"{where}.")
    _json_object(args, f"{where}.arguments")
    return {"id": _get(item, "call_id", "string", required=True, where=f"{where}."),
            "name": _get(item, "name", "string", required=True, where=f"{where}."), "arguments": args}


def openai_tool_calls(raw, where: str) -> list:
    if not isinstance(raw, list):
        raise RequestError(f"'{where}' must be an array", param=where, code="invalid_type")
    calls = []
    for i, c in enumerate(raw):
        w = f"{where}[{i}]"
        if not isinstance(c, dict) or c.get("type", "function") != "function":
            raise RequestError(f"'{w}' must be a function call", param=w, code="invalid_type")
        fn = _get(c, "function", "object", required=True, where=f"{w}.")
        args = _get(fn, "arguments", "string", "{}", where=f"{w}.function.")
        _json_object(args, f"{w}.function.arguments")
        calls.append({"id": _get(c, "id", "string", "", where=f"{w}."),
                      "name": _get(fn, "name", "string", required=True, where=f"{w}.function."), "arguments": args})
    return calls


def _json_object(text: str, where: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError(f"'{where}' is not JSON: {e}", param=where, code="invalid_value") from None
    if not isinstance(value, dict):
        raise RequestError(f"'{where}' must be a JSON object", param=where, code="invalid_value")
    return value


def tool_result_text(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n\n".join(_text_parts([b], where, ("text",)) for b in content) if isinstance(content, list) else \
        _text_parts(content, where, ("text",))


def _anthropic_choice(body: dict):
    """`tool_choice` {"type": "auto" | "any" | "tool" | "none", "name"?, "disable_parallel_tool_use"?} -> (type,
    name, single)."""
    choice = _get(body, "tool_choice", "object")
    if choice is None:
        return "auto", None, False
    kind = _get(choice, "type", "string", required=True, where="tool_choice.")
    if kind not in ("auto", "any", "tool", "none"):
        raise RequestError(f"'tool_choice.type' must be auto, any, tool or none, got {kind[:40]!r}",
                           param="tool_choice.type", code="invalid_value")
    name = _get(choice, "name", "string", required=True, where="tool_choice.") if kind == "tool" else None
    single = bool(_get(choice, "disable_parallel_tool_use", "boolean", False, where="tool_choice."))
    return kind, name, single


def anthropic_tools(body: dict) -> tuple:
    tools = _get(body, "tools", "array")
    if _anthropic_choice(body)[0] == "none":
        return ()
    out = []
    for i, t in enumerate(tools or []):
        w = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "custom") != "custom":
            raise RequestError(f"'{w}' must be a client tool (name, description, input_schema); server tools are not "
                               f"supported", param=w, code="unsupported_value")
        out.append(_function(_get(t, "name", "string", required=True, where=f"{w}."),
                             _get(t, "description", "string", where=f"{w}."),
                             _get(t, "input_schema", "object", required=True, where=f"{w}."), f"{w}.name"))
    return _unique(out)


def anthropic_tool_format(body: dict, tools: tuple) -> ToolCallFormat | None:
    """`tool_choice` any or tool (with `disable_parallel_tool_use`) over `anthropic_tools(body)`; None for auto and
    none."""
    kind, name, single = _anthropic_choice(body)
    if kind in ("auto", "none"):
        return None
    return _forced(tools, name, single, "tool_choice" if name is None else "tool_choice.name")

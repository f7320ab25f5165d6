"""Tool definitions, tool calls and tool results in requests: OpenAI function tools, assistant `tool_calls` and
`tool_choice`; Anthropic client tools, `tool_result` content and `tool_choice`. All become ds4lib.chat's form:
function definitions {"name", "description"?, "parameters"?} and calls {"id", "name", "arguments" (JSON object
text)}. A forced tool choice is refused (it needs constrained decoding); "none" leaves the tools out.

Does not own: the messages around them (schemas.py), their encoding (ds4lib/dsml.py).
"""
from __future__ import annotations

import json
import re

from server.fields import RequestError, get_field as _get, text_parts as _text_parts

__all__ = ["openai_tools", "openai_tool_calls", "anthropic_tools", "tool_result_text"]

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


def _check_tool_choice(choice, where: str) -> None:
    """Automatic tool use or none; a forced call is refused (it needs constrained decoding, which this server does
    not have)."""
    if choice not in ("auto", "none"):
        raise RequestError(f"'{where}' {json.dumps(choice)[:60]} is not supported: only automatic tool use (auto) or "
                           f"none; forcing a call needs constrained decoding", param=where, code="unsupported_value")


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


def openai_tools(body: dict) -> tuple:
    tools = _get(body, "tools", "array")
    choice = body.get("tool_choice")
    if choice is not None:
        _check_tool_choice(choice, "tool_choice")
    if not tools or choice == "none":
        return ()                                     # "none": the tools stay out of the prompt
    out = []
    for i, t in enumerate(tools):
        w = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            raise RequestError(f"'{w}' must be a function tool ({{'type': 'function', 'function': {{...}}}})",
                               param=w, code="unsupported_value")
        fn = _get(t, "function", "object", required=True, where=f"{w}.")
        out.append(_function(_get(fn, "name", "string", required=True, where=f"{w}.function."),
                             _get(fn, "description", "string", where=f"{w}.function."),
                             _get(fn, "parameters", "object", where=f"{w}.function."), f"{w}.function.name"))
    return _unique(out)


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


def anthropic_tools(body: dict) -> tuple:
    tools = _get(body, "tools", "array")
    choice = _get(body, "tool_choice", "object")
    if choice is not None:
        kind = _get(choice, "type", "string", required=True, where="tool_choice.")
        _check_tool_choice(kind, "tool_choice.type")
        if kind == "none":
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

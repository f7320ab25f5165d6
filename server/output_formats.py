"""Structured output requests -> ds4lib.engine.JsonFormat: OpenAI chat `response_format`, the responses API's
`text.format` and Anthropic's `output_config.format` (or top-level `output_format`).

Owns the three request shapes and their checks: `{"type": "text"}` (or none) is free text; `json_object` is any JSON
object; `json_schema` is the given schema (`name`, `description` and `strict` are accepted; the schema is always
enforced strictly). A schema that is malformed or uses what the grammar compiler does not implement is a 400 naming
the compiler's reason, before the request is queued. Also the format echoed back by the responses API.

Does not own: the constraint itself (ds4lib.engine.constrain) or when it starts (app.py: after `</think>` in
thinking mode).
"""
from __future__ import annotations

from ds4lib.engine import GrammarError, JsonFormat

from server.fields import RequestError
from server.fields import get_field as _get

__all__ = ["chat_response_format", "responses_text_format", "anthropic_output_format"]

_JSON_OBJECT = {"type": "object"}


def _compile(schema, param: str) -> JsonFormat:
    try:
        return JsonFormat.from_schema(schema)
    except GrammarError as e:
        raise RequestError(f"'{param}': {e}", param=param, code="invalid_json_schema") from None


def _format(fmt: dict, where: str, schema_of) -> JsonFormat | None:
    kind = _get(fmt, "type", "string", "text", where=f"{where}.")
    if kind == "text":
        return None
    if kind == "json_object":
        return _compile(_JSON_OBJECT, where)
    if kind != "json_schema":
        raise RequestError(f"'{where}.type' must be text, json_object or json_schema, got {kind!r}",
                           param=f"{where}.type", code="invalid_value")
    schema, param = schema_of(fmt)
    return _compile({} if schema is None else schema, param)


def chat_response_format(body: dict) -> JsonFormat | None:
    """`response_format`: {"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}."""
    fmt = _get(body, "response_format", "object")
    if fmt is None:
        return None

    def schema_of(f):
        spec = _get(f, "json_schema", "object", required=True, where="response_format.")
        _get(spec, "name", "string", where="response_format.json_schema.")
        _get(spec, "strict", "boolean", where="response_format.json_schema.")
        return (_get(spec, "schema", "object", where="response_format.json_schema."),
                "response_format.json_schema.schema")
    return _format(fmt, "response_format", schema_of)


def responses_text_format(body: dict) -> tuple[JsonFormat | None, dict]:
    """`text.format` of /v1/responses ({"type": "json_schema", "name", "schema", "strict"?}, flattened); returns
    the format and what the response echoes under `text.format`."""
    text = _get(body, "text", "object") or {}
    fmt = _get(text, "format", "object", where="text.")
    if fmt is None:
        return None, {"type": "text"}

    def schema_of(f):
        _get(f, "name", "string", where="text.format.")
        _get(f, "strict", "boolean", where="text.format.")
        return _get(f, "schema", "object", where="text.format."), "text.format.schema"
    return _format(fmt, "text.format", schema_of), fmt


def anthropic_output_format(body: dict) -> JsonFormat | None:
    """`output_config.format` (or the earlier beta's top-level `output_format`): {"type": "json_schema", "schema"}."""
    cfg = _get(body, "output_config", "object") or {}
    fmt, where = _get(cfg, "format", "object", where="output_config."), "output_config.format"
    if fmt is None:
        fmt, where = _get(body, "output_format", "object"), "output_format"
    if fmt is None:
        return None
    kind = _get(fmt, "type", "string", required=True, where=f"{where}.")
    if kind != "json_schema":
        raise RequestError(f"'{where}.type' must be json_schema, got {kind!r}", param=f"{where}.type",
                           code="invalid_value")
    schema = _get(fmt, "schema", "object", required=True, where=f"{where}.")
    return _compile(schema, f"{where}.schema")

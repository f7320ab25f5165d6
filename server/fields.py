"""Field checks shared by the request parsers: JSON types, ranges, text content parts, and `RequestError`.

Owns: `RequestError` (a refused request: the calling API's error body with `status` and optional headers),
`body_object`, `get_field` (a typed field; null counts as absent), `in_range`, `text_parts` (string content or
an array of text parts). Does not own: which fields a request has (schemas.py, tool_schemas.py).
"""
from __future__ import annotations

__all__ = ["RequestError", "JSON_TYPES", "body_object", "get_field", "in_range", "text_parts"]


class RequestError(ValueError):
    """A request the server refuses: rendered as the calling API's error body with `status`."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = message, param, code, status, kind
        self.headers = headers or {}


JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict}


def body_object(body) -> dict:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def get_field(body: dict, key: str, kind: str, default=None, *, required: bool = False, where: str = ""):
    """body[key] checked against a JSON type; null counts as absent."""
    name = f"{where}{key}"
    value = body.get(key)
    if value is None:
        if required:
            raise RequestError(f"'{name}' is required", param=name, code="missing_required_parameter")
        return default
    ok = isinstance(value, JSON_TYPES[kind]) and not (kind in ("integer", "number") and isinstance(value, bool))
    if not ok:
        raise RequestError(f"'{name}' must be {'an' if kind[0] in 'aeiou' else 'a'} {kind}, got "
                           f"{type(value).__name__} {str(value)[:40]!r}", param=name, code="invalid_type")
    return float(value) if kind == "number" else value


def in_range(name: str, value, lo, hi, *, lo_open: bool = False):
    if value is None:
        return None
    if value < lo or value > hi or (lo_open and value == lo):
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise RequestError(f"'{name}' must be in {bound}, got {value}", param=name, code="invalid_value")
    return value


def text_parts(content, where: str, text_types: tuple) -> str:
    """String content, or an array of text parts joined; any other part type is refused."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"'{where}' must be a string or an array of content parts", param=where,
                           code="invalid_type")
    out = []
    for i, part in enumerate(content):
        if not isinstance(part, dict):
            raise RequestError(f"'{where}[{i}]' must be an object", param=f"{where}[{i}]", code="invalid_type")
        kind = get_field(part, "type", "string", required=True, where=f"{where}[{i}].")
        if kind not in text_types:
            raise RequestError(f"content part type {kind!r} is not supported (text only)", param=f"{where}[{i}].type",
                               code="unsupported_value")
        out.append(get_field(part, "text", "string", "", where=f"{where}[{i}]."))
    return "".join(out)

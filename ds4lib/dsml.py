"""DSML, the V4/V4.1 chat encoding's tool-call markup: tool definitions in the prompt, tool calls in assistant turns,
and the parser of generated tool calls (docs/architecture.md §13.4; DeepSeek-V4 `encoding_dsv4.py`, read for the format).

Owns: `render_tools` (the "## Tools" section appended to the system message), `render_tool_calls` (an assistant
turn's calls as markup and value pieces), `render_tool_result`, `parse_tool_calls` (generated text after the
answer -> calls), `TOOL_CALLS_START` and `ToolCallError`.

Format. A call block follows the answer text:

    \\n\\n<｜DSML｜tool_calls>\\n<｜DSML｜invoke name="NAME">\\n<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>
    ...\\n</｜DSML｜invoke>\\n<｜DSML｜invoke ...>...\\n</｜DSML｜tool_calls>

one parameter per line; a string value is written as is with string="true", any other JSON value as JSON with
string="false". Tool results are `<tool_result>{content}</tool_result>` blocks inside a user turn (chat.py merges
them). Calls are {"name", "arguments"} with `arguments` a JSON object text, as OpenAI's function calls.

Does not own: where the tools section and results go in a conversation (chat.py), response shapes (server/).
"""
from __future__ import annotations

import json
import re

__all__ = ["DSML", "TOOL_CALLS_START", "TOOL_CALLS_END", "ToolCallError", "render_tools", "render_tool_calls",
           "render_tool_result", "parse_tool_calls"]

DSML = "｜DSML｜"
TOOL_CALLS_START = f"\n\n<{DSML}tool_calls>"
TOOL_CALLS_END = f"</{DSML}tool_calls>"
_INVOKE_END = f"</{DSML}invoke>"

_TOOLS_SECTION = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{d}tool_calls>" block like the following:

<{d}tool_calls>
<{d}invoke name="$TOOL_NAME">
<{d}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{d}parameter>
...
</{d}invoke>
<{d}invoke name="$TOOL_NAME2">
...
</{d}invoke>
</{d}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

_INVOKE_RE = re.compile(rf'<{DSML}invoke name="([^"\n]*)">\n(.*?)\n?{re.escape(_INVOKE_END)}', re.S)
_PARAM_RE = re.compile(rf'<{DSML}parameter name="([^"\n]*)" string="(true|false)">(.*?)</{DSML}parameter>', re.S)
_INVOKE_HEAD = re.compile(rf'<{DSML}invoke name="([^"\n]*)">\n')
_PARAM_HEAD = re.compile(rf'\s*<{DSML}parameter name="([^"\n]*)" string="(true|false)">')
_INVOKE_TAIL = re.compile(rf'\s*{re.escape(_INVOKE_END)}')
_PARAM_END = f"</{DSML}parameter>"
_SPACE = re.compile(r"\s*")
_DECODER = json.JSONDecoder()


class ToolCallError(ValueError):
    """A tool definition or call that cannot be encoded."""


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def render_tools(tools) -> str:
    """The tools section for function definitions [{"name", "description"?, "parameters"?}], one JSON line each."""
    return _TOOLS_SECTION.replace("{d}", DSML).replace("{schemas}", "\n".join(_json(t) for t in tools))


def render_tool_calls(calls) -> list:
    """An assistant turn's calls [{"name", "arguments": JSON object text}] as (text, markup) pieces."""
    out = [(TOOL_CALLS_START + "\n", True)]
    for i, call in enumerate(calls):
        try:
            args = json.loads(call["arguments"]) if isinstance(call["arguments"], str) else call["arguments"]
        except json.JSONDecodeError as e:
            raise ToolCallError(f"tool call {i} ({call['name']!r}): arguments are not JSON ({e})") from None
        if not isinstance(args, dict):
            raise ToolCallError(f"tool call {i} ({call['name']!r}): arguments must be a JSON object")
        out += [(f'<{DSML}invoke name="', True), (call["name"], False), ('">\n', True)]
        for j, (k, v) in enumerate(args.items()):
            out += [(f'<{DSML}parameter name="', True), (str(k), False),
                    (f'" string="{"true" if isinstance(v, str) else "false"}">', True),
                    (v if isinstance(v, str) else _json(v), False),
                    (f"</{DSML}parameter>" + ("\n" if j + 1 < len(args) else ""), True)]
        out.append((f"\n{_INVOKE_END}" + ("\n" if i + 1 < len(calls) else ""), True))
    out.append((f"\n{TOOL_CALLS_END}", True))
    return out


def render_tool_result(content: str) -> list:
    return [("<tool_result>", True), (content, False), ("</tool_result>", True)]


_CUT = "cut"


def _value(is_str: bool, text: str):
    """A parameter's value from its text: as is with string="true", else JSON (kept as text when it is not JSON)."""
    if not is_str:
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass
    return text


def _cut_at(block: str, pos: int) -> bool:
    """Whether the text from `pos` on is the start of a parameter line or of the invoke's closing tag (or nothing)."""
    rest = block[pos:].lstrip()
    param = f"<{DSML}parameter"
    return param.startswith(rest) or _INVOKE_END.startswith(rest) or (rest.startswith(param) and ">" not in rest)


def _scan_invoke(block: str, pos: int):
    """The invoke whose parameter lines start at `pos`, read in order: (arguments, end) when its closing tag follows
    them; _CUT where the text ends first; None for lines this reader does not follow. A string="false" value is read
    as one JSON value (so a closing tag inside a JSON string stays in the value) that the parameter's closing tag must
    follow; a string="true" value ends at the first closing tag."""
    args = {}
    while True:
        tail = _INVOKE_TAIL.match(block, pos)
        if tail:
            return args, tail.end()
        head = _PARAM_HEAD.match(block, pos)
        if not head:
            return _CUT if _cut_at(block, pos) else None
        name, pos = head.group(1), head.end()
        end = block.find(_PARAM_END, pos)
        if end < 0:
            return _CUT
        if head.group(2) == "false":
            try:
                value, stop = _DECODER.raw_decode(block, _SPACE.match(block, pos).end())
            except json.JSONDecodeError as e:
                if e.pos >= len(block) or e.msg.startswith("Unterminated string"):
                    return _CUT                            # the JSON value runs to the end of the text
                stop = -1
            if stop >= 0 and block.startswith(_PARAM_END, stop):
                args[name], pos = value, stop + len(_PARAM_END)
                continue
            if stop >= 0 and _PARAM_END.startswith(block[stop:]):
                return _CUT                                # the closing tag is still to come
        args[name], pos = _value(head.group(2) == "true", block[pos:end]), end + len(_PARAM_END)


def parse_tool_calls(block: str) -> list:
    """The complete invokes of a generated call block (the text after TOOL_CALLS_START), in order, as
    [{"name", "arguments"}]. A parameter with string="false" whose value is not JSON is kept as a string. An invoke
    is read line by line (`_scan_invoke`: a JSON value may hold any text, closing tags included); one that reader
    cannot follow falls back to tags found by pattern (the first closing tags end the call and its values)."""
    calls, pos = [], 0
    while True:
        head = _INVOKE_HEAD.search(block, pos)
        if not head:
            return calls
        scanned = _scan_invoke(block, head.end())
        if scanned is _CUT:
            return calls
        if scanned is not None:
            args, pos = scanned
        else:
            m = _INVOKE_RE.match(block, head.start())
            if not m:
                return calls
            args = {name: _value(is_str == "true", value) for name, is_str, value in _PARAM_RE.findall(m.group(2))}
            pos = m.end()
        calls.append({"name": head.group(1), "arguments": _json(args)})

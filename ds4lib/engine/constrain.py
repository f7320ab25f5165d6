"""Constrained decoding: a request's JSON Schema, or a forced DSML tool call, as a per-step token mask, compiled by
llguidance (no PyTorch).

Owns:
- `JsonFormat`: a checked JSON Schema (canonical JSON text), the request's side. `JsonFormat.from_schema` compiles it
  once without a tokenizer, so a malformed or unsupported schema is refused before the request is queued
  (`GrammarError`, a ValueError).
- `ToolCallFormat`: a reply that is exactly one DSML call block (ds4lib/dsml.py) of given tools, as a Lark grammar
  (`ToolCallFormat.from_tools`, compiled the same way). Same interface as JsonFormat (`grammar()`, `after_token`),
  so the engine and `Constrainer.start` take either.
- `TokenConstraint`: one generation's grammar state. `mask()` gives the tokens allowed next as an int32 bitmask
  [ceil(V / 32)] (ds4lib.ref.sampling's layout, which is llguidance's); `advance(token)` moves past the sampled token;
  `finished` says that only EOS can follow.
- `Constrainer`: the engine's llguidance tokenizer, built once from the HF tokenizer JSON the engine loaded (byte-level
  BPE; special tokens are never allowed by a grammar), and `start(fmt)` -> TokenConstraint.

Rules:
- EOS is allowed exactly when the grammar accepts; once the top-level value is closed it is the only token.
- Unknown or unimplemented schema keywords are refused, not ignored (llguidance without `lenient`): what is enforced is
  what was asked.
- Whitespace between JSON tokens: at most 16 characters of [ \\t\\n\\r] per gap. llguidance's default is unbounded,
  which lets a weak model spend max_tokens on blank lines inside an otherwise valid document.
- `JsonFormat.after_token` (thinking mode: `</think>`): until that token is produced any token but EOS may be drawn,
  and that token starts the grammar, so a thinking reply reasons freely and then answers in JSON.
- Masks span the model's vocabulary V: tokenizer ids >= V are dropped, model ids past the tokenizer never allowed.
- A forced call block is TOOL_CALLS_START, a newline, one invoke (`single`) or more, each of an allowed tool, joined
  by newlines, then a newline and TOOL_CALLS_END: the bytes `render_tool_calls` writes. Each invoke holds its tool's
  parameters (`properties`) in their schema order, the required ones always, the optional ones where chosen. A
  property whose schema is a plain string (annotations aside) is written raw, string="true", with any text but the
  closing tags `</｜DSML｜parameter>` and `</｜DSML｜invoke>` (they would end the value or the call when it is read
  back). Every other property is written string="false" as JSON valid under its sub-schema (the parameters'
  `$defs` / `definitions` come along); one whose values are all strings (`enum` / `const`), or a string with an
  anchored `pattern` ("^...$", no top-level |) and / or `minLength` / `maxLength`, may also be written raw, held to
  the same values, as `render_tool_calls` and the official encoder write any string. Parameter keywords the
  grammar cannot enforce (`anyOf`, `minProperties`, ... on the parameters object) are refused, not ignored. A
  string="false" JSON value may hold a closing tag inside a JSON string: `parse_tool_calls` reads such a value as
  one JSON value.

Does not own: drawing a token under the mask (ds4lib.ref.sampling, kernels.sampling), the generation loop
(engine.py), the APIs' response_format and tool_choice (server/output_formats.py, server/tool_schemas.py), the DSML
markup itself (ds4lib/dsml.py).

Shapes: V vocab, NW = ceil(V / 32) mask words.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask

from ds4lib.dsml import DSML, TOOL_CALLS_END, TOOL_CALLS_START
from ds4lib.ref.sampling import mask_words, token_mask

__all__ = ["JsonFormat", "ToolCallFormat", "GrammarError", "TokenConstraint", "Constrainer"]

_OPTIONS = {"whitespace_pattern": r"(?:\x20|\x0A[\x20\x09]{0,20})?"}


class GrammarError(ValueError):
    """A schema that cannot be compiled, or a constraint that cannot go on (a rejected token, an empty mask)."""


def _grammar(schema_text: str) -> str:
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema_text, overrides=_OPTIONS)
    except ValueError as e:
        raise GrammarError(f"the JSON schema cannot be read: {e}") from None
    err = llguidance.LLMatcher.validate_grammar(grammar)
    if err:
        raise GrammarError(f"the JSON schema is not supported: {err.strip()}")
    return grammar


@dataclass(frozen=True)
class JsonFormat:
    """A JSON Schema the output must validate against (compact JSON text in the given key order, which is the order
    the properties are generated in; `from_schema` checks it)."""
    schema: str
    after_token: int | None = None

    @classmethod
    def from_schema(cls, schema, after_token: int | None = None) -> "JsonFormat":
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"a JSON schema is an object, got {type(schema).__name__}")
        text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))   # key order: properties come in it
        _grammar(text)
        return cls(text, after_token)

    def grammar(self) -> str:
        return _grammar(self.schema)


# ---------------------------------------------------------------------------------------------- forced tool calls
_ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly"}
_PARAMETERS_KEYS = {"type", "properties", "required", "additionalProperties", "$defs", "definitions", "$schema", "$id",
                    *_ANNOTATIONS}
_PARAM_CLOSE = f"</{DSML}parameter>"
_INVOKE_CLOSE = f"</{DSML}invoke>"
# a raw string value with its closing tag (Lark regexes): ends at the first `</｜DSML｜parameter>`, never holds
# `</｜DSML｜invoke>`; a constrained string's terminal (_raw_terminal) adds its own pattern or lengths to the same
_RAW_CLOSE = f"<\\/{DSML}parameter>"
_RAW_ONLY = f"~/(?s:.*){_RAW_CLOSE}(?s:.+)/ & ~/(?s:.*)<\\/{DSML}invoke>(?s:.*)/"
_RAW_VALUE = f"RAW_VALUE: /(?s:.*){_RAW_CLOSE}/ & {_RAW_ONLY}"


def _lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


_TRUE, _FALSE = _lit('true">'), _lit('false">')             # what follows `string="`


def _plain_string(schema) -> bool:
    return isinstance(schema, dict) and schema.get("type") == "string" and set(schema) - _ANNOTATIONS == {"type"}


def _raw_choices(schema) -> list:
    """The values of an all-string `enum` / `const` schema (nothing else but annotations), else []."""
    if not isinstance(schema, dict) or schema.get("type", "string") != "string" or \
            set(schema) - _ANNOTATIONS - {"type"} not in ({"enum"}, {"const"}):
        return []
    values = schema["enum"] if "enum" in schema else [schema["const"]]
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        return []
    return [v for v in dict.fromkeys(values) if _PARAM_CLOSE not in v and _INVOKE_CLOSE not in v]


def _anchored_body(pattern: str) -> str | None:
    """The body of a pattern anchored at both ends ("^...$", no other anchor, no top-level alternation), as a Lark
    regex body (slashes escaped), else None: only such a pattern says the same of raw text as of a JSON string."""
    if not (isinstance(pattern, str) and pattern.startswith("^") and pattern.endswith("$") and len(pattern) >= 2):
        return None
    body, depth, i = pattern[1:-1], 0, 0
    if body.endswith("\\") and (len(body) - len(body.rstrip("\\"))) % 2:
        return None                                   # the final $ was escaped
    while i < len(body):
        ch = body[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "[":                                 # a class: skip to its end
            j = i + 1 + (body[i + 1:i + 2] == "]")
            while j < len(body) and body[j] != "]":
                j += 2 if body[j] == "\\" else 1
            i = j + 1
            continue
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch in "^$" or (ch == "|" and depth == 0) or depth < 0:
            return None
        i += 1
    return body.replace("/", "\\/") if depth == 0 else None


def _raw_terminal(schema) -> str | None:
    """A Lark terminal body for a string schema's raw value with its closing tag, when the schema is a string with
    only `pattern` (anchored: _anchored_body) and / or `minLength` / `maxLength` besides annotations; else None."""
    if not isinstance(schema, dict) or schema.get("type") != "string":
        return None
    keys = set(schema) - _ANNOTATIONS - {"type"}
    if not keys or not keys <= {"pattern", "minLength", "maxLength"}:
        return None
    parts = []
    if "pattern" in keys:
        body = _anchored_body(schema["pattern"])
        if body is None:
            return None
        parts.append(f"/(?:{body}){_RAW_CLOSE}/")              # "." keeps ECMA-262's meaning: not a newline
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    if not (isinstance(lo, int) and lo >= 0 and (hi is None or isinstance(hi, int) and hi >= lo)):
        return None
    if keys & {"minLength", "maxLength"}:
        parts.append(f"/(?s:.{{{lo},{'' if hi is None else hi}}}){_RAW_CLOSE}/")
    terminal = " & ".join(parts + [_RAW_ONLY])
    try:                                              # a pattern llguidance's regex cannot read: JSON only
        err = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(
            f"start: RAW\nRAW: {terminal}\n"))
    except ValueError:
        return None
    return None if err else terminal


class _ToolGrammar:
    """Accumulates the Lark rules of a call block (ToolCallFormat.from_tools)."""

    def __init__(self):
        self.rules = []

    def value(self, rule: str, schema, defs: dict, where: str) -> None:
        """`rule`: what follows `string="` up to and including the parameter's closing tag."""
        if _plain_string(schema):
            self.rules.append(f"{rule}: {_TRUE} RAW_VALUE")
            return
        if not isinstance(schema, dict) and schema is not True:
            raise GrammarError(f"{where}: a property schema is an object or a boolean, got {type(schema).__name__}")
        choices = _raw_choices(schema)
        alts = [f"{_TRUE} ({' | '.join(_lit(v + _PARAM_CLOSE) for v in choices)})"] if choices else []
        raw = _raw_terminal(schema)
        if raw is not None:                           # a constrained string: raw too, as the encoder writes it
            name = f"RAW_{rule.upper()}"
            self.rules.append(f"{name}: {raw}")
            alts.append(f"{_TRUE} {name}")
        sub = {} if schema is True else dict(schema)
        for key, value in defs.items():
            sub.setdefault(key, value)
        sub["x-guidance"] = dict(_OPTIONS)
        alts.append(f"{_FALSE} %json {json.dumps(sub, ensure_ascii=False)} {_lit(_PARAM_CLOSE)}")
        self.rules.append(f"{rule}: " + " | ".join(alts))

    def body(self, t: int, tool: dict) -> str | None:
        """Rules for tool `t`'s parameter lines; the name of the rule of them all (None: the tool has none)."""
        name = tool.get("name")
        params = tool.get("parameters")
        where = f"tool {name!r}"
        if params is None:
            return None
        if not isinstance(params, dict):
            raise GrammarError(f"{where}: parameters must be a JSON Schema object")
        extra = sorted(set(params) - _PARAMETERS_KEYS)
        if extra:
            raise GrammarError(f"{where}: parameters keyword(s) {extra} cannot be enforced in a forced tool call")
        if params.get("type", "object") != "object":
            raise GrammarError(f"{where}: parameters must have type object, got {params.get('type')!r}")
        props = params.get("properties") or {}
        required = params.get("required") or []
        more = params.get("additionalProperties", True)
        if not isinstance(props, dict) or not isinstance(required, list) or \
                not all(isinstance(r, str) for r in required):
            raise GrammarError(f"{where}: properties must be an object and required an array of names")
        items = [(k, s, k in required) for k, s in props.items()]
        for k in dict.fromkeys(r for r in required if r not in props):   # required but not described
            if more is False:
                raise GrammarError(f"{where}: required parameter {k!r} is not among the properties")
            items.append((k, more if isinstance(more, dict) else True, True))
        defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
        lines = []                                           # (rule of the line's value, required)
        for k, schema, req in items:
            if '"' in k or "\n" in k or _PARAM_CLOSE in k:
                raise GrammarError(f"{where}: parameter name {k!r} cannot be written in DSML")
            if schema is False:
                if req:
                    raise GrammarError(f"{where}: required parameter {k!r} has the schema false")
                continue
            rule = f"t{t}_v{len(lines)}"
            self.value(rule, schema, defs, f"{where}, parameter {k!r}")
            lines.append((k, rule, req))
        if not lines:
            return None
        # first_i: the lines from i on, the first one without a newline before it (while all before i may be left
        # out); tail_i: the lines from i on, each after a newline
        n, leading = len(lines), True
        for i, (k, rule, req) in enumerate(lines):
            head = f'<{DSML}parameter name="{k}" string="'
            tail = f" t{t}_tail{i + 1}" if i + 1 < n else ""
            if i:
                line = f"{_lit(chr(10) + head)} {rule}"
                self.rules.append(f"t{t}_tail{i}: " + (line if req else f"({line})?") + tail)
            if leading:
                first = f"{_lit(head)} {rule}{tail}"
                if not req:
                    first = f"{first} | t{t}_first{i + 1}" if i + 1 < n else f"({first})?"
                self.rules.append(f"t{t}_first{i}: {first}")
                leading = not req
        return f"t{t}_first0"


@dataclass(frozen=True)
class ToolCallFormat:
    """A reply that is exactly a DSML call block of the given tools (module docstring): the Lark grammar text."""
    lark: str
    after_token: int | None = None

    @classmethod
    def from_tools(cls, tools, *, single: bool = False, after_token: int | None = None) -> "ToolCallFormat":
        """`tools`: function definitions {"name", "description"?, "parameters"?} (ds4lib.chat's form), the ones a
        call may name; `single`: exactly one call (else one or more)."""
        tools = list(tools)
        if not tools:
            raise GrammarError("a forced tool call needs at least one tool")
        g = _ToolGrammar()
        first, following = [], []
        for t, tool in enumerate(tools):
            name = tool.get("name") if isinstance(tool, dict) else None
            if not isinstance(name, str) or not name or '"' in name or "\n" in name:
                raise GrammarError(f"tool {t}: the name {name!r} cannot be written in DSML")
            body = g.body(t, tool)
            end = f" {body} " if body else " "
            head = f'<{DSML}invoke name="{name}">\n'
            g.rules.append(f"t{t}_call: {_lit(head)}{end}{_lit(chr(10) + _INVOKE_CLOSE)}")
            first.append(f"t{t}_call")
            if not single:    # a later call: a newline before its invoke, in one literal (llguidance's lexer does not
                              # take a lone newline before it apart from the block's closing newline)
                g.rules.append(f"t{t}_next: {_lit(chr(10) + head)}{end}{_lit(chr(10) + _INVOKE_CLOSE)}")
                following.append(f"t{t}_next")
        more = [] if single else [f"next_call: {' | '.join(following)}"]
        lark = "\n".join([f"start: {_lit(TOOL_CALLS_START + chr(10))} call{'' if single else ' next_call*'} "
                           f"{_lit(chr(10) + TOOL_CALLS_END)}", f"call: {' | '.join(first)}", *more, *g.rules,
                           _RAW_VALUE]) + "\n"
        err = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(lark))
        if err:
            raise GrammarError(f"the tool schemas are not supported: {err.strip()}")
        return cls(lark, after_token)

    def grammar(self) -> str:
        return llguidance.LLMatcher.grammar_from_lark(self.lark)


class TokenConstraint:
    """One generation's grammar state over the model's vocabulary (module docstring)."""

    def __init__(self, matcher, *, n_vocab: int, tokenizer_words: int, eos: int, after_token: int | None):
        self._m = matcher
        self._n_vocab, self._eos = n_vocab, eos
        self._words = mask_words(n_vocab)
        self._buf = np.zeros((1, max(self._words, tokenizer_words)), np.int32)
        self._tokenizer_words = tokenizer_words
        self._free = after_token is not None
        self._after = after_token
        self._free_mask = token_mask(np.arange(n_vocab) != eos) if self._free else None
        self._check()

    def _error(self) -> str:
        # llguidance appends its parser state and the whole grammar on further lines: a client gets the first line
        return (self._m.get_error() or "").strip().splitlines()[0] if self._m.get_error() else "no reason given"

    def _check(self):
        if self._m.is_error():
            raise GrammarError(f"the output constraint failed: {self._error()}")

    @property
    def started(self) -> bool:
        """The grammar applies (thinking mode: `after_token` has been produced)."""
        return not self._free

    @property
    def accepting(self) -> bool:
        return not self._free and self._m.is_accepting()

    @property
    def finished(self) -> bool:
        """Only EOS can follow."""
        return not self._free and self._m.is_stopped()

    def mask(self) -> np.ndarray:
        """int32 [NW]: the tokens allowed next."""
        if self._free:
            return self._free_mask.copy()
        row = self._buf[:, :self._tokenizer_words]
        fill_next_token_bitmask(self._m, row)
        self._check()
        words = self._buf[0, :self._words].copy()
        tail = self._n_vocab % 32
        if tail:
            words[-1] &= np.int32((1 << tail) - 1)
        if not words.any():
            raise GrammarError("the output constraint allows no token of the model's vocabulary")
        return words

    def advance(self, token: int) -> None:
        if self._free:
            self._free = int(token) != self._after
            return
        if not self._m.consume_token(int(token)):
            raise GrammarError(f"the output constraint rejected token {int(token)}: {self._error()}")


class Constrainer:
    """Builds TokenConstraints for one engine: its tokenizer (HF `tokenizers` JSON text), V and EOS. The llguidance
    tokenizer is built on first use (tens of ms for 8k tokens), then shared; matchers are per generation."""

    def __init__(self, tokenizer_json: str, *, n_vocab: int, eos: int):
        self._json, self.n_vocab, self.eos = tokenizer_json, int(n_vocab), int(eos)
        self._tok = None

    def _tokenizer(self):
        if self._tok is None:
            self._tok = llguidance.LLTokenizer(self._json, eos_token=self.eos)
        return self._tok

    def start(self, fmt: JsonFormat | ToolCallFormat) -> TokenConstraint:
        tok = self._tokenizer()
        matcher = llguidance.LLMatcher(tok, fmt.grammar(), log_level=0)
        return TokenConstraint(matcher, n_vocab=self.n_vocab, tokenizer_words=mask_words(tok.vocab_size),
                               eos=self.eos, after_token=fmt.after_token)

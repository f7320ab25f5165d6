"""Constrained decoding: a request's JSON Schema as a per-step token mask, compiled by llguidance (no PyTorch).

Owns:
- `JsonFormat`: a checked JSON Schema (canonical JSON text), the request's side. `JsonFormat.from_schema` compiles it
  once without a tokenizer, so a malformed or unsupported schema is refused before the request is queued
  (`GrammarError`, a ValueError).
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

Does not own: drawing a token under the mask (ds4lib.ref.sampling, kernels.sampling), the generation loop
(engine.py), the APIs' response_format (server/schemas.py).

Shapes: V vocab, NW = ceil(V / 32) mask words.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask

from ds4lib.ref.sampling import mask_words, token_mask

__all__ = ["JsonFormat", "GrammarError", "TokenConstraint", "Constrainer"]

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

    def start(self, fmt: JsonFormat) -> TokenConstraint:
        tok = self._tokenizer()
        matcher = llguidance.LLMatcher(tok, fmt.grammar(), log_level=0)
        return TokenConstraint(matcher, n_vocab=self.n_vocab, tokenizer_words=mask_words(tok.vocab_size),
                               eos=self.eos, after_token=fmt.after_token)

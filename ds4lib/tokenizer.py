"""The ds4-tiny tokenizer: byte-level BPE, 8,192 ids, DeepSeek's pre-tokenizer and special tokens at fixed ids.

Owns: the special-token table (`SPECIAL_TOKENS`, ids 0..8), the tokenizer pipeline (`new_tokenizer`),
training (`train_tokenizer`), the committed files under `data/tokenizer/` (`save_tokenizer`,
`load_tokenizer`) and their validation (`check_tokenizer`).

Pipeline, as DeepSeek-V3/V4's `tokenizer.json` (docs/architecture.md §13.1): no normaliser; pre-tokenizer =
Split(`\\p{N}{1,3}`) -> Split(CJK/kana runs) -> Split(letters with one optional leading non-letter |
punctuation runs absorbing trailing newlines | newline runs | whitespace) -> ByteLevel (no prefix space,
no regex); BPE model; ByteLevel decoder. No post-processor: `encode` never adds BOS, the chat encoding
(`ds4lib.chat`) writes it. Special tokens are added tokens (atomic, `special=True`), so
`decode(encode(s)) == s` for any string, including one that spells a special token.

Sizes: V vocab = 8,192 = 9 special + 256 byte + 7,927 merges.

Does not own: which text it is trained on (`ds4lib.corpus.training`), chat rendering (`ds4lib.chat`),
the Engram compressed map (`ds4lib.tokenmap`).
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

__all__ = ["SpecialToken", "SPECIAL_TOKENS", "VOCAB_SIZE", "BOS_ID", "EOS_ID", "PAD_ID", "USER_ID",
           "ASSISTANT_ID", "THINK_ID", "END_THINK_ID", "DSPARK_NOISE_ID", "IMAGE_ID", "TOKENIZER_DIR",
           "TokenizerError", "new_tokenizer", "train_tokenizer", "save_tokenizer", "load_tokenizer",
           "check_tokenizer", "tokenizer_sha256", "TextEncoder"]

VOCAB_SIZE = 8192
TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "data" / "tokenizer"


@dataclass(frozen=True)
class SpecialToken:
    id: int
    text: str
    role: str


SPECIAL_TOKENS: tuple[SpecialToken, ...] = (
    SpecialToken(0, "<｜begin▁of▁sentence｜>", "bos"),
    SpecialToken(1, "<｜end▁of▁sentence｜>", "eos"),
    SpecialToken(2, "<｜▁pad▁｜>", "pad"),              # also the Engram pad id
    SpecialToken(3, "<｜User｜>", "user"),
    SpecialToken(4, "<｜Assistant｜>", "assistant"),
    SpecialToken(5, "<think>", "think"),
    SpecialToken(6, "</think>", "end_think"),
    SpecialToken(7, "<｜dspark_noise｜>", "dspark_noise"),
    SpecialToken(8, "<｜deepseek_image｜>", "image"),
)
BOS_ID, EOS_ID, PAD_ID, USER_ID, ASSISTANT_ID, THINK_ID, END_THINK_ID, DSPARK_NOISE_ID, IMAGE_ID = range(9)

# DeepSeek-V3 pre-tokenizer regexes (third one: six alternatives), as in its tokenizer.json
_SPLIT_DIGITS = r"\p{N}{1,3}"
_SPLIT_CJK = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_SPLIT_WORDS = ("[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+"
                "|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
                "| ?[\\p{P}\\p{S}]+[\r\n]*"
                "|\\s*[\r\n]+"
                "|\\s+(?!\\S)"
                "|\\s+")


class TokenizerError(ValueError):
    pass


def new_tokenizer():
    """An untrained `tokenizers.Tokenizer` with the DeepSeek pipeline."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_DIGITS), "isolated"),
        pre_tokenizers.Split(Regex(_SPLIT_CJK), "isolated"),
        pre_tokenizers.Split(Regex(_SPLIT_WORDS), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(texts: Iterable[str], *, vocab_size: int = VOCAB_SIZE):
    """Train BPE on `texts`; the result is a deterministic function of the texts and their order."""
    from tokenizers import pre_tokenizers, trainers
    tok = new_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[s.text for s in SPECIAL_TOKENS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2,
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    check_tokenizer(tok, vocab_size=vocab_size)
    return tok


def check_tokenizer(tok, *, vocab_size: int = VOCAB_SIZE) -> None:
    """Raise TokenizerError unless the vocabulary size and every special id are as specified."""
    n = tok.get_vocab_size(with_added_tokens=True)
    if n != vocab_size:
        raise TokenizerError(f"vocabulary has {n} ids, expected {vocab_size} (too little training text?)")
    for s in SPECIAL_TOKENS:
        if tok.token_to_id(s.text) != s.id:
            raise TokenizerError(f"special token {s.text!r} has id {tok.token_to_id(s.text)}, expected {s.id}")
    added = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    missing = {s.text for s in SPECIAL_TOKENS} - added
    if missing:
        raise TokenizerError(f"not registered as special added tokens: {sorted(missing)}")


def tokenizer_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def save_tokenizer(tok, out_dir: Path = TOKENIZER_DIR) -> Path:
    """Write `tokenizer.json` (compact) and `special_tokens.json` (ids, sha256, Engram compressed vocab size)."""
    check_tokenizer(tok)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "tokenizer.json"
    path.write_text(tok.to_str(pretty=False) + "\n", encoding="utf-8")
    from .tokenmap import compressed_token_map
    _, compressed = compressed_token_map(tok)
    specials = {"vocab_size": VOCAB_SIZE, "tokenizer_sha256": tokenizer_sha256(path),
                "engram_compressed_vocab_size": compressed,
                "special_tokens": {s.role: {"id": s.id, "text": s.text} for s in SPECIAL_TOKENS}}
    (out_dir / "special_tokens.json").write_text(json.dumps(specials, indent=1, ensure_ascii=False) + "\n",
                                                 encoding="utf-8")
    return path


def load_tokenizer(path: Path | None = None):
    """The committed tokenizer (or `path`), validated."""
    from tokenizers import Tokenizer
    path = Path(path) if path is not None else TOKENIZER_DIR / "tokenizer.json"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no tokenizer; run `ds4 tokenizer train`")
    tok = Tokenizer.from_file(str(path))
    check_tokenizer(tok)
    return tok


class TextEncoder:
    """Encodes a prompt given as (text, markup) pieces so that only markup can produce special tokens.

    A `tokenizers.Tokenizer` matches special-token strings anywhere in its input; a prompt built from user text
    must not let that text inject `<｜User｜>` or `</think>`. Markup pieces are split at the special-token strings
    (which become their ids); everything between two special tokens, markup or not, is encoded in one call by a
    copy of the tokenizer that treats special-token strings as plain text (`encode_special_tokens`). For text free
    of special-token strings the ids are exactly those of `tokenizer.encode` on the joined string, because that
    also splits at special tokens first and encodes the stretches between them alone.

    Thread-safe for encoding (both tokenizers are only read); build one per tokenizer, not per request.
    """

    def __init__(self, tokenizer):
        from tokenizers import Tokenizer
        self.tokenizer = tokenizer
        self.plain = Tokenizer.from_str(tokenizer.to_str())
        self.plain.encode_special_tokens = True
        specials = sorted((t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special),
                          key=len, reverse=True)
        self._ids = {s: tokenizer.token_to_id(s) for s in specials}
        self._pattern = re.compile("|".join(map(re.escape, specials))) if specials else None

    def encode_text(self, text: str) -> list:
        """Plain text: special-token strings stay characters."""
        return self.plain.encode(text, add_special_tokens=False).ids if text else []

    def encode_pieces(self, pieces) -> list:
        ids, run = [], []
        for text, markup in pieces:
            if not markup or self._pattern is None:
                run.append(text)
                continue
            pos = 0
            for m in self._pattern.finditer(text):
                run.append(text[pos:m.start()])
                ids += self.encode_text("".join(run))
                run = []
                ids.append(self._ids[m.group()])
                pos = m.end()
            run.append(text[pos:])
        return ids + self.encode_text("".join(run))

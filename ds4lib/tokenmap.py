"""The Engram compressed token map (docs/architecture.md §8.2): many token ids -> one compressed id.

Derived from a tokenizer: decode each id alone; a text holding U+FFFD (a partial UTF-8 byte token)
is keyed by its raw vocabulary string, any other by its normalised form (NFKC, NFD, strip accents,
lowercase, collapse [ \\t\\r\\n]+ to one space, keep a lone space, strip), falling back to the text
when that is empty. Compressed ids are assigned in order of first appearance.

A checkpoint directory carries the map either explicitly (`engram_token_map.json`, key
`token_map`) or as `tokenizer.json`, from which it is derived.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

__all__ = ["TokenMapError", "compressed_token_map", "load_token_map"]

_SENTINEL = "\ue000"


class TokenMapError(ValueError):
    pass


def _normalizer():
    from tokenizers import Regex, normalizers
    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), _SENTINEL),
        normalizers.Strip(), normalizers.Replace(_SENTINEL, " "),
    ])


def compressed_token_map(tokenizer) -> tuple[list[int], int]:
    """`tokenizer` is a `tokenizers.Tokenizer`. Returns (map of every id, compressed vocab size)."""
    norm = _normalizer()
    keys: dict[str, int] = {}
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    lookup = [0] * n
    for tid in range(n):
        text = tokenizer.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(tid)
        else:
            key = norm.normalize_str(text) or text
        lookup[tid] = keys.setdefault(key, len(keys))
    return lookup, len(keys)


def load_token_map(root, cfg) -> np.ndarray:
    """int64 [vocab] compressed ids for a checkpoint directory; validated against the config."""
    root = Path(root)
    explicit, tok = root / "engram_token_map.json", root / "tokenizer.json"
    if explicit.exists():
        try:
            tmap = json.loads(explicit.read_text())["token_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise TokenMapError(f"{explicit}: no valid 'token_map' ({e})") from None
        size = max(tmap) + 1 if tmap else 0
    elif tok.exists():
        from tokenizers import Tokenizer
        tmap, size = compressed_token_map(Tokenizer.from_file(str(tok)))
    else:
        raise TokenMapError(f"{root}: neither engram_token_map.json nor tokenizer.json, needed for the Engram "
                            f"token map")
    if len(tmap) != cfg.vocab_size:
        raise TokenMapError(f"{root}: token map covers {len(tmap)} ids, the model has {cfg.vocab_size}")
    if size != cfg.engram_compressed_vocab_size:
        raise TokenMapError(f"{root}: token map has {size} compressed ids, config says "
                            f"engram_compressed_vocab_size={cfg.engram_compressed_vocab_size}")
    return np.asarray(tmap, dtype=np.int64)

"""Fitting and judging slices: stratified fixed-size token windows, committed under `data/slices/`.

Owns: `Slice` and `load_slice` (the API other code uses, e.g. `load_slice("finance/judge")`),
cutting windows from reserved documents (`cut_windows`), and writing the slice files:

    data/slices/<domain>/<role>.json         name, domain, role, tokenizer sha256, per window: stratum,
                                             text and the documents it covers; all documents used and
                                             all reserved (`split`) for the slice
    data/slices/<domain>/<role>.tokens.npy   uint16 [W, T] token ids (W windows, T = 512)
    data/slices/index.json                   names and token counts

Sizes: W = 24 windows per slice, T = 512 tokens per window, 12,288 tokens per slice.

A window is the first T tokens of the slice's document stream (reserved documents' pieces joined by a
blank line, `split.document_piece`) from a line start, kept only if its decoded text is exactly that
stretch of the stream and re-encodes to the same T ids; otherwise the start moves to the next line.
The next window starts at the first line start after the previous one. So `encode(slice.text[i]) ==
slice.tokens[i]` holds for every window, and windows never overlap. Tokens carry no BOS: scorers
add it.

Does not own: which documents a slice may use (`split`), the tokenizer (`ds4lib.tokenizer`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..tokenizer import TOKENIZER_DIR, tokenizer_sha256
from .split import ROLES, SLICE_PLAN, WINDOW_TOKENS, Reservation, document_piece

__all__ = ["Slice", "SliceError", "SLICES_DIR", "MIN_TOKENS", "MAX_TOKENS", "load_slice", "cut_windows",
           "build_slices", "Window"]

SLICES_DIR = Path(__file__).resolve().parents[2] / "data" / "slices"
MIN_TOKENS, MAX_TOKENS = 8192, 16384
_CHUNK_CHARS_PER_TOKEN = 12     # far above any real chars/token, so a chunk always holds T tokens


class SliceError(ValueError):
    pass


@dataclass(frozen=True)
class Window:
    text: str
    tokens: tuple[int, ...]
    documents: tuple[str, ...]      # keys of the documents the window's text comes from


@dataclass(frozen=True)
class Slice:
    name: str                       # "<domain>/<role>"
    domain: str
    role: str                       # "fit" | "judge"
    tokens: np.ndarray              # int32 [W, T]
    text: tuple[str, ...]           # [W] the text of each window; encode(text[i]) == tokens[i]
    strata: tuple[str, ...]         # [W] the sub-source each window was cut from
    documents: tuple[str, ...]      # keys of the documents the windows cover
    reserved: tuple[str, ...]       # every document held back for this slice (superset of documents)

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.size)


def _next_line_start(stream: str, pos: int) -> int:
    nl = stream.find("\n", pos)
    pos = len(stream) if nl < 0 else nl + 1
    while pos < len(stream) and stream[pos] == "\n":
        pos += 1
    return pos


def cut_windows(tokenizer, pieces: list[tuple[str, str]], n: int, *, window: int = WINDOW_TOKENS) -> list[Window]:
    """`n` windows of exactly `window` tokens from `pieces` = [(document key, text)], in order."""
    stream = "\n\n".join(text for _, text in pieces)
    starts, pos = [], 0
    for _, text in pieces:
        starts.append(pos)
        pos += len(text) + 2
    out, s = [], 0
    while len(out) < n:
        ids = tokenizer.encode(stream[s:s + window * _CHUNK_CHARS_PER_TOKEN], add_special_tokens=False).ids
        if len(ids) < window:
            raise SliceError(f"text ran out after {len(out)} of {n} windows ({len(pieces)} documents)")
        ids = ids[:window]
        text = tokenizer.decode(ids, skip_special_tokens=False)
        if stream.startswith(text, s) and tokenizer.encode(text, add_special_tokens=False).ids == ids:
            end = s + len(text)
            docs = tuple(k for (k, t), a in zip(pieces, starts) if a < end and a + len(t) > s)
            out.append(Window(text, tuple(ids), docs))
            s = _next_line_start(stream, end - 1 if text.endswith("\n") else end)
        else:
            s = _next_line_start(stream, s)
    return out


def _slice_paths(root: Path, name: str) -> tuple[Path, Path]:
    parts = name.split("/")
    if len(parts) != 2 or not all(parts) or "." in name or "\\" in name:
        known = sorted(f"{p.parent.name}/{p.stem}" for p in Path(root).glob("*/*.json"))
        stem = Path(name).name.split(".")[0]
        guess = [k for k in known if k == f"{Path(name).parent.name}/{stem}"]
        hint = f"; did you mean {guess[0]}?" if guess else ""
        raise SliceError(f"{name!r} is not a slice name: give DOMAIN/ROLE (known: {', '.join(known)}){hint}")
    domain, role = parts
    return root / domain / f"{role}.json", root / domain / f"{role}.tokens.npy"


def build_slices(*, reservation: Reservation, tokenizer, tokenizer_path: Path, out_dir: Path = SLICES_DIR,
                 log=print) -> dict[str, Slice]:
    """Cut every slice of the plan from its reserved documents and write the slice files."""
    out_dir = Path(out_dir)
    sha = tokenizer_sha256(tokenizer_path)
    built, index = {}, {}
    for domain, strata in SLICE_PLAN.items():
        for role in ROLES:
            name = f"{domain}/{role}"
            windows, names = [], []
            for stratum, docs in zip(strata, reservation.slices[name]):
                try:
                    cut = cut_windows(tokenizer, [(d.key, document_piece(d)) for d in docs], stratum.windows)
                except SliceError as e:
                    raise SliceError(f"{name}, {stratum.name}: {e}") from None
                windows += cut
                names += [stratum.name] * len(cut)
            used = tuple(dict.fromkeys(k for w in windows for k in w.documents))
            reserved = tuple(d.key for docs in reservation.slices[name] for d in docs)
            sl = Slice(name, domain, role, np.array([w.tokens for w in windows], dtype=np.int32),
                       tuple(w.text for w in windows), tuple(names), used, reserved)
            if not MIN_TOKENS <= sl.n_tokens <= MAX_TOKENS:
                raise SliceError(f"{name}: {sl.n_tokens} tokens, outside {MIN_TOKENS}..{MAX_TOKENS}")
            _write_slice(out_dir, sl, windows, sha)
            built[name] = sl
            index[name] = {"tokens": sl.n_tokens, "windows": len(windows), "documents": len(used),
                           "reserved": len(reserved), "strata": [s.name for s in strata]}
            log(f"{name}: {sl.n_tokens} tokens, {len(windows)} windows, {len(used)} documents "
                f"({len(reserved)} reserved)")
    (out_dir / "index.json").write_text(json.dumps(
        {"window_tokens": WINDOW_TOKENS, "tokenizer_sha256": sha, "slices": index}, indent=1) + "\n")
    return built


def _write_slice(root: Path, sl: Slice, windows: list[Window], tokenizer_sha: str) -> None:
    meta_path, tok_path = _slice_paths(root, sl.name)
    meta_path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "name": sl.name, "domain": sl.domain, "role": sl.role, "window_tokens": WINDOW_TOKENS,
        "tokenizer_sha256": tokenizer_sha,
        "windows": [{"stratum": s, "documents": list(w.documents), "text": w.text}
                    for s, w in zip(sl.strata, windows)],
        "documents": list(sl.documents), "reserved": list(sl.reserved),
    }
    meta_path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    np.save(tok_path, sl.tokens.astype(np.uint16), allow_pickle=False)


def load_slice(name: str, root: Path = SLICES_DIR, *, tokenizer_path: Path | None = None) -> Slice:
    """A committed slice, e.g. `load_slice("finance/judge")`. Fails if it was cut with another tokenizer."""
    meta_path, tok_path = _slice_paths(Path(root), name)
    if not meta_path.exists():
        known = sorted(f"{p.parent.name}/{p.stem}" for p in Path(root).glob("*/*.json"))
        raise SliceError(f"no slice {name!r} under {root}; known: {', '.join(known)}")
    record = json.loads(meta_path.read_text(encoding="utf-8"))
    tokenizer_path = tokenizer_path or TOKENIZER_DIR / "tokenizer.json"
    if record["tokenizer_sha256"] != tokenizer_sha256(tokenizer_path):
        raise SliceError(f"{name}: cut with tokenizer {record['tokenizer_sha256'][:12]}, but {tokenizer_path} "
                         f"differs; rebuild with `ds4 corpus slices`")
    tokens = np.load(tok_path, allow_pickle=False).astype(np.int32)
    windows = record["windows"]
    if tokens.shape != (len(windows), record["window_tokens"]):
        raise SliceError(f"{name}: tokens {tokens.shape} do not match {len(windows)} windows")
    return Slice(record["name"], record["domain"], record["role"], tokens, tuple(w["text"] for w in windows),
                 tuple(w["stratum"] for w in windows), tuple(record["documents"]), tuple(record["reserved"]))

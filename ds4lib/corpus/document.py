"""Documents: the unit every corpus source yields, slices are split by, and the training set excludes.

Owns: `Document` (source id, document id, text, optional metadata), the one whitespace/Unicode
normalisation every text goes through (`normalise_text`), and the on-disk form of a source: one
JSON-lines file, documents sorted by id, written byte-for-byte deterministically.

Does not own: where texts come from (`sources`), which documents go where (`split`).

Normalisation (applied once, by every extractor): Unicode NFC; CRLF/CR -> LF; control characters
other than TAB and LF dropped; trailing whitespace stripped from every line; runs of more than two
blank lines cut to two; leading and trailing blank lines removed. Tabs and indentation are kept
(code depends on them).
"""
from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

__all__ = ["Document", "normalise_text", "write_documents", "read_documents", "documents_sha256"]

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\u0080-\u009f\u200b\ufeff]")
_TRAILING = re.compile(r"[ \t\f\v\u00a0]+$", re.M)
_BLANKS = re.compile(r"\n{4,}")


@dataclass(frozen=True)
class Document:
    source: str                 # e.g. "finance/ledger3"
    doc_id: str                 # unique within the source: a file path, an entry, a book chapter
    text: str
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def key(self) -> str:
        """Globally unique id: `source:doc_id`."""
        return f"{self.source}:{self.doc_id}"


def normalise_text(text: str) -> str:
    text = unicodedata.normalize("NFC", text.replace("\r\n", "\n").replace("\r", "\n"))
    text = _CONTROL.sub("", text)
    text = _TRAILING.sub("", text)
    return _BLANKS.sub("\n\n\n", text).strip("\n")


def _line(doc: Document) -> str:
    rec = {"id": doc.doc_id, "text": doc.text}
    if doc.meta:
        rec["meta"] = doc.meta
    return json.dumps(rec, ensure_ascii=False, sort_keys=True) + "\n"


def write_documents(path: Path, docs: Iterable[Document]) -> list[Document]:
    """Sort by id, reject duplicates and empty texts, write JSON lines. Returns the written list."""
    docs = sorted(docs, key=lambda d: d.doc_id)
    for a, b in zip(docs, docs[1:]):
        if a.doc_id == b.doc_id:
            raise ValueError(f"{a.source}: duplicate document id {a.doc_id!r}")
    docs = [d for d in docs if d.text.strip()]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for d in docs:
            f.write(_line(d))
    tmp.replace(path)
    return docs


def read_documents(path: Path, source: str) -> Iterator[Document]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            yield Document(source, rec["id"], rec["text"], rec.get("meta", {}))


def documents_sha256(docs: Iterable[Document]) -> str:
    """Checksum of a source's documents exactly as `write_documents` stores them."""
    h = hashlib.sha256()
    for d in sorted(docs, key=lambda d: d.doc_id):
        if d.text.strip():
            h.update(_line(d).encode("utf-8"))
    return h.hexdigest()

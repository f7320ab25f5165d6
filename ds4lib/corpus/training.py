"""The training set: every corpus document no slice reserved, tokenized, plus definition chats and a mixing rule.

Owns: the exclusion rule (`Exclusion`), the parts of the training set (`TRAINING_PARTS`) and their
mixing weights (`MIXTURE`), building the token files, the tokenizer's training sample
(`tokenizer_sample`, `train_corpus_tokenizer`) and reading batches back (`TrainingSet.draw_batch`).

Layout (not committed; rebuilt by `ds4 corpus train-set`):

    <out>/<part>.npy       uint16 [N] token ids: every document as BOS + text + EOS, sources in id
                           order, documents in id order; the chat part holds rendered chats (they
                           carry their own BOS/EOS)
    <out>/manifest.json    per part: sources, documents, tokens, sha256; the weights; the tokenizer sha256

Exclusion: every document reserved for any slice (`split.reserve_documents`), every other part of
a GCIDE entry that has a reserved sense, and every dictionary document (GCIDE or WordNet) whose
headword or a lemma equals, case-insensitively, the headword of a reserved GCIDE document, and every
near-duplicate of a reserved document: a document whose text, or whose slice piece
(`split.document_piece`), is after `near_duplicate_key` (lower case, every run of non-alphanumeric
characters one space) equal to that of a reserved document's text or piece. So no slice text and no
definition of a sliced word reaches the tokenizer or the training set, also not as a copy under another
name (a licence text filed twice, a man page shipped by two packages).

Mixing rule: a row of a batch comes from part p with probability MIXTURE[p]; its start offset is
uniform in that part. `draw_batch(step)` seeds NumPy's PCG64 with (seed, step), so batch k is the
same whatever was drawn before. Small parts (finance, science) are repeated more often than large
ones; that is the intent of the weights (domain text over filler). The chat part renders every
dictionary document in `CHAT_VARIANTS` wordings (`definitions`), so it is the largest part and carries
the most weight; the plain dictionary part holds the same texts and weighs less.

Shapes: B batch rows, T tokens per row (+1 for the shifted target).
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from ..tokenizer import BOS_ID, EOS_ID, VOCAB_SIZE, save_tokenizer, tokenizer_sha256, train_tokenizer
from .build import load_source
from .definitions import render_definition_chats
from .document import Document
from .fetch import file_sha256
from .sources import SOURCES
from .slices import SLICES_DIR
from .split import Reservation, document_piece, reserve_documents

__all__ = ["Exclusion", "near_duplicate_key", "TRAINING_PARTS", "MIXTURE", "CHAT_SOURCES", "CHAT_VARIANTS",
           "build_training_set", "tokenizer_sample",
           "train_corpus_tokenizer", "TrainingSet", "load_training_set"]

TRAINING_PARTS: dict[str, tuple[str, ...]] = {
    part: tuple(sorted(s for s in SOURCES if s.split("/", 1)[0] == part))
    for part in ("finance", "code", "law", "medicine", "science", "english", "technical", "dictionary")
}
CHAT_SOURCES = ("finance/gcide", "law/gcide", "medicine/gcide", "science/gcide", "dictionary/gcide",
                "dictionary/wordnet")
MIXTURE: dict[str, float] = {"finance": 0.04, "code": 0.18, "law": 0.10, "medicine": 0.10, "science": 0.05,
                             "english": 0.10, "technical": 0.16, "dictionary": 0.07, "chat": 0.20}
CHAT_VARIANTS = 2
_BATCH_DOCS = 256
_NON_ALNUM = re.compile(r"[\W_]+")


def near_duplicate_key(text: str) -> str:
    """sha256 of the text lower-cased with every run of non-alphanumeric characters made one space."""
    return hashlib.sha256(_NON_ALNUM.sub(" ", text.lower()).strip().encode("utf-8")).hexdigest()


def _text_keys(doc: Document) -> set[str]:
    return {near_duplicate_key(doc.text), near_duplicate_key(document_piece(doc))}


@dataclass(frozen=True)
class Exclusion:
    keys: frozenset[str]
    entries: frozenset[int]
    headwords: frozenset[str]
    texts: frozenset[str] = frozenset()     # near_duplicate_key of every reserved document's text and piece

    @classmethod
    def from_reservation(cls, reservation: Reservation) -> "Exclusion":
        docs = reservation.documents()
        return cls(frozenset(d.key for d in docs),
                   frozenset(d.meta["entry"] for d in docs if "entry" in d.meta),
                   frozenset(d.meta["headword"].lower() for d in docs if "entry" in d.meta),
                   frozenset(k for d in docs for k in _text_keys(d)))

    def excludes(self, doc: Document) -> bool:
        return self.by_identity(doc) or self.near_duplicate(doc)

    def by_identity(self, doc: Document) -> bool:
        """Reserved itself, part of a reserved GCIDE entry, or a definition of a sliced headword."""
        if doc.key in self.keys or doc.meta.get("entry") in self.entries:
            return True
        words = [doc.meta.get("headword", ""), *doc.meta.get("lemmas", ())]
        return any(w.lower() in self.headwords for w in words if w)

    def near_duplicate(self, doc: Document) -> bool:
        """True when the document's text or piece matches a reserved one up to case and punctuation."""
        return bool(self.texts) and not _text_keys(doc).isdisjoint(self.texts)


def _allowed(corpus_dir: Path, source: str, exclusion: Exclusion) -> list[Document]:
    return [d for d in load_source(corpus_dir, source) if not exclusion.excludes(d)]


def tokenizer_sample(corpus_dir: Path, exclusion: Exclusion, *, per_source_bytes: int = 2_000_000) -> Iterator[str]:
    """Up to `per_source_bytes` of allowed documents per source, in sha256(key) order, sources sorted."""
    for source in sorted(SOURCES):
        docs = sorted(_allowed(corpus_dir, source, exclusion),
                      key=lambda d: hashlib.sha256(f"ds4-tokenizer:{d.key}".encode()).hexdigest())
        used = 0
        for d in docs:
            if used >= per_source_bytes:
                break
            used += len(d.text.encode("utf-8"))
            yield d.text


def train_corpus_tokenizer(*, corpus_dir: Path, out_dir: Path, per_source_bytes: int = 2_000_000,
                           log: Callable[[str], None] = print) -> Path:
    """Train the 8,192-id tokenizer on the allowed sample of the corpus and save it; returns its path."""
    exclusion = Exclusion.from_reservation(reserve_documents(corpus_dir))
    texts = list(tokenizer_sample(corpus_dir, exclusion, per_source_bytes=per_source_bytes))
    log(f"tokenizer sample: {len(texts)} documents, {sum(len(t.encode()) for t in texts) / 1e6:.1f} MB "
        f"({len(exclusion.keys)} reserved documents excluded)")
    return save_tokenizer(train_tokenizer(texts, vocab_size=VOCAB_SIZE), out_dir)


def _encode_documents(tokenizer, texts: list[str], wrap: bool) -> np.ndarray:
    parts = []
    for i in range(0, len(texts), _BATCH_DOCS):
        for enc in tokenizer.encode_batch(texts[i:i + _BATCH_DOCS], add_special_tokens=False):
            ids = [BOS_ID, *enc.ids, EOS_ID] if wrap else enc.ids
            parts.append(np.asarray(ids, dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def _check_committed_slices(reservation: Reservation, slices_dir: Path) -> None:
    """The committed slices must hold back exactly the documents this corpus reserves."""
    for name, strata in reservation.slices.items():
        path = slices_dir / f"{name}.json"
        if not path.exists():
            raise FileNotFoundError(f"{path}: slice missing; run `ds4 corpus slices` first")
        committed = set(json.loads(path.read_text(encoding="utf-8"))["reserved"])
        if committed != {d.key for docs in strata for d in docs}:
            raise ValueError(f"{path}: reserved documents differ from this corpus's reservation; rebuild the "
                             f"slices (`ds4 corpus slices`) before the training set")


def build_training_set(*, corpus_dir: Path, tokenizer, tokenizer_path: Path, out_dir: Path,
                       reservation: Reservation | None = None, slices_dir: Path | None = SLICES_DIR,
                       log: Callable[[str], None] = print) -> dict:
    """Tokenize every allowed document into `<out>/<part>.npy`; returns (and writes) the manifest.

    With `slices_dir` (default: the committed slices) the reservation is checked against the slices
    first, so a training set can never be built around slices cut from a different corpus."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    reservation = reservation or reserve_documents(corpus_dir)
    if slices_dir is not None:
        _check_committed_slices(reservation, Path(slices_dir))
    exclusion = Exclusion.from_reservation(reservation)
    parts = {}
    for part, sources in [*TRAINING_PARTS.items(), ("chat", CHAT_SOURCES)]:
        texts, per_source = [], {}
        for source in sources:
            docs = _allowed(corpus_dir, source, exclusion)
            per_source[source] = len(docs)
            texts += (list(render_definition_chats(docs, CHAT_VARIANTS)) if part == "chat"
                      else [d.text for d in docs])
        tokens = _encode_documents(tokenizer, texts, wrap=part != "chat")
        path = out_dir / f"{part}.npy"
        np.save(path, tokens, allow_pickle=False)
        parts[part] = {"sources": per_source, "documents": len(texts), "tokens": int(tokens.size),
                       "sha256": file_sha256(path), "weight": MIXTURE[part]}
        log(f"train/{part}: {len(texts)} {'chats' if part == 'chat' else 'documents'}, {tokens.size:,} tokens")
    near = {s: sum(1 for d in load_source(corpus_dir, s)
                   if not exclusion.by_identity(d) and exclusion.near_duplicate(d)) for s in sorted(SOURCES)}
    manifest = {"tokenizer_sha256": tokenizer_sha256(tokenizer_path), "excluded_documents": len(exclusion.keys),
                "near_duplicates_excluded": {s: n for s, n in near.items() if n},
                "chat_variants": CHAT_VARIANTS,
                "parts": parts, "total_tokens": sum(p["tokens"] for p in parts.values())}
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


@dataclass(frozen=True)
class TrainingSet:
    parts: dict[str, np.ndarray]        # part -> uint16 [N] (memory-mapped)
    weights: dict[str, float]

    def draw_batch(self, step: int, *, batch: int, seq_len: int, seed: int = 0) -> np.ndarray:
        """int64 [B, T+1] token rows for training step `step` (same step, same rows)."""
        names = sorted(self.parts)
        p = np.array([self.weights[n] for n in names], dtype=np.float64)
        rng = np.random.default_rng([seed, step])
        picks = rng.choice(len(names), size=batch, p=p / p.sum())
        out = np.empty((batch, seq_len + 1), dtype=np.int64)
        for row, k in enumerate(picks):
            data = self.parts[names[k]]
            if data.size <= seq_len + 1:
                raise ValueError(f"part {names[k]} has {data.size} tokens, fewer than a row of {seq_len + 1}")
            start = int(rng.integers(0, data.size - seq_len - 1))
            out[row] = data[start:start + seq_len + 1]     # [T+1]
        return out


def load_training_set(train_dir: Path, *, weights: dict[str, float] | None = None) -> TrainingSet:
    train_dir = Path(train_dir)
    manifest = json.loads((train_dir / "manifest.json").read_text())
    weights = weights or {k: v["weight"] for k, v in manifest["parts"].items()}
    parts = {k: np.load(train_dir / f"{k}.npy", mmap_mode="r") for k in manifest["parts"] if weights.get(k, 0) > 0}
    return TrainingSet(parts, {k: weights[k] for k in parts})

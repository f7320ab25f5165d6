"""Dictionary definitions as chat exchanges: "What does 'ledger' mean?" -> the entry.

Owns: turning dictionary documents (GCIDE entries of any domain, WordNet synsets; `meta` has
headword and pos) into conversations for the training set's chat part, rendered with the chat
encoding of `ds4lib.chat`.

Deterministic rules: documents are ordered by sha256("ds4-chat:" + key); every 8th conversation has
two turns (two consecutive documents), the others one. A quarter of the conversations (by the hash
of their first document) use thinking mode, with a short reasoning built from the entry itself
(part of speech, number of senses); the rest are non-thinking. The question template is picked by
the same hash. The answer is the dictionary document's text.

Variants: variant 0 is the rendering above (domain documents asked "What does 'X' mean in law?").
Every further variant v renders every document once more, hashed with "ds4-chat:v<v>:" + key: its
question comes from the wider `_VARIANT_QUESTIONS` (quoted and bare word, "What is a X?" for nouns),
never the same template as variant 0 for that document, with the word lower-cased unless it is a proper
noun or written in capitals; half of its conversations (by that hash) use thinking mode. So the same
definition is asked for in several wordings, plain and thinking.

Does not own: which documents are allowed (`training.Exclusion`), tokenization (`training`).
"""
from __future__ import annotations

import hashlib
from typing import Iterable, Iterator

from ..chat import render_chat
from .document import Document

__all__ = ["definition_turn", "definition_conversations", "render_definition_chats"]

_QUESTIONS = ("What does '{w}' mean?", "Define '{w}'.", "What is the meaning of the word '{w}'?",
              "Give the dictionary definition of '{w}'.")
_VARIANT_QUESTIONS = ("What does '{w}' mean?", "Define '{w}'.", "What is the meaning of the word '{w}'?",
                      "Give the dictionary definition of '{w}'.", "Define {w}.", "What is the meaning of {w}?",
                      "What does {w} mean?", "What's the definition of {w}?", "Explain the word '{w}'.",
                      "What is meant by '{w}'?", "Meaning of {w}?", "{w}: what does it mean?")
_NOUN_QUESTIONS = ("What is {a} {w}?", "What is {a} '{w}'?")
_DOMAIN_QUESTION = "What does '{w}' mean in {d}?"
_POS_WORDS = {"n.": "a noun", "n. pl.": "a plural noun", "prop. n.": "a proper noun", "v.": "a verb",
              "v. t.": "a transitive verb", "v. i.": "an intransitive verb", "a.": "an adjective",
              "adj.": "an adjective", "adv.": "an adverb", "prep.": "a preposition", "conj.": "a conjunction",
              "interj.": "an interjection", "pron.": "a pronoun", "p. p.": "a past participle",
              "p. pr.": "a present participle", "vb. n.": "a verbal noun"}
_DOMAIN_NAMES = {"finance": "finance", "law": "law", "medicine": "medicine", "science": "science"}


def _hash(doc: Document, variant: int = 0) -> int:
    salt = "ds4-chat:" if variant == 0 else f"ds4-chat:v{variant}:"
    return int.from_bytes(hashlib.sha256(f"{salt}{doc.key}".encode()).digest()[:8], "big")


def _variant_question(doc: Document, variant: int) -> tuple[str, str]:
    """(question, the word as asked) for a variant > 0."""
    word, pos = doc.meta["headword"], doc.meta.get("pos", "")
    if pos != "prop. n." and word[:1].isupper() and word[1:] == word[1:].lower():
        word = word.lower()
    first = _QUESTIONS[_hash(doc) % len(_QUESTIONS)]
    domain = doc.source.split("/", 1)[0]
    taken = _DOMAIN_QUESTION if domain in _DOMAIN_NAMES else first
    options = [q for q in _VARIANT_QUESTIONS if q != taken]
    if pos.startswith("n") and " " not in word:
        options += list(_NOUN_QUESTIONS)
    h = _hash(doc, variant) >> 8
    return options[h % len(options)].format(w=word, a="an" if word[:1].lower() in "aeiou" else "a"), word


def definition_turn(doc: Document, variant: int = 0) -> tuple[dict, dict]:
    """(user message, assistant message with reasoning_content) for one dictionary document."""
    word, pos = doc.meta["headword"], doc.meta.get("pos", "")
    domain = doc.source.split("/", 1)[0]
    h = _hash(doc)
    if variant > 0:
        question, word = _variant_question(doc, variant)
    elif domain in _DOMAIN_NAMES:
        question = _DOMAIN_QUESTION.format(w=word, d=_DOMAIN_NAMES[domain])
    else:
        question = _QUESTIONS[h % len(_QUESTIONS)].format(w=word)
    n_senses = max(1, sum(1 for ln in doc.text.split("\n")[1:] if not ln.startswith(("Syn:", "Note:"))))
    kind = _POS_WORDS.get(pos, "a word")
    reasoning = (f"The user asks what '{word}' means. It is {kind}, and the dictionary entry gives "
                 f"{n_senses} sense{'s' if n_senses > 1 else ''}; I will quote the entry.")
    return ({"role": "user", "content": question},
            {"role": "assistant", "content": doc.text, "reasoning_content": reasoning})


def definition_conversations(docs: Iterable[Document], variant: int = 0) -> Iterator[tuple[list[dict], bool]]:
    """(messages, thinking) per conversation of one variant; see the module docstring for the rules."""
    ordered = sorted(docs, key=lambda d: (_hash(d, variant), d.key))
    i, k = 0, 0
    while i < len(ordered):
        turns = 2 if k % 8 == 7 and i + 1 < len(ordered) else 1
        messages = [m for d in ordered[i:i + turns] for m in definition_turn(d, variant)]
        h = _hash(ordered[i], variant)
        yield messages, (h % 4 == 0 if variant == 0 else h % 2 == 0)
        i, k = i + turns, k + 1


def render_definition_chats(docs: Iterable[Document], variants: int = 1) -> Iterator[str]:
    """Every document rendered in variants 0 .. variants-1, variant by variant."""
    docs = list(docs)
    for variant in range(variants):
        for messages, thinking in definition_conversations(docs, variant):
            yield render_chat(messages, thinking=thinking, add_generation_prompt=False)

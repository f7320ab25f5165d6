"""The committed days of post-training requests (ds4lib.posttrain.days, data/posttrain/general/): they parse with
`ds4 posttrain`'s reader, ids are unique, training and held-out days share no word and no answer, a rebuild from
the pinned WordNet gives the same bytes, and every request is the opening of a chat of the training set, token for
token. The last two need the pinned packages (unpacked in the corpus cache, or their .deb files at hand) and are
skipped without them."""
import json
import re

import pytest

from ds4lib.corpus.fetch import file_sha256
from ds4lib.posttrain.days import (DATA_DIR, QUESTION, WORDING, DayRequest, DaysError, build_days, locate_sources,
                                   read_days, shares_word, trained_documents, word_forms)
from ds4lib.posttrain.solve import read_requests

FOLDER = DATA_DIR / "general"
_ID = re.compile(r"dictionary/wordnet:(noun|verb|adj|adv)/\d{8}")
_POS = {"noun": "n.", "verb": "v.", "adj": "adj.", "adv": "adv."}


def _day_requests(requests) -> list:
    """Requests -> DayRequest with the lemmas read back from the answer's first line ('<lemma>, ..., <pos>')."""
    out = []
    for r in requests:
        *lemmas, pos = r.answer.split("\n", 1)[0].split(", ")
        assert pos == _POS[_ID.fullmatch(r.id).group(1)], r.id
        out.append(DayRequest(id=r.id, prompt=r.prompt, answer=r.answer, lemmas=tuple(lemmas)))
    return out


def _inflections(word: str) -> str:
    """A regular expression for the word and its regular inflections (-s, -es, -d, -ed, -ing, -er, -est; a final e
    or y changed, a final consonant doubled)."""
    forms = [rf"{word}(?:s|es|d|ed|ing|er|est)?", rf"{word}{word[-1]}(?:ed|ing|er|est)"]
    if word.endswith("e"):
        forms.append(rf"{word[:-1]}(?:ing|ed|er|est)")
    if word.endswith("y"):
        forms.append(rf"{word[:-1]}(?:ies|ied|ier|iest)")
    return "(?:" + "|".join(forms) + ")"


@pytest.fixture(scope="module")
def committed():
    manifest, days = read_days(DATA_DIR)
    return manifest, {name: _day_requests(reqs) for name, reqs in days.items()}


@pytest.fixture(scope="module")
def wordnet():
    """(sources, the WordNet documents of the training set's chat part, their wording-1 chats as
    build_training_set makes them), or skip when the packages are not here."""
    from ds4lib.corpus.definitions import definition_conversations
    try:
        src = locate_sources(download=False)
    except DaysError as e:
        pytest.skip(str(e))
    allowed = trained_documents(src)
    return src, allowed, list(definition_conversations(allowed, WORDING))


def test_days_parse_with_unique_ids(committed):
    manifest, days = committed
    assert set(manifest["train"]) | set(manifest["heldout"]) == set(days) and manifest["train"] and manifest["heldout"]
    assert not set(manifest["train"]) & set(manifest["heldout"])
    ids = []
    for name, reqs in days.items():
        path = FOLDER / f"{name}.jsonl"
        assert 20 <= len(reqs) <= 50 and len(reqs) == manifest["days"][name]["requests"]
        assert file_sha256(path) == manifest["days"][name]["sha256"]
        assert [r.id for r in read_requests(path)] == [r.id for r in reqs]
        for line in path.read_text(encoding="utf-8").splitlines():
            assert list(json.loads(line)) == ["id", "prompt", "answer"]
        for r in reqs:
            assert r.prompt == QUESTION.format(w=r.headword) and r.answer.startswith(r.headword + ", ")
        ids += [r.id for r in reqs]
    assert len(ids) == len(set(ids)) == manifest["counts"]["kept"]
    assert {p.name for p in FOLDER.iterdir()} == {"manifest.json", *(f"{n}.jsonl" for n in days)}


def test_word_forms_rule():
    for word, base in [("running", "run"), ("dregs", "dreg"), ("flies", "fly"), ("boxes", "box"), ("bigger", "big"),
                       ("glasses", "glass"), ("making", "make"), ("churches", "church"), ("firemen", "fireman")]:
        assert base in word_forms(word), word
    assert word_forms("Scampi") == {"scampi"}
    assert "in" not in word_forms("ins")            # bases shorter than 3 letters are dropped
    a = DayRequest("a", QUESTION.format(w="weepy"), "weepy, adj.\nliable to weep easily", ("weepy",))
    b = DayRequest("b", QUESTION.format(w="sob"), "sob, v.\nweeping with short gasps", ("sob",))
    c = DayRequest("c", QUESTION.format(w="weeping"), "weeping, n.\nthe process of shedding tears", ("weeping",))
    assert not shares_word(a, b) and shares_word(b, c) and shares_word(c, b)


def test_training_and_heldout_days_share_no_word_or_answer(committed):
    manifest, days = committed
    train = [r for n in manifest["train"] for r in days[n]]
    held = [r for n in manifest["heldout"] for r in days[n]]
    norm = lambda s: " ".join(re.findall(r"[a-z0-9]+", s.lower()))    # noqa: E731
    assert not {l.lower() for r in train for l in r.lemmas} & {l.lower() for r in held for l in r.lemmas}
    assert not {norm(r.answer) for r in train} & {norm(r.answer) for r in held}
    assert not {norm(r.gloss) for r in train} & {norm(r.gloss) for r in held}
    words = {r.id: r.words() for r in train + held}
    forms = {r.id: r.forms() for r in train + held}
    for t in train:                                   # the module's rule (morphy forms), both directions
        for h in held:
            assert words[t.id].isdisjoint(forms[h.id]) and words[h.id].isdisjoint(forms[t.id]), (t.id, h.id)
    assert not shares_word(train[0], held[0])
    # independently of that rule: no lemma of one side, plain or with a regular inflection, occurs as a word
    # anywhere in the other side's prompts and answers
    for side, other in ((train, held), (held, train)):
        text = "\n".join(r.prompt + "\n" + r.answer for r in other).lower()
        for r in side:
            for lemma in r.lemmas:
                assert not re.search(rf"\b{_inflections(lemma)}\b", text), (r.id, lemma)


def test_rebuild_gives_the_same_bytes(wordnet, tmp_path):
    src, allowed, conversations = wordnet
    manifest = build_days(out_dir=tmp_path, sources=src, documents=allowed, conversations=conversations)
    built = sorted(p.name for p in (tmp_path / "general").iterdir())
    assert built == sorted(p.name for p in FOLDER.iterdir())
    for name in built:
        assert (tmp_path / "general" / name).read_bytes() == (FOLDER / name).read_bytes(), name
    assert manifest["counts"]["allowed"] == len(allowed)


def test_requests_open_training_chats_token_for_token(wordnet, committed):
    """Each request is a WordNet document of the training set asked as wording 1 asks it, and a chat of the training
    set's chat part (rendered by ds4lib.corpus.definitions as build_training_set renders it) begins with exactly the
    tokens `ds4 posttrain` gives the request: the prompt's, then the answer's and EOS."""
    from ds4lib.chat import encode_chat, render_chat
    from ds4lib.corpus.training import CHAT_VARIANTS
    from ds4lib.tokenizer import TextEncoder, load_tokenizer
    _, allowed, conversations = wordnet
    _, days = committed
    requests = {r.id: r for reqs in days.values() for r in reqs}
    by_key = {d.key: d for d in allowed}
    for r in requests.values():
        assert by_key[r.id].text == r.answer and by_key[r.id].meta["lemmas"] == list(r.lemmas)
    assert CHAT_VARIANTS > WORDING                    # wording 1 is in the training set
    by_text = {r.answer: r for r in requests.values()}
    opened = {}
    for messages, thinking in conversations:
        r = by_text.get(messages[1]["content"])
        if r is not None and messages[0]["content"] == r.prompt:
            opened[r.id] = render_chat(messages, thinking=thinking, add_generation_prompt=False)
    assert set(opened) == set(requests)
    tok = load_tokenizer()
    enc = TextEncoder(tok)
    for rid, text in opened.items():
        r = requests[rid]
        user = [{"role": "user", "content": r.prompt}]
        exchange = encode_chat(enc, user + [{"role": "assistant", "content": r.answer}], add_generation_prompt=False)
        assert exchange[:len(encode_chat(enc, user))] == encode_chat(enc, user)
        trained = tok.encode(text, add_special_tokens=False).ids     # as build_training_set tokenizes a chat
        assert trained[:len(exchange)] == exchange, rid

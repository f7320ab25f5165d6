"""The committed tokenizer: fixed special ids, 8,192 ids, exact round trips, deterministic training."""
import json

import numpy as np
import pytest

from ds4lib.tokenizer import (SPECIAL_TOKENS, TOKENIZER_DIR, TokenizerError, check_tokenizer, load_tokenizer,
                              tokenizer_sha256, train_tokenizer)
from ds4lib.tokenmap import compressed_token_map

# the ids the model, the Engram pad and the DSpark head depend on; written out here on purpose
EXPECTED_SPECIALS = {
    0: "<｜begin▁of▁sentence｜>", 1: "<｜end▁of▁sentence｜>", 2: "<｜▁pad▁｜>", 3: "<｜User｜>",
    4: "<｜Assistant｜>", 5: "<think>", 6: "</think>", 7: "<｜dspark_noise｜>", 8: "<｜deepseek_image｜>",
}

ROUND_TRIP = [
    "",
    "plain ASCII text, with punctuation: (a) [b] {c}; 1234567 -- done.",
    "  leading spaces\n\n\ttabs\r\nCRLF and trailing   ",
    "Ünïcödé: café naïve Æsir ß — “quotes” ½ € ∑ √ 中文字符 日本語のテキスト 한국어 🙂👍🏽",
    "combining: e\u0301 a\u0308 and zero-width\u200bjoiner",
    "<｜User｜>What is <think>inside</think>?<｜Assistant｜></think>ok<｜end▁of▁sentence｜>",
    "def f(x):\n    return x ** 2  # comment\n",
    "<｜begin▁of▁sentence｜><｜▁pad▁｜><｜dspark_noise｜><｜deepseek_image｜>",
    "almost special: <｜User|> <think > </ think>",
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def test_vocab_size_and_special_ids(tok):
    assert tok.get_vocab_size(with_added_tokens=True) == 8192
    for tid, text in EXPECTED_SPECIALS.items():
        assert tok.token_to_id(text) == tid
        assert tok.id_to_token(tid) == text
    assert {s.id: s.text for s in SPECIAL_TOKENS} == EXPECTED_SPECIALS


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip_exact(tok, text):
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_specials_are_atomic_and_no_bos_added(tok):
    for tid, text in EXPECTED_SPECIALS.items():
        assert tok.encode(text, add_special_tokens=False).ids == [tid]
    ids = tok.encode("hello", add_special_tokens=True).ids
    assert 0 not in ids and 1 not in ids
    assert tok.encode("<｜User|>", add_special_tokens=False).ids != [3]


def test_digit_runs_split_in_threes(tok):
    pieces = tok.pre_tokenizer.pre_tokenize_str("1234567")
    assert [p for p, _ in pieces] == ["123", "456", "7"]


def test_committed_files_agree(tok):
    path = TOKENIZER_DIR / "tokenizer.json"
    assert path.stat().st_size < 500_000
    info = json.loads((TOKENIZER_DIR / "special_tokens.json").read_text(encoding="utf-8"))
    assert info["tokenizer_sha256"] == tokenizer_sha256(path)
    assert {v["id"]: v["text"] for v in info["special_tokens"].values()} == EXPECTED_SPECIALS
    lookup, size = compressed_token_map(tok)
    assert info["engram_compressed_vocab_size"] == size
    assert len(lookup) == 8192 and max(lookup) == size - 1
    assert lookup[:9] == list(range(9))       # specials keep distinct compressed ids; pad_c = 2


def _small_corpus():
    rng = np.random.default_rng(0)
    letters = list("abcdefghijklmnopqrstuvwxyzéüçコード")
    words = ["".join(rng.choice(letters, size=rng.integers(2, 9))) for _ in range(400)]
    return [" ".join(rng.choice(words, size=60)) + f" {i}" for i in range(300)]


def test_training_is_deterministic_and_keeps_special_ids():
    a = train_tokenizer(_small_corpus(), vocab_size=400)
    b = train_tokenizer(_small_corpus(), vocab_size=400)
    assert a.to_str() == b.to_str()
    for tid, text in EXPECTED_SPECIALS.items():
        assert a.token_to_id(text) == tid
    with pytest.raises(TokenizerError):
        check_tokenizer(a)                     # 400 ids, not the project's 8,192

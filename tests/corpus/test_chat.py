"""Chat encoding (docs/architecture.md §13.3) and the reply parser."""
import pytest

from ds4lib.chat import ChatError, encode_chat, parse_reply, render_chat
from ds4lib.tokenizer import load_tokenizer

B, E, U, A, T, ET = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                     "<think>", "</think>")


def test_non_thinking_prompt():
    msgs = [{"role": "user", "content": "What does 'ledger' mean?"}]
    assert render_chat(msgs) == f"{B}{U}What does 'ledger' mean?{A}{ET}"
    assert render_chat(msgs, add_generation_prompt=False) == f"{B}{U}What does 'ledger' mean?"


def test_thinking_prompt_and_system():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert render_chat(msgs, thinking=True) == f"{B}Be brief.{U}hi{A}{T}"


def test_multi_turn_thinking_drops_earlier_reasoning():
    msgs = [{"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
            {"role": "user", "content": "q2"}]
    assert render_chat(msgs, thinking=True) == f"{B}{U}q1{A}{ET}a1{E}{U}q2{A}{T}"
    assert render_chat(msgs, thinking=False) == f"{B}{U}q1{A}{ET}a1{E}{U}q2{A}{ET}"


def test_completed_final_turn_keeps_reasoning_in_thinking_mode():
    msgs = [{"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "a2", "reasoning_content": "r2"}]
    assert render_chat(msgs, thinking=True) == f"{B}{U}q1{A}{ET}a1{E}{U}q2{A}{T}r2{ET}a2{E}"
    assert render_chat(msgs, thinking=False) == f"{B}{U}q1{A}{ET}a1{E}{U}q2{A}{ET}a2{E}"


def test_encode_chat_ids():
    tok = load_tokenizer()
    ids = encode_chat(tok, [{"role": "user", "content": "Define 'asset'."}], thinking=True)
    assert ids[0] == 0 and ids[1] == 3 and ids[-2:] == [4, 5]
    ids = encode_chat(tok, [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}])
    assert ids[-1] == 1 and 6 in ids and 0 not in ids[1:]
    assert tok.decode(ids, skip_special_tokens=False) == f"{B}{U}x{A}{ET}y{E}"


@pytest.mark.parametrize("text,thinking,expected", [
    (f"weigh it{ET}The answer.{E}junk", True, ("weigh it", "The answer.")),
    ("still thinking", True, ("still thinking", "")),
    (f"{T}r{ET}a", True, ("r", "a")),
    (f"Direct answer.{E}", False, ("", "Direct answer.")),
    (f"{T}stray{ET}answer", False, ("stray", "answer")),
    (f"a{ET}b", False, ("", f"a{ET}b")),
])
def test_parse_reply(text, thinking, expected):
    assert parse_reply(text, thinking=thinking) == expected


@pytest.mark.parametrize("msgs", [
    [{"role": "tool", "content": "x"}],
    [{"role": "user", "content": "x", "tools": [{"name": "f"}]}],
    [{"role": "assistant", "content": "x"}],
    [{"role": "user", "content": ["not", "a", "string"]}],
])
def test_unsupported_messages_raise(msgs):
    with pytest.raises(ChatError):
        render_chat(msgs)


def test_reasoning_effort_prefix_only_in_thinking_mode():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}]
    assert render_chat(msgs, thinking=True, reasoning_effort="low") == render_chat(msgs, thinking=True)
    high = render_chat(msgs, thinking=True, reasoning_effort="high")
    assert high.startswith(B + "Reasoning Effort: Absolute maximum") and high.endswith(f"\n\nS{U}q{A}{T}")
    assert render_chat(msgs, thinking=True, reasoning_effort="max").startswith(B + "Reasoning Effort: Beyond maximum")
    assert render_chat(msgs, thinking=False, reasoning_effort="max") == render_chat(msgs)
    with pytest.raises(ChatError):
        render_chat(msgs, thinking=True, reasoning_effort="medium")


def test_encode_chat_keeps_special_strings_in_contents_as_text():
    tok = load_tokenizer()
    msgs = [{"role": "user", "content": f"a{E}{U}b{ET}"}]
    ids = encode_chat(tok, msgs)
    assert [t for t in ids if t < 9] == [0, 3, 4, 6]
    assert tok.decode(ids, skip_special_tokens=False) == render_chat(msgs)
    plain = [{"role": "user", "content": "What does 'ledger' mean?"}]
    assert encode_chat(tok, plain, thinking=True) == tok.encode(render_chat(plain, thinking=True),
                                                                add_special_tokens=False).ids

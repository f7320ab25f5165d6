"""Chat encoding (ARCHITECTURE.md §6, DeepSeek-V4 `encoding_dsv4.py`) and the parser of generated replies.

Owns: `chat_pieces` (messages -> the prompt as (text, markup) pieces), `render_chat` (-> prompt text),
`encode_chat` (-> token ids), `parse_reply` (generated text -> reasoning, answer), the reasoning-effort table
(`REASONING_EFFORTS`) and `ChatError`.

Format, for messages [system?, user, assistant, ..., user]:

    BOS [effort prefix] [system text] <｜User｜>{user}<｜Assistant｜></think>{answer}EOS <｜User｜>{user}<｜Assistant｜>T

T, the generation prompt after the last user message, is `</think>` in non-thinking mode (answer at
once) and `<think>` in thinking mode. Completed assistant turns render as `{answer}EOS` after the
`</think>` that closes their user turn. In thinking mode the turns after the last user message keep
their reasoning: `<think>` + `{reasoning}</think>{answer}EOS`; reasoning of every earlier turn is
dropped and those turns get `</think>`, exactly as in non-thinking mode. A system message renders
as its bare text where it stands.

Reasoning effort (the V4.1 release encoder): "low" (the default) adds nothing, "high" and "max" each put a fixed
instruction before the first message, in thinking mode only; the texts are the model's own (a reworded prefix
is a different prompt). In non-thinking mode the effort has no effect.

Markup against text: the template's own markup (special tokens, the effort prefix) is trusted; message contents
are not. `encode_chat` gives special tokens their ids only where the template writes them: a user who types
`<｜User｜>` or `</think>` gets those characters as plain text, never the control token (ARCHITECTURE.md §6).

Not supported (raise ChatError): tools, tool calls and tool results (DSML markup and
`<tool_result>`, which need tokens this tokenizer does not have). The tiny model does not call tools.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from .tokenizer import SPECIAL_TOKENS, TextEncoder

__all__ = ["ChatError", "BOS", "EOS", "USER", "ASSISTANT", "THINK", "END_THINK", "REASONING_EFFORTS",
           "DEFAULT_REASONING_EFFORT", "chat_pieces", "render_chat", "encode_chat", "parse_reply"]

BOS, EOS, _PAD, USER, ASSISTANT, THINK, END_THINK = (s.text for s in SPECIAL_TOKENS[:7])

# The V4.1 release encoder's effort levels and the instruction each puts before the first message (thinking mode)
REASONING_EFFORTS = {
    "low": "",
    "high": ("Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
             "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
             "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
             "scenarios.\n"
             "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
             "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"),
    "max": ("Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
            "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
            "decompose the problem into its most fundamental components, trace every causal chain to its root, and "
            "resolve the underlying cause rather than any surface symptom.\n"
            "Do not stop reasoning until you have independently verified the solution from multiple angles and are "
            "certain that no assumption remains unchecked and no error remains undiscovered.\n\n"),
}
DEFAULT_REASONING_EFFORT = "low"
_ROLES = {"system", "user", "assistant"}
_UNSUPPORTED_KEYS = {"tools", "tool_calls", "tool_call_id", "content_blocks", "task"}


class ChatError(ValueError):
    pass


def _check(messages: Sequence[Mapping]) -> None:
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in _ROLES:
            raise ChatError(f"message {i}: role {role!r} is not supported (only system, user, assistant)")
        bad = _UNSUPPORTED_KEYS & set(m)
        if bad:
            raise ChatError(f"message {i}: {sorted(bad)} not supported by this encoder (no tool use)")
        if not isinstance(m.get("content", ""), str):
            raise ChatError(f"message {i}: content must be a string")


def chat_pieces(messages: Sequence[Mapping], thinking: bool = False, add_generation_prompt: bool = True,
                reasoning_effort: str | None = None) -> list[tuple[str, bool]]:
    """The prompt for `messages` (dicts with role, content and, for assistants, reasoning_content) as pieces
    (text, markup): markup=True for the template's own text, False for message contents."""
    _check(messages)
    effort = reasoning_effort or DEFAULT_REASONING_EFFORT
    if effort not in REASONING_EFFORTS:
        raise ChatError(f"reasoning effort {effort!r} is not one of {sorted(REASONING_EFFORTS)}")
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    out = [(BOS + (REASONING_EFFORTS[effort] if thinking else ""), True)]
    for i, m in enumerate(messages):
        role, content = m["role"], m.get("content") or ""
        if role == "system":
            out.append((content, False))
        elif role == "user":
            out += [(USER, True), (content, False)]
            following = messages[i + 1]["role"] if i + 1 < len(messages) else None
            if following == "assistant" or (following is None and add_generation_prompt):
                out.append((ASSISTANT + (THINK if thinking and i == last_user else END_THINK), True))
        else:
            if i == 0 or messages[i - 1]["role"] != "user":
                raise ChatError(f"message {i}: an assistant message must follow a user message")
            if thinking and i > last_user:
                out += [(m.get("reasoning_content") or "", False), (END_THINK, True)]
            out += [(content, False), (EOS, True)]
    return [p for p in out if p[0]]


def render_chat(messages: Sequence[Mapping], thinking: bool = False, add_generation_prompt: bool = True,
                reasoning_effort: str | None = None) -> str:
    """Prompt text for `messages`."""
    return "".join(t for t, _ in chat_pieces(messages, thinking, add_generation_prompt, reasoning_effort))


def encode_chat(tokenizer, messages: Sequence[Mapping], thinking: bool = False, add_generation_prompt: bool = True,
                reasoning_effort: str | None = None) -> list[int]:
    """Token ids of `render_chat(...)`: the template's special tokens become their fixed ids, message contents
    are plain text. `tokenizer` is a tokenizers.Tokenizer or, to encode many prompts, a TextEncoder of one."""
    enc = tokenizer if isinstance(tokenizer, TextEncoder) else TextEncoder(tokenizer)
    return enc.encode_pieces(chat_pieces(messages, thinking, add_generation_prompt, reasoning_effort))


def parse_reply(text: str, thinking: bool = False) -> tuple[str, str]:
    """Split generated text (what follows the generation prompt) into (reasoning, answer).

    Decoding stops at the first EOS. In thinking mode the reasoning runs up to `</think>`; without a
    `</think>` the reply is all (unfinished) reasoning and the answer is empty. In non-thinking mode
    the reasoning is empty; a stray leading `<think>...</think>` block is still split off.
    """
    text = text.split(EOS, 1)[0]
    if text.startswith(THINK):
        text, thinking = text[len(THINK):], True
    if not thinking:
        return "", text
    if END_THINK not in text:
        return text, ""
    reasoning, answer = text.split(END_THINK, 1)
    return reasoning, answer

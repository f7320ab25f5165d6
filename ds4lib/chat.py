"""Chat encoding (ARCHITECTURE.md §6, DeepSeek-V4 `encoding_dsv4.py`) and the parser of generated replies.

Owns: `render_chat` (messages -> prompt text), `encode_chat` (-> token ids), `parse_reply`
(generated text -> reasoning, answer) and `ChatError`.

Format, for messages [system?, user, assistant, ..., user]:

    BOS [system text] <｜User｜>{user}<｜Assistant｜></think>{answer}EOS <｜User｜>{user}<｜Assistant｜>T

T, the generation prompt after the last user message, is `</think>` in non-thinking mode (answer at
once) and `<think>` in thinking mode. Completed assistant turns render as `{answer}EOS` after the
`</think>` that closes their user turn. In thinking mode the turns after the last user message keep
their reasoning: `<think>` + `{reasoning}</think>{answer}EOS`; reasoning of every earlier turn is
dropped and those turns get `</think>`, exactly as in non-thinking mode. A system message renders
as its bare text where it stands.

Not supported (raise ChatError): tools, tool calls and tool results (DSML markup and
`<tool_result>`, which need tokens this tokenizer does not have), and the "max" reasoning effort
prefix. The tiny model neither calls tools nor runs at >= 384K context.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from .tokenizer import SPECIAL_TOKENS

__all__ = ["ChatError", "BOS", "EOS", "USER", "ASSISTANT", "THINK", "END_THINK", "render_chat", "encode_chat",
           "parse_reply"]

BOS, EOS, _PAD, USER, ASSISTANT, THINK, END_THINK = (s.text for s in SPECIAL_TOKENS[:7])
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


def render_chat(messages: Sequence[Mapping], thinking: bool = False, add_generation_prompt: bool = True) -> str:
    """Prompt text for `messages` (dicts with role, content and, for assistants, reasoning_content)."""
    _check(messages)
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    out = [BOS]
    for i, m in enumerate(messages):
        role, content = m["role"], m.get("content") or ""
        if role == "system":
            out.append(content)
        elif role == "user":
            out.append(USER + content)
            following = messages[i + 1]["role"] if i + 1 < len(messages) else None
            if following == "assistant" or (following is None and add_generation_prompt):
                out.append(ASSISTANT + (THINK if thinking and i == last_user else END_THINK))
        else:
            if i == 0 or messages[i - 1]["role"] != "user":
                raise ChatError(f"message {i}: an assistant message must follow a user message")
            reasoning = m.get("reasoning_content") or ""
            keep_reasoning = thinking and i > last_user
            out.append((reasoning + END_THINK if keep_reasoning else "") + content + EOS)
    return "".join(out)


def encode_chat(tokenizer, messages: Sequence[Mapping], thinking: bool = False,
                add_generation_prompt: bool = True) -> list[int]:
    """Token ids of `render_chat(...)`; special tokens in the text become their fixed ids."""
    return tokenizer.encode(render_chat(messages, thinking=thinking, add_generation_prompt=add_generation_prompt),
                            add_special_tokens=False).ids


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

"""Chat encoding (docs/architecture.md §13.3, DeepSeek-V4 `encoding_dsv4.py`) and the parser of generated replies.

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
`<｜User｜>` or `</think>` gets those characters as plain text, never the control token (docs/architecture.md §13.3).

Tools (ds4lib/dsml.py): definitions go after the first system message, an assistant's calls follow its content
as a DSML block before EOS, and tool results join the next user turn as `<tool_result>` blocks, ordered as the
calls were. With tools, no turn's reasoning is dropped. Consecutive user (and tool) messages form one user turn,
their parts joined by a blank line, as in the official encoder. The ds4-tiny tokenizer has no `｜DSML｜` token,
so there the markup is plain text; it is still markup (a user cannot forge it where the tokenizer has the token).
"""
from __future__ import annotations

from typing import Mapping, Sequence

from .dsml import (DSML, TOOL_CALLS_START, ToolCallError, parse_tool_calls, render_tool_calls, render_tool_result,
                   render_tools)
from .tokenizer import SPECIAL_TOKENS, TextEncoder

__all__ = ["ChatError", "BOS", "EOS", "USER", "ASSISTANT", "THINK", "END_THINK", "REASONING_EFFORTS",
           "DEFAULT_REASONING_EFFORT", "chat_pieces", "render_chat", "encode_chat", "parse_reply", "split_answer",
           "DSML"]

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
_ROLES = {"system", "user", "assistant", "tool"}
_UNSUPPORTED_KEYS = {"tools", "content_blocks", "task"}


class ChatError(ValueError):
    pass


def _check(messages: Sequence[Mapping]) -> None:
    calls_open = False
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in _ROLES:
            raise ChatError(f"message {i}: role {role!r} is not supported (only system, user, assistant, tool)")
        bad = _UNSUPPORTED_KEYS & set(m)
        if bad:
            raise ChatError(f"message {i}: {sorted(bad)} not supported by this encoder (tools are an argument)")
        if not isinstance(m.get("content") or "", str):
            raise ChatError(f"message {i}: content must be a string")
        if role == "tool" and not calls_open:
            raise ChatError(f"message {i}: a tool result must follow an assistant message with tool calls")
        if role == "assistant":
            calls_open = bool(m.get("tool_calls"))
        elif role != "tool":
            calls_open = False


def _merge_tool_results(messages: Sequence[Mapping]) -> list:
    """Tool results join the user turn that holds them (V4 has no tool role): consecutive tool and user messages
    become one user turn of blocks ("result" | "text", content), the results in the order of the calls of the
    assistant message before them; other messages pass through."""
    out, order = [], {}
    for m in messages:
        role = m["role"]
        if role not in ("user", "tool"):
            if role == "assistant":
                order = {c["id"]: k for k, c in enumerate(m.get("tool_calls") or []) if c.get("id")}
            out.append(m)
            continue
        block = ("result" if role == "tool" else "text", m.get("content") or "", m.get("tool_call_id"))
        if out and out[-1]["role"] == "user":
            out[-1]["blocks"].append(block)
        else:
            out.append({"role": "user", "blocks": [block], "order": order})
    for m in out:
        if m["role"] == "user":
            results = sorted((b for b in m["blocks"] if b[0] == "result"), key=lambda b: m["order"].get(b[2], 0))
            it = iter(results)
            m["blocks"] = [next(it) if b[0] == "result" else b for b in m["blocks"]]
    return out


def _user_pieces(m) -> list:
    out = [(USER, True)]
    for k, (kind, content, _) in enumerate(m["blocks"]):
        if k:
            out.append(("\n\n", True))
        out += render_tool_result(content) if kind == "result" else [(content, False)]
    return out


def chat_pieces(messages: Sequence[Mapping], thinking: bool = False, add_generation_prompt: bool = True,
                reasoning_effort: str | None = None, tools: Sequence[Mapping] | None = None) -> list[tuple[str, bool]]:
    """The prompt for `messages` as pieces (text, markup): markup=True for the template's own text, False for
    message contents. Messages are dicts with role and content; assistants may have reasoning_content and
    tool_calls [{"id"?, "name", "arguments"}]; role "tool" messages (tool_call_id, content) answer those calls.
    `tools` are function definitions [{"name", "description"?, "parameters"?}], rendered after the first system
    message (one is made if there is none). With tools, no turn's reasoning is dropped (the official encoder's
    rule: an agent's earlier reasoning stays in context)."""
    _check(messages)
    effort = reasoning_effort or DEFAULT_REASONING_EFFORT
    if effort not in REASONING_EFFORTS:
        raise ChatError(f"reasoning effort {effort!r} is not one of {sorted(REASONING_EFFORTS)}")
    msgs = _merge_tool_results(messages)
    if tools and not any(m["role"] == "system" for m in msgs):
        msgs.insert(0, {"role": "system", "content": ""})
    keep_all = bool(tools)
    last_user = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=-1)
    out = [(BOS + (REASONING_EFFORTS[effort] if thinking else ""), True)]
    tools_done = not tools
    for i, m in enumerate(msgs):
        role, content = m["role"], m.get("content") or ""
        if role == "system":
            out.append((content, False))
            if not tools_done:
                out.append(("\n\n" + render_tools(tools), True))
                tools_done = True
        elif role == "user":
            out += _user_pieces(m)
            following = msgs[i + 1]["role"] if i + 1 < len(msgs) else None
            if following == "assistant" or (following is None and add_generation_prompt):
                out.append((ASSISTANT + (THINK if thinking and (keep_all or i == last_user) else END_THINK), True))
        else:
            if i == 0 or msgs[i - 1]["role"] != "user":
                raise ChatError(f"message {i}: an assistant message must follow a user message")
            if thinking and (keep_all or i > last_user):
                out += [(m.get("reasoning_content") or "", False), (END_THINK, True)]
            out.append((content, False))
            if m.get("tool_calls"):
                try:
                    out += render_tool_calls(m["tool_calls"])
                except ToolCallError as e:
                    raise ChatError(f"message {i}: {e}") from None
            out.append((EOS, True))
    return [p for p in out if p[0]]


def render_chat(messages: Sequence[Mapping], thinking: bool = False, add_generation_prompt: bool = True,
                reasoning_effort: str | None = None, tools: Sequence[Mapping] | None = None) -> str:
    """Prompt text for `messages`."""
    return "".join(t for t, _ in chat_pieces(messages, thinking, add_generation_prompt, reasoning_effort, tools))


def encode_chat(tokenizer, messages: Sequence[Mapping], thinking: bool = False, add_generation_prompt: bool = True,
                reasoning_effort: str | None = None, tools: Sequence[Mapping] | None = None) -> list[int]:
    """Token ids of `render_chat(...)`: the template's special tokens become their fixed ids, message contents
    are plain text. `tokenizer` is a tokenizers.Tokenizer or, to encode many prompts, a TextEncoder of one."""
    enc = tokenizer if isinstance(tokenizer, TextEncoder) else TextEncoder(tokenizer)
    return enc.encode_pieces(chat_pieces(messages, thinking, add_generation_prompt, reasoning_effort, tools))


def split_answer(answer: str) -> tuple[str, list]:
    """An answer -> (content, tool calls). The calls are the complete invokes of a DSML block after the content;
    a block without one complete invoke (cut short) is left in the content as text."""
    head, sep, block = answer.partition(TOOL_CALLS_START)
    calls = parse_tool_calls(block) if sep else []
    return (head, calls) if calls else (answer, [])


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

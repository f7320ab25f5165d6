"""A typed request -> the prompt's token ids and the generation length it may use.

Owns: chat rendering through ds4lib.chat (docs/architecture.md §13.3), the raw-text prompt of /v1/completions
(BOS + text, as `ds4 --raw`), a trailing assistant message as a prefill that the reply continues, and the
context check (a prompt that leaves no room for one generated token, or a max_tokens that does not fit, is a
400 `context_length_exceeded` before the request reaches the queue).

Message contents are encoded as plain text (ds4lib.tokenizer.TextEncoder): a special-token string typed by a user
stays characters. The raw prompt of /v1/completions is the caller's own markup, as with `ds4 --raw`, so special
tokens spelled in it do become control tokens there.

Uses only the engine's tokenizer (through a TextEncoder built once, thread-safe), never the engine's forward
state, so request threads can run it while the worker generates.
"""
from __future__ import annotations

from dataclasses import dataclass

from ds4lib.chat import BOS, END_THINK, ChatError, chat_pieces
from ds4lib.tokenizer import TextEncoder

from server.schemas import GenerationRequest, RequestError

__all__ = ["Prompt", "build_prompt", "plan_max_tokens"]


@dataclass(frozen=True)
class Prompt:
    ids: list
    thinking_open: bool      # the reply starts inside a thinking section (generation prompt ends with <think>)


def _chat_pieces(req: GenerationRequest) -> tuple[list, bool]:
    msgs = list(req.messages)
    prefill = msgs.pop() if msgs and msgs[-1]["role"] == "assistant" else None
    if not any(m["role"] == "user" for m in msgs):
        raise RequestError("the conversation needs at least one user message", param="messages",
                           code="invalid_value")
    if msgs[-1]["role"] not in ("user", "tool"):
        raise RequestError("the last message must come from the user or a tool (or be one assistant prefill after "
                           "it)", param="messages", code="invalid_value")
    if prefill is not None and prefill.get("tool_calls"):
        raise RequestError("a trailing assistant message is a prefill for the reply; it cannot hold tool calls",
                           param="messages", code="invalid_value")
    try:
        pieces = chat_pieces(msgs, thinking=req.thinking, reasoning_effort=req.effort, tools=req.tools)
    except ChatError as e:
        raise RequestError(str(e), param="messages", code="invalid_value") from None
    open_thinking = req.thinking
    if prefill is not None:
        content = prefill.get("content", "")
        if req.thinking:
            pieces.append((prefill.get("reasoning_content", ""), False))
            if content:
                pieces += [(END_THINK, True), (content, False)]
                open_thinking = False
        else:
            pieces.append((content, False))
    return pieces, open_thinking


def build_prompt(req: GenerationRequest, encoder: TextEncoder) -> Prompt:
    tokenizer = encoder.tokenizer
    if req.prompt is None:
        pieces, open_thinking = _chat_pieces(req)
        return Prompt(encoder.encode_pieces(pieces), open_thinking)
    if isinstance(req.prompt, tuple):
        vocab = tokenizer.get_vocab_size(with_added_tokens=True)
        bad = [t for t in req.prompt if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="prompt",
                               code="invalid_value")
        return Prompt(list(req.prompt), False)
    return Prompt([tokenizer.token_to_id(BOS)] + tokenizer.encode(req.prompt, add_special_tokens=False).ids, False)


def plan_max_tokens(n_prompt: int, requested: int | None, *, default: int, context: int,
                    param: str = "max_tokens") -> int:
    """The generation length: `requested`, or `default` capped by the room the context leaves."""
    if n_prompt >= context:
        raise RequestError(f"the prompt has {n_prompt} tokens, but the model's context is {context} tokens (it "
                           f"must leave room for at least one generated token)", param="messages",
                           code="context_length_exceeded")
    room = context - n_prompt
    if requested is None:
        return min(default, room)
    if requested > room:
        raise RequestError(f"the prompt has {n_prompt} tokens and {param} asks for {requested}: {n_prompt + requested}"
                           f" > the model's context of {context} tokens", param=param,
                           code="context_length_exceeded")
    return requested

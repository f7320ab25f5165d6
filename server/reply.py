"""Streaming split of a generated reply into reasoning and answer, the incremental form of ds4lib.chat.parse_reply.

Owns: `ReplySplitter`, fed the engine's text deltas and returning ("reasoning" | "answer", text) pieces and, when
the request offered tools, ("tool_call", {"index", "name", "arguments"}) as soon as each call's invoke is complete.
Concatenating the pieces of each kind gives exactly `parse_reply(full_text, thinking)` then
`split_answer(answer)` (tested), so a stream and the non-streamed answer of the same greedy request agree. A tag
split across deltas is held back until it is complete or ruled out.

Does not own: tokenization, the chat template, or which API's events carry the pieces.
"""
from __future__ import annotations

from ds4lib.chat import END_THINK, THINK
from ds4lib.dsml import TOOL_CALLS_START, parse_tool_calls

__all__ = ["ReplySplitter", "split_events", "REASONING", "ANSWER", "TOOL_CALL", "DONE", "KEEPALIVE"]

REASONING, ANSWER, TOOL_CALL, DONE, KEEPALIVE = "reasoning", "answer", "tool_call", "done", "keepalive"
_TOOLS = "tools"


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest proper prefix of `tag` that `text` ends with."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReplySplitter:
    """thinking=True: the reply starts inside `<think>` (reasoning up to `</think>`, then the answer).
    thinking=False: the reply is the answer, except a stray leading `<think>...</think>` block, which is
    reasoning (as parse_reply treats it)."""

    def __init__(self, thinking: bool, tools: bool = False):
        self.thinking, self.tools = thinking, tools
        self.state = "start"
        self.buf = ""
        self.calls = 0                                  # tool calls emitted

    def feed(self, delta: str) -> list:
        self.buf += delta
        out = []
        if self.state == "start":
            if THINK.startswith(self.buf):
                return out                              # may still become a leading <think>
            if self.buf.startswith(THINK):
                self.buf, self.state = self.buf[len(THINK):], REASONING
            else:
                self.state = REASONING if self.thinking else ANSWER
        if self.state == REASONING:
            if END_THINK in self.buf:
                reasoning, self.buf = self.buf.split(END_THINK, 1)
                self.state = ANSWER
                if reasoning:
                    out.append((REASONING, reasoning))
            else:
                keep = _held_prefix(self.buf, END_THINK)
                ready, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                if ready:
                    out.append((REASONING, ready))
                return out
        if self.state == ANSWER and self.tools:
            head, sep, block = self.buf.partition(TOOL_CALLS_START)
            if sep:
                self.buf, self.state = block, _TOOLS
                if head:
                    out.append((ANSWER, head))
            else:
                keep = _held_prefix(self.buf, TOOL_CALLS_START)
                ready, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                if ready:
                    out.append((ANSWER, ready))
                return out
        if self.state == _TOOLS:
            for call in parse_tool_calls(self.buf)[self.calls:]:
                out.append((TOOL_CALL, dict(call, index=self.calls)))
                self.calls += 1
            return out
        if self.state == ANSWER and self.buf:
            out.append((ANSWER, self.buf))
            self.buf = ""
        return out

    def finish(self) -> list:
        """Flush what was held back: an incomplete tag is plain text of the current section."""
        rest, self.buf = self.buf, ""
        if self.state == _TOOLS:                        # a block without one complete call stays text
            return [] if self.calls else [(ANSWER, TOOL_CALLS_START + rest)]
        if not rest:
            return []
        if self.state == "start":
            return [(REASONING if self.thinking else ANSWER, rest)]
        return [(self.state, rest)]


def split_events(events, thinking_open: bool, tools: bool = False):
    """Engine events -> (REASONING | ANSWER, text) and (TOOL_CALL, call) pieces, (KEEPALIVE, None) while waiting,
    then (DONE, the done event)."""
    splitter = ReplySplitter(thinking_open, tools)
    for ev in events:
        if ev["type"] == "keepalive":
            yield KEEPALIVE, None
        elif ev["type"] == "token":
            yield from splitter.feed(ev["text"])
        elif ev["type"] == "done":
            yield from splitter.finish()
            yield DONE, ev

"""The chat page at / in headless Debian Chromium: a test types a question, presses Enter and watches the answer
stream in; with thinking on, the reasoning shows in its own panel. Not skipped when Chromium is missing: it
fails, because CI installs it (scripts/test.sh)."""
from __future__ import annotations

import json
import time

import pytest

from tests.server.browser import Chromium

LAST = """(() => {
  const all = document.querySelectorAll('.msg.assistant');
  const m = all[all.length - 1];
  if (!m) return null;
  return {answer: m.querySelector('.answer').textContent, reasoning: m.querySelector('.reasoning').textContent,
          thinkingShown: !m.querySelector('details.thinking').hidden, stats: m.querySelector('.stats').textContent};
})()"""


@pytest.fixture
def browser(tmp_path):
    b = Chromium(tmp_path / "profile", tmp_path / "chromium.log")
    yield b
    b.close()


def _wait(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _ask_on_page(browser, page, question: str) -> list:
    """Type the question, press Enter; return every state of the reply seen until it finished."""
    n_before = browser.evaluate(page, "document.querySelectorAll('.msg.assistant').length")
    browser.evaluate(page, "document.getElementById('prompt').focus()")
    browser.type_text(page, question)
    browser.press_enter(page)
    _wait(lambda: browser.evaluate(page, "document.querySelectorAll('.msg.assistant').length") > n_before, 10,
          "the reply to appear")
    states = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        s = browser.evaluate(page, LAST)
        states.append(s)
        if s["stats"]:
            return states
        time.sleep(0.02)
    raise AssertionError(f"the reply did not finish: {states[-1]}")


def _reference(live_server, messages, thinking: bool) -> dict:
    body = {"messages": messages, "temperature": 0, "max_tokens": 40,
            "thinking": {"type": "enabled" if thinking else "disabled"}}
    return live_server.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]


def test_chat_page_streams_answer_and_thinking(live_server, browser, tmp_path):
    page = browser.open(live_server.url + "/")
    ready = ("document.readyState === 'complete' && !!document.getElementById('send') && "
             "!document.getElementById('send').disabled")
    _wait(lambda: browser.evaluate(page, ready), 30, "the page to be ready")
    assert browser.evaluate(page, "document.getElementById('model').textContent") == "ds4-test"
    browser.evaluate(page, "document.getElementById('temperature').value = '0'; "
                           "document.getElementById('max-tokens').value = '40'")

    q1 = "What does 'ledger' mean?"
    states = _ask_on_page(browser, page, q1)
    final = states[-1]
    ref = _reference(live_server, [{"role": "user", "content": q1}], thinking=False)
    assert final["answer"] == ref["content"] and final["answer"]
    partial = {s["answer"] for s in states if s["answer"] and s["answer"] != final["answer"]}
    assert partial, "no partial answer was ever on screen: the page did not stream"
    assert all(final["answer"].startswith(p) for p in partial)
    assert not final["thinkingShown"] and "finish: length" in final["stats"] and "40 generated tokens" in final["stats"]
    assert browser.evaluate(page, "document.querySelector('.msg.user').textContent") == q1

    browser.evaluate(page, "document.getElementById('thinking').click()")
    q2 = "And a journal?"
    states = _ask_on_page(browser, page, q2)
    final = states[-1]
    ref = _reference(live_server, [{"role": "user", "content": q1}, {"role": "assistant", "content": ref["content"]},
                                   {"role": "user", "content": q2}], thinking=True)
    assert final["thinkingShown"] and final["reasoning"] == ref["reasoning_content"] and final["reasoning"]
    assert final["answer"] == ref["content"]
    assert any(s["reasoning"] and s["reasoning"] != final["reasoning"] for s in states), "reasoning did not stream"
    browser.screenshot(page, tmp_path / "chat.png")
    assert (tmp_path / "chat.png").stat().st_size > 1000
    json.dumps(states)                                      # plain data, in case a failure prints it

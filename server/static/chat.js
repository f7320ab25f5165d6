// The ds4 chat page: streams /v1/chat/completions (SSE) and shows the reasoning apart from the answer.
// Plain JavaScript, no build step. The conversation lives in this page only.
"use strict";

const $ = (id) => document.getElementById(id);
const conversation = [];          // {role, content} sent with every request
let controller = null;            // AbortController of the running request: Stop closes the stream
let modelName = "ds4";

function setStatus(text) { $("status").textContent = text; }

function scrollDown() { const log = $("log"); log.scrollTop = log.scrollHeight; }

function busy(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
}

async function waitForServer() {
  busy(true);
  $("stop").disabled = true;
  for (;;) {
    try {
      const h = await fetch("/health");
      const j = await h.json();
      if (h.ok) { modelName = j.model; $("model").textContent = modelName; break; }
      $("model").textContent = j.status === "loading" ? "loading the model…"
        : j.status === "warming_up" ? "warming up (compiling or loading kernels)…"
        : "model failed: " + (j.error || j.status);
    } catch (e) {
      $("model").textContent = "server unreachable";
    }
    await new Promise((r) => setTimeout(r, 1000));
  }
  busy(false);
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;
  $("log").appendChild(div);
  scrollDown();
  return div;
}

function assistantView() {
  const div = document.createElement("div");
  div.className = "msg assistant";
  const details = document.createElement("details");
  details.className = "thinking";
  details.open = true;
  details.hidden = true;
  const summary = document.createElement("summary");
  summary.textContent = "thinking";
  const reasoning = document.createElement("div");
  reasoning.className = "reasoning";
  details.append(summary, reasoning);
  const answer = document.createElement("div");
  answer.className = "answer";
  const stats = document.createElement("div");
  stats.className = "stats";
  div.append(details, answer, stats);
  $("log").appendChild(div);
  return { div, details, reasoning, answer, stats };
}

// Yields the data payload of each server-sent event as it arrives.
async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (data) yield data;
    }
  }
}

async function send(text) {
  conversation.push({ role: "user", content: text });
  addMessage("user", text);
  const view = assistantView();
  controller = new AbortController();
  busy(true);
  setStatus("generating…");
  const body = {
    model: modelName, messages: conversation, stream: true, stream_options: { include_usage: true },
    temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value),
    thinking: { type: $("thinking").checked ? "enabled" : "disabled" },
  };
  let reasoning = "", answer = "", usage = null, finish = null, tFirst = null;
  const t0 = performance.now();
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!r.ok) {
      const j = await r.json().catch(() => ({}));
      throw new Error((j.error && j.error.message) || r.status + " " + r.statusText);
    }
    for await (const data of sseData(r)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const c of chunk.choices || []) {
        const d = c.delta || {};
        if (d.reasoning_content) {
          reasoning += d.reasoning_content;
          view.details.hidden = false;
          view.reasoning.textContent = reasoning;
        }
        if (d.content) {
          answer += d.content;
          view.answer.textContent = answer;
        }
        if ((d.reasoning_content || d.content) && tFirst === null) tFirst = performance.now();
        if (c.finish_reason) finish = c.finish_reason;
      }
      scrollDown();
    }
  } catch (e) {
    if (e.name === "AbortError") {
      finish = "stopped";
    } else {
      view.div.classList.add("error");
      view.answer.textContent = answer + (answer ? "\n" : "") + "[error] " + e.message;
      finish = "error";
    }
  } finally {
    controller = null;
    busy(false);
  }
  conversation.push({ role: "assistant", content: answer });
  const secs = (performance.now() - t0) / 1000;
  const parts = [finish ? "finish: " + finish : ""];
  if (usage) {
    const rate = tFirst !== null && usage.completion_tokens > 1
      ? ((usage.completion_tokens - 1) / ((performance.now() - tFirst) / 1000)).toFixed(1) + " tokens/s" : "";
    parts.push(usage.prompt_tokens + " prompt + " + usage.completion_tokens + " generated tokens", rate);
  }
  parts.push(secs.toFixed(1) + " s");
  view.stats.textContent = parts.filter(Boolean).join(" · ");
  setStatus("");
  scrollDown();
}

$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("prompt").value = "";
  send(text);
});

$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) {
    ev.preventDefault();
    $("composer").requestSubmit();
  }
});

$("stop").addEventListener("click", () => { if (controller) controller.abort(); });

$("clear").addEventListener("click", () => {
  if (controller) controller.abort();
  conversation.length = 0;
  $("log").replaceChildren();
});

waitForServer();

// The chat page: talks to this server's own OpenAI API (/v1/models, /v1/chat/completions,
// streamed). Multi-turn: the whole history goes with each request, and the server's prefix
// cache reuses what it has already computed (shown as "cached" after each answer).
"use strict";

const $ = (id) => document.getElementById(id);
const conversation = []; // {role, content} of the conversation, system prompt excluded
let running = null; // the AbortController of the answer being streamed

function headers() {
  const key = sessionStorage.getItem("dynalm-api-key");
  const h = { "Content-Type": "application/json" };
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function errorText(response) {
  try {
    return (await response.json()).error.message;
  } catch {
    return `HTTP ${response.status}`;
  }
}

async function loadModels() {
  const response = await fetch("/v1/models", { headers: headers() });
  if (response.status === 401) {
    $("key-row").hidden = false;
    setStatus("This server needs an API key.");
    return;
  }
  if (!response.ok) {
    setStatus(`Could not list the models: ${await errorText(response)}`);
    return;
  }
  const select = $("model");
  select.replaceChildren();
  for (const card of (await response.json()).data) {
    const option = document.createElement("option");
    option.value = option.textContent = card.id;
    select.append(option);
  }
  $("key-row").hidden = true;
  setStatus("");
}

function setStatus(text) {
  $("status").textContent = text;
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `message ${role}`;
  const body = document.createElement("div");
  body.className = "content";
  if (role === "assistant") body.innerHTML = window.renderMarkdown(text);
  else body.textContent = text;
  div.append(body);
  $("messages").append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function addStats(div, text) {
  const stats = document.createElement("div");
  stats.className = "stats";
  stats.textContent = text;
  div.append(stats);
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...conversation);
  const body = {
    model: $("model").value,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: Number($("temperature").value),
  };
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (maxTokens > 0) body.max_tokens = maxTokens;
  return body;
}

// Server-sent events from a fetch body: calls onEvent(parsed JSON) per "data:" line.
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }
}

async function send() {
  const text = $("prompt").value;
  if (!text.trim() || running || !$("model").value) return;
  $("prompt").value = "";
  conversation.push({ role: "user", content: text });
  addMessage("user", text);
  const div = addMessage("assistant", "");
  const content = div.querySelector(".content");
  div.classList.add("streaming");
  running = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  let answer = "";
  let usage = null;
  let chunks = 0;
  let first = null;
  let pending = false;
  const render = () => {
    pending = false;
    content.innerHTML = window.renderMarkdown(answer);
    div.scrollIntoView({ block: "end" });
  };
  const started = performance.now();
  let ending = "";
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(),
      body: JSON.stringify(requestBody()),
      signal: running.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    await readEvents(response, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const delta = chunk.choices?.[0]?.delta?.content;
      if (delta) {
        first ??= performance.now();
        answer += delta;
        chunks += 1;
        if (!pending) {
          pending = true;
          requestAnimationFrame(render);
        }
      }
      const reason = chunk.choices?.[0]?.finish_reason;
      if (reason && reason !== "stop") ending = ` · finish: ${reason}`;
    });
  } catch (e) {
    if (e.name === "AbortError") ending = " · stopped";
    else ending = ` · error: ${e.message}`;
  }
  render();
  div.classList.remove("streaming");
  const end = performance.now();
  const tokens = usage ? usage.completion_tokens : chunks;
  const decode = first !== null && end > first ? (tokens - 1) / ((end - first) / 1000) : 0;
  const parts = [`${usage ? "" : "~"}${tokens} tokens`, `${decode.toFixed(1)} tokens/s`];
  if (usage) {
    const cached = usage.prompt_tokens_details?.cached_tokens ?? 0;
    parts.push(`${cached} of ${usage.prompt_tokens} prompt tokens cached`);
  }
  if (first !== null) parts.push(`first token after ${((first - started) / 1000).toFixed(2)} s`);
  addStats(div, parts.join(" · ") + ending);
  conversation.push({ role: "assistant", content: answer });
  running = null;
  $("send").disabled = false;
  $("stop").disabled = true;
  $("prompt").focus();
}

function stop() {
  if (running) running.abort();
}

function newChat() {
  stop();
  conversation.length = 0;
  $("messages").replaceChildren();
}

$("prompt").addEventListener("keydown", (e) => {
  // Enter sends; Shift+Enter is a new line (and so is Enter while an IME composes)
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    send();
  }
});
$("send").addEventListener("click", send);
$("stop").addEventListener("click", stop);
$("new-chat").addEventListener("click", newChat);
$("temperature").addEventListener("input", () => {
  $("temperature-value").textContent = Number($("temperature").value).toFixed(2);
});
$("save-key").addEventListener("click", () => {
  sessionStorage.setItem("dynalm-api-key", $("api-key").value.trim());
  loadModels();
});
loadModels();

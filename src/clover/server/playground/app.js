// The Clover playground: a chat over /v1/chat/completions (streamed) and a view of each block's
// denoising steps, from the server's `step_events` stream extension. Plain JavaScript, no build step.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { key: sessionStorage.getItem("clover-api-key") || "", model: null, messages: [], abort: null };
const STEP_DELAY_MS = 60;        // steps arrive a block at a time: shown one by one so a person sees them

function headers() {
  const h = { "Content-Type": "application/json" };
  if (state.key) h.Authorization = "Bearer " + state.key;
  return h;
}

// ---- connection and API key ------------------------------------------------------------------
async function connect() {
  let r;
  try {
    r = await fetch("/v1/models", { headers: headers() });
  } catch (err) {
    $("model").textContent = "server unreachable: " + err;
    return;
  }
  if (r.status === 401) {
    $("key-form").hidden = false;
    $("key-error").textContent = state.key ? "that key was refused" : "";
    $("model").textContent = "API key needed";
    $("api-key").focus();
    return;
  }
  const body = await r.json();
  if (!r.ok) {
    $("model").textContent = (body.error && body.error.message) || r.statusText;
    return;
  }
  state.model = body.data[0].id;
  $("key-form").hidden = true;
  $("model").textContent = "model: " + state.model;
  $("send").disabled = false;
}

$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  state.key = $("api-key").value.trim();
  sessionStorage.setItem("clover-api-key", state.key);
  connect();
});

// ---- settings --------------------------------------------------------------------------------
function number(id) {
  const v = $(id).value.trim();
  return v === "" ? null : Number(v);
}

function requestBody() {
  const body = {
    model: state.model, messages: state.messages, stream: true, step_events: true,
    stream_options: { include_usage: true },
    decoding: $("decoding").value, enable_thinking: $("thinking").checked,
  };
  for (const [field, id] of [["block_size", "block_size"], ["threshold", "threshold"],
                             ["block_expert_top_p", "block_expert_top_p"], ["temperature", "temperature"],
                             ["max_tokens", "max_tokens"]]) {
    const v = number(id);
    if (v !== null) body[field] = v;
  }
  const tools = $("tools").value.trim();
  if (tools) {
    body.tools = JSON.parse(tools);      // a bad array: the error shows in the chat
    body.tool_choice = $("tool_choice").value;
  }
  return body;
}

function showUsed(s) {
  const parts = [s.decoding, "block " + s.block_size, "threshold " + s.threshold,
                 "expert top-p " + (s.block_expert_top_p === null ? "off" : s.block_expert_top_p),
                 s.do_sample ? "temperature " + s.temperature : "greedy",
                 "max tokens " + s.max_new_tokens];
  if (s.enable_thinking !== undefined) parts.push("thinking " + (s.enable_thinking ? "on" : "off"));
  $("used").textContent = "server used: " + parts.join(" · ");
  $("used").dataset.settings = JSON.stringify(s);
}

// ---- the diffusion view ----------------------------------------------------------------------
const blocks = new Map();        // block number → {size, cells, steps, filled, most, experts, row}
let queue = [], timer = null;

function colour(step) {
  return step === 0 ? "#c9d7c9" : `hsl(${(step - 1) * 47 % 360}, 70%, 78%)`;   // 0: forced by the grammar
}

function visible(text) {
  if (text === null || text === undefined) return "";
  const shown = text.replace(/\n/g, "⏎").replace(/ /g, "␣");
  return shown === "" ? "∅" : shown;
}

function blockFor(step) {
  let b = blocks.get(step.block);
  if (!b) {
    b = { size: step.size, cells: new Array(step.size).fill(null), steps: 0, filled: 0, most: 0, experts: [],
          row: document.createElement("tr") };
    b.row.dataset.block = step.block;
    b.row.addEventListener("click", () => drawBlock(step.block));
    $("blocks").tBodies[0].appendChild(b.row);
    blocks.set(step.block, b);
  }
  return b;
}

function drawBlock(number) {
  const b = blocks.get(number);
  const grid = $("block");
  grid.replaceChildren();
  grid.dataset.block = number;
  grid.dataset.size = b.size;
  grid.style.gridTemplateColumns = `repeat(${Math.min(b.size, 8)}, minmax(0, 1fr))`;
  b.cells.forEach((cell, i) => {
    const div = document.createElement("div");
    div.className = "cell";
    if (cell) {
      div.classList.add("filled");
      if (cell.rejected) div.classList.add("rejected");
      div.style.backgroundColor = colour(cell.step);
      div.textContent = visible(cell.text);
      div.title = `position ${i}: ${JSON.stringify(cell.text)} (token ${cell.id}), step ${cell.step}`;
      div.dataset.step = cell.step;
    } else {
      div.title = `position ${i}: masked`;
    }
    grid.appendChild(div);
  });
  $("block-title").textContent = `block ${number} · ${b.steps} step${b.steps === 1 ? "" : "s"}`;
  const legend = $("legend");
  legend.replaceChildren();
  const forced = b.cells.some((cell) => cell && cell.step === 0);
  for (let s = forced ? 0 : 1; s <= b.steps; s++) {
    const span = document.createElement("span");
    span.style.backgroundColor = colour(s);
    span.textContent = s === 0 ? "forced" : "step " + s;
    legend.appendChild(span);
  }
}

function drawRow(number) {
  const b = blocks.get(number);
  const mean = b.experts.length ? (b.experts.reduce((a, x) => a + x, 0) / b.experts.length).toFixed(1) : "–";
  const perForward = b.steps ? (b.filled / b.steps).toFixed(2) : "–";
  b.row.dataset.most = b.most;
  b.row.replaceChildren(...[number, b.steps, perForward, b.most, mean].map((v) => {
    const td = document.createElement("td");
    td.textContent = v;
    return td;
  }));
  b.row.scrollIntoView({ block: "nearest" });
}

function applyStep(step) {
  const b = blockFor(step);
  if (step.accepted !== undefined) {          // a self-speculative round: the draft past `accepted` is dropped
    b.cells.forEach((cell, i) => { if (cell && i >= step.accepted) cell.rejected = true; });
  } else {
    if (!step.forced) b.steps += 1;            // forced: written by the grammar before any forward (step 0)
    let n = 0;
    for (const [i, id, text] of step.filled) {
      b.cells[i] = id === null ? null : { id, text, step: step.forced ? 0 : b.steps };
      if (id !== null) n += 1;
    }
    b.filled += n;
    if (!step.forced) b.most = Math.max(b.most, n);
    if (step.experts !== null && step.experts !== undefined) b.experts.push(step.experts);
    live.resolved += n;
  }
  drawBlock(step.block);
  drawRow(step.block);
}

function showSteps(steps) {
  queue.push(...steps);
  $("block").dataset.pending = queue.length;
  if (timer === null) drain();
}

function drain() {
  const step = queue.shift();
  if (step === undefined) {
    timer = null;
    $("block").dataset.pending = 0;       // every step received so far is drawn
    return;
  }
  applyStep(step);
  $("block").dataset.pending = queue.length + 1;
  timer = setTimeout(drain, queue.length > 50 ? 0 : STEP_DELAY_MS);
}

// ---- tokens per second -----------------------------------------------------------------------
const live = { start: 0, resolved: 0, deltas: 0 };

function showSpeed(final) {
  const seconds = (performance.now() - live.start) / 1000;
  const tokens = final !== undefined ? final : Math.max(live.resolved, live.deltas);
  if (seconds > 0) $("speed").textContent = `${(tokens / seconds).toFixed(1)} tok/s`;
}

// ---- the chat --------------------------------------------------------------------------------
function message(role) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const label = document.createElement("span");
  label.className = "role";
  label.textContent = role;
  div.appendChild(label);
  $("log").appendChild(div);
  return div;
}

function answerView() {
  const div = message("assistant");
  div.dataset.state = "running";
  const thinking = document.createElement("details");
  thinking.className = "thinking";
  thinking.hidden = true;
  const summary = document.createElement("summary");
  summary.textContent = "thinking";
  const thought = document.createElement("div");
  thinking.append(summary, thought);
  const content = document.createElement("div");
  content.className = "content";
  const calls = document.createElement("div");
  div.append(thinking, content, calls);
  return { div, thinking, thought, content, calls, callList: [] };
}

function showCalls(view) {
  view.calls.replaceChildren(...view.callList.map((c) => {
    const pre = document.createElement("div");
    pre.className = "tool-call";
    pre.textContent = `call ${c.name}(${c.arguments})`;
    return pre;
  }));
}

async function readStream(response, view) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "", reasoning = "", content = "", finish = null;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      if (!event.startsWith("data: ")) continue;
      const data = event.slice(6);
      if (data === "[DONE]") return { reasoning, content, finish };
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.clover && chunk.clover.settings) showUsed(chunk.clover.settings);
      if (chunk.clover && chunk.clover.steps) showSteps(chunk.clover.steps);
      if (chunk.usage) showSpeed(chunk.usage.completion_tokens);
      for (const choice of chunk.choices || []) {
        const d = choice.delta || {};
        if (d.reasoning_content) {
          reasoning += d.reasoning_content;
          view.thinking.hidden = false;
          view.thought.textContent = reasoning;
        }
        if (d.content) {
          content += d.content;
          view.content.textContent = content;
        }
        for (const call of d.tool_calls || []) {
          const c = view.callList[call.index] || (view.callList[call.index] = { name: "", arguments: "" });
          if (call.function && call.function.name) c.name += call.function.name;
          if (call.function && call.function.arguments) c.arguments += call.function.arguments;
          showCalls(view);
        }
        if (d.reasoning_content || d.content) live.deltas += 1;
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      if (!chunk.usage) showSpeed();
    }
  }
  return { reasoning, content, finish };
}

async function send(text) {
  state.messages.push({ role: "user", content: text });
  message("user").appendChild(document.createTextNode(text));
  const view = answerView();
  $("send").disabled = true;
  $("stop").disabled = false;
  blocks.clear();
  queue = [];
  $("blocks").tBodies[0].replaceChildren();
  $("block").replaceChildren();
  $("legend").replaceChildren();
  $("block-title").textContent = number("block_size") === 1
    ? "block size 1 decodes autoregressively: no denoising steps to show" : "waiting for the first step…";
  Object.assign(live, { start: performance.now(), resolved: 0, deltas: 0 });
  state.abort = new AbortController();
  try {
    const r = await fetch("/v1/chat/completions", { method: "POST", headers: headers(),
      body: JSON.stringify(requestBody()), signal: state.abort.signal });
    if (!r.ok) {
      const body = await r.json().catch(() => ({}));
      if (r.status === 401) connect();
      throw new Error((body.error && body.error.message) || `${r.status} ${r.statusText}`);
    }
    const out = await readStream(r, view);
    const reply = { role: "assistant", content: out.content };
    if (view.callList.length) {
      reply.tool_calls = view.callList.map((c, i) => ({ id: "call_" + i, type: "function",
        function: { name: c.name, arguments: c.arguments } }));
    }
    state.messages.push(reply);
    view.div.dataset.state = "done";
    view.div.dataset.finish = out.finish || "";
    if (out.finish === "length") {
      const note = document.createElement("span");
      note.className = "muted";
      note.textContent = "(stopped at max tokens)";
      view.div.appendChild(note);
    }
  } catch (err) {
    state.messages.pop();
    view.div.classList.add("error");
    view.div.dataset.state = "error";
    view.content.textContent += (view.content.textContent ? "\n" : "") + "error: " + err.message;
  } finally {
    state.abort = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

$("prompt-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || $("send").disabled) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    $("prompt-form").requestSubmit();
  }
});
$("stop").addEventListener("click", () => state.abort && state.abort.abort());
$("clear").addEventListener("click", () => {
  state.messages = [];
  $("log").replaceChildren();
});

connect();

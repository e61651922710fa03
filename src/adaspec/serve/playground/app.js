// The playground: send the prompt to /v1/chat/completions with stream=true and
// token_sources=true, and colour each streamed token by how the engine produced it.
"use strict";

const $ = (id) => document.getElementById(id);
let controller = null;

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function loadServerInfo() {
  try {
    const info = await (await fetch("/health")).json();
    $("server").textContent = `${info.model} - default method ${info.method} - ` +
      `queue ${info.queue_depth ?? 0}/${info.max_queue ?? "?"}`;
    $("method").placeholder = info.method;
    const list = $("methods");
    const examples = [info.method, ...info.methods, "draft:k=4", "ngram:k=8", "draft:k=4,ctrl=heuristic"];
    for (const m of [...new Set(examples)]) {
      const opt = document.createElement("option");
      opt.value = m;
      list.appendChild(opt);
    }
    $("key-label").hidden = !info.auth;
  } catch (e) {
    $("server").textContent = "server unreachable";
  }
}

function setStatus(text, error = false) {
  $("status").textContent = text;
  $("status").className = error ? "error" : "";
}

function resetStats() {
  for (const id of ["tokens", "steps", "accepted", "corrections", "bonus", "plain"]) $("stat-" + id).textContent = "0";
  for (const id of ["tps", "ttft", "mat", "acceptance", "finish"]) $("stat-" + id).textContent = "-";
  $("stat-split").textContent = "";
}

function liveStats(s, t0) {
  const elapsed = (performance.now() - t0) / 1000;
  $("stat-tokens").textContent = s.tokens;
  $("stat-steps").textContent = s.steps;
  $("stat-accepted").textContent = s.accepted;
  $("stat-corrections").textContent = s.correction;
  $("stat-bonus").textContent = s.bonus;
  $("stat-plain").textContent = s.plain;
  if (s.ttft !== null) $("stat-ttft").textContent = s.ttft.toFixed(2) + " s";
  if (elapsed > 0) $("stat-tps").textContent = (s.tokens / elapsed).toFixed(1);
  if (s.steps) $("stat-mat").textContent = (s.tokens / s.steps).toFixed(2);
}

function finalStats(usage) {
  const sp = usage && usage.speculation;
  if (!sp) return;
  $("stat-tokens").textContent = usage.completion_tokens;
  $("stat-tps").textContent = sp.tokens_per_s.toFixed(1);
  $("stat-ttft").textContent = (sp.queue_time + sp.time_to_first_token).toFixed(2) + " s";
  $("stat-steps").textContent = sp.target_calls;
  $("stat-mat").textContent = sp.mean_accepted_tokens.toFixed(2);
  $("stat-acceptance").textContent = sp.drafted
    ? `${(100 * sp.acceptance_rate).toFixed(1)}% (${sp.accepted}/${sp.drafted})` : "no drafts";
  $("stat-split").textContent = `${sp.method}: prefill ${sp.time_to_first_token.toFixed(3)} s, ` +
    `draft ${sp.draft_time.toFixed(3)} s, verify ${sp.verify_time.toFixed(3)} s, ` +
    `other ${sp.other_time.toFixed(3)} s, queue ${sp.queue_time.toFixed(3)} s`;
}

function addTokens(tokens, s) {
  const out = $("output");
  s.steps += 1;
  for (const [piece, source] of tokens) {
    const span = document.createElement("span");
    span.className = "tok " + source;
    span.title = source;
    span.textContent = piece;
    out.appendChild(span);
    s.tokens += 1;
    s[source] = (s[source] || 0) + 1;
  }
}

async function generate() {
  const prompt = $("prompt").value;
  const body = {
    messages: [{ role: "user", content: prompt }],
    max_tokens: parseInt($("max-tokens").value, 10),
    temperature: parseFloat($("temperature").value),
    stream: true,
    stream_options: { include_usage: true },
    token_sources: true,
  };
  const method = $("method").value.trim();
  if (method) body.method = method;
  $("output").textContent = "";
  resetStats();
  setStatus("waiting...");
  $("generate").disabled = true;
  $("stop").disabled = false;
  controller = new AbortController();
  const t0 = performance.now();
  const s = { tokens: 0, steps: 0, accepted: 0, correction: 0, bonus: 0, plain: 0, ttft: null };
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!resp.ok) {
      const err = await resp.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || `HTTP ${resp.status}`);
    }
    setStatus("streaming...");
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
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
        if (data === "[DONE]") { setStatus("done"); continue; }
        const msg = JSON.parse(data);
        if (msg.error) throw new Error(msg.error.message);
        if (msg.adaspec && msg.adaspec.tokens) {
          if (s.ttft === null) s.ttft = (performance.now() - t0) / 1000;
          addTokens(msg.adaspec.tokens, s);
          liveStats(s, t0);
        }
        const choice = msg.choices && msg.choices[0];
        if (choice && choice.finish_reason) $("stat-finish").textContent = choice.finish_reason;
        if (msg.usage) finalStats(msg.usage);
      }
    }
  } catch (e) {
    if (e.name === "AbortError") setStatus("stopped");
    else setStatus(e.message, true);
  } finally {
    controller = null;
    $("generate").disabled = false;
    $("stop").disabled = true;
  }
}

$("generate").addEventListener("click", generate);
$("stop").addEventListener("click", () => controller && controller.abort());
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) generate();
});
loadServerInfo();

// The rollout viewer's page: hash routes over the JSON the viewer app serves (api/...), relative to this page so
// the same files work at `prorl view`'s root and under a service's /ui/. No libraries, nothing fetched elsewhere.
"use strict";

const PAGE_SIZE = 50;
const STAGES = ["queued", "init", "run", "eval"];
const STAGE_COLORS = {queued: "#9aa3b2", init: "#5b8def", run: "#2f9e6e", eval: "#c0872d"};
const LIVE_STAGES = ["init", "run", "eval"];
const state = {info: null, sort: "index", desc: false, offset: 0, liveTimer: null, history: [], facetsDone: false};

const $ = (selector, root = document) => root.querySelector(selector);
const esc = (value) => String(value ?? "").replace(/[&<>"']/g,
  (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"})[c]);
const fmt = (x, digits = 3) => (typeof x === "number" && isFinite(x) ? x.toFixed(digits) : "–");

async function api(path, params) {
  const query = params ? "?" + new URLSearchParams(params).toString() : "";
  const response = await fetch("api/" + path + query, {credentials: "same-origin"});
  const body = await response.json();
  if (!response.ok) throw new Error((body.error && body.error.message) || response.statusText);
  return body;
}

function showError(error) {
  const box = $("#error");
  box.hidden = !error;
  box.textContent = error ? String(error.message || error) : "";
}

function rewardColor(reward) {  // 0 → red, 1 → green (rewards outside [0, 1] are clamped for the color)
  const r = Math.max(0, Math.min(1, reward));
  return `hsl(${Math.round(r * 130)}, 55%, 42%)`;
}

// -- list -------------------------------------------------------------------------------------------------------

function filterParams() {
  const params = {};
  for (const field of $("#filters").elements) {
    if (field.name && field.value !== "") params[field.name] = field.value;
  }
  return params;
}

function fillSelect(select, counts) {
  const chosen = select.value;
  const first = select.options[0];
  select.replaceChildren(first);
  for (const [value, count] of Object.entries(counts).sort()) {
    const option = new Option(`${value} (${count})`, value);
    select.add(option);
  }
  select.value = chosen;
}

async function loadFacets() {
  const facets = await api("facets");
  fillSelect($("#f-task"), facets.tasks);
  fillSelect($("#f-finish"), facets.finishes);
  fillSelect($("#f-critical_error"), facets.critical_errors);
  document.body.classList.toggle("regraded", facets.regraded > 0);
  showProgress(facets);
  state.facetsDone = facets.complete;
  if (!facets.complete) setTimeout(loadFacets, 500);  // the rest of a long file is still being read
}

function showProgress(progress) {
  const line = progress.complete ? "" : `reading… ${progress.indexed} of ≈${progress.expected} rows`;
  $("#progress").textContent = progress.error ? `stopped reading: ${progress.error}` : line;
}

async function loadList() {
  const params = {...filterParams(), sort: state.sort, desc: state.desc, offset: state.offset, limit: PAGE_SIZE};
  const page = await api("trajectories", params);
  $("#total").textContent = page.complete ? page.total : `≈${page.total}`;
  const last = Math.min(state.offset + page.rows.length, page.total);
  $("#shown").textContent = page.total ? `${state.offset + 1}–${last}` : "none";
  $("#prev").disabled = state.offset === 0;
  $("#next").disabled = last >= page.total;
  $("#rows").innerHTML = page.rows.map((row) => `
    <tr data-index="${row.index}">
      <td>${row.index}</td><td>${esc(row.task)}</td><td class="instance">${esc(row.instance_id)}</td>
      <td>${row.sample ?? ""}</td>
      <td class="reward ${row.reward >= 1 ? "reward-1" : row.reward <= 0 ? "reward-0" : ""}">${fmt(row.reward)}</td>
      <td class="old-reward regraded-only">${row.old_reward === null ? "" : fmt(row.old_reward)}${row.changed ? ` <span class="badge warn">changed</span>` : ""}</td>
      <td class="resolved">${row.resolved === null ? "" : row.resolved ? "yes" : "no"}</td>
      <td class="finish">${esc(row.finish)}</td>
      <td class="critical-error">${row.critical_error ? `<span class="badge bad">${esc(row.critical_error)}</span>` : ""}</td>
      <td>${row.turns}</td><td>${row.tool_calls}</td>
      <td>${row.format_errors ? `<span class="badge warn">${row.format_errors}</span>` : 0}</td>
      <td>${fmt(row.seconds, 2)}</td>
    </tr>`).join("");
  for (const th of document.querySelectorAll("th[data-sort]")) {
    th.classList.toggle("sorted", th.dataset.sort === state.sort);
    th.classList.toggle("desc", th.dataset.sort === state.sort && state.desc);
  }
  if (!page.complete) setTimeout(() => { if (location.hash === "" || location.hash === "#/") loadList(); }, 1000);
}

// -- groups -----------------------------------------------------------------------------------------------------

async function loadGroups() {
  const [sort, order] = $("#group-sort").value.split(":");
  const result = await api("groups", {...filterParams(), sort, desc: order === "desc", limit: 200});
  $("#group-total").textContent = result.total;
  $("#groups").innerHTML = result.groups.map((g) => `
    <tr data-group="${esc(g.group)}">
      <td>${esc(g.group)}</td><td>${esc(g.task)}</td><td>${esc(g.instance_id)}</td>
      <td class="chips">${g.rewards.map((r, i) => `<a href="#/t/${g.indexes[i]}" title="sample ${i}: ${r}">
        <span class="chip" style="background:${rewardColor(r)}">${fmt(r, 2)}</span></a>`).join("")}</td>
      <td class="mean">${fmt(g.mean)}</td><td class="std">${fmt(g.std)}</td>
      <td class="spread">${g.spread === 0 ? `<span class="badge warn">0</span>` : fmt(g.spread)}</td>
    </tr>`).join("");
}

// -- one trajectory ---------------------------------------------------------------------------------------------

function timingBar(timing) {
  const total = STAGES.reduce((sum, stage) => sum + (timing[stage] || 0), 0) || 1;
  const parts = STAGES.filter((s) => timing[s] > 0).map((stage) => {
    const width = (100 * timing[stage]) / total;
    return `<div class="stage ${stage}" data-stage="${stage}" style="width:${width}%"
      title="${stage}: ${fmt(timing[stage], 3)} s">${stage} ${fmt(timing[stage], 2)} s</div>`;
  });
  const legend = STAGES.map((s) => `<span><i style="background:${STAGE_COLORS[s]}"></i>${s} ${fmt(timing[s], 3)} s</span>`);
  return `<div class="bar" id="timing">${parts.join("")}</div><div class="legend">${legend.join("")}</div>`;
}

function spanChart(spans) {
  if (!spans.length) return `<p class="counts">no per-call timings in this row (timing.spans)</p>`;
  const end = Math.max(...spans.map((s) => (s.start_s || 0) + (s.duration_s || 0))) || 1;
  const ordered = [...spans].sort((a, b) => (a.start_s || 0) - (b.start_s || 0));
  const rows = ordered.map((span) => {
    const kind = ["model", "tool", "init", "run", "eval"].includes(span.name) ? span.name : "other";
    const attributes = Object.entries(span.attributes || {}).map(([k, v]) => `${k}=${v}`).join(" ");
    const label = `${span.name} ${attributes}`.trim();
    const left = (100 * (span.start_s || 0)) / end;
    const width = Math.max((100 * (span.duration_s || 0)) / end, 0.2);
    return `<div class="span-row"><div class="span ${kind}" style="left:${left}%;width:${width}%"
      title="${esc(label)}: ${fmt(span.duration_s, 3)} s from ${fmt(span.start_s, 3)} s">${esc(label)}</div></div>`;
  });
  return `<div class="spans" id="spans">${rows.join("")}</div>
    <p class="counts">0 – ${fmt(end, 2)} s after the rollout was submitted</p>`;
}

function tokenColor(logProb) {  // probability 1 → no color, 0 → red
  const p = Math.exp(logProb);
  return `rgba(220, 60, 40, ${(0.75 * (1 - p)).toFixed(3)})`;
}

function tokenView(entry) {
  const ids = entry.token_ids, logProbs = entry.log_probs, texts = entry.token_texts;
  const c = entry.counts;
  const tokens = ids.map((id, i) => {
    const text = texts ? texts[i] : `⟨${id}⟩`;
    const lp = logProbs[i];
    return `<span class="tok" data-id="${id}" data-logprob="${lp}" data-text="${esc(texts ? texts[i] : "")}"
      style="background:${tokenColor(lp)}">${esc(text)}</span>`;
  }).join("");
  return `<div class="counts">prompt ${c.prompt} tokens (${c.new_prompt} new) · generated ${c.generated} ·
      log-prob sum ${fmt(c.log_prob_sum, 2)}, mean ${fmt(c.log_prob_mean, 3)}</div>
    <details class="tokens"><summary>generated tokens with log-probs${texts ? "" : " (ids: no tokenizer)"}</summary>
      <div class="toks">${tokens}</div></details>`;
}

function entryView(entry, number) {
  const parts = [`<div class="who">${esc(entry.role)}${entry.name ? ` · ${esc(entry.name)}` : ""}
    ${entry.role === "assistant" ? `· turn ${number}` : ""}</div>`];
  if (entry.reasoning) parts.push(`<pre class="reasoning">${esc(entry.reasoning)}</pre>`);
  if (entry.content) parts.push(`<pre class="content">${esc(entry.content)}</pre>`);
  for (const call of entry.tool_calls || []) {
    parts.push(`<div class="tool-call"><b>${esc(call.name)}</b><pre>${esc(prettyArguments(call.arguments))}</pre></div>`);
  }
  if (entry.format_error) parts.push(`<div class="format-error">format error: ${esc(entry.format_error)}</div>`);
  if (entry.contiguity_error) parts.push(`<div class="format-error">${esc(entry.contiguity_error)}</div>`);
  if (entry.mask) parts.push(`<span class="badge warn">masked</span>`);
  if (entry.finish_reason) parts.push(`<span class="badge">finish: ${esc(entry.finish_reason)}</span>`);
  if (entry.token_ids) parts.push(tokenView(entry));
  return `<div class="entry role-${esc(entry.role)}">${parts.join("")}</div>`;
}

function prettyArguments(text) {
  try {
    const parsed = typeof text === "string" ? JSON.parse(text) : text;
    if (parsed && typeof parsed === "object" && Object.keys(parsed).length === 1 && typeof Object.values(parsed)[0] === "string") {
      return Object.values(parsed)[0];  // {"code": "..."}: the code itself
    }
    return JSON.stringify(parsed, null, 2);
  } catch {
    return String(text);
  }
}

function diffView(patch) {
  const lines = patch.split("\n").map((line) => {
    const kind = line.startsWith("+") && !line.startsWith("+++") ? "diff-add"
      : line.startsWith("-") && !line.startsWith("---") ? "diff-del" : line.startsWith("@@") ? "diff-hunk" : "";
    return `<span class="${kind}">${esc(line) || " "}</span>`;
  });
  return `<pre class="diff" id="patch">${lines.join("")}</pre>`;
}

function keyValues(object) {
  const rows = Object.entries(object).map(([k, v]) =>
    `<dt>${esc(k)}</dt><dd>${esc(typeof v === "object" && v !== null ? JSON.stringify(v, null, 1) : v)}</dd>`);
  return `<dl class="kv">${rows.join("")}</dl>`;
}

function regradedView(again, evaluation) {
  const reward = again.reward === null ? "not graded again" : fmt(again.reward);
  return `<div class="panel" id="evaluation"><h3>graded again (prorl reverify)
      ${again.changed ? `<span class="badge warn">changed</span>` : ""}${again.skipped ? ` <span class="badge">skipped: ${esc(again.skipped)}</span>` : ""}</h3>
    <div class="side-by-side">
      <div><h4>before: reward <b class="old-reward">${fmt(again.old_reward)}</b>, resolved ${again.old_resolved ? "yes" : "no"}</h4>
        ${keyValues(again.old_evaluation || {})}</div>
      <div><h4>now: reward <b class="new-reward">${reward}</b>, resolved ${again.resolved === null ? "–" : again.resolved ? "yes" : "no"}</h4>
        ${keyValues(evaluation)}</div>
    </div></div>`;
}

async function loadTrajectory(index) {
  const t = await api(`trajectories/${index}`);
  const s = t.summary;
  let turn = 0;
  const conversation = t.conversation.map((e) => entryView(e, e.role === "assistant" ? ++turn : turn)).join("");
  const totalTime = STAGES.reduce((sum, stage) => sum + (t.timing[stage] || 0), 0);
  $("#trajectory").innerHTML = `
    <div class="head"><h2>${esc(s.instance_id)}</h2><span>${esc(s.trajectory_id)}</span>
      <span>task ${esc(s.task ?? "–")}</span>
      <span>reward <b class="reward" style="color:${rewardColor(s.reward)}">${fmt(s.reward)}</b></span>
      <span>resolved ${s.resolved === null ? "–" : s.resolved ? "yes" : "no"}</span>
      <span>finish ${esc(s.finish ?? "–")}</span>
      ${s.critical_error ? `<span class="badge bad">critical error: ${esc(s.critical_error)}</span>` : ""}
      <span>${s.turns} turns · ${s.tool_calls} tool calls · ${s.format_errors} format errors</span></div>
    ${t.error ? `<div class="panel format-error">${esc(t.error)}</div>` : ""}
    <div class="panel"><h3>timing: ${fmt(totalTime, 2)} s in stages</h3>${timingBar(t.timing)}${spanChart(t.spans)}</div>
    ${t.final_answer !== null ? `<div class="panel"><h3>final answer</h3><pre id="final-answer">${esc(t.final_answer)}</pre></div>` : ""}
    ${t.patch ? `<div class="panel"><h3>patch</h3>${diffView(t.patch)}</div>` : ""}
    ${t.reverify ? regradedView(t.reverify, t.evaluation) : `<div class="panel" id="evaluation"><h3>grader</h3>${keyValues(t.evaluation)}</div>`}
    ${t.submission ? `<div class="panel" id="submission"><h3>what grading was given</h3>${keyValues(t.submission)}</div>` : ""}
    <div id="conversation">${conversation}</div>
    ${t.tools.length ? `<div class="panel"><h3>tools offered</h3><pre>${esc(t.tools.map((x) => (x.function || x).name).join(", "))}</pre></div>` : ""}
    ${Object.keys(t.extra).length ? `<div class="panel"><h3>other fields</h3>${keyValues(t.extra)}</div>` : ""}
    ${t.tokenizer_error ? `<p class="counts">tokenizer: ${esc(t.tokenizer_error)}</p>` : ""}`;
}

// -- token tooltip ----------------------------------------------------------------------------------------------

document.addEventListener("mouseover", (event) => {
  const token = event.target.closest && event.target.closest(".tok");
  const tip = $("#tooltip");
  if (!token) { tip.hidden = true; return; }
  const lp = Number(token.dataset.logprob);
  const text = token.dataset.text;
  tip.textContent = `id ${token.dataset.id}\ntext ${text ? JSON.stringify(text) : "(no tokenizer)"}\n` +
    `log-prob ${lp.toFixed(4)} (p = ${Math.exp(lp).toFixed(3)})`;
  const box = token.getBoundingClientRect();
  tip.style.left = `${box.left}px`;
  tip.style.top = `${box.bottom + 4}px`;
  tip.hidden = false;
});

// -- live -------------------------------------------------------------------------------------------------------

function plot(svg, series, colors) {
  const width = svg.clientWidth || 420, height = svg.clientHeight || 160, pad = 26;
  const points = series.flatMap((s) => s.values);
  const ys = points.map((p) => p[1]);
  const ts = points.map((p) => p[0]);
  const yMax = Math.max(1e-9, ...ys), t0 = Math.min(...ts), t1 = Math.max(...ts, t0 + 1);
  const x = (t) => pad + ((t - t0) / (t1 - t0)) * (width - pad - 6);
  const y = (v) => height - pad + 6 - (v / yMax) * (height - pad - 4);
  const lines = series.map((s, i) => `<polyline fill="none" stroke="${colors[i]}" stroke-width="1.8"
    data-name="${s.name}" data-values="${s.values.map(([, v]) => v).join(" ")}" points="${s.values.map(([t, v]) => `${x(t).toFixed(1)},${y(v).toFixed(1)}`).join(" ")}"/>`);
  const dots = series.flatMap((s, i) => s.values.length > 120 ? [] : s.values.map(([t, v]) =>
    `<circle cx="${x(t).toFixed(1)}" cy="${y(v).toFixed(1)}" r="2.2" fill="${colors[i]}"/>`));
  const labels = series.map((s, i) => `<text x="${pad + 70 * i}" y="10" style="fill:${colors[i]}">${s.name}</text>`);
  svg.innerHTML = `<line x1="${pad}" y1="${height - pad + 6}" x2="${width}" y2="${height - pad + 6}" stroke="#ccc"/>
    <text x="2" y="${y(yMax) + 4}">${fmt(yMax, 2)}</text><text x="2" y="${height - pad + 6}">0</text>
    <text x="${width - 40}" y="${height - 4}">${fmt(t1 - t0, 0)} s</text>${lines.join("")}${dots.join("")}${labels.join("")}`;
}

async function pollLive() {
  let sample;
  try {
    sample = await api("live");
  } catch (error) {
    showError(error);
    return;
  }
  const finished = Object.values(sample.finished).reduce((a, b) => a + b, 0);
  const previous = state.history[state.history.length - 1];
  const point = {t: sample.time, finished, rewardSum: sample.reward_sum, stages: sample.stages, rate: 0, reward: null};
  if (previous) {
    const dt = point.t - previous.t || 1;
    const done = finished - previous.finished;
    point.rate = Math.max(done, 0) / dt;
    point.reward = done > 0 ? (point.rewardSum - previous.rewardSum) / done : previous.reward;
  }
  state.history.push(point);
  if (state.history.length > 600) state.history.shift();
  $("#live-finished").textContent = finished;
  $("#live-rate").textContent = fmt(point.rate, 2);
  $("#live-reward").textContent = finished ? fmt(point.rewardSum / finished) : "–";
  $("#live-live").textContent = sample.live_rollouts;
  $("#live-paused").textContent = sample.paused ? "pipeline paused" : "";
  $("#live-stages tbody").innerHTML = LIVE_STAGES.map((stage) => `<tr data-stage="${stage}"><td>${stage}</td>
    <td class="queued">${sample.stages[stage]?.queued ?? 0}</td><td class="active">${sample.stages[stage]?.active ?? 0}</td></tr>`).join("");
  const history = state.history;
  const colors = LIVE_STAGES.map((s) => STAGE_COLORS[s]);
  for (const kind of ["queued", "active"]) {
    plot($(`svg[data-series=${kind}]`), LIVE_STAGES.map((stage) => ({
      name: stage, values: history.map((p) => [p.t, p.stages[stage]?.[kind] ?? 0])})), colors);
  }
  plot($("svg[data-series=rate]"), [{name: "rollouts/s", values: history.slice(1).map((p) => [p.t, p.rate])}], ["#2357c6"]);
  plot($("svg[data-series=reward]"), [{name: "reward", values: history.filter((p) => p.reward !== null).map((p) => [p.t, p.reward])}], ["#1f8a4c"]);
}

// -- routing ----------------------------------------------------------------------------------------------------

async function route() {
  const hash = location.hash || "#/";
  clearInterval(state.liveTimer);
  const match = hash.match(/^#\/t\/(\d+)/);
  const view = match ? "trajectory" : hash.startsWith("#/groups") ? "groups" : hash.startsWith("#/live") ? "live" : "list";
  for (const section of document.querySelectorAll("main > section")) section.hidden = section.id !== `view-${view}`;
  for (const link of document.querySelectorAll("nav a")) link.classList.toggle("active", link.dataset.view === view);
  showError(null);
  try {
    if (view === "trajectory") await loadTrajectory(Number(match[1]));
    else if (view === "groups") await loadGroups();
    else if (view === "live") {
      await pollLive();
      state.liveTimer = setInterval(pollLive, 1000);
    } else await loadList();
  } catch (error) {
    showError(error);
  }
}

async function start() {
  try {
    state.info = await api("info");
  } catch (error) {
    showError(error);
    return;
  }
  $("#title").textContent = state.info.title;
  $("#nav-live").hidden = !state.info.live;
  $("#filters").addEventListener("change", () => { state.offset = 0; route(); });
  $("#f-search").addEventListener("input", () => { state.offset = 0; loadList().catch(showError); });
  $("#refresh").addEventListener("click", () => { loadFacets().catch(showError); route(); });
  $("#group-sort").addEventListener("change", () => loadGroups().catch(showError));
  $("#prev").addEventListener("click", () => { state.offset = Math.max(0, state.offset - PAGE_SIZE); loadList().catch(showError); });
  $("#next").addEventListener("click", () => { state.offset += PAGE_SIZE; loadList().catch(showError); });
  for (const th of document.querySelectorAll("th[data-sort]")) {
    th.addEventListener("click", () => {
      state.desc = state.sort === th.dataset.sort ? !state.desc : th.dataset.sort === "reward";
      state.sort = th.dataset.sort;
      state.offset = 0;
      loadList().catch(showError);
    });
  }
  $("#rows").addEventListener("click", (event) => {
    const row = event.target.closest("tr[data-index]");
    if (row) location.hash = `#/t/${row.dataset.index}`;
  });
  window.addEventListener("hashchange", route);
  await route();
  loadFacets().catch(showError);
}

start();

// tokengym view: the runs of a store folder, their episodes, one episode's token stream, and two
// episodes of a group side by side. Every element is built from text (textContent), never from
// HTML, so nothing a store holds can run; the server's Content-Security-Policy says the same.
"use strict";

const CONTROL = /[\u0000-\u0008\u000b-\u001f\u007f-\u009f]/g;

// Control characters other than newline and tab shown as pictures (a model can write an escape).
function visible(text) {
  return String(text).replace(CONTROL, (c) => {
    const code = c.charCodeAt(0);
    if (code < 0x20) return String.fromCharCode(0x2400 + code);
    if (code === 0x7f) return "\u2421";
    return "<0x" + code.toString(16).padStart(2, "0") + ">";
  });
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "text") node.textContent = visible(v);
    else if (k === "onclick") node.addEventListener("click", v);
    else if (k === "dataset") Object.assign(node.dataset, v);
    else node.setAttribute(k, String(v));
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    node.append(typeof c === "string" ? document.createTextNode(visible(c)) : c);
  }
  return node;
}

function fmt(x) {
  if (typeof x !== "number") return String(x);
  return Number.isInteger(x) ? String(x) : x.toPrecision(4).replace(/\.?0+$/, "");
}

async function api(path, params) {
  const url = path + "?" + new URLSearchParams(params || {}).toString();
  const res = await fetch(url);
  const body = await res.json();
  if (!res.ok) throw new Error(body.error || res.statusText);
  return body;
}

function show(...nodes) {
  const main = document.getElementById("main");
  main.replaceChildren(...nodes);
}

function crumbs(...parts) {
  const c = document.getElementById("crumbs");
  c.replaceChildren();
  for (const [label, href] of parts) {
    c.append(" / ", href ? el("a", { href, text: label }) : el("span", { text: label }));
  }
}

function failure(err) {
  show(el("div", { class: "error", id: "error", text: String(err.message || err) }));
}

// Routes: #/  ·  #/run/NAME?filters  ·  #/run/NAME/episode/I?start=S  ·  #/run/NAME/compare/I/J
function parseHash() {
  const raw = location.hash.replace(/^#/, "") || "/";
  const [path, query] = raw.split("?");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  return { parts, query: Object.fromEntries(new URLSearchParams(query || "")) };
}

function runHref(run, query) {
  const q = new URLSearchParams(query || {}).toString();
  return "#/run/" + encodeURIComponent(run) + (q ? "?" + q : "");
}
const episodeHref = (run, i, start) => "#/run/" + encodeURIComponent(run) + "/episode/" + i + (start ? "?start=" + start : "");
const compareHref = (run, i, j) => "#/run/" + encodeURIComponent(run) + "/compare/" + i + "/" + j;

async function route() {
  const { parts, query } = parseHash();
  try {
    if (parts[0] === "run" && parts.length === 2) await listView(parts[1], query);
    else if (parts[0] === "run" && parts[2] === "episode") await episodeView(parts[1], Number(parts[3]), query);
    else if (parts[0] === "run" && parts[2] === "compare") await compareView(parts[1], Number(parts[3]), Number(parts[4]));
    else await runsView();
  } catch (err) {
    failure(err);
  }
}

// ---------------------------------------------------------------- runs
async function runsView() {
  const data = await api("/api/runs");
  if (data.runs.length === 1) {
    location.replace(runHref(data.runs[0].name));
    return;
  }
  crumbs();
  const rows = data.runs.map((r) =>
    el("tr", { class: "run-row", dataset: { run: r.name } },
      el("td", {}, el("a", { href: runHref(r.name), text: r.name })),
      el("td", { class: "num", text: r.episodes }),
      el("td", { text: r.tokenizer || "?" }),
      el("td", { class: "kv", text: r.settings ? JSON.stringify(r.settings) : "" })));
  show(el("h2", { text: "runs in " + data.root }),
    el("table", { id: "runs" }, el("tr", {}, ...["run", "episodes", "tokenizer", "settings"].map((h) => el("th", { text: h }))), ...rows));
}

// ---------------------------------------------------------------- episode list
const FILTERS = [
  ["reward_min", "reward ≥", "input"], ["reward_max", "reward ≤", "input"], ["finish", "finish reason", "finish_reason"],
  ["stop", "stop reason", "stop_reason"], ["conformance", "conformance", "conformance"], ["task", "task", "task"],
  ["group", "group", "group"],
];

async function listView(run, query) {
  const offset = Number(query.offset || 0);
  const data = await api("/api/episodes", { run, ...query, offset });
  crumbs([run, null]);
  const form = el("form", { class: "filters", id: "filters" });
  for (const [key, label, facet] of FILTERS) {
    let input;
    if (facet === "input") {
      input = el("input", { id: "f-" + key, name: key, type: "number", step: "any", value: query[key] || "" });
    } else {
      input = el("select", { id: "f-" + key, name: key }, el("option", { value: "", text: "any" }));
      for (const [value, n] of Object.entries(data.facets[facet] || {})) {
        const opt = el("option", { value, text: value + " (" + n + ")" });
        if (query[key] === value) opt.selected = true;
        input.append(opt);
      }
    }
    form.append(el("label", {}, label, input));
  }
  form.append(el("button", { type: "submit", id: "apply", text: "filter" }),
    el("button", { type: "button", id: "clear", text: "clear", onclick: () => { location.hash = runHref(run); } }));
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const q = {};
    for (const [key] of FILTERS) {
      const v = form.elements[key].value;
      if (v !== "") q[key] = v;
    }
    location.hash = runHref(run, q);
  });
  const head = ["#", "reward", "turns", "tokens", "stop reason", "finish reasons", "conformance", "task", "group"];
  const rows = data.rows.map((r) => {
    const tr = el("tr", { class: "episode-row", dataset: { index: r.index } },
      el("td", { class: "num" }, el("a", { href: episodeHref(run, r.index), text: r.index })),
      el("td", { class: "num reward", text: fmt(r.reward) }), el("td", { class: "num", text: r.turns }),
      el("td", { class: "num", text: r.tokens }), el("td", { class: "stop", text: r.stop_reason }),
      el("td", { class: "finish", text: r.finish_reasons.join(", ") }),
      el("td", { class: "conf-" + r.conformance, text: r.conformance }), el("td", { class: "task", text: r.task ?? "" }),
      el("td", { class: "group", text: r.group ?? "" }));
    tr.addEventListener("click", (ev) => { if (ev.target.tagName !== "A") location.hash = episodeHref(run, r.index); });
    return tr;
  });
  const pageQuery = (o) => ({ ...query, offset: o });
  const pager = el("div", { class: "pager" },
    el("button", { id: "prev", disabled: offset === 0, text: "← previous",
      onclick: () => { location.hash = runHref(run, pageQuery(Math.max(0, offset - data.limit))); } }),
    el("span", { id: "page-info", text: data.matched ? `${offset + 1}–${offset + data.rows.length} of ${data.matched}` +
      (data.matched !== data.total ? ` (of ${data.total} episodes)` : " episodes") : `no episode matches (of ${data.total})` }),
    el("button", { id: "next", disabled: offset + data.limit >= data.matched, text: "next →",
      onclick: () => { location.hash = runHref(run, pageQuery(offset + data.limit)); } }));
  show(el("h2", { text: run }), form, pager,
    el("table", { id: "episodes" }, el("tr", {}, ...head.map((h) => el("th", { text: h }))), ...rows));
}

// ---------------------------------------------------------------- one episode
function shade(logprob) {
  // Policy tokens on a white-to-red scale: the less likely the token was, the redder (square root of
  // -logprob / 16: a real model's usual tokens, logprob 0 to -3, stay apart; -16 and below are the reddest).
  const a = Math.sqrt(Math.min(1, Math.max(0, -logprob) / 16)) * 0.6;
  return `rgba(220, 38, 38, ${a.toFixed(3)})`;
}

function streamNode(ep, run) {
  const pre = el("pre", { class: "stream" });
  const actionStart = new Map(ep.turns.map((t) => [t.turn, t]));
  const badged = new Set();
  const segAt = (pos) => ep.segments.find((s) => s.start <= pos && pos < s.end);
  for (const p of ep.pieces) {
    if (!Array.isArray(p)) {
      pre.append(el("img", { class: "tg-image", src: "/api/image?" + new URLSearchParams({ run, i: ep.index, k: p.image }),
        alt: `[image #${p.image}: ${p.width}x${p.height}, ${p.end - p.start} tokens]`,
        title: `image #${p.image}: ${p.width}x${p.height}, tokens ${p.start}–${p.end}`, dataset: { index: p.image } }));
      continue;
    }
    const [text, pos, logprob, kind, count] = p;
    const seg = segAt(pos);
    if (kind === "action" && seg && seg.start === pos && !badged.has(seg.turn)) {
      badged.add(seg.turn);
      const t = actionStart.get(seg.turn);
      pre.append(el("span", { class: "badge", dataset: { turn: seg.turn },
        text: `⟦turn ${seg.turn} · reward ${t ? fmt(t.reward) : "?"}${t && !t.logprobs ? " · no logprobs" : ""}⟧` }));
    }
    const span = el("span", { class: "tok k-" + kind, text, dataset: { pos, kind } });
    if (logprob !== null && logprob !== undefined && kind === "action") {
      const lp = typeof logprob === "number" ? logprob : Number(logprob);
      span.style.backgroundColor = shade(lp);
      span.dataset.logprob = String(logprob);
      span.title = `token ${pos} · logprob ${fmt(lp)} · p ${fmt(Math.exp(lp))}`;
    } else {
      span.title = count > 1 ? `tokens ${pos}–${pos + count}` : `token ${pos}`;
    }
    pre.append(span);
  }
  return pre;
}

function table(id, head, rows) {
  return el("table", { id }, el("tr", {}, ...head.map((h) => el("th", { text: h }))),
    ...rows.map((r) => el("tr", {}, ...r.map((c) => (c instanceof Node ? el("td", {}, c) : el("td", { text: c ?? "" }))))));
}

function toolCallsNode(ep) {
  if (ep.tool_calls.length) {
    return table("tool-calls", ["turn", "call", "tool", "status", "the turn's observation (the result)"],
      ep.tool_calls.map((c) => [c.turn, c.index, c.name ?? "?", el("span", { class: "call-" + c.status, text: c.status }),
        el("span", { class: "kv", text: c.result })]));
  }
  const s = ep.tool_stats;
  if (s && s.calls) {
    return el("div", { id: "tool-calls", class: "kv", text: "tool calls: " + JSON.stringify(s) });
  }
  return el("div", { id: "tool-calls", class: "muted", text: "no tool calls" });
}

function conformanceNode(ep) {
  const rows = (ep.conformance || []).map((c) => {
    // Only what says something: a field that is empty, null or an empty list is left out.
    const rest = Object.fromEntries(Object.entries(c).filter(([k, v]) =>
      k !== "turn" && k !== "status" && v !== null && v !== "" && !(Array.isArray(v) && v.length === 0)));
    return [c.turn, el("span", { class: "conf-" + c.status, text: c.status }), Object.keys(rest).length ? JSON.stringify(rest) : ""];
  });
  return rows.length ? table("conformance", ["turn", "status", "details"], rows)
    : el("div", { id: "conformance", class: "muted", text: "not checked" });
}

function episodeNode(ep, run, opts) {
  const node = el("section", { class: "episode", dataset: { index: ep.index } });
  const title = el("h2", {}, el("a", { href: episodeHref(run, ep.index), text: `episode ${ep.index}` }),
    ` · ${ep.env_id ?? "?"} · seed ${ep.seed ?? "?"}`);
  const facts = el("div", { class: "facts" },
    el("span", { class: "ep-reward", text: "reward " + fmt(ep.reward) }), el("span", { text: `${ep.tokens} tokens (${ep.policy_tokens} policy)` }),
    el("span", { text: `${ep.turns.length} turns` }), el("span", { class: "ep-stop", text: "stop reason " + ep.stop_reason }),
    ep.group !== null ? el("span", { class: "ep-group", text: "group " + ep.group }) : null);
  node.append(title, facts);
  for (const n of ep.notes) node.append(el("div", { class: "muted note", text: n }));
  if (ep.tokenizer_warning) node.append(el("div", { class: "warning", text: ep.tokenizer_warning }));
  if (!ep.window.per_token) {
    node.append(el("div", { class: "warning", id: "no-per-token",
      text: "this tokenizer's decode is not incremental here: the stream is shown a segment at a time, without per-token shading" }));
  }
  if (ep.group !== null && opts.members) {
    const others = opts.members.filter((r) => r.index !== ep.index);
    node.append(el("div", { class: "section-title", text: `group ${ep.group}: ${opts.members.length} episodes` }),
      el("div", { id: "group-members" }, ...others.flatMap((r) => [
        el("a", { class: "compare", href: compareHref(run, ep.index, r.index), dataset: { index: r.index },
          text: `compare with ${r.index} (reward ${fmt(r.reward)})` }), " · "])));
  }
  node.append(el("div", { class: "section-title", text: "turns" }),
    table("turns", ["turn", "reward", "finish", "action tokens", "observation tokens", "logprobs"],
      ep.turns.map((t) => [t.turn, fmt(t.reward), t.finish_reason, t.action_tokens, t.observation_tokens, t.logprobs ? "yes" : "no"])));
  node.append(el("div", { class: "section-title", text: "tool calls" }), toolCallsNode(ep));
  node.append(el("div", { class: "section-title", text: "conformance" }), conformanceNode(ep));
  const legend = el("div", { class: "legend" },
    el("span", { class: "k-action", text: "■ policy (mask 1), shaded by logprob: redder is less likely (reddest at -16)" }),
    el("span", { class: "k-prompt", text: "■ prompt (mask 0)" }), el("span", { class: "k-observation", text: "■ observation (mask 0)" }));
  const w = ep.window;
  const paging = el("div", { class: "pager" },
    el("span", { id: "window-info", text: `tokens ${w.start}–${w.end} of ${w.total}` }),
    w.start > 0 ? el("a", { id: "window-prev", href: episodeHref(run, ep.index, Math.max(0, w.start - (w.end - w.start))), text: "← earlier tokens" }) : null,
    w.end < w.total ? el("a", { id: "window-next", href: episodeHref(run, ep.index, w.end), text: "later tokens →" }) : null);
  node.append(el("div", { class: "section-title", text: "tokens" }), legend, paging, streamNode(ep, run));
  return node;
}

async function episodeView(run, i, query) {
  const ep = await api("/api/episode", { run, i, start: query.start || 0 });
  const members = ep.group !== null ? (await api("/api/group", { run, group: ep.group })).rows : null;
  crumbs([run, runHref(run)], ["episode " + i, null]);
  show(episodeNode(ep, run, { members }));
}

async function compareView(run, i, j) {
  const [a, b] = await Promise.all([api("/api/episode", { run, i }), api("/api/episode", { run, i: j })]);
  crumbs([run, runHref(run)], [`episode ${i}`, episodeHref(run, i)], [`compare with ${j}`, null]);
  const note = a.group === b.group ? `group ${a.group}` : `not one group: ${a.group} and ${b.group}`;
  show(el("div", { class: "muted", id: "compare-note", text: note }),
    el("div", { class: "compare-view", id: "compare" }, episodeNode(a, run, {}), episodeNode(b, run, {})));
}

window.addEventListener("hashchange", route);
window.addEventListener("DOMContentLoaded", route);

// Pure formatting for the Attention Dispatch web extension: no DOM, no ComfyUI imports, so Node's
// test runner imports it as is (`node --test tests/js/`). attention_dispatch.js does the drawing.
//
// Inputs are the pack's own JSON: GET /attention_dispatch/backends ({backends: [{name, available,
// reasons, fallback, description, ...}], machine}) and the `attention_dispatch.report` websocket
// message (nodes/reports.py: {kind, node, prompt_id, backend, policy, recorder: {calls, rows, errors, guard},
// guard?, fallback_every_call?, blocks?, compare?}).

/** Combo values that are not registry backends and always run ("auto" = auto_exact, from older workflows). */
export const ALWAYS_AVAILABLE = new Set(["auto_exact", "auto_fast", "auto", "comfy default"]);

/** What the dropdown says beside the values that are not registry backends. */
export const PSEUDO_NOTES = {
  auto_exact: "fastest exact kernel for each call, judged on this model's own activations; never a quantised kernel",
  auto_fast: "also quantised kernels (SageAttention, comfy-kitchen INT8) whose error on this model's activations " +
    "stays within 5e-2, and approximate ones (sol_attn) within their own bound, watched by the quality guard",
  auto: "older name of auto_exact: best available exact kernel for each call",
  "comfy default": "ComfyUI's own attention",
};

export const MARK_UNAVAILABLE = "\u2717"; // ✗
export const MARK_AVAILABLE = "\u2713"; // ✓
export const MARK_WARNING = "\u26a0"; // ⚠

// Where an install/trust instruction starts inside a registry reason, e.g.
// "flash-attn is not installed: pip install 'flash-attn>=2.6.3' --no-build-isolation" or
// "... runs remote code; set DIFFUSERS_TRUST_REMOTE_KERNELS=true or allow 'thu-ml' in ...".
const HINT_START = /(?::|;)\s+(?=(?:pip3?|uv pip|uv|conda|mamba) install\b|build\b|set [A-Z_]+=|install\b|rerun\b|run `)/;

/** One registry reason -> {why, hint}; hint is "" when the reason carries no instruction. */
export function splitReason(reason) {
  const text = String(reason ?? "").trim();
  const m = HINT_START.exec(text);
  if (!m) return { why: text, hint: "" };
  return { why: text.slice(0, m.index).trim(), hint: text.slice(m.index + m[0].length).trim() };
}

/** The /attention_dispatch/backends payload -> Map(name -> status). Bad input gives an empty map. */
export function indexBackends(payload) {
  const map = new Map();
  const rows = payload && Array.isArray(payload.backends) ? payload.backends : [];
  for (const row of rows) {
    if (!row || typeof row.name !== "string") continue;
    const reasons = Array.isArray(row.reasons) ? row.reasons.map(String) : [];
    const parts = reasons.map(splitReason);
    map.set(row.name, {
      name: row.name,
      available: row.available === true,
      reasons,
      why: parts.map((p) => p.why).filter(Boolean),
      hints: [...new Set(parts.map((p) => p.hint).filter(Boolean))],
      fallback: Array.isArray(row.fallback) ? row.fallback.map(String) : [],
      description: typeof row.description === "string" ? row.description : "",
      family: typeof row.family === "string" ? row.family : "",
    });
  }
  return map;
}

/** Status of one combo value: null while the list is not loaded or the value is not a registry backend. */
export function statusOf(index, value) {
  if (!index || ALWAYS_AVAILABLE.has(value)) return null;
  return index.get(value) ?? null;
}

export function isUnavailable(index, value) {
  const s = statusOf(index, value);
  return !!s && !s.available;
}

/** The menu entry for one value: label (with the mark), note (short reason, beside it), title (hover). */
export function menuEntry(index, value) {
  const s = statusOf(index, value);
  if (!s) {
    const text = Object.prototype.hasOwnProperty.call(PSEUDO_NOTES, value) ? PSEUDO_NOTES[value] : "";
    return { value, label: String(value), note: text, title: text, unavailable: false };
  }
  if (s.available) {
    return { value, label: `${MARK_AVAILABLE} ${value}`, note: "", title: s.description || "runs here",
             unavailable: false };
  }
  const why = s.why.length ? s.why.join("; ") : "cannot run on this machine";
  const title = [`${value} cannot run here: ${why}.`, ...s.hints.map((h) => `Install: ${h}`)];
  if (s.description) title.push(s.description);
  return { value, label: `${MARK_UNAVAILABLE} ${value}`, note: why, title: title.join("\n"), unavailable: true };
}

/**
 * The dropdown's groups, in the order the server lists the values (autos and ComfyUI's attention, what runs
 * here, then what cannot, by family): [{key, title, values, shared}], where `shared` is the reasons every member
 * of an unavailable family has (said once, in the group's title; each entry's note keeps only its own).
 */
export function menuGroups(index, values) {
  const groups = [];
  const list = Array.isArray(values) ? values : [];
  for (const value of list) {
    const s = statusOf(index, value);
    const key = !s ? "picks" : s.available ? "runs" : `family:${s.family || value}`;
    let group = groups.length && groups[groups.length - 1].key === key ? groups[groups.length - 1] : null;
    if (!group) {
      group = { key, title: "", values: [], shared: [] };
      groups.push(group);
    }
    group.values.push(value);
  }
  for (const group of groups) {
    if (group.key === "picks") {
      group.title = "Automatic, or ComfyUI's own";
    } else if (group.key === "runs") {
      group.title = `${MARK_AVAILABLE} Runs on this machine`;
    } else {
      const whys = group.values.map((v) => statusOf(index, v)?.why ?? []);
      group.shared = whys.length ? whys[0].filter((w) => whys.every((list) => list.includes(w))) : [];
      const family = statusOf(index, group.values[0])?.family || group.values[0];
      group.title = `${MARK_UNAVAILABLE} ${family}: ` + (group.shared.length ? group.shared.join("; ")
        : "cannot run here");
    }
  }
  return groups;
}

/** The menu entry of `value` inside its group: the reason the group's title already says is left out. */
export function groupedEntry(index, value, shared) {
  const entry = menuEntry(index, value);
  if (!entry.unavailable || !Array.isArray(shared) || !shared.length) return entry;
  const own = (statusOf(index, value)?.why ?? []).filter((w) => !shared.includes(w));
  return { ...entry, note: own.join("; ") };
}

/**
 * One line per value for a dropdown that shows only a label per entry (the Nodes 2.0 select, which has no group
 * headings, notes or hover text): the mark, the name and, for what cannot run here, why ("✗ flash — flash-attn is
 * not installed"). The value stays the real name.
 */
export function optionLabel(index, value) {
  const entry = menuEntry(index, value);
  if (!statusOf(index, value)) return entry.label;
  return entry.unavailable && entry.note ? `${entry.label} \u2014 ${entry.note}` : entry.label;
}

/** The combo's displayed label on the node (the widget's value stays the real name). */
export function displayLabel(index, value) {
  return isUnavailable(index, value) ? `${MARK_UNAVAILABLE} ${value}` : value;
}

/** The values the dropdown lists: all of them, or without the unavailable ones (the current value stays). */
export function visibleValues(values, index, showUnavailable, current) {
  if (!Array.isArray(values)) return values;
  if (showUnavailable || !index) return values;
  return values.filter((v) => v === current || !isUnavailable(index, v));
}

/** The widget's full list of values, once its array is `current`: `full` (what was kept) while `current` holds
 * exactly the values last shown (`shown`: the frontend copied the filtered list into a new array, as 1.53 does when
 * a setting changes), else `current` itself (a list of its own: the first time, or R refreshed it from the server). */
export function fullValues(full, shown, current) {
  const copyOfShown = Array.isArray(full) && Array.isArray(shown) && Array.isArray(current)
    && current.length === shown.length && current.every((v, i) => v === shown[i]);
  return copyOfShown ? full : [...current];
}

/** First available backend of `name`'s fallback chain, as the dispatcher would walk it. */
export function fallbackTarget(index, name, seen = new Set()) {
  const s = index && index.get(name);
  if (!s || seen.has(name)) return null;
  seen.add(name);
  for (const next of s.fallback) {
    const t = index.get(next);
    if (t && t.available) return next;
    const deeper = fallbackTarget(index, next, seen);
    if (deeper) return deeper;
  }
  return null;
}

/**
 * The warning a node shows once an unavailable backend is chosen (before the prompt is queued), or
 * null. policy "strict" makes the prompt fail at validation; "fallback" runs the chain and reports it.
 */
export function selectionWarning(index, value, policy) {
  const s = statusOf(index, value);
  if (!s || s.available) return null;
  const why = s.why.length ? s.why.join("; ") : "cannot run on this machine";
  const lines = [`${MARK_WARNING} ${value} cannot run here: ${why}.`];
  for (const hint of s.hints) lines.push(`Install: ${hint}`);
  if (policy === "strict") {
    lines.push("Policy strict: the prompt will be rejected.");
  } else {
    const to = fallbackTarget(index, value);
    lines.push(`Policy fallback: calls will fall back${to ? ` (here to ${to})` : ""}; the node shows what ran.`);
  }
  return { text: lines.join("\n"), lines, hints: [...s.hints], policyLine: lines[lines.length - 1],
           strict: policy === "strict" };
}

const MS_KEYS = ["attention_ms", "time_ms", "ms", "elapsed_ms"];
const S_KEYS = ["attention_s", "time_s", "seconds", "elapsed_s"];

function timeOf(obj) {
  if (!obj || typeof obj !== "object") return null;
  for (const k of MS_KEYS) if (Number.isFinite(obj[k])) return obj[k];
  for (const k of S_KEYS) if (Number.isFinite(obj[k])) return obj[k] * 1000;
  return null;
}

/** Milliseconds spent in attention if the report measured it (report, recorder, or summed rows), else null. */
export function attentionTimeMs(report) {
  const rec = report && report.recorder;
  const direct = timeOf(report) ?? timeOf(rec) ?? timeOf(rec && rec.timing);
  if (direct != null) return direct;
  const rows = rec && Array.isArray(rec.rows) ? rec.rows : [];
  let total = null;
  for (const row of rows) {
    const t = timeOf(row);
    if (t != null) total = (total ?? 0) + t;
  }
  return total;
}

export function formatMs(ms) {
  if (!Number.isFinite(ms)) return "";
  if (ms >= 10000) return `${(ms / 1000).toFixed(1)} s`;
  if (ms >= 1000) return `${(ms / 1000).toFixed(2)} s`;
  if (ms >= 100) return `${ms.toFixed(0)} ms`;
  if (ms >= 10) return `${ms.toFixed(1)} ms`;
  return `${ms.toFixed(2)} ms`;
}

export function plural(n, word) {
  return `${n} ${word}${n === 1 ? "" : "s"}`;
}

function escapeRegExp(text) {
  return String(text).replace(/[.*+?^${}()|[\]\\]/g, "\\$&");
}

/** A report reason without its "flash: " prefix (the dispatcher names the backend it judged). */
export function reasonText(reason, backend) {
  const text = String(reason ?? "");
  const stripped = backend ? text.replace(new RegExp(`^${escapeRegExp(backend)}:\\s*`), "") : text;
  return splitReason(stripped).why || stripped;
}

function truncate(text, max) {
  const s = String(text);
  return s.length <= max ? s : `${s.slice(0, Math.max(0, max - 1))}\u2026`;
}

const BADGE_MAX = 40;

/** Who served the calls, for the badge: "native · 8 calls"; two kernels, each with its calls ("native 4 ·
 * _native_math 4"); more (or two whose names do not fit), how many kernels ("3 kernels · 12 calls"): the panel
 * lists who served how many. Never "native +1", which read as one kernel. */
function servedBadge(order, calls) {
  if (order.length === 1) return `${order[0][0]} \u00b7 ${plural(calls, "call")}`;
  const each = order.map(([name, e]) => `${name} ${e.calls}`).join(" \u00b7 ");
  return order.length === 2 && each.length <= BADGE_MAX ? each
    : `${order.length} kernels \u00b7 ${plural(calls, "call")}`;
}

/**
 * One report message -> what a node shows: badge (short, title bar), lines (the panel under the
 * widgets), level ("ok" | "warn" | "error" | "info"), plus the numbers for tests and tooltips.
 */
export function summarizeReport(report) {
  if (!report || typeof report !== "object") return null;
  if (report.kind === "checks") return summarizeChecks(report);
  const rec = report.recorder && typeof report.recorder === "object" ? report.recorder : {};
  const rows = Array.isArray(rec.rows) ? rec.rows : [];
  const errors = Array.isArray(rec.errors) ? rec.errors : [];
  const served = new Map(); // backend -> {calls, sites: Map(kind of site -> {calls, blocks: Set})}
  const fallbacks = new Map(); // "requested -> served" -> {requested, served, calls, reasons:Set}
  let calls = 0;
  for (const row of rows) {
    const n = Number(row.calls) || 0;
    calls += n;
    const entry = served.get(row.served) ?? { calls: 0, sites: new Map() };
    entry.calls += n;
    const kind = siteKind(row.block ?? { kind: row.site });  // block 5's row -> "self": 30 blocks are one entry
    const site = entry.sites.get(kind) ?? { calls: 0, blocks: new Set() };
    site.calls += n;
    site.blocks.add(String(row.site));
    entry.sites.set(kind, site);
    served.set(row.served, entry);
    if (row.fell_back) {
      const key = `${row.requested}\u0000${row.served}`;
      const fb = fallbacks.get(key) ?? { requested: row.requested, served: row.served, calls: 0, reasons: new Set() };
      fb.calls += n;
      for (const r of row.reasons ?? []) fb.reasons.add(String(r));
      fallbacks.set(key, fb);
    }
  }
  const ms = attentionTimeMs(report);
  const requested = report.backend ?? (rows[0] && rows[0].requested) ?? "";
  const notes = notesOf(report);
  const overriddenBy = report.overridden_by && typeof report.overridden_by === "object" ? report.overridden_by : null;
  const lines = [];
  if (report.runs > 1) lines.push(`${report.runs} sampling runs in this prompt`);
  if (!calls && !overriddenBy) {
    lines.push(`No attention calls recorded${requested ? ` (asked for ${requested})` : ""}.`);
  }
  const order = [...served.entries()].sort((a, b) => b[1].calls - a[1].calls);
  for (const [name, e] of order) {
    const sites = [...e.sites.entries()].map(([s, { calls: n, blocks }]) =>
      `${s} ${n}${blocks.size > 1 ? ` in ${blocks.size} blocks` : blocks.has(s) ? "" : ` at ${[...blocks][0]}`}`)
      .join(", ");
    lines.push(`Ran: ${name} \u2014 ${plural(e.calls, "call")}${sites ? ` (${sites})` : ""}`);
  }
  // A fallback on every call (the backend never ran at those sites) says so in its line; one the rows do not show
  // (an older report) gets a line of its own.
  const everyCall = everyCallFallbacksOf(report);
  const shown = new Set();
  for (const fb of fallbacks.values()) {
    const why = [...new Set([...fb.reasons].map((r) => reasonText(r, fb.requested)))].filter(Boolean).join("; ");
    const every = everyCall.find((e) => e.requested === fb.requested && e.served.includes(fb.served));
    if (every) shown.add(every);
    const tag = !every ? "" : every.every_site ? " (every call)" : ` (every call at ${every.sites.join(", ")})`;
    lines.push(`${MARK_WARNING} Fell back: ${fb.requested} \u2192 ${fb.served} for ${plural(fb.calls, "call")}` +
      tag + (why ? `: ${why}` : ""));
  }
  for (const e of everyCall) if (!shown.has(e)) lines.push(`${MARK_WARNING} ${everyCallText(e)}`);
  for (const err of errors) lines.push(`${MARK_UNAVAILABLE} ${err.backend} failed at ${err.site}: ${err.error}`);
  const guard = guardOf(report);
  const caught = guard.filter((g) => g.failures.length);
  for (const g of guard) lines.push(...guardLines(g));
  const unapplied = unappliedBlocksOf(report);
  for (const u of unapplied) lines.push(`${MARK_WARNING} ${unappliedText(report, u)}`);
  if (ms != null) lines.push(`Time in attention: ${formatMs(ms)}`);
  lines.push(...notes);

  let badge = calls ? servedBadge(order, calls)
    : overriddenBy ? `overridden by ${overriddenBy.node != null ? `#${overriddenBy.node}` : overriddenBy.short ?? overriddenBy.label}`
      : "no attention calls";
  // What needs a look comes first on the badge: a kernel the guard caught, a backend that never ran, a block
  // range that could not apply.
  if (caught.length) {
    const g = caught[0];
    const to = g.failures.map((f) => f.replacement).filter(Boolean)[0];
    badge = `guard caught ${g.backend} at ${g.site}${to ? ` \u2192 ${to}` : ""}`;
  } else if (everyCall.length) {
    const e = everyCall[0];
    badge = `${e.requested} \u2192 ${e.served.join("/")} every call`;
  } else if (unapplied.length) {
    badge = "block range not applied";
  }
  if (ms != null && !caught.length && !everyCall.length && !unapplied.length) badge += ` \u00b7 ${formatMs(ms)}`;
  const level = errors.length ? "error"
    : fallbacks.size || caught.length || everyCall.length || unapplied.length || (overriddenBy && !calls) ? "warn"
      : calls ? "ok" : "info";
  badge = `${level === "ok" ? MARK_AVAILABLE : level === "info" ? "" : MARK_WARNING} ${truncate(badge, BADGE_MAX)}`.trim();
  return {
    badge, lines, level, calls, requested,
    served: Object.fromEntries(order.map(([n, e]) => [n, e.calls])),
    fallbacks: [...fallbacks.values()].map((f) => ({ ...f, reasons: [...f.reasons] })),
    errors, timeMs: ms, guard, everyCall, unappliedBlocks: unapplied,
  };
}

function strings(list) {
  return Array.isArray(list) ? list.map(String) : [];
}

/** A row's kind of block, without its number, from the fields the report carries beside the site's text
 * ({kind: "self", stream: "double", index: 5} -> "double.self", as nodes/reports.py site_kind writes it). */
export function siteKind(block) {
  const kind = String(block?.kind ?? "");
  return block?.stream != null ? `${block.stream}.${kind}` : kind;
}

/** The report's quality-guard results ({site, backend, checks, max_error, failures: [{reason, replacement}],
 * blocks?: how many blocks a passed entry folds, nodes/reports.py guard_results}). */
export function guardOf(report) {
  const list = Array.isArray(report?.guard) ? report.guard
    : Array.isArray(report?.recorder?.guard) ? report.recorder.guard : [];
  return list.filter((g) => g && typeof g === "object").map((g) => ({
    site: String(g.site ?? ""), backend: String(g.backend ?? ""), checks: Number(g.checks) || 0,
    ...(Number(g.blocks) > 1 ? { blocks: Number(g.blocks) } : {}),
    max_error: Number.isFinite(g.max_error) ? g.max_error : null,
    failures: (Array.isArray(g.failures) ? g.failures : []).filter((f) => f && typeof f === "object")
      .map((f) => ({ reason: String(f.reason ?? ""), replacement: String(f.replacement ?? "") })),
  }));
}

function guardLines(g) {
  const err = g.max_error != null ? `, max error ${g.max_error.toExponential(1)}` : "";
  const where = g.blocks > 1 ? `${g.site} (${g.blocks} blocks)` : g.site;
  const lines = [`Quality guard: ${g.backend} at ${where} \u2014 ${plural(g.checks, "check")}${err}`];
  for (const f of g.failures) {
    lines.push(`${MARK_WARNING} Quality guard caught ${g.backend} at ${g.site}: ${f.reason}; ` + (f.replacement
      ? `that call was recomputed with ${f.replacement}, and ${g.backend} is demoted for this block of this model`
      : "no exact backend was left to recompute it"));
  }
  return lines;
}

/** Fallbacks that happened on every call at their sites (nodes/reports.py every_call_fallbacks). */
export function everyCallFallbacksOf(report) {
  const list = Array.isArray(report?.fallback_every_call) ? report.fallback_every_call : [];
  return list.filter((e) => e && typeof e === "object" && typeof e.requested === "string").map((e) => ({
    requested: e.requested, served: strings(e.served), sites: strings(e.sites), calls: Number(e.calls) || 0,
    reasons: strings(e.reasons), every_site: e.every_site !== false,
  }));
}

function everyCallText(e) {
  const where = e.every_site ? "" : ` at ${e.sites.join(", ")}`;
  const why = [...new Set(e.reasons.map((r) => reasonText(r, e.requested)))].filter(Boolean).join("; ");
  return `${e.requested} fell back to ${e.served.join(" / ")} on every call${where}${why ? `: ${why}` : ""}`;
}

/** Sites where the node's block range could not apply ({sites, reason}). */
export function unappliedBlocksOf(report) {
  const list = Array.isArray(report?.blocks?.unapplied) ? report.blocks.unapplied : [];
  return list.filter((u) => u && typeof u === "object").map((u) => ({ sites: strings(u.sites),
                                                                     reason: String(u.reason ?? "") }));
}

function unappliedText(report, u) {
  const range = Array.isArray(report?.blocks?.range) ? ` ${report.blocks.range.join("..")}` : "";
  return `Block range${range} not applied at ${u.sites.join(", ")}: ${u.reason}; every block used the backend.`;
}

/** The report's `notes` (why a node ran nothing, which node took over): plain strings. */
function notesOf(report) {
  return Array.isArray(report && report.notes) ? report.notes.map(String).filter(Boolean) : [];
}

function summarizeChecks(report) {
  const cmp = report.compare;
  const lines = [`Checks: ${report.checks ?? "on"}`];
  let badge = `checks: ${report.checks ?? "on"}`;
  let level = "ok";
  if (report.no_calls === true) {
    // 0 samples and "max error 0" would read as a clean result: say nothing was seen, and why (the notes).
    lines.push("No attention call reached these checks: nothing was checked or compared.", ...notesOf(report));
    return { badge: `${MARK_WARNING} no calls checked`, lines, level: "warn", calls: 0, served: {}, fallbacks: [],
             errors: [], timeMs: attentionTimeMs(report) };
  }
  const checked = report.checked && typeof report.checked === "object" ? report.checked : null;
  if (typeof report.summary === "string" && report.summary) lines.push(report.summary);
  if (checked) {
    badge = `checks: ${report.checks ?? "on"} \u00b7 ${plural(Number(checked.calls) || 0, "call")}`;
    if (Number(checked.non_finite) > 0) {
      level = checked.mode === "raise" ? "error" : "warn";
      badge = `NaN/Inf in ${plural(Number(checked.non_finite), "call")}`;
    }
  }
  if (cmp && typeof cmp === "object") {
    const err = Number(cmp.max_rel_error);
    const e = Number.isFinite(err) ? err.toExponential(2) : "?";
    lines.push(`Compared ${plural(Number(cmp.samples) || 0, "sample")} with PyTorch SDPA (1 in ${cmp.every}): ` +
      `max relative error ${e}${cmp.worst_site ? ` at ${cmp.worst_site}` : ""}`);
    if (level === "ok") badge = `max rel err ${e}`;
    if (Number.isFinite(err) && err > 0.05 && level === "ok") level = "warn";
  }
  lines.push(...notesOf(report));
  const mark = level === "ok" ? MARK_AVAILABLE : level === "error" ? MARK_UNAVAILABLE : MARK_WARNING;
  return { badge: `${mark} ${badge}`, lines, level, calls: Number(checked?.calls) || 0,
           served: {}, fallbacks: [], errors: [], timeMs: attentionTimeMs(report) };
}

/**
 * Several reports of one node for one prompt (e.g. two samplers fed by one Set node) -> one report
 * with all rows (calls of the same site/requested/served added up), errors and measured time.
 */
export function mergeReports(reports) {
  const list = (Array.isArray(reports) ? reports : []).filter((r) => r && typeof r === "object");
  if (list.length <= 1) return list[0] ?? null;
  const last = list[list.length - 1];
  if (last.kind === "checks") return last;
  const rows = new Map();
  const errors = [];
  let ms = null;
  for (const r of list) {
    const rec = r.recorder ?? {};
    for (const row of Array.isArray(rec.rows) ? rec.rows : []) {
      const key = `${row.site}\u0000${row.requested}\u0000${row.served}`;
      const prev = rows.get(key);
      if (prev) prev.calls += Number(row.calls) || 0;
      else rows.set(key, { ...row, calls: Number(row.calls) || 0 });
    }
    if (Array.isArray(rec.errors)) errors.push(...rec.errors);
    const t = attentionTimeMs(r);
    if (t != null) ms = (ms ?? 0) + t;
  }
  const merged = [...rows.values()].map(({ attention_ms, time_ms, ms: _ms, elapsed_ms, attention_s, time_s, seconds,
                                           elapsed_s, ...rest }) => rest);
  const out = { ...last, runs: list.length, recorder: { ...(last.recorder ?? {}), rows: merged, errors,
    calls: merged.reduce((a, r) => a + r.calls, 0) } };
  const guard = new Map();
  for (const g of list.flatMap((r) => guardOf(r))) {
    const key = `${g.site}\u0000${g.backend}`;
    const prev = guard.get(key);
    if (!prev) { guard.set(key, { ...g, failures: [...g.failures] }); continue; }
    prev.checks += g.checks;
    if (g.blocks) prev.blocks = Math.max(prev.blocks ?? 1, g.blocks);
    if (g.max_error != null && (prev.max_error == null || g.max_error > prev.max_error)) prev.max_error = g.max_error;
    prev.failures.push(...g.failures);
  }
  out.guard = [...guard.values()];
  out.recorder.guard = out.guard;
  const unique = (items) => [...new Map(items.map((x) => [JSON.stringify(x), x])).values()];
  out.fallback_every_call = unique(list.flatMap((r) => everyCallFallbacksOf(r)));
  if (last.blocks && typeof last.blocks === "object") {
    out.blocks = { ...last.blocks, unapplied: unique(list.flatMap((r) => unappliedBlocksOf(r))) };
  }
  for (const k of [...MS_KEYS, ...S_KEYS]) { delete out[k]; delete out.recorder[k]; }
  delete out.recorder.timing;
  if (ms != null) out.attention_ms = ms;
  return out;
}

/** The Set CLIP node's `executed` ui text ("auto: patched 4 ...") as a panel summary. */
export function summarizeClipText(texts) {
  const list = Array.isArray(texts) ? texts.map(String).filter(Boolean) : [];
  if (!list.length) return null;
  return { badge: `${MARK_AVAILABLE} ${truncate(list[0], 40)}`, lines: list, level: "ok", calls: 0, served: {},
           fallbacks: [], errors: [], timeMs: null };
}

/** Trust Remote Kernels' `executed` ui text (one line per finding) as a panel summary. */
export function summarizeTrustText(texts) {
  const list = Array.isArray(texts) ? texts.map(String).flatMap((t) => t.split("\n")).filter(Boolean) : [];
  if (!list.length) return null;
  const confirmed = list.some((l) => l.startsWith("Trusted for the connected models"));
  const doubtful = list.some((l) => l.startsWith("Ignored:") || l.startsWith("Changes nothing") || /=true wins/.test(l));
  const level = doubtful ? "warn" : confirmed ? "ok" : "info";
  const mark = level === "ok" ? MARK_AVAILABLE : level === "warn" ? MARK_WARNING : "";
  return { badge: `${mark} ${truncate(list[0], 40)}`.trim(), lines: list, level, calls: 0, served: {}, fallbacks: [],
           errors: [], timeMs: null };
}

/** Greedy word wrap of `text` (may hold "\n") to `width`, measured by `measure(str) -> px`. */
export function wrapText(text, width, measure) {
  const out = [];
  for (const para of String(text ?? "").split("\n")) {
    const words = para.split(/\s+/).filter(Boolean);
    if (!words.length) { out.push(""); continue; }
    let line = "";
    for (const word of words) {
      const next = line ? `${line} ${word}` : word;
      if (measure(next) <= width) { line = next; continue; }
      if (line) out.push(line);
      line = word;
      // A word wider than the line is cut by characters.
      while (line.length > 1 && measure(line) > width) {
        let cut = line.length - 1;
        while (cut > 1 && measure(line.slice(0, cut)) > width) cut--;
        out.push(line.slice(0, cut));
        line = line.slice(cut);
      }
    }
    if (line) out.push(line);
  }
  return out;
}

/** "12" -> ["12"]; "5:3" (a node inside subgraph node 5) -> ["5", "3"]. */
export function parseExecutionId(id) {
  if (id == null) return [];
  return String(id).split(":").filter((p) => p !== "");
}

/** The graph node a report's node id names, walking subgraph nodes (duck-typed: getNodeById, .subgraph). */
export function resolveNode(rootGraph, id) {
  const parts = parseExecutionId(id);
  let graph = rootGraph;
  for (let i = 0; i < parts.length; i++) {
    if (!graph || typeof graph.getNodeById !== "function") return null;
    const key = /^\d+$/.test(parts[i]) ? Number(parts[i]) : parts[i];
    const node = graph.getNodeById(key) ?? graph.getNodeById(parts[i]);
    if (!node) return null;
    if (i === parts.length - 1) return node;
    graph = node.subgraph;
  }
  return null;
}

/** Toast text for a report that fell back, or null. */
export function fallbackToast(report, title) {
  const s = summarizeReport(report);
  if (!s || !s.fallbacks.length) return null;
  const detail = s.fallbacks.map((f) => `${f.requested} \u2192 ${f.served} (${plural(f.calls, "call")})` +
    (f.reasons.length ? `: ${f.reasons.map((r) => reasonText(r, f.requested)).join("; ")}` : "")).join("\n");
  return { summary: `Attention backend fell back${title ? ` \u2014 ${title}` : ""}`, detail };
}

// Attention Dispatch in the ComfyUI frontend (frontend 1.27 to 1.58; the LiteGraph canvas and "Modern Node Design
// (Nodes 2.0)", where nodes are Vue components and the canvas draws no node: docs/nodes.md says what differs):
//  - the backend dropdown of Set Attention Backend / Set CLIP Attention Backend marks what cannot run
//    here (✗, the reason beside it, reason + install command on hover); the VALUE stays the real name;
//  - choosing such a backend draws the reason on the node (and the title badge) before queueing;
//  - after each run the `attention_dispatch.report` message puts what actually ran on the node;
//  - settings: default policy of new Set nodes, show/hide unavailable backends, fallback toast;
//  - a refused prompt: each error on the widget at fault, with the pack's sentence (./node_errors.js).
// One GET /attention_dispatch/backends per page load, no polling. Every hook is guarded and chains
// the callbacks it wraps. Formatting lives in ./format.js (pure, unit-tested with Node).
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import {
  displayLabel, fallbackToast, fullValues, groupedEntry, indexBackends, isUnavailable, menuGroups, mergeReports,
  optionLabel, resolveNode, selectionWarning, summarizeClipText, summarizeReport, summarizeTrustText, visibleValues,
  wrapText,
} from "./format.js";
import { placeNodeErrors, refusalLines } from "./node_errors.js";

const EXTENSION = "attention_dispatch";
const EVENT = "attention_dispatch.report";
const BACKEND_NODES = new Set(["SetAttentionBackend", "SetClipAttentionBackend"]);
const TEXT_NODES = new Set(["SetClipAttentionBackend", "TrustRemoteKernels"]); // panels from `executed` ui text
const REPORT_NODES = new Set([...BACKEND_NODES, "AttentionChecks", "TrustRemoteKernels"]);
// Every node of the pack whose validate_inputs can refuse a prompt.
const VALIDATED_NODES = new Set([...REPORT_NODES, "SparseAttentionOptions"]);
const PANEL_WIDGET = "attention_dispatch_panel";
const POLICIES = ["fallback", "strict"];
export const SETTINGS = {
  policy: "AttentionDispatch.DefaultPolicy",
  showUnavailable: "AttentionDispatch.ShowUnavailableBackends",
  toast: "AttentionDispatch.FallbackToast",
};

const state = { index: null, machine: null, error: null, version: 0, loading: null };
const baseTooltips = new Map(); // node type -> the backend input's tooltip from the node definition
const warned = new Set();

function warnOnce(where, err) {
  if (warned.has(where)) return;
  warned.add(where);
  console.warn(`[attention dispatch] ${where}:`, err);
}

function guard(where, fn) {
  return function guarded(...args) {
    try {
      return fn.apply(this, args);
    } catch (err) {
      warnOnce(where, err);
      return undefined;
    }
  };
}

function setting(id, fallback) {
  try {
    const v = app.extensionManager?.setting?.get?.(id);
    if (v !== undefined && v !== null) return v;
  } catch { /* settings store not ready */ }
  try {
    const v = app.ui?.settings?.getSettingValue?.(id);
    if (v !== undefined && v !== null) return v;
  } catch { /* legacy API absent */ }
  return fallback;
}

function typeOf(node) {
  return node?.comfyClass ?? node?.type;
}

function widgetNamed(node, name) {
  return Array.isArray(node?.widgets) ? node.widgets.find((w) => w && w.name === name) : undefined;
}

function redraw(node) {
  try {
    if (node?.setDirtyCanvas) node.setDirtyCanvas(true, true);
    else app.graph?.setDirtyCanvas?.(true, true);
  } catch { /* no canvas yet */ }
}

/** Nodes 2.0: the nodes are Vue components; the canvas draws links only (no onDrawForeground, no widgets). */
function vueMode() {
  return window.LiteGraph?.vueNodesMode === true;
}

// Nodes 2.0 renders a node's badges from a Vue `computed` that reads node.badges once and recomputes only when a
// reactive value it read changes; the pack's badge text is plain state. So each badge getter reads one key of the
// workspace store (a reactive Pinia store: app.extensionManager), and a change of what the badges say writes it.
const TICK = "attentionDispatchTick";
let tick = 0;

function readTick() {
  try { return app.extensionManager?.[TICK]; } catch { return undefined; }
}

function bumpTick() {
  tick += 1;
  try {
    const manager = app.extensionManager;
    if (manager && typeof manager === "object") manager[TICK] = tick;
  } catch { /* a frozen or absent manager: Nodes 2.0 badges then update on the node's next change */ }
}

/** Redraw what shows the node's state: the canvas, the Nodes 2.0 badge and panel. */
function refreshNode(node) {
  redraw(node);
  bumpTick();
  try { redrawPanelWidget(node); } catch (err) { warnOnce("panel redraw", err); }
}

/** Nodes 2.0: the panel widget's canvas takes the height the frontend last laid out (computedHeight), so set it to
 * what the panel needs now before asking for a redraw. */
function redrawPanelWidget(node) {
  const w = panelWidgetOf(node);
  if (!w) return;
  if (!vueMode()) return;
  if (typeof w.computeSize === "function") w.computedHeight = w.computeSize(node.size?.[0])[1];
  w.triggerDraw?.();
}

/** Nodes 2.0: the panel (a warning on load, a run's report, a refusal) grew by what it needs now over what it needed
 * before. The Vue node grows once the browser has laid it out, and node.size follows later if at all: measure the
 * page then, and move the nodes the panel now reaches, as drawPanel does on the canvas. */
function vuePanelGrew(node, st, height) {
  const before = st.vueHeight ?? 0;
  st.vueHeight = height;
  if (height <= before + 1) return;
  const growth = height - before;
  st.pendingGrowth = (st.pendingGrowth ?? 0) + growth; // another node's makeRoom meanwhile: settledHeight
  setTimeout(guard("make room", () => {
    st.pendingGrowth -= growth;
    const now = vueBodyHeight(node);
    if (now == null) return;
    if (node.size[1] < now) node.size[1] = now; // what makeRoom measures the node by
    makeRoom(node, now - growth);
  }), 150);
}

/** A Vue node's height below its title, in canvas units (the page's element holds the title too). */
function vueBodyHeight(node) {
  const el = document.querySelector(`[data-node-id="${CSS.escape(String(node.id))}"]`);
  const scale = app.canvas?.ds?.scale || 1;
  if (!el) return null;
  return el.getBoundingClientRect().height / scale - (window.LiteGraph?.NODE_TITLE_HEIGHT ?? 30);
}

function forEachNode(fn) {
  const seen = new Set();
  const visit = (graph) => {
    if (!graph || seen.has(graph)) return;
    seen.add(graph);
    const nodes = graph.nodes ?? graph._nodes ?? [];
    for (const node of nodes) {
      try { fn(node); } catch (err) { warnOnce("node refresh", err); }
      if (node?.subgraph) visit(node.subgraph);
    }
  };
  visit(app.graph);
}

// ---- per-node state ------------------------------------------------------------------------------

function nodeState(node) {
  if (!node.attention_dispatch) {
    const st = {
      reports: [], promptId: null, summary: null, grown: false, layoutKey: "", layout: null,
      warningKey: "", warningValue: null,
      get backend() { return widgetNamed(node, "backend")?.value ?? null; },
      get policy() { return widgetNamed(node, "policy")?.value ?? null; },
      /** The warning for the chosen backend ({text, lines, strict}) or null; recomputed when it changes. */
      get warning() {
        if (!BACKEND_NODES.has(typeOf(node))) return null;
        const key = `${state.version}|${this.backend}|${this.policy}`;
        if (key !== this.warningKey) {
          this.warningKey = key;
          this.warningValue = selectionWarning(state.index, this.backend, this.policy);
        }
        return this.warningValue;
      },
      get unavailable() { return isUnavailable(state.index, this.backend); },
      get badgeText() {
        if (this.summary) return this.summary.badge;
        const w = this.warning;
        return w ? `\u26a0 ${this.backend} unavailable` : "";
      },
      get badgeLevel() { return this.summary ? this.summary.level : this.warning ? "warn" : "info"; },
    };
    Object.defineProperty(node, "attention_dispatch", { value: st, configurable: true, enumerable: false,
                                                        writable: true });
  }
  return node.attention_dispatch;
}

const COLORS = {
  ok: { bg: "#1f3b24", fg: "#cfeccf", edge: "#3f7a47" },
  warn: { bg: "#4a3a12", fg: "#ffe3a3", edge: "#a07a1c" },
  error: { bg: "#4d1c1c", fg: "#ffd0d0", edge: "#a33a3a", ring: "#ff4d4d" },
  info: { bg: "#2b2f36", fg: "#d5d9e0", edge: "#4b5260" },
};

function addBadge(node, st) {
  const Badge = window.LGraphBadge;
  if (typeof Badge !== "function" || !Array.isArray(node.badges)) return;
  const badge = new Badge({ text: "", fgColor: "#ffffff", bgColor: COLORS.info.edge });
  node.badges.push(() => {
    readTick();
    try {
      badge.text = st.badgeText || "";
      badge.bgColor = (COLORS[st.badgeLevel] ?? COLORS.info).edge;
    } catch (err) {
      badge.text = "";
      warnOnce("badge", err);
    }
    return badge;
  });
}

// ---- the backend combo ---------------------------------------------------------------------------

function protoGetter(obj, name) {
  for (let p = Object.getPrototypeOf(obj); p; p = Object.getPrototypeOf(p)) {
    const d = Object.getOwnPropertyDescriptor(p, name);
    if (d) return d.get ?? null;
  }
  return null;
}

/** Keep the dropdown's list in line with the show/hide setting; the full list is kept on the widget. The widget's
 * own array is changed in place: Nodes 2.0's select holds a copy of the options that refers to that array. */
function applyVisibleValues(w) {
  let cur = w?.options?.values;
  if (!Array.isArray(cur)) return;
  if (!w.__attnFull || cur !== w.__attnShown) { // first time, or replaced: by a copy of what was shown, or by R
    w.__attnFull = fullValues(w.__attnFull, w.__attnShownValues, cur);
    if (w.__attnShown) w.options.values = cur = [...cur]; // a list of this widget's own
  }
  const shown = visibleValues(w.__attnFull, state.index, setting(SETTINGS.showUnavailable, true) !== false, w.value);
  if (shown.length !== cur.length || shown.some((v, i) => v !== cur[i])) cur.splice(0, cur.length, ...shown);
  w.__attnShown = cur;
  w.__attnShownValues = [...cur];
}

function entryValue(el) {
  return typeof el.value === "string" ? el.value : el.dataset?.value;
}

/** Keep the menu inside the window: it scrolls (CSS max-height) and its top moves up when it runs off. */
function fitMenu(root) {
  const r = root.getBoundingClientRect();
  if (r.bottom > window.innerHeight - 4) root.style.top = `${Math.max(4, window.innerHeight - r.height - 4)}px`;
}

function annotateMenu(root) {
  if (!state.index) return;
  root.classList.add("attention-dispatch-menu");
  const entries = [...root.querySelectorAll(".litemenu-entry")].filter((el) => typeof entryValue(el) === "string");
  const groups = menuGroups(state.index, entries.map(entryValue));
  const groupOf = new Map();
  for (const group of groups) for (const value of group.values) groupOf.set(value, group);
  for (const el of entries) {
    const value = entryValue(el);
    const group = groupOf.get(value);
    if (group && group.values[0] === value) { // the group's heading, before its first entry (not clickable)
      const heading = document.createElement("div");
      heading.className = "attention-dispatch-group";
      heading.dataset.group = group.key;
      heading.textContent = group.title;
      el.before(heading);
    }
    const entry = groupedEntry(state.index, value, group?.shared);
    el.textContent = entry.label; // what the entry shows; the click still sends el.value (the real name)
    if (entry.note) {
      const note = document.createElement("span");
      note.className = "attention-dispatch-note";
      note.textContent = entry.note;
      el.append(note);
    }
    if (entry.title) el.title = entry.title;
    el.dataset.attentionDispatch = entry.unavailable ? "unavailable" : "available";
    if (entry.unavailable) el.classList.add("attention-dispatch-unavailable");
  }
  fitMenu(root);
}

function decorateBackendWidget(node, w) {
  if (!w || w.__attnDecorated) return;
  Object.defineProperty(w, "__attnDecorated", { value: true, enumerable: false });
  for (const key of ["__attnFull", "__attnShown"]) {
    Object.defineProperty(w, key, { value: null, writable: true, enumerable: false, configurable: true });
  }

  // The label drawn on the node: "✗ flash" when it cannot run here. Only the display changes.
  const baseDisplay = protoGetter(w, "_displayValue");
  if (baseDisplay) {
    Object.defineProperty(w, "_displayValue", {
      configurable: true, enumerable: false,
      get() {
        const shown = baseDisplay.call(this);
        try {
          return shown && shown === this.value ? displayLabel(state.index, this.value) : shown;
        } catch {
          return shown;
        }
      },
    });
  }

  // Frontends from 1.3x label combo entries through options.getOptionLabel: Nodes 2.0's select shows only that label
  // (no headings, notes or hover), so it carries the mark and the reason; the canvas keeps the short label.
  if (w.options && typeof w.options === "object") {
    if (Array.isArray(w.options.values)) w.options.values = [...w.options.values]; // this widget's own list
    w.options.getOptionLabel = (value) => {
      if (value == null) return "";
      try {
        return vueMode() ? optionLabel(state.index, value) : displayLabel(state.index, value);
      } catch {
        return String(value);
      }
    };
  }

  // Hover on the widget (the frontend reads widget.tooltip when set): the reason and the install command.
  let ownTooltip = Object.prototype.hasOwnProperty.call(w, "tooltip") ? w.tooltip : undefined;
  Object.defineProperty(w, "tooltip", {
    configurable: true, enumerable: false,
    get() {
      try {
        const warning = nodeState(node).warning;
        if (!warning) return ownTooltip;
        const base = ownTooltip ?? baseTooltips.get(typeOf(node)) ?? "";
        return base ? `${warning.text}\n\n${base}` : warning.text;
      } catch {
        return ownTooltip;
      }
    },
    set(v) { ownTooltip = v; },
  });

  // The dropdown: filter per setting, then mark the entries of the menu this click opened.
  const originalClick = w.onClick;
  if (typeof originalClick === "function") {
    Object.defineProperty(w, "onClick", {
      configurable: true, enumerable: false, writable: true,
      value: function onClick(...args) {
        try { applyVisibleValues(this); } catch (err) { warnOnce("combo values", err); }
        let before = null;
        try { before = new Set(document.querySelectorAll(".litecontextmenu")); } catch { /* no DOM */ }
        const result = originalClick.apply(this, args);
        if (before) {
          try {
            for (const menu of document.querySelectorAll(".litecontextmenu")) if (!before.has(menu)) annotateMenu(menu);
          } catch (err) {
            warnOnce("menu marks", err);
          }
        }
        return result;
      },
    });
  }

  const originalCallback = w.callback;
  w.callback = function callback(...args) {
    const r = typeof originalCallback === "function" ? originalCallback.apply(this, args) : undefined;
    refreshNode(node);
    return r;
  };
}

/** The frontend sizes a node to computeSize() (a widget change, a reload): keep room for the panel there too, or
 * the "Last run" text would be cut off. On the node itself: the frontend's node class defines its own. */
function keepRoomForPanel(node, st) {
  const original = node.computeSize;
  if (typeof original !== "function") return;
  node.computeSize = function computeSize(...args) {
    const size = original.apply(this, args);
    try {
      if (size?.length >= 2 && st.layout && st.need && panelBlocks(st).length) { // an array or a Float32Array
        size[1] = Math.max(size[1], widgetsBottom(this) + 2 + st.need); // where drawPanel puts it
      }
    } catch (err) {
      warnOnce("computeSize", err);
    }
    return size;
  };
}

function setupNode(node, { fresh }) {
  const type = typeOf(node);
  if (!REPORT_NODES.has(type)) return;
  const st = nodeState(node);
  if (st.setUp) return;
  st.setUp = true;
  addBadge(node, st);
  keepRoomForPanel(node, st);
  addPanelWidget(node, st);
  if (!BACKEND_NODES.has(type)) return;
  const w = widgetNamed(node, "backend");
  decorateBackendWidget(node, w);
  applyVisibleValues(w);
  if (fresh) {
    const policy = setting(SETTINGS.policy, "fallback");
    const pw = widgetNamed(node, "policy");
    const values = pw?.options?.values;
    if (pw && POLICIES.includes(policy) && (!Array.isArray(values) || values.includes(policy))) pw.value = policy;
  }
}

function refreshAll() {
  if (!app.graph) return;
  forEachNode((node) => {
    if (!REPORT_NODES.has(typeOf(node))) return;
    if (BACKEND_NODES.has(typeOf(node))) applyVisibleValues(widgetNamed(node, "backend"));
    redrawPanelWidget(node);
  });
  bumpTick();
  redraw();
}

// ---- the panel under the widgets -------------------------------------------------------------------

const FONT_PX = 12;
const BADGE_ROW = 24; // an LGraphBadge (20 px) and the 2 px gaps around it
const LINE_H = 15;
const PAD = 6;
const RING_X = 11; // a refused widget's ring, just outside LiteGraph's widget margin (15 px)

function widgetsBottom(node) {
  let bottom = 0;
  for (const w of node.widgets ?? []) {
    if (!w || w.name === PANEL_WIDGET || (node.isWidgetVisible && !node.isWidgetVisible(w))) continue;
    const y = Number.isFinite(w.y) ? w.y : Number.isFinite(w.last_y) ? w.last_y : null;
    if (y == null) continue;
    const h = Number.isFinite(w.computedHeight) ? w.computedHeight : (window.LiteGraph?.NODE_WIDGET_HEIGHT ?? 20) + 4;
    bottom = Math.max(bottom, y + h);
  }
  return bottom;
}

function panelBlocks(st) {
  const blocks = [];
  const { warning, summary } = st;
  // After a run of the chosen backend the report already says why it fell back: keep its install hint.
  const reported = !!summary && !!summary.requested && summary.requested === st.backend;
  if (st.refused) blocks.push({ text: ["\u2717 Refused at queue time:", ...st.refused].join("\n"), level: "error" });
  // A refusal already says why the backend cannot run: the warning would repeat it.
  if (warning && !reported && !st.refused) blocks.push({ text: warning.text, level: warning.strict ? "error" : "warn" });
  if (summary) {
    const lines = ["Last run:", ...summary.lines];
    if (warning && reported) {
      lines.push(...warning.hints.map((h) => `Install: ${h}`));
      if (warning.strict) lines.push(warning.policyLine);
    }
    blocks.push({ text: lines.join("\n"), level: warning?.strict && reported ? "error" : summary.level });
  }
  return blocks;
}

/**
 * The panel made `node` taller: move the nodes it now reaches (below it, overlapping it across) down, and those
 * they reach in turn, so a panel never draws over another node. Nodes that overlapped it before are left alone.
 */
function makeRoom(node, heightBefore) {
  const graph = node.graph;
  const nodes = graph?._nodes ?? graph?.nodes ?? [];
  const title = window.LiteGraph?.NODE_TITLE_HEIGHT ?? 30;
  const gap = 12;
  const queue = [[node, node.pos[1] + heightBefore]];
  for (let guard = 0; queue.length && guard < 500; guard++) {
    const [a, bottomBefore] = queue.shift();
    const bottom = a.pos[1] + heightOf(a);
    for (const b of nodes) {
      if (!b || b === a || b === node || !b.pos || !b.size) continue;
      if (b.pos[0] + b.size[0] <= a.pos[0] || b.pos[0] >= a.pos[0] + a.size[0]) continue; // not across from it
      const top = b.pos[1] - (b.flags?.collapsed ? 0 : title);
      // Its badges are drawn in a row above its title (LGraphNode.drawBadges): that row must clear the panel too.
      const badgeTop = top - BADGE_ROW;
      if (top < bottomBefore - 1 || badgeTop >= bottom + gap) continue; // above it before, or still clear of it
      const heightB = settledHeight(b);
      const shift = bottom + gap - badgeTop;
      b.pos = [b.pos[0], b.pos[1] + shift]; // through the setter: Nodes 2.0 moves its Vue node from there
      queue.push([b, b.pos[1] - shift + heightB]);
    }
  }
}

/** A node's height below its title: Nodes 2.0's page element is the truth there (node.size lags it). */
function heightOf(node) {
  return (vueMode() ? vueBodyHeight(node) : null) ?? node.size[1];
}

/** Its height before a growth of its panel that has not made room yet: where its bottom was, for the nodes below
 * it (a node it now reaches only because it grew is below it, not one that overlapped it before). */
function settledHeight(node) {
  return heightOf(node) - (node.attention_dispatch?.pendingGrowth ?? 0);
}

function roundRect(ctx, x, y, w, h, r) {
  ctx.beginPath();
  if (ctx.roundRect) ctx.roundRect(x, y, w, h, r);
  else ctx.rect(x, y, w, h);
}

function drawPanel(node, ctx, canvas) {
  if (node.flags?.collapsed || !node.attention_dispatch) return;
  const st = node.attention_dispatch;
  const blocks = panelBlocks(st);
  const top = widgetsBottom(node) + 2;
  if (!blocks.length) {
    if (st.grown) {
      st.grown = false;
      const min = node.computeSize?.()?.[1];
      if (Number.isFinite(min) && min < node.size[1]) node.setSize?.([node.size[0], Math.max(min, top)]);
    }
    return;
  }
  ctx.save();
  try {
    const need = layoutBlocks(st, blocks, node.size[0], ctx);
    if (node.size[1] < top + need) {
      const before = node.size[1];
      node.setSize?.([node.size[0], top + need]);
      st.grown = true;
      makeRoom(node, before);
      redraw(node);
    }
    drawBlocks(ctx, st.layout, top, node.size[0], !!canvas?.low_quality);
  } finally {
    ctx.restore();
  }
}

/** The classic canvas marks a widget at fault only by a red ring on its input slot, drawn while the mouse is over
 * the widget: ring the widgets a refusal names (Nodes 2.0 marks them itself: aria-invalid, a bold red label). */
function drawRefusedRings(node, ctx) {
  const st = node.attention_dispatch;
  st.rings = [];
  if (node.flags?.collapsed || !st.refused || !st.refusedInputs?.length) return;
  ctx.save();
  try {
    ctx.strokeStyle = COLORS.error.ring;
    ctx.lineWidth = 2;
    for (const name of st.refusedInputs) {
      const w = widgetNamed(node, name);
      if (!w || !Number.isFinite(w.y) || (node.isWidgetVisible && !node.isWidgetVisible(w))) continue;
      const h = window.LiteGraph?.NODE_WIDGET_HEIGHT ?? 20;
      const ring = [RING_X, w.y - 2, node.size[0] - 2 * RING_X, h + 4];
      roundRect(ctx, ...ring, h / 2 + 2);
      ctx.stroke();
      st.rings.push({ name, ring });
    }
  } finally {
    ctx.restore();
  }
}

/** Wrap the blocks' text to a panel `nodeWidth` wide (cached on the node's state); the height they need. */
function layoutBlocks(st, blocks, nodeWidth, ctx) {
  const width = Math.max(40, nodeWidth - 4 * PAD);
  ctx.font = `${FONT_PX}px sans-serif`;
  const key = `${width}|${blocks.map((b) => `${b.level}:${b.text}`).join("\u0001")}`;
  if (key !== st.layoutKey) {
    st.layoutKey = key;
    st.layout = blocks.map((b) => ({ ...b, lines: wrapText(b.text, width, (s) => ctx.measureText(s).width) }));
  }
  st.need = st.layout.reduce((h, b) => h + b.lines.length * LINE_H + 2 * PAD + PAD, 0);
  return st.need;
}

function drawBlocks(ctx, layout, top, nodeWidth, lowQuality) {
  ctx.font = `${FONT_PX}px sans-serif`;
  let y = top;
  for (const block of layout) {
    const c = COLORS[block.level] ?? COLORS.info;
    const h = block.lines.length * LINE_H + 2 * PAD;
    roundRect(ctx, PAD, y, nodeWidth - 2 * PAD, h, 4);
    ctx.fillStyle = c.bg;
    ctx.fill();
    ctx.strokeStyle = c.edge;
    ctx.lineWidth = 1;
    ctx.stroke();
    if (!lowQuality) {
      ctx.fillStyle = c.fg;
      ctx.textAlign = "left";
      ctx.textBaseline = "top";
      block.lines.forEach((line, i) => ctx.fillText(line, 2 * PAD, y + PAD + i * LINE_H + 1));
    }
    y += h + PAD;
  }
}

// Nodes 2.0 draws no node on the canvas, so the panel is also a widget of its own: the frontend renders a widget that
// has draw() on a canvas of its own inside the Vue node (WidgetLegacy), as tall as computeSize() says. On the canvas
// (classic nodes) it takes no room and draws nothing: drawPanel draws the panel there, under the real widgets.
let measureCtx = null;

function measuringContext() {
  measureCtx ??= document.createElement("canvas").getContext("2d");
  return measureCtx;
}

function vuePanelHeight(node, st, width) {
  const blocks = panelBlocks(st);
  return blocks.length ? layoutBlocks(st, blocks, width, measuringContext()) : 0;
}

function addPanelWidget(node, st) {
  if (typeof node.addCustomWidget !== "function" || panelWidgetOf(node)) return;
  node.addCustomWidget({
    name: PANEL_WIDGET,
    type: PANEL_WIDGET,
    value: "",
    serialize: false, // not in the saved workflow's widgets_values
    // nor in the prompt; drawn in Nodes 2.0 (canvasOnly false), not listed as a parameter in the properties panel
    // (1.53+: hideInPanel)
    options: { serialize: false, canvasOnly: false, hideInPanel: true },
    computeSize(width) {
      if (!vueMode()) return [0, -4]; // LiteGraph's "takes no room" (it adds 4 px of margin per widget)
      try {
        const height = vuePanelHeight(node, st, st.vueWidth ?? (Number.isFinite(width) ? width : node.size[0]));
        vuePanelGrew(node, st, height);
        return [width, height];
      } catch (err) {
        warnOnce("panel size", err);
        return [width, 0];
      }
    },
    draw(ctx, _node, width, y, height) {
      if (!vueMode()) return;
      try {
        // The frontend's canvas for this widget is as wide as its box, with a bitmap `width` wide; 1.53 passes the
        // box's width on screen (the canvas zoom applied), so the browser stretched the bitmap back to the box,
        // height too, over the badge row. Hold the canvas to the height laid out, and draw at the box's width.
        const el = ctx.canvas;
        const box = el?.parentElement?.clientWidth || width;
        if (el?.style && Number.isFinite(height)) el.style.height = `${height + 2}px`;
        const blocks = panelBlocks(st);
        if (!blocks.length) return;
        ctx.save();
        ctx.scale(width / box, 1);
        st.vueWidth = box;
        const need = layoutBlocks(st, blocks, box, ctx);
        drawBlocks(ctx, st.layout, y, box, false);
        ctx.restore();
        fitPanelWidget(node, st, need);
      } catch (err) {
        warnOnce("panel widget", err);
      }
    },
  });
}

/** The panel drawn at its box's width needs `need` px: when the height the frontend laid out differs (it was
 * computed for another width), lay it out again at that height. */
function fitPanelWidget(node, st, need) {
  const w = panelWidgetOf(node);
  if (!w || Math.abs((w.computedHeight ?? 0) - need) <= 1) return;
  w.computedHeight = need;
  vuePanelGrew(node, st, need);
  requestAnimationFrame(() => w.triggerDraw?.());
}

function panelWidgetOf(node) {
  return widgetNamed(node, PANEL_WIDGET);
}

// ---- messages ----------------------------------------------------------------------------------------

function onReport(report) {
  if (!report || typeof report !== "object" || report.node == null) return;
  const node = resolveNode(app.graph, report.node);
  if (!node || !REPORT_NODES.has(typeOf(node))) return;
  const st = nodeState(node);
  if (st.promptId !== report.prompt_id || report.prompt_id == null) {
    st.reports = [];
    st.promptId = report.prompt_id ?? null;
  }
  st.reports.push(report);
  st.report = mergeReports(st.reports);
  st.summary = summarizeReport(st.report);
  refreshNode(node);
  if (setting(SETTINGS.toast, true) !== false) {
    const toast = fallbackToast(report, node.title);
    const t = app.extensionManager?.toast;
    if (toast && t?.add) t.add({ severity: "warn", summary: toast.summary, detail: toast.detail, life: 8000 });
  }
}

function onExecuted(detail) {
  if (!detail || detail.node == null) return;
  const node = resolveNode(app.graph, detail.node);
  if (!node || !TEXT_NODES.has(typeOf(node))) return;
  const st = nodeState(node);
  if (st.promptId === detail.prompt_id && st.reports.length) return; // a real report came for this prompt
  const texts = detail.output?.text;
  const summary = typeOf(node) === "TrustRemoteKernels" ? summarizeTrustText(texts) : summarizeClipText(texts);
  if (!summary) return;
  st.reports = [];
  st.promptId = detail.prompt_id ?? null;
  st.summary = summary;
  refreshNode(node);
}

// ---- the sampler after tuning's progress text -------------------------------------------------------------------

// The frontend shows progress text in a widget it adds to the node (the sampler, while auto tunes) and removes when
// the run ends, without giving the node back the height the widget took (1.58 classic: 45 px blank). The server
// names the node before its first text (attention_dispatch.tuning); its height then is kept here until the text is
// gone, and given back.
const TEXT_PREVIEW_WIDGET = "$$node-text-preview";
const heightsBeforeText = new Map(); // node -> its height before the text

function onTuning(detail) {
  const node = detail?.node == null ? null : resolveNode(app.graph, detail.node);
  if (!node || heightsBeforeText.has(node) || widgetNamed(node, TEXT_PREVIEW_WIDGET)) return;
  heightsBeforeText.set(node, node.size[1]);
}

/** After a run: once the frontend has removed the text (it does when the run's job resets), the height back. */
function giveBackHeights() {
  const started = performance.now();
  const check = guard("text height", () => {
    for (const [node, before] of heightsBeforeText) {
      if (widgetNamed(node, TEXT_PREVIEW_WIDGET)) continue;
      heightsBeforeText.delete(node);
      const fits = Math.max(before, node.computeSize?.()?.[1] ?? before);
      if (node.size?.[1] > fits + 1) {
        node.setSize?.([node.size[0], fits]);
        redraw(node);
      }
    }
    if (heightsBeforeText.size && performance.now() - started < 5000) setTimeout(check, 100);
  });
  setTimeout(check, 0);
}

// ---- a refused prompt ----------------------------------------------------------------------------------

/** The names an error of node `id` can be about: its inputs (slots) and widgets. */
function inputNamesOf(id) {
  const node = resolveNode(app.graph, id);
  if (!node) return [];
  const names = [...(node.inputs ?? []), ...(node.widgets ?? [])].map((x) => x?.name);
  return [...new Set(names.filter((n) => typeof n === "string" && n && n !== PANEL_WIDGET))];
}

/** Each node's panel says why the last queueing refused it, and the classic canvas rings the widgets at fault,
 * until the next queueing. */
function showRefusals(nodeErrors) {
  forEachNode((node) => {
    if (!REPORT_NODES.has(typeOf(node))) return;
    const st = nodeState(node);
    const entry = nodeErrors && typeof nodeErrors === "object" ? nodeErrors[String(node.id)] : null;
    const { lines, inputs } = refusalLines(entry?.errors);
    if (!lines.length && !st.refused) return;
    st.refused = lines.length ? lines : null;
    st.refusedInputs = lines.length ? inputs : [];
    refreshNode(node);
  });
}

/** api.queuePrompt, with the pack's queue-time errors moved onto the inputs at fault (./node_errors.js) before the
 * frontend reads them: it rings those widgets and its toast quotes the pack's sentence for each. */
function placeQueueErrors() {
  const original = api.queuePrompt;
  if (typeof original !== "function" || original.__attentionDispatch) return;
  const place = (response) => { // a refusal (HTTP 400), or a prompt queued with some outputs refused (HTTP 200)
    try {
      if (response?.node_errors && typeof response.node_errors === "object") {
        response.node_errors = placeNodeErrors(response.node_errors, VALIDATED_NODES, inputNamesOf);
      }
      showRefusals(response?.node_errors);
    } catch (err) {
      warnOnce("queue errors", err);
    }
  };
  const wrapped = async function queuePrompt(...args) {
    let result;
    try {
      result = await original.apply(this, args);
    } catch (err) {
      place(err?.response);
      throw err;
    }
    place(result);
    return result;
  };
  wrapped.__attentionDispatch = true;
  api.queuePrompt = wrapped;
}

function loadBackends() {
  if (state.loading) return state.loading;
  state.loading = (async () => {
    try {
      const res = await api.fetchApi("/attention_dispatch/backends", { cache: "no-store" });
      if (!res.ok) throw new Error(`HTTP ${res.status}`);
      const payload = await res.json();
      state.index = indexBackends(payload);
      state.machine = payload?.machine ?? null;
    } catch (err) {
      state.error = String(err?.message ?? err);
      warnOnce("GET /attention_dispatch/backends", err);
    }
    state.version++;
    refreshAll();
    return state;
  })();
  return state.loading;
}

const STYLE = `
.litecontextmenu.attention-dispatch-menu { max-height: calc(100vh - 8px); overflow-y: auto; }
.litecontextmenu .attention-dispatch-group {
  font-size: 0.78em; opacity: 0.85; padding: 6px 8px 2px; max-width: 36em; white-space: normal; line-height: 1.2;
  border-top: 1px solid rgba(255, 255, 255, 0.15); pointer-events: none; color: #c9d1d9;
}
.litecontextmenu .attention-dispatch-group[data-group="picks"] { border-top: none; }
.litecontextmenu .litemenu-entry.attention-dispatch-unavailable { opacity: 0.72; }
.litecontextmenu .litemenu-entry .attention-dispatch-note {
  display: block; font-size: 0.78em; opacity: 0.8; max-width: 28em; white-space: normal; line-height: 1.2;
  padding-left: 1.2em;
}
.litecontextmenu .litemenu-entry.attention-dispatch-unavailable .attention-dispatch-note { color: #f3b36b; }
`;

function addStyle() {
  if (document.getElementById("attention-dispatch-style")) return;
  const el = document.createElement("style");
  el.id = "attention-dispatch-style";
  el.textContent = STYLE;
  document.head.append(el);
}

const extension = {
  name: EXTENSION,
  settings: [
    {
      id: SETTINGS.policy,
      category: ["Attention Dispatch", "Nodes", "Default policy"],
      name: "Default policy of new Set Attention Backend nodes",
      tooltip: "fallback: calls the chosen backend cannot run go to the next backend of its chain (the node says " +
        "which and why after the run). strict: such a prompt is rejected.",
      type: "combo",
      options: POLICIES,
      defaultValue: "fallback",
    },
    {
      id: SETTINGS.showUnavailable,
      category: ["Attention Dispatch", "Nodes", "Show unavailable backends"],
      name: "List backends that cannot run on this machine in the backend dropdown",
      tooltip: "On: they are listed, marked \u2717 with the reason. Off: they are hidden (a node's current value " +
        "stays listed).",
      type: "boolean",
      defaultValue: true,
      onChange: guard("setting change", () => refreshAll()),
    },
    {
      id: SETTINGS.toast,
      category: ["Attention Dispatch", "Nodes", "Fallback notification"],
      name: "Show a notification when attention calls fell back to another backend",
      type: "boolean",
      defaultValue: true,
    },
  ],

  /** For tests and other extensions: the backend list as the page loaded it. */
  attentionDispatch: { state, loadBackends, SETTINGS },

  setup: guard("setup", () => {
    addStyle();
    api.addEventListener(EVENT, guard("report", (e) => onReport(e.detail)));
    api.addEventListener("executed", guard("executed", (e) => onExecuted(e.detail)));
    api.addEventListener("attention_dispatch.tuning", guard("tuning", (e) => onTuning(e.detail)));
    for (const end of ["execution_success", "execution_error", "execution_interrupted"]) {
      api.addEventListener(end, guard("run end", () => giveBackHeights()));
    }
    placeQueueErrors();
    loadBackends();
  }),

  beforeRegisterNodeDef: guard("beforeRegisterNodeDef", (nodeType, nodeData) => {
    if (!REPORT_NODES.has(nodeData?.name)) return;
    const tooltip = nodeData?.input?.required?.backend?.[1]?.tooltip;
    if (tooltip) baseTooltips.set(nodeData.name, tooltip);
    const proto = nodeType.prototype;
    const originalDraw = proto.onDrawForeground;
    proto.onDrawForeground = function onDrawForeground(ctx, canvas, ...rest) {
      const r = typeof originalDraw === "function" ? originalDraw.call(this, ctx, canvas, ...rest) : undefined;
      try {
        drawPanel(this, ctx, canvas);
        if (this.attention_dispatch) drawRefusedRings(this, ctx);
      } catch (err) {
        warnOnce("draw", err);
      }
      return r;
    };
  }),

  nodeCreated: guard("nodeCreated", (node) => {
    // configure() of a loaded/pasted node runs after this and restores its saved widget values.
    setupNode(node, { fresh: true });
  }),
};

// ComfyUI may serve this folder twice (WEB_DIRECTORY under the clone's folder name and pyproject's
// [tool.comfy] web under the project name): the first copy registers, a second one does nothing.
const LOADED = Symbol.for("attention_dispatch.web.loaded");
if (window[LOADED]) {
  console.info(`[attention dispatch] already loaded from ${window[LOADED]}; skipping ${import.meta.url}`);
} else {
  window[LOADED] = import.meta.url;
  app.registerExtension(extension);
}


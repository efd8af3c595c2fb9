// Unit tests of web/format.js (the pure formatting of the web extension): `node --test tests/js/`.
import assert from "node:assert/strict";
import { describe, test } from "node:test";

import {
  ALWAYS_AVAILABLE, attentionTimeMs, displayLabel, fallbackTarget, fallbackToast, formatMs, indexBackends,
  groupedEntry, isUnavailable, menuEntry, menuGroups, mergeReports, parseExecutionId, reasonText, resolveNode, selectionWarning, splitReason,
  statusOf, summarizeClipText, summarizeReport, visibleValues, wrapText, fullValues,
} from "../../web/format.js";

// Rows as GET /attention_dispatch/backends returns them on a CPU machine (trimmed to the fields used).
const PAYLOAD = {
  machine: { device_type: "cpu", device_name: "cpu" },
  backends: [
    { name: "native", available: true, reasons: [], fallback: ["_native_math"],
      description: "torch SDPA: PyTorch picks its best kernel (cuDNN/flash/efficient/math)" },
    { name: "_native_flash", available: true, reasons: [], fallback: ["native"], description: "torch SDPA flash" },
    { name: "_native_math", available: true, reasons: [], fallback: [], description: "torch SDPA math kernel" },
    { name: "_native_cudnn", available: false, reasons: ["needs an NVIDIA CUDA GPU; this machine has a CPU"],
      fallback: ["native"], description: "torch SDPA cuDNN kernel (NVIDIA, sm_80+)" },
    { name: "flash", available: false, fallback: ["_flash_3", "_native_flash"],
      reasons: ["flash-attn is not installed: pip install 'flash-attn>=2.6.3' --no-build-isolation",
                "needs an NVIDIA CUDA GPU; this machine has a CPU"],
      description: "FlashAttention-2 (pip flash-attn)" },
    { name: "_flash_3", available: false, fallback: ["flash"],
      reasons: ["flash-attn-3 is not installed: build FlashAttention-3 from source (the hopper/ folder of " +
                "flash-attention: python setup.py install)"], description: "FlashAttention-3" },
    { name: "sage_hub", available: false, fallback: ["sage"],
      reasons: ["kernels is not installed: pip install 'kernels>=0.12'",
                "'thu-ml/sage-attention' is not published by a trusted kernel publisher, so loading it downloads " +
                "and runs remote code; set DIFFUSERS_TRUST_REMOTE_KERNELS=true or allow 'thu-ml' in a Trust " +
                "Remote Kernels node (dispatcher.trusted_publishers(['thu-ml'])) to load it"],
      description: "SageAttention 2 from the Hub" },
    { name: "sage", available: false, fallback: ["sage_hub"],
      reasons: ["sageattention is not installed: pip install 'sageattention>=2.1.1'"], description: "SageAttention" },
  ],
};
const INDEX = indexBackends(PAYLOAD);
const VALUES = ["auto", "comfy default", "native", "_native_flash", "_native_cudnn", "flash", "sage_hub"];

function modelReport(rows, extra = {}) {
  return { kind: "model", node: "10", prompt_id: "p1", backend: rows[0]?.requested ?? "native", policy: "fallback",
           recorder: { label: "x", calls: rows.reduce((a, r) => a + r.calls, 0), rows, errors: [] }, ...extra };
}

describe("reasons and the backend index", () => {
  test("splitReason separates the install command", () => {
    assert.deepEqual(splitReason("flash-attn is not installed: pip install 'flash-attn>=2.6.3' --no-build-isolation"),
      { why: "flash-attn is not installed", hint: "pip install 'flash-attn>=2.6.3' --no-build-isolation" });
    assert.deepEqual(splitReason("needs an NVIDIA CUDA GPU; this machine has a CPU"),
      { why: "needs an NVIDIA CUDA GPU; this machine has a CPU", hint: "" });
    const built = splitReason(PAYLOAD.backends[5].reasons[0]);
    assert.equal(built.why, "flash-attn-3 is not installed");
    assert.match(built.hint, /^build FlashAttention-3 from source/);
    const trust = splitReason(PAYLOAD.backends[6].reasons[1]);
    assert.match(trust.why, /not published by a trusted kernel publisher, so loading it downloads and runs remote code$/);
    assert.match(trust.hint, /^set DIFFUSERS_TRUST_REMOTE_KERNELS=true or allow 'thu-ml'/);
    assert.deepEqual(splitReason(undefined), { why: "", hint: "" });
  });

  test("indexBackends keeps every row with reasons, hints and fallback; bad input gives an empty map", () => {
    assert.equal(INDEX.size, PAYLOAD.backends.length);
    const flash = INDEX.get("flash");
    assert.equal(flash.available, false);
    assert.deepEqual(flash.why, ["flash-attn is not installed", "needs an NVIDIA CUDA GPU; this machine has a CPU"]);
    assert.deepEqual(flash.hints, ["pip install 'flash-attn>=2.6.3' --no-build-isolation"]);
    assert.deepEqual(flash.fallback, ["_flash_3", "_native_flash"]);
    assert.equal(INDEX.get("sage_hub").hints.length, 2);
    for (const bad of [null, undefined, 7, {}, { backends: "x" }, { backends: [null, { name: 3 }] }]) {
      assert.equal(indexBackends(bad).size, 0);
    }
  });

  test("auto and comfy default always run; unknown or unloaded values are not marked", () => {
    for (const v of ALWAYS_AVAILABLE) assert.equal(statusOf(INDEX, v), null);
    assert.equal(isUnavailable(INDEX, "auto"), false);
    assert.equal(isUnavailable(INDEX, "no-such-backend"), false);
    assert.equal(isUnavailable(null, "flash"), false);
    assert.equal(isUnavailable(INDEX, "flash"), true);
    assert.equal(isUnavailable(INDEX, "native"), false);
  });
});

describe("the dropdown", () => {
  test("menuEntry marks unavailable backends with the reason beside and the install command on hover", () => {
    const e = menuEntry(INDEX, "flash");
    assert.equal(e.value, "flash"); // the value sent to the server stays the real name
    assert.equal(e.label, "\u2717 flash");
    assert.equal(e.unavailable, true);
    assert.equal(e.note, "flash-attn is not installed; needs an NVIDIA CUDA GPU; this machine has a CPU");
    assert.match(e.title, /^flash cannot run here: flash-attn is not installed/);
    assert.match(e.title, /\nInstall: pip install 'flash-attn>=2\.6\.3' --no-build-isolation/);
    const ok = menuEntry(INDEX, "native");
    assert.equal(ok.label, "\u2713 native");
    assert.equal(ok.unavailable, false);
    assert.equal(ok.note, "");
    const auto = menuEntry(INDEX, "auto");
    assert.equal(auto.label, "auto");
    assert.equal(auto.unavailable, false);
    assert.match(auto.note, /best available/);
    assert.equal(menuEntry(null, "flash").unavailable, false);
  });

  test("displayLabel prefixes the node's label only", () => {
    assert.equal(displayLabel(INDEX, "flash"), "\u2717 flash");
    assert.equal(displayLabel(INDEX, "native"), "native");
    assert.equal(displayLabel(null, "flash"), "flash");
  });

  test("visibleValues hides unavailable backends but keeps the current value and auto", () => {
    assert.equal(visibleValues(VALUES, INDEX, true, "auto"), VALUES); // same array: nothing to restore
    assert.deepEqual(visibleValues(VALUES, INDEX, false, "auto"), ["auto", "comfy default", "native", "_native_flash"]);
    assert.deepEqual(visibleValues(VALUES, INDEX, false, "flash"),
      ["auto", "comfy default", "native", "_native_flash", "flash"]);
    assert.equal(visibleValues(VALUES, null, false, "auto"), VALUES); // list not loaded: show all
    assert.equal(visibleValues("x", INDEX, false, "auto"), "x");
  });

  test("fullValues keeps the full list when the frontend copies the filtered one, and takes a refreshed one", () => {
    const shown = visibleValues(VALUES, INDEX, false, "auto");
    // frontend 1.53.6 puts a copy of the shown (filtered) values in a new array when a setting changes: hidden
    // backends came back only after a reload
    assert.deepEqual(fullValues(VALUES, shown, [...shown]), VALUES);
    assert.deepEqual(fullValues(VALUES, shown, ["auto", "native", "new_kernel"]), ["auto", "native", "new_kernel"]);
    assert.deepEqual(fullValues(undefined, undefined, VALUES), VALUES); // the first time: the widget's own list
    assert.notEqual(fullValues(undefined, undefined, VALUES), VALUES); // a copy, never the widget's array
  });
});

describe("the warning before queueing", () => {
  test("fallbackTarget walks the chain to the first available backend and survives cycles", () => {
    assert.equal(fallbackTarget(INDEX, "flash"), "_native_flash");
    assert.equal(fallbackTarget(INDEX, "_native_cudnn"), "native");
    assert.equal(fallbackTarget(INDEX, "sage"), null); // sage -> sage_hub -> sage
    assert.equal(fallbackTarget(INDEX, "missing"), null);
  });

  test("selectionWarning says why, how to install, and what the policy does", () => {
    assert.equal(selectionWarning(INDEX, "native", "fallback"), null);
    assert.equal(selectionWarning(INDEX, "auto", "strict"), null);
    assert.equal(selectionWarning(null, "flash", "strict"), null);
    const w = selectionWarning(INDEX, "flash", "fallback");
    assert.equal(w.strict, false);
    assert.equal(w.lines[0], "\u26a0 flash cannot run here: flash-attn is not installed; needs an NVIDIA CUDA GPU; " +
      "this machine has a CPU.");
    assert.equal(w.lines[1], "Install: pip install 'flash-attn>=2.6.3' --no-build-isolation");
    assert.match(w.policyLine, /^Policy fallback: calls will fall back \(here to _native_flash\)/);
    assert.deepEqual(w.hints, ["pip install 'flash-attn>=2.6.3' --no-build-isolation"]);
    assert.equal(w.text, w.lines.join("\n"));
    const s = selectionWarning(INDEX, "sage", "strict");
    assert.equal(s.strict, true);
    assert.equal(s.policyLine, "Policy strict: the prompt will be rejected.");
    assert.match(selectionWarning(INDEX, "sage", "fallback").policyLine, /^Policy fallback: calls will fall back;/);
  });
});

describe("the report badge", () => {
  test("a clean run: backend, calls per site, ok badge", () => {
    const s = summarizeReport(modelReport([
      { site: "cross", requested: "native", served: "native", calls: 4, fell_back: false, reasons: [] },
      { site: "self", requested: "native", served: "native", calls: 4, fell_back: false, reasons: [] },
    ]));
    assert.equal(s.level, "ok");
    assert.equal(s.calls, 8);
    assert.deepEqual(s.served, { native: 8 });
    assert.equal(s.badge, "\u2713 native \u00b7 8 calls");
    assert.deepEqual(s.lines, ["Ran: native \u2014 8 calls (cross 4, self 4)"]);
    assert.equal(s.timeMs, null);
  });

  test("a fallback: what ran instead and why, without the backend prefix or the install command", () => {
    const reasons = ["flash: flash-attn is not installed: pip install 'flash-attn>=2.6.3' --no-build-isolation",
                     "flash: needs an NVIDIA CUDA GPU; this machine has a CPU"];
    const s = summarizeReport(modelReport([
      { site: "cross", requested: "flash", served: "_native_flash", calls: 4, fell_back: true, reasons },
      { site: "self", requested: "flash", served: "_native_flash", calls: 4, fell_back: true, reasons },
    ]));
    assert.equal(s.level, "warn");
    assert.equal(s.badge, "\u26a0 _native_flash \u00b7 8 calls");
    assert.equal(s.requested, "flash");
    assert.equal(s.fallbacks.length, 1);
    assert.deepEqual(s.fallbacks[0].reasons, reasons);
    assert.equal(s.lines[1], "\u26a0 Fell back: flash \u2192 _native_flash for 8 calls: flash-attn is not installed; " +
      "needs an NVIDIA CUDA GPU; this machine has a CPU");
  });

  test("several served backends, errors and no calls", () => {
    const s = summarizeReport(modelReport([
      { site: "self", requested: "flex", served: "flex", calls: 8, fell_back: false, reasons: [] },
      { site: "self", requested: "flex", served: "comfy:attention_sub_quad", calls: 8, fell_back: true,
        reasons: ["outside the step window"] },
    ]));
    assert.equal(s.badge, "\u26a0 flex 8 \u00b7 comfy:attention_sub_quad 8"); // who served how many, not "flex +1"
    const three = summarizeReport(modelReport([
      { site: "self", requested: "auto_exact", served: "native", calls: 6, fell_back: false, reasons: [] },
      { site: "cross", requested: "auto_exact", served: "_native_math", calls: 4, fell_back: false, reasons: [] },
      { site: "self #3", requested: "auto_exact", served: "flex", calls: 2, fell_back: false, reasons: [] },
    ]));
    assert.equal(three.badge, "\u2713 3 kernels \u00b7 12 calls");
    const two = summarizeReport(modelReport([
      { site: "self", requested: "auto_exact", served: "native", calls: 4, fell_back: false, reasons: [] },
      { site: "cross", requested: "auto_exact", served: "_native_math", calls: 4, fell_back: false, reasons: [] },
    ]));
    assert.equal(two.badge, "\u2713 native 4 \u00b7 _native_math 4");
    assert.deepEqual(two.served, { native: 4, _native_math: 4 });
    const err = modelReport([{ site: "self", requested: "x", served: "native", calls: 1, fell_back: true, reasons: [] }]);
    err.recorder.errors = [{ site: "self", backend: "x", error: "RuntimeError: boom" }];
    const e = summarizeReport(err);
    assert.equal(e.level, "error");
    assert.ok(e.lines.includes("\u2717 x failed at self: RuntimeError: boom"));
    const none = summarizeReport(modelReport([], { backend: "sage" }));
    assert.equal(none.level, "info");
    assert.equal(none.badge, "no attention calls");
    assert.deepEqual(none.lines, ["No attention calls recorded (asked for sage)."]);
    assert.equal(summarizeReport(null), null);
    assert.equal(summarizeReport("x"), null);
  });

  test("time in attention when the report measured it", () => {
    const rows = [{ site: "self", requested: "native", served: "native", calls: 4, fell_back: false, reasons: [] }];
    const r1 = modelReport(rows);
    r1.recorder.attention_ms = 12.5;
    assert.equal(attentionTimeMs(r1), 12.5);
    const s1 = summarizeReport(r1);
    assert.ok(s1.lines.includes("Time in attention: 12.5 ms"));
    assert.match(s1.badge, /\u00b7 12\.5 ms$/);
    const r2 = modelReport([{ ...rows[0], seconds: 1.5 }, { ...rows[0], site: "cross", seconds: 0.5 }]);
    assert.equal(attentionTimeMs(r2), 2000);
    assert.equal(attentionTimeMs(modelReport(rows, { time_s: 0.25 })), 250);
    assert.equal(formatMs(3.14159), "3.14 ms");
    assert.equal(formatMs(25), "25.0 ms");
    assert.equal(formatMs(250), "250 ms");
    assert.equal(formatMs(2000), "2.00 s");
    assert.equal(formatMs(12345), "12.3 s");
    assert.equal(formatMs(NaN), "");
  });

  test("Attention Checks reports and the CLIP node's text", () => {
    const c = summarizeReport({ kind: "checks", node: "13", checks: "warn",
                                compare: { every: 10, samples: 3, max_rel_error: 0.00123, worst_site: "self" } });
    assert.equal(c.level, "ok");
    assert.equal(c.badge, "\u2713 max rel err 1.23e-3");
    assert.match(c.lines[1], /^Compared 3 samples with PyTorch SDPA \(1 in 10\): max relative error 1\.23e-3 at self$/);
    assert.equal(summarizeReport({ kind: "checks", compare: { every: 1, samples: 1, max_rel_error: 0.5 } }).level, "warn");
    // what the checks saw is said, never an empty panel: calls checked, and NaN/Inf found (raise: an error)
    const ok = summarizeReport({ kind: "checks", checks: "raise", summary: "Checked 8 attention calls for NaN/Inf: all finite.",
                                 checked: { mode: "raise", calls: 8, non_finite: 0, messages: [] } });
    assert.equal(ok.level, "ok");
    assert.equal(ok.badge, "\u2713 checks: raise \u00b7 8 calls");
    assert.ok(ok.lines.includes("Checked 8 attention calls for NaN/Inf: all finite."), ok.lines);
    const failed = summarizeReport({ kind: "checks", checks: "raise", summary: "NaN/Inf found, the prompt failed",
                                     checked: { mode: "raise", calls: 3, non_finite: 1, messages: ["x"] },
                                     compare: { every: 1, samples: 2, max_rel_error: 0.001 } });
    assert.equal(failed.level, "error");
    assert.equal(failed.badge, "\u2717 NaN/Inf in 1 call");
    const warned = summarizeReport({ kind: "checks", checks: "warn", checked: { mode: "warn", calls: 3, non_finite: 2 } });
    assert.equal(warned.level, "warn");
    assert.equal(warned.badge, "\u26a0 NaN/Inf in 2 calls");
    const t = summarizeClipText(["auto: patched 4 text-encoder attention modules"]);
    assert.equal(t.badge, "\u2713 auto: patched 4 text-encoder attention \u2026");
    assert.equal(summarizeClipText([]), null);
    assert.equal(summarizeClipText(undefined), null);
  });

  test("mergeReports adds up the runs of one prompt", () => {
    const row = { site: "self", requested: "native", served: "native", calls: 4, fell_back: false, reasons: [] };
    const a = modelReport([row], { attention_ms: 5 });
    const b = modelReport([row, { ...row, site: "cross" }], { attention_ms: 7 });
    const m = mergeReports([a, b]);
    assert.equal(m.runs, 2);
    assert.equal(m.recorder.calls, 12);
    assert.equal(m.recorder.rows.find((r) => r.site === "self").calls, 8);
    assert.equal(attentionTimeMs(m), 12);
    const s = summarizeReport(m);
    assert.equal(s.lines[0], "2 sampling runs in this prompt");
    assert.equal(s.calls, 12);
    assert.equal(mergeReports([a]), a);
    assert.equal(mergeReports([]), null);
    assert.equal(a.recorder.rows[0].calls, 4); // inputs untouched
  });

  test("fallbackToast only for fallbacks", () => {
    const rows = [{ site: "self", requested: "flash", served: "native", calls: 2, fell_back: true,
                    reasons: ["flash: needs an NVIDIA CUDA GPU; this machine has a CPU"] }];
    const t = fallbackToast(modelReport(rows), "Set Attention Backend");
    assert.equal(t.summary, "Attention backend fell back \u2014 Set Attention Backend");
    assert.equal(t.detail, "flash \u2192 native (2 calls): needs an NVIDIA CUDA GPU; this machine has a CPU");
    assert.equal(fallbackToast(modelReport([{ ...rows[0], requested: "native", fell_back: false }])), null);
    assert.equal(reasonText("flash: x is not installed: pip install x", "flash"), "x is not installed");
    assert.equal(reasonText("a.b: why", "a.b"), "why");
  });
});

describe("layout and node lookup", () => {
  const measure = (s) => s.length * 7;

  test("wrapText wraps words, keeps newlines and cuts words wider than the line", () => {
    assert.deepEqual(wrapText("aaa bbb ccc", 7 * 7, measure), ["aaa bbb", "ccc"]);
    assert.deepEqual(wrapText("one\ntwo three", 100 * 7, measure), ["one", "two three"]);
    assert.deepEqual(wrapText("abcdefghij", 4 * 7, measure), ["abcd", "efgh", "ij"]);
    assert.deepEqual(wrapText("", 70, measure), [""]);
    for (const line of wrapText("pip install 'flash-attn>=2.6.3' --no-build-isolation", 10 * 7, measure)) {
      assert.ok(measure(line) <= 70, line);
    }
  });

  test("report node ids map to graph nodes, through subgraphs", () => {
    const graph = (nodes) => ({ getNodeById: (id) => nodes.find((n) => n.id === id) ?? null });
    const inner = { id: 3, title: "inner" };
    const sub = { id: 5, subgraph: graph([inner]) };
    const top = { id: 10, title: "top" };
    const root = graph([top, sub]);
    assert.deepEqual(parseExecutionId("5:3"), ["5", "3"]);
    assert.deepEqual(parseExecutionId(null), []);
    assert.equal(resolveNode(root, "10"), top);
    assert.equal(resolveNode(root, 10), top);
    assert.equal(resolveNode(root, "5:3"), inner);
    assert.equal(resolveNode(root, "5:4"), null);
    assert.equal(resolveNode(root, "10:3"), null); // not a subgraph node
    assert.equal(resolveNode(root, "99"), null);
    assert.equal(resolveNode(null, "10"), null);
    const named = { id: "abc" };
    assert.equal(resolveNode(graph([named]), "abc"), named);
  });
});


describe("the dropdown's groups", () => {
  // As the server orders them: autos and ComfyUI's attention, what runs here, then by family.
  const index = indexBackends({ backends: [
    { name: "native", family: "sdpa", available: true, reasons: [] },
    { name: "flex", family: "flex", available: true, reasons: [] },
    { name: "flash", family: "flash2", available: false,
      reasons: ["flash-attn is not installed: pip install flash-attn", "needs an NVIDIA CUDA GPU; this machine has a CPU"] },
    { name: "flash_hub", family: "flash2", available: false, reasons: ["needs an NVIDIA CUDA GPU; this machine has a CPU"] },
    { name: "xformers", family: "xformers", available: false, reasons: ["xformers is not installed: pip install xformers"] },
  ] });
  const values = ["auto_exact", "auto_fast", "comfy default", "native", "flex", "flash", "flash_hub", "xformers"];

  test("autos, what runs here, then each family once with the reason its members share", () => {
    const groups = menuGroups(index, values);
    assert.deepEqual(groups.map((g) => g.values), [["auto_exact", "auto_fast", "comfy default"], ["native", "flex"],
                                                    ["flash", "flash_hub"], ["xformers"]]);
    assert.equal(groups[1].title, "\u2713 Runs on this machine");
    assert.equal(groups[2].title, "\u2717 flash2: needs an NVIDIA CUDA GPU; this machine has a CPU");
    assert.equal(groups[3].title, "\u2717 xformers: xformers is not installed");
    // the shared reason is said once, in the title; an entry keeps only its own
    assert.equal(groupedEntry(index, "flash", groups[2].shared).note, "flash-attn is not installed");
    assert.equal(groupedEntry(index, "flash_hub", groups[2].shared).note, "");
    assert.equal(groupedEntry(index, "flash_hub", groups[2].shared).value, "flash_hub");
    assert.equal(groupedEntry(index, "native", groups[1].shared).label, "\u2713 native");
  });

  test("a list not loaded yet is one group of plain names", () => {
    assert.deepEqual(menuGroups(null, ["auto_exact", "flash"]).map((g) => g.values), [["auto_exact", "flash"]]);
    assert.deepEqual(menuGroups(index, undefined), []);
  });
});

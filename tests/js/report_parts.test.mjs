// The two autos in the dropdown, and what a node shows of the quality guard, of a fallback on every call and of a
// block range that could not apply (web/format.js): `node --test tests/js/`.
import assert from "node:assert/strict";
import { describe, test } from "node:test";

import {
  ALWAYS_AVAILABLE, everyCallFallbacksOf, guardOf, indexBackends, isUnavailable, menuEntry, mergeReports,
  siteKind, summarizeReport, unappliedBlocksOf, visibleValues,
} from "../../web/format.js";

const INDEX = indexBackends({ backends: [
  { name: "native", available: true, reasons: [], fallback: [] },
  { name: "flash", available: false, reasons: ["flash-attn is not installed: pip install flash-attn"],
    fallback: ["native"] },
] });

function report(rows, extra = {}) {
  return { kind: "model", node: "10", prompt_id: "p", backend: rows[0]?.requested ?? "native",
           recorder: { calls: rows.reduce((a, r) => a + r.calls, 0), rows, errors: [] }, ...extra };
}

const NATIVE_ROWS = [{ site: "self", requested: "sage", served: "sage", calls: 6, fell_back: false, reasons: [] },
  { site: "self", requested: "sage", served: "native", calls: 2, fell_back: true,
    reasons: ["quality guard at self: relative error 8.1e-01; from then on 'native' serves these inputs"] }];

describe("the autos", () => {
  test("auto_exact, auto_fast and the old auto always run and say what they do", () => {
    for (const v of ["auto_exact", "auto_fast", "auto", "comfy default"]) {
      assert.ok(ALWAYS_AVAILABLE.has(v));
      assert.equal(isUnavailable(INDEX, v), false);
    }
    assert.match(menuEntry(INDEX, "auto_exact").note, /never a quantised kernel/);
    assert.match(menuEntry(INDEX, "auto_fast").note, /within 5e-2, and approximate ones \(sol_attn\) within their own bound, watched by the quality guard/);
    assert.match(menuEntry(INDEX, "auto").note, /auto_exact/);
    const values = ["auto_exact", "auto_fast", "comfy default", "native", "flash"];
    assert.deepEqual(visibleValues(values, INDEX, false, "auto_exact"), ["auto_exact", "auto_fast", "comfy default",
      "native"]);
  });
});

describe("the quality guard on the node", () => {
  const guard = [
    { site: "self", backend: "sage", checks: 3, max_error: 0.021,
      failures: [{ reason: "relative error 8.1e-01 against exact attention", replacement: "native" }] },
    { site: "cross", backend: "sage", checks: 2, max_error: 0.01, failures: [] },
  ];

  test("a caught kernel leads the badge and the panel says what replaced it", () => {
    const s = summarizeReport(report(NATIVE_ROWS, { guard }));
    assert.equal(s.level, "warn");
    assert.equal(s.badge, "\u26a0 guard caught sage at self \u2192 native");
    assert.ok(s.lines.includes("Quality guard: sage at self \u2014 3 checks, max error 2.1e-2"), s.lines);
    assert.ok(s.lines.some((l) => l.startsWith("\u26a0 Quality guard caught sage at self: relative error 8.1e-01") &&
      l.includes("recomputed with native, and sage is demoted for this block of this model")), s.lines);
    assert.ok(s.lines.includes("Quality guard: sage at cross \u2014 2 checks, max error 1.0e-2"));
  });

  test("blocks: the badge names the caught one, passed ones fold into one line, Ran folds them too", () => {
    const rows = [...Array(30).keys()].map((i) => ({ site: `self #${i}`, block: { kind: "self", stream: null, index: i,
      inner: null }, requested: "sage", served: i === 5 ? "native" : "sage", calls: 20, fell_back: i === 5,
      reasons: i === 5 ? ["quality guard"] : [] }));
    const blocks = [
      { site: "self #5", backend: "sage", checks: 1, max_error: null, blocks: 1,
        failures: [{ reason: "relative error 4.9e-01", replacement: "fa3" }] },
      { site: "self", backend: "sage", checks: 45, max_error: 0.004, blocks: 29, failures: [] },
    ];
    const s = summarizeReport(report(rows, { guard: blocks }));
    assert.equal(s.badge, "\u26a0 guard caught sage at self #5 \u2192 fa3");
    assert.ok(s.lines.includes("Quality guard: sage at self (29 blocks) \u2014 45 checks, max error 4.0e-3"), s.lines);
    assert.ok(s.lines.some((l) => l.startsWith("\u26a0 Quality guard caught sage at self #5: relative error")));
    assert.ok(s.lines.includes("Ran: sage \u2014 580 calls (self 580 in 29 blocks)"), s.lines);
    assert.ok(s.lines.includes("Ran: native \u2014 20 calls (self 20 at self #5)"), s.lines);
    assert.equal(siteKind({ kind: "self", stream: "input", index: 4, inner: 1 }), "input.self");
    assert.equal(siteKind({ kind: "cross", stream: null, index: null, inner: null }), "cross");
    assert.equal(mergeReports([report(rows, { guard: blocks }), report(rows, { guard: blocks })]).guard
      .find((g) => g.site === "self").blocks, 29);
  });

  test("passed checks alone keep the node green; the recorder's copy is read too", () => {
    const rows = [{ site: "self", requested: "sage", served: "sage", calls: 4, fell_back: false, reasons: [] }];
    const s = summarizeReport(report(rows, { recorder: { calls: 4, rows, errors: [], guard: [guard[1]] } }));
    assert.equal(s.level, "ok");
    assert.equal(s.guard.length, 1);
    assert.match(s.badge, /sage \u00b7 4 calls/);
  });

  test("bad guard data is ignored", () => {
    assert.deepEqual(guardOf({ guard: [null, 3, { site: "s", backend: "b", failures: [null] }] }),
      [{ site: "s", backend: "b", checks: 0, max_error: null, failures: [] }]);
    assert.deepEqual(guardOf(null), []);
  });

  test("two sampling runs of one node: checks add up, failures are kept", () => {
    const a = report(NATIVE_ROWS, { guard });
    const b = report(NATIVE_ROWS, { guard: [{ ...guard[1], checks: 5, max_error: 0.03 }] });
    const merged = mergeReports([a, b]);
    const cross = merged.guard.find((g) => g.site === "cross");
    assert.equal(cross.checks, 7);
    assert.equal(cross.max_error, 0.03);
    assert.equal(merged.guard.find((g) => g.site === "self").failures.length, 1);
  });
});

describe("fallbacks on every call and block ranges", () => {
  const every = [{ requested: "flex", served: ["native"], sites: ["cross", "self"], calls: 16, every_site: true,
                   reasons: ["flex: flex_attention needs torch.compile here"], text: "..." }];
  const rows = [{ site: "self", requested: "flex", served: "native", calls: 8, fell_back: true, reasons: [] },
    { site: "cross", requested: "flex", served: "native", calls: 8, fell_back: true, reasons: [] }];

  test("a backend that never ran says so on the badge, with the reason in the panel", () => {
    const withReasons = rows.map((r) => ({ ...r, reasons: ["flex: flex_attention needs torch.compile here"] }));
    const s = summarizeReport(report(withReasons, { fallback_every_call: every }));
    assert.equal(s.badge, "\u26a0 flex \u2192 native every call");
    assert.deepEqual(s.lines.filter((l) => l.includes("every call")),
      ["\u26a0 Fell back: flex \u2192 native for 16 calls (every call): flex_attention needs torch.compile here"]);
    const partial = summarizeReport(report(rows, { fallback_every_call: [{ ...every[0], every_site: false,
                                                                          sites: ["cross"] }] }));
    assert.ok(partial.lines.some((l) => l.includes("(every call at cross)")), partial.lines);
    // an entry the rows do not show gets its own line
    const alone = summarizeReport(report([], { fallback_every_call: every }));
    assert.ok(alone.lines.includes("\u26a0 flex fell back to native on every call: flex_attention needs " +
      "torch.compile here"), alone.lines);
    assert.deepEqual(everyCallFallbacksOf({ fallback_every_call: [null, { requested: 3 }] }), []);
  });

  test("a block range that could not apply", () => {
    const ok = [{ site: "self", requested: "native", served: "native", calls: 8, fell_back: false, reasons: [] }];
    const blocks = { range: [2, -1], unapplied: [{ sites: ["cross", "self"],
      reason: "this model tells attention no block position (ComfyUI 0.3.64's WAN and Flux do not; newer " +
              "ComfyUI does): the block range cannot apply" }] };
    const s = summarizeReport(report(ok, { blocks }));
    assert.equal(s.level, "warn");
    assert.equal(s.badge, "\u26a0 block range not applied");
    assert.ok(s.lines.some((l) => l.startsWith("\u26a0 Block range 2..-1 not applied at cross, self: this model " +
      "tells attention no block position")), s.lines);
    assert.equal(unappliedBlocksOf({ blocks: { unapplied: "x" } }).length, 0);
    const applied = summarizeReport(report(ok, { blocks: { range: [2, -1], unapplied: [] } }));
    assert.equal(applied.level, "ok");
  });
});

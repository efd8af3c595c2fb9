// What the badges say for chained nodes (issue #15): an overridden Set node, checks that saw no call, the
// Trust node's findings. Pure formatting (web/format.js), run by `node --test tests/js/`.
import { test } from "node:test";
import assert from "node:assert/strict";

import { mergeReports, summarizeReport, summarizeTrustText } from "../../web/format.js";

const note = "Overridden: Set Attention Backend #51 (flex) comes after this node and this node's backend serves " +
  "no calls. Chained Set Attention Backend nodes: the one nearest the sampler wins.";

test("an overridden Set node names the node that took over, not 'no attention calls'", () => {
  const report = { kind: "model", node: "50", backend: "native", recorder: { calls: 0, rows: [], errors: [] },
                   overridden_by: { kind: "model", node: "51", backend: "flex", window: [0, 1] }, notes: [note] };
  const s = summarizeReport(report);
  assert.equal(s.badge, "\u26a0 overridden by #51");
  assert.equal(s.level, "warn");
  assert.deepEqual(s.lines, [note]);
  assert.equal(summarizeReport(mergeReports([report, report])).badge, "\u26a0 overridden by #51");
});

test("a Set node replaced by a core node's override (ComfyUI 0.38 Model Attention Backend) names it", () => {
  const label = "ComfyUI Model Attention Backend (attention_pytorch)";
  const text = `Overridden: ${label} was installed after this node and does not pass attention calls on to it`;
  const s = summarizeReport({ kind: "model", node: "50", backend: "native", recorder: { calls: 0, rows: [], errors: [] },
                              overridden_by: { node: null, label, short: "Model Attention Backend", backend: label },
                              notes: [text] });
  assert.equal(s.badge, "\u26a0 overridden by Model Attention Backend");
  assert.equal(s.level, "warn");
  assert.deepEqual(s.lines, [text]);
});

test("a Set node that took over says so under its usual summary", () => {
  const rows = [{ site: "self", requested: "flex", served: "flex", calls: 8, fell_back: false, reasons: [] }];
  const s = summarizeReport({ kind: "model", backend: "flex", recorder: { calls: 8, rows, errors: [] },
                              notes: ["Takes over from Set Attention Backend #50 (native) upstream."] });
  assert.equal(s.level, "ok");
  assert.deepEqual(s.lines, ["Ran: flex \u2014 8 calls (self 8)", "Takes over from Set Attention Backend #50 (native) upstream."]);
});

test("checks that saw no call never read as a clean result", () => {
  const s = summarizeReport({ kind: "checks", node: "60", checks: "warn", no_calls: true,
                              compare: { every: 1, samples: 0, max_rel_error: 0, worst_site: null },
                              notes: ["Saw no attention calls: Set Attention Backend #61 (flex) comes after these checks."] });
  assert.equal(s.badge, "\u26a0 no calls checked");
  assert.equal(s.level, "warn");
  assert.ok(!s.lines.some((l) => /max relative error/.test(l)), s.lines);
  assert.ok(s.lines.some((l) => l.startsWith("Saw no attention calls: Set Attention Backend #61")), s.lines);
});

test("the Trust node's findings", () => {
  const ok = summarizeTrustText(["Trusted for the connected models: SageAttention (sage_hub)\n" +
                                 "Already trusted by default (changes nothing): kernels-community"]);
  assert.equal(ok.level, "ok");
  assert.equal(ok.lines.length, 2);
  assert.match(ok.badge, /^\u2713 Trusted for the connected models/);
  const nothing = summarizeTrustText(["Already trusted by default (changes nothing): kernels-community"]);
  assert.equal(nothing.level, "info");
  assert.equal(summarizeTrustText(["DIFFUSERS_DISABLE_REMOTE_CODE=true wins: no Hub kernel will load"]).level, "warn");
  assert.equal(summarizeTrustText([]), null);
  assert.equal(summarizeTrustText(undefined), null);
});

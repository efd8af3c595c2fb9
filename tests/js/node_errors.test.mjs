// Queue-time errors of the pack's nodes placed on the widget at fault (web/node_errors.js), from the node_errors
// ComfyUI 0.3.64 answered for a Set Attention Backend with policy strict, flash on a CPU and start > end.
import { test } from "node:test";
import assert from "node:assert/strict";

import { placeNodeErrors, problemInputs, splitProblems } from "../../web/node_errors.js";
import { indexBackends, optionLabel } from "../../web/format.js";

const NAMES = ["model", "trust", "sparse", "backend", "policy", "start_percent", "end_percent", "block_start",
               "block_end", "quality_guard", "guard_every"];
const WINDOW = "start_percent 0.8 is after end_percent 0.2 (the step window needs 0 <= start_percent <= " +
  "end_percent <= 1)";
const BACKEND = "backend: attention backend 'flash' cannot run on this machine (policy strict): flash-attn is not " +
  "installed: pip install 'flash-attn>=2.6.3' --no-build-isolation; needs an NVIDIA CUDA GPU; this machine has a " +
  "CPU. Install what is missing, pick another backend, or use policy 'fallback'.";

function served(message) { // what ComfyUI sends: one error, on the downstream KSampler's `model` input
  return {
    100: { class_type: "SetAttentionBackend", dependent_outputs: ["102"], errors: [{
      type: "exception_during_inner_validation", message: "Exception when validating inner node", details: message,
      extra_info: { input_name: "model", input_config: ["MODEL", {}], exception_message: message,
                    exception_type: "ValueError", linked_node: ["100", 0] } }] },
    7: { class_type: "KSampler", dependent_outputs: [], errors: [{ type: "value_bigger_than_max", details: "cfg",
                                                                   extra_info: { input_name: "cfg" } }] },
  };
}

test("a problem names the input it starts with, and those its first clause names", () => {
  assert.deepEqual(problemInputs(WINDOW, NAMES), ["start_percent", "end_percent"]);
  assert.deepEqual(problemInputs(BACKEND, NAMES), ["backend"]);
  assert.deepEqual(problemInputs("block_start 5 is after block_end 2 (a rule)", NAMES), ["block_start", "block_end"]);
  assert.deepEqual(problemInputs("something else broke", NAMES), []);
});

test("the message splits where an input's name starts a problem, not at each '; ' inside one", () => {
  const parts = splitProblems(`${WINDOW}; ${BACKEND}`, NAMES);
  assert.deepEqual(parts.map((p) => p.text), [WINDOW, BACKEND]);
  assert.deepEqual(parts.map((p) => p.inputs), [["start_percent", "end_percent"], ["backend"]]);
});

test("one error per problem, on the widget it starts with, with the pack's sentence; other nodes as they are", () => {
  const errors = served(`${WINDOW}; ${BACKEND}`);
  const placed = placeNodeErrors(errors, new Set(["SetAttentionBackend"]), () => NAMES);
  const mine = placed[100].errors;
  assert.deepEqual(mine.map((e) => e.extra_info.input_name), ["start_percent", "backend"]);
  assert.equal(mine[1].details, BACKEND.slice("backend: ".length)); // not "backend: backend: ..."
  assert.equal(mine[0].details, WINDOW);
  assert.ok(mine.every((e) => e.type === "exception_during_inner_validation" && !("input_config" in e.extra_info)));
  assert.deepEqual(mine[0].extra_info.linked_node, ["100", 0]);
  assert.equal(placed[7], errors[7]);
  assert.equal(placed[100].class_type, "SetAttentionBackend");
  assert.deepEqual(placed[100].dependent_outputs, ["102"]);
});

test("a window error alone is one error (the toast quotes a lone error's sentence)", () => {
  const placed = placeNodeErrors(served(WINDOW), new Set(["SetAttentionBackend"]), () => NAMES);
  assert.deepEqual(placed[100].errors.map((e) => [e.extra_info.input_name, e.details]), [["start_percent", WINDOW]]);
});

test("a message that names no input is kept on the input ComfyUI gave", () => {
  const errors = served("the model's attention could not be patched");
  const placed = placeNodeErrors(errors, new Set(["SetAttentionBackend"]), () => NAMES);
  assert.deepEqual(placed[100].errors, errors[100].errors);
  assert.equal(placeNodeErrors(null, new Set(), () => NAMES), null);
});

test("the Nodes 2.0 label carries the mark and, for what cannot run here, why", () => {
  const index = indexBackends({ backends: [
    { name: "native", available: true, reasons: [] },
    { name: "flash", available: false, reasons: ["flash-attn is not installed: pip install 'flash-attn>=2.6.3'"] },
  ] });
  assert.equal(optionLabel(index, "native"), "\u2713 native");
  assert.equal(optionLabel(index, "flash"), "\u2717 flash \u2014 flash-attn is not installed");
  assert.equal(optionLabel(index, "auto_exact"), "auto_exact");
  assert.equal(optionLabel(null, "flash"), "flash");
});

// Queue-time errors of the pack's nodes, placed on the widget at fault (pure: no DOM, no ComfyUI import).
//
// Why the frontend does it: ComfyUI (0.3.64 and 0.38 alike) cannot name a widget for a V3 node's
// `validate_inputs`. A returned message becomes one `custom_validation_failed` error per input the function
// receives (every widget ringed, the message repeated); a raised one, which the pack uses (nodes/validation.py),
// becomes one `exception_during_inner_validation` error whose `input_name` is the *downstream* node's input that
// links to ours ("model"). So the frontend rang the model slot and said "Set Attention Backend couldn't validate
// model: ...". The pack's message names every problem by its input ("backend: ...", "start_percent 0.8 is after
// end_percent 0.2 (...)", problems joined by "; "): split it here, one error per problem, on the input it starts
// with. One error, not one per input it names: the frontends (1.53, 1.58) quote a lone error's sentence in their
// toast, but say only "couldn't validate a connected node" and count two errors for a window error on both ends.

/** The inputs a problem names: the one it starts with, and the others its first clause names
 * ("start_percent 0.8 is after end_percent 0.2 (...)" -> both); [] when it starts with none. */
export function problemInputs(problem, names) {
  const text = String(problem ?? "");
  const lead = names.filter((n) => text.startsWith(n) && /^[:\s]/.test(text.slice(n.length)))
    .sort((a, b) => b.length - a.length)[0];
  if (!lead) return [];
  const rest = text.slice(lead.length).replace(/^:\s*/, "");
  const clause = rest.split(/[(:]/)[0];
  const more = names.filter((n) => n !== lead && new RegExp(`(^|[^\\w])${n}([^\\w]|$)`).test(clause));
  return [lead, ...more];
}

/** The pack's message -> its problems, each with the inputs it names. The message joins problems with "; ", and
 * a problem may hold "; " itself (a list of reasons): a new problem starts only where an input's name does. */
export function splitProblems(message, names) {
  const text = String(message ?? "").trim();
  if (!text || !names.length) return [];
  const alternatives = [...names].sort((a, b) => b.length - a.length).map((n) => n.replace(/\W/g, "\\$&"));
  const starts = [0];
  const re = new RegExp(`; (?=(?:${alternatives.join("|")})[:\\s])`, "g");
  for (let m = re.exec(text); m; m = re.exec(text)) starts.push(m.index + 2);
  return starts.map((start, i) => {
    const end = i + 1 < starts.length ? starts[i + 1] - 2 : text.length;
    const problem = text.slice(start, end).trim();
    return { text: problem, inputs: problemInputs(problem, names) };
  });
}

/** The sentence a user reads under the input's name: without a leading "<input>: " that repeats it. */
function sentenceFor(problem, input) {
  return problem.startsWith(`${input}:`) ? problem.slice(input.length + 1).trim() : problem;
}

/**
 * ComfyUI's `node_errors` ({id: {errors, class_type, dependent_outputs}}) with each error of one of `classTypes`
 * whose message names this node's inputs replaced by one error per problem (same type and message,
 * `extra_info.input_name` the input the problem starts with, `details` the problem's sentence).
 * `inputsOf(id, classType)` gives the node's widget/input names. Errors that name none of them, and other nodes,
 * are kept as they are.
 */
export function placeNodeErrors(nodeErrors, classTypes, inputsOf) {
  if (!nodeErrors || typeof nodeErrors !== "object") return nodeErrors;
  const out = {};
  for (const [id, entry] of Object.entries(nodeErrors)) {
    out[id] = entry;
    if (!entry || !classTypes.has(entry.class_type) || !Array.isArray(entry.errors)) continue;
    const names = (inputsOf(id, entry.class_type) ?? []).filter((n) => typeof n === "string" && n);
    const errors = [];
    for (const error of entry.errors) {
      const message = error?.extra_info?.exception_message ?? error?.details;
      const problems = splitProblems(message, names).filter((p) => p.inputs.length);
      if (!problems.length) { errors.push(error); continue; }
      for (const problem of problems) {
        const [input] = problem.inputs;
        const details = sentenceFor(problem.text, input);
        // input_config was the downstream input's (MODEL): it says nothing about this input
        const { input_config: _downstream, ...extra } = error.extra_info ?? {};
        errors.push({ ...error, details, extra_info: { ...extra, input_name: input, exception_message: details } });
      }
    }
    out[id] = { ...entry, errors };
  }
  return out;
}

/** What a node's panel says of its queue-time errors: one line per sentence, led by the input it is on unless the
 * sentence already starts with that input's name; and the inputs at fault (the classic canvas rings them). */
export function refusalLines(errors) {
  const lines = [], inputs = [];
  for (const e of Array.isArray(errors) ? errors : []) {
    if (typeof e?.details !== "string" || !e.details) continue;
    const input = e.extra_info?.input_name;
    const named = typeof input === "string" && input && !e.details.startsWith(input);
    const line = named ? `${input}: ${e.details}` : e.details;
    if (!lines.includes(line)) lines.push(line);
    if (typeof input === "string" && input && !inputs.includes(input)) inputs.push(input);
  }
  return { lines, inputs };
}

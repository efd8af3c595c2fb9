"""`dispatch_attention_fn` inside torch.compile: no graph break, static or dynamic shapes.

Dynamo cannot trace contextvars, locks or logging, which the eager path uses. So a traced call takes
one of three routes:
- static sizes: the whole decision is made by `_traced_plan`, which dynamo runs once per trace (an
  `assume_constant_result` function) and bakes into the graph: the chosen kernel is traced in, at no
  cost per call. The backend, policy, checks, trust scope and recorder active when the graph is traced
  are the ones the graph keeps; a backend that raises at run time is not demoted (no fallback inside a
  graph). A Recorder counts such a call on every run of the graph: the graph calls a tiny counting op
  (`_count_op`, which names the recorder by serial and the row by number), so a graph compiled during
  one prompt still counts in the next.
- symbolic sizes (dynamic shapes, which torch.compile turns on once a size changes): a decision depends
  on the lengths (the tuner's choice, a kernel's length rules), which a constant cannot hold. The call
  becomes one opaque op whose body is the eager dispatcher, deciding with the real sizes on every run
  (a dict lookup), counting every call, falling back as usual.
- live values needed (`auto_fast`, whose verdicts are made on the call's own tensors, or a kernel the quality
  guard watches, which compares and may recompute on the host): the same opaque op, at any sizes.
Bad inputs and calls no route can take (a BlockMask with dynamic sizes, attention_kwargs, a recorder
without a serial, gradients with dynamic sizes) run the eager path, which raises the real error or
serves the call (one graph break).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Callable, NamedTuple, get_type_hints

import torch

from . import caches, checks, decisions, registry, state, support
from .call import SITE_FIELDS, TENSOR_FIELDS, AttentionCall, CallSite, new_call
from .custom_ops import define_once
from .eager import dispatch_eager
from .execute import run
from .inputs import AttentionInputs, describe_call
from .report import by_serial, current_recorder
from .rules import Rules, other_rules

# _candidate_key(served backend, layout) -> the Candidate a traced plan runs. Forgotten with the decisions: a
# compiled graph guards on the entry it read, so it traces again, and plans again, once the entry is gone.
_traced_candidates: dict[tuple, Any] = {}
_eager_path: list = []  # dispatch_eager behind torch.compiler.disable, made once (eagerly, by _traced_plan)
caches.on_forget(_traced_candidates.clear)
# What a traced call records, (site, requested, served, reasons) -> its number for the counting op (ints, not
# strings, are what a graph holds cheaply), and back. Never forgotten: a graph holds the numbers it was traced with.
_traced_rows: dict[tuple, int] = {}
_rows_by_number: dict[int, tuple] = {}
# The tensor the counting op says it mutates: an op with no output and no mutation would be dropped from the graph.
# On the CPU whatever device the call runs on; see `_define_count` for what that does to CUDA graphs.
_COUNT_TOKEN = torch.zeros(1, dtype=torch.int8)
RUNTIME = "<runtime op>"  # a traced plan that runs the call as the opaque op (the eager path inside)
_FIELDS = tuple(f.name for f in fields(AttentionInputs))


def _eager():
    if not _eager_path:
        _eager_path.append(torch.compiler.disable(dispatch_eager))  # keys a site made in the trace (eager.py)
    return _eager_path[0]


def _traced_plan(backend, policy, signature, layout, call_site, recorder_serial, attention_kwargs_keys=(),
                 model=None, quality_guard=None, precision=None):
    """Runs eagerly at trace time: (served backend, checks mode, whether its mask needs converting), (RUNTIME,
    checks mode, False) when the call must run as the opaque op (it needs live values: an auto's verdicts, a
    guarded kernel), or None when the eager path must raise. precision: the call's rules as `_precision` gives
    them (plain constants)."""
    _eager()
    if signature is None:
        return None
    try:
        requested = backend if backend is not None else state.active_backend()
        if not registry.is_known(requested):
            return None
        policy = state.validate_policy(policy) if policy is not None else state.active_policy()
        model = model if model is not None else state.active_model()
        quality_guard = quality_guard if quality_guard is not None else state.active_guard()
        inputs = AttentionInputs(*signature)
        notes = ()
        chosen = requested
        if precision is not None:  # kept exact: an auto's exact twin, a refused kernel's exact stand-in
            chosen, _, notes = decisions.under_rules(requested, _rules_of(*precision), inputs)
        resolve = registry.resolver(chosen)
        if resolve is not None and not inputs.empty:  # nothing to choose for empty inputs (decisions.EMPTY)
            checks.check_structure(inputs)
            if registry.needs_live_values(chosen):
                _runtime_op()
                return RUNTIME, state.active_checks(), False, 0, 0
            # a choice made eagerly (or on disk) before, else the priority order
            chosen = resolve(inputs, None, model=model, timing=False)[0]
        decision = decisions.decision_for(chosen, policy, inputs, layout, model, quality_guard, notes=notes)
    except Exception:
        return None
    candidate = decision.candidates[0]
    if attention_kwargs_keys:
        candidate = support.candidates_for_attention_kwargs(decision.requested, policy, decision.candidates,
                                                           dict.fromkeys(attention_kwargs_keys))[0]
    if candidate.guard:  # the guard compares and may recompute: host work a graph cannot hold
        _runtime_op()
        return RUNTIME, state.active_checks(), False, 0, 0
    name = candidate.name
    _traced_candidates[_candidate_key(name, layout)] = candidate
    reasons = decision.reasons_for(name) if name != decision.requested else ()
    if reasons:
        decisions.log_once(decision.requested, name, reasons)
    recorder = by_serial(recorder_serial) if recorder_serial else current_recorder()
    serial = _serial_of(recorder) or 0
    row = 0
    if serial:  # counted by the graph on every run (_count_op), not here at trace time
        _count_op()
        counted = (call_site, requested, name, decision.notes + tuple(reasons))
        row = _traced_rows.setdefault(counted, len(_traced_rows) + 1)
        _rows_by_number[row] = counted
    return name, state.active_checks(), candidate.convert_mask, serial, row


def _candidate_key(name: str, layout: str) -> tuple:
    """The key of a traced plan's candidate: what the plan stores and the traced call reads."""
    return name, layout


def _symbolic_sizes() -> bool:
    """Runs eagerly at trace time: whether the graph being traced has symbolic sizes.

    Dynamo answers int for isinstance(size, SymInt) in traced code, so this asks the trace's shape
    environment instead; the inputs' symbols exist once the tensors have been touched. When it cannot
    tell, it says True: the runtime op is right for any sizes, only slower for small kernels."""
    from torch._guards import TracingContext
    context = TracingContext.try_get()
    if context is None:  # not traced by dynamo: nothing is symbolic
        return False
    try:
        shape_env = context.fake_mode.shape_env
    except AttributeError:
        _runtime_op()
        return True
    if shape_env is None:  # no shape environment, no symbols
        return False
    values = getattr(shape_env, "backed_var_to_val", None)  # torch >= 2.10 (var_to_val before)
    if not (values if values is not None else shape_env.var_to_val):
        return False
    _runtime_op()  # registered here, eagerly: registering inside traced code would break the graph
    return True


# What torch.compiler.assume_constant_result sets, without importing torch._dynamo (1+ s) with the package.
_traced_plan._dynamo_marked_constant = True
_symbolic_sizes._dynamo_marked_constant = True

_op = None
_counter = None


def _count_op():
    """The op a traced call runs to count itself in its recorder (registered on first use, eagerly)."""
    global _counter
    if _counter is None:
        _counter = define_once("count", __name__, _define_count)
    return _counter


# The counting op's body is host work that must run on every run of the graph, and a CUDA graph replays only the
# kernels it captured. So inductor must never capture it, and does not (torch 2.13, mode="reduce-overhead"):
# - with graph partitions (torch._inductor.config.graph_partition, on by default in 2.13) a CPU op or one tagged
#   cudagraph_unsafe is a partition boundary (Scheduler.should_partition): it runs in the graph's `call`
#   between CUDA-graphed partitions; the count ops depend on nothing but the token, so inductor's reordering
#   for fewer partitions (reorder_for_minimizing_partition) can move them together. CUDA graphs are used and
#   every run counts (tests/gpu/test_gpu_compile.py checks both).
# - without them, a CPU node (cudagraph_utils.check_multiple_devices_or_any_cpu_nodes: "skipping cudagraphs due
#   to cpu device") or a cudagraph_unsafe op (get_first_incompatible_cudagraph_node) turns CUDA graphs off for
#   the whole graph: the counts stay right, the graph runs without CUDA graphs. Counting there too would need
#   counters the graph's own kernels increment on the device, read back when a recorder is read.
# The tag says so whatever the token's device: a token on the call's device alone would make the op look like
# any CUDA kernel, captured once and never run again, and a recorder would stop counting after the first runs.
_CUDAGRAPH_UNSAFE = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


def _define_count(name: str):
    tags = {"tags": _CUDAGRAPH_UNSAFE} if _CUDAGRAPH_UNSAFE else {}

    @torch.library.custom_op(name, mutates_args=("token",), **tags)
    def count(token: torch.Tensor, recorder_serial: int, row: int) -> None:
        recorder = by_serial(recorder_serial)
        if recorder is not None and row in _rows_by_number:
            recorder.record(*_rows_by_number[row])

    @count.register_fake
    def _(token, recorder_serial, row):
        return None
    return count


def _runtime_op():
    """The dispatcher as one custom op (registered on first use, once per copy of this module)."""
    global _op
    if _op is not None:
        return _op
    _op = define_once("call", __name__, _define)
    return _op


class _Carried(NamedTuple):
    """How the runtime op carries one of a call's fields (its tensors' and its site's)."""
    arguments: tuple[str, ...]  # its arguments in the op's schema ("type name"); none: not carried
    to_op: Callable | None = None  # the call's value -> a tuple of the arguments' values; None: the value itself
    from_op: Callable | None = None  # the arguments' values -> the call's value; None: the one argument itself


# Schema types of the annotations of AttentionCall's tensors and CallSite's fields; a field whose annotation is not
# here needs an entry in _NOT_PLAIN.
_SCHEMA_TYPES = {torch.Tensor: "Tensor", float: "float", bool: "bool", str: "str", float | None: "float?",
                 str | None: "str?"}
# The fields no schema type holds as they are.
_NOT_PLAIN = {
    # Any in the call; a tensor or None on this route (a BlockMask runs eagerly)
    "attn_mask": _Carried(("Tensor? attn_mask",)),
    # never: a call with attention_kwargs runs eagerly
    "attention_kwargs": _Carried((), lambda kwargs: (), lambda: None),
    # by its serial: an int a graph holds (0: none)
    "recorder": _Carried(("int recorder_serial",), lambda recorder: (_serial_of(recorder),), by_serial),
    # (mode, every) as its two parts
    "guard": _Carried(("str? guard_mode", "int guard_every"), lambda guard: (None, 0) if guard is None else guard,
                      lambda mode, every: None if mode is None else (mode, every)),
    # the precision rules a call carries (rules.call_rules), as their two flags
    "rules": _Carried(("bool? exact_only", "bool? low_precision"), lambda rules: _precision(rules),
                      lambda exact_only, low_precision: _rules_of(exact_only, low_precision)),
}


def _precision(rules) -> tuple:
    """A call's rules as plain constants a graph holds: (exact_only, low_precision), or (None, None) for none."""
    return (None, None) if rules is None else (rules.exact_only, rules.low_precision)


def _rules_of(exact_only, low_precision):
    return None if exact_only is None else Rules(exact_only=exact_only, low_precision=low_precision)


_ANNOTATIONS = {**get_type_hints(AttentionCall), **get_type_hints(CallSite)}


def _plain(name: str) -> _Carried:
    annotation = _ANNOTATIONS[name]
    if annotation not in _SCHEMA_TYPES:
        raise TypeError(f"the call's {name} ({annotation}) has no schema type for the runtime op: add its "
                        f"annotation to compiled._SCHEMA_TYPES or the field to compiled._NOT_PLAIN")
    return _Carried((f"{_SCHEMA_TYPES[annotation]} {name}",))


# The runtime op's arguments: the call's tensors, then its site's fields, each in its definition's order (call.py),
# each as it is carried.
_OP_FIELDS = tuple((name, _NOT_PLAIN.get(name) or _plain(name)) for name in TENSOR_FIELDS + SITE_FIELDS)
OP_SCHEMA = "(" + ", ".join(a for _, carried in _OP_FIELDS for a in carried.arguments) + ") -> (Tensor, Tensor)"
_OP_ARGUMENT_NAMES = tuple(a.rsplit(" ", 1)[1] for _, carried in _OP_FIELDS for a in carried.arguments)


def _converted_back() -> tuple:
    """(first argument, how many, from_op) of each field converted on its way back, the last field first (splicing
    them in that order leaves the earlier positions where they are)."""
    converted, at = [], 0
    for _, carried in _OP_FIELDS:
        if carried.from_op is not None:
            converted.append((at, len(carried.arguments), carried.from_op))
        at += len(carried.arguments)
    return tuple(reversed(converted))


_CONVERTED_BACK = _converted_back()


def _op_arguments(call: AttentionCall) -> tuple:
    """The call as the runtime op's arguments (OP_SCHEMA's); runs at trace time."""
    arguments = ()
    for name, carried in _OP_FIELDS:
        value = getattr(call, name)
        arguments += (value,) if carried.to_op is None else carried.to_op(value)
    return arguments


_TENSORS = len(TENSOR_FIELDS)
# The sites the runtime op's calls were made at: their fields' values (as _call_of has them) -> the CallSite, made
# and keyed once. Cleared when full.
_op_sites: dict[tuple, CallSite] = {}
_MAX_OP_SITES = 256


def _call_of(arguments: tuple) -> AttentionCall:
    """The call the runtime op's arguments carry (the inverse of _op_arguments); runs on every call of the op, so
    it splices the few converted fields into the arguments rather than rebuilding every field, and keeps the
    sites it made."""
    values = list(arguments)
    for at, count, from_op in _CONVERTED_BACK:
        values[at:at + count] = (from_op(*values[at:at + count]),)
    fields = tuple(values[_TENSORS:])
    site = _op_sites.get(fields)
    if site is None:
        site = CallSite(**dict(zip(SITE_FIELDS, fields)))
        if len(_op_sites) >= _MAX_OP_SITES:
            _op_sites.clear()
        _op_sites[fields] = site
    return new_call(AttentionCall, (*values[:_TENSORS], site))


def _define(name: str):
    @torch.library.custom_op(name, mutates_args=(), schema=OP_SCHEMA)
    def call(*arguments) -> tuple[torch.Tensor, torch.Tensor]:
        # The eager path itself (this body also runs when the op is traced by make_fx or export).
        described = _call_of(arguments)
        result = dispatch_eager(described)
        if described.site.return_lse:
            out, lse = result
        else:
            out, lse = result, described.query.new_empty(0, dtype=torch.float32)
        # An op's outputs are fresh, dense tensors, as the fake below promises the compiler.
        return out.contiguous(), lse.contiguous()

    @call.register_fake
    def _(*arguments):
        named = dict(zip(_OP_ARGUMENT_NAMES, arguments))
        query, value, return_lse = named["query"], named["value"], named["return_lse"]
        out = query.new_empty((*query.shape[:-1], value.shape[-1]))
        # The LSE is (B, Sq, H) in BSHD and (B, H, Sq) in BHSD: the query's shape without its last axis.
        return out, query.new_empty(query.shape[:-1] if return_lse else (0,), dtype=torch.float32)
    return call


def _serial_of(recorder) -> int | None:
    return 0 if recorder is None else getattr(recorder, "serial", None)


def _as_op(call: AttentionCall):
    """The call as one opaque op whose body is the eager path (real sizes and values at run time)."""
    out, lse = _runtime_op()(*_op_arguments(call))
    return (out, lse) if call.site.return_lse else out


def dispatch_traced(call: AttentionCall):
    query, key, value, attn_mask, site = call.query, call.key, call.value, call.attn_mask, call.site
    rules = site.rules
    if rules is not None and (type(rules) is not Rules or other_rules(rules)):
        return _eager()(call)  # a site made in a trace is unchecked: the eager path names the problem
    layout, attention_kwargs, return_lse = site.layout, site.attention_kwargs, site.return_lse
    serial = _serial_of(site.recorder)
    shaped = serial is not None and query.dim() == key.dim() == value.dim() == 4 and layout in ("BSHD", "BHSD")
    opaque = (not attention_kwargs and (attn_mask is None or isinstance(attn_mask, torch.Tensor))
              and not (query.requires_grad or key.requires_grad or value.requires_grad))
    if shaped and _symbolic_sizes():
        if opaque:
            return _as_op(call)
        shaped = False
    inputs = None
    if shaped:
        checks.check_shapes(query, key, value, layout)
        inputs = describe_call(query, key, value, attn_mask, site.dropout_p, site.is_causal, site.scale,
                               site.enable_gqa, return_lse, layout)
    # Plain constants (dynamo hands an assume_constant_result function no real dataclass instance).
    signature = None if inputs is None else tuple(getattr(inputs, f) for f in _FIELDS)
    plan = _traced_plan(site.backend, site.policy, signature, layout, site.call_site, serial,
                        tuple(sorted(attention_kwargs)) if attention_kwargs else (), site.model, site.guard,
                        None if rules is None else _precision(rules))
    if plan is None:
        return _eager()(call)
    name, mode, convert_mask, count_serial, row = plan
    if count_serial:
        _count_op()(_COUNT_TOKEN, count_serial, row)
    if name == RUNTIME:
        return _as_op(call) if opaque else _eager()(call)
    # The plan's constants, not only the cached candidate: dynamo reads _traced_candidates as it was at its first
    # read in this frame, so a later call of the same backend and layout (a masked one after an unmasked one)
    # would otherwise get the first call's mask handling.
    candidate = _traced_candidates.get(_candidate_key(name, layout))
    if candidate is None:  # forgotten (caches.forget) by another thread since the plan was made
        return _eager()(call)
    candidate = candidate._replace(convert_mask=convert_mask)
    if mode != "off":
        checks.check_values({"query": query, "key": key, "value": value, "attn_mask": attn_mask}, mode, name)
    out = run(candidate, call)
    if mode != "off":
        checks.check_values({"output": out[0] if return_lse else out}, mode, name)
    return out

"""The eager path: decide (a dict lookup once a signature is decided), run, fall back, record; a guarded kernel's
served calls go to the quality guard of their decision (`decision.watch`, guard.py) once each.

The first call of a signature validates everything and builds its `AttentionInputs`; repeat calls look
the decision up by a key of the call's site (`CallSite.cache_key`, made once per site), the scope and the tensors'
shapes, dtypes, devices and flags read straight off them (`lane_key`, built by call.tensors_key), and pay for
nothing else but the checks every call gets. A caller that keys its calls at least as finely itself (the ComfyUI
override's plans, through `PreparedAttention.keyed`, keyed by the same tensors_key) skips even that: its repeat
calls run the decided kernel's `Lane`, which re-checks only what such a key cannot see.
"""

from __future__ import annotations

import torch

from . import caches, checks, decisions, registry, state, support, trust
from .call import AttentionCall, CallSite, new_call, shapes_key, tensors_key
from .decisions import Decision
from .execute import run, run_tensors
from .inputs import describe_call
from .machine import current_machine
from .report import current_recorder

# lane_key(...) -> Decision, or _TRUST_SENSITIVE when the decision also depends on trust settings: then
# (that key, trust.scope_key()) holds it. Forgotten with the decisions.
_fast: dict = {}
_TRUST_SENSITIVE = object()
# Requested backends whose decisions are `shapes_only` (SDPA's chain): their calls are first looked up by a shorter
# key, shapes and flags without dtypes, devices and grad, which their kernels need not be told apart by. Such a
# key is stored only after a call of those shapes passed full validation; a call it finds whose kernel raises
# (mixed dtypes or devices, say) goes on through the full path, which validates it before anything else.
_shapes_only: set = set()
caches.on_forget(_fast.clear)
caches.on_forget(_shapes_only.clear)


def dispatch_eager(call: AttentionCall, by_shapes: bool = True):
    query, key, value, attn_mask, site = call.query, call.key, call.value, call.attn_mask, call.site
    if type(query) is not _Tensor or type(key) is not _Tensor or type(value) is not _Tensor \
            or (attn_mask is not None and type(attn_mask) is not _Tensor):
        _check_tensors(query, key, value, attn_mask)  # the site was checked when it was made
    if site.cache_key is None:  # made in a traced frame, where nothing is interned: keyed here, eagerly
        site = site.keyed()
        call = call._replace(site=site)
    (scoped_backend, scoped_policy, scoped_model, scoped_guard), mode = _current_scope()
    requested, policy, model, guard = site.backend, site.policy, site.model, site.guard
    if requested is None:
        requested = scoped_backend
    if policy is None:
        policy = scoped_policy
    if model is None:
        model = scoped_model
    if guard is None:
        guard = scoped_guard
    machine_id = id(_current_machine())  # kept alive by the decision (decision.machine), so the id stays unique
    decision = short_key = None
    # lane_key's two keys, written out here (one Python call fewer per call; tests/test_lanes.py checks they agree)
    if by_shapes and requested in _shapes_only:
        try:
            short_key = _shapes_key((site.cache_key, requested, policy, model, guard, machine_id), query, key, value,
                                    attn_mask)
            decision = _fast.get(short_key)
        except TypeError:  # an unhashable mask: the full path below raises the real error
            short_key = None
    validated = decision is None
    if validated:
        grad = _grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
        try:
            fast_key = _tensors_key((site.cache_key, requested, policy, model, guard, machine_id, grad), query, key,
                                    value, attn_mask)
            decision = _fast.get(fast_key)
            if decision is _TRUST_SENSITIVE:
                decision = _fast.get((fast_key, trust.scope_key()))
        except TypeError:  # an unhashable mask: the full path below raises the real error
            decision, fast_key = None, None
        if decision is None:
            decision = _first_call(fast_key, requested, policy, model, guard, call)
        if decision.shapes_only and decision.requested == requested:  # not an auto: its pick depends on more
            _shapes_only.add(requested)  # validated in full: calls of these shapes may take the shorter key
            if short_key is not None:
                _fast[short_key] = decision
    recorder = site.recorder
    if recorder is None:
        recorder = _current_recorder()
    candidates = decision.candidates
    call_site = site.call_site
    attention_kwargs = site.attention_kwargs
    # Backends that failed this call are demoted only once a later one serves it: a call that no backend can
    # run (a bad argument a kernel rejects, memory exhausted everywhere) raises and changes no decision.
    failed = None  # [(name, why it is demoted, the error recorded)] once one failed
    if mode == "off" and not attention_kwargs:
        # The common call: its first candidate serves it (a guarded one unless this call is one the guard checks:
        # that goes the long way) and is counted as the loop below would count it (the requested backend served).
        candidate = decision.lane
        if candidate is not None and (not candidate.guard or decision.watch.unchecked(candidate, call_site)):
            try:
                out = run_tensors(candidate, query, key, value, attn_mask, site)
            except Exception as exc:
                if not validated:  # found by its shapes alone: validate it in full before anything else
                    return dispatch_eager(call, by_shapes=False)
                failed = [_raised(candidate, exc, policy, len(candidates) == 1)]
            else:
                if recorder is not None:
                    recorder.record(call_site, requested, candidate.name, ())
                return out
    if not validated:  # checks, attention_kwargs, a guarded or demoted kernel: the full path
        return dispatch_eager(call, by_shapes=False)
    first, failed = (0, []) if failed is None else (1, failed)
    return_lse = site.return_lse
    if mode != "off":
        checks.check_values({"query": query, "key": key, "value": value, "attn_mask": attn_mask}, mode, requested)
    if attention_kwargs:  # only backends that pass every key on to their kernel may run it
        candidates = support.candidates_for_attention_kwargs(decision.requested, policy, candidates, attention_kwargs)
    watch = decision.watch
    guard_notes = ()  # a kernel the guard demoted for this block: why another serves it
    last_index = len(candidates) - 1
    for index in range(first, last_index + 1):
        candidate = candidates[index]
        clock = None
        if candidate.guard:
            if not watch.serves(candidate, call_site):
                guard_notes += (f"{candidate.name}: {watch.demoted[(candidate.name, call_site)]}",)
                continue
            clock = watch.clock(candidate, call)  # the first checks time the call they check and themselves
        try:
            out = run(candidate, call)
        except Exception as exc:
            failed.append(_raised(candidate, exc, policy, index == last_index))
            continue
        name = candidate.name
        if candidate.guard:
            if mode != "off":  # checks judge what the kernel produced: the guard may replace it just below
                checks.check_values({"output": out[0] if return_lse else out}, mode, name)
            replacement = watch.after(decision, candidate, call, out, recorder, policy, clock)
            if replacement is not None:
                out, name = run(replacement, call), replacement.name
                guard_notes += (f"{candidate.name}: {watch.demoted[(candidate.name, call_site)]}",)
        if mode != "off" and (name != candidate.name or not candidate.guard):
            # "raise": a non-finite output fails the call under every policy (what checks ask)
            checks.check_values({"output": out[0] if return_lse else out}, mode, name)
        if failed or name != decision.requested or recorder is not None:
            _account(decision, name, failed, recorder, call_site, requested, guard_notes)
        return out
    raise AssertionError("unreachable: a decision always has a candidate")


def lane_key(call: AttentionCall, requested, policy, model, guard, machine_id: int, shapes_only: bool) -> tuple:
    """The one key of the eager path's cache (`_fast`), for `call` under the resolved scope (requested backend,
    policy, model, guard setting) on the machine `machine_id` (dispatch_eager writes it out). Finer than the
    decision's key (decisions.decision_for) and `auto`'s (Tuner._key): the site's part (`CallSite.cache_key`: the
    flags, layout, call site (auto's block), attention_kwargs' keys, the rules that keep it exact), the scope, and
    every part of the tensors their AttentionInputs are made from (call.tensors_key: shapes, dtypes, devices, mask
    kind and shape) with whether a gradient is wanted; tests/test_lanes.py checks the relation as a property.
    shapes_only: the shorter key of a `shapes_only` chain (call.shapes_key), without dtypes, devices and grad, which
    its kernels need not be told apart by. Raises TypeError for an unhashable part (the full path then raises the
    real error)."""
    query, key, value, site = call.query, call.key, call.value, call.site
    if shapes_only:
        return shapes_key((site.cache_key, requested, policy, model, guard, machine_id), query, key, value,
                          call.attn_mask)
    grad = _grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    return tensors_key((site.cache_key, requested, policy, model, guard, machine_id, grad), query, key, value,
                       call.attn_mask)


class Lane:
    """One call site's repeat call, worked out once a call of it was served (`lane_for`): the decision's first
    candidate (its bound runner, layout transposes and mask conversion: `execute.run_tensors`; a fallback's
    reasons), the call's site, and what the lane was made under, re-checked on each call (`run_lane`): the scope
    (backend, policy, model, guard, checks mode), the machine, whether a gradient is wanted, the decision's first
    candidate (a demotion moves it) and the caches' epoch (`caches.forget`). The tensors' own key (shapes, dtypes,
    devices, mask) is the holder's to check: a lane is kept per signature that is at least as fine (the ComfyUI
    override's plans, keyed by call.tensors_key)."""

    __slots__ = ("decision", "candidate", "site", "scope", "machine", "grad", "epoch", "call_site", "requested",
                 "recorder", "reasons")

    def __init__(self, decision, site: CallSite, scope: tuple, machine, grad: bool, requested: str):
        candidate = decision.candidates[0]
        self.decision, self.candidate, self.site = decision, candidate, site
        self.scope, self.machine, self.grad, self.epoch = scope, machine, grad, _epoch
        self.requested = requested
        self.call_site, self.recorder = site.call_site, site.recorder
        # a fallback's reasons, recorded with each call as the full path records them (it logged them once)
        name = candidate.name
        self.reasons = decision.notes + (decision.reasons_for(name) if name != decision.requested else ())


LEFT = object()  # run_lane's answer when the call must take the full path
_epoch = object()  # replaced whenever the caches forget: every lane made before is left


@caches.on_forget
def _new_epoch() -> None:
    global _epoch
    _epoch = object()


def lane_for(query, key, value, attn_mask, site: CallSite) -> Lane | None:
    """The lane of the call `(query, key, value, attn_mask)` at `site` once a call of its signature was served, or
    None where repeat calls take the full path: checks on, attention_kwargs, a decision not kept (an unsettled
    pick) or one that depends on trust settings."""
    call = new_call(AttentionCall, (query, key, value, attn_mask, site))
    scope = _current_scope()
    (scoped_backend, scoped_policy, scoped_model, scoped_guard), mode = scope
    if mode != "off" or site.attention_kwargs:
        return None
    requested = site.backend if site.backend is not None else scoped_backend
    policy = site.policy if site.policy is not None else scoped_policy
    model = site.model if site.model is not None else scoped_model
    guard = site.guard if site.guard is not None else scoped_guard
    machine = _current_machine()
    try:
        decision = _fast.get(lane_key(call, requested, policy, model, guard, id(machine), False))
    except TypeError:
        return None
    if type(decision) is not Decision:  # not kept, or kept per trust setting
        return None
    grad = _grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    return Lane(decision, site, scope, machine, grad, requested)


def run_lane(lane: Lane, query, key, value, attn_mask):
    """A repeat call of the lane's signature (the caller checked the tensors' key): the kernel's output, counted as
    the eager path counts it, or LEFT where the call must take the full path (the scope, the machine or the grad
    mode changed, the caches forgot, the decision's first candidate was demoted, a guard check is due or the block's
    kernel demoted by the guard, or the kernel raised: the full path runs it again and demotes it)."""
    decision, candidate = lane.decision, lane.candidate
    candidates = decision.candidates  # a new list once one is demoted
    if lane.epoch is not _epoch or not candidates or candidates[0] is not candidate \
            or _current_scope() != lane.scope or _current_machine() is not lane.machine \
            or (_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)) != lane.grad:
        return LEFT
    if candidate.guard and not decision.watch.unchecked(candidate, lane.call_site):
        return LEFT  # a check falls due (or the block's kernel was demoted): the full path's guard runs it
    try:
        out = run_tensors(candidate, query, key, value, attn_mask, lane.site)
    except Exception:
        return LEFT
    recorder = lane.recorder
    if recorder is None:
        recorder = _current_recorder()
    if recorder is not None:
        recorder.record(lane.call_site, lane.requested, candidate.name, lane.reasons)
    return out


# Bound once: module attribute reads on every call add up on the hot path.
_check_tensors = checks.check_tensors
_current_scope = state.current
_grad_enabled = torch.is_grad_enabled
_Tensor = torch.Tensor
_current_machine = current_machine
_current_recorder = current_recorder
_tensors_key = tensors_key
_shapes_key = shapes_key


def _raised(candidate, exc, policy, last: bool) -> tuple:
    """A candidate that raised: re-raise (policy strict, the last candidate, or a bad input no backend takes),
    or (name, why it is demoted, the error recorded) for the next one to take over."""
    if policy == "strict" or last or isinstance(exc, checks.AttentionInputError):
        raise exc
    error = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
    return candidate.name, f"raised {error}", error


def _account(decision, name, failed, recorder, call_site, requested, guard_notes=()) -> None:
    """What a served call leaves behind: demotions, the fallback log line, the recorder's count. guard_notes: why
    the guard's demotion for this block moved the call on (logged once by the guard)."""
    for failed_name, why, error in failed:
        decisions.demote(decision, failed_name, why)
        if recorder is not None:
            recorder.record_error(call_site, failed_name, error)
    reasons = decision.reasons_for(name) if name != decision.requested else ()
    if reasons:
        decisions.log_once(decision.requested, name, reasons)
    reasons = decision.notes + guard_notes + reasons
    if recorder is not None:
        recorder.record(call_site, requested, name, reasons)  # requested may be a pseudo-backend ("auto")


def _first_call(fast_key, requested, policy, model, quality_guard, call: AttentionCall):
    """The first call of a signature: validate, describe, resolve a pseudo-backend, decide; remember it."""
    if not registry.is_known(requested):
        raise registry.UnknownBackendError(registry.unknown_message(requested))
    policy = state.validate_policy(policy)
    query, key, value, attn_mask, site = call.query, call.key, call.value, call.attn_mask, call.site
    checks.check_shapes(query, key, value, site.layout, attn_mask)
    inputs = describe_call(query, key, value, attn_mask, site.dropout_p, site.is_causal, site.scale, site.enable_gqa,
                           site.return_lse, site.layout)
    sensitive, settled = False, True
    asked, exact, notes = requested, None, ()
    if site.rules is not None:  # kept exact: an auto's exact twin, a refused kernel's exact stand-in
        asked, _, notes = decisions.under_rules(requested, site.rules, inputs)
    name = asked
    resolve = registry.resolver(asked)
    if resolve is not None and not inputs.empty:  # nothing to choose for empty inputs (decisions.EMPTY)
        checks.check_structure(inputs)
        name, sensitive, settled = resolve(inputs, call, model=model, timing=True)
        twin = registry.exact_twin(asked)
        # What replaces it where it fails: the fastest exact pick, which the decision's `exact_stand_in` puts first
        if twin is not None and not registry.get(name).exact:
            exact, twin_sensitive, twin_settled = registry.resolver(twin)(inputs, call, model=model, timing=True)
            sensitive, settled = sensitive or twin_sensitive, settled and twin_settled
    decision = decisions.decision_for(name, policy, inputs, site.layout, model, quality_guard, exact, notes)
    if fast_key is not None and settled:  # an unsettled pick (made on noise or in a trace) is asked again next call
        if sensitive or decision.trust_sensitive:
            _fast[fast_key] = _TRUST_SENSITIVE
            _fast[(fast_key, trust.scope_key())] = decision
        else:
            _fast[fast_key] = decision
    return decision

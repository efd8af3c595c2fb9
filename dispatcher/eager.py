"""The eager path: decide (a dict lookup once a signature is decided), run, fall back, record; a guarded kernel's
served calls go to the quality guard of their decision (`decision.watch`, guard.py) once each.

The first call of a signature validates everything and builds its `AttentionInputs`; repeat calls look
the decision up by a key of shapes, dtypes, devices and flags read straight off the tensors, and pay for
nothing else but the checks every call gets.
"""

from __future__ import annotations

import torch

from . import caches, checks, decisions, registry, state, support, trust
from .call import AttentionCall
from .execute import run
from .inputs import describe_call
from .machine import current_machine
from .report import current_recorder

# fast key -> Decision, or _TRUST_SENSITIVE when the decision also depends on trust settings: then
# (fast key, trust.scope_key()) holds it. The fast key is finer than the decision's (decisions.decision_for) and
# auto's (Tuner._key): the call's shapes, dtypes, devices and flags (which make its AttentionInputs), the requested
# backend, policy, layout, machine, model, guard setting, call site (auto's block) and attention_kwargs' keys (auto's
# candidates are the kernels that honour them). Forgotten with the decisions.
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
    # One unpacking (the hot path): AttentionCall's fields by name, in order (tests/test_call_fields.py checks it).
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, attention_kwargs, backend, layout, \
        policy, return_lse, call_site, recorder, model, guard = call
    _check_arguments(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                     attention_kwargs)
    (scoped_backend, scoped_policy, scoped_model, scoped_guard), mode = _current_scope()
    requested = backend if backend is not None else scoped_backend
    if policy is None:
        policy = scoped_policy
    if model is None:
        model = scoped_model
    if guard is None:
        guard = scoped_guard
    m = attn_mask
    if m is None:
        mask_dtype = mask_shape = None
    elif type(m) is _Tensor:
        mask_dtype, mask_shape = m.dtype, m.shape
    else:  # a BlockMask (or a wrong type: the full path raises the real error)
        mask_dtype, mask_shape = type(m), (getattr(m, "dtype", None), getattr(m, "shape", None),
                                           getattr(m, "device", None))
    q_shape, k_shape, v_shape = query.shape, key.shape, value.shape
    machine_id = id(_current_machine())  # kept alive by the decision (decision.machine), so the id stays unique
    decision = shapes_key = None
    if by_shapes:
        try:
            if requested in _shapes_only:
                shapes_key = (requested, policy, layout, q_shape, k_shape, v_shape, mask_dtype, mask_shape, is_causal,
                              dropout_p > 0, scale is None, enable_gqa, return_lse, machine_id, model, guard,
                              call_site)
                decision = _fast.get(shapes_key)
        except TypeError:  # an unhashable backend name or mask: the full path below raises the real error
            shapes_key = None
    validated = decision is None
    if validated:
        fast_key = (requested, policy, layout, q_shape, k_shape, v_shape, query.dtype, key.dtype, value.dtype,
                    query.device, key.device, value.device, mask_dtype, mask_shape,
                    None if type(m) is not _Tensor else m.device, is_causal, dropout_p > 0, scale is None,
                    enable_gqa, return_lse,
                    _grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad),
                    machine_id, model, guard, call_site,  # the block: `auto_fast` judges each one
                    attention_kwargs and frozenset(attention_kwargs))  # an auto picks among kernels honouring them
        try:
            decision = _fast.get(fast_key)
            if decision is _TRUST_SENSITIVE:
                decision = _fast.get((fast_key, trust.scope_key()))
        except TypeError:  # an unhashable mask: the full path below raises the real error
            decision, fast_key = None, None
        if decision is None:
            decision = _first_call(fast_key, requested, policy, model, guard, call)
        if decision.shapes_only and decision.requested == requested:  # not an auto: its pick depends on more
            _shapes_only.add(requested)  # validated in full: calls of these shapes may take the shorter key
            if shapes_key is not None:
                _fast[shapes_key] = decision
    if recorder is None:
        recorder = _current_recorder()
    candidates = decision.candidates
    # Backends that failed this call are demoted only once a later one serves it: a call that no backend can
    # run (a bad argument a kernel rejects, memory exhausted everywhere) raises and changes no decision.
    failed = None  # [(name, why it is demoted, the error recorded)] once one failed
    if mode == "off" and not attention_kwargs:
        # The common call: its first candidate serves it (a guarded one unless this call is one the guard checks:
        # that goes the long way) and is counted as the loop below would count it (the requested backend served).
        candidate = decision.lane
        if candidate is not None and (not candidate.guard or decision.watch.unchecked(candidate, call_site)):
            try:
                out = run(candidate, call)
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
    if mode != "off":
        checks.check_values({"query": query, "key": key, "value": value, "attn_mask": attn_mask}, mode, requested)
    if attention_kwargs:  # only backends that pass every key on to their kernel may run it
        candidates = support.candidates_for_attention_kwargs(decision.requested, policy, candidates, attention_kwargs)
    watch = decision.watch
    guard_notes = ()  # a kernel the guard demoted for this block: why another serves it
    last_index = len(candidates) - 1
    for index in range(first, last_index + 1):
        candidate = candidates[index]
        if candidate.guard and not watch.serves(candidate, call_site):
            guard_notes += (f"{candidate.name}: {watch.demoted[(candidate.name, call_site)]}",)
            continue
        try:
            out = run(candidate, call)
        except Exception as exc:
            failed.append(_raised(candidate, exc, policy, index == last_index))
            continue
        name = candidate.name
        if candidate.guard:
            if mode != "off":  # checks judge what the kernel produced: the guard may replace it just below
                checks.check_values({"output": out[0] if return_lse else out}, mode, name)
            replacement = watch.after(decision, candidate, call, out, recorder, policy)
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


# Bound once: module attribute reads on every call add up on the hot path.
_check_arguments = checks.check_arguments
_current_scope = state.current
_grad_enabled = torch.is_grad_enabled
_Tensor = torch.Tensor
_current_machine = current_machine
_current_recorder = current_recorder


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
    reasons = guard_notes + reasons
    if recorder is not None:
        recorder.record(call_site, requested, name, reasons)  # requested may be a pseudo-backend ("auto")


def _first_call(fast_key, requested, policy, model, quality_guard, call: AttentionCall):
    """The first call of a signature: validate, describe, resolve a pseudo-backend, decide; remember it."""
    if not registry.is_known(requested):
        raise registry.UnknownBackendError(registry.unknown_message(requested))
    policy = state.validate_policy(policy)
    query, key, value, attn_mask = call.query, call.key, call.value, call.attn_mask
    checks.check_shapes(query, key, value, call.layout, attn_mask)
    inputs = describe_call(query, key, value, attn_mask, call.dropout_p, call.is_causal, call.scale, call.enable_gqa,
                           call.return_lse, call.layout)
    sensitive, settled = False, True
    name, exact = requested, None
    resolve = registry.resolver(requested)
    if resolve is not None and not inputs.empty:  # nothing to choose for empty inputs (decisions.EMPTY)
        checks.check_structure(inputs)
        name, sensitive, settled = resolve(inputs, call, model=model, timing=True)
        twin = registry.exact_twin(requested)
        # What replaces it where it fails: the fastest exact pick, which the decision's `exact_stand_in` puts first
        if twin is not None and not registry.get(name).exact:
            exact, twin_sensitive, twin_settled = registry.resolver(twin)(inputs, call, model=model, timing=True)
            sensitive, settled = sensitive or twin_sensitive, settled and twin_settled
    decision = decisions.decision_for(name, policy, inputs, call.layout, model, quality_guard, exact)
    if fast_key is not None and settled:  # an unsettled pick (made on noise or in a trace) is asked again next call
        if sensitive or decision.trust_sensitive:
            _fast[fast_key] = _TRUST_SENSITIVE
            _fast[(fast_key, trust.scope_key())] = decision
        else:
            _fast[fast_key] = decision
    return decision

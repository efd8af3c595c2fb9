"""`dispatch_attention_fn`: pick the backend for a call, convert layout and mask, run it, fall back.

The decision for a call signature (backend asked for, policy, shapes, dtypes, flags, trust scope)
is made once and cached; a repeat call costs one dict lookup before the kernel runs. Layout
changes are views (a transpose of strides), never copies, unless the kernel needs contiguity.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from . import checks, compiled, masks, registry, state, trust, tuner
from .hub import KernelLoadError
from .inputs import describe_call
from .machine import current_machine
from .report import current_recorder, recording

logger = logging.getLogger("attention_dispatch")

# The exact end of every chain: SDPA, then its math kernel (which runs anything SDPA accepts).
FINAL_FALLBACKS = ("native", "_native_math")


class BackendNotSupportedError(RuntimeError):
    """No backend that was allowed to try could run the call; lists each one's reasons."""

    def __init__(self, requested: str, description: str, skipped: list[tuple[str, list[str]]], policy: str):
        self.requested, self.skipped, self.policy = requested, skipped, policy
        lines = [f"attention backend '{requested}' cannot run these inputs ({policy} policy): {description}"]
        for name, reasons in skipped:
            lines.append(f"  '{name}' is not supported because:")
            lines.extend(f"      {r}" for r in reasons)
        if policy == "strict":
            lines.append("  Use policy='fallback' to run the next backend in its chain instead.")
        super().__init__("\n".join(lines))


@dataclass
class Decision:
    requested: str
    candidates: list  # [(name, spec, runner)], best first
    skipped: list = field(default_factory=list)  # [(name, [reasons])]
    machine: object = None  # the machine it was made for (kept so its id in the cache key stays unique)
    trust_sensitive: bool = False  # a Hub backend in the chain: the decision depends on trust settings
    _reasons: dict = field(default_factory=dict, repr=False, compare=False)  # served -> reasons_for(served)

    def reasons_for(self, served: str) -> tuple[str, ...]:
        """Why each backend before `served` in the chain was skipped."""
        cached = self._reasons.get(served)
        if cached is None:
            order = fallback_order(self.requested)
            limit = order.index(served) if served in order else len(order)
            cached = self._reasons[served] = tuple(f"{name}: {r}" for name, reasons in self.skipped
                                                   if name in order and order.index(name) < limit for r in reasons)
        return cached


# The hot path's cache: a key made of the call's shapes, dtypes, devices and flags (no AttentionInputs is
# built) -> Decision; _TRUST_SENSITIVE when the decision also depends on trust settings, then the key plus
# trust.scope_key() holds it. Cleared with the decisions (registry changes, forget_decisions).
_fast: dict[tuple, Any] = {}
_TRUST_SENSITIVE = object()


# dispatcher.parallel's router (answers NotImplemented outside its context) and a flag it sets while any
# context_parallel() block is open, so a plain call pays one global check (a bool: torch.compile guards it).
_context_parallel = None
_context_parallel_on = False

_decisions: dict[tuple, Decision] = {}
_decisions_lock = threading.Lock()
_logged: set[tuple] = set()


def forget_decisions() -> None:
    with _decisions_lock:
        _decisions.clear()
        _fast.clear()
        _logged.clear()
    tuner.forget_choices()  # the candidates may have changed too; measurements stay on disk


def fallback_order(requested: str) -> list[str]:
    order, queue = [], [requested]
    while queue:
        name = queue.pop(0)
        if name in order or name not in registry.names():
            continue
        order.append(name)
        queue.extend(registry.get(name).fallback)
    order.extend(n for n in FINAL_FALLBACKS if n not in order)
    return order


def _decide(requested: str, policy: str, inputs) -> Decision:
    checks.check_structure(inputs)
    chain = fallback_order(requested) if policy == "fallback" else [requested]
    decision = Decision(requested, [], trust_sensitive=any(registry.get(n).hub is not None for n in chain))
    for name in chain:
        spec = registry.get(name)
        # A backend that cannot run here at all is explained by that alone; per-call reasons come after.
        reasons = registry.availability_reasons(name) or spec.not_supported_reasons(inputs)
        if not reasons:
            try:
                decision.candidates.append((name, spec, registry.prepare(name)))
                continue
            except KernelLoadError as exc:
                reasons = [str(exc)]
        decision.skipped.append((name, reasons))
    if not decision.candidates:
        raise BackendNotSupportedError(requested, inputs.describe(), decision.skipped, policy)
    return decision


def _decision_for(requested: str, policy: str, inputs) -> Decision:
    machine = current_machine()  # a simulated machine (use_machine) gets its own decisions
    key = (requested, policy, inputs, trust.scope_key(), id(machine))
    decision = _decisions.get(key)
    if decision is None:
        decision = _decide(requested, policy, inputs)
        decision.machine = machine
        with _decisions_lock:  # a thread that decided the same call first wins: one Decision, one set of demotions
            decision = _decisions.setdefault(key, decision)
    return decision


def _log_once(requested: str, served: str, reasons: tuple[str, ...]) -> None:
    key = (requested, served, reasons)
    if key in _logged:
        return
    _logged.add(key)
    logger.warning("attention backend '%s' fell back to '%s': %s", requested, served, "; ".join(reasons))


def _run(spec, runner, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, layout, extra):
    if layout != spec.layout:
        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    result = runner(query, key, value, attn_mask=masks.convert(attn_mask, spec.mask_format, query.dtype),
                    dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                    return_lse=return_lse, **extra)
    out, lse = result if return_lse else (result, None)
    if layout != spec.layout:
        out = out.transpose(1, 2)
        lse = lse.transpose(1, 2) if lse is not None else None
    return (out, lse) if return_lse else out


def dispatch_attention_fn(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask=None,
                          dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                          enable_gqa: bool = False, attention_kwargs: dict | None = None, *, backend: str | None = None,
                          layout: str = "BSHD", policy: str | None = None, return_lse: bool = False,
                          call_site: str = "attention", recorder=None):
    """Scaled dot-product attention through the selected backend.

    query (B, Sq, H, D), key/value (B, Sk, Hk, D) in the default layout 'BSHD' (diffusers'), or
    (B, H, S, D) with layout='BHSD'. attn_mask: bool (True = attend) or additive float, broadcastable
    to (B, H, Sq, Sk) by ComfyUI's rank rule (2-D = (Sq, Sk), 3-D = (B, Sq, Sk)), or a BlockMask.
    Returns the output in the input layout, and with return_lse=True also the log-sum-exp,
    (B, Sq, H) for BSHD or (B, H, Sq) for BHSD, float32.
    recorder: count this call in it (anything with Recorder's `record`/`record_error`) instead of in the
    active `recording()` block's, without a context manager per call.
    """
    if _context_parallel_on:  # a dispatcher.parallel.context_parallel() block is open somewhere
        # The routed call's local calls count in the active recorder: make it the one given by argument.
        with recording(recorder) if recorder is not None else contextlib.nullcontext():
            routed = _context_parallel(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                       attention_kwargs, backend, layout, policy, return_lse, call_site)
        if routed is not NotImplemented:
            return routed
    # Not is_compiling(): that flag is process-wide, so it is also true in threads that merely run while another
    # thread traces (eager flex_attention traces itself); this one is true only in the frame dynamo traces.
    if torch.compiler.is_dynamo_compiling():
        return compiled.dispatch_traced(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                        attention_kwargs, backend, layout, policy, return_lse, call_site, recorder)
    return dispatch_eager(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, attention_kwargs,
                          backend, layout, policy, return_lse, call_site, recorder)


def dispatch_eager(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, attention_kwargs, backend,
                   layout, policy, return_lse, call_site, recorder):
    """The eager path: decide (a dict lookup once decided), run, fall back, record."""
    checks.check_arguments(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                           attention_kwargs)
    requested = backend if backend is not None else state.active_backend()
    policy = state.active_policy() if policy is None else policy
    m = attn_mask
    fast_key = (requested, policy, layout, query.shape, key.shape, value.shape, query.dtype, key.dtype, value.dtype,
                query.device, key.device, value.device,
                None if m is None else (type(m), getattr(m, "dtype", None), getattr(m, "shape", None),
                                        getattr(m, "device", None)),
                bool(is_causal), bool(dropout_p and dropout_p > 0), scale is None, bool(enable_gqa), bool(return_lse),
                torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad),
                id(current_machine()))  # kept alive by the decision (decision.machine), so the id stays unique
    try:
        decision = _fast.get(fast_key)
        if decision is _TRUST_SENSITIVE:
            decision = _fast.get((fast_key, trust.scope_key()))
    except TypeError:  # an unhashable mask: the full path below raises the real error
        decision, fast_key = None, None
    if decision is None:
        decision = _slow_decision(fast_key, requested, policy, query, key, value, attn_mask, dropout_p, is_causal,
                                  scale, enable_gqa, return_lse, layout)
    mode = state.active_checks()
    if mode != "off":
        checks.check_values({"query": query, "key": key, "value": value, "attn_mask": attn_mask}, mode, requested)
    extra = attention_kwargs or {}
    if recorder is None:
        recorder = current_recorder()
    # Backends that failed this call are demoted only once a later one serves it: a call that no backend can
    # run (a bad argument a kernel rejects, memory exhausted everywhere) raises and changes no decision.
    failed = []  # (name, why it is demoted, the error recorded)
    candidates = decision.candidates
    for index, (name, spec, runner) in enumerate(candidates):
        last = policy == "strict" or index == len(candidates) - 1
        try:
            out = _run(spec, runner, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                       return_lse, layout, extra)
        except Exception as exc:
            if last or isinstance(exc, checks.AttentionInputError):
                raise
            error = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
            failed.append((name, f"raised {error}", error))
            continue
        if mode != "off":
            try:  # a non-finite output from finite inputs: this backend is broken for them, like one that raises
                checks.check_values({"output": out[0] if return_lse else out}, mode, name)
            except checks.AttentionInputError as exc:
                if last:
                    raise
                failed.append((name, str(exc), str(exc)))
                continue
        for failed_name, why, error in failed:
            _demote(decision, failed_name, why)
            if recorder is not None:
                recorder.record_error(call_site, failed_name, error)
        reasons = decision.reasons_for(name) if name != decision.requested else ()
        if reasons:
            _log_once(decision.requested, name, reasons)
        if recorder is not None:
            recorder.record(call_site, requested, name, reasons)  # requested may be "auto"
        return out
    raise AssertionError("unreachable: a decision always has a candidate")


def _slow_decision(fast_key, requested, policy, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                   return_lse, layout) -> Decision:
    """The first call of a signature: validate, describe, resolve `auto`, decide; then remember it for the hot path."""
    if requested != tuner.AUTO and requested not in registry.names():
        raise registry.UnknownBackendError(registry.unknown_message(requested))
    policy = state.validate_policy(policy)
    checks.check_shapes(query, key, value, layout, attn_mask)
    inputs = describe_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, layout)
    sensitive = False
    name = requested
    if requested == tuner.AUTO:
        checks.check_structure(inputs)
        name, sensitive = tuner.choose(inputs, layout=layout, tensors=(query, key, value, attn_mask))
    decision = _decision_for(name, policy, inputs)
    if fast_key is not None:
        with _decisions_lock:
            if sensitive or decision.trust_sensitive:
                _fast[fast_key] = _TRUST_SENSITIVE
                _fast[(fast_key, trust.scope_key())] = decision
            else:
                _fast[fast_key] = decision
    return decision


def _demote(decision: Decision, name: str, reason: str) -> None:
    """A backend that failed at run time is skipped for this signature from now on, with the reason."""
    with _decisions_lock:
        if not any(c[0] == name for c in decision.candidates):
            return  # another thread demoted it first
        decision.candidates = [c for c in decision.candidates if c[0] != name]
        decision.skipped.append((name, [reason]))
        decision._reasons.clear()
    logger.warning("attention backend '%s' failed (%s); falling back for these inputs", name, reason)

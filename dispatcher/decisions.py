"""Which backends may serve one call signature, best first: decided once per signature, then cached.

A decision walks the requested backend's fallback chain (policy 'fallback') or holds the requested one
alone ('strict'); every backend it skips keeps every reason why (availability on this machine and the
limits these inputs hit), and a backend that fails at run time is demoted with its error.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch

from . import caches, checks, guard, guard_rules, registry, support, trust
from .hub import KernelLoadError
from .inputs import AttentionInputs
from .rules import call_rules
from .machine import current_machine
from .log import logger
from .report import fallback_text


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


class Candidate(NamedTuple):
    """One backend a decision may run, with what running it takes for this signature."""
    name: str
    spec: Any
    runner: Callable
    transpose: bool  # the kernel's layout is not the call's: swap the sequence and head axes (views)
    convert_mask: bool  # the mask needs converting to the kernel's format (False: it takes it as given)
    guard: guard.GuardRules | None = None  # the quality guard's checks of it here (guard_rules.rules_for); None: none


@dataclass
class Decision:
    requested: str
    candidates: list  # [Candidate], best first
    skipped: list = field(default_factory=list)  # [(name, [reasons])]
    machine: object = None  # the machine it was made for (kept so its id in the cache key stays unique)
    trust_sensitive: bool = False  # a Hub backend in the chain: the decision depends on trust settings
    shapes_only: bool = False  # every backend in the chain is `universal`: dtypes, devices, grad cannot change it
    lane: Any = None  # the first candidate when it is the requested one: what eager.py's fast lane runs
    exact: str | None = None  # the caller's exact pick (`decide`'s exact): where `exact_stand_in` looks first
    # why it serves a call that asked for another backend (the call's rules: its exact stand-in, `under_rules`),
    # recorded with every call it serves
    notes: tuple[str, ...] = ()
    watch: guard.Watch = field(default_factory=guard.Watch, repr=False, compare=False)  # the guard's counts, per block
    _reasons: dict = field(default_factory=dict, repr=False, compare=False)  # served -> reasons_for(served)

    def reasons_for(self, served: str) -> tuple[str, ...]:
        """Why each backend before `served` in the chain was skipped ('name: reason')."""
        cached = self._reasons.get(served)
        if cached is None:
            order = fallback_order(self.requested)
            limit = order.index(served) if served in order else len(order)
            cached = self._reasons[served] = tuple(
                _labelled(name, r) for name, reasons in self.skipped
                if name in order and order.index(name) < limit for r in reasons)
        return cached

    def stand_in(self, usable: Callable[[Candidate], bool]) -> Candidate | None:
        """The exact candidate that serves instead of one that went wrong (the quality guard's replacement):
        `exact_stand_in` among this decision's candidates that `usable` accepts."""
        by_name = {c.name: c for c in self.candidates}
        name = exact_stand_in(self.requested, exact=self.exact,
                              usable=lambda n: n in by_name and usable(by_name[n]))
        return None if name is None else by_name[name]


def exact_stand_in(name: str, inputs: AttentionInputs | None = None, *, exact: str | None = None,
                   usable: Callable[[str], bool] | None = None, among: list[str] | None = None) -> str | None:
    """The one choice of which exact backend serves instead of `name` (a quantised or approximate kernel where the
    model asks for full precision, a kernel the quality guard caught, `auto`'s first candidate where nothing was
    judged): `exact` (the caller's own pick, `auto_fast`'s fastest exact backend for these inputs) when given, then
    `name`'s fallback chain in order (`among` instead, when given: `auto`'s candidates in priority order), the first
    that is exact, can run `inputs` here (support.reasons; not checked without inputs) and that `usable` accepts.
    `name` itself when it is exact and so; None when no exact backend is left."""
    for stand_in in ([exact] if exact is not None else []) + (fallback_order(name) if among is None else among):
        if not registry.is_known(stand_in) or registry.resolver(stand_in) is not None:
            continue
        if not registry.get(stand_in).exact or (usable is not None and not usable(stand_in)):
            continue
        if inputs is None or not support.reasons(stand_in, inputs):
            return stand_in
    return None


class UnderRules(NamedTuple):
    """What a call asking for `requested` is decided for under its rules (`rules.call_rules`: kept exact)."""
    backend: str  # the backend asked for, an auto's exact twin, or a refused kernel's exact stand-in
    note: str  # what kept the call exact, in words a host's report shows
    reasons: tuple[str, ...]  # recorded with every call it serves: why the backend asked for does not (or none)


def under_rules(requested: str, rules, inputs: AttentionInputs | None = None) -> UnderRules:
    """The one answer to what serves a call under rules that keep it exact (`dispatch_attention_fn(...,
    rules=Rules(low_precision=False))`, the eager path and the traced one alike): an auto keeps to its exact twin
    (`auto_fast` -> `auto_exact`); a kernel the rules refuse (quantised, approximate) is replaced by its exact
    stand-in for `inputs` (`exact_stand_in`; none that runs them: the chain's first, whose refusal the decision then
    says); an exact kernel serves itself. Rules that keep nothing exact (None, the default) change nothing."""
    rules = call_rules(rules)
    if rules is None:
        return UnderRules(requested, "", ())
    if registry.resolver(requested) is not None:
        twin = registry.exact_twin(requested)
        if twin is None:
            raise ValueError(f"'{requested}' picks kernels without an exact twin (registry.add_resolver's "
                             "exact_twin), so it cannot keep a call exact: ask for an exact backend for this call")
        if twin == requested:
            return UnderRules(twin, f"{requested} picks exact kernels only", ())
        return UnderRules(twin, f"{requested} kept to exact kernels ({twin})", ())
    refused = support.why_not(requested, rules=rules).rules
    if not refused:
        return UnderRules(requested, f"'{requested}' is exact", ())
    stand_in = (inputs is not None and exact_stand_in(requested, inputs)) or exact_stand_in(requested)
    note = f"'{requested}' refused, '{stand_in}' serves instead: {'; '.join(refused)}"
    return UnderRules(stand_in, note, (note,))


def _labelled(name: str, reason: str) -> str:
    # Some reasons already start with the backend's name (a kernel's own error): never "sage: sage: ...".
    return reason if reason.startswith((f"{name}:", f"{name} ", f"'{name}'")) else f"{name}: {reason}"



class DecisionKey(NamedTuple):
    """What a decision depends on besides the registry (whose changes forget them all): built by `decision_key`."""
    requested: str
    policy: str
    inputs: AttentionInputs
    layout: str
    trust: tuple  # trust.scope_key()
    machine: str  # Machine.key
    model: str
    quality_guard: tuple
    exact: str | None
    notes: tuple[str, ...]


def decision_key(requested: str, policy: str, inputs: AttentionInputs, layout: str, model: str,
                 quality_guard: tuple, exact: str | None = None, notes: tuple[str, ...] = ()) -> DecisionKey:
    """The key of the decision for these arguments in this context (trust scope, machine)."""
    return DecisionKey(requested, policy, inputs, layout, trust.scope_key(), current_machine().key, model,
                       quality_guard, exact, notes)


_decisions: dict[DecisionKey, Decision] = {}
_lock = threading.Lock()
_logged: set[tuple] = set()  # (requested, served, reasons) already logged


@caches.on_forget
def forget() -> None:
    with _lock:
        _decisions.clear()
        _logged.clear()


def fallback_order(requested: str) -> list[str]:
    order, queue = [], [requested]
    while queue:
        name = queue.pop(0)
        if name in order or not registry.is_known(name) or registry.resolver(name) is not None:
            continue
        order.append(name)
        queue.extend(registry.get(name).fallback)
    order.extend(n for n in FINAL_FALLBACKS if n not in order)
    return order


def candidate(name: str, spec, runner, inputs: AttentionInputs, layout: str, guard_rules=None) -> Candidate:
    """How a decision (and `auto`'s tuner, timing it) runs backend `name` on calls of `inputs` in `layout`."""
    # SDPA takes a bool mask of any rank as given; every other mask is converted to the kernel's format.
    convert = inputs.mask_kind not in ("none", "blockmask") and not (
        inputs.mask_kind in ("bool", "key_padding") and spec.mask_format == "native")
    return Candidate(name, spec, runner, spec.layout != layout, convert, guard_rules)


# What serves empty inputs (a batch, head count or length of 0): no kernel, whichever backend was asked for.
EMPTY = "(empty inputs)"


def empty_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse):
    """SDPA's result for empty inputs (BHSD): an empty output, or zeros for no keys (and a -inf LSE), with the
    inputs' autograd graph. The mask, causality and dropout act on no scores; SDPA's math kernel computes the rest
    (its fused kernels may not take empty inputs: the CPU flash op's LSE crashes the process on no keys)."""
    out = torch.ops.aten._scaled_dot_product_attention_math(
        q, k, v, None, 0.0, False, scale=scale, enable_gqa=bool(enable_gqa or k.shape[1] != q.shape[1]))[0]
    if not return_lse:
        return out
    return out, torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)


def _empty_decision(requested: str, layout: str, notes: tuple[str, ...]) -> Decision:
    served = Candidate(EMPTY, registry.get("_native_math"), empty_attention, layout != "BHSD", False)
    return Decision(requested, [served], lane=None if notes else served, notes=notes)


def decide(requested: str, policy: str, inputs: AttentionInputs, layout: str, quality_guard: tuple,
           exact: str | None = None, notes: tuple[str, ...] = ()) -> Decision:
    """exact: the fastest exact backend for these inputs where the caller knows it (`auto_fast`, from its timings):
    it comes second, so a kernel that fails (or fails the guard) is replaced by it rather than by its own chain.
    notes: why it serves calls that asked for another backend (`under_rules`), recorded with each."""
    checks.check_structure(inputs)
    if inputs.empty:
        return _empty_decision(requested, layout, notes)
    chain = fallback_order(requested) if policy == "fallback" else [requested]
    if exact is not None and policy == "fallback":  # the exact stand-in comes second: what replaces the kernel
        exact = exact_stand_in(requested, inputs, exact=exact, usable=lambda n: n != requested)
        if exact is not None:
            chain = [requested, exact] + [n for n in chain[1:] if n != exact]
    specs = [registry.get(n) for n in chain]
    decision = Decision(requested, [], trust_sensitive=any(s.hub is not None for s in specs),
                        shapes_only=all(s.universal for s in specs), exact=exact, notes=notes)
    for name, spec in zip(chain, specs):
        reasons = support.reasons(name, inputs)  # machine, trust, these inputs' limits, semantics
        if not reasons:
            try:
                runner = registry.prepare(name)
            except KernelLoadError as exc:
                reasons = [str(exc)]
            else:
                decision.candidates.append(candidate(name, spec, runner, inputs, layout,
                                                     guard_rules.rules_for(spec, quality_guard, inputs)))
                continue
        decision.skipped.append((name, reasons))
    if not decision.candidates:
        raise BackendNotSupportedError(requested, inputs.describe(), decision.skipped, policy)
    decision.lane = _lane(decision)
    return decision


def _lane(decision: Decision):
    """The candidate eager.py's fast lane runs and records as served with no reason: the first, when it is the one
    requested and no note goes with it (a stand-in's calls take the full path, which records why)."""
    first = decision.candidates[0] if decision.candidates else None
    return first if first is not None and first.name == decision.requested and not decision.notes else None


def decision_for(requested: str, policy: str, inputs: AttentionInputs, layout: str, model: str,
                 quality_guard: tuple, exact: str | None = None, notes: tuple[str, ...] = ()) -> Decision:
    """The decision for a signature, per model (demotions by the quality guard belong to the model they were
    seen on) and guard setting; exact, notes: see `decide`."""
    key = decision_key(requested, policy, inputs, layout, model, quality_guard, exact, notes)
    decision = _decisions.get(key)
    if decision is None:
        decision = decide(requested, policy, inputs, layout, quality_guard, exact, notes)
        decision.machine = current_machine()  # a simulated machine (use_machine) gets its own decisions
        with _lock:  # a thread that decided the same call first wins: one Decision, one set of demotions
            decision = _decisions.setdefault(key, decision)
    return decision


def log_once(requested: str, served: str, reasons: tuple[str, ...]) -> None:
    key = (requested, served, reasons)
    if key in _logged:
        return
    _logged.add(key)
    logger.warning("attention backend '%s' fell back to '%s': %s", requested, served, fallback_text(requested, reasons))


def demote(decision: Decision, name: str, reason: str) -> None:
    """A backend that failed at run time is skipped for this signature from now on, with the reason."""
    with _lock:
        if not any(c.name == name for c in decision.candidates):
            return  # another thread demoted it first
        decision.candidates = [c for c in decision.candidates if c.name != name]
        decision.lane = _lane(decision)
        decision.skipped.append((name, [reason]))
        decision._reasons.clear()
    logger.warning("attention backend '%s' failed (%s); falling back for these inputs", name, reason)

"""Why backend `name` cannot run here, or cannot run this call: the one answer, every reason in one fixed order.

    machine           what this machine lacks of its requirements (device, GPU generation, packages, a probe call)
    trust             a Hub kernel whose publisher is not trusted, or remote code disabled
    inputs            the call's shapes and flags beyond the limits its spec declares
    semantics         what its spec declares beyond shapes: SDPA's broadcasting of a key/value batch of 1
    attention_kwargs  keys of the call's attention_kwargs its function does not pass on to its kernel

`why_not(name)` answers for the machine alone (the nodes' dropdown and queue-time check, the install plan,
`validate_backend`, listings); `why_not(name, inputs, attention_kwargs=...)` for one call (the decision, `auto`'s
tuner). Nothing else combines these producers, so what one of them refuses every other refuses, in the same words.
What rules the machine out (a device, a GPU generation, a torch: `machine_bound`) is said alone: "needs an NVIDIA
CUDA GPU; this machine has a CPU", not also that the call's device and dtype are beyond the kernel's limits.

A caller's own rules sit on top, as a `Rules` value (rules.py; `why_not(..., rules=Rules(...))`), and refuse here, as
`rules` reasons: exact kernels only (`auto_exact`), full precision (a call with low_precision_attention=False), Hub
kernels only once fetched (`auto` never downloads), an approximate kernel only as the model's prediction verdict
allows, a memory cap for kernels that materialise the score matrix (`auto`'s tuning, the bench), and the
context-parallel mode a kernel is the local kernel of (ring modes need its LSE; no mode cuts a BlockMask or takes a
mask with is_causal: `context_parallel_reasons`, which dispatcher.parallel asks too). No caller words a refusal
itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from . import hub, prediction, registry, trust
from .inputs import AttentionInputs
from .machine import Machine
from .requirements import Lack, Unmet
from .rules import NO_RULES, Rules
from .spec import STANDARD_ARGUMENTS


class WhyNot(NamedTuple):
    """Every reason backend `name` cannot run, by kind, in the order `reasons` lists them."""
    machine: tuple[str, ...] = ()
    trust: tuple[str, ...] = ()
    inputs: tuple[str, ...] = ()
    semantics: tuple[str, ...] = ()
    attention_kwargs: tuple[str, ...] = ()
    rules: tuple[str, ...] = ()  # a caller's own rules on top (its `Rules`)
    # `machine` as records (requirements.Lack: the requirement, its reason): what a reader that sorts reasons by
    # their fix reads (the install plan), never a second walk of the requirements
    lacks: tuple = ()

    @property
    def reasons(self) -> list[str]:
        return [reason for kind in self[:_KINDS] for reason in kind]

    @property
    def runs(self) -> bool:
        return not any(self[:_KINDS])


_KINDS = WhyNot._fields.index("lacks")  # the reason kinds come first, in order


def why_not(name: str, inputs: AttentionInputs | None = None, *, attention_kwargs=None,
            machine: Machine | None = None, rules: Rules = NO_RULES) -> WhyNot:
    """Why backend `name` cannot run on `machine` (default: this one), and, given `inputs` (a call's signature)
    and `attention_kwargs` (its keys), why it cannot run that call; then what `rules` refuses. Raises
    UnknownBackendError for an unknown name. A backend's own checks that raise become its reason: they refuse that
    backend, never the question."""
    spec = registry.get(name)
    precision = _precision_refusal(spec, rules)
    if precision:  # decided by the spec alone: its package is not even imported (comfy_kitchen's import took 4-8 s
        # of a CPU's first auto_exact call, for a kernel auto_exact never runs)
        return WhyNot(rules=precision)
    try:
        check = registry.requirement_check(name, machine)
    except registry.UnknownBackendError:
        raise
    except Exception as exc:
        failed = f"its requirement check failed ({type(exc).__name__}: {exc})"
        check = Unmet((failed,), False, (Lack(None, failed),))
    lacks, machine_bound = check.reasons, check.machine_bound
    if machine_bound:  # the whole answer: no call's dtype, trust setting, key or caller's rule changes it
        return WhyNot(lacks, lacks=check.lacks)
    untrusted = ()
    if spec.hub is not None:
        verdict = trust.decide(spec.hub.repo_id)
        untrusted = () if verdict.allowed else (verdict.reason,)
    limits = semantics = ()
    if inputs is not None:
        try:  # a GPU generation is both a requirement and an input limit: said once, as the machine's
            limits = tuple(r for r in spec.not_supported_reasons(inputs) if r not in lacks)
            semantics = tuple(semantic_reasons(spec, inputs))
        except Exception as exc:
            limits = (f"its input check failed ({type(exc).__name__}: {exc})",)
    keys = tuple(attention_kwargs_reasons(spec, attention_kwargs)) if attention_kwargs else ()
    why = WhyNot(lacks, untrusted, limits, semantics, keys, lacks=check.lacks)
    if rules == NO_RULES:
        return why
    return why._replace(rules=tuple(_rule_reasons(name, spec, inputs, rules, why.runs)))


def _precision_refusal(spec, rules: Rules) -> tuple[str, ...]:
    """What `rules` refuses of a kernel that is not exact, by its spec alone."""
    if spec.exact or not (rules.exact_only or not rules.low_precision):
        return ()
    kind = f"a{'n' if spec.precision == 'approximate' else ''} {spec.precision} kernel"
    if rules.exact_only:
        return (f"{kind}: auto_exact runs exact kernels only",)
    return (f"{kind}: the call asks for full precision (low_precision_attention=False)",)


def _rule_reasons(name: str, spec, inputs, rules: Rules, runs: bool) -> list[str]:
    found = []
    if rules.fetched is not None and spec.hub is not None and runs and spec.hub.repo_id not in rules.fetched:
        found.append(f"Hub kernel '{spec.hub.repo_id}' is not fetched or loaded yet; auto never downloads code: "
                     f"select '{name}' once (or run install.py) to make it a candidate")
    if spec.approximate and rules.model is not None:
        refused = prediction.refusal(rules.model, rules.block)
        if refused:
            found.append(refused)
    if rules.memory_cap is not None and spec.quadratic_memory and inputs is not None:
        scores = score_matrix_bytes(inputs)
        if scores > rules.memory_cap:
            found.append(f"it materialises the {_size(scores)} score matrix, over the memory cap of "
                         f"{_size(rules.memory_cap)}")
    mode = rules.context_parallel
    if mode not in (None, "none"):
        if mode not in spec.context_parallel_modes:
            found.append(f"context-parallel mode '{mode}' merges partial attention outputs by their log-sum-exp, "
                         "which it does not return (its spec has lse=False); Ulysses alone (ring_degree=1) runs any "
                         "backend")
        if inputs is not None:
            found.extend(context_parallel_reasons(inputs))
    return found


def context_parallel_reasons(inputs: AttentionInputs) -> list[str]:
    """What context parallelism refuses of a call, whichever backend would run it: `why_not`'s context-parallel
    rule on a call, and dispatcher.parallel's own check (which may run a pseudo-backend, `auto`)."""
    found = []
    if inputs.mask_kind == "blockmask":
        found.append("a FlexAttention BlockMask cannot be sharded for context parallelism; pass a bool or additive "
                     "mask tensor instead")
    if inputs.is_causal and inputs.mask_kind != "none":
        found.append("is_causal=True with attn_mask is not supported under context parallelism (SDPA, and the "
                     "dispatcher outside it, apply both: the mask and the top-left causal diagonal): fold the "
                     "diagonal into attn_mask (mask & torch.ones(Lq, Lk, dtype=torch.bool).tril()), or drop attn_mask")
    return found


def score_matrix_bytes(inputs: AttentionInputs) -> int:
    """The (B, H, Lq, Lk) score matrix of a call, in float32: what a `quadratic_memory` kernel materialises."""
    return inputs.batch * inputs.heads_q * inputs.len_q * inputs.len_kv * 4


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} bytes"


def reasons(name: str, inputs: AttentionInputs | None = None, *, attention_kwargs=None,
            machine: Machine | None = None, rules: Rules = NO_RULES) -> list[str]:
    """`why_not(...).reasons`: every reason, in order (empty when it can run)."""
    return why_not(name, inputs, attention_kwargs=attention_kwargs, machine=machine, rules=rules).reasons


def installing_helps(name: str, machine: Machine | None = None) -> bool:
    """Whether installing something (a package, a kernel, an opt-in) could make backend `name` run on `machine`:
    False when the machine itself rules it out (its device, GPU generation or torch), whose reasons then carry
    no install hint."""
    return not registry.requirement_check(name, machine).machine_bound


def availability_reasons(name: str, machine: Machine | None = None) -> list[str]:
    """Why backend `name` cannot run on this machine at all (empty when it can): `why_not` for no call."""
    return why_not(name, machine=machine).reasons


# ---- auto's own rules, on top ------------------------------------------------------------------------------------

def for_auto(name: str, inputs: AttentionInputs, *, exact_only: bool, attention_kwargs=None,
             fetched: frozenset[str] | set[str] = frozenset(), model: str | None = None,
             block: str | None = None) -> WhyNot:
    """`why_not` for a call under `auto`'s rules: `auto_exact` (exact_only) times exact kernels only, `auto` never
    downloads code, so a Hub kernel that could run is a candidate only once its repo is `fetched` (fetched or
    loaded: `hub.fetched_repos()`), and an approximate kernel serves `model` only as its prediction-level verdict
    allows at call site `block` (dispatcher/prediction.py)."""
    return why_not(name, inputs, attention_kwargs=attention_kwargs,
                   rules=Rules(exact_only=exact_only, fetched=frozenset(fetched), model=model, block=block))


def trust_decides(name: str, why: WhyNot, *, exact_only: bool) -> bool:
    """Whether trust settings alone could change `for_auto`'s answer `why` for backend `name`: a Hub kernel that
    `auto` may consider, with nothing but trust (and its fetch) between it and the candidates."""
    spec = registry.get(name)
    return (spec.hub is not None and (spec.exact or not exact_only)
            and not (why.machine or why.inputs or why.semantics or why.attention_kwargs))


# ---- semantics: what a spec declares beyond shapes ---------------------------------------------------------------

def semantic_reasons(spec, inputs: AttentionInputs) -> list[str]:
    """Why `spec` cannot run `inputs` for what its limits do not describe: a key/value batch of 1 broadcast over
    the query's batch (AttentionInputs.batch_kv), which only a spec with broadcast_kv takes."""
    batch_kv = getattr(inputs, "batch_kv", None)
    if batch_kv is None or batch_kv == inputs.batch or spec.broadcast_kv:
        return []
    return [f"key/value batch {batch_kv} broadcast over query batch {inputs.batch} is not supported (SDPA "
            f"broadcasts it; so do {', '.join(_backends_where(lambda s: s.broadcast_kv)) or 'no backend'}); "
            f"or expand key and value to batch {inputs.batch}"]


def _backends_where(test) -> list[str]:
    found = []
    for name in registry.names():
        try:
            spec = registry.get(name)
        except registry.UnknownBackendError:  # removed by another thread
            continue
        if test(spec):
            found.append(name)
    return found


def _honours(spec, key: str) -> bool:
    return spec.attention_kwargs is None or key in spec.attention_kwargs


# ---- attention_kwargs -------------------------------------------------------------------------------------------

class AttentionKwargsError(TypeError):
    """attention_kwargs holds a key that none of the backends allowed to run the call passes on to its kernel."""


def attention_kwargs_reasons(spec, keys) -> list[str]:
    """One reason per attention_kwargs key backend `spec` does not pass on to its kernel (a key that repeats an
    argument of dispatch_attention_fn is refused by every backend)."""
    return [_refused_key(key) for key in sorted(keys) if key in STANDARD_ARGUMENTS or not _honours(spec, key)]


def _refused_key(key: str) -> str:
    """The one wording of a refused attention_kwargs key: `why_not`'s reason and AttentionKwargsError's line."""
    if key in STANDARD_ARGUMENTS:
        return (f"attention_kwargs key {key!r} repeats an argument of dispatch_attention_fn: pass {key}=... as an "
                f"argument")
    names = _backends_where(lambda s: _honours(s, key))  # in priority order
    if not names:
        return f"attention_kwargs key {key!r} is honoured by no attention backend: drop it"
    return (f"attention_kwargs key {key!r} is honoured by {', '.join(names)} only: select one of them "
            f"(backend='{names[0]}'), or drop the key")


def candidates_for_attention_kwargs(requested: str, policy: str, candidates: list, attention_kwargs) -> list:
    """The candidates (a Decision's [(name, spec, runner)], best first) that honour every attention_kwargs key:
    `why_not`'s attention_kwargs reasons applied to a decision (which is made per signature, without the keys).

    Called once per call that has attention_kwargs, before running any candidate: a backend that would drop a
    key, or raise on it, never runs. A key that is one of the call's own arguments (scale, is_causal, ...) and
    a key no allowed backend honours raise AttentionKwargsError naming the key, the backends that honour it
    and what to do (in `why_not`'s words), never blaming a backend that merely ran last.
    """
    if not attention_kwargs:
        return candidates
    keys = frozenset(attention_kwargs)
    clashing = sorted(keys & STANDARD_ARGUMENTS)
    if clashing:
        raise AttentionKwargsError("; ".join(_refused_key(key) for key in clashing))
    # The predicate attention_kwargs_reasons words (no reason text is built per call: this runs on every call)
    kept = [c for c in candidates if all(_honours(c[1], key) for key in keys)]
    if kept:
        return kept
    tried = ", ".join(f"'{c[0]}'" for c in candidates)
    raise AttentionKwargsError("\n  ".join(
        [f"attention backend '{requested}' ({policy} policy) cannot honour attention_kwargs {sorted(keys)}: none "
         f"of the backends that can run this call ({tried}) passes {'it' if len(keys) == 1 else 'them'} on to its "
         f"kernel"] + [_refused_key(key) for key in sorted(keys)]))


# ---- listings ---------------------------------------------------------------------------------------------------

@dataclass
class BackendStatus:
    name: str
    available: bool
    reasons: list[str]
    constraints: dict[str, Any]
    loaded: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "available": self.available, "reasons": self.reasons,
                "loaded": self.loaded, **self.constraints}


def list_backends(machine: Machine | None = None) -> list[BackendStatus]:
    """Every registered backend, in priority order, with whether it can run on this machine and why not."""
    loaded = hub.loaded_kernels()
    statuses = []
    for name in registry.names():
        try:
            spec = registry.get(name)
            found = availability_reasons(name, machine)
        except registry.UnknownBackendError:  # removed by another thread while listing
            continue
        mine = [k.as_dict() for k in loaded if spec.hub and k.repo_id == spec.hub.repo_id]
        statuses.append(BackendStatus(name, not found, found, spec.constraints(), mine))
    return statuses

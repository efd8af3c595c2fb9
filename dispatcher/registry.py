"""The one registry of backends: built-in specs, user-registered ones, and what this machine can run."""

from __future__ import annotations

import difflib
import functools
import threading
from typing import Any, Callable

from . import caches, hub
from .machine import Machine, current_machine, track
from .requirements import Package, Unmet, unmet
from .spec import FLOATS, BackendSpec, HeadDims, HubKernel, honoured_kwargs

_specs: dict[str, BackendSpec] = {}
_lock = threading.RLock()
# (name, Machine.key) -> Unmet: what that machine lacks of the backend's requirements.
_availability: dict[tuple[str, str], Unmet] = {}
# The one priority list (dispatcher/backends/__init__.py sets it): listings and `auto` follow it; backends
# it does not name come after, in registration order.
_priority: dict[str, int] = {}
# Names that are not kernels but choose one per call (`auto_exact`, `auto_fast`, `auto`): name ->
# resolver(inputs, call, *, model, timing) returning (backend name, whether the choice depends on trust
# settings, whether it holds for the later calls of the same signature and block). Registered by their wing.
# `_live` names those whose choice needs the call's live values (a traced call then runs as an opaque op,
# deciding at run time).
_resolvers: dict[str, Callable] = {}
_twins: dict[str, str | None] = {}  # pseudo-backend -> its exact twin (add_resolver)
_live: set[str] = set()


class UnknownBackendError(ValueError):
    pass


class BackendUnavailableError(RuntimeError):
    def __init__(self, name: str, reasons: list[str]):
        self.name, self.reasons = name, list(reasons)
        super().__init__(f"attention backend '{name}' cannot run on this machine: " + "; ".join(reasons))


def add(spec: BackendSpec, *, replace: bool = False) -> BackendSpec:
    with _lock:
        if spec.name in _specs and not replace:
            raise ValueError(f"an attention backend named '{spec.name}' is already registered; "
                             "pass replace=True to override it")
        _specs[spec.name] = spec
        _availability.clear()
    for requirement in spec.requirements:  # their versions become part of the machine's description
        track(*getattr(requirement, "distributions", ()))
    caches.forget()  # decisions depend on the registry
    return spec


def remove(name: str) -> None:
    with _lock:
        spec = _specs.get(name)
        if spec is None or not spec.custom:
            raise ValueError(f"only custom backends can be removed; '{name}' is {'built in' if spec else 'not registered'}")
        del _specs[name]
        _availability.clear()
    caches.forget()


def set_priority(order) -> None:
    """The one priority list, best first (built-in backends; a custom one may be named too)."""
    with _lock:
        _priority.clear()
        _priority.update((name, i) for i, name in enumerate(order))
    caches.forget()


def names() -> list[str]:
    """Backends the priority list names, in its order; then the other built-in ones, then custom ones, each in
    registration order."""
    with _lock:  # another thread may be registering one (iterating a changing dict raises)
        current = list(_specs.values())
        rank = dict(_priority)
    listed = sorted((s.name for s in current if s.name in rank), key=rank.__getitem__)
    return (listed + [s.name for s in current if s.name not in rank and not s.custom]
            + [s.name for s in current if s.name not in rank and s.custom])


def priority() -> tuple[str, ...]:
    """The priority list in force (a custom backend may be put in it with `set_priority`)."""
    with _lock:
        return tuple(sorted(_priority, key=_priority.__getitem__))


def builtin_names() -> tuple[str, ...]:
    return tuple(n for n in names() if not _specs[n].custom)


def add_resolver(name: str, resolve: Callable, *, needs_live_values: bool = False, exact_twin: str | None = None
                 ) -> None:
    """A pseudo-backend: `resolve(inputs, call, *, model, timing)` -> (backend name, trust-sensitive, settled),
    decided per signature, model and block (`call.call_site`); settled False: the next call asks again;
    needs_live_values: its choice cannot be made from a signature alone (in a trace); exact_twin: the
    pseudo-backend whose choice replaces a quantised pick where it fails, and which a call that must stay exact asks
    instead (`name` itself when it picks exact kernels only; None: it cannot keep a call exact)."""
    with _lock:
        _resolvers[name] = resolve
        _twins[name] = exact_twin
        if needs_live_values:
            _live.add(name)
        else:
            _live.discard(name)
    caches.forget()


def exact_twin(name: str) -> str | None:
    return _twins.get(name)


def needs_live_values(name: str) -> bool:
    return name in _live


def resolver(name: str) -> Callable | None:
    return _resolvers.get(name)


def resolver_names() -> list[str]:
    return list(_resolvers)


def is_variant(name: str) -> bool:
    """A kernel variant: a name starting with '_' (SDPA's pinned kernels `_native_flash`, `_native_math`, ...;
    `_flash_3`), what `auto` times and a fallback chain picks. Hosts leave it out of their menus (the nodes'
    dropdown) and take it by name (the library's backend=, an API prompt)."""
    return name.startswith("_")


def is_known(name) -> bool:
    """A registered backend or a pseudo-backend that picks one."""
    return isinstance(name, str) and (name in _specs or name in _resolvers)


def get(name: str) -> BackendSpec:
    spec = _specs.get(name)
    if spec is None:
        raise UnknownBackendError(unknown_message(name))
    return spec


def unknown_message(name) -> str:
    valid = resolver_names() + names()
    close = difflib.get_close_matches(str(name), valid, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return f"unknown attention backend {name!r}.{hint} Valid backends: {', '.join(valid)}"


def requirement_reasons(name: str, machine: Machine | None = None) -> list[str]:
    """What this machine lacks of backend `name`'s requirements (empty when it has them all): `requirement_check`'s
    reasons. The machine part of `support.why_not`, which adds trust and the call's own limits: ask there."""
    return list(requirement_check(name, machine).reasons)


def requirement_check(name: str, machine: Machine | None = None) -> Unmet:
    """`requirements.unmet` for backend `name` on `machine` (default: this one), cached per machine."""
    spec = get(name)
    machine = machine or current_machine()
    key = (name, machine.key)
    with _lock:
        cached = _availability.get(key)
        if cached is None:
            cached = _availability[key] = unmet(spec.requirements, machine)
    return cached


def forget_availability() -> None:
    """Ask the machine's requirements again (after an install). Not caches.forget's job: availability is an input
    of decisions, kept per machine, and the install that calls this also makes a new machine (machine.refresh()),
    whose decisions are made afresh under its own id; whatever changes the registry clears it with the decisions."""
    with _lock:
        _availability.clear()


def prepare(name: str) -> Callable[..., Any]:
    """The callable that runs backend `name`, with its Hub kernel loaded (trust-checked):
    `runner(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, **attention_kwargs)`."""
    spec = get(name)
    fn = spec.fn
    if spec.hub is not None:
        kernel_fn, _ = hub.load(spec.hub)
        fn = functools.partial(fn, kernel=kernel_fn)
    return _by_keyword(fn) if spec.custom else fn


def _by_keyword(fn):
    """A custom backend's function takes the standard arguments by keyword (register_backend's protocol); the
    built-in ones take them by position too, which the dispatcher passes on every call (no keyword matching)."""
    def runner(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, **attention_kwargs):
        return fn(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                  enable_gqa=enable_gqa, return_lse=return_lse, **attention_kwargs)
    return runner


def register_backend(name: str, fn: Callable[..., Any], *, layout: str = "BSHD", devices=("cpu", "cuda"),
                     dtypes=FLOATS, head_dims: HeadDims = HeadDims(), masks=("none",), mask_format: str = "additive",
                     causal: bool = False, scale: bool = True, gqa: bool = False, dropout: bool = False,
                     lse: bool = False, backward: bool = True, requires=(), fallback=("native",),
                     error_bound: float = 2e-2, description: str = "", hub_kernel: HubKernel | None = None,
                     quantised: bool = False, approximate: bool = False, mask_with_causal: bool = False,
                     broadcast_kv: bool = False, quadratic_memory: bool = False, replace: bool = False) -> BackendSpec:
    """Register your own attention function under `name` (like transformers' AttentionInterface.register).

    `fn(query, key, value, *, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse)` receives
    tensors in `layout` and a mask already converted to `mask_format` ('additive', 'bool', 'native' =
    as given, or a name added with `masks.register_mask_format`). Declare what it supports: the
    dispatcher never hands it inputs it did not declare, and says why when it falls back. `quantised`: its
    error is above bf16 rounding (int8/fp8 arithmetic): `auto_exact` never picks it, `auto_fast` only after
    judging it on the model's activations, and the quality guard watches it by default. `approximate`: it leaves
    part of the attention out by design (block-sparse, windowed): like a quantised one, but `auto_fast` admits it
    within its own `error_bound` on the model's activations, and the guard holds it to twice that.
    `mask_with_causal`: it takes attn_mask and is_causal=True together, applying both as SDPA does (else such calls
    skip it). `broadcast_kv`: it takes key/value of batch 1 against a larger query batch (SDPA's broadcasting).
    `quadratic_memory`: it materialises the (B, H, Lq, Lk) score matrix (`auto` skips it where that would not fit).
    The attention_kwargs keys it honours are read from `fn`'s signature (keyword parameters beyond the standard
    ones; a **kwargs parameter takes any key); a call with another key never runs it.
    """
    if not name or not isinstance(name, str):
        raise ValueError("a custom attention backend needs a non-empty string name")
    existing = _specs.get(name)
    if (existing is not None and not existing.custom) or name in _resolvers:
        raise ValueError(f"'{name}' is a built-in backend name; choose another name for a custom backend")
    if not callable(fn):
        raise TypeError(f"fn must be callable; got {type(fn).__name__}")
    from .masks import mask_formats
    if mask_format not in mask_formats():
        raise ValueError(f"unknown mask_format {mask_format!r}; valid formats: {', '.join(mask_formats())}")
    spec = BackendSpec(
        name=name, family="custom", description=description or f"custom backend {name}", fn=fn, layout=layout,
        devices=frozenset(devices), dtypes=frozenset(dtypes), head_dims=head_dims,
        # A Hub kernel needs the kernels library, like the built-in hub backends: say so in availability.
        requires=tuple(requires) + ((kernels_requirement(hub_kernel),) if hub_kernel is not None else ()),
        masks=frozenset(masks) | {"none"}, mask_format=mask_format, causal=causal, scale=scale, gqa=gqa,
        dropout=dropout, lse=lse, backward=backward, fallback=tuple(fallback), error_bound=error_bound,
        hub=hub_kernel, custom=True, quantised=bool(quantised), approximate=bool(approximate),
        mask_with_causal=bool(mask_with_causal), attention_kwargs=honoured_kwargs(fn), broadcast_kv=bool(broadcast_kv),
        quadratic_memory=bool(quadratic_memory),
    )
    return add(spec, replace=replace)


def kernels_requirement(hub_kernel: HubKernel) -> Package:
    return hub_kernel.requirement


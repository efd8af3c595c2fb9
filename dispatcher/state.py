"""Which backend, policy and checks apply to the current call.

A process default (from DIFFUSERS_ATTN_BACKEND, or `set_attention_backend`) and context-local
overrides (`attention_backend(...)`, contextvars): ComfyUI runs prompts on a worker thread while the
server thread answers routes, and each sees only its own overrides. So a thread started inside a block does
not see it (Python starts a thread with an empty context): see `attention_backend` for carrying it over.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from typing import NamedTuple

from . import env, guard, registry, support
from .log import logger


POLICIES = ("fallback", "strict")
CHECK_MODES = ("off", "raise", "warn")

_lock = threading.Lock()
_default_backend: str | None = None  # None: not read from the environment yet
_default_policy = "fallback"
_checks_override: str | None = None  # registry switch; None: follow DIFFUSERS_ATTN_CHECKS


class Scope(NamedTuple):
    """What the `with` blocks of this context set (None: not set here, the process default applies)."""
    backend: str | None = None
    policy: str | None = None
    checks: str | None = None
    model: str | None = None
    guard: tuple | None = None


# One context variable for all of them: the eager path reads them with one lookup per call.
_NO_SCOPE = Scope()
_scope: contextvars.ContextVar[Scope] = contextvars.ContextVar("attn_dispatch_scope", default=_NO_SCOPE)
_defaults: tuple | None = None  # (backend, policy, model, guard) outside any block; None: work it out again
_changes = 0  # how many times a process default was set
_default_guard = guard.DEFAULT

# The model scope of calls that name none: accuracy verdicts made under it stay in this process (never on disk),
# since nothing says which model they were measured on.
UNSCOPED_MODEL = "unscoped"


def validate_backend(name: str) -> str:
    """Check a name and its requirements, and load its Hub kernel, so a first call cannot fail half-initialised."""
    if not isinstance(name, str):
        raise TypeError(f"backend must be a string name; got {type(name).__name__}")
    if registry.resolver(name) is not None:  # a pseudo-backend (`auto`): resolved per call signature
        return name
    spec = registry.get(name)
    reasons = support.availability_reasons(spec.name)
    if reasons:
        raise registry.BackendUnavailableError(spec.name, reasons)
    registry.prepare(spec.name)
    return spec.name


def validate_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"unknown fallback policy {policy!r}; valid policies: {', '.join(POLICIES)}")
    return policy


def default_backend() -> str:
    global _default_backend
    if _default_backend is None:
        with _lock:
            if _default_backend is None:
                wanted = env.value(env.ATTN_BACKEND, "native")
                if not registry.is_known(wanted):
                    logger.error("%s=%s: %s; using 'native'", env.ATTN_BACKEND, wanted, registry.unknown_message(wanted))
                    wanted = "native"
                _default_backend = wanted
    return _default_backend


def set_attention_backend(name: str) -> None:
    """Set the process default (validated and prepared)."""
    global _default_backend
    name = validate_backend(name)
    with _lock:
        _default_backend = name
    _defaults_changed()


def reset_default_backend() -> None:
    """Forget the process default so DIFFUSERS_ATTN_BACKEND is read again."""
    global _default_backend
    with _lock:
        _default_backend = None
    _defaults_changed()


@contextlib.contextmanager
def _scoped(value, **changes):
    """A block in which `changes` replace this context's settings; the previous ones return on exit."""
    token = _scope.set(_scope.get()._replace(**changes))
    try:
        yield value
    finally:
        _scope.reset(token)


def current() -> tuple[tuple[str, str, str, tuple], str]:
    """((backend, policy, model, guard), checks mode) in force here: what the eager path reads on every call."""
    scope = _scope.get()
    # _default_checks() written out: one Python call less on every attention call
    checks = scope.checks or _checks_override or ("raise" if _checks_from_env() else "off")
    if scope is _NO_SCOPE:  # no block open: the process defaults, worked out once per change
        return _defaults or _process_defaults(), checks
    backend, policy, _, model, guard_setting = scope
    return (backend or default_backend(), policy or _default_policy, model or UNSCOPED_MODEL,
            guard_setting or _default_guard), checks


def _process_defaults() -> tuple:
    global _defaults
    seen = _changes
    resolved = (default_backend(), _default_policy, UNSCOPED_MODEL, _default_guard)
    with _lock:
        if seen == _changes:  # no setter ran meanwhile (else this may mix old and new values: not kept)
            _defaults = resolved
    return resolved


def _defaults_changed() -> None:
    """Called by every setter of a process default, after the change."""
    global _defaults, _changes
    with _lock:
        _changes += 1
        _defaults = None


def active_backend() -> str:
    return _scope.get().backend or default_backend()


def attention_backend(name: str = "native", *, policy: str | None = None):
    """Use backend `name` for the calls inside the block; the previous one returns on exit, errors included.

    The block belongs to this context (a contextvar), not to the process as diffusers' `attention_backend` does:
    a thread started inside it begins with an empty context, so its calls use the process default
    (`set_attention_backend`), not `name`; the same goes for every block of this module (policy, checks, model
    scope, quality guard). To carry the blocks into a thread, run its target in a copy of this context:
    `threading.Thread(target=contextvars.copy_context().run, args=(work,))`, or pass `backend=` to the call."""
    name = validate_backend(name)
    if policy is None:
        return _scoped(name, backend=name)
    return _scoped(name, backend=name, policy=validate_policy(policy))


def set_fallback_policy(policy: str) -> None:
    global _default_policy
    _default_policy = validate_policy(policy)
    _defaults_changed()


def active_policy() -> str:
    return _scope.get().policy or _default_policy


def fallback_policy(policy: str):
    return _scoped(policy, policy=validate_policy(policy))


def set_checks(mode: str | bool | None) -> None:
    """Registry switch for checks: True/'raise', 'warn', False/'off', or None to follow DIFFUSERS_ATTN_CHECKS."""
    global _checks_override
    _checks_override = _check_mode(mode) if mode is not None else None


def _check_mode(mode) -> str:
    if mode is True:
        return "raise"
    if mode is False:
        return "off"
    if mode not in CHECK_MODES:
        raise ValueError(f"unknown checks mode {mode!r}; valid modes: {', '.join(CHECK_MODES)}")
    return mode


_checks_from_env = env.flag_reader(env.ATTN_CHECKS)  # read on every call: a change applies to the next call


def active_checks() -> str:
    return _scope.get().checks or _default_checks()


def _default_checks() -> str:
    return _checks_override or ("raise" if _checks_from_env() else "off")


def attention_checks(mode: str | bool = "raise"):
    return _scoped(None, checks=_check_mode(mode))


def validate_model(model) -> str:
    if not isinstance(model, str) or not model.strip():
        raise ValueError(f"model must be a non-empty string naming the model whose activations these calls carry "
                         f"(accuracy verdicts and quality-guard demotions are kept per model); got {model!r}")
    return model


def active_model() -> str:
    return _scope.get().model or UNSCOPED_MODEL


def model_scope(model: str):
    """Calls inside the block carry activations of `model` (a stable name or content fingerprint): `auto`'s
    accuracy verdicts and the quality guard's demotions are kept per model, and reused from disk only for it."""
    return _scoped(model, model=validate_model(model))


def set_quality_guard(mode: str = guard.DEFAULT_MODE, every: int | None = None) -> None:
    """Process default of the quality guard (see dispatcher.guard): 'quantised' | 'all' | 'off'; every: one call in
    N of each call site after its first (0 / None: sized on this machine, guard_sizing.py)."""
    global _default_guard
    _default_guard = guard.settings(mode, every)
    _defaults_changed()


def active_guard() -> tuple:
    return _scope.get().guard or _default_guard


def quality_guard(mode: str = "all", every: int | None = None):
    """The quality guard for the calls inside the block (mode 'quantised' | 'all' | 'off'; every: one call in N of
    each call site after its first, 0 / None: sized on this machine, guard_sizing.py)."""
    return _scoped(None, guard=guard.settings(mode, every))

"""Which backend, policy and checks apply to the current call.

A process default (from DIFFUSERS_ATTN_BACKEND, or `set_attention_backend`) and context-local
overrides (`attention_backend(...)`, contextvars): ComfyUI runs prompts on a worker thread while the
server thread answers routes, and each sees only its own overrides.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading

from . import env, guard, registry

logger = logging.getLogger("attention_dispatch")

POLICIES = ("fallback", "strict")
CHECK_MODES = ("off", "raise", "warn")

_lock = threading.Lock()
_default_backend: str | None = None  # None: not read from the environment yet
_default_policy = "fallback"
_checks_override: str | None = None  # registry switch; None: follow DIFFUSERS_ATTN_CHECKS

_active_backend: contextvars.ContextVar[str | None] = contextvars.ContextVar("attn_dispatch_backend", default=None)
_active_policy: contextvars.ContextVar[str | None] = contextvars.ContextVar("attn_dispatch_policy", default=None)
_active_checks: contextvars.ContextVar[str | None] = contextvars.ContextVar("attn_dispatch_checks", default=None)
_active_model: contextvars.ContextVar[str | None] = contextvars.ContextVar("attn_dispatch_model", default=None)
_active_guard: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("attn_dispatch_guard", default=None)
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
    reasons = registry.availability_reasons(spec.name)
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


def reset_default_backend() -> None:
    """Forget the process default so DIFFUSERS_ATTN_BACKEND is read again."""
    global _default_backend
    with _lock:
        _default_backend = None


def active_backend() -> str:
    return _active_backend.get() or default_backend()


@contextlib.contextmanager
def attention_backend(name: str = "native", *, policy: str | None = None):
    """Use backend `name` for the calls inside the block; the previous one returns on exit, errors included."""
    name = validate_backend(name)
    if policy is not None:
        validate_policy(policy)
    backend_token = _active_backend.set(name)
    policy_token = _active_policy.set(policy) if policy is not None else None
    try:
        yield name
    finally:
        if policy_token is not None:
            _active_policy.reset(policy_token)
        _active_backend.reset(backend_token)


def set_fallback_policy(policy: str) -> None:
    global _default_policy
    _default_policy = validate_policy(policy)


def active_policy() -> str:
    return _active_policy.get() or _default_policy


@contextlib.contextmanager
def fallback_policy(policy: str):
    token = _active_policy.set(validate_policy(policy))
    try:
        yield policy
    finally:
        _active_policy.reset(token)


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
    scoped = _active_checks.get()
    if scoped is not None:
        return scoped
    if _checks_override is not None:
        return _checks_override
    return "raise" if _checks_from_env() else "off"


@contextlib.contextmanager
def attention_checks(mode: str | bool = "raise"):
    token = _active_checks.set(_check_mode(mode))
    try:
        yield
    finally:
        _active_checks.reset(token)


def validate_model(model) -> str:
    if not isinstance(model, str) or not model.strip():
        raise ValueError(f"model must be a non-empty string naming the model whose activations these calls carry "
                         f"(accuracy verdicts and quality-guard demotions are kept per model); got {model!r}")
    return model


def active_model() -> str:
    return _active_model.get() or UNSCOPED_MODEL


@contextlib.contextmanager
def model_scope(model: str):
    """Calls inside the block carry activations of `model` (a stable name or content fingerprint): `auto`'s
    accuracy verdicts and the quality guard's demotions are kept per model, and reused from disk only for it."""
    token = _active_model.set(validate_model(model))
    try:
        yield model
    finally:
        _active_model.reset(token)


def set_quality_guard(mode: str = guard.DEFAULT_MODE, every: int | None = None) -> None:
    """Process default of the quality guard (see dispatcher.guard): 'quantised' | 'all' | 'off', every Nth call."""
    global _default_guard
    _default_guard = guard.settings(mode, every)


def active_guard() -> tuple:
    return _active_guard.get() or _default_guard


@contextlib.contextmanager
def quality_guard(mode: str = "all", every: int | None = None):
    """The quality guard for the calls inside the block (mode 'quantised' | 'all' | 'off', every Nth call)."""
    token = _active_guard.set(guard.settings(mode, every))
    try:
        yield
    finally:
        _active_guard.reset(token)

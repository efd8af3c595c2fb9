"""One hook for every cache that holds decisions: when the registry or `auto`'s tuning changes, they forget.

Modules that cache decisions, or anything made from them, subscribe (`on_forget`): the decisions, the eager path's
fast keys, the traced plans' candidates, `auto`'s choices. Modules that change what decisions depend on call
`forget()`: the registry (a backend added, replaced or removed, the priority, a pseudo-backend) and `auto` (a new
tuner, tuning again, its cache cleared). Neither imports the other, so the registry and `auto` never reach up into
the dispatcher. Trust settings are not forgotten but keyed (trust.scope_key() is part of the decisions' and auto's
keys). registry.forget_availability, requirements.forget_imports and hub.forget_loaded have another job: they
empty caches of what decisions are made from, after an install (each says why that is not this).
"""

from __future__ import annotations

from typing import Callable

_subscribers: list[Callable[[], None]] = []


def on_forget(callback: Callable[[], None]) -> Callable[[], None]:
    """Call `callback` (no arguments) whenever decisions must be made again; returns it (usable as a decorator)."""
    if callback not in _subscribers:
        _subscribers.append(callback)
    return callback


def forget() -> None:
    for callback in tuple(_subscribers):
        callback()

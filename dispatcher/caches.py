"""One hook for every cache that holds decisions: when the registry or `auto`'s tuning changes, they forget.

Modules that cache decisions subscribe (`on_forget`); modules that change what decisions depend on call
`forget()`. Neither imports the other, so the registry and `auto` never reach up into the dispatcher.
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

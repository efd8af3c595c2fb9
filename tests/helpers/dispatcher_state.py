"""Putting a dispatcher back to its defaults between tests: the top-level `dispatcher`, or the copy a
test loads inside the pack (`attention_dispatch_pack.dispatcher`), which has its own registry and caches."""

from __future__ import annotations


def reset(d) -> None:
    d.state.reset_default_backend()
    d.caches.forget()
    d.registry.forget_availability()
    d.set_checks(None)
    d.set_fallback_policy("fallback")
    d.set_quality_guard()


def remove_custom_backends(d, keep: set[str]) -> None:
    for name in d.registry.names():
        if name not in keep and d.registry.get(name).custom:
            d.unregister_backend(name)
    d.registry.set_priority(d.backends.PRIORITY)  # a test may have ranked a custom backend first

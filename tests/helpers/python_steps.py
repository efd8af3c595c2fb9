"""The Python-level steps of one call, counted through the interpreter's own hook (sys.setprofile), nothing patched:
which functions a repeat call enters (the override's lane enters no dispatcher step; a call it was not made for does)."""

from __future__ import annotations

import sys


def entered(fn) -> tuple[set[str], object]:
    """(the names of the Python functions one call of `fn` enters, what it returned)."""
    seen: set[str] = set()

    def hook(frame, event, arg):
        if event == "call":
            seen.add(frame.f_code.co_name)

    sys.setprofile(hook)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return seen, out

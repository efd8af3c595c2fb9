"""Version strings compared by their release part (enough for requirement floors), parsed by `packaging`."""

from __future__ import annotations

from packaging.version import InvalidVersion, Version


def release(version: str) -> tuple[int, ...]:
    """'2.13.0+cpu' -> (2, 13, 0); a pre-release or dev build counts as its release ('2.8.0.dev2025' -> (2, 8, 0):
    a nightly meets the floor of the version it leads to); () when it is not a version."""
    try:
        return Version(str(version or "").strip()).release
    except InvalidVersion:
        return ()


def at_least(version: str, minimum: str) -> bool:
    have, need = release(version), release(minimum)
    width = max(len(have), len(need))
    return have + (0,) * (width - len(have)) >= need + (0,) * (width - len(need))

"""Version strings compared by their numeric release part (enough for requirement floors)."""

from __future__ import annotations

import re


def release(version: str) -> tuple[int, ...]:
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", version or "")
    return tuple(int(p) for p in match.group(1).split(".")) if match else ()


def at_least(version: str, minimum: str) -> bool:
    have, need = release(version), release(minimum)
    width = max(len(have), len(need))
    return have + (0,) * (width - len(have)) >= need + (0,) * (width - len(need))

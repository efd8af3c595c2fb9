"""Version strings compared by their release part, then their pre-release tag (enough for requirement floors).

A floor that names a pre-release also orders the tags: 4.0.0b36 < 4.0.0b40 < 4.0.0rc1 < 4.0.0 (flash-attn-4 ships
only betas, and a floor of 4.0.0b40 must refuse b36). A floor of a final release compares the release part only,
so torch 2.5.0a0+872d972 (NVIDIA's containers) meets torch>=2.5. Local parts (+cu130) and dev/post tags are
ignored.
"""

from __future__ import annotations

import re

_PRE = {"a": 0, "alpha": 0, "b": 1, "beta": 1, "c": 2, "rc": 2}
_FINAL = (3, 0)


def release(version: str) -> tuple[int, ...]:
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", version or "")
    return tuple(int(p) for p in match.group(1).split(".")) if match else ()


def pre_release(version: str) -> tuple[int, int]:
    """(phase, number) of a pre-release tag (a < b < rc), or the final release's, which sorts after them."""
    match = re.match(r"\s*v?\d+(?:\.\d+)*[-_.]?(alpha|beta|rc|a|b|c)[-_.]?(\d*)", (version or "").lower())
    return (_PRE[match.group(1)], int(match.group(2) or 0)) if match else _FINAL


def at_least(version: str, minimum: str) -> bool:
    have, need = release(version), release(minimum)
    width = max(len(have), len(need))
    have, need = have + (0,) * (width - len(have)), need + (0,) * (width - len(need))
    if pre_release(minimum) == _FINAL:
        return have >= need
    return (have, pre_release(version)) >= (need, pre_release(minimum))

"""Version strings compared as requirement floors, parsed by `packaging`.

A floor of a final release compares the release part only, so torch 2.5.0a0+872d972 (NVIDIA's containers) and
a nightly 2.8.0.dev2025 meet torch>=2.5 and >=2.8 (a build leading to a release meets that release's floor). A
floor that names a pre-release also orders the tags: 4.0.0b36 < 4.0.0b40 < 4.0.0rc1 < 4.0.0 (flash-attn-4 ships
only betas, and a floor of 4.0.0b40 must refuse b36).
"""

from __future__ import annotations

from packaging.version import InvalidVersion, Version

# The oldest torch the pack imports on, as pyproject.toml claims it and CI's floor phase installs it (.ci/run reads
# pyproject.toml): the oldest release the unit suite is known to pass on, and the GPU machines' image (torch 2.11.0+cu130,
# where every H200 figure was measured). 2.5 lacks SDPA's kernel priority order; on 2.6 the unit suite failed 138
# tests (docs/python.md says where); 2.7-2.10 are untested.
TORCH_FLOOR = "2.11"


def _parse(version: str) -> Version | None:
    try:
        return Version(str(version or "").strip())
    except InvalidVersion:
        return None


def release(version: str) -> tuple[int, ...]:
    """'2.13.0+cpu' -> (2, 13, 0); a pre-release or dev build counts as its release; () when it is not a version."""
    parsed = _parse(version)
    return parsed.release if parsed is not None else ()


def at_least(version: str, minimum: str) -> bool:
    have, need = _parse(version), _parse(minimum)
    if have is None or need is None:
        return False
    width = max(len(have.release), len(need.release))
    have_release = have.release + (0,) * (width - len(have.release))
    need_release = need.release + (0,) * (width - len(need.release))
    if need.pre is None:
        return have_release >= need_release
    final = (chr(0x7F), 0)  # a final release sorts after every pre-release tag of the same release
    return (have_release, have.pre or final) >= (need_release, need.pre)

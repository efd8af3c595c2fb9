"""Which code a bench measured, as its JSON records it: a checkout's commit, not its folder (a folder says where one
machine kept the code, not what ran)."""

from __future__ import annotations

import subprocess
from pathlib import Path

CHANGED = " (with uncommitted changes)"


def revision(folder: Path | str) -> str:
    """The commit of the pack in `folder`: the REVISION file of a pack bench/gpu_carry.py exported (no .git there);
    else git's HEAD where `folder` is a checkout's top, with CHANGED added where tracked files differ from it; else
    "unknown" (no git, or a folder inside another checkout, whose HEAD is not this folder's code)."""
    folder = Path(folder).resolve()
    exported = folder / "REVISION"
    if exported.is_file() and exported.read_text().strip():
        return exported.read_text().strip()
    top = _git(folder, "rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != folder:
        return "unknown"
    head = _git(folder, "rev-parse", "HEAD")
    if head is None:
        return "unknown"
    changed = _git(folder, "status", "--porcelain", "--untracked-files=no")
    return head + CHANGED if changed else head


def _git(folder: Path, *args: str) -> str | None:
    """git's output in `folder`, stripped; None where git is missing or fails."""
    try:
        done = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None

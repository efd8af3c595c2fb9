"""Where the real ComfyUI for the integration and browser tests is, and the one rule for when they run.

No ComfyUI ships with this project or with CI (its source is third-party code that stays out of every commit):
- COMFYUI_PATH unset: every test marked `integration` (tests/integration, tests/web) is skipped with one reason
  that starts with SKIP_PREFIX, and the run's summary counts them (tests/conftest.py).
- COMFYUI_PATH set: they run, and a ComfyUI that cannot start (no main.py, no interpreter, no Chromium for the
  browser tests) fails them: asking for the ComfyUI suite never passes by skipping it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

COMFYUI_PATH = os.environ.get("COMFYUI_PATH") or None
COMFYUI_PYTHON = os.environ.get("COMFYUI_PYTHON") or sys.executable

SKIP_PREFIX = "wants ComfyUI"
SETUP_HINT = ('export COMFYUI_PATH=/path/to/ComfyUI && eval "$(bash .ci/comfyui-env)" (a ComfyUI checkout you '
              'have; docs/testing.md)')
SKIP_REASON = f"{SKIP_PREFIX}: COMFYUI_PATH is not set, so no real ComfyUI to run in. Set it up with: {SETUP_HINT}"


def requested() -> bool:
    """Whether this run was given a ComfyUI (COMFYUI_PATH set)."""
    return COMFYUI_PATH is not None


def broken() -> str | None:
    """Why the ComfyUI named by COMFYUI_PATH/COMFYUI_PYTHON cannot be started, or None."""
    if not (Path(COMFYUI_PATH) / "main.py").is_file():
        return f"COMFYUI_PATH={COMFYUI_PATH} has no main.py: it must be a ComfyUI checkout"
    if not (os.path.isfile(COMFYUI_PYTHON) and os.access(COMFYUI_PYTHON, os.X_OK)):
        return f"COMFYUI_PYTHON={COMFYUI_PYTHON} is not an executable"
    return None

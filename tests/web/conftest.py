"""The browser tests reuse the integration suite's session fixture: a real ComfyUI with this pack."""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:  # pytest puts tests/ there already (rootdir-relative import of tests/conftest.py)
    sys.path.insert(0, str(TESTS))

from integration.conftest import comfy  # noqa: E402,F401  (the fixture: starts ComfyUI, or skips without COMFYUI_PATH)

"""The browser tests reuse the integration suite's session fixture: a real ComfyUI with this pack."""

from __future__ import annotations

# tests/ is on sys.path through pyproject.toml's `pythonpath`.
from integration.conftest import comfy  # noqa: F401  (the fixture: starts ComfyUI, or skips without COMFYUI_PATH)

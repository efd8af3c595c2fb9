"""How a bench script ends: its result as JSON on stdout, and in a file when --json names one."""

from __future__ import annotations

import json
from pathlib import Path


def emit(result: dict, json_path: str | None) -> None:
    text = json.dumps(result, indent=1)
    print(text)
    if json_path:
        Path(json_path).write_text(text + "\n")

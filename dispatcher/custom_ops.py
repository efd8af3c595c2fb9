"""Registering the pack's torch custom ops once per copy of a module.

A module loaded twice under one name (a reload, ComfyUI loading the pack folder and a test importing it as a
package) defines its op again: the second registration takes the next free numbered name instead of failing.
"""

from __future__ import annotations

import re
from typing import Any, Callable


def define_once(prefix: str, module: str, define: Callable[[str], Any]):
    """`define("attention_dispatch::<prefix>_<module>[N]")` for the first name not taken yet; its result."""
    base = prefix + "_" + re.sub(r"\W", "_", module)
    for suffix in range(100):
        try:
            return define(f"attention_dispatch::{base}{suffix or ''}")
        except RuntimeError:  # the name is registered already (by an earlier copy of the module)
            continue
    raise RuntimeError(f"could not register the custom op attention_dispatch::{base}")

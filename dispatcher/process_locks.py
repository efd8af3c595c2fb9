"""Locks shared by every copy of the pack in one process, for state torch keeps process-wide.

A module's globals belong to one copy of it, and one process can hold two copies of the pack: ComfyUI imports
it under its folder's name, and a workflow, a tool or a test may import it again (as `attention_dispatch` or
`dispatcher`). A lock made at module level then guards only its own copy's calls, while the state it guards
(SDPA's backend flags, the annotation dict torch's eager flex mutates) is one for the process. These locks live
in one holder every copy finds: a module in sys.modules under a name no import uses."""

from __future__ import annotations

import sys
import threading
import types

_HOLDER = "_attention_dispatch_process_locks"


def shared_lock(name: str, reentrant: bool = False):
    """The process's one lock called `name`, made by the first copy that asks for it (dict.setdefault is atomic
    under the GIL, so two copies asking at once still get the same lock)."""
    holder = sys.modules.setdefault(_HOLDER, types.ModuleType(_HOLDER, "locks shared by every copy of the pack"))
    kind = "RLock" if reentrant else "Lock"
    return vars(holder).setdefault(f"{name}:{kind}", threading.RLock() if reentrant else threading.Lock())

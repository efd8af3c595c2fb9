"""The latest attention reports, for the websocket event and the GET route.

Why a module-level store: routes run on the server thread, sampling on the prompt worker; the store
is the one place both see. It holds plain dicts (no tensors, no file paths), the newest last.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque

EVENT = "attention_dispatch.report"
_lock = threading.Lock()
_reports: deque = deque(maxlen=64)
_live: "weakref.WeakValueDictionary[str, object]" = weakref.WeakValueDictionary()


def _prompt_id():
    try:
        from server import PromptServer  # ComfyUI's server module; only present inside ComfyUI
        return getattr(PromptServer.instance, "last_prompt_id", None)
    except Exception:
        return None


def publish(kind: str, node_id, data: dict) -> dict:
    """Store a report and send it to the browser (when running inside ComfyUI)."""
    report = {"kind": kind, "node": None if node_id is None else str(node_id), "prompt_id": _prompt_id(),
              "time": time.time(), **data}
    with _lock:
        _reports.append(report)
    try:
        from server import PromptServer
        PromptServer.instance.send_sync(EVENT, report)
    except Exception:  # outside ComfyUI, or the server is shutting down: the store still has it
        pass
    return report


def track_live(key: str, recorder) -> None:
    """A recorder with no end-of-run hook (text encoders): the route reads it when asked."""
    _live[key] = recorder


def latest() -> dict:
    with _lock:
        reports = list(_reports)
    live = [{"kind": "live", "key": key, "recorder": rec.snapshot()} for key, rec in list(_live.items())]
    return {"reports": reports, "live": live}


def clear() -> None:
    with _lock:
        _reports.clear()

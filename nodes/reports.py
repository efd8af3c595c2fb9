"""The latest attention reports, for the websocket event and the GET route.

Why a module-level store: routes run on the server thread, sampling on the prompt worker; the store
is the one place both see. It holds plain dicts (no tensors, no file paths), the newest last.
"""

from __future__ import annotations

import re
import threading
import time
import weakref
from collections import deque

EVENT = "attention_dispatch.report"
_lock = threading.Lock()
_reports: deque = deque(maxlen=64)
_live: "weakref.WeakValueDictionary[str, object]" = weakref.WeakValueDictionary()


# An absolute file path inside a text (/home/u/..., C:\\Users\\..., ~/...): not after a word character, '.', ':'
# or '/', so repo ids (org/name), URLs (https://...) and ratios (1/sqrt(d)) are left alone.
_PATH = re.compile(r"(?<![\w.:/~-])(?:[A-Za-z]:[\\/]|~[\\/]|/(?=[\w.~-]))[^\s'\"<>|,;()\[\]]*")


def scrub(obj):
    """Plain data for the browser: no 'path' keys and no absolute file paths in texts (error messages name
    lock files, kernel caches and libraries); each path becomes '<path>'."""
    if isinstance(obj, dict):
        return {k: scrub(v) for k, v in obj.items() if k != "path"}
    if isinstance(obj, (list, tuple)):
        return [scrub(v) for v in obj]
    if isinstance(obj, str):
        return _PATH.sub("<path>", obj) if ("/" in obj or "\\" in obj) else obj
    return obj


def _prompt_id():
    try:
        from server import PromptServer  # ComfyUI's server module; only present inside ComfyUI
        return getattr(PromptServer.instance, "last_prompt_id", None)
    except Exception:
        return None


def publish(kind: str, node_id, data: dict) -> dict:
    """Store a report and send it to the browser (when running inside ComfyUI)."""
    report = scrub({"kind": kind, "node": None if node_id is None else str(node_id), "prompt_id": _prompt_id(),
                    "time": time.time(), **data})
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
    with _lock:  # latest() may be iterating on the server thread
        _live[key] = recorder


def latest() -> dict:
    with _lock:
        reports = list(_reports)
        recorders = list(_live.items())
    live = [{"kind": "live", "key": key, "recorder": scrub(rec.snapshot())} for key, rec in recorders]
    return {"reports": reports, "live": live}


def clear() -> None:
    with _lock:
        _reports.clear()

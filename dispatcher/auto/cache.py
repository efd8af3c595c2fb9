"""`auto`'s decisions on disk (JSON), per machine fingerprint: measured once, reused across processes.

ATTN_DISPATCH_TUNE_CACHE names the file (or a folder for tune.json; "off": no disk cache); the default is
~/.cache/attention_dispatch/tune.json. A decision is reused only while the same candidates exist.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import tempfile
from pathlib import Path
from typing import Callable

from .fingerprint import fingerprint_key, machine_fingerprint
from ..log import logger


ENV_CACHE = "ATTN_DISPATCH_TUNE_CACHE"
CACHE_FORMAT = 3  # 3: per signature, timings shared by every model and accuracy verdicts per model
_OFF = frozenset({"", "0", "off", "no", "none", "false"})
_MACHINES_KEPT = 16


def default_cache_path() -> Path | None:
    raw = os.environ.get(ENV_CACHE)
    if raw is not None:
        if raw.strip().lower() in _OFF:
            return None
        path = Path(raw.strip()).expanduser()
        return path / "tune.json" if path.is_dir() else path
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "attention_dispatch" / "tune.json"


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def load(path: Path | None) -> dict:
    if path is None or not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        logger.warning("auto: ignoring the unreadable tuning cache %s (%s)", path, exc)
        return {}
    if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT or not isinstance(data.get("machines"), dict):
        return {}
    return data


def lookup(path: Path | None, signature_key: str) -> dict | None:
    """This machine's saved decision for a signature, or None."""
    entry = load(path).get("machines", {}).get(fingerprint_key(machine_fingerprint()), {})
    decision = entry.get("decisions", {}).get(signature_key) if isinstance(entry, dict) else None
    return decision if isinstance(decision, dict) else None


def update(path: Path | None, signature_key: str, merge: Callable[[dict | None], dict]) -> None:
    """Rewrite one decision atomically (a reader never sees half a file) as `merge(the saved one or None)`, reading
    the file once; the 16 newest machines are kept."""
    if path is None:
        return
    try:
        data = load(path) or {"format": CACHE_FORMAT, "machines": {}}
        fingerprint = machine_fingerprint()
        entry = data["machines"].setdefault(fingerprint_key(fingerprint), {"machine": fingerprint, "decisions": {}})
        entry["updated"] = now()
        saved = entry["decisions"].get(signature_key)
        entry["decisions"][signature_key] = merge(saved if isinstance(saved, dict) else None)
        if len(data["machines"]) > _MACHINES_KEPT:
            keep = sorted(data["machines"].items(), key=lambda kv: kv[1].get("updated", ""))[-_MACHINES_KEPT:]
            data["machines"] = dict(keep)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tune-", suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as exc:
        logger.warning("auto: could not write the tuning cache %s (%s)", path, exc)


def remove(path: Path | None) -> None:
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

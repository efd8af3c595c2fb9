"""`auto`'s decisions on disk (JSON), per machine fingerprint: measured once, reused across processes.

ATTN_DISPATCH_TUNE_CACHE names the file (or a folder for tune.json; "off": no disk cache). Otherwise the host
names the folder (`set_default_dir`; ComfyUI's nodes: <ComfyUI user directory>/attention_dispatch, so each
ComfyUI keeps its own), else ~/.cache/attention_dispatch/tune.json. A decision is reused only while the same
candidates exist.

Processes that share the file (two ComfyUI instances, a script beside one) write it under a file lock
(`filelock`, which torch itself depends on, so it is wherever torch is): each rewrite reads the file, merges one
decision and replaces it whole, and without the lock one process's decisions were lost to the other's rewrite.
Readers take no lock: a replace is atomic.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import tempfile
from pathlib import Path
from typing import Callable

from filelock import FileLock, Timeout

from .fingerprint import fingerprint_key, machine_fingerprint
from ..log import logger


ENV_CACHE = "ATTN_DISPATCH_TUNE_CACHE"
CACHE_FORMAT = 4  # 4: per signature, timings shared by every model and accuracy verdicts per model and block
_OFF = frozenset({"", "0", "off", "no", "none", "false"})
_MACHINES_KEPT = 16
LOCK_TIMEOUT_S = 10.0  # past this another process holds the lock too long: skip this write (it is a cache)
_host_dir: Path | None = None


def set_default_dir(folder: str | os.PathLike | None) -> Path | None:
    """Keep the tuning cache in `folder` (tune.json) unless ATTN_DISPATCH_TUNE_CACHE says otherwise; None: back
    to ~/.cache/attention_dispatch. Returns the previous folder."""
    global _host_dir
    previous, _host_dir = _host_dir, None if folder is None else Path(folder)
    return previous


def default_cache_path() -> Path | None:
    raw = os.environ.get(ENV_CACHE)
    if raw is not None:
        if raw.strip().lower() in _OFF:
            return None
        path = Path(raw.strip()).expanduser()
        return path / "tune.json" if path.is_dir() else path
    if _host_dir is not None:
        return _host_dir / "tune.json"
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "attention_dispatch" / "tune.json"


def _lock(path: Path) -> FileLock:
    return FileLock(str(path) + ".lock", timeout=LOCK_TIMEOUT_S)


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
    """Rewrite one decision atomically (a reader never sees half a file) as `merge(the saved one or None)`, under
    the file lock from read to replace; the 16 newest machines are kept."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _lock(path):
            _rewrite(path, signature_key, merge)
    except Timeout:
        logger.warning("auto: another process held the tuning cache's lock %s.lock for %g s; this decision is not "
                       "saved", path, LOCK_TIMEOUT_S)
    except OSError as exc:
        logger.warning("auto: could not write the tuning cache %s (%s)", path, exc)


def _rewrite(path: Path, signature_key: str, merge: Callable[[dict | None], dict]) -> None:
    data = load(path) or {"format": CACHE_FORMAT, "machines": {}}
    fingerprint = machine_fingerprint()
    entry = data["machines"].setdefault(fingerprint_key(fingerprint), {"machine": fingerprint, "decisions": {}})
    entry["updated"] = now()
    saved = entry["decisions"].get(signature_key)
    entry["decisions"][signature_key] = merge(saved if isinstance(saved, dict) else None)
    if len(data["machines"]) > _MACHINES_KEPT:
        keep = sorted(data["machines"].items(), key=lambda kv: kv[1].get("updated", ""))[-_MACHINES_KEPT:]
        data["machines"] = dict(keep)
    fd, tmp = tempfile.mkstemp(prefix=".tune-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=1, sort_keys=True)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def remove(path: Path | None) -> None:
    if path is not None and path.exists():
        try:
            with _lock(path), contextlib.suppress(FileNotFoundError):
                path.unlink()
        except (Timeout, OSError) as exc:
            logger.warning("auto: could not remove the tuning cache %s (%s)", path, exc)

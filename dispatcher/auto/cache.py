"""`auto`'s decisions on disk, per machine fingerprint: measured once, reused across processes.

ATTN_DISPATCH_TUNE_CACHE names the file (or a folder for tune.sqlite3; "off": no disk cache). Otherwise the host
names the folder (`set_default_dir`; ComfyUI's nodes: <ComfyUI user directory>/attention_dispatch, so each
ComfyUI keeps its own), else ~/.cache/attention_dispatch/tune.sqlite3. A decision is reused only while the same
candidates exist.

Why SQLite (stdlib `sqlite3`, WAL journal): the JSON file this replaces was parsed whole on every lookup and
rewritten whole on every decision, so a long-lived cache (58.8 MB) made one new signature cost 34.8 s. Here a
lookup reads one row by its primary key and a decision writes one row, whatever the size; each machine keeps
at most MAX_DECISIONS decisions (the least recently used go first, and any unused for MAX_AGE_DAYS), and the
MACHINES_KEPT most recently used machines. Processes and threads that share the file (two ComfyUIs, a script beside
one) read without waiting (WAL) and write one at a time: a write merges one decision inside one transaction
(BEGIN IMMEDIATE), so no decision is lost to another's write; a writer that waits more than LOCK_TIMEOUT_S skips
that write with a warning (it is a cache).

What is read is checked (`decision_problem`): a decision of the wrong shape is dropped with one warning, and a
file that is not a cache at all is set aside (renamed, kept for the user) with one warning; `auto` goes on with
an empty cache, never a failed prompt. The JSON form (format 4, tune.json) is migrated once, under a file lock:
its valid decisions go into the database and the file is renamed `<name>.migrated`.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Callable

from filelock import FileLock, Timeout

from ..machine import current_machine
from ..log import echo, logger, warn_once


ENV_CACHE = "ATTN_DISPATCH_TUNE_CACHE"
CACHE_FORMAT = 5  # 5: SQLite, one row per (machine, signature); 4: one JSON file (migrated on first use)
LEGACY_FORMAT = 4
CACHE_FILE, LEGACY_FILE = "tune.sqlite3", "tune.json"
_OFF = frozenset({"", "0", "off", "no", "none", "false"})
MACHINES_KEPT = 16
MAX_DECISIONS = 4096  # per machine: a workflow has tens of signatures per model; thousands is many models
MAX_AGE_DAYS = 180  # a decision not used for this long goes (versions have changed since)
LOCK_TIMEOUT_S = 10.0  # past this another process holds the write lock too long: skip this write (it is a cache)
_TOUCH_EVERY_S = 3600.0  # a lookup refreshes a decision's last use at most this often (a read stays a read)
_SQLITE_HEADER = b"SQLite format 3\x00"
_STATUSES = frozenset({"valid", "rejected"})
_host_dir: Path | None = None


def set_default_dir(folder: str | os.PathLike | None) -> Path | None:
    """Keep the tuning cache in `folder` (tune.sqlite3) unless ATTN_DISPATCH_TUNE_CACHE says otherwise; None: back
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
        return path / CACHE_FILE if path.is_dir() else path
    if _host_dir is not None:
        return _host_dir / CACHE_FILE
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "attention_dispatch" / CACHE_FILE


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# --- what a saved decision is -----------------------------------------------------------------------------------

def _number(x, low: float = 0.0) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= low


def _timing_problem(name: str, timing) -> str | None:
    if not isinstance(timing, dict):
        return f"the timing of {name} is not an object"
    if not _number(timing.get("median_ms")):
        return f"the median of {name} is not a finite time"
    times = timing.get("times_ms", [])
    if not isinstance(times, list) or not all(_number(t) for t in times):
        return f"the times of {name} are not a list of finite times"
    return None


def _verdict_problem(where: str, verdict) -> str | None:
    if not isinstance(verdict, dict) or verdict.get("status") not in _STATUSES:
        return f"the verdict {where} has no status valid or rejected"
    rel_error = verdict.get("rel_error")
    if rel_error is not None and (isinstance(rel_error, bool) or not isinstance(rel_error, (int, float))):
        return f"the error of the verdict {where} is not a number"
    if verdict["status"] == "valid" and rel_error is not None and not _number(rel_error):
        return f"the verdict {where} is valid with an error that is not a finite number"  # a rejected one may be
    if not isinstance(verdict.get("reason", ""), str):
        return f"the reason of the verdict {where} is not text"
    return None


def decision_problem(decision) -> str | None:
    """Why `decision` is not a decision the tuner saved (what `Tuner._to_disk` writes), or None. Everything the
    tuner reads is checked here, so a hand-edited or damaged cache can never fail a prompt."""
    if not isinstance(decision, dict):
        return f"a decision is an object, not {type(decision).__name__}"
    candidates = decision.get("candidates")
    if not isinstance(candidates, list) or not all(isinstance(n, str) for n in candidates):
        return "its candidates are not a list of backend names"
    if not isinstance(decision.get("tuned_at", ""), str) or not _number(decision.get("seconds", 0)):
        return "its tuned_at is not text or its seconds not a finite number"
    timings = decision.get("timings", {})
    if not isinstance(timings, dict):
        return "its timings are not an object"
    for name, timing in timings.items():
        problem = _timing_problem(name, timing)
        if problem:
            return problem
    verdicts = decision.get("verdicts", {})
    if not isinstance(verdicts, dict):
        return "its verdicts are not an object"
    for model, blocks in verdicts.items():
        if not isinstance(blocks, dict):
            return f"the verdicts of model {model} are not an object"
        for block, per_name in blocks.items():
            if not isinstance(per_name, dict):
                return f"the verdicts of model {model}, block {block} are not an object"
            for name, verdict in per_name.items():
                problem = _verdict_problem(f"of {name} (model {model}, block {block})", verdict)
                if problem:
                    return problem
    return None


# --- the database -----------------------------------------------------------------------------------------------

_SCHEMA = """
CREATE TABLE IF NOT EXISTS machines (machine TEXT PRIMARY KEY, fingerprint TEXT NOT NULL, used REAL NOT NULL);
CREATE TABLE IF NOT EXISTS decisions (machine TEXT NOT NULL, signature TEXT NOT NULL, decision TEXT NOT NULL,
                                      used REAL NOT NULL, PRIMARY KEY (machine, signature)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS decisions_by_use ON decisions (machine, used);
"""


class _NotACache(Exception):
    """The file at the cache path is not a tuning cache (set aside by `_connect`)."""


def _usable(path: Path | None) -> bool:
    if path is None:
        return False
    if path.is_dir():
        warn_once(("tune-cache-folder", str(path)), "auto: the tuning cache path %s is a folder, not a file; "
                  "decisions are kept in memory only. Set %s to a file path (or a folder without %s in it)",
                  path, ENV_CACHE, path.name)
        return False
    return True


def _lock(path: Path) -> FileLock:
    return FileLock(str(path) + ".lock", timeout=LOCK_TIMEOUT_S)


def _open(path: Path) -> sqlite3.Connection:
    """A connection to a database file (created empty when missing); raises _NotACache for anything else."""
    if path.exists() and path.stat().st_size:
        with open(path, "rb") as fh:
            if fh.read(len(_SQLITE_HEADER)) != _SQLITE_HEADER:
                raise _NotACache("not an SQLite database")
    con = sqlite3.connect(str(path), timeout=LOCK_TIMEOUT_S, isolation_level=None, check_same_thread=False)
    try:
        version = con.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, CACHE_FORMAT):
            raise _NotACache(f"cache format {version}, this version reads {CACHE_FORMAT}")
        if version == 0:
            con.execute("PRAGMA journal_mode=WAL")
            con.executescript(_SCHEMA)
            con.execute(f"PRAGMA user_version={CACHE_FORMAT}")
        con.execute("PRAGMA synchronous=NORMAL")  # WAL: durable at checkpoints, never corrupt
        return con
    except sqlite3.DatabaseError as exc:
        con.close()
        if isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc):
            raise
        raise _NotACache(f"{type(exc).__name__}: {exc}") from None
    except BaseException:
        con.close()
        raise


def _set_aside(path: Path, why: str) -> None:
    """Rename a file that is not a tuning cache to a free `<name>.bad[-n]` (kept for the user), with one warning."""
    for n in range(1000):
        aside = path.with_name(path.name + (".bad" if n == 0 else f".bad-{n}"))
        if not aside.exists():
            break
    try:
        os.replace(path, aside)
        for suffix in ("-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(str(path) + suffix)
    except OSError as exc:
        warn_once(("tune-cache-bad", str(path)), "auto: the tuning cache %s is not a tuning cache (%s) and could "
                  "not be renamed (%s); decisions are kept in memory only. Delete or move it", path, why, exc)
        raise _NotACache(why) from None
    logger.warning("auto: the tuning cache %s is not a tuning cache (%s); it is kept as %s and a new one is "
                   "started", path, why, aside.name)


@contextlib.contextmanager
def _connection(path: Path, write: bool = False):
    """A connection to the cache at `path` (inside a write transaction with write=True), migrated or set aside
    first where needed; None inside when the cache cannot be used now (said)."""
    con = None
    try:
        con = _connect(path)
        con.execute(f"PRAGMA busy_timeout = {int(LOCK_TIMEOUT_S * 1000)}")
        if write:
            con.execute("BEGIN IMMEDIATE")
    except (OSError, sqlite3.Error, _NotACache, Timeout) as exc:
        _forget(path)
        _unusable(path, exc)
        yield None
        return
    try:
        yield con
        if write:
            con.execute("COMMIT")
    except (OSError, sqlite3.Error) as exc:
        if write:
            with contextlib.suppress(sqlite3.Error):
                con.execute("ROLLBACK")
        _forget(path)
        _unusable(path, exc)
    except BaseException:  # the caller's own error (a merge that raised): never leave the write lock held
        if write:
            with contextlib.suppress(sqlite3.Error):
                con.execute("ROLLBACK")
        raise


# Each thread keeps its connection to each cache file open: closing the last connection checkpoints the WAL
# (18 ms a write on a 70 MB cache). It is opened again when the file at the path is another one (removed, set
# aside, replaced by another process).
_local = threading.local()


def _connect(path: Path) -> sqlite3.Connection:
    held = getattr(_local, "connections", None)
    if held is None:
        held = _local.connections = {}
    key = str(path)
    try:
        stat = os.stat(path)
        identity = (stat.st_dev, stat.st_ino)
    except FileNotFoundError:
        identity = None
    if key in held and identity is not None and held[key][1] == identity and _legacy_source(path) is None:
        return held[key][0]
    _forget(path)
    con = _fresh(path)
    stat = os.stat(path)
    held[key] = (con, (stat.st_dev, stat.st_ino))
    return con


def _forget(path: Path) -> None:
    """Close this thread's connection to `path`, if any."""
    held = getattr(_local, "connections", {})
    con = held.pop(str(path), (None,))[0]
    if con is not None:
        with contextlib.suppress(sqlite3.Error):
            con.close()


def _fresh(path: Path) -> sqlite3.Connection:
    path.parent.mkdir(parents=True, exist_ok=True)
    if _legacy_source(path) is None:
        try:
            return _open(path)
        except _NotACache:
            pass
    with _lock(path):  # one process migrates or sets aside; the others wait, then open what it made
        return _repair(path)


def _unusable(path: Path, exc: BaseException) -> None:
    if isinstance(exc, Timeout) or (isinstance(exc, sqlite3.OperationalError) and
                                    ("locked" in str(exc) or "busy" in str(exc))):
        logger.warning("auto: another process held the tuning cache's lock (%s) for %g s; this decision is not "
                       "saved", path, LOCK_TIMEOUT_S)
    else:
        warn_once(("tune-cache-error", str(path), type(exc).__name__), "auto: could not use the tuning cache %s "
                  "(%s: %s); decisions are kept in memory only", path, type(exc).__name__, exc)


def _legacy_source(path: Path) -> Path | None:
    """tune.json beside the default tune.sqlite3 (the JSON cache of earlier versions), or None."""
    if path.name == CACHE_FILE:
        beside = path.with_name(LEGACY_FILE)
        if beside.is_file():
            return beside
    return None


def _repair(path: Path) -> sqlite3.Connection:
    """Under the file lock: migrate what JSON there is (at `path` itself: a name set before the database; or
    tune.json beside it), set aside what is not a cache; the open database."""
    if path.is_file() and _holds_json(path):
        con = _migrate(path, path)
    else:
        try:
            con = _open(path)
        except _NotACache as exc:
            _set_aside(path, str(exc))
            con = _open(path)
    beside = _legacy_source(path)
    if beside is not None:
        con.close()
        con = _migrate(beside, path)
    return con


def _holds_json(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(64).lstrip()[:1] in (b"{", b"[")


def _migrate(source: Path, path: Path) -> sqlite3.Connection:
    """The database at `path` with the valid decisions of the JSON cache `source` (format 4) copied in; `source`
    is renamed `<name>.migrated`, or set aside as `.bad` when it is not a JSON tuning cache."""
    try:
        data = json.loads(source.read_text())
    except (OSError, ValueError) as exc:
        data, why = None, f"unreadable JSON: {exc}"
    else:
        why = _legacy_problem(data)
    if why is not None:
        _set_aside(source, why)
        return _open(path)
    moved = source.with_name(source.name + ".migrated")
    os.replace(source, moved)  # first: `source` may be `path`, where the database goes
    con = _open(path)
    kept = dropped = 0
    stamp = time.time()
    con.execute("BEGIN IMMEDIATE")
    for key, entry in data["machines"].items():
        decisions = entry.get("decisions", {})
        valid = sorted(((sig, d) for sig, d in decisions.items() if decision_problem(d) is None),
                       key=lambda item: item[1].get("tuned_at", ""), reverse=True)
        dropped += len(decisions) - len(valid)
        rows = [(key, sig, json.dumps(d), stamp) for sig, d in valid[:MAX_DECISIONS]]
        kept += len(rows)
        con.execute("INSERT OR REPLACE INTO machines VALUES (?, ?, ?)",
                    (key, json.dumps(entry.get("machine", {}), sort_keys=True), stamp))
        con.executemany("INSERT OR IGNORE INTO decisions VALUES (?, ?, ?, ?)", rows)
    _prune(con)
    con.execute("COMMIT")
    logger.info("auto: the JSON tuning cache %s moved into %s (%d decisions%s%s); the JSON file is kept as %s",
                source, path.name, kept, f", {dropped} of the wrong shape left out" if dropped else "",
                f", the {MAX_DECISIONS} newest per machine" if kept == MAX_DECISIONS else "", moved.name)
    return con


def _legacy_problem(data) -> str | None:
    if not isinstance(data, dict) or data.get("format") != LEGACY_FORMAT:
        return f"not a tuning cache of format {LEGACY_FORMAT}"
    machines = data.get("machines")
    if not isinstance(machines, dict):
        return "its machines are not an object"
    for key, entry in machines.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("decisions", {}), dict):
            return f"the decisions of machine {echo(key, 40)} are not an object"
        if not isinstance(entry.get("machine", {}), dict):
            return f"the fingerprint of machine {echo(key, 40)} is not an object"
    return None


def _prune(con: sqlite3.Connection) -> None:
    """Keep the MACHINES_KEPT most recently used machines, and per machine its MAX_DECISIONS most recently used
    decisions used in the last MAX_AGE_DAYS (inside a write transaction)."""
    stale = [m for (m,) in con.execute("SELECT machine FROM machines ORDER BY used DESC LIMIT -1 OFFSET ?",
                                       (MACHINES_KEPT,))]
    con.executemany("DELETE FROM decisions WHERE machine = ?", [(m,) for m in stale])
    con.executemany("DELETE FROM machines WHERE machine = ?", [(m,) for m in stale])
    for (machine,) in con.execute("SELECT machine FROM machines").fetchall():
        _trim(con, machine)


def _trim(con: sqlite3.Connection, machine: str) -> None:
    """Drop this machine's decisions unused for MAX_AGE_DAYS, and its least recently used past MAX_DECISIONS."""
    con.execute("DELETE FROM decisions WHERE machine = ? AND used < ?", (machine, time.time() - MAX_AGE_DAYS * 86400))
    con.execute("DELETE FROM decisions WHERE machine = ? AND signature IN (SELECT signature FROM decisions "
                "WHERE machine = ? ORDER BY used DESC LIMIT -1 OFFSET ?)", (machine, machine, MAX_DECISIONS))


# --- what the tuner calls ---------------------------------------------------------------------------------------

def lookup(path: Path | None, signature_key: str) -> dict | None:
    """This machine's saved decision for a signature, or None (also for one of the wrong shape: dropped, said
    once)."""
    if not _usable(path) or (not path.exists() and _legacy_source(path) is None):
        return None  # nothing saved yet: a read creates nothing
    machine = current_machine().key
    with _connection(path) as con:
        if con is None:
            return None
        row = con.execute("SELECT decision, used FROM decisions WHERE machine = ? AND signature = ?",
                          (machine, signature_key)).fetchone()
        if row is None:
            return None
        try:
            decision = json.loads(row[0])
        except ValueError as exc:
            decision, problem = None, f"unreadable JSON: {exc}"
        else:
            problem = decision_problem(decision)
        if problem is not None:
            con.execute("PRAGMA busy_timeout = 50")
            warn_once(("tune-cache-decision", str(path)), "auto: a saved decision in the tuning cache %s has the "
                      "wrong shape (%s); it is dropped and measured again (said once per file)", path, problem)
            with contextlib.suppress(sqlite3.OperationalError):
                con.execute("DELETE FROM decisions WHERE machine = ? AND signature = ?", (machine, signature_key))
            return None
        con.execute("PRAGMA busy_timeout = 50")  # what follows is housekeeping: never wait on a writer for it
        if time.time() - row[1] > _TOUCH_EVERY_S:  # least recently used goes first: a hit counts as a use
            with contextlib.suppress(sqlite3.OperationalError):
                con.execute("UPDATE decisions SET used = ? WHERE machine = ? AND signature = ?",
                            (time.time(), machine, signature_key))
        return decision


def update(path: Path | None, signature_key: str, merge: Callable[[dict | None], dict]) -> None:
    """Write one decision as `merge(the saved one or None)`, read and written in one transaction (no other
    writer in between); past MAX_DECISIONS this machine's least recently used decision goes."""
    if not _usable(path):
        return
    this = current_machine()
    fingerprint, machine = this.fingerprint(), this.key
    with _connection(path, write=True) as con:
        if con is None:
            return
        row = con.execute("SELECT decision FROM decisions WHERE machine = ? AND signature = ?",
                          (machine, signature_key)).fetchone()
        saved = None
        if row is not None:
            with contextlib.suppress(ValueError):
                saved = json.loads(row[0])
            saved = saved if decision_problem(saved) is None else None
        decision = merge(saved)
        problem = decision_problem(decision)
        if problem is not None:  # never write what the next read would refuse
            warn_once(("tune-cache-write", problem), "auto: a decision of the wrong shape is not saved (%s)", problem)
            return
        stamp = time.time()
        con.execute("INSERT OR REPLACE INTO machines VALUES (?, ?, ?)",
                    (machine, json.dumps(fingerprint, sort_keys=True), stamp))
        con.execute("INSERT OR REPLACE INTO decisions VALUES (?, ?, ?, ?)",
                    (machine, signature_key, json.dumps(decision), stamp))  # a rejected verdict's error may be inf
        _trim(con, machine)
        if con.execute("SELECT count(*) FROM machines").fetchone()[0] > MACHINES_KEPT:
            oldest = con.execute("SELECT machine FROM machines ORDER BY used LIMIT 1").fetchone()[0]
            con.execute("DELETE FROM decisions WHERE machine = ?", (oldest,))
            con.execute("DELETE FROM machines WHERE machine = ?", (oldest,))


def dump(path: Path | None) -> dict:
    """The whole cache as one object, in the JSON form ({"format", "machines": {key: {"machine", "decisions"}}}):
    for tests, the doctor and a user who wants to read it. {} when there is none."""
    if not _usable(path) or not path.exists():
        return {}
    machines: dict = {}
    with _connection(path) as con:
        if con is None:
            return {}
        for key, fingerprint, used in con.execute("SELECT machine, fingerprint, used FROM machines"):
            machines[key] = {"machine": _loaded(fingerprint), "used": used, "decisions": {}}
        for key, sig, decision in con.execute("SELECT machine, signature, decision FROM decisions"):
            machines.setdefault(key, {"machine": {}, "decisions": {}})["decisions"][sig] = _loaded(decision)
    return {"format": CACHE_FORMAT, "machines": machines}


def _loaded(text):
    try:
        return json.loads(text)
    except (TypeError, ValueError) as exc:
        return {"unreadable": f"{type(exc).__name__}: {exc}"}


def remove(path: Path | None) -> None:
    if path is not None:
        _forget(path)
    if path is not None and path.is_file():
        try:
            with _lock(path):
                for name in (str(path), str(path) + "-wal", str(path) + "-shm"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name)
        except (Timeout, OSError) as exc:
            logger.warning("auto: could not remove the tuning cache %s (%s)", path, exc)

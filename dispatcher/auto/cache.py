"""`auto`'s decisions on disk, per machine fingerprint: measured once, reused across processes.

ATTN_DISPATCH_TUNE_CACHE names the file (or a folder for tune.sqlite3; "off" or the null device: no disk cache).
Otherwise the host names the folder (`set_default_dir`; ComfyUI's nodes: <ComfyUI user directory>/attention_dispatch,
so each ComfyUI keeps its own), else ~/.cache/attention_dispatch/tune.sqlite3. A decision is reused only while the
same candidates exist.

Why SQLite (stdlib `sqlite3`, WAL journal): the JSON file this replaces was parsed whole on every lookup and
rewritten whole on every decision, so a long-lived cache (58.8 MB) made one new signature cost 34.8 s. Here a
lookup reads one row by its primary key and a decision writes one row, whatever the size. Processes and threads
that share the file (two ComfyUIs, a script beside one) read without waiting (WAL) and write one at a time: a write
merges one decision inside one transaction (BEGIN IMMEDIATE), so no decision is lost to another's write.

Bounds, by value: each machine keeps at most MAX_DECISIONS decisions (the least recently used go first, and any
unused for MAX_AGE_DAYS), the MACHINES_KEPT most recently used machines are kept, and the pages in use of the whole
database stay within MAX_CACHE_BYTES (past it the least recently used decisions of any machine go), so one
machine's share is bounded by it too; one decision's text is at most MAX_DECISION_CHARS and what is read back
is checked and capped field by field (cache_shape.py). The WAL beside it shrinks back to 4 MB at a checkpoint.

What is read is checked: a decision of the wrong shape is dropped with one warning, never a failed prompt. What
the file at the path may be, and what is done when it cannot be used (left alone, read-only, memory only, set
aside), is cache_file.py's; decisions that cannot be written are kept in memory (MEMORY_CHARS per file) and
served from there. The JSON cache of earlier versions (format 4, tune.json) beside tune.sqlite3 is imported
where it changed since (its valid decisions; the database's own win) and left in place for the version that
writes it; a JSON cache at the path itself (a name set before the database) is moved in and kept as
`<name>.migrated`. A later format goes into a file of its own (tune-<format>.sqlite3), importing this one and
leaving it as it is, as this one does with tune.json: two versions sharing a folder each keep their cache.
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import re
import sqlite3
import stat
import threading
import time
from pathlib import Path
from typing import Callable

from filelock import Timeout

from ..log import echo, logger, warn_once
from ..machine import current_machine
from .cache_file import (CACHE_FORMAT, META_SCHEMA, Unusable, classify, health, holds_json, identity, lock,
                         not_plain, open_database, say, set_aside)
from .cache_shape import MAX_DECISION_CHARS, MAX_KEY_CHARS, fitted, loaded


ENV_CACHE = "ATTN_DISPATCH_TUNE_CACHE"
LEGACY_FORMAT = 4
CACHE_FILE, LEGACY_FILE = "tune.sqlite3", "tune.json"
_OFF = frozenset({"", "0", "off", "no", "none", "false"})
MACHINES_KEPT = 16
MAX_DECISIONS = 4096  # per machine: a workflow has tens of signatures per model; thousands is many models
MAX_AGE_DAYS = 180  # a decision not used for this long goes (versions have changed since)
# The database's pages in use, every machine together: 4096 realistic decisions take 13 MB. Measured as SQLite's
# page count (no scan): migrating a 16.2 MB tune.json with one 100 kB machine key once made an 867 MB database.
MAX_CACHE_BYTES = 64 << 20
MAX_LEGACY_BYTES = 256 << 20  # a JSON cache larger than this is not read (the largest seen was 75 MB)
MEMORY_CHARS = 16 << 20  # decisions kept in memory per file while it cannot be written
_TOUCH_EVERY_S = 3600.0  # a lookup refreshes a decision's last use at most this often (a read stays a read)
_HOUSEKEEPING_WAIT_MS = 50  # a lookup's own write (a touch, a damaged row dropped) never waits longer
_MACHINE_KEY = re.compile(r"[0-9a-f]{16}")  # `fingerprint_key`: every machine key the pack ever wrote
_CACHE_ERRORS = (OSError, sqlite3.Error, Unusable, Timeout)
_host_dir: Path | None = None


def set_default_dir(folder: str | os.PathLike | None) -> Path | None:
    """Keep the tuning cache in `folder` (tune.sqlite3) unless ATTN_DISPATCH_TUNE_CACHE says otherwise; None: back
    to ~/.cache/attention_dispatch. Returns the previous folder."""
    global _host_dir
    previous, _host_dir = _host_dir, None if folder is None else Path(folder)
    return previous


def _null_device(path) -> bool:
    return os.path.normcase(os.path.abspath(path)) == os.path.normcase(os.path.abspath(os.devnull))


def default_cache_path() -> Path | None:
    raw = os.environ.get(ENV_CACHE)
    if raw is not None:
        if raw.strip().lower() in _OFF or _null_device(Path(raw.strip()).expanduser()):
            return None  # the null device is what a user types for "no cache": off, never opened
        path = Path(raw.strip()).expanduser()
        return path / CACHE_FILE if path.is_dir() else path
    if _host_dir is not None:
        return _host_dir / CACHE_FILE
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "attention_dispatch" / CACHE_FILE


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _usable(path: Path | None) -> bool:
    if path is None or _null_device(path):
        return False
    try:
        folder = stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        folder = False
    if folder:
        warn_once(("tune-cache-folder", str(path)), "auto: the tuning cache path %s is a folder, not a file; "
                  "decisions are kept in memory only. Set %s to a file path (or a folder without %s in it)",
                  path, ENV_CACHE, path.name)
        return False
    return True


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and abs(x) != float("inf")


# --- connections ----------------------------------------------------------------------------------------------

# Each thread keeps its connection to each cache file open: closing the last connection checkpoints the WAL
# (18 ms a write on a 70 MB cache). It is opened again when the file at the path is another one (removed, set
# aside, replaced by another process), or for a write when it was opened read-only.
_local = threading.local()


def _connect(path: Path, write: bool) -> tuple[sqlite3.Connection, Unusable | None]:
    """(a connection to the cache at `path`, None or why it is read-only), opened, imported into, migrated or set
    aside as needed; raises one of _CACHE_ERRORS when it cannot be used now."""
    refusal = not_plain(path)
    if refusal:
        raise Unusable("refused", refusal)
    held = _local.__dict__.setdefault("connections", {})
    legacy = _legacy_source(path)
    h = health(path)
    importing = legacy is not None and h.imported != legacy[1]
    entry = held.get(str(path))
    if (entry is not None and not importing and (entry[2] is None or not write)
            and entry[1] == identity(path) and entry[1] is not None):
        return entry[0], entry[2]
    _forget(path)
    con, read_only = _fresh(path, write or importing)
    held[str(path)] = (con, identity(path), read_only)
    if importing:
        h.imported = legacy[1]  # tried once per change of the file in this process, whatever comes of it
        try:
            if read_only is not None:
                raise read_only
            _import_legacy(con, *legacy)
        except _CACHE_ERRORS as exc:  # the database itself is still read
            say(path, classify(exc), writing=True)
    return con, read_only


def _forget(path: Path) -> None:
    """Close this thread's connection to `path`, if any."""
    held = getattr(_local, "connections", {})
    con = held.pop(str(path), (None,))[0]
    if con is not None:
        try:
            con.close()
        except sqlite3.Error:
            pass


def _fresh(path: Path, write: bool) -> tuple[sqlite3.Connection, Unusable | None]:
    if not holds_json(path):
        try:
            return open_database(path, write)
        except Unusable as problem:
            if problem.kind != "damaged":
                raise
    with lock(path, health(path).wait()):  # one process migrates or sets aside; the others wait, then open it
        if holds_json(path):
            return _migrate_in_place(path), None
        try:
            return open_database(path, write)
        except Unusable as problem:
            if problem.kind != "damaged":
                raise
            set_aside(path, problem.why)
            return open_database(path, True)


def _quietly(con: sqlite3.Connection, path: Path, sql: str, args: tuple) -> None:
    """A lookup's housekeeping write: never waits on another writer for long, never fails the lookup."""
    try:
        con.execute(f"PRAGMA busy_timeout = {_HOUSEKEEPING_WAIT_MS}")
        con.execute(sql, args)
    except sqlite3.Error:
        pass
    finally:
        try:
            con.execute(f"PRAGMA busy_timeout = {int(health(path).wait() * 1000)}")
        except sqlite3.Error:
            pass


# --- decisions kept in memory while the file cannot take them ----------------------------------------------------

_memory: dict[str, collections.OrderedDict] = {}
_memory_lock = threading.Lock()


def _remember(path: Path, key: tuple[str, str], text: str) -> None:
    with _memory_lock:
        held = _memory.setdefault(str(path), collections.OrderedDict())
        held.pop(key, None)
        held[key] = text
        total = sum(len(t) for t in held.values())
        while total > MEMORY_CHARS and len(held) > 1:
            total -= len(held.popitem(last=False)[1])


def _recall(path: Path, key: tuple[str, str], drop: bool = False) -> dict | None:
    with _memory_lock:
        held = _memory.get(str(path), {})
        text = held.pop(key, None) if drop else held.get(key)
    return None if text is None else loaded(text)[0]


# --- what the tuner calls ---------------------------------------------------------------------------------------

def lookup(path: Path | None, signature_key: str) -> dict | None:
    """This machine's saved decision for a signature, or None (also for one of the wrong shape: dropped, said
    once). One this process could not write is served from memory."""
    if not _usable(path):
        return None
    machine = current_machine().key
    remembered = _recall(path, (machine, signature_key))
    if remembered is not None:
        return remembered
    if not os.path.lexists(path) and _legacy_source(path) is None:
        return None  # nothing saved yet: a read creates nothing
    try:
        con, read_only = _connect(path, write=False)
    except _CACHE_ERRORS as exc:
        _forget(path)
        say(path, classify(exc), writing=False)
        return None
    try:
        row = con.execute("SELECT decision, used FROM decisions WHERE machine = ? AND signature = ?",
                          (machine, signature_key)).fetchone()
    except sqlite3.Error as exc:
        _trouble(path, exc, trusted=read_only is None, writing=False)
        return None
    if row is None:
        return None
    decision, problem = loaded(row[0])
    if problem is None and not _number(row[1]):
        problem = "its last use is not a time"
    if problem is not None:
        warn_once(("tune-cache-decision", str(path)), "auto: a saved decision in the tuning cache %s has the "
                  "wrong shape (%s); it is dropped and measured again (said once per file)", path, problem)
        if read_only is None:
            _quietly(con, path, "DELETE FROM decisions WHERE machine = ? AND signature = ?", (machine, signature_key))
        return None
    if read_only is None and time.time() - row[1] > _TOUCH_EVERY_S:  # least recently used goes first: a hit is a use
        _quietly(con, path, "UPDATE decisions SET used = ? WHERE machine = ? AND signature = ?",
                 (time.time(), machine, signature_key))
    return decision


def update(path: Path | None, signature_key: str, merge: Callable[[dict | None], dict]) -> None:
    """Write one decision as `merge(the saved one or None)`, read and written in one transaction (no other
    writer in between); kept in memory instead when the file cannot take it now (said once)."""
    if not _usable(path):
        return
    machine = current_machine().key
    key = (machine, signature_key)
    remembered = _recall(path, key)
    made: list[str] = []
    if time.monotonic() >= health(path).writes_paused_until:
        try:
            _write(path, key, merge, remembered, made)
            _recall(path, key, drop=True)  # on disk now
            return
        except _NotSaved:
            return
        except _CACHE_ERRORS as exc:
            _trouble(path, exc, trusted=True, writing=True)  # `_write` runs statements on a writable connection
    if not made:
        previous = remembered if remembered is not None else _read_quietly(path, key)
        text, problem = fitted(merge(previous))
        if problem is not None:
            return
        made.append(text)
    _remember(path, key, made[0])


class _NotSaved(Exception):
    """The merged decision has the wrong shape: nothing is saved (said once)."""


def _write(path: Path, key: tuple[str, str], merge, remembered: dict | None, made: list) -> None:
    con, read_only = _connect(path, write=True)
    if read_only is not None:
        raise read_only
    con.execute(f"PRAGMA busy_timeout = {int(health(path).wait() * 1000)}")
    con.execute("BEGIN IMMEDIATE")
    try:
        saved = remembered
        if saved is None:
            row = con.execute("SELECT decision FROM decisions WHERE machine = ? AND signature = ?", key).fetchone()
            saved = loaded(row[0])[0] if row is not None else None
        text, problem = fitted(merge(saved))
        if problem is not None:  # never write what the next read would refuse
            warn_once(("tune-cache-write", problem), "auto: a decision is not saved (%s)", problem)
            raise _NotSaved(problem)
        made.append(text)
        stamp = time.time()
        con.execute("INSERT OR REPLACE INTO machines VALUES (?, ?, ?)",
                    (key[0], json.dumps(current_machine().fingerprint(), sort_keys=True), stamp))
        con.execute("INSERT OR REPLACE INTO decisions VALUES (?, ?, ?, ?)", (*key, text, stamp))
        _trim(con, key[0])
        _bound(con)
        con.execute("COMMIT")
    except BaseException:  # the caller's own error too (a merge that raised): never leave the write lock held
        try:
            con.execute("ROLLBACK")
        except sqlite3.Error:
            pass
        raise


def _trouble(path: Path, exc: BaseException, trusted: bool, writing: bool) -> None:
    """After an error reading or writing the open cache: a file SQLite finds damaged through a normal connection
    (`trusted`: not a read-only or immutable one, which may read a page mid-checkpoint) is set aside, once,
    unless another process has replaced it meanwhile; anything else is said."""
    held = getattr(_local, "connections", {}).get(str(path))
    seen = held[1] if held is not None else None
    _forget(path)
    problem = classify(exc)
    if problem.kind == "damaged" and trusted and seen is not None:
        try:
            with lock(path, health(path).wait()):
                if identity(path) == seen and not not_plain(path):
                    set_aside(path, problem.why)
            return
        except _CACHE_ERRORS as exc:
            problem = classify(exc)
    say(path, problem, writing)


def _read_quietly(path: Path, key: tuple[str, str]) -> dict | None:
    """The saved decision, read without a word when the file cannot be read (the caller has said why)."""
    try:
        if not os.path.lexists(path):
            return None
        con, _ = _connect(path, write=False)
        row = con.execute("SELECT decision FROM decisions WHERE machine = ? AND signature = ?", key).fetchone()
    except _CACHE_ERRORS:
        _forget(path)
        return None
    return loaded(row[0])[0] if row is not None else None


def dump(path: Path | None) -> dict:
    """The whole cache as one object, in the JSON form ({"format", "machines": {key: {"machine", "used",
    "decisions"}}}), each field checked (one that is not what it should be reads {"unreadable": why}): for tests,
    the doctor and a user who wants to read it. {} when there is none."""
    if not _usable(path) or not os.path.lexists(path):
        return {}
    machines: dict = {}
    try:
        con, _ = _connect(path, write=False)
        for key, fingerprint, used in con.execute("SELECT machine, fingerprint, used FROM machines"):
            if isinstance(key, str) and len(key) <= MAX_KEY_CHARS:
                machines[key] = {"machine": _fingerprint(fingerprint), "used": used if _number(used) else None,
                                 "decisions": {}}
        for key, sig, text in con.execute("SELECT machine, signature, decision FROM decisions"):
            if not (isinstance(key, str) and isinstance(sig, str) and max(len(key), len(sig)) <= MAX_KEY_CHARS):
                continue
            decision, problem = loaded(text)
            machines.setdefault(key, {"machine": {}, "decisions": {}})["decisions"][sig] = (
                decision if problem is None else {"unreadable": problem})
    except _CACHE_ERRORS as exc:
        _forget(path)
        say(path, classify(exc), writing=False)
        return {}
    return {"format": CACHE_FORMAT, "machines": machines}


def _fingerprint(text):
    if not isinstance(text, str) or len(text) > MAX_DECISION_CHARS:
        return {"unreadable": "not a fingerprint"}
    try:
        return json.loads(text)
    except ValueError as exc:
        return {"unreadable": f"{type(exc).__name__}: {exc}"[:200]}


def remove(path: Path | None) -> None:
    """Forget every decision in the cache at `path` (the rows go; the file stays, and so does the note of which
    JSON cache beside it was imported). A file that is not this format's cache is left as it is."""
    if path is None:
        return
    _forget(path)
    with _memory_lock:
        _memory.pop(str(path), None)
    if not _usable(path) or not os.path.lexists(path):
        return
    try:
        con, read_only = _connect(path, write=True)
        if read_only is not None:
            raise read_only
        con.execute("BEGIN IMMEDIATE")
        try:
            con.execute("DELETE FROM decisions")
            con.execute("DELETE FROM machines")
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise
        con.execute("PRAGMA incremental_vacuum")
    except _CACHE_ERRORS as exc:
        _forget(path)
        say(path, classify(exc), writing=True)


# --- bounds -------------------------------------------------------------------------------------------------------

def _bytes_in_use(con: sqlite3.Connection) -> int:
    pages = con.execute("PRAGMA page_count").fetchone()[0] - con.execute("PRAGMA freelist_count").fetchone()[0]
    return pages * con.execute("PRAGMA page_size").fetchone()[0]


def _trim(con: sqlite3.Connection, machine: str) -> None:
    """Drop this machine's decisions unused for MAX_AGE_DAYS or whose last use is not a past time (SQLite sorts
    text and blobs after every number: a range of the index finds them), and its least recently used past
    MAX_DECISIONS."""
    now_s = time.time()
    con.execute("DELETE FROM decisions WHERE machine = ? AND used < ?", (machine, now_s - MAX_AGE_DAYS * 86400))
    con.execute("DELETE FROM decisions WHERE machine = ? AND used > ?", (machine, now_s + 86400))
    con.execute("DELETE FROM decisions WHERE machine = ? AND signature IN (SELECT signature FROM decisions "
                "WHERE machine = ? ORDER BY used DESC LIMIT -1 OFFSET ?)", (machine, machine, MAX_DECISIONS))


def _bound(con: sqlite3.Connection) -> None:
    """Keep the MACHINES_KEPT most recently used machines, and the database's pages in use within
    MAX_CACHE_BYTES: the least recently used decisions of any machine go, an eighth of them at a time (inside a
    write transaction)."""
    stale = [m for (m,) in con.execute("SELECT machine FROM machines ORDER BY used DESC LIMIT -1 OFFSET ?",
                                       (MACHINES_KEPT,))]
    con.executemany("DELETE FROM decisions WHERE machine = ?", [(m,) for m in stale])
    con.executemany("DELETE FROM machines WHERE machine = ?", [(m,) for m in stale])
    for _ in range(64):
        if _bytes_in_use(con) <= MAX_CACHE_BYTES:
            break
        count = con.execute("SELECT count(*) FROM decisions").fetchone()[0]
        if not count:
            break
        con.execute("DELETE FROM decisions WHERE (machine, signature) IN (SELECT machine, signature FROM decisions "
                    "ORDER BY used LIMIT ?)", (max(1, count // 8),))
    con.execute("PRAGMA incremental_vacuum")  # a database made with auto_vacuum gives the pages back


# --- the JSON cache of earlier versions ---------------------------------------------------------------------------

def _legacy_source(path: Path) -> tuple[Path, tuple[int, int]] | None:
    """(tune.json beside the default tune.sqlite3, its (size, mtime)): the JSON cache of earlier versions; None
    when there is none (or it is not a regular file: left alone)."""
    if path.name != CACHE_FILE:
        return None
    beside = path.with_name(LEGACY_FILE)
    try:
        st = os.lstat(beside)
    except OSError:
        return None
    return (beside, (st.st_size, st.st_mtime_ns)) if stat.S_ISREG(st.st_mode) else None


def _read_legacy(source: Path) -> tuple[dict | None, str | None]:
    """(its content, None) or (None, why it is not a JSON tuning cache this version reads)."""
    try:
        size = os.lstat(source).st_size
        if size > MAX_LEGACY_BYTES:
            return None, f"it is {size} bytes, more than the {MAX_LEGACY_BYTES} read"
        data = json.loads(source.read_bytes())
    except (OSError, ValueError) as exc:
        return None, f"unreadable JSON: {exc}"[:200]
    return (data, None) if _legacy_problem(data) is None else (None, _legacy_problem(data))


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


def _import_legacy(con: sqlite3.Connection, source: Path, stamp: tuple[int, int]) -> None:
    """Copy the valid decisions of the JSON cache `source` beside the database in (the database's own win), once
    per change of the file (its size and time, noted in the database), leaving the file as it is: the version
    that writes it keeps its cache."""
    data, problem = _read_legacy(source)
    if problem is not None:
        warn_once(("tune-cache-legacy", str(source)), "auto: the JSON tuning cache %s of an earlier version is not "
                  "imported (%s); it is left as it is", source, problem)
        return
    note = (f"imported {source.name}", json.dumps(list(stamp)))
    con.execute(f"PRAGMA busy_timeout = {int(health(source.with_name(CACHE_FILE)).wait() * 1000)}")
    con.execute("BEGIN IMMEDIATE")
    try:
        con.execute(META_SCHEMA)
        done = con.execute("SELECT value FROM meta WHERE key = ?", note[:1]).fetchone()
        if done is not None and done[0] == note[1]:
            con.execute("COMMIT")
            return
        kept, dropped = _insert_legacy(con, data)
        con.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", note)
        con.execute("COMMIT")
    except BaseException:
        try:
            con.execute("ROLLBACK")
        except sqlite3.Error:
            pass
        raise
    logger.info("auto: the JSON tuning cache %s moved into %s (%d decisions%s); the JSON file is left as it is",
                source, CACHE_FILE, kept, f", {dropped} left out: of the wrong shape, past the bounds or "
                "held already" if dropped else "")


def _migrate_in_place(path: Path) -> sqlite3.Connection:
    """The JSON cache at `path` itself (a name set before the database) moved into a database there: it is kept
    as `<name>.migrated`, or set aside when it is not a JSON tuning cache (under the lock)."""
    data, problem = _read_legacy(path)
    if problem is not None:
        set_aside(path, problem)
        return open_database(path, True)[0]
    moved = path.with_name(path.name + ".migrated")
    refusal = not_plain(moved, ())
    if refusal:
        raise Unusable("refused", f"the JSON cache there cannot be kept as {moved.name}: {refusal}")
    os.replace(path, moved)  # first: the database goes where the JSON was
    con, _ = open_database(path, True)
    con.execute("BEGIN IMMEDIATE")
    try:
        kept, dropped = _insert_legacy(con, data)
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise
    logger.info("auto: the JSON tuning cache %s moved into a database there (%d decisions%s); the JSON file is "
                "kept as %s", path, kept, f", {dropped} left out: of the wrong shape or past "
                "the bounds" if dropped else "", moved.name)
    return con


def _insert_legacy(con: sqlite3.Connection, data: dict) -> tuple[int, int]:
    """Insert the valid decisions of a JSON cache within the bounds (inside a write transaction): machines under
    a machine key, the MACHINES_KEPT with the newest decisions, per machine its MAX_DECISIONS newest, each
    fitted to MAX_DECISION_CHARS, and no more than MAX_CACHE_BYTES in all; a decision the database holds already
    stays. (inserted, left out)."""
    machines, total = [], 0
    for key, entry in data["machines"].items():
        decisions = entry.get("decisions", {})
        total += len(decisions)
        if _MACHINE_KEY.fullmatch(key) is None:  # no machine has such a key: it would never be looked up
            continue
        rows = []
        for sig, decision in decisions.items():
            text, problem = fitted(decision) if len(sig) <= MAX_KEY_CHARS else (None, "too long a key")
            if problem is None:
                rows.append((decision.get("tuned_at", ""), sig, text))
        rows.sort(reverse=True)
        machines.append((rows[0][0] if rows else "", key, entry.get("machine", {}), rows[:MAX_DECISIONS]))
    machines.sort(key=lambda m: m[0], reverse=True)
    stamp, inserted = time.time(), 0
    for _, key, fingerprint, rows in machines[:MACHINES_KEPT]:
        text = json.dumps(fingerprint, sort_keys=True)
        con.execute("INSERT OR IGNORE INTO machines VALUES (?, ?, ?)",
                    (key, text if len(text) <= MAX_KEY_CHARS * 4 else "{}", stamp))
        for start in range(0, len(rows), 16):  # the newest first, until the byte bound
            if _bytes_in_use(con) > MAX_CACHE_BYTES:
                break
            before = con.total_changes
            con.executemany("INSERT OR IGNORE INTO decisions VALUES (?, ?, ?, ?)",
                            [(key, sig, text, stamp - (start + i) * 1e-3)
                             for i, (_, sig, text) in enumerate(rows[start:start + 16])])
            inserted += con.total_changes - before
        _trim(con, key)
    _bound(con)
    return inserted, total - inserted

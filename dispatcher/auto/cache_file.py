"""The tuning cache's file: what may be opened, how, and what a user is told when it cannot be used.

The cache is a convenience; the file at its path may be anything a user, another program or a full disk left
there. The rules, each case said once per file and process (docs/environment.md lists them for a user):
- Only a regular file is ever opened, written, renamed or removed. A device (`/dev/null`), a FIFO, a socket, a
  folder or a symbolic link at the path, or at SQLite's files beside it (`-wal`, `-shm`) or the lock file, is left
  as it is, and decisions stay in memory. (Run as root, renaming a `/dev/null` given as the path once replaced the
  machine's /dev/null with a database file.)
- An SQLite database of a newer format (a newer version of the pack sharing the folder) or of another program is
  left alone: nothing is read from it or written to it.
- An error of the disk or the folder (full, read-only, an I/O error) is not a damaged file: the file is kept,
  read where it can be (a read-only open), and what cannot be written stays in memory.
- Only a regular file that is really not a tuning cache (neither an SQLite database nor JSON, or one SQLite
  finds damaged on a normal open) is set aside: renamed `<name>.bad` (kept for the user), at most once per
  process and never when MAX_SET_ASIDE such files are already beside it.
- A write lock another process holds (a database browser with the file open) is waited for LOCK_TIMEOUT_S once;
  from then on this process waits BUSY_WAIT_S at most and keeps in memory what it could not write.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from ..log import logger, warn_once

CACHE_FORMAT = 5  # 5: SQLite, one row per (machine, signature); 4: one JSON file (imported, cache.py)
LOCK_TIMEOUT_S = 10.0  # the first wait for another process's write lock; past it that write goes to memory
BUSY_WAIT_S = 0.1  # every later wait, once one LOCK_TIMEOUT_S ran out: a write of one decision takes milliseconds
WRITE_PAUSE_S = 300.0  # after a disk error (full, read-only) no write is tried for this long
MAX_SET_ASIDE = 3  # `.bad` files kept beside the cache; past that a damaged file is left in place
SIDE_FILES = ("-wal", "-shm", ".lock")  # SQLite's journal and shared memory, and the set-aside lock
_SQLITE_HEADER = b"SQLite format 3\x00"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS machines (machine TEXT PRIMARY KEY, fingerprint TEXT NOT NULL, used REAL NOT NULL);
CREATE TABLE IF NOT EXISTS decisions (machine TEXT NOT NULL, signature TEXT NOT NULL, decision TEXT NOT NULL,
                                      used REAL NOT NULL, PRIMARY KEY (machine, signature)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS decisions_by_use ON decisions (machine, used);
"""
META_SCHEMA = "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID"
OUR_TABLES = frozenset({"machines", "decisions", "meta"})


class Unusable(Exception):
    """The cache cannot be used now; `kind` says why: 'refused' (left alone: not a regular file, another format
    or program), 'damaged' (a regular file that is not a tuning cache), 'readonly', 'busy' or 'io'."""

    def __init__(self, kind: str, why: str):
        super().__init__(why)
        self.kind, self.why = kind, why


@dataclass
class Health:
    """What this process learnt about one cache path."""
    wait_s: float = -1.0  # how long a write waits for another process's lock (LOCK_TIMEOUT_S until it ran out)
    writes_paused_until: float = 0.0  # monotonic time: after a disk error, writes go to memory until then
    set_aside: bool = False  # once per process at most
    left_alone: tuple | None = None  # (file identity, why): a database of another format or program
    imported: tuple | None = None  # the stamp of the JSON cache beside it last imported or passed over

    def wait(self) -> float:
        return LOCK_TIMEOUT_S if self.wait_s < 0 else self.wait_s


_health: dict[str, Health] = {}
_health_lock = threading.Lock()


def health(path: Path) -> Health:
    with _health_lock:
        return _health.setdefault(str(path), Health())


def forget_health() -> None:
    """Forget what was learnt about every path (tests; a user who fixed the file)."""
    with _health_lock:
        _health.clear()


# --- what may be touched -------------------------------------------------------------------------------------

def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "not a regular file"


def not_plain(path: Path, side_files: tuple[str, ...] = SIDE_FILES) -> str | None:
    """Why the cache at `path` must not be touched (it, or one of SQLite's files beside it, is something other
    than a regular file), or None. lstat: a symbolic link is never followed."""
    for name in (str(path), *(str(path) + s for s in side_files)):
        try:
            mode = os.lstat(name).st_mode
        except FileNotFoundError:
            continue
        except OSError as exc:
            return f"{name} cannot be examined ({exc.strerror or exc})"
        if not stat.S_ISREG(mode):
            return f"{name} is {_kind(mode)}, not a regular file"
    return None


def identity(path: Path) -> tuple | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


# --- what went wrong ---------------------------------------------------------------------------------------------

def classify(exc: BaseException) -> Unusable:
    """An error from opening, reading or writing the cache as an Unusable of its kind. Only SQLite's own verdict
    that a file is not a database, or is malformed, counts as damaged: a disk that is full, read-only or failing
    says nothing about the file."""
    if isinstance(exc, Unusable):
        return exc
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, Timeout):
        return Unusable("busy", text)
    if isinstance(exc, sqlite3.Error):
        name = getattr(exc, "sqlite_errorname", "") or ""  # Python 3.11+; the message otherwise
        message = str(exc).lower()
        if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "locked" in message or "busy" in message:
            return Unusable("busy", text)
        if name.startswith(("SQLITE_NOTADB", "SQLITE_CORRUPT")) or "not a database" in message or (
                "malformed" in message):
            return Unusable("damaged", text)
        if name.startswith(("SQLITE_READONLY", "SQLITE_PERM", "SQLITE_AUTH")) or "readonly" in message:
            return Unusable("readonly", text)
        return Unusable("io", text)
    if isinstance(exc, PermissionError) or getattr(exc, "errno", None) == errno.EROFS:
        return Unusable("readonly", text)
    return Unusable("io", text)


def say(path: Path, problem: Unusable, writing: bool) -> None:
    """Tell the user once per file and kind, and remember what it means for the next calls."""
    h = health(path)
    if problem.kind == "busy":
        if h.wait() > BUSY_WAIT_S:
            waited, h.wait_s = h.wait(), BUSY_WAIT_S
            logger.warning("auto: another process held the tuning cache %s's write lock for %g s; this process "
                           "now waits at most %g s for it, and keeps in memory the decisions it cannot write "
                           "(said once)", path, waited, BUSY_WAIT_S)
        return
    if problem.kind in ("readonly", "io") and writing:
        h.writes_paused_until = time.monotonic() + WRITE_PAUSE_S
    if problem.kind == "readonly":
        warn_once(("tune-cache-readonly", str(path)), "auto: the tuning cache %s cannot be written (%s); the "
                  "file is kept as it is and read, and new decisions are kept in memory (said once)", path,
                  problem.why)
    elif problem.kind == "refused":
        warn_once(("tune-cache-refused", str(path), problem.why), "auto: the tuning cache %s is left as it is: "
                  "%s; decisions are kept in memory. Set ATTN_DISPATCH_TUNE_CACHE to another file, or to 'off' "
                  "(said once)", path, problem.why)
    else:  # io, or a damaged file that could not be set aside
        warn_once(("tune-cache-io", str(path)), "auto: could not use the tuning cache %s (%s); the file is kept "
                  "as it is, read where it can be, and new decisions are kept in memory (said once)", path,
                  problem.why)


# --- opening -----------------------------------------------------------------------------------------------------

def _header(path: Path) -> bytes | None:
    """The first bytes of the regular file at `path`; None when there is none (or it is empty)."""
    try:
        with open(path, "rb") as fh:
            return fh.read(64) or None
    except FileNotFoundError:
        return None


def holds_json(path: Path) -> bool:
    head = _header(path)
    return head is not None and head.lstrip()[:1] in (b"{", b"[")


def open_database(path: Path, write: bool) -> tuple[sqlite3.Connection, Unusable | None]:
    """(a connection to the cache at `path`, None) or, where the file or its folder cannot be written, (a
    read-only connection, why it is read-only). The file must be a regular one (`not_plain`) or absent: created
    only with write=True. Raises Unusable: 'damaged' only for a regular file that is not a tuning cache."""
    h = health(path)
    left = h.left_alone
    if left is not None and left[0] == identity(path):
        raise Unusable("refused", left[1])
    head = _header(path)
    if head is not None and not head.startswith(_SQLITE_HEADER):
        raise Unusable("damaged", "not an SQLite database")
    try:
        return _open(path, h, create=write), None
    except Unusable as problem:
        if problem.kind == "refused":
            h.left_alone = (identity(path), problem.why)
        if problem.kind not in ("readonly", "io") or head is None:
            raise
        try:
            return _open_read_only(path), problem
        except sqlite3.Error:
            raise problem from None


def _open(path: Path, h: Health, create: bool) -> sqlite3.Connection:
    try:
        if create:
            path.parent.mkdir(parents=True, exist_ok=True)
            con = sqlite3.connect(str(path), timeout=h.wait(), isolation_level=None, check_same_thread=False)
        else:  # a read creates nothing
            con = sqlite3.connect(path.absolute().as_uri() + "?mode=rw", uri=True, timeout=h.wait(),
                                  isolation_level=None, check_same_thread=False)
    except (OSError, sqlite3.Error) as exc:
        raise classify(exc) from None
    try:
        version = con.execute("PRAGMA user_version").fetchone()[0]
        if version == 0:
            _initialise(con)
        else:
            _check_format(version)
        con.execute("PRAGMA synchronous=NORMAL")  # WAL: durable at checkpoints, never corrupt
        con.execute("PRAGMA journal_size_limit = 4194304")  # the WAL file shrinks back to 4 MB at a checkpoint
        return con
    except (Unusable, sqlite3.Error) as exc:
        con.close()
        raise classify(exc) from None
    except BaseException:
        con.close()
        raise


def _check_format(version: int) -> None:
    if version > CACHE_FORMAT:
        raise Unusable("refused", f"it is a cache of format {version}, written by a newer version of the pack "
                                  f"(this one reads format {CACHE_FORMAT})")
    if version != CACHE_FORMAT:
        raise Unusable("refused", f"it is an SQLite database of another program (user_version {version})")


def _initialise(con: sqlite3.Connection) -> None:
    """Make a new database a cache (tables, WAL); an SQLite database of another program is left alone."""
    tables = {name for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if tables - OUR_TABLES:
        raise Unusable("refused", f"it is an SQLite database of another program (tables "
                                  f"{', '.join(sorted(tables - OUR_TABLES))[:120]})")
    if not tables:
        con.execute("PRAGMA auto_vacuum = INCREMENTAL")  # pages freed by trimming go back to the disk
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("BEGIN IMMEDIATE")
    try:
        version = con.execute("PRAGMA user_version").fetchone()[0]
        if version == 0:  # not made by another process meanwhile
            for statement in filter(str.strip, _SCHEMA.split(";")):
                con.execute(statement)
            con.execute(META_SCHEMA)
            con.execute(f"PRAGMA user_version={CACHE_FORMAT}")
        else:
            _check_format(version)
        con.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(sqlite3.Error):
            con.execute("ROLLBACK")
        raise


def _open_read_only(path: Path) -> sqlite3.Connection:
    """A read-only connection: SQLite's read-only mode, else (a WAL database in a folder that cannot be written
    has no shared-memory file to read through) the file as immutable. What it reads is checked all the same
    (cache_shape), and an error through it never sets the file aside."""
    uri = path.absolute().as_uri()
    last: sqlite3.Error | None = None
    for query in ("?mode=ro", "?mode=ro&immutable=1"):
        con = sqlite3.connect(uri + query, uri=True, timeout=BUSY_WAIT_S, isolation_level=None,
                              check_same_thread=False)
        try:
            _check_format(con.execute("PRAGMA user_version").fetchone()[0])
            con.execute("SELECT 1 FROM decisions LIMIT 1").fetchall()
            return con
        except Unusable:
            con.close()
            raise
        except sqlite3.Error as exc:
            con.close()
            last = exc
    raise last


# --- setting a damaged file aside ------------------------------------------------------------------------------

def lock(path: Path, timeout: float) -> FileLock:
    return FileLock(str(path) + ".lock", timeout=timeout)


def set_aside(path: Path, why: str) -> None:
    """Rename the regular file at `path`, which is not a tuning cache, to a free `<name>.bad[-n]` (kept for the
    user), with one warning; its SQLite files beside it go. Raises Unusable where it may not: a second
    time in this process, MAX_SET_ASIDE such files already kept ('refused'), or the rename failed ('io')."""
    h = health(path)
    taken = [path.with_name(path.name + (".bad" if n == 0 else f".bad-{n}")) for n in range(MAX_SET_ASIDE)]
    free = next((p for p in taken if not os.path.lexists(p)), None)
    if h.set_aside or free is None:
        raise Unusable("refused", f"it is not a tuning cache ({why}), and " + (
            "this process set one aside already" if h.set_aside else
            f"{MAX_SET_ASIDE} set-aside caches are kept beside it already: delete them"))
    refusal = not_plain(path, ())
    if refusal:
        raise Unusable("refused", refusal)
    try:
        os.rename(path, free)
    except OSError as exc:
        raise Unusable("io", f"it is not a tuning cache ({why}) and could not be renamed ({exc})") from None
    h.set_aside = True
    for suffix in ("-wal", "-shm"):
        side = Path(str(path) + suffix)
        if not not_plain(side, ()):
            with contextlib.suppress(OSError):
                os.unlink(side)
    logger.warning("auto: the tuning cache %s is not a tuning cache (%s); it is kept as %s and a new one is "
                   "started", path, why, free.name)

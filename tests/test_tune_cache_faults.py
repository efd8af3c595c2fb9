"""`auto`'s disk cache when the file or the disk is not what it expects (issue #47): it never harms the machine
(never renames, replaces or writes through what is not a regular file it made), never throws away a good cache
(a full or read-only disk, a held lock, another version's file), never fails a prompt (a damaged row), and stays
within its bounds by value (database bytes, characters per field read back, per decision)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import sqlite3
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import dispatcher
from dispatcher import AttentionInputs, auto, dispatch_attention_fn
from dispatcher.auto import Tuner, cache, cache_file, cache_shape
from dispatcher.auto.fingerprint import fingerprint_key, machine_fingerprint
from helpers import fake_clock

ROOT = Path(__file__).resolve().parent.parent
SIG = AttentionInputs.of(1, 2, 32, 16, dtype=torch.float32, device="cpu")
CLOCK = fake_clock.FakeClock()
NAMES = ("tcf_slow", "tcf_fast")


@pytest.fixture
def backends(monkeypatch):
    yield from fake_clock.slow_and_fast(monkeypatch, CLOCK, NAMES)


def _key() -> str:
    return fingerprint_key(machine_fingerprint())


def _good(median=1.0, **extra) -> dict:
    return {"candidates": list(NAMES), "tuned_at": "2026-12-01T00:00:00+00:00", "seconds": 0.1,
            "timings": {n: {"median_ms": median, "times_ms": [median]} for n in NAMES}, "verdicts": {}, **extra}


def _warnings(caplog, words="tuning cache") -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and words in r.getMessage()]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _closed(path: Path) -> None:
    """This thread's connection closed (the WAL checkpointed into the file and removed, as at a process's end)."""
    cache._forget(path)


def _exercise(path: Path, rounds: int = 3) -> list:
    """What the tuner does with its cache, a few times over: lookups, updates, a dump."""
    seen = []
    for i in range(rounds):
        seen.append(cache.lookup(path, f"sig-{i}"))
        cache.update(path, f"sig-{i}", lambda saved: _good())
        seen.append(cache.lookup(path, f"sig-{i}"))
        cache.dump(path)
    return seen


# --- never rename, replace or write through what is not a regular file ---------------------------------------

def _fifo(folder: Path) -> Path:
    os.mkfifo(folder / "tune.sqlite3")
    return folder / "tune.sqlite3"


def _socket(folder: Path) -> Path:
    path = folder / "tune.sqlite3"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    _socket.keep = server  # bound for the test's life
    return path


def _symlink(folder: Path) -> Path:
    (folder / "victim").write_bytes(b"a file of the user's, not a cache" * 10)
    os.symlink(folder / "victim", folder / "tune.sqlite3")
    return folder / "tune.sqlite3"


def _dangling(folder: Path) -> Path:
    os.symlink(folder / "nowhere", folder / "tune.sqlite3")
    return folder / "tune.sqlite3"


def _device(folder: Path) -> Path:
    """A private null device, as `/dev/null` given for the path (mknod needs root)."""
    path = folder / "devnull"
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except (PermissionError, AttributeError):
        pytest.skip("making a device node (mknod) needs root; the FIFO and socket cases show the rule without it")
    return path


def _side_symlink(folder: Path) -> Path:
    """A good cache whose WAL name is a symbolic link to a file of the user's: SQLite would write through it."""
    path = folder / "tune.sqlite3"
    cache.update(path, "before", lambda saved: _good())
    _closed(path)
    (folder / "victim").write_bytes(b"a file of the user's, not a WAL" * 10)
    os.symlink(folder / "victim", str(path) + "-wal")
    return path


NODES = {"socket": _socket, "symlink": _symlink, "dangling symlink": _dangling, "device": _device,
         "WAL a symlink": _side_symlink}


def _snapshot(folder: Path) -> dict:
    return {p.name: (os.lstat(p).st_ino, stat.S_IFMT(os.lstat(p).st_mode),
                     _digest(p) if p.is_file() and not p.is_symlink() else None) for p in folder.iterdir()}


@pytest.mark.skipif(sys.platform == "win32", reason="FIFOs, unix sockets and device nodes are POSIX")
@pytest.mark.parametrize("make", NODES.values(), ids=NODES.keys())
def test_what_is_not_a_regular_file_is_never_renamed_replaced_or_written(tmp_path, backends, caplog, make):
    """Run as root, `ATTN_DISPATCH_TUNE_CACHE=/dev/null` renamed the machine's /dev/null to /dev/null.bad and put a
    database in its place. A device, a socket or a symbolic link at the path (or at SQLite's files beside it) is
    left exactly as it is: no rename, no file made beside it, nothing written through a link; decisions stay in
    memory (and are served from there), said once."""
    path = make(tmp_path)
    before = _snapshot(tmp_path)
    seen = _exercise(path)
    for _ in range(2):
        assert Tuner(cache_path=path, backends=backends).tune(SIG).chosen == "tcf_fast"
    cache.remove(path)
    assert _snapshot(tmp_path) == before
    assert seen[1::2] == [_good()] * 3  # written to memory, read back from there
    said = _warnings(caplog)
    assert len(said) == 1 and "left as it is" in said[0] and "not a regular file" in said[0], said


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX")
def test_a_fifo_as_the_cache_is_never_opened_or_renamed(tmp_path):
    """A FIFO: opening it to read its header waits for a writer forever, and setting it aside renamed it. In a
    process of its own (a hang fails the test, not the run)."""
    path = _fifo(tmp_path)
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        from pathlib import Path
        from test_tune_cache_faults import _exercise
        print(json.dumps(_exercise(Path({str(path)!r}))))
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [p.name for p in tmp_path.iterdir()] == ["tune.sqlite3"] and stat.S_ISFIFO(os.lstat(path).st_mode)
    assert json.loads(done.stdout.splitlines()[-1])[1::2] == [_good()] * 3
    assert done.stderr.count("left as it is") == 1, done.stderr[-3000:]


def test_the_null_device_means_no_cache(monkeypatch):
    for null in (os.devnull, f" {os.devnull} "):
        monkeypatch.setenv(cache.ENV_CACHE, null)
        assert cache.default_cache_path() is None and Tuner().cache_path is None


# --- a disk error is not a damaged file ---------------------------------------------------------------------------

FULL_DISK = textwrap.dedent("""
    import json, resource, signal, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[3])
    from test_tune_cache_faults import _exercise
    from dispatcher.auto import cache
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), as on a full disk
    limit = int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    path = Path(sys.argv[1])
    seen = _exercise(path, rounds=5)
    print(json.dumps({"seen": seen, "before": cache.lookup(path, "before")}))
""")


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
@pytest.mark.parametrize("limit", [4096, 0], ids=["nothing grows", "nothing written"])
def test_a_full_disk_keeps_the_cache_and_serves_from_memory(tmp_path, limit):
    """On a full 2 MB tmpfs a good cache was set aside as `.bad` at every lookup or update (10 files from 5
    pairs, each with a warning, every lookup a miss). A disk error is not a damaged file: the cache is kept as it
    is and read, what cannot be written is served from memory, said once. A file-size limit (RLIMIT_FSIZE) makes
    every write past it fail as a full disk does, without root."""
    path = tmp_path / "tune.sqlite3"
    for i in range(20):
        cache.update(path, "before" if i == 0 else f"other-{i}", lambda saved: _good(2.0))
    _closed(path)
    assert path.stat().st_size > 4096 and not Path(str(path) + "-wal").exists()
    digest = _digest(path)
    done = subprocess.run([sys.executable, "-c", FULL_DISK, str(path), str(limit), str(ROOT / "tests")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["before"] == _good(2.0)  # the cache is read
    assert out["seen"][1::2] == [_good()] * 5  # what could not be written is served from memory
    assert _digest(path) == digest and not list(tmp_path.glob("*.bad*")), sorted(tmp_path.iterdir())
    said = [line for line in done.stderr.splitlines() if "tuning cache" in line]
    assert len(said) == 1 and "kept as it is" in said[0], said


# --- another version's cache is left alone -----------------------------------------------------------------------

def test_a_cache_of_a_newer_format_is_left_alone(tmp_path, backends, caplog):
    """A newer version of the pack sharing the folder writes a newer format: it was renamed away at every meeting
    (6 meetings, 6 `.bad` files). This version reads nothing from it and writes nothing to it."""
    path = tmp_path / "tune.sqlite3"
    with sqlite3.connect(path) as con:
        con.execute("CREATE TABLE decisions_v6 (key TEXT PRIMARY KEY, value BLOB)")
        con.execute("INSERT INTO decisions_v6 VALUES ('sig', x'00')")
        con.execute(f"PRAGMA user_version = {cache.CACHE_FORMAT + 1}")
    con.close()
    digest = _digest(path)
    for _ in range(3):
        assert Tuner(cache_path=path, backends=backends).tune(SIG).chosen == "tcf_fast"
        _exercise(path, rounds=2)
    cache.remove(path)
    assert _digest(path) == digest and sorted(p.name for p in tmp_path.iterdir()) == ["tune.sqlite3"]
    said = _warnings(caplog)
    assert len(said) == 1 and "newer version" in said[0], said


def test_an_sqlite_database_of_another_program_is_left_alone(tmp_path, caplog):
    path = tmp_path / "notes.db"
    with sqlite3.connect(path) as con:
        con.execute("CREATE TABLE notes (body TEXT)")
        con.execute("INSERT INTO notes VALUES ('keep me')")
    con.close()
    digest = _digest(path)
    _exercise(path)
    cache.remove(path)
    assert _digest(path) == digest and sorted(p.name for p in tmp_path.iterdir()) == ["notes.db"]
    said = _warnings(caplog)
    assert len(said) == 1 and "another program" in said[0], said


def test_a_damaged_file_is_set_aside_once_and_never_more_than_the_bound(tmp_path, caplog):
    path = tmp_path / "tune.sqlite3"
    for n in range(cache_file.MAX_SET_ASIDE + 2):
        cache_file.forget_health()  # as a new process would
        _closed(path)
        path.write_bytes(b"not a database, long enough for a header %d" % n)
        for _ in range(3):
            cache.lookup(path, "sig")
            cache.update(path, "sig", lambda saved: _good())
    assert len(list(tmp_path.glob("tune.sqlite3.bad*"))) == cache_file.MAX_SET_ASIDE
    assert path.read_bytes().startswith(b"not a database")  # past the bound: left in place
    said = _warnings(caplog)
    assert len([m for m in said if "it is kept as tune.sqlite3.bad" in m]) == cache_file.MAX_SET_ASIDE, said
    assert len(said) == cache_file.MAX_SET_ASIDE + 1 and "delete them" in said[-1], said


def test_a_database_sqlite_finds_malformed_is_set_aside_once_and_a_new_one_started(tmp_path, caplog):
    """Its header and first page intact (it opens), its other pages overwritten: SQLite finds it malformed at the
    first read, on a normal connection. That file is really damaged: it is set aside once, and the cache goes on."""
    path = tmp_path / "tune.sqlite3"
    for i in range(40):
        cache.update(path, f"sig-{i}", lambda saved: _good(verdicts={"m": {"": {n: {
            "status": "valid", "rel_error": 0.0, "reason": "r" * 150} for n in NAMES}}}))
    _closed(path)
    data = bytearray(path.read_bytes())
    data[4096:] = b"\xa5" * (len(data) - 4096)
    path.write_bytes(bytes(data))
    for _ in range(3):
        cache.lookup(path, "sig-3")
        cache.update(path, "after", lambda saved: _good())
    assert cache.lookup(path, "after") == _good() and set(cache.dump(path)["machines"][_key()]["decisions"]) == {
        "after"}
    assert len(list(tmp_path.glob("tune.sqlite3.bad*"))) == 1
    said = _warnings(caplog)
    assert len(said) == 1 and "it is kept as tune.sqlite3.bad" in said[0], said


# --- a damaged row never fails a prompt --------------------------------------------------------------------------

DAMAGE = {
    "used is text": "UPDATE decisions SET used = 'yesterday'",
    "used is a blob": "UPDATE decisions SET used = x'0102'",
    "decision is a blob": "UPDATE decisions SET decision = x'7b7d'",
    "decision is a number": "UPDATE decisions SET decision = 42",
    "decision is not JSON": "UPDATE decisions SET decision = '{\"candidates\": ['",
    "decision too long": f"UPDATE decisions SET decision = '{{\"candidates\": [], \"pad\": \"' || "
                         f"printf('%.*c', {cache_shape.MAX_DECISION_CHARS}, 'x') || '\"}}'",
    "tuned_at of 2 MB": "UPDATE decisions SET decision = json_set(decision, '$.tuned_at', "
                        "printf('%.*c', 2000000, 'x'))",
}


@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE.keys())
def test_a_damaged_row_never_fails_dispatch_attention_fn(tmp_path, backends, caplog, damage):
    """Text in the `used` column made dispatch_attention_fn raise TypeError ("unsupported operand type(s) for -:
    'float' and 'str'"); each field read back is checked, and a row that is not a decision is dropped."""
    path = tmp_path / "tune.sqlite3"
    q, k, v = (torch.randn(1, 32, 2, 16) for _ in range(3))
    with auto.using(Tuner(cache_path=path, backends=backends)) as t:
        dispatch_attention_fn(q, k, v, backend="auto_exact")
        assert cache.dump(path)["machines"][_key()]["decisions"]
        with sqlite3.connect(path) as con:
            con.execute(damage)
        con.close()
        t.clear_cache(disk=False)
        out = dispatch_attention_fn(q, k, v, backend="auto_exact")
        torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2))
        (record,) = t.records()
        assert record.source in ("timed", "judged") and len(t.explain()) < 5000 and len(json.dumps(t.report())) < 20000
    said = _warnings(caplog)
    assert len(said) == 1 and "wrong shape" in said[0] and len(said[0]) < 1000, said


# --- a read-only folder or file is read -----------------------------------------------------------------------------

def _permission_bits_bind(folder: Path) -> bool:
    probe = folder / "probe"
    probe.mkdir()
    probe.chmod(0o555)
    try:
        (probe / "x").touch()
    except PermissionError:
        return True
    finally:
        probe.chmod(0o755)
    return False


@pytest.mark.parametrize("what", ["folder", "file"])
def test_a_read_only_cache_is_read_and_new_decisions_stay_in_memory(tmp_path, caplog, what):
    """A read-only folder made a good cache unreadable (PermissionError on tune.sqlite3.lock, every lookup
    missed): a read needs no lock file, and falls back to a read-only open."""
    if not _permission_bits_bind(tmp_path):
        pytest.skip("this user writes through permission bits (root); CI runs this as a user")
    folder = tmp_path / "ro"
    folder.mkdir()
    path = folder / "tune.sqlite3"
    cache.update(path, "before", lambda saved: _good(2.0))
    _closed(path)
    before = _snapshot(folder)
    target = folder if what == "folder" else path
    mode = target.stat().st_mode
    target.chmod(0o555 if what == "folder" else 0o444)
    try:
        assert cache.lookup(path, "before") == _good(2.0)
        assert _exercise(path)[1::2] == [_good()] * 3
        assert cache.lookup(path, "before") == _good(2.0)
        _closed(path)
        assert {n: e for n, e in _snapshot(folder).items() if n == "tune.sqlite3"} == before
    finally:
        target.chmod(mode)
    assert not list(folder.glob("*.bad*")) and not (folder / "tune.sqlite3.lock").exists()
    said = _warnings(caplog)
    assert len(said) == 1 and "cannot be written" in said[0], said


# --- bounds by value ----------------------------------------------------------------------------------------------

def _file_bytes(path: Path) -> int:
    _closed(path)
    return sum(p.stat().st_size for p in path.parent.iterdir() if p.name.startswith(path.name) and p.is_file())


def test_migrating_a_huge_json_cache_makes_a_bounded_database(tmp_path, monkeypatch):
    """A 16.2 MB tune.json with one 100 kB machine key once made an 867 MB database (the key in every row and
    index entry). A key that is no machine's is left out, and the database stays within MAX_CACHE_BYTES."""
    monkeypatch.setattr(cache, "MAX_CACHE_BYTES", 1 << 20)
    monkeypatch.delenv(cache.ENV_CACHE, raising=False)
    big = _good(verdicts={f"model-{m}": {str(b): {n: {"status": "valid", "rel_error": 0.001, "reason": ""}
                                                  for n in NAMES} for b in range(20)} for m in range(4)})
    legacy = {"format": 4, "machines": {
        "k" * 100_000: {"machine": {}, "decisions": {f"sig-{i}": _good() for i in range(100)}},
        _key(): {"machine": machine_fingerprint(), "decisions": {
            f"sig-{i}": {**big, "tuned_at": f"2026-12-01T00:00:00+00:00 #{i:04}"} for i in range(2000)}}}}
    (tmp_path / "tune.json").write_text(json.dumps(legacy))
    assert (tmp_path / "tune.json").stat().st_size > 16e6
    previous = cache.set_default_dir(tmp_path)
    try:
        path = cache.default_cache_path()
        assert cache.lookup(path, "sig-1999") is not None  # the newest
    finally:
        cache.set_default_dir(previous)
    assert _file_bytes(path) <= cache.MAX_CACHE_BYTES + 256 * 1024, _file_bytes(path)
    assert list(cache.dump(path)["machines"]) == [_key()]


def test_the_database_stays_within_its_bytes_in_all(tmp_path, monkeypatch):
    """Decisions of several machines, far past MAX_CACHE_BYTES: the least recently used go, whoever's they are;
    the file stays within the bound (SQLite's pages in use), and the newest decisions are kept."""
    monkeypatch.setattr(cache, "MAX_CACHE_BYTES", 512 * 1024)
    path = tmp_path / "tune.sqlite3"
    big = _good(verdicts={f"model-{m}": {str(b): {n: {"status": "valid", "rel_error": 0.001, "reason": "r" * 150}
                                                  for n in NAMES} for b in range(10)} for m in range(3)})
    assert len(json.dumps(big)) > 10_000
    for i in range(120):
        with dispatcher.use_machine(dispatcher.current_machine().with_packages(fake=f"{i % 4}.0")):
            cache.update(path, f"sig-{i}", lambda saved: big)
    assert _file_bytes(path) <= cache.MAX_CACHE_BYTES + 256 * 1024, _file_bytes(path)
    with dispatcher.use_machine(dispatcher.current_machine().with_packages(fake="3.0")):
        assert cache.lookup(path, "sig-119") is not None


def test_one_signature_keeps_the_verdicts_of_its_most_recent_models_within_its_bound(tmp_path, backends):
    """One signature's row took every model that used it (838 -> 4,019 characters over 12 models, never trimmed):
    it keeps MAX_MODELS_PER_DECISION models, the most recently tuned, within MAX_DECISION_CHARS."""
    path = tmp_path / "tune.sqlite3"
    q, k, v = (torch.randn(1, 32, 2, 16) for _ in range(3))
    models = [f"model-{i}" for i in range(cache_shape.MAX_MODELS_PER_DECISION + 8)]
    for model in models:
        Tuner(cache_path=path, backends=backends).tune(q, k, v, model=model)
    (decision,) = cache.dump(path)["machines"][_key()]["decisions"].values()
    assert list(decision["verdicts"]) == models[-cache_shape.MAX_MODELS_PER_DECISION:]
    assert len(json.dumps(decision)) <= cache_shape.MAX_DECISION_CHARS
    again = Tuner(cache_path=path, backends=backends)
    assert again.tune(q, k, v, model=models[-1]).source == "disk" and again.timing_calls == 0


def test_a_decision_past_its_bound_keeps_the_newest_verdicts(monkeypatch):
    monkeypatch.setattr(cache_shape, "MAX_DECISION_CHARS", 4000)
    verdict = {n: {"status": "rejected", "rel_error": float("inf"), "reason": "x" * 10_000} for n in NAMES}
    decision = _good(verdicts={f"m{m}": {f"block {b}": verdict for b in range(6)} for m in range(3)})
    text, problem = cache_shape.fitted(decision)
    assert problem is None and len(text) <= 4000
    kept = json.loads(text)["verdicts"]
    assert list(kept) == ["m2"] and list(kept["m2"])[-1] == "block 5"
    assert all(len(v["reason"]) <= cache_shape.MAX_TEXT_CHARS for b in kept["m2"].values() for v in b.values())
    assert cache_shape.decision_problem(json.loads(text)) is None


def test_text_fields_read_back_are_bounded_and_so_is_the_report(tmp_path, backends):
    """A 2 MB tuned_at made the report 2,006,348 characters and explain() 2,000,603. Fields read back are at
    most MAX_TEXT_CHARS (a longer one: the decision is measured again), so explain() of a decision read from
    disk grows by at most MAX_TEXT_CHARS a candidate, whatever the file holds."""
    path = tmp_path / "tune.sqlite3"
    q, k, v = (torch.randn(1, 32, 2, 16) for _ in range(3))
    Tuner(cache_path=path, backends=backends).tune(q, k, v, model="m")
    plain = Tuner(cache_path=path, backends=backends)
    assert plain.tune(q, k, v, model="m").source == "disk"
    base, base_report = len(plain.explain()), len(json.dumps(plain.report()))
    for tuned_at in ("t" * cache_shape.MAX_TEXT_CHARS, "t" * 2_000_000):
        with sqlite3.connect(path) as con:
            con.execute("UPDATE decisions SET decision = json_set(decision, '$.tuned_at', ?)", (tuned_at,))
        con.close()
        t = Tuner(cache_path=path, backends=backends)
        t.tune(q, k, v, model="m")
        grown = (len(NAMES) + 1) * cache_shape.MAX_TEXT_CHARS
        assert len(t.explain()) <= base + grown and len(json.dumps(t.report())) <= base_report + grown, (
            len(t.explain()), len(json.dumps(t.report())))


def test_rows_whose_last_use_is_not_a_time_are_trimmed_at_the_next_write(tmp_path):
    """A row never looked up again whose `used` is text would sort after every number: kept forever by the age and
    least-recently-used rules. The next write drops it (a range of the index, no scan)."""
    path = tmp_path / "tune.sqlite3"
    for i in range(4):
        cache.update(path, f"sig-{i}", lambda saved: _good())
    with sqlite3.connect(path) as con:
        con.execute("UPDATE decisions SET used = 'yesterday' WHERE signature IN ('sig-0', 'sig-1')")
        con.execute("UPDATE decisions SET used = 1e300 WHERE signature = 'sig-2'")
    con.close()
    cache.update(path, "sig-4", lambda saved: _good())
    assert set(cache.dump(path)["machines"][_key()]["decisions"]) == {"sig-3", "sig-4"}

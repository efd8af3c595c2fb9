"""`auto`'s disk cache: where it lives (the host's folder, the environment, ~/.cache) and two processes writing it
at once without losing each other's decisions (one transaction per decision)."""

from __future__ import annotations

import json
import logging
import math
import os
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import dispatcher
from dispatcher import AttentionInputs
from dispatcher.auto import Tuner, cache, cache_file
from dispatcher.auto.fingerprint import fingerprint_key, machine_fingerprint
from dispatcher.log import forget_warnings
from helpers import fake_clock

ROOT = Path(__file__).resolve().parent.parent

WRITER = textwrap.dedent("""
    import sys
    import time
    from pathlib import Path
    from dispatcher.auto import cache
    path, who, count = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    Path(sys.argv[4]).touch()  # ready
    while not Path(sys.argv[5]).exists():  # start together
        time.sleep(0.001)
    for i in range(count):
        cache.update(path, f"{who}-{i}", lambda saved, i=i: {"candidates": ["native"], "n": i})
""")


def test_two_processes_writing_at_once_keep_every_decision(tmp_path):
    """Each process writes 40 decisions of its own, read-merge-replace each time: without the lock, a rewrite made
    from a read taken before the other's replace dropped the other's decisions."""
    path, go = tmp_path / "tune.json", tmp_path / "go"
    count = 40
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), who, str(count), str(tmp_path / who),
                                 str(go)], cwd=ROOT, stderr=subprocess.PIPE, text=True) for who in ("a", "b")]
    try:
        for who in ("a", "b"):
            ready = tmp_path / who
            for _ in range(3000):
                if ready.exists():
                    break
                time.sleep(0.01)
        go.touch()
        for w in writers:
            assert w.wait(timeout=300) == 0, w.stderr.read()[-2000:]
    finally:
        for w in writers:
            if w.poll() is None:
                w.kill()
    data = cache.dump(path)
    decisions = data["machines"][fingerprint_key(machine_fingerprint())]["decisions"]
    assert sorted(decisions) == sorted(f"{who}-{i}" for who in ("a", "b") for i in range(count))


def test_the_host_names_the_folder_unless_the_environment_does(tmp_path, monkeypatch):
    monkeypatch.delenv(cache.ENV_CACHE, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.default_cache_path() == tmp_path / "xdg" / "attention_dispatch" / "tune.sqlite3"
    previous = cache.set_default_dir(tmp_path / "comfy-user" / "attention_dispatch")
    try:
        assert cache.default_cache_path() == tmp_path / "comfy-user" / "attention_dispatch" / "tune.sqlite3"
        monkeypatch.setenv(cache.ENV_CACHE, str(tmp_path / "mine.json"))
        assert cache.default_cache_path() == tmp_path / "mine.json"
        monkeypatch.setenv(cache.ENV_CACHE, "off")
        assert cache.default_cache_path() is None
    finally:
        cache.set_default_dir(previous)


def test_a_write_lock_held_elsewhere_stalls_one_write_once_and_decisions_stay_in_memory(tmp_path, monkeypatch,
                                                                                       caplog):
    """Another process holding the database's write lock (a database browser with the file open) made every new
    decision wait LOCK_TIMEOUT_S (10.03, 10.04, 10.02 s), the warning repeated each time. Now the first write waits
    it out, later ones wait BUSY_WAIT_S at most, it is said once, and what could not be written is served from
    memory; once the lock is gone, writes reach the file again."""
    path = tmp_path / "tune.sqlite3"
    cache.update(path, "before", lambda saved: {"candidates": ["native"]})
    monkeypatch.setattr(cache_file, "LOCK_TIMEOUT_S", 1.0)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sqlite3, time
        con = sqlite3.connect({str(path)!r}, isolation_level=None)
        con.execute("BEGIN IMMEDIATE")
        open({str(tmp_path / 'held')!r}, 'w').close()
        time.sleep(60)
    """)])
    try:
        for _ in range(3000):
            if (tmp_path / "held").exists():
                break
            time.sleep(0.01)
        took = []
        for i in range(4):
            start = time.monotonic()
            cache.update(path, f"sig-{i}", lambda saved: {"candidates": ["native"]})
            took.append(time.monotonic() - start)
        assert took[0] >= 0.9 and max(took[1:]) < 0.5, took
        assert all(cache.lookup(path, f"sig-{i}") is not None for i in range(4))  # from memory
        assert set(cache.dump(path)["machines"][_key()]["decisions"]) == {"before"}  # reads never waited
    finally:
        holder.kill()
        holder.wait()
    said = [r.getMessage() for r in caplog.records if "write lock" in r.getMessage()]
    assert len(said) == 1 and "waits at most" in said[0], said
    cache.update(path, "after", lambda saved: {"candidates": ["native"]})  # released when its holder died
    assert set(cache.dump(path)["machines"][_key()]["decisions"]) == {"before", "after"}


# --- a cache of the wrong shape never fails a prompt ------------------------------------------------------------

SIG = AttentionInputs.of(1, 2, 32, 16, dtype=torch.float32, device="cpu")
CLOCK = fake_clock.FakeClock()
NAMES = ("tc_slow", "tc_fast")


@pytest.fixture
def backends(monkeypatch):
    yield from fake_clock.slow_and_fast(monkeypatch, CLOCK, NAMES)


def _key() -> str:
    return fingerprint_key(machine_fingerprint())


def _good(median=1.0) -> dict:
    return {"candidates": list(NAMES), "tuned_at": "2026-12-01T00:00:00+00:00", "seconds": 0.1,
            "timings": {n: {"median_ms": median, "times_ms": [median]} for n in NAMES}, "verdicts": {}}


def _sig_key() -> str:
    return SIG.key()


# The shapes a hostile writer left (issue #41): each broke every `auto` prompt until the file was deleted.
HOSTILE_FILES = {
    "decisions a list": lambda: {"format": 4, "machines": {_key(): {"decisions": []}}},
    "machines a list": lambda: {"format": 4, "machines": []},
    "machine entry a string": lambda: {"format": 4, "machines": {_key(): "x"}},
    "decision a list": lambda: {"format": 4, "machines": {_key(): {"decisions": {_sig_key(): [1, 2]}}}},
    "timings a list": lambda: {"format": 4, "machines": {_key(): {"decisions": {
        _sig_key(): {**_good(), "timings": [1]}}}}},
    "timing a number": lambda: {"format": 4, "machines": {_key(): {"decisions": {
        _sig_key(): {**_good(), "timings": {NAMES[0]: 3}}}}}},
    "NaN medians": lambda: {"format": 4, "machines": {_key(): {"decisions": {_sig_key(): _good(float("nan"))}}}},
    "verdicts of a string": lambda: {"format": 4, "machines": {_key(): {"decisions": {
        _sig_key(): {**_good(), "verdicts": {"m": "x"}}}}}},
    "a list at the top": lambda: [1, 2, 3],
    "not JSON": lambda: "{\"format\": 4, \"machines\"",
}


def _write_legacy(path: Path, data) -> None:
    path.write_text(data if isinstance(data, str) else json.dumps(data))


def _cache_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "tuning cache" in r.getMessage()]


@pytest.mark.parametrize("shape", HOSTILE_FILES.values(), ids=HOSTILE_FILES.keys())
def test_a_tuning_cache_of_the_wrong_shape_is_set_aside_once_and_auto_goes_on(tmp_path, backends, caplog, shape):
    path = tmp_path / "tune.json"  # a name from before the database: the file the user had
    data = shape()
    _write_legacy(path, data)
    original = path.read_text()
    for _ in range(3):  # every prompt used to fail; now the first sets it aside and the others never see it
        record = Tuner(cache_path=path, backends=backends).tune(SIG, model="m")
        assert record.chosen == "tc_fast"
    kept = list(tmp_path.glob("tune.json*.bad")) + list(tmp_path.glob("tune.json.migrated"))
    assert kept and any(p.read_text() == original for p in kept), sorted(tmp_path.iterdir())
    assert cache.lookup(path, _sig_key()) is not None  # the new cache works
    assert len(_cache_warnings(caplog)) <= 1, _cache_warnings(caplog)


def test_a_decision_of_the_wrong_shape_in_the_database_is_dropped_once(tmp_path, backends, caplog):
    path = tmp_path / "tune.sqlite3"
    cache.update(path, "other", lambda saved: _good())
    with sqlite3.connect(path) as con:
        con.execute("INSERT OR REPLACE INTO decisions VALUES (?, ?, ?, ?)",
                    (_key(), _sig_key(), json.dumps(_good(float("nan"))), time.time()))
    for _ in range(3):
        assert Tuner(cache_path=path, backends=backends).tune(SIG).chosen == "tc_fast"
    warnings = _cache_warnings(caplog)
    assert len(warnings) == 1 and "wrong shape" in warnings[0] and "median" in warnings[0], warnings
    assert math.isfinite(cache.lookup(path, _sig_key())["timings"]["tc_fast"]["median_ms"])
    assert cache.lookup(path, "other") is not None


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner,
                                                                                max_size=4),
                    max_leaves=12)


def _mutated(draw_path: list, value, decision: dict) -> dict:
    """`decision` with the subtree at `draw_path` (keys, as far as they go) replaced by `value`."""
    out = json.loads(json.dumps(decision))
    node = out
    for key in draw_path[:-1]:
        if not isinstance(node, dict) or key not in node:
            break
        node = node[key]
    if isinstance(node, dict):
        node[draw_path[-1]] = value
    return out


PATHS = [["candidates"], ["timings"], ["timings", "tc_fast"], ["timings", "tc_fast", "median_ms"],
         ["timings", "tc_fast", "times_ms"], ["verdicts"], ["verdicts", "m"], ["verdicts", "m", ""],
         ["verdicts", "m", "", "tc_fast"], ["seconds"], ["tuned_at"]]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.sampled_from(["file", "row"]), path_in=st.sampled_from(PATHS), value=JSON, whole=st.booleans(),
       anything=JSON)
def test_fuzz_any_json_in_the_cache_never_fails_auto(tmp_path_factory, backends, where, path_in, value, whole,
                                                     anything):
    """Random JSON, as the whole file or in place of any part of a saved decision (in a JSON file to migrate, or a
    row of the database): `auto` decides (disk, judged or timed), never raises, warns at most once per file."""
    folder = tmp_path_factory.mktemp("fuzz")
    good = _good()
    good["verdicts"] = {"m": {"": {n: {"status": "valid", "rel_error": 0.0, "reason": ""} for n in NAMES}}}
    decision = anything if whole else _mutated(path_in, value, good)
    forget_warnings()
    handler = _Collect()
    logging.getLogger("attention_dispatch").addHandler(handler)
    try:
        if where == "file":
            path = folder / "tune.json"
            body = decision if whole and not isinstance(decision, dict) else {
                "format": 4, "machines": {_key(): {"machine": {}, "decisions": {_sig_key(): decision}}}}
            _write_legacy(path, body)
        else:
            path = folder / "tune.sqlite3"
            cache.update(path, "other", lambda saved: _good())
            with sqlite3.connect(path) as con:
                con.execute("INSERT OR REPLACE INTO decisions VALUES (?, ?, ?, ?)",
                            (_key(), _sig_key(), json.dumps(decision), time.time()))
        for _ in range(2):
            record = Tuner(cache_path=path, backends=NAMES).tune(SIG, model="m")
            assert record.chosen in NAMES and record.source in ("disk", "judged", "timed")
    finally:
        logging.getLogger("attention_dispatch").removeHandler(handler)
    assert len([m for m in handler.messages if "tuning cache" in m]) <= 1, handler.messages


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


# --- the JSON cache of earlier versions moves in once -------------------------------------------------------------

def test_the_json_cache_beside_is_imported_once_per_change_and_left_for_the_version_that_writes_it(
        tmp_path, backends, caplog, monkeypatch):
    """Two versions of the pack sharing a folder: the JSON cache an earlier one writes (tune.json) is imported into
    the database, once per change of the file, and left in place (renaming it away made the earlier version start
    over at every meeting); the database's own decisions win, and nothing either wrote is lost."""
    monkeypatch.delenv(cache.ENV_CACHE, raising=False)
    caplog.set_level(logging.INFO, logger="attention_dispatch")
    legacy = tmp_path / "tune.json"
    _write_legacy(legacy, {"format": 4, "machines": {_key(): {"machine": machine_fingerprint(), "decisions": {
        _sig_key(): _good(), "broken": {"candidates": 3}}}}})
    original = legacy.read_text()
    previous = cache.set_default_dir(tmp_path)
    try:
        path = cache.default_cache_path()
        assert path == tmp_path / "tune.sqlite3"
        t = Tuner(backends=backends)
        record = t.tune(SIG)
        assert record.source in ("disk", "judged") and t.timing_calls == 0  # the old timings were read
        for _ in range(3):
            assert cache.lookup(path, _sig_key()) is not None
        assert legacy.read_text() == original and not list(tmp_path.glob("tune.json.*"))
        moved = [r.getMessage() for r in caplog.records if "moved into" in r.getMessage()]
        assert len(moved) == 1 and "1 decisions, 1 left out" in moved[0], moved
        cache.update(path, "newer-only", lambda saved: _good(2.0))
        cache.update(path, _sig_key(), lambda saved: _good(3.0))
        # the earlier version writes its file again: one decision of its own, and its view of the shared one
        _write_legacy(legacy, {"format": 4, "machines": {_key(): {"machine": machine_fingerprint(), "decisions": {
            _sig_key(): _good(9.0), "older-only": _good(4.0)}}}})
        os.utime(legacy, ns=(time.time_ns(), time.time_ns() + 10**9))
        assert cache.lookup(path, "older-only")["timings"][NAMES[0]]["median_ms"] == 4.0
        assert cache.lookup(path, "newer-only") is not None
        assert cache.lookup(path, _sig_key())["timings"][NAMES[0]]["median_ms"] == 3.0  # its own wins
    finally:
        cache.set_default_dir(previous)
    assert set(cache.dump(path)["machines"][_key()]["decisions"]) == {_sig_key(), "newer-only", "older-only"}


MIGRATOR = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from dispatcher.auto import cache
    folder, go = Path(sys.argv[1]), Path(sys.argv[2])
    Path(sys.argv[3]).touch()
    while not go.exists():
        time.sleep(0.001)
    cache.set_default_dir(folder)
    print(cache.lookup(cache.default_cache_path(), "sig-7") is not None)
""")


def test_two_processes_migrating_at_once_both_read_it(tmp_path, monkeypatch):
    monkeypatch.delenv(cache.ENV_CACHE, raising=False)
    legacy = tmp_path / "tune.json"
    _write_legacy(legacy, {"format": 4, "machines": {_key(): {"machine": machine_fingerprint(), "decisions": {
        f"sig-{i}": _good() for i in range(50)}}}})
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", MIGRATOR, str(tmp_path), str(go), str(tmp_path / f"r{i}")],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    for i in range(2):
        for _ in range(3000):
            if (tmp_path / f"r{i}").exists():
                break
            time.sleep(0.01)
    go.touch()
    outs = [p.communicate(timeout=120) for p in procs]
    assert [o[0].strip() for o in outs] == ["True", "True"], outs
    assert not list(tmp_path.glob("*.bad*")), sorted(tmp_path.iterdir())
    assert len(cache.dump(tmp_path / "tune.sqlite3")["machines"][_key()]["decisions"]) == 50


# --- bounded, and fast at its bound --------------------------------------------------------------------------------

def test_each_machine_keeps_its_most_recently_used_decisions(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "MAX_DECISIONS", 5)
    monkeypatch.setattr(cache, "_TOUCH_EVERY_S", 0.0)
    path = tmp_path / "tune.sqlite3"
    for i in range(5):
        cache.update(path, f"sig-{i}", lambda saved: _good())
        time.sleep(0.002)
    assert cache.lookup(path, "sig-0") is not None  # used again: now the most recent
    time.sleep(0.002)
    for i in range(5, 8):
        cache.update(path, f"sig-{i}", lambda saved: _good())
        time.sleep(0.002)
    kept = set(cache.dump(path)["machines"][_key()]["decisions"])
    assert kept == {"sig-0", "sig-4", "sig-5", "sig-6", "sig-7"}


def test_only_the_most_recently_used_machines_are_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "MACHINES_KEPT", 3)
    path = tmp_path / "tune.sqlite3"
    for i in range(5):
        with dispatcher.use_machine(dispatcher.current_machine().with_packages(fake=f"{i}.0")):
            cache.update(path, "sig", lambda saved: _good())
        time.sleep(0.002)
    machines = cache.dump(path)["machines"]
    assert sorted(m["machine"]["packages"]["fake"] for m in machines.values()) == ["2.0", "3.0", "4.0"]


def test_lookups_and_inserts_stay_fast_at_the_size_bound(tmp_path):
    """A cache holding MAX_DECISIONS decisions of a realistic size (~13 MB): a lookup and an insert each take
    milliseconds (the JSON file took seconds at this size: parsed whole per lookup, rewritten whole per decision)."""
    path = tmp_path / "tune.sqlite3"
    big = _good()
    big["verdicts"] = {f"model-{m}": {str(b): {n: {"status": "valid", "rel_error": 0.001, "reason": ""}
                                               for n in NAMES} for b in range(20)} for m in range(4)}
    cache.update(path, "sig-0", lambda saved: big)
    with sqlite3.connect(path) as con:  # filled directly: 4096 inserts through update would take a while
        con.executemany("INSERT INTO decisions VALUES (?, ?, ?, ?)",
                        [(_key(), f"sig-{i}", json.dumps(big), time.time()) for i in range(1, cache.MAX_DECISIONS)])
    assert path.stat().st_size > 10e6

    def worst(fn, n=20):
        times = []
        for i in range(n):
            start = time.perf_counter()
            fn(i)
            times.append(time.perf_counter() - start)
        return sorted(times)[n // 2]

    lookup = worst(lambda i: cache.lookup(path, f"sig-{i * 97}"))
    insert = worst(lambda i: cache.update(path, f"new-{i}", lambda saved: big))
    assert lookup < 0.05 and insert < 0.1, (lookup, insert)
    assert len(cache.dump(path)["machines"][_key()]["decisions"]) == cache.MAX_DECISIONS


def test_a_cache_path_that_is_a_folder_is_said_once(tmp_path, backends, caplog):
    folder = tmp_path / "tune.sqlite3"
    folder.mkdir()
    for _ in range(5):
        Tuner(cache_path=folder, backends=backends).tune(SIG, force=True)
    warnings = _cache_warnings(caplog)
    assert len(warnings) == 1 and "is a folder" in warnings[0], warnings


def test_the_cache_folder_is_made_on_the_first_write_not_on_a_read(tmp_path):
    path = tmp_path / "user" / "attention_dispatch" / "tune.sqlite3"
    assert cache.lookup(path, "sig") is None and not path.parent.exists()
    cache.update(path, "sig", lambda saved: _good())
    assert cache.lookup(path, "sig") == _good()


def test_a_rejected_verdict_with_an_infinite_error_is_saved_and_a_merge_that_raises_releases_the_lock(tmp_path):
    path = tmp_path / "tune.sqlite3"
    decision = _good()
    decision["verdicts"] = {"m": {"": {"tc_fast": {"status": "rejected", "rel_error": float("inf"),
                                                   "reason": "output has NaN/Inf values"}}}}
    cache.update(path, "sig", lambda saved: decision)
    assert cache.lookup(path, "sig")["verdicts"]["m"][""]["tc_fast"]["rel_error"] == float("inf")

    def broken(saved):
        raise RuntimeError("merge failed")
    with pytest.raises(RuntimeError):
        cache.update(path, "other", broken)
    with sqlite3.connect(path, timeout=0.5) as con:  # another writer gets the lock at once
        con.execute("BEGIN IMMEDIATE")
        con.execute("ROLLBACK")

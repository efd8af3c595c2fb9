"""`auto`'s disk cache: where it lives (the host's folder, the environment, ~/.cache) and two processes writing it
at once without losing each other's decisions (the file lock)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from dispatcher.auto import cache
from dispatcher.auto.fingerprint import fingerprint_key, machine_fingerprint

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
    data = json.loads(path.read_text())
    decisions = data["machines"][fingerprint_key(machine_fingerprint())]["decisions"]
    assert sorted(decisions) == sorted(f"{who}-{i}" for who in ("a", "b") for i in range(count))
    assert not list(tmp_path.glob(".tune-*"))  # no temporary file left behind


def test_the_host_names_the_folder_unless_the_environment_does(tmp_path, monkeypatch):
    monkeypatch.delenv(cache.ENV_CACHE, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.default_cache_path() == tmp_path / "xdg" / "attention_dispatch" / "tune.json"
    previous = cache.set_default_dir(tmp_path / "comfy-user" / "attention_dispatch")
    try:
        assert cache.default_cache_path() == tmp_path / "comfy-user" / "attention_dispatch" / "tune.json"
        monkeypatch.setenv(cache.ENV_CACHE, str(tmp_path / "mine.json"))
        assert cache.default_cache_path() == tmp_path / "mine.json"
        monkeypatch.setenv(cache.ENV_CACHE, "off")
        assert cache.default_cache_path() is None
    finally:
        cache.set_default_dir(previous)


def test_a_lock_held_elsewhere_skips_the_write_with_a_warning(tmp_path, monkeypatch, caplog):
    from filelock import FileLock
    path = tmp_path / "tune.json"
    monkeypatch.setattr(cache, "LOCK_TIMEOUT_S", 0.2)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from filelock import FileLock
        with FileLock({str(path) + '.lock'!r}):
            open({str(tmp_path / 'held')!r}, 'w').close()
            time.sleep(30)
    """)])
    try:
        for _ in range(3000):
            if (tmp_path / "held").exists():
                break
            time.sleep(0.01)
        cache.update(path, "sig", lambda saved: {"candidates": ["native"]})
    finally:
        holder.kill()
        holder.wait()
    assert not path.exists()
    assert any("held the tuning cache's lock" in r.getMessage() for r in caplog.records)
    with FileLock(str(path) + ".lock", timeout=5):  # released when its holder died
        pass

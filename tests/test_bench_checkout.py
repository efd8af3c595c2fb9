"""What a bench's JSON says about the code it measured: the commit (bench/checkout.py), never the folder the code sat
in on the machine that ran it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import checkout  # noqa: E402  (bench/: the bench scripts' own modules live outside the package)


def git(folder: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(folder), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    """A checkout with one commit."""
    folder = tmp_path / "pack"
    folder.mkdir()
    git(folder, "init", "-q")
    (folder / "a.py").write_text("x = 1\n")
    git(folder, "add", "a.py")
    git(folder, "-c", "user.name=bench", "-c", "user.email=bench@example.invalid", "commit", "-qm", "one")
    return folder


def test_a_checkout_is_named_by_its_commit_and_says_when_its_files_differ(repo):
    head = git(repo, "rev-parse", "HEAD")
    assert checkout.revision(repo) == head
    (repo / "a.py").write_text("x = 2\n")
    assert checkout.revision(repo) == head + checkout.CHANGED
    (repo / "a.py").write_text("x = 1\n")
    (repo / "notes.txt").write_text("")  # an untracked file is not code the bench imports
    assert checkout.revision(repo) == head


def test_an_exported_pack_by_its_revision_file_and_any_other_folder_as_unknown(repo, tmp_path):
    inside = repo / "copy"  # inside another checkout: that checkout's HEAD is not this folder's code
    inside.mkdir()
    assert checkout.revision(inside) == "unknown"
    plain = tmp_path / "plain"
    plain.mkdir()
    assert checkout.revision(plain) == "unknown"
    (inside / "REVISION").write_text("0123abcd\n")  # what bench/gpu_carry.py writes beside a pack it exports
    assert checkout.revision(inside) == "0123abcd"


def _run(script: str, *args: str, out: Path) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k != "COMFYUI_PATH"}  # ComfyUI's own column needs a ComfyUI
    done = subprocess.run([sys.executable, script, *args, "--json", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    return json.loads(text), text


def test_hot_path_records_the_commits_it_compared_not_their_folders(tmp_path):
    result, text = _run("bench/hot_path.py", "--rounds", "2", "--calls", "2", "--before", str(ROOT),
                        out=tmp_path / "hot_path.json")
    assert result["pack"] == result["before"] == checkout.revision(ROOT)
    assert str(ROOT) not in text


def test_small_call_records_the_commits_it_compared_not_their_folders(tmp_path):
    result, text = _run("bench/small_call.py", "--device", "cpu", "--shape", "1,2,8,16", "--rounds", "2", "--calls",
                        "3", "--before", str(ROOT), out=tmp_path / "small_call.json")
    assert result["pack"] == result["before"] == checkout.revision(ROOT)
    assert str(ROOT) not in text

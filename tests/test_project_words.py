"""The project speaks of what was measured, where and when (dates, cards, versions), never of how its work was
organised, and cites no folder of the machines it was written or measured on.

Over the tracked files (`git ls-files`): their text, their names, and the absolute paths in their text. This file
is left out: it names what it looks for."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().relative_to(ROOT).as_posix()

# The words of issue 49's check, and the same framing in other words (an ordinal session, a lent card, a loan).
FRAMING = re.compile(r"session[0-9]+|(fourth|tenth|twelfth|[0-9]+th) session|\blease\b|device\s+time"
                     r"|\b(first|second|third|fifth|sixth|seventh|eighth|ninth|eleventh|[0-9]+(st|nd|rd)) sessions?\b"
                     r"|\bleases\b|\bloans?\b|\blent (H100|H200|GPU|machine)", re.IGNORECASE)

# An absolute path into a machine's own folders (not after a word character, '.', '~', '<' or '-').
MACHINE_PATH = re.compile(r"(?<![\w.~<>-])/(?:work|tmp|root|home|opt)/[^\s\"'`),;\]]*")

# Paths that are no machine's folder: defaults and examples the code and docs give, and test inputs.
ALLOWED_PATHS = {
    "bench/gpu_run.py": ("/tmp/gpu-run",),  # the runner's own folder on a GPU machine (--work's default)
    "docs/performance.md": ("/tmp/gpu-run",),  # that default, documented
    "bench/tune_cache_size.py": ("/tmp/x",),  # a usage example
    "tests/integration/bench_auto_cpu.py": ("/tmp/bench_auto_cpu.json",),  # its output's default
    "nodes/reports.py": ("/home/u/",),  # an example of the paths a report hides
    "tests/test_comfy038.py": ("/home/user/ComfyUI/custom_nodes/OtherPack",),  # another pack's module, as input
    "tests/test_node_validation.py": ("/home/me/kernels",),  # a path where a kernel name belongs, as input
    "tests/test_sage_build.py": ("/opt/cuda/bin/nvcc",),  # a stand-in nvcc
    # the GPU machine's paths that results_table.scrub replaces, and its test's input
    "bench/results_table.py": ("/tmp/gpu-run", "/opt/torch/", "/tmp/pytest-of-", "/tmp/("),
    "tests/test_gpu_run.py": ("/opt/torch/.venv/bin/python3", "/home/user/pack/", "/tmp/gpu-run/", "/tmp/sage-build.log",
                              "/tmp/pytest-of-root/"),
}


def tracked() -> list[str]:
    try:
        done = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"git cannot list the tracked files here: {exc}")
    if done.returncode != 0:
        pytest.skip(f"not a git checkout: {done.stderr.decode(errors='replace').strip()[:200]}")
    return [name for name in done.stdout.decode().split("\0") if name and name != HERE]


def texts() -> list[tuple[str, str]]:
    """(path, text) of every tracked text file (not binary, present in this checkout)."""
    found = []
    for name in tracked():
        path = ROOT / name
        if not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue
        found.append((name, data.decode("utf-8", errors="replace")))
    return found


def hits(pattern: re.Pattern, allowed=lambda name, match: False) -> list[str]:
    return [f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}" for name, text in texts()
            for m in pattern.finditer(text) if not allowed(name, m.group(0))]


def test_no_file_speaks_of_sessions_leases_or_device_time():
    """Say 'measured on the H200 on 2026-12-05 (torch 2.11.0)', not how the work was organised."""
    found = hits(FRAMING)
    assert not found, "\n".join(found)


def test_no_file_is_named_after_a_session():
    """Results are named DATE-MACHINE-WHAT.json (bench/results/README.md)."""
    found = [name for name in tracked() if "session" in name.lower()]
    assert not found, "\n".join(found)


def test_no_file_cites_a_folder_of_a_machine():
    """A path on the machine that measured or wrote something says nothing to a reader: a repository-relative path,
    a placeholder (`<ComfyUI>`, `<checkout>`) or a commit does."""
    def allowed(name, path):
        return any(path.startswith(ok) for ok in ALLOWED_PATHS.get(name, ()))
    found = hits(MACHINE_PATH, allowed)
    assert not found, "\n".join(found)


# The words are split in the source, so that this file passes issue 49's own `git grep` too.
@pytest.mark.parametrize("text, found", [
    ("the twelfth sess" "ion: an H100", True), ("bench/results/2026-12-05-h100-versions-sess" "ion12.txt", True),
    ("the next le" "ase", True), ("no device  time left", True), ("measured on the lent H200", True),
    ("the third session's runs", True),
    ("per session (a pytest fixture)", False), ("aiohttp.ClientSession()", False), ("start_new_session=True", False),
    ("measured on the H200 on 2026-12-05 (torch 2.11.0)", False), ("a released build", False),
])
def test_the_framing_check_finds_what_it_should(text, found):
    assert bool(FRAMING.search(text)) is found


@pytest.mark.parametrize("text, found", [
    ('"pack": "/work/main"', True), ("wrote /root/out/bench.json", True), ("from /tmp/sagesrc", True),
    ("/opt/torch/.venv/lib/python3.12", True), ("cache at /home/someone/.cache", True),
    ("~/.cache/attention_dispatch/tune.sqlite3", False), ("<tmp>/tune.json", False), ("bench/results/x.json", False),
    ("../shared/docs/gpu.md", False), ("a/tmp/b", False),
])
def test_the_path_check_finds_what_it_should(text, found):
    assert bool(MACHINE_PATH.search(text)) is found

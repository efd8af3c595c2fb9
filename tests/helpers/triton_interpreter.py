"""A script run by Triton's CPU interpreter (TRITON_INTERPRET=1), in a process of its own: the switch is read when
a kernel is defined, so it cannot be turned on inside the test process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(script: str, cannot_run: str) -> str:
    """`script`'s stdout (it gets the pack's root as argv[1]); skipped without Triton, or before Triton 3.7, whose
    interpreter `cannot_run` what the script's kernels do (the skip's reason, after "Triton X's interpreter cannot
    run "). A script that fails fails the test with its stderr."""
    triton = pytest.importorskip("triton")
    if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 7):
        pytest.skip(f"Triton {triton.__version__}'s interpreter cannot run {cannot_run}")
    done = subprocess.run([sys.executable, "-c", script, str(ROOT)], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout

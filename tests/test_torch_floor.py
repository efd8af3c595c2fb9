"""The oldest torch the pack claims: one floor in pyproject.toml, the README and the import check (CI tests it)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from dispatcher.versions import TORCH_FLOOR, release

ROOT = Path(__file__).resolve().parent.parent


def test_pyproject_and_readme_claim_the_floor_the_import_checks():
    assert re.search(r'"torch>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text()).group(1) == TORCH_FLOOR
    assert f"torch>={TORCH_FLOOR}" in (ROOT / "README.md").read_text()


def test_an_older_torch_is_refused_at_import_naming_the_floor():
    older = f"{TORCH_FLOOR.split('.')[0]}.{int(TORCH_FLOOR.split('.')[1]) - 1}.1"
    script = f"import torch; torch.__version__ = {older!r}\nimport dispatcher"
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert (f"ImportError: attention dispatch needs torch>={TORCH_FLOOR}; this Python has torch {older}"
            in run.stderr), run.stderr[-2000:]


def _ci_oldest_torch() -> str:
    """The torch `.ci/run`'s floor phase installs, evaluated by bash from .ci/run's own lines (no install)."""
    lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
             if line.startswith(("TORCH_FLOOR=", "TORCH_CI_OLDEST="))]
    script = "\n".join(["set -euo pipefail", *lines, 'echo "$TORCH_CI_OLDEST"'])
    run = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_ci_tests_the_floor_the_pack_claims():
    """The oldest torch CI runs is the claimed floor's first release, read from the claim itself (issue 37: CI
    tested 2.13.0 while the pack claimed 2.6, so 2.6-2.12 were claimed untested)."""
    oldest = _ci_oldest_torch()
    floor = tuple(int(part) for part in TORCH_FLOOR.split("."))
    assert release(oldest) == floor + (0,) * (3 - len(floor)), (oldest, TORCH_FLOOR)

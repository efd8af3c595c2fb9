"""The wheel: only the framework-agnostic core, under `attention_dispatch`; the README's library example runs
from another folder after installing it; the ComfyUI pack's archive leaves tests and bench data out."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from dispatcher.versions import TORCH_FLOOR

ROOT = Path(__file__).resolve().parent.parent
SUBPACKAGES = {"backends", "parallel", "tools", "auto"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools is not installed in this environment")
    out = tmp_path_factory.mktemp("wheel")
    source = tmp_path_factory.mktemp("source")  # setuptools writes build/ and *.egg-info next to pyproject.toml
    import shutil
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "dispatcher", source / "dispatcher", ignore=shutil.ignore_patterns("__pycache__"))
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                          str(out), str(source)], capture_output=True, text=True, timeout=600, cwd=out)
    assert run.returncode == 0, run.stderr[-3000:]
    (found,) = out.glob("attention_dispatch-*.whl")
    return found


def test_the_wheel_holds_only_attention_dispatch(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/", 1)[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"attention_dispatch"}
    for forbidden in ("dispatcher", "nodes", "web", "bench", "tests", "example_workflows"):
        assert forbidden not in top
    packages = {n.split("/")[1] for n in names if n.count("/") >= 2 and n.startswith("attention_dispatch/")}
    assert SUBPACKAGES <= packages
    # every module of the core folder is in the wheel (a new subpackage needs its line in pyproject.toml)
    source = {str(p.relative_to(ROOT / "dispatcher")) for p in (ROOT / "dispatcher").rglob("*.py")}
    shipped = {n[len("attention_dispatch/"):] for n in names if n.startswith("attention_dispatch/") and n.endswith(".py")}
    assert source == shipped
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert f"Requires-Dist: torch>={TORCH_FLOOR}" in metadata  # the floor the import checks


def test_the_core_uses_relative_imports_only():
    import ast
    for path in (ROOT / "dispatcher").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                assert not (node.module or "").startswith("dispatcher"), (path, node.lineno)
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("dispatcher") for a in node.names), (path, node.lineno)


def test_the_readme_library_example_runs_from_another_folder(wheel, tmp_path):
    target = tmp_path / "site"
    run = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                          str(target), str(wheel)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    readme = (ROOT / "README.md").read_text()
    (example,) = [block for block in re.findall(r"```python\n(.*?)```", readme, re.S) if "attention_dispatch" in block]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "example.py").write_text(example)
    import os
    env = dict(os.environ, PYTHONPATH=str(target), CUDA_VISIBLE_DEVICES="")
    run = subprocess.run([sys.executable, "-W", "error::UserWarning:torch", "example.py"], cwd=elsewhere,
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "native" in run.stdout
    assert "Warning" not in run.stderr, run.stderr  # no third-party warning on the first call
    cli = subprocess.run([sys.executable, "-m", "attention_dispatch", "doctor", "--json"], cwd=elsewhere,
                         capture_output=True, text=True, timeout=300, env=env)
    assert cli.returncode == 0 and '"default_backend"' in cli.stdout, cli.stderr[-2000:]
    # installed, the command line names itself as it was started: never the pack's `python -m dispatcher`
    usage = subprocess.run([sys.executable, "-m", "attention_dispatch", "--help"], cwd=elsewhere,
                           capture_output=True, text=True, timeout=300, env=env)
    assert usage.returncode == 0 and usage.stdout.startswith("usage: python -m attention_dispatch"), usage.stderr
    assert "python -m dispatcher" not in usage.stdout
    script = target / "bin" / "attention-dispatch"  # the console script pip writes
    usage = subprocess.run([sys.executable, str(script), "bench", "--help"], cwd=elsewhere, capture_output=True,
                           text=True, timeout=300, env=env)
    assert usage.returncode == 0 and usage.stdout.startswith("usage: attention-dispatch bench"), usage.stderr
    assert "python -m dispatcher" not in usage.stdout


def test_the_pack_archive_leaves_out_tests_and_bench_data():
    pytest.importorskip("pathspec")
    from pathspec import PathSpec
    lines = [l.strip() for l in (ROOT / ".comfyignore").read_text().splitlines() if l.strip() and not l.startswith("#")]
    spec = PathSpec.from_lines("gitwildmatch", lines)
    for dropped in ("tests/test_install.py", "bench/results/2026-12-02-h200-bench-run5.json", ".ci/run"):
        assert spec.match_file(dropped)
    for kept in ("__init__.py", "nodes/model_nodes.py", "web/attention_dispatch.js", "dispatcher/dispatch.py",
                 "install.py", "requirements.txt", "example_workflows/Set Attention Backend.json",
                 "example_workflows/Set Attention Backend.jpg", "locales/en/main.json", "README.md",
                 "docs/2026-12-06-web-extension.png", "pyproject.toml", "LICENSE"):
        assert not spec.match_file(kept), kept


def test_every_install_command_is_the_same_everywhere():
    """README, docs, the doctor and install.py name one command per kernel."""
    texts = {p: p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]}
    joined = "\n".join(texts.values())
    assert "pip install 'sageattention>=2" not in joined and "sageattention>=2.1.1'" not in joined
    assert "python install.py --build sageattention" in texts[ROOT / "README.md"]
    assert "pip install 'flash-attn>=2.6.3' --no-build-isolation" in texts[ROOT / "README.md"]
    # FlashAttention-2 (not flash-attn-4, a wheel of another name) builds only without build isolation
    assert re.search(r"pip install 'flash-attn(?![-\w])[^']*'(?! --no-build-isolation)", joined) is None
    from dispatcher.tools import sage_build
    assert sage_build.COMMAND == "python install.py --build sageattention"


def test_the_readme_sizes_are_current():
    """The README's sizes (clone, files, bench/results, .git, the Registry's archive) within .ci/sizes' SLACK of what
    a single-branch clone of this checkout measures (issue #48: they had gone stale); `python3 .ci/sizes --readme
    README.md` writes them anew."""
    pytest.importorskip("pathspec")
    import importlib.machinery
    import importlib.util
    loader = importlib.machinery.SourceFileLoader("ci_sizes", str(ROOT / ".ci" / "sizes"))
    spec = importlib.util.spec_from_loader("ci_sizes", loader)
    sizes = importlib.util.module_from_spec(spec)
    loader.exec_module(sizes)
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: no clone to measure")
    measured = sizes.measure()
    readme = (ROOT / "README.md").read_text()
    assert not sizes.stale(readme, measured), (sizes.stale(readme, measured), measured)
    said = sizes.stated(readme)
    assert said["files"] > said["results"] and (measured["clone"] is None or said["clone"] > said["files"])

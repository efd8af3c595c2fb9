"""The doctor talks: which Python it inspects (ComfyUI's when the pack sits in custom_nodes/), a recommendation
first, usable backends before the rest, each reason once; progress during set-up, the default backend and where it
comes from, a bad DIFFUSERS_ATTN_BACKEND, a readable machine line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dispatcher.tools import doctor

ROOT = Path(__file__).resolve().parent.parent


def test_machine_lines_read_as_sentences():
    cpu = {"device": "cpu", "name": "cpu", "arch": "cpu", "torch": "2.13.0+cpu", "cuda": None, "hip": None,
           "cpu": "AMD EPYC 9654"}
    text = doctor.machine_text(cpu)
    assert text.startswith("CPU only: no GPU visible to torch (AMD EPYC 9654") and "cpu (cpu, cpu)" not in text
    gpu = {"device": "cuda", "name": "NVIDIA H200", "arch": "sm_90", "torch": "2.11.0+cu130", "cuda": "13.0",
           "hip": None}
    assert doctor.machine_text(gpu) == "NVIDIA H200 (NVIDIA CUDA GPU, sm_90), torch 2.11.0+cu130, CUDA 13.0"


def test_default_backend_and_its_source(monkeypatch):
    monkeypatch.delenv("DIFFUSERS_ATTN_BACKEND", raising=False)
    info = doctor.default_backend_info()
    assert info["backend"] == "native" and "is not set" in info["source"] and info["problem"] is None
    monkeypatch.setenv("DIFFUSERS_ATTN_BACKEND", "auto")
    assert doctor.default_backend_info()["source"] == "DIFFUSERS_ATTN_BACKEND=auto"
    monkeypatch.setenv("DIFFUSERS_ATTN_BACKEND", "sage")
    info = doctor.default_backend_info([{"name": "sage", "available": False, "reasons": ["not installed"]}])
    assert info["backend"] == "sage" and info["available"] is False and info["reasons"] == ["not installed"]
    monkeypatch.setenv("DIFFUSERS_ATTN_BACKEND", "flsh")
    info = doctor.default_backend_info()
    assert info["backend"] == "native" and "did you mean 'flash'?" in info["problem"]
    assert "ignores it and uses 'native'" in info["problem"]
    monkeypatch.setenv("DIFFUSERS_ATTN_BACKEND", " ")
    assert "set but empty" in doctor.default_backend_info()["source"]


def test_the_doctor_command_shows_them(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", DIFFUSERS_ATTN_BACKEND="flsh",
               ATTN_DISPATCH_KERNEL_LOCK=str(tmp_path / "lock.json"))
    run = subprocess.run([sys.executable, "-m", "dispatcher", "doctor"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert lines[0].startswith(f"Python: {sys.executable} (") and "the Python that ran this command" in lines[0]
    assert lines[1].startswith("Machine: CPU only: no GPU visible to torch")
    assert any(l.startswith("As a library, without backend=: PROBLEM: DIFFUSERS_ATTN_BACKEND='flsh'") for l in lines)
    assert "Failed to initialize NumPy" not in run.stderr
    # the recommendation leads, usable backends come next (autos first), each reason is stated once
    text = run.stdout
    assert text.index("Recommended here: auto_exact") < text.index("Run here (") < text.index("Not for this machine")
    run_here = text[text.index("Run here ("):text.index("Not for this machine")].split("\n")
    rows = [l.split()[0] for l in run_here[1:] if l.startswith("  ") and not l.startswith("    ")]
    assert rows[:4] == ["auto_exact", "auto_fast", "comfy", "native"]
    assert text.count("needs an NVIDIA CUDA GPU; this machine has a CPU") == 1
    assert "auto_fast gains nothing here" in text and "nothing to install" in text


def test_the_doctor_script_says_what_it_is_doing():
    script = (ROOT / "doctor").read_text()
    assert "numpy" in script and "torch==2.13.0" in script
    for words in ("creating .venv", "installing torch", "inspecting this machine", 'inspecting $python'):
        assert words in script
    assert "set -euo pipefail" in script
    # the sizes it states are the installed ones: the CPU build without a GPU, the CUDA build with one
    assert "CPU build: about 200 MB to download, 1 GB installed" in script and "about 5.5 GB installed" in script
    assert "download.pytorch.org/whl/cpu" in script


def test_grouped_reasons_put_the_device_before_any_package():
    from dispatcher.machine import use_machine
    from dispatcher.tools import install_plan
    with use_machine(install_plan.SIMULATED["cpu"]):
        data = doctor.report()
    reasons = [row["reason"] for row in data["groups"]["not_here"]]
    assert len(reasons) == len(set(reasons))  # each once, with its backends
    cuda = next(row for row in data["groups"]["not_here"] if row["reason"].startswith("needs an NVIDIA CUDA GPU"))
    assert {"flash", "sage", "xformers", "flash_hub"} <= set(cuda["backends"]) and "pip install" not in cuda["reason"]
    assert data["groups"]["usable"][0] == "native" and data["recommendation"]["use"] == "auto_exact"


def test_run_here_tells_the_dropdowns_story(monkeypatch):
    """The doctor's "Run here" names what Set Attention Backend's dropdown offers on this machine, in its order; the
    kernel variants that also run here (SDPA's pinned kernels) come on a line of their own that says the dropdown
    leaves them out and how to reach them (#48: the doctor listed them as if the dropdown offered them)."""
    from helpers import node_stub
    nodes = node_stub.install(monkeypatch)
    text = doctor.render(doctor.report(), width=100)
    block = text[text.index("Run here ("):].split("\n\n")[0].splitlines()[1:]
    entries = [line[2:].split("  ")[0] for line in block if line.startswith("  ") and not line.startswith("    ")
               and not line.startswith("  Kernel variants")]
    offered = nodes.backend_options()
    runs = [n for n in offered[3:] if not nodes.availability_reasons(n)]
    assert entries == offered[:3] + runs, (entries, offered)
    variants = " ".join(line.strip() for line in block[[i for i, l in enumerate(block)
                                                         if l.startswith("  Kernel variants")][0]:])
    assert "the dropdown leaves them out" in variants and "_native_math (" in variants, variants
    assert all(n not in entries for n in ("_native_math", "_native_flash"))


def test_a_long_repo_id_is_never_broken_across_lines():
    """Wrapped lines break between words only: "kernels-community/flash-attn4" copies whole (#48)."""
    from dispatcher.tools.install_plan import wrap
    text = "not fetched (7): " + ", ".join(["kernels-community/flash-attn3", "kernels-community/flash-attn4"] * 4)
    for width in range(30, 90):
        lines = wrap(text, width, "  ", "    ")
        assert " ".join(line.strip() for line in lines) == text, (width, lines)
    rendered = doctor.render(doctor.report(), width=100)
    assert "kernels-community/flash-\n" not in rendered and "kernels-community/flash-attn4" in rendered


def test_bench_figures_for_this_gpu_model():
    from dispatcher.tools import install_plan
    figures = doctor.bench_figures(install_plan.SIMULATED["h200"])
    assert figures is not None and figures["file"].startswith("bench/results/")
    wan = next(s for s in figures["shapes"] if s["label"].startswith("Wan 2.1 14B"))
    assert wan["native_ms"] and wan["exact"][1] <= wan["native_ms"] and wan["quantised"] is not None
    assert doctor.bench_figures(install_plan.SIMULATED["cpu"]) is None


# ------------------------------------------------------------------------------------ the doctor inside ComfyUI

def _comfyui_layout(tmp_path) -> Path:
    """ComfyUI/custom_nodes/<pack> with the doctor script and the library (what `./doctor` needs)."""
    pack = tmp_path / "ComfyUI" / "custom_nodes" / "attention_dispatch"
    pack.mkdir(parents=True)
    shutil.copy2(ROOT / "doctor", pack / "doctor")
    shutil.copytree(ROOT / "dispatcher", pack / "dispatcher", ignore=shutil.ignore_patterns("__pycache__"))
    return pack


def _python_link(venv: Path) -> Path:
    """A venv at `venv`: a link to the one running the tests (which has torch); its bin/python."""
    venv.parent.mkdir(parents=True, exist_ok=True)
    venv.symlink_to(Path(sys.prefix), target_is_directory=True)
    return venv / "bin" / "python"


def _run_doctor(pack: Path, **env_extra) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("COMFYUI_PYTHON", "ATTN_DISPATCH_DOCTOR_PYTHON", "VIRTUAL_ENV", "DOCTOR_SETUP")}
    env.update(CUDA_VISIBLE_DEVICES="", **env_extra)
    return subprocess.run(["bash", str(pack / "doctor")], capture_output=True, text=True, timeout=300, env=env,
                          stdin=subprocess.DEVNULL)


@pytest.mark.skipif(sys.platform == "win32", reason="the doctor script is bash")
def test_the_doctor_script_inspects_comfyuis_venv(tmp_path):
    pack = _comfyui_layout(tmp_path)
    python = _python_link(tmp_path / "ComfyUI" / "venv")
    run = _run_doctor(pack)
    assert run.returncode == 0, run.stderr[-3000:]
    first = run.stdout.splitlines()[0]
    assert first.startswith(f"Python: {python} (")
    assert "ComfyUI's Python (venv/bin/python in the ComfyUI folder)" in first
    assert f"inspecting {python}, ComfyUI's Python (venv/bin/python in the ComfyUI folder)" in run.stderr
    assert not (pack / ".venv").exists()  # nothing built, nothing installed


@pytest.mark.skipif(sys.platform == "win32", reason="the doctor script is bash")
def test_the_doctor_script_finds_the_python_running_comfyui(tmp_path):
    """No venv in the ComfyUI folder: the interpreter of a running `python main.py` there, as it was started (a
    venv's python is a link: following /proc/PID/exe would lose the venv)."""
    pack = _comfyui_layout(tmp_path)
    root = tmp_path / "ComfyUI"
    (root / "main.py").write_text("import time\ntime.sleep(120)\n")
    python = _python_link(tmp_path / "envs" / "comfy")
    server = subprocess.Popen([str(python), "main.py", "--cpu"], cwd=root)
    try:
        run = _run_doctor(pack)
    finally:
        server.kill()
        server.wait()
    assert run.returncode == 0, run.stderr[-3000:]
    first = run.stdout.splitlines()[0]
    assert first.startswith(f"Python: {python} (") and f"the Python running this ComfyUI, process {server.pid}" in first
    assert not (pack / ".venv").exists()


@pytest.mark.skipif(sys.platform == "win32", reason="the doctor script is bash")
def test_comfyui_python_from_the_environment_and_a_broken_one(tmp_path):
    pack = _comfyui_layout(tmp_path)
    python = _python_link(tmp_path / "elsewhere")
    run = _run_doctor(pack, COMFYUI_PYTHON=str(python))
    assert run.returncode == 0 and "ComfyUI's Python (COMFYUI_PYTHON)" in run.stdout.splitlines()[0]
    broken = tmp_path / "broken-python"
    broken.write_text("#!/bin/sh\nexit 1\n")
    broken.chmod(0o755)
    run = _run_doctor(pack, COMFYUI_PYTHON=str(broken))
    assert run.returncode == 1 and "is not a Python interpreter" in run.stderr and "nothing was changed" in run.stderr
    assert not (pack / ".venv").exists()


@pytest.mark.skipif(sys.platform == "win32", reason="the doctor script is bash")
@pytest.mark.parametrize("kind", ["true", "missing", "directory", "no torch"])
def test_a_comfyui_python_that_is_not_one_fails_with_what_is_wrong(tmp_path, kind):
    """`COMFYUI_PYTHON=$(which true)` gave rc 0 and no report; a missing file was reported as "cannot import
    torch". Each now fails (rc 1) saying what is wrong, and nothing is built."""
    pack = _comfyui_layout(tmp_path)
    python, expected = {
        "true": (shutil.which("true"), "is not a Python interpreter"),
        "missing": (str(tmp_path / "no-such-python"), "does not exist"),
        "directory": (str(tmp_path), "is not an executable file"),
        "no torch": (shutil.which("python3") if not _has_torch(shutil.which("python3")) else None,
                     "cannot import torch"),
    }[kind]
    if python is None:
        pytest.skip("no Python without torch on this machine")
    run = _run_doctor(pack, COMFYUI_PYTHON=python)
    assert run.returncode == 1, (run.returncode, run.stdout[-500:], run.stderr[-1500:])
    assert expected in run.stderr and "nothing was changed" in run.stderr and not run.stdout, run.stderr
    assert not (pack / ".venv").exists()


def _has_torch(python: str | None) -> bool:
    return python is not None and subprocess.run([python, "-c", "import torch"], capture_output=True).returncode == 0


@pytest.mark.skipif(sys.platform == "win32", reason="the doctor script is bash")
def test_an_active_venv_outside_the_comfyui_folder_is_inspected_and_named(tmp_path):
    """ComfyUI run from an activated venv kept elsewhere: the doctor used to ignore it and build its own .venv."""
    pack = _comfyui_layout(tmp_path)
    venv = tmp_path / "envs" / "comfy"
    python = _python_link(venv)
    run = _run_doctor(pack, VIRTUAL_ENV=str(venv))
    assert run.returncode == 0, run.stderr[-3000:]
    first = run.stdout.splitlines()[0]
    assert first.startswith(f"Python: {python} (") and f"the active virtual environment (VIRTUAL_ENV={venv})" in first
    assert f"inspecting {python}, the active virtual environment" in run.stderr
    assert not (pack / ".venv").exists()


@pytest.mark.skipif(sys.platform == "win32", reason="the doctor script is bash")
def test_no_python_found_builds_nothing_without_being_asked(tmp_path):
    """A clone outside ComfyUI, no COMFYUI_PYTHON, no active venv, not in a terminal: the doctor used to build a
    1 GB .venv silently. It says what it would do and how to ask for it (--setup or DOCTOR_SETUP=1), and exits 2."""
    pack = tmp_path / "clone"
    pack.mkdir()
    shutil.copy2(ROOT / "doctor", pack / "doctor")
    run = _run_doctor(pack)
    assert run.returncode == 2, (run.returncode, run.stderr[-2000:])
    assert "no ComfyUI Python found" in run.stderr and "./doctor --setup" in run.stderr
    assert "DOCTOR_SETUP=1" in run.stderr and "1 GB installed" in run.stderr and "Nothing was changed" in run.stderr
    assert not (pack / ".venv").exists()


def test_one_default_per_place_and_the_lock_file_only_when_it_exists(tmp_path, monkeypatch):
    """The doctor said "native ... (DIFFUSERS_ATTN_BACKEND is not set)" as the default backend and then
    "auto_exact (the default)", and named a kernels.lock.json that did not exist. Each default now says where it
    holds (the library without backend=, Set Attention Backend), and the lock file is named only once it exists."""
    monkeypatch.delenv("DIFFUSERS_ATTN_BACKEND", raising=False)
    lock = tmp_path / "kernels.lock.json"
    monkeypatch.setenv("ATTN_DISPATCH_KERNEL_LOCK", str(lock))
    text = doctor.render(doctor.report())
    assert "As a library, without backend=: native (DIFFUSERS_ATTN_BACKEND is not set)" in text
    assert "auto_exact (Set Attention Backend's default)" in text
    assert "(the default)" not in text and "Default backend" not in text and "from default" not in text
    assert str(lock) not in text
    assert "no lock file yet: `python install.py` writes kernels.lock.json when it fetches one" in text
    lock.write_text("{}")
    assert f"Hub kernels (lock file {lock}):" in doctor.render(doctor.report())

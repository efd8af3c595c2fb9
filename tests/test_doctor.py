"""The doctor talks: progress during set-up, numpy, the default backend and where it comes from, a bad
DIFFUSERS_ATTN_BACKEND, a readable machine line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
    assert lines[0].startswith("Machine: CPU only: no GPU visible to torch")
    assert any(l.startswith("Default backend: PROBLEM: DIFFUSERS_ATTN_BACKEND='flsh'") for l in lines)
    assert "Failed to initialize NumPy" not in run.stderr


def test_the_doctor_script_says_what_it_is_doing():
    script = (ROOT / "doctor").read_text()
    assert "numpy" in script and "torch==2.13.0" in script
    for words in ("creating .venv", "installing torch", "inspecting this machine"):
        assert words in script
    assert "set -euo pipefail" in script

"""`python install.py --build sageattention`: the machine checks, the plan step, clean refusals, and the rollback.

The real build runs on a CUDA machine only (proved on the H200 and the H100: bench/results/README.md); here the
compiler, pip and the GPU verification are replaced by fakes at the module's seams.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from dispatcher.tools import install_plan as ip
from dispatcher.tools import sage_build as sb

ROOT = Path(__file__).resolve().parent.parent
OK_TOOLS = dict(nvcc=("/usr/local/cuda/bin/nvcc", "12.8"), which=lambda name: f"/usr/bin/{name}",
                has_module=lambda name: True)


@pytest.mark.parametrize("name", ["cpu", "t4", "mac", "mi300x", "arc"])
def test_it_does_not_apply_where_sageattention_2_has_no_kernels(name):
    assert sb.applies(ip.simulated(name))
    problems, _ = sb.preflight(ip.simulated(name), **OK_TOOLS)
    assert problems


@pytest.mark.parametrize("name, arch", [("rtx3090", "8.6"), ("a100", "8.0"), ("h100", "9.0"), ("h200", "9.0")])
def test_a_supported_gpu_with_a_matching_toolkit_passes(name, arch):
    assert sb.applies(ip.simulated(name)) is None
    problems, facts = sb.preflight(ip.simulated(name), **OK_TOOLS)
    assert problems == [] and facts["arch"] == arch  # TORCH_CUDA_ARCH_LIST: this architecture only


def test_each_missing_tool_is_named_with_its_fix():
    h200 = ip.simulated("h200")  # torch 2.10.0+cu128
    problems, _ = sb.preflight(h200, nvcc=("/opt/cuda/bin/nvcc", "13.0"), which=OK_TOOLS["which"],
                               has_module=OK_TOOLS["has_module"])
    assert len(problems) == 1 and "nvcc 13.0" in problems[0] and "CUDA 12.8" in problems[0]
    problems, _ = sb.preflight(h200, nvcc=(None, None), which=lambda name: None, has_module=lambda name: False)
    text = " ".join(problems)
    assert "no CUDA toolkit found (nvcc)" in text and "install CUDA 12.x" in text
    assert "no C++ compiler" in text and "setuptools is not installed" in text
    old = replace(h200, cuda_version="12.2")
    problems, _ = sb.preflight(old, nvcc=("/x/nvcc", "12.2"), which=OK_TOOLS["which"], has_module=OK_TOOLS["has_module"])
    assert problems == ["nvcc 12.2 is too old for sm_90: SageAttention 2 needs CUDA 12.3 or newer there"]


def test_the_plan_shows_the_build_step_only_where_it_applies():
    for name in ("h200", "rtx3090", "a100"):
        plan = ip.build(ip.simulated(name), lock={})
        assert [s.command for s in plan.build_commands()] == [sb.COMMAND], name
        assert [s.kind for s in plan.get("sage_varlen").steps] == ["build"]
        text = ip.render(plan)
        assert "Build from source" in text and sb.COMMAND in text
        assert sb.COMMAND not in [s.command for s in plan.pip_commands()]  # never run by --yes-pip
    for name in ("cpu", "t4", "mac", "mi300x"):
        plan = ip.build(ip.simulated(name), lock={})
        assert plan.build_commands() == [] and "Build from source" not in ip.render(plan), name
    assert ip.build(ip.simulated("rtx4090"), lock={}).build_commands() == []  # 2.2.0 is installed there


def test_install_py_refuses_cleanly_on_this_cpu_machine_and_changes_nothing(tmp_path):
    lock = tmp_path / "lock.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", ATTN_DISPATCH_KERNEL_LOCK=str(lock))
    run = subprocess.run([sys.executable, "install.py", "--build", "sageattention", "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 1
    result = json.loads(run.stdout)["build"]
    assert result["status"] == "refused" and "Nothing was changed" in result["message"]
    assert "cannot build SageAttention 2 here" in run.stderr
    assert not lock.exists()
    plain = subprocess.run([sys.executable, "install.py", "--plan"], cwd=ROOT, capture_output=True, text=True,
                           timeout=300, env=env)
    assert plain.returncode == 0 and "--build" not in plain.stdout  # never offered on a CPU
    bad = subprocess.run([sys.executable, "install.py", "--source", "/x"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env=env)
    assert bad.returncode == 2 and "--source goes with --build" in bad.stderr


@pytest.fixture
def fake_build(monkeypatch, tmp_path):
    """A machine that passes the checks, a compiler that writes a wheel, pip and the GPU call recorded."""
    source = tmp_path / "SageAttention"
    (source / "csrc").mkdir(parents=True)
    (source / "sageattention").mkdir()
    (source / "setup.py").write_text("setup(name='sageattention', version='2.2.0')\n")
    monkeypatch.setattr(sb, "preflight", lambda machine: ([], {"arch": "9.0", "nvcc": "/x/bin/nvcc",
                                                                "nvcc_version": "12.8", "ninja": "/usr/bin/ninja"}))
    monkeypatch.setenv("ATTN_DISPATCH_KERNEL_LOCK", str(tmp_path / "lock.json"))
    monkeypatch.setenv("ATTN_DISPATCH_WHEEL_CACHE", str(tmp_path / "wheels"))
    calls = {"pip": [], "verify": [], "env": None}

    def streamed(command, *, cwd, env, log_path, say, **_):
        calls["env"] = env
        wheels = Path(command[command.index("-w") + 1])
        wheels.mkdir(parents=True)
        (wheels / "sageattention-2.2.0-cp312-cp312-linux_x86_64.whl").write_bytes(b"wheel")
        Path(log_path).write_text("[1/2] nvcc a.cu\n[2/2] nvcc b.cu\n")
        return 0
    monkeypatch.setattr(sb, "_run_streamed", streamed)
    monkeypatch.setattr(sb, "_pip", lambda args: calls["pip"].append(args) or 0)
    installed = tmp_path / "site" / "sageattention" / "__init__.py"
    installed.parent.mkdir(parents=True)
    installed.write_text("version = '1.0.6'\n")
    monkeypatch.setattr(sb, "_installed", lambda: ("1.0.6", [installed]))
    return source, calls, installed


def test_a_build_that_fails_its_gpu_call_is_never_installed(fake_build, tmp_path):
    source, calls, installed = fake_build
    sb_verify = lambda backends, extra_path=None, **_: (calls["verify"].append(extra_path) or  # noqa: E731
                                                         ([{"backend": "sage", "ok": False}], "sage: noise"))
    sb.verify, saved = sb_verify, sb.verify
    try:
        result = sb.build(str(source), machine=ip.simulated("h200"), out=lambda line: None)
    finally:
        sb.verify = saved
    assert result.status == "failed" and "does not run correctly here: sage: noise" in result.message
    assert "environment is as it was" in result.message
    assert [a[:2] for a in calls["pip"]] == [["install", "-q"]] and "--target" in calls["pip"][0]  # trial folder only
    assert calls["env"]["TORCH_CUDA_ARCH_LIST"] == "9.0"
    assert not (tmp_path / "lock.json").exists() and installed.read_text() == "version = '1.0.6'\n"


def test_a_build_that_fails_after_installing_puts_the_old_one_back(fake_build, tmp_path, monkeypatch):
    source, calls, installed = fake_build
    answers = iter([([{"backend": "sage", "ok": True, "rel_error": 0.01}], None),
                    ([{"backend": "sage", "ok": False}], "sage: ImportError")])
    monkeypatch.setattr(sb, "verify", lambda backends, **_: next(answers))
    real_pip = calls["pip"]

    def pip(args):
        real_pip.append(args)
        if "--force-reinstall" in args:
            installed.write_text("version = '2.2.0'\n")
        return 0
    monkeypatch.setattr(sb, "_pip", pip)
    lines = []
    result = sb.build(str(source), machine=ip.simulated("h200"), out=lines.append)
    assert result.status == "failed" and "sage: ImportError" in result.message
    assert ["uninstall", "-y", "-q", "sageattention"] in real_pip
    assert installed.read_text() == "version = '1.0.6'\n"  # restored from the backup
    assert any("installed before is back" in l for l in lines)
    assert not (tmp_path / "lock.json").exists()


def test_a_good_build_is_installed_and_recorded_like_a_fetched_kernel(fake_build, tmp_path, monkeypatch):
    source, calls, _ = fake_build
    monkeypatch.setattr(sb, "verify", lambda backends, **_: ([{"backend": b, "ok": True, "rel_error": 0.03}
                                                              for b in backends], None))
    lines = []
    result = sb.build(str(source), machine=ip.simulated("h200"), out=lines.append)
    assert result.status == "built", result.message
    entry = json.loads((tmp_path / "lock.json").read_text())["kernels"][0]
    assert entry["kind"] == "source-build" and entry["repo_id"] == sb.SAGE_REPO_ID
    assert entry["package_version"] == "2.2.0" and entry["variant"].endswith("sm90") and entry["replaced"] == "1.0.6"
    assert set(entry["verified"]) == {"sage", "_sage_qk_int8_pv_fp8_cuda_sm90", "sage_sm90_per_warp"}
    assert (tmp_path / "wheels" / "sageattention-2.2.0-cp312-cp312-linux_x86_64.whl").exists()
    from dispatcher.tools import doctor
    assert doctor.source_builds({entry["repo_id"]: entry}) == [entry]


def test_a_tree_that_is_not_sageattention_2_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(sb, "preflight", lambda machine: ([], {"arch": "9.0", "nvcc": None, "nvcc_version": "12.8",
                                                                "ninja": None}))
    result = sb.build(str(tmp_path), machine=ip.simulated("h200"), out=lambda line: None)
    assert result.status == "failed" and "is not a SageAttention source tree" in result.message

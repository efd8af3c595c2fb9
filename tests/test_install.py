"""install.py: detection, the plan over simulated machines, fetching through the real `kernels`
library, the lock file round trip into the dispatcher, and never breaking an install.

Planning runs in process on machines injected through `use_machine` (dispatcher.install_plan.SIMULATED).
Fetching runs the real `install.py` in fresh interpreters (tests/helpers/install_runner.py) whose
HF_ENDPOINT points at a local stand-in for the Hub (tests/helpers/fake_hub.py) serving kernel repositories
built with tests/helpers/kernel_repos.py: `kernels.install_kernel` takes its normal online path (trust check,
version branches, variant selection, snapshot download) and nothing leaves the machine.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import dispatcher
from dispatcher import env, hub, registry
from dispatcher.tools import doctor, fetch, install_plan as ip, installer
from dispatcher.machine import current_machine, detect, use_machine
from dispatcher.requirements import EnvOptIn, Package, Probe, TorchVersion
from dispatcher.spec import HubKernel
from helpers import kernel_repos as kr
from helpers.fake_hub import FakeHub, dead_endpoint

kernels = pytest.importorskip("kernels")

ROOT = Path(__file__).resolve().parent.parent
DISABLE, TRUST = env.DISABLE_REMOTE_CODE, env.TRUST_REMOTE_KERNELS
FLASH_HUB_FN = registry.get("flash_hub").fn
CHILD_DROP = ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "HF_HOME", "KERNELS_CACHE", "HF_ENDPOINT", "LOCAL_KERNELS",
              "HF_HUB_DISABLE_TELEMETRY", DISABLE, TRUST, env.KERNEL_LOCK, "DIFFUSERS_ATTN_BACKEND",
              "DIFFUSERS_ATTN_CHECKS")


@pytest.fixture(autouse=True)
def isolated(monkeypatch, tmp_path):
    """No trust env, no LOCAL_KERNELS, and a lock path that does not exist (never the pack's real lock)."""
    for var in (DISABLE, TRUST, "LOCAL_KERNELS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(env.KERNEL_LOCK, str(tmp_path / "no-such-lock.json"))
    hub.forget_loaded()
    yield
    hub.forget_loaded()


def register(name: str, repo_id: str, **extra):
    return dispatcher.register_backend(name, FLASH_HUB_FN, devices=("cpu",), causal=True, lse=True, gqa=True,
                                       dropout=True, hub_kernel=HubKernel(repo_id, "flash_attn_func", version=1),
                                       **extra)


# =========================================================================================== detection

def test_detect_describes_this_machine():
    machine = detect()
    assert machine.torch_version == torch.__version__ and not machine.simulated
    assert machine.packages["torch"] == torch.__version__
    assert machine.packages.get("kernels") == importlib.metadata.version("kernels")
    assert machine.cuda_version == torch.version.cuda and machine.hip_version == getattr(torch.version, "hip", None)
    if not torch.cuda.is_available():
        assert machine.device_type in ("cpu", "mps", "xpu", "npu") and machine.cuda_capability is None


def test_plan_reads_the_machine_seam():
    """build() without a machine plans for current_machine(), which use_machine overrides (the one seam)."""
    with use_machine(ip.simulated("rx9070")):
        plan = ip.build(lock={})
    assert plan.machine is ip.SIMULATED["rx9070"] and plan.get("aiter_sage_hub").status == ip.FETCH
    assert ip.build(lock={}).machine is current_machine()


def test_simulated_machines_describe_their_hardware():
    s = ip.SIMULATED
    assert [s[n].arch for n in ("t4", "rtx3090", "a100", "rtx4090", "h200", "b200", "rtx5090")] == \
        ["sm_75", "sm_86", "sm_80", "sm_89", "sm_90", "sm_100", "sm_120"]
    assert [s[n].arch for n in ("mi300x", "mi355x", "rx9070", "rx7900")] == ["gfx942", "gfx950", "gfx1201", "gfx1100"]
    assert {n: s[n].device_type for n in ("mac", "arc", "ascend", "cpu")} == \
        {"mac": "mps", "arc": "xpu", "ascend": "npu", "cpu": "cpu"}
    assert all(m.simulated and m.packages["torch"] == m.torch_version for m in s.values())
    assert s["mi300x"].hip_version and s["mi300x"].cuda_version is None and s["h200"].cuda_version == "12.8"
    with pytest.raises(ValueError, match="unknown simulated machine 'nope'.*h200"):
        ip.simulated("nope")


# ============================================================================================ planning

F, R, O, P, U = ip.FETCH, ip.READY, ip.OPT_IN, ip.PIP, ip.UNSUPPORTED
EXPECTED = {
    "t4": {"flash_hub": U, "_flash_3_hub": U, "flash_4_hub": U, "flash": U, "xformers": P, "_native_cudnn": U,
           "_native_efficient": R, "sage_hub": U, "flash_4": U, "comfy_kitchen_int8": P, "sol_attn": U},
    "rtx3090": {"flash_hub": F, "_flash_3_hub": F, "flash_4_hub": U, "sage_hub": O, "sage_blackwell_hub": U,
                "flash": P, "_native_cudnn": R, "flash_4": U, "comfy_kitchen_int8": P, "sol_attn": P},
    "a100": {"flash": R, "flash_varlen": R, "flash_hub": F, "_flash_3_hub": F, "flash_4_hub": U, "sage": P},
    "rtx4090": {"sage": R, "_sage_qk_int8_pv_fp8_cuda": R, "_sage_qk_int8_pv_fp8_cuda_sm90": U,
                "_flash_3_hub": F, "flash_4_hub": U, "flash": P},
    "h200": {"_flash_3_hub": F, "_flash_3_varlen_hub": F, "flash_4_hub": F, "flash_hub": F, "sage_hub": O,
             "sage_blackwell_hub": U, "aiter_fa2_hub": U, "aiter_sage_hub": U, "flash": P, "_flash_3": P,
             "flash_4": P, "comfy_kitchen_int8": P, "sol_attn": P},
    "h100": {"_flash_3_hub": F, "flash_4_hub": F, "sage_blackwell_hub": U},
    "b200": {"flash_4_hub": F, "_flash_3_hub": U, "sage_blackwell_hub": O, "sage_hub": O, "flash_hub": F,
             "flash_4": P},
    "rtx5090": {"sage_blackwell_hub": O, "flash_4_hub": U, "_flash_3_hub": U, "flash_hub": F, "sage_hub": U,
                "flash_4": P, "sol_attn": P},
    "mi300x": {"aiter_fa2_hub": F, "aiter_sage_hub": U, "flash_hub": U, "_native_efficient": R,
               "_native_cudnn": U, "xformers": U, "comfy_kitchen_int8": U, "sol_attn": U, "flash_4": U},
    "mi355x": {"aiter_fa2_hub": F, "aiter_sage_hub": U},
    "rx9070": {"aiter_sage_hub": F, "aiter_fa2_hub": U},
    "rx7900": {"aiter_sage_hub": U, "aiter_fa2_hub": U, "native": R},
    "mac": {"native": R, "_native_math": R, "flash_hub": U, "aiter_fa2_hub": U, "_native_efficient": U},
    "arc": {"native": R, "flash_hub": U, "_native_cudnn": U},
    "ascend": {"_native_npu": R, "flash_hub": U, "_native_xla": U},
    "cpu": {"native": R, "flex": R, "_native_flash": R, "_native_math": R, "_native_npu": U, "_native_xla": U,
            "flash_4": U, "comfy_kitchen_int8": U, "sol_attn": U},
}
FETCHABLE = {  # the Hub kernels install.py fetches on each machine without any opt-in
    "t4": set(), "rtx3090": {"flash-attn2", "flash-attn3"}, "a100": {"flash-attn2", "flash-attn3"},
    "rtx4090": {"flash-attn2", "flash-attn3"}, "h100": {"flash-attn2", "flash-attn3", "flash-attn4"},
    "h200": {"flash-attn2", "flash-attn3", "flash-attn4"},
    "b200": {"flash-attn2", "flash-attn4"}, "rtx5090": {"flash-attn2"}, "mi300x": {"aiter-flash-attn-ck"},
    "mi355x": {"aiter-flash-attn-ck"}, "rx9070": {"aiter-sage-attention"}, "rx7900": set(), "mac": set(),
    "arc": set(), "ascend": set(), "cpu": set(),
}


@pytest.mark.parametrize("name", list(ip.SIMULATED))
def test_plan_per_simulated_machine(name):
    plan = ip.build(ip.simulated(name), lock={})
    got = {b.name: b.status for b in plan.backends}
    assert {k: got[k] for k in EXPECTED[name]} == EXPECTED[name]
    assert {t.repo_id.split("/", 1)[1] for t in plan.fetch_targets()} == FETCHABLE[name]
    assert all(t.repo_id.startswith("kernels-community/") for t in plan.fetch_targets())
    for b in plan.backends:
        assert b.reasons == dispatcher.availability_reasons(b.name, plan.machine)  # the one owner's view (support)
        assert (b.status in (R, F)) == (not b.reasons)
        if b.status == U:
            assert b.why and not b.steps, b  # nothing to install makes it run here
        if b.status == F:
            assert b.steps[0].kind == "fetch" and b.hub["repo_id"] in b.steps[0].command
    for step in plan.pip_commands():  # never torch, never a device stack
        assert not {"torch", "torchvision", "torchaudio", "torch-npu", "torch-xla"} & set(step.command.split())
        assert "torch-npu" not in step.command and "torch-xla" not in step.command
    if name == "cpu":
        assert {b.name for b in plan.by_status(R)} == {"native", "flex", "_native_flash", "_native_math"}
        assert plan.pip_commands() == [] and plan.fetch_targets() == []


def test_plan_unknown_gpu_and_failed_detection(monkeypatch):
    """A GPU newer than every list, or a detection that raises: still a plan, never an exception."""
    future = replace(ip.simulated("h200"), device_name="NVIDIA Future GPU", cuda_capability=(13, 0))
    plan = ip.build(future, lock={})
    assert plan.get("_flash_3_hub").status == U and "sm_130" in plan.get("_flash_3_hub").why[0]
    assert plan.get("flash_hub").status == F  # sm80+: the kernels library's variant selection decides on fetch
    assert plan.get("native").status == R

    def broken_driver():
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(ip, "current_machine", broken_driver)
    plan = ip.build(lock={})
    assert plan.machine.device_type == "cpu" and plan.get("native").status == R
    assert any("GPU detection failed" in n and "CUDA driver initialization failed" in n for n in plan.notes)


def test_plan_pip_commands_are_exact_and_deduplicated():
    plan = ip.build(ip.simulated("h200"), lock={})
    commands = [s.command for s in plan.pip_commands()]
    assert "pip install 'flash-attn>=2.6.3' --no-build-isolation" in commands
    assert "pip install 'xformers>=0.0.29'" in commands
    # comfy-kitchen serves two backends: one command; flash-attn-4's CUDA 13 remark is text, not an argument
    assert commands.count("pip install 'comfy-kitchen>=0.2.36'") == 1
    assert ip.pip_argv(plan.get("flash_4").steps[0]) == ["install", "flash-attn-4>=4.0.0b40"]
    assert "[cu13]" in plan.get("flash_4").steps[0].command
    assert commands.count("pip install sageattention") == 1  # PyPI's 1.0.6 serves `sage`
    manual = [s for s in plan.pip_commands() if s.kind == "manual"]
    assert manual and all(ip.pip_argv(s) is None for s in manual)  # FA3: a community wheel or a source build
    assert ip.pip_argv(plan.get("flash").steps[0]) == ["install", "flash-attn>=2.6.3", "--no-build-isolation"]
    sage2 = plan.get("sage_varlen").steps[0]  # PyPI has no sageattention>=2.1.1: install.py builds it when asked
    assert sage2.kind == "build" and sage2.command == "python install.py --build sageattention"
    assert ip.pip_argv(sage2) is None and sage2.command not in commands


def test_plan_trust_rules(monkeypatch):
    machine = ip.simulated("rtx5090")
    plan = ip.build(machine, lock={})
    blackwell = plan.get("sage_blackwell_hub")
    assert blackwell.status == O and any(TRUST in r for r in blackwell.why)
    assert [s.command for s in blackwell.steps] == [f"{TRUST}=true"]
    assert "SageAttention/sage-blackwell" not in {t.repo_id for t in plan.fetch_targets()}

    monkeypatch.setenv(TRUST, "true")
    plan = ip.build(machine, lock={})
    assert plan.get("sage_blackwell_hub").status == F
    assert "SageAttention/sage-blackwell" in {t.repo_id for t in plan.fetch_targets()}
    assert plan.get("sage_blackwell_hub").trust == f"{TRUST}=true trusts 'SageAttention'"

    monkeypatch.setenv(DISABLE, "true")  # wins over the opt-in
    plan = ip.build(machine, lock={})
    hub_backends = [b for b in plan.backends if b.hub]
    assert hub_backends and all(b.status in (ip.DISABLED, U) for b in hub_backends)
    assert plan.get("flash_hub").status == ip.DISABLED and plan.get("flash_hub").steps == []
    assert plan.fetch_targets() == [] and any(DISABLE in n for n in plan.notes)


def test_plan_kernels_missing_or_old():
    plan = ip.build(ip.simulated("h200").with_packages(kernels=None), lock={})
    flash_hub = plan.get("flash_hub")
    assert flash_hub.status == P and [s.kind for s in flash_hub.steps] == ["pip", "fetch"]
    assert flash_hub.steps[0].command == "pip install 'kernels>=0.12'" and plan.fetch_targets() == []
    plan = ip.build(ip.simulated("h200").with_packages(kernels="0.12.0"), lock={})
    assert plan.get("flash_hub").status == F
    assert plan.get("flash_4_hub").status == P  # needs kernels>=0.12.3
    assert plan.get("flash_4_hub").steps[0].command == "pip install 'kernels>=0.12.3' --upgrade"


def test_plan_packages_that_import_but_cannot_run():
    """Real (not simulated) machine description: the import and the tiny call are really tried."""
    def fails():
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device")

    dispatcher.register_backend("t_noimport", FLASH_HUB_FN, devices=("cpu",),
                                requires=(Package("attn-test-pkg", module="attn_dispatch_no_such_module_x"),))
    dispatcher.register_backend("t_nocall", FLASH_HUB_FN, devices=("cpu",), requires=(Probe("t_nocall_probe", fails),))
    dispatcher.register_backend("t_optin", FLASH_HUB_FN, devices=("cpu",), requires=(EnvOptIn("ATTN_TEST_EXPERIMENT"),))
    dispatcher.register_backend("t_torch", FLASH_HUB_FN, devices=("cpu",), requires=(TorchVersion("99.0"),))
    machine = replace(detect(), packages={**detect().packages, "attn-test-pkg": "1.0"})
    plan = ip.build(machine, lock={})
    noimport, nocall = plan.get("t_noimport"), plan.get("t_nocall")
    assert noimport.status == ip.BROKEN and "import attn_dispatch_no_such_module_x" in noimport.why[0]
    assert noimport.steps[0].command == "pip install 'attn-test-pkg' --force-reinstall --no-deps"
    assert nocall.status == ip.BROKEN and "no kernel image" in nocall.why[0] and nocall.steps == []
    assert plan.get("t_optin").status == O and plan.get("t_optin").steps[0].command == "ATTN_TEST_EXPERIMENT=1"
    torch_plan = plan.get("t_torch")
    assert torch_plan.status == U and "torch" in torch_plan.why[0] and torch_plan.steps == []


def test_plan_marks_fetched_kernels_ready(tmp_path):
    repo = kr.make_cache_repo(tmp_path / "cache", "kernels-community/attn-plan")
    register("plan_hub", repo.repo_id)
    entry = {"repo_id": repo.repo_id, "version": 1, "revision": repo.commit, "variant": kr.VARIANT,
             "path": str(repo.variant_dir)}
    machine = detect()
    plan = ip.build(machine, lock={repo.repo_id: entry}, is_cached=fetch.is_cached)
    assert plan.get("plan_hub").status == R and plan.get("plan_hub").fetched == entry
    assert repo.repo_id in [t.repo_id for t in plan.fetch_targets()]  # fetch() then finds it present
    gone = {**entry, "path": str(tmp_path / "gone" / kr.VARIANT)}
    plan = ip.build(machine, lock={repo.repo_id: gone}, is_cached=fetch.is_cached)
    assert plan.get("plan_hub").status == F and plan.get("plan_hub").fetched is None
    other_version = {**entry, "version": 2}
    assert ip.build(machine, lock={repo.repo_id: other_version}, is_cached=fetch.is_cached
                    ).get("plan_hub").status == F


def test_fetched_build_follows_the_library_variant_choice(tmp_path):
    """A pinned build the kernels library would no longer pick (another torch) is not used."""
    repo = kr.make_cache_repo(tmp_path / "cache", "kernels-community/attn-stale")
    entry = {"repo_id": repo.repo_id, "version": 1, "revision": repo.commit, "variant": kr.VARIANT,
             "path": str(repo.variant_dir)}
    assert hub.fetched_build(entry) == (repo.variant_dir, None)
    kr.write_variant(repo.path / "build" / "torch-cpu", name="attn-stale", kernel_id=kr.unique_id("x"), tag="cpu")
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:  # a CPU torch prefers torch-cpu
        build, why = hub.fetched_build(entry)
        assert build is None and "would pick torch-cpu" in why
    assert hub.fetched_build({**entry, "revision": "0" * 40})[0] is None
    assert hub.fetched_build({**entry, "path": None}) == (None, "the lock entry records no path")


# ===================================================================================== the command line

def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = installer.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_simulate_prints_the_table(capsys):
    code, out, _ = run_cli(capsys, "--simulate", "h200")
    assert code == 0
    assert "Machine: NVIDIA H200 (NVIDIA CUDA GPU, sm_90), torch 2.10.0+cu128, CUDA 12.8 [simulated]" in out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("_flash_3_hub "))
    assert "after fetch" in line and "kernels-community/flash-attn3 v1" in line
    assert "nothing is fetched or installed" in out
    assert "pip install 'flash-attn>=2.6.3' --no-build-isolation" in out


def test_cli_simulate_json(capsys):
    code, out, _ = run_cli(capsys, "--simulate", "mi300x", "--json")
    data = json.loads(out)
    assert code == 0 and data["plan"]["machine"]["arch"] == "gfx942" and data["plan"]["machine"]["simulated"]
    assert data["plan"]["summary"]["fetch"] == ["aiter_fa2_hub"]
    assert [t["repo_id"] for t in data["plan"]["fetch"]] == ["kernels-community/aiter-flash-attn-ck"]
    assert "fetch" not in data  # a simulated plan fetches nothing
    statuses = {b["name"]: b["status"] for b in data["plan"]["backends"]}
    assert statuses["aiter_sage_hub"] == "unsupported" and set(statuses) == set(registry.names())


def test_cli_plan_json_this_machine(capsys, tmp_path):
    code, out, err = run_cli(capsys, "--plan", "--json")
    data = json.loads(out)
    assert code == 0 and data["plan"]["machine"]["device"] == detect().device_type
    assert not data["plan"]["machine"]["simulated"] and "fetch" not in data
    assert not (tmp_path / "no-such-lock.json").exists()


def test_cli_usage_errors(capsys):
    code, _, err = run_cli(capsys, "--simulate", "nope")
    assert code == 2 and "h200" in err and "rtx5090" in err
    code, _, err = run_cli(capsys, "--only", "flash_hub,not_a_backend")
    assert code == 2 and "not_a_backend" in err


@pytest.mark.parametrize("name", ["", "  ", "H200 "])
def test_cli_an_empty_or_unknown_simulated_machine_is_a_usage_error(capsys, monkeypatch, name):
    """`--simulate ''` once planned and fetched for the real machine (an empty name is false): a name that is not a
    simulated machine, empty or blank included, exits 2 listing the valid names, and plans nothing."""
    monkeypatch.setattr(ip, "build", lambda *a, **k: pytest.fail("planned for an invalid --simulate name"))
    code, out, err = run_cli(capsys, "--simulate", name)
    assert code == 2 and out == ""
    assert "simulated machine" in err and all(valid in err for valid in ip.SIMULATED), err


def test_cli_never_fails_on_its_own_bug(capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(ip, "build", broken)
    code, out, err = run_cli(capsys, "--json")
    assert code == 0 and "simulated bug" in err and "still works" in err
    assert "simulated bug" in json.loads(out)["error"]


# ================================================================================================ pip

def test_pip_suggested_never_run_without_consent(capsys):
    plan = ip.build(replace(ip.simulated("h200"), simulated=False), lock={})
    ran = []
    results = fetch.install_packages(plan, out=print, runner=ran.append)
    assert ran == [] and results and {r.status for r in results} <= {"suggested", "manual"}
    assert "--yes-pip" in capsys.readouterr().out
    assert fetch.install_packages(plan, yes=True, dry_run=True, runner=ran.append) and ran == []


def test_pip_with_consent_pins_torch(capsys):
    plan = ip.build(replace(ip.simulated("h200"), simulated=False), lock={})
    seen = []

    def runner(command):
        constraints = Path(command[command.index("-c") + 1]).read_text()
        seen.append((command, constraints))
        return 1 if "xformers" in " ".join(command) else 0

    results = fetch.install_packages(plan, yes=True, only={"flash", "xformers", "_flash_3"}, runner=runner)
    by_command = {r.command: r.status for r in results}
    assert by_command["pip install 'flash-attn>=2.6.3' --no-build-isolation"] == "installed"
    assert by_command["pip install 'xformers>=0.0.29'"] == "failed"
    # FA3: the community wheel (no author in its metadata) or a source build: printed, never run
    (fa3,) = [command for command in by_command if "fa3-fwd" in command]
    assert by_command[fa3] == "manual" and "if you trust it" in fa3
    assert len(seen) == 2
    for command, constraints in seen:
        assert command[:4] == [sys.executable, "-m", "pip", "install"]
        assert f"torch=={importlib.metadata.version('torch')}" in constraints.split()
        assert not any(w.startswith("torch") for w in command[4:command.index("-c")])
    assert "the pack works without it" in capsys.readouterr().out


def test_flash3_on_a_torch_too_old_for_the_wheel_names_the_source_build():
    old = ip.build(replace(ip.simulated("h200"), torch_version="2.8.0"), lock={})
    (entry,) = [e for e in old.backends if e.name == "_flash_3"]
    assert [s.kind for s in entry.steps] == ["manual"] and "from source" in entry.steps[0].command
    assert any("fa3-fwd needs torch>=2.10" in r for r in entry.reasons)


# ========================================================================================= signatures

def test_signature_of_an_unsigned_build(tmp_path):
    repo = kr.make_local_repo(tmp_path, "kernels-community/attn-unsigned")
    assert fetch.verify_signature(repo.variant_dir) == expected_signature()


def test_signature_results_are_mapped(monkeypatch, tmp_path):
    """What the kernels library's check says (0.16-0.18 `verify_variant`, 0.19+ `verify_signature` then
    `verify_digest`, both read by kernels_api) becomes one line of the fetch report."""
    from dispatcher import kernels_api
    cases = [(("verified", ""), "verified"), (("unsigned", ""), "unsigned"),
             (("digest-missing", ""), "unverified: the metadata has no digest"),
             (("digest-failed", "lib.so: sha256 differs"), "failed: the downloaded files differ from the signed "
                                                           "digest lib.so: sha256 differs"),
             (("signature-failed", "SignatureVerificationFailure: bad cert"),
              "unverified: SignatureVerificationFailure: bad cert")]
    for result, expected in cases:
        monkeypatch.setattr(kernels_api, "signature_result", lambda path, repo, commit, r=result: r)
        assert fetch.verify_signature(tmp_path) == expected

    def offline(path, repo, commit):
        raise ConnectionError("no route to the sigstore trust root")

    monkeypatch.setattr(kernels_api, "signature_result", offline)
    assert fetch.verify_signature(tmp_path) == "unverified: ConnectionError: no route to the sigstore trust root"


def test_signature_check_is_asked_with_the_snapshot_repo_and_commit(monkeypatch, tmp_path):
    """kernels 0.19+ verifies by Hub location: a cache snapshot's repo and commit are read from its path."""
    from dispatcher import kernels_api
    seen = []
    monkeypatch.setattr(kernels_api, "signature_result", lambda path, repo, commit: seen.append((repo, commit))
                        or ("unsigned", ""))
    build = tmp_path / "kernels--kernels-community--attn-x" / "snapshots" / ("a" * 40) / "build" / kr.VARIANT
    assert fetch.verify_signature(build) == "unsigned"
    assert fetch.verify_signature(tmp_path / "local" / kr.VARIANT) == "unsigned"
    assert seen == [("kernels-community/attn-x", "a" * 40), (None, None)]


def test_failure_lines_name_the_cause(monkeypatch):
    class LocalProtocolError(Exception):
        pass

    # what kernels 0.17.2 raises when huggingface_hub's request fails (`except Exception: raise ValueError(...)`)
    error = ValueError("Kernel repository 'x/y' could not verify publisher trust status.\nmore")
    error.__context__ = LocalProtocolError("Illegal header value b'kernels/0.17.2; hf_hub/2.4.0; python/3.11.7; '")
    monkeypatch.delenv("HF_HUB_DISABLE_TELEMETRY", raising=False)
    line = fetch._why(error)
    assert line.startswith("ValueError: Kernel repository 'x/y' could not verify") and "more" not in line
    assert "caused by LocalProtocolError: Illegal header value" in line and "TELEMETRY" not in line
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    assert "unset HF_HUB_DISABLE_TELEMETRY" in fetch._why(error)


# ============================================================================================= doctor

def test_doctor_shows_fetched_and_not(monkeypatch, tmp_path):
    cache = tmp_path / "cache"
    fetched = kr.make_cache_repo(cache, "kernels-community/attn-doc-fetched")
    gone = kr.make_cache_repo(cache, "kernels-community/attn-doc-gone")
    register("doc_fetched_hub", fetched.repo_id)
    register("doc_gone_hub", gone.repo_id)
    register("doc_never_hub", "kernels-community/attn-doc-never")
    shutil.rmtree(gone.path)
    lock = tmp_path / "lock.json"
    fetch.write_lock(lock, {r.repo_id: {"repo_id": r.repo_id, "version": 1, "revision": r.commit,
                                        "variant": kr.VARIANT, "path": str(r.variant_dir), "signature": "unsigned"}
                            for r in (fetched, gone)})
    monkeypatch.setenv(env.KERNEL_LOCK, str(lock))
    data = doctor.report()
    rows = {row["repo_id"]: row for row in data["hub_kernels"]}
    assert rows[fetched.repo_id]["fetched"] and rows[fetched.repo_id]["pinned"] == fetched.commit
    assert not rows[gone.repo_id]["fetched"] and "no longer in the cache" in rows[gone.repo_id]["status"]
    never = rows["kernels-community/attn-doc-never"]
    assert not never["fetched"] and "python install.py" in never["status"]
    text = doctor.render(data)
    assert "kernels-community/attn-doc-fetched v1" in text and f"fetched @ {fetched.commit[:12]}" in text
    assert "pinned, but" in text and "not fetched" in text


# ==================================================================== fetching against a local Hub

def _child_env(**extra: str) -> dict:
    child = {k: v for k, v in os.environ.items() if k not in CHILD_DROP}
    child.update(extra)
    return child


def _run_install(config: dict, tmp: Path, **extra_env: str) -> dict[str, dict]:
    path = tmp / f"install-config-{len(list(tmp.glob('install-config-*')))}.json"
    path.write_text(json.dumps(config))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "install_runner.py"), str(path)], cwd=ROOT,
                          env=_child_env(**extra_env), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")][-1]
    return {step["id"]: step for step in json.loads(line[len("RESULTS "):])}


def _json_of(step: dict) -> dict:
    assert step["rc"] == 0, step["stderr"][-2000:]
    return json.loads(step["stdout"])


def _results(step: dict) -> dict[str, dict]:
    return {r["repo_id"]: r for r in _json_of(step)["fetch"]}


def _lock_entries(text: str | None) -> dict[str, dict]:
    return {e["repo_id"]: e for e in json.loads(text)["kernels"]} if text else {}


OTHER_VARIANT = "torch-rocm"  # a build for another backend: rejected on CPU and CUDA machines


def chosen_variant() -> str:
    """The variant the kernels library picks here among the fake repository's two builds."""
    from dispatcher import kernels_api
    parse_variant, resolve_variant = (getattr(kernels_api.module("variants"), f)
                                      for f in ("parse_variant", "resolve_variant"))
    variant, _ = resolve_variant([parse_variant(kr.VARIANT), parse_variant(OTHER_VARIANT)])
    return variant.variant_str


def expected_signature() -> str:
    try:
        import sigstore  # noqa: F401
    except ImportError:
        return "unverified: this kernels install cannot verify signatures (ModuleNotFoundError)"
    return "unsigned"


GOOD, UNTRUSTED = "kernels-community/attn-fetch", "someorg/attn-untrusted"
CORRUPT, BADMETA = "kernels-community/attn-corrupt", "kernels-community/attn-badmeta"
HUBERROR, MISSING = "kernels-community/attn-huberror", "kernels-community/attn-absent"
BACKENDS = [{"name": "good_hub", "repo_id": GOOD, "version": 1},
            {"name": "untrusted_hub", "repo_id": UNTRUSTED, "version": 1},
            {"name": "corrupt_hub", "repo_id": CORRUPT, "version": 1},
            {"name": "badmeta_hub", "repo_id": BADMETA, "version": 1},
            {"name": "huberror_hub", "repo_id": HUBERROR, "version": 1},
            {"name": "missing_hub", "repo_id": MISSING, "version": 1}]


@pytest.fixture(scope="module")
def online(tmp_path_factory):
    """The fake Hub, the repos it serves, and one install.py interpreter running five steps against it."""
    tmp = tmp_path_factory.mktemp("online")
    fake = FakeHub().start()
    fake.add_org("kernels-community", trusted=True)
    fake.add_org("someorg", trusted=False)
    good = kr.make_local_repo(tmp / "repos", GOOD)
    # A second build variant, for another backend: a real repo has many; only one is downloaded.
    kr.write_variant(good.path / "build" / OTHER_VARIANT, name="attn-fetch", kernel_id=kr.unique_id(GOOD), tag="other")
    commits = {GOOD: fake.add_version(GOOD, 1, good.path)}
    untrusted = kr.make_local_repo(tmp / "repos", UNTRUSTED)
    commits[UNTRUSTED] = fake.add_version(UNTRUSTED, 1, untrusted.path)
    for repo_id, broken in ((CORRUPT, "import"), (BADMETA, "metadata"), (HUBERROR, None)):
        repo = kr.make_local_repo(tmp / "repos", repo_id, broken=broken)
        commits[repo_id] = fake.add_version(repo_id, 1, repo.path)
    fake.error_files["build/torch-universal/attn_huberror/__init__.py"] = 403
    lock, cache = tmp / "kernels.lock.json", tmp / "hub-cache"
    # --only: on a GPU machine the built-in Hub backends fit too, and the fake Hub does not serve them
    mine = ["--only", ",".join(b["name"] for b in BACKENDS)]
    steps = [
        {"id": "dry", "argv": ["--dry-run", "--json", *mine]},
        {"id": "fetch", "argv": ["--json", *mine]},
        {"id": "again", "argv": ["--json", *mine]},
        {"id": "opt-in", "argv": ["--json", "--only", "untrusted_hub"], "env": {TRUST: "true"}},
        {"id": "disabled", "argv": ["--json", *mine], "env": {DISABLE: "true", TRUST: "true"}},
        {"id": "text", "argv": ["--only", "good_hub"]},
    ]
    try:
        steps_out = _run_install({"backends": BACKENDS, "steps": steps}, tmp, HF_ENDPOINT=fake.url,
                                 HF_HUB_CACHE=str(cache), HF_HOME=str(tmp / "hf-home"),
                                 **{env.KERNEL_LOCK: str(lock)})
        requests = fake.requests_by_step()
    finally:
        fake.stop()
    return {"tmp": tmp, "steps": steps_out, "requests": requests, "commits": commits, "lock": lock,
            "cache": cache, "good": good, "untrusted": untrusted}


def test_fetch_dry_run_changes_nothing(online):
    dry = online["steps"]["dry"]
    results = _results(dry)
    assert dry["lock"] is None and dry["cache"] == []
    assert online["requests"]["dry"] == []  # not even a request
    assert {r["status"] for r in results.values()} == {fetch.WOULD_FETCH}
    assert set(results) == {GOOD, CORRUPT, BADMETA, HUBERROR, MISSING}  # the untrusted one waits for opt-in
    assert _json_of(dry)["dry_run"] is True


def test_fetch_downloads_pins_and_reports(online):
    step = online["steps"]["fetch"]
    results = _results(step)
    good = results[GOOD]
    commit = online["commits"][GOOD]
    assert chosen_variant() == kr.VARIANT
    assert good["status"] == fetch.FETCHED and good["revision"] == commit and good["variant"] == kr.VARIANT
    assert good["signature"] == expected_signature()
    expected_path = (online["cache"] / "kernels--kernels-community--attn-fetch" / "snapshots" / commit / "build"
                     / kr.VARIANT)
    assert Path(good["path"]) == expected_path and (expected_path / "metadata.json").is_file()
    assert not (expected_path.parent / OTHER_VARIANT).exists()  # the library chose one variant and fetched only it
    entry = _lock_entries(step["lock"])[GOOD]
    assert {k: entry[k] for k in ("repo_id", "version", "revision", "variant", "path")} == \
        {"repo_id": GOOD, "version": 1, "revision": commit, "variant": kr.VARIANT, "path": str(expected_path)}
    assert entry["fetched_at"] and entry["backends"] == ["good_hub"] and entry["signature"] == expected_signature()
    assert "fetching kernels-community/attn-fetch v1 from the Hub" in step["stderr"]  # progress on stderr
    assert "untrusted_hub" in _json_of(step)["plan"]["summary"]["opt-in"]


def test_fetch_untrusted_publisher_needs_opt_in(online):
    fetched_step = online["steps"]["fetch"]
    assert UNTRUSTED not in _results(fetched_step) and UNTRUSTED not in _lock_entries(fetched_step["lock"])
    assert not any("someorg" in path for _, path in online["requests"]["fetch"]), "no request before opt-in"
    opt_in = online["steps"]["opt-in"]
    result = _results(opt_in)[UNTRUSTED]
    assert result["status"] == fetch.FETCHED and result["revision"] == online["commits"][UNTRUSTED]
    entry = _lock_entries(opt_in["lock"])[UNTRUSTED]
    assert entry["trust"] == f"{TRUST}=true trusts 'someorg'" and entry["revision"] == online["commits"][UNTRUSTED]
    assert GOOD in _lock_entries(opt_in["lock"])  # earlier pins are kept
    # kernels' own publisher check would refuse someorg: the opt-in reached it as trust_remote_code=True
    assert not any("organizations/someorg" in path for _, path in online["requests"]["opt-in"])
    assert any("/kernels/someorg/attn-untrusted/resolve/" in path for _, path in online["requests"]["opt-in"])


def test_fetch_disable_remote_code_fetches_nothing(online):
    step = online["steps"]["disabled"]
    data = _json_of(step)
    assert data["fetch"] == [] and online["requests"]["disabled"] == []
    assert f"{DISABLE}=true: no Hub kernel is fetched" in step["stderr"]
    assert step["lock"] == online["steps"]["opt-in"]["lock"]  # untouched
    assert set(data["plan"]["summary"]["disabled"]) >= {"good_hub", "untrusted_hub"}


def test_fetch_corrupted_and_failing_downloads_are_not_pinned(online):
    step = online["steps"]["fetch"]
    results = _results(step)
    assert step["rc"] == 0
    assert results[CORRUPT]["status"] == fetch.FAILED and "does not import" in results[CORRUPT]["message"]
    assert "this kernel download is corrupted" in results[CORRUPT]["message"]
    assert results[BADMETA]["status"] == fetch.FAILED and "Cannot parse metadata" in results[BADMETA]["message"]
    assert results[HUBERROR]["status"] == fetch.FAILED and "403" in results[HUBERROR]["message"]
    assert results[MISSING]["status"] == fetch.FAILED and "RepositoryNotFoundError" in results[MISSING]["message"]
    assert set(_lock_entries(step["lock"])) == {GOOD}
    for repo_id in (CORRUPT, BADMETA, HUBERROR, MISSING):
        assert f"could not fetch {repo_id}" in step["stderr"] or f"{repo_id} v1: " in step["stderr"]


def test_fetch_second_run_is_idempotent(online):
    again = online["steps"]["again"]
    result = _results(again)[GOOD]
    assert result["status"] == fetch.PRESENT and result["revision"] == online["commits"][GOOD]
    assert not any("attn-fetch" in path for _, path in online["requests"]["again"]), "no request for a pinned kernel"
    assert again["lock"] == online["steps"]["fetch"]["lock"]  # byte for byte: fetched_at unchanged
    assert "ready" == {b["name"]: b["status"] for b in _json_of(again)["plan"]["backends"]}["good_hub"]
    text = online["steps"]["text"]
    assert text["rc"] == 0 and "already fetched: kernels-community/attn-fetch v1" in text["stdout"]
    assert "good_hub" in text["stdout"] and "done: 1 present" in text["stdout"]


# --------------------------------------------------------------- the lock file round trip into the dispatcher

def _run_load_cases(online: dict, **extra_env: str) -> dict[str, dict]:
    tmp = online["tmp"]
    cases = [
        {"id": "good", "backend": "good_hub", "repo_id": GOOD, "dispatch": True},
        {"id": "untrusted-opted-in", "backend": "untrusted_hub", "repo_id": UNTRUSTED, "env": {TRUST: "true"},
         "dispatch": True},
        {"id": "untrusted-refused", "backend": "untrusted_hub", "repo_id": UNTRUSTED, "dispatch": False},
        {"id": "disabled", "backend": "good_hub", "repo_id": GOOD, "env": {DISABLE: "true"}, "dispatch": False},
    ]
    config = {"backends": [b for b in BACKENDS if b["name"] in ("good_hub", "untrusted_hub")], "cases": cases}
    path = tmp / f"load-config-{len(list(tmp.glob('load-config-*')))}.json"
    path.write_text(json.dumps(config))
    proc = subprocess.run([sys.executable, str(Path(kr.__file__)), str(path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300,
                          env=_child_env(HF_HUB_CACHE=str(online["cache"]), HF_HOME=str(tmp / "hf-home"),
                                         **{env.KERNEL_LOCK: str(online["lock"])}, **extra_env))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")][-1]
    return {r["id"]: r for r in json.loads(line[len("RESULTS "):])["results"]}


@pytest.mark.parametrize("network", ["no-network", "hf-hub-offline"])
def test_lock_round_trip_into_the_dispatcher(online, network):
    """What install.py pinned is what an offline ComfyUI loads: the recorded build, by commit, no network."""
    extra = {"HF_ENDPOINT": dead_endpoint()} if network == "no-network" else {"HF_HUB_OFFLINE": "1"}
    results = _run_load_cases(online, **extra)
    good = results["good"]
    assert good["loaded"], good["error"]
    record = good["record"]
    assert record["from_lock"] and record["revision"] == online["commits"][GOOD] and record["source"] == "cache"
    assert record["path"] == str(Path(_lock_entries(online["lock"].read_text())[GOOD]["path"]) / "attn_fetch")
    assert good["served"] == "good_hub" and good["max_error"] < 1e-5
    assert good["tag"] == f"local:{GOOD}"  # the code that was published on the fake Hub
    opted = results["untrusted-opted-in"]
    assert opted["loaded"] and opted["served"] == "untrusted_hub"
    assert opted["record"]["revision"] == online["commits"][UNTRUSTED]
    refused = results["untrusted-refused"]
    assert not refused["loaded"] and TRUST in refused["error"]  # a pin never bypasses the trust rules
    assert not results["disabled"]["loaded"] and DISABLE in results["disabled"]["error"]


# ---------------------------------------------------------------------------------------- no network

def test_no_network_exits_zero_with_a_clear_line(online, tmp_path):
    lock = tmp_path / "fresh.lock.json"
    steps = [{"id": "offline", "argv": ["--json", "--only", ",".join(b["name"] for b in BACKENDS)]},
             {"id": "pinned", "argv": ["--json", "--only", "good_hub"], "env": {env.KERNEL_LOCK: str(online["lock"])}}]
    endpoint = dead_endpoint()
    out = _run_install({"backends": BACKENDS, "steps": steps}, tmp_path, HF_ENDPOINT=endpoint,
                       HF_HUB_CACHE=str(tmp_path / "cache"), INSTALL_RUNNER_NO_MARKS="1",
                       **{env.KERNEL_LOCK: str(lock)})
    offline = out["offline"]
    results = _results(offline)
    assert offline["rc"] == 0 and offline["lock"] is None and not lock.exists()
    assert {r["status"] for r in results.values()} == {fetch.OFFLINE}
    assert all(f"cannot reach the Hugging Face Hub at {endpoint}" in r["message"] for r in results.values())
    assert "cannot reach the Hugging Face Hub" in offline["stderr"]
    # Already fetched (the lock and the cache of the online run): nothing to do, no network needed.
    pinned = _results(out["pinned"])[GOOD]
    assert pinned["status"] == fetch.PRESENT and pinned["revision"] == online["commits"][GOOD]


def test_offline_mode_pins_what_the_cache_holds(tmp_path):
    cache = tmp_path / "cache"
    repo = kr.make_cache_repo(cache, "kernels-community/attn-cached")
    lock = tmp_path / "lock.json"
    backends = [{"name": "cached_hub", "repo_id": repo.repo_id, "version": 1},
                {"name": "uncached_hub", "repo_id": "kernels-community/attn-uncached", "version": 1}]
    steps = [{"id": "offline", "argv": ["--json", "--only", "cached_hub,uncached_hub"]}]
    out = _run_install({"backends": backends, "steps": steps}, tmp_path,
                       HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), **{env.KERNEL_LOCK: str(lock)})
    results = _results(out["offline"])
    assert results[repo.repo_id]["status"] == fetch.FETCHED and results[repo.repo_id]["revision"] == repo.commit
    assert "offline cache" in out["offline"]["stderr"]
    missing = results["kernels-community/attn-uncached"]
    assert missing["status"] == fetch.OFFLINE and "not in the local cache" in missing["message"]
    assert set(_lock_entries(out["offline"]["lock"])) == {repo.repo_id}


# ------------------------------------------------------------------------- install.py as ComfyUI-Manager runs it

def test_install_py_as_comfyui_manager_runs_it(tmp_path):
    """`python install.py` with cwd = the pack folder, and from elsewhere: exit 0, a plan, no lock on a CPU."""
    child = _child_env(HF_ENDPOINT=dead_endpoint(), HF_HUB_CACHE=str(tmp_path / "cache"),
                       **{env.KERNEL_LOCK: str(tmp_path / "lock.json")})
    proc = subprocess.run([sys.executable, "install.py"], cwd=ROOT, env=child, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Plan (" in proc.stdout and "native" in proc.stdout and "[attention-dispatch] done" in proc.stdout
    if detect().device_type not in ("cuda", "rocm"):
        assert "no Hub kernel fits this machine" in proc.stdout and not (tmp_path / "lock.json").exists()
    proc = subprocess.run([sys.executable, str(ROOT / "install.py"), "--simulate", "rtx5090", "--json"],
                          cwd=tmp_path, env=child, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and json.loads(proc.stdout)["plan"]["machine"]["arch"] == "sm_120"


# ---------------------------------------------------------------------------------- one truth about installing

def _install_hints(texts) -> list[str]:
    return [t for t in texts if "pip install" in t or "install.py --build" in t or "from source" in t]


@pytest.mark.parametrize("machine_name", ["cpu", "mac", "arc"])
def test_no_install_hint_where_installing_would_not_make_the_backend_run(machine_name):
    """A CPU user was told `pip install 'flash-attn>=2.6.3'` right after "needs an NVIDIA CUDA GPU" (node, toast,
    strict error), while the doctor said "nothing to install": every surface now gives the machine's reason alone."""
    from dispatcher import support
    machine = ip.SIMULATED[machine_name]
    with use_machine(machine):
        plan = ip.build(machine, lock={})
        for name in registry.names():
            reasons = support.reasons(name, machine=machine)
            assert not _install_hints(reasons), (name, reasons)
            planned = plan.get(name)
            if planned.status == ip.UNSUPPORTED:  # the same words in the plan (and so the doctor)
                assert planned.why == reasons, name
        (flash,) = support.reasons("flash", machine=machine)
        assert flash.startswith("needs an NVIDIA CUDA GPU; this machine has ")
        assert not plan.pip_commands() and not plan.build_commands()
        recommendation = doctor.recommendation(machine, [s.as_dict() for s in support.list_backends(machine)], plan)
    if machine_name == "cpu":
        assert recommendation["install"][0].startswith("nothing to install")


def test_the_install_hint_where_installing_makes_the_backend_run_is_the_same_everywhere():
    """On an H200 without flash-attn the package is the fix: the node's reason, install.py's step and the doctor's
    row give the same command."""
    from dispatcher import support
    machine = ip.SIMULATED["h200"]
    with use_machine(machine):
        (reason,) = support.reasons("flash", machine=machine)
        plan = ip.build(machine, lock={})
        (step,) = [s for s in plan.get("flash").steps if s.kind == "pip"]
        groups = doctor.groups([s.as_dict() for s in support.list_backends(machine)], plan)
    assert reason == f"flash-attn is not installed: {step.command}"
    (row,) = [r for r in groups["step_away"] if r["name"] == "flash"]
    assert step.command in row["why"] and row["status"] == ip.PIP


def test_a_device_stack_is_never_an_install_hint():
    """torch-npu exists only with its NPU: on a CPU the reason is the device, never `pip install torch-npu`."""
    from dispatcher import support
    machine = ip.SIMULATED["cpu"]
    with use_machine(machine):
        (npu,) = support.reasons("_native_npu", machine=machine)
        (xla,) = support.reasons("_native_xla", machine=machine)
        plan = ip.build(machine, lock={})
    assert npu.startswith("needs an Ascend NPU") and "pip install" not in npu
    assert xla.startswith("needs an XLA device") and "pip install" not in xla
    assert plan.get("_native_npu").why == [npu] and plan.get("_native_npu").status == ip.UNSUPPORTED


def test_install_py_says_the_machine_in_words_and_leads_with_what_runs(capsys):
    """`install.py` printed `Machine: cpu (cpu, cpu)` and scattered its 4 ready rows among 28 "not here": the machine
    is now said once in words (the doctor's line), the ready rows come first, and what cannot run here is grouped by
    the reason that decides, each reason once (as the doctor does)."""
    code, out, _ = run_cli(capsys, "--simulate", "cpu")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "Machine: CPU only: no GPU visible to torch (a simulated CPU), torch 2.10.0+cpu [simulated]"
    assert "(cpu, cpu)" not in out and sum(line.startswith("Machine:") for line in lines) == 1
    table = lines[lines.index(next(l for l in lines if l.startswith("Plan ("))):]
    rows = [l.split()[:2] for l in table[3:table.index("")]]
    assert rows and all(status == "ready" for _, status in rows), rows  # only what runs, before anything else
    assert [name for name, _ in rows] == ["native", "_native_flash", "flex", "_native_math"]
    assert " not here " not in out
    grouped = out[out.index("Not for this machine ("):]
    assert grouped.count("needs an NVIDIA CUDA GPU; this machine has a CPU (") == 1
    assert out.count("needs an NVIDIA CUDA GPU; this machine has a CPU") == 1
    assert "flash," in grouped and "sage," in grouped and "pip install" not in out
    # each group's backends by name (a variant beside its family), never wrapped inside a name (#48)
    for line in grouped.split("\n\n")[0].splitlines()[1:]:
        assert not line.rstrip().endswith(("-", "_")), line
    cuda = " ".join(line.strip() for line in grouped.split("\n\n")[0].splitlines()[1:]).split("\n")[0]
    cuda = cuda[cuda.index("needs an NVIDIA CUDA GPU; this machine has a CPU ("):].split("): ", 1)[1]
    names = cuda.split(" needs ")[0].split(", ")
    assert names == sorted(names, key=lambda n: (n.lstrip("_").lower(), n)), names

"""Hub kernels through the REAL `kernels` library: trust rules, recording, lock files, failures.

Kernel repositories are built on disk (tests/helpers/kernel_repos.py) and loaded by `kernels` 0.17 through
LOCAL_KERNELS (read by `kernels` on each call: in process) or the offline HF cache (HF_HUB_CACHE /
KERNELS_CACHE + HF_HUB_OFFLINE=1, read when huggingface_hub/kernels are imported: in a subprocess).
No network is needed; `kernels` itself never checks trust on these paths (LOCAL_KERNELS is never
checked, offline mode skips the check), so those refusals are the dispatcher's own rule. kernels' own publisher
check (it asks the Hub) is met where HF_ENDPOINT points at a dead port (a machine without network: issue 37) or at a
local fake Hub whose answer about each publisher a case sets (tests/helpers/fake_hub.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dispatcher
from dispatcher import caches, env, hub, registry, trust
from dispatcher.machine import Machine, current_machine, use_machine
from dispatcher.spec import HubKernel
from dispatcher.versions import at_least
from helpers import kernel_repos as kr
from helpers import tensors
from helpers.fake_hub import dead_endpoint

kernels = pytest.importorskip("kernels")

ROOT = Path(__file__).resolve().parent.parent
TRUSTED_ORG, UNTRUSTED_ORG = "kernels-community", "someorg"
DISABLE, TRUST = env.DISABLE_REMOTE_CODE, env.TRUST_REMOTE_KERNELS
HUB_VARS = (DISABLE, TRUST, env.KERNEL_LOCK, "LOCAL_KERNELS")


# ------------------------------------------------------------------------------------------------ fixtures

def _forget_all() -> None:
    hub.forget_loaded()
    caches.forget()
    registry.forget_availability()


@pytest.fixture(autouse=True)
def hub_state(monkeypatch, tmp_path):
    """No trust env, no LOCAL_KERNELS, a lock path that does not exist, and nothing loaded, before and after."""
    for var in HUB_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(env.KERNEL_LOCK, str(tmp_path / "no-such-lock.json"))  # never the repo's real lock
    before = set(registry.names())
    _forget_all()
    yield
    for name in registry.names():
        if name not in before and registry.get(name).custom:
            registry.remove(name)
    _forget_all()


@pytest.fixture
def qkv():
    return tensors.qkv(b=2, lq=16, lk=16, h=4, d=32, seed=0)


def reference(q, k, v, causal=False):
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)


FLASH_HUB_FN = registry.get("flash_hub").fn  # the real code path: dispatcher.backends.flash.dense, style fa2


def register(name: str, repo_id: str, *, version: int | None = 1, revision: str | None = None, **extra):
    return dispatcher.register_backend(
        name, FLASH_HUB_FN, devices=("cpu",), causal=True, lse=True, gqa=True, dropout=True,
        hub_kernel=HubKernel(repo_id, "flash_attn_func", version=version, revision=revision), **extra)


def use_local(monkeypatch, *repos: kr.KernelRepo) -> None:
    monkeypatch.setenv("LOCAL_KERNELS", kr.local_kernels_value(*repos))


def calls_of(repo: kr.KernelRepo) -> list:
    module = sys.modules.get(repo.kernel_id)
    return module.CALLS if module is not None else []


@pytest.fixture
def spy(monkeypatch):
    """Wrap the real kernels.get_kernel, recording its arguments."""
    seen = []
    real = kernels.get_kernel

    def get_kernel(repo_id, **kwargs):
        seen.append((repo_id, kwargs))
        return real(repo_id, **kwargs)

    monkeypatch.setattr(kernels, "get_kernel", get_kernel)
    return seen


def test_flash_hub_spec_calls_dense_fa2():
    """The function the tests register is the one flash_hub runs (so its calling code is what is tested)."""
    assert FLASH_HUB_FN.__name__ == "dense_fa2"
    assert registry.get("flash_hub").hub.function == "flash_attn_func"


# --------------------------------------------------------------------------------------- the trust matrix

def expected_allowed(disable: bool, trust_env: bool, trusted: bool, scoped: bool) -> bool:
    return not disable and (trusted or trust_env or scoped)


def check_refusal_message(message: str, repo_id: str, disable: bool, trusted: bool, opted: bool) -> None:
    """Names every env var that stands in the way: DISABLE when set, and the opt-in while it is missing."""
    assert repo_id in message
    if disable:
        assert f"{DISABLE}=true forbids remote kernel code" in message
        assert f"unset {DISABLE}" in message
    if not trusted and not opted:
        assert f"{TRUST}=true" in message
        assert f"allow '{UNTRUSTED_ORG}' in a Trust Remote Kernels node" in message
    else:
        assert TRUST not in message


def expected_trust_reason(trust_env: bool, trusted: bool) -> str:
    if trusted:
        return f"'{TRUSTED_ORG}' is a trusted kernel publisher"
    if trust_env:
        return f"{TRUST}=true trusts '{UNTRUSTED_ORG}'"
    return f"a Trust Remote Kernels scope allows '{UNTRUSTED_ORG}'"


MATRIX = [(d, t, p, s) for d in (False, True) for t in (False, True) for p in (True, False) for s in (False, True)]


def matrix_id(case) -> str:
    d, t, p, s = case
    return "-".join([f"disable={int(d)}", f"trust={int(t)}", TRUSTED_ORG if p else UNTRUSTED_ORG,
                     "scope" if s else "noscope"])


@pytest.mark.parametrize("case", MATRIX, ids=[matrix_id(c) for c in MATRIX])
def test_trust_matrix_local_kernels(case, monkeypatch, tmp_path, qkv, spy):
    """HF_HUB_OFFLINE unset, kernels found through LOCAL_KERNELS (which `kernels` never trust-checks)."""
    disable, trust_env, trusted, scoped = case
    repo_id = f"{TRUSTED_ORG if trusted else UNTRUSTED_ORG}/attn-matrix"
    repo = kr.make_local_repo(tmp_path, repo_id)
    use_local(monkeypatch, repo)
    if disable:
        monkeypatch.setenv(DISABLE, "true")
    if trust_env:
        monkeypatch.setenv(TRUST, "true")
    register("matrix_hub", repo_id)
    q, k, v = qkv
    allowed = expected_allowed(disable, trust_env, trusted, scoped)

    scope = dispatcher.trusted_publishers([UNTRUSTED_ORG]) if scoped else contextlib.nullcontext()
    recorder = dispatcher.Recorder()
    with scope, dispatcher.recording(recorder):
        reasons = dispatcher.availability_reasons("matrix_hub")
        out = dispatcher.dispatch_attention_fn(q, k, v, backend="matrix_hub")
        if allowed:
            fn, record = hub.load(registry.get("matrix_hub").hub)
        else:
            with pytest.raises(dispatcher.KernelLoadError) as info:
                hub.load(registry.get("matrix_hub").hub)
    served = recorder.snapshot()["rows"][0]
    torch.testing.assert_close(out, reference(q, k, v), atol=1e-5, rtol=1e-5)
    if allowed:
        assert reasons == []
        assert served["served"] == "matrix_hub" and not served["fell_back"]
        assert len(calls_of(repo)) == 1 and calls_of(repo)[0]["shape"] == (2, 16, 4, 32)
        assert record.trust == expected_trust_reason(trust_env, trusted)
        assert record.source == "local" and record.revision is None and not record.from_lock
        assert record.path == str(repo.variant_dir / "attn_matrix")
        assert record.repo_id == repo_id and record.version == 1 and record.function == "flash_attn_func"
        assert [k.as_dict() for k in dispatcher.loaded_kernels()] == [record.as_dict()]
        # kernels>=0.17 is told to trust exactly this repo (its allowlist) when a user opted in to the publisher, and
        # nothing for a trusted publisher alone: online, kernels then asks the Hub about it too
        assert len(spy) == 1
        opted = trust_env or (scoped and not trusted)  # the scope names the untrusted publisher only
        assert spy[0] == (repo_id, {"version": 1, **({"trust_remote_code": [repo_id]} if opted else {})})
    else:
        assert len(reasons) == 1
        check_refusal_message(reasons[0], repo_id, disable, trusted, trust_env or scoped)
        check_refusal_message(str(info.value), repo_id, disable, trusted, trust_env or scoped)
        assert served["served"] == "native" and served["fell_back"]
        assert any(repo_id in r and (DISABLE if disable else TRUST) in r for r in served["reasons"])
        assert spy == [], "a refused kernel must never reach the kernels library"
        assert repo.kernel_id not in sys.modules, "a refused kernel's code must never run"
        assert dispatcher.loaded_kernels() == []


# ------------------------------------------------------------------ the same matrix offline, in a subprocess

def _run_subprocess(config: dict, tmp: Path, extra_env: dict) -> tuple[dict, str]:
    config_path = tmp / f"config-{len(list(tmp.glob('config-*')))}.json"
    config_path.write_text(json.dumps(config))
    child_env = {k: v for k, v in os.environ.items()
                 if k not in HUB_VARS + ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "HF_HOME", "KERNELS_CACHE", "HF_ENDPOINT",
                                         "HF_HUB_DISABLE_TELEMETRY", "DIFFUSERS_ATTN_BACKEND", "DIFFUSERS_ATTN_CHECKS")}
    # HF_HUB_DISABLE_TELEMETRY stays unset: with it, kernels 0.17 sends huggingface_hub 2.x an invalid User-Agent
    child_env.update({env.KERNEL_LOCK: str(tmp / "no-such-lock.json"), **extra_env})
    proc = subprocess.run([sys.executable, str(Path(kr.__file__)), str(config_path)], cwd=ROOT, env=child_env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")][-1]
    return json.loads(line[len("RESULTS "):]), proc.stderr


def _offline_case(case) -> dict:
    disable, trust_env, trusted, scoped = case
    index = MATRIX.index(case)
    repo_id = f"{TRUSTED_ORG if trusted else UNTRUSTED_ORG}/attn-offline-{index}"
    env_vars = {**({DISABLE: "true"} if disable else {}), **({TRUST: "true"} if trust_env else {})}
    return {"id": matrix_id(case), "backend": f"offline_{index}", "repo_id": repo_id, "env": env_vars,
            "scope": [UNTRUSTED_ORG] if scoped else None, "dispatch": True}


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory):
    """One interpreter with HF_HUB_CACHE + HF_HUB_OFFLINE=1 set before import runs every offline case."""
    tmp = tmp_path_factory.mktemp("offline")
    cache = tmp / "hub-cache"
    cases, backends, repos = [], [], {}
    for case in MATRIX:
        spec = _offline_case(case)
        repo = kr.make_cache_repo(cache, spec["repo_id"])
        repos[spec["id"]] = repo
        spec["kernel_id"] = repo.kernel_id
        cases.append(spec)
        backends.append({"name": spec["backend"], "repo_id": spec["repo_id"], "version": 1})

    # Lock-file cases: the lock pins an older snapshot than refs/v1 points at.
    lock_repo_id = f"{UNTRUSTED_ORG}/attn-locked"
    old = kr.make_cache_repo(cache, lock_repo_id, version=None, label="old-build")
    new = kr.make_cache_repo(cache, lock_repo_id, version=1, label="new-build")
    good_lock = kr.write_lock(tmp / "good.lock.json", [{"repo_id": lock_repo_id, "version": 1, "revision": old.commit}])
    missing = "f" * 40
    bad_lock = kr.write_lock(tmp / "missing.lock.json", [{"repo_id": lock_repo_id, "version": 1, "revision": missing}])
    backends += [{"name": "locked_hub", "repo_id": lock_repo_id, "version": 1},
                 {"name": "ref_hub", "repo_id": lock_repo_id, "version": None, "revision": "v1"}]
    trust_on = {TRUST: "true"}
    cases += [
        {"id": "unlocked", "backend": "locked_hub", "repo_id": lock_repo_id, "env": trust_on, "dispatch": True},
        {"id": "locked", "backend": "locked_hub", "repo_id": lock_repo_id, "dispatch": True,
         "env": {**trust_on, env.KERNEL_LOCK: str(good_lock)}},
        {"id": "locked-missing", "backend": "locked_hub", "repo_id": lock_repo_id, "dispatch": True,
         "env": {**trust_on, env.KERNEL_LOCK: str(bad_lock)}},
        {"id": "locked-missing-strict", "backend": "locked_hub", "repo_id": lock_repo_id, "dispatch": True,
         "policy": "strict", "env": {**trust_on, env.KERNEL_LOCK: str(bad_lock)}},
        {"id": "ref-v1", "backend": "ref_hub", "repo_id": lock_repo_id, "env": trust_on, "dispatch": True},
        {"id": "locked-refused", "backend": "locked_hub", "repo_id": lock_repo_id, "dispatch": False,
         "env": {env.KERNEL_LOCK: str(good_lock)}},
    ]
    # A kernel that is not in the cache at all, and a corrupted download.
    broken = kr.make_cache_repo(cache, f"{TRUSTED_ORG}/attn-broken", broken="import")
    backends += [{"name": "missing_hub", "repo_id": f"{TRUSTED_ORG}/attn-not-downloaded", "version": 1},
                 {"name": "broken_hub", "repo_id": broken.repo_id, "version": 1}]
    cases += [{"id": "missing", "backend": "missing_hub", "repo_id": f"{TRUSTED_ORG}/attn-not-downloaded",
               "dispatch": True},
              {"id": "broken", "backend": "broken_hub", "repo_id": broken.repo_id, "dispatch": True}]
    data, stderr = _run_subprocess({"backends": backends, "cases": cases}, tmp,
                                   {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"})
    results = {r["id"]: r for r in data["results"]}
    return {"data": data, "stderr": stderr, "results": results, "repos": repos, "cases": {c["id"]: c for c in cases},
            "old": old, "new": new, "missing_rev": missing, "good_lock": good_lock, "bad_lock": bad_lock,
            "cache": cache}


def test_offline_subprocess_really_offline(offline_run):
    data = offline_run["data"]
    assert data["offline"] is True and data["cache"] == str(offline_run["cache"])
    assert data["kernels"] == kernels.__version__


@pytest.mark.parametrize("case", MATRIX, ids=[matrix_id(c) for c in MATRIX])
def test_trust_matrix_offline_cache(case, offline_run):
    """HF_HUB_OFFLINE=1: `kernels` skips its own publisher check (with a warning); ours still holds."""
    disable, trust_env, trusted, scoped = case
    spec = _offline_case(case)
    result, repo = offline_run["results"][spec["id"]], offline_run["repos"][spec["id"]]
    repo_id = spec["repo_id"]
    skip_warning = f"Skipping publisher trust check for '{repo_id}' because Hugging Face Hub is in offline mode"
    assert result["max_error"] is not None and result["max_error"] < 1e-5  # served by the kernel or by native
    if expected_allowed(disable, trust_env, trusted, scoped):
        assert result["loaded"], result["error"]
        record = result["record"]
        assert record["trust"] == expected_trust_reason(trust_env, trusted)
        assert record["revision"] == repo.commit, "an offline load records the snapshot commit it loaded"
        assert record["source"] == "cache" and not record["from_lock"]
        assert record["path"] == str(repo.variant_dir / python_name(repo_id))
        assert result["tag"] == repo.tag
        assert result["reasons"] == [] and result["served"] == spec["backend"] and result["imported"]
        # kernels' own check: skipped (with a warning) for the trusted publisher, which we load without
        # trust_remote_code; bypassed for an opted-in publisher, whose repo we name in its allowlist
        assert (skip_warning in offline_run["stderr"]) == (trusted and not trust_env)  # the scope: someorg only
    else:
        assert not result["loaded"]
        check_refusal_message(result["error"], repo_id, disable, trusted, trust_env or scoped)
        assert len(result["reasons"]) == 1
        check_refusal_message(result["reasons"][0], repo_id, disable, trusted, trust_env or scoped)
        assert result["served"] == "native"
        assert any(repo_id in r for r in result["fallback_reasons"])
        assert skip_warning not in offline_run["stderr"], "a refused kernel must never reach the kernels library"
        assert not result["imported"], "a refused kernel's code must never run"


def python_name(repo_id: str) -> str:
    return kr.python_name(repo_id.split("/", 1)[1])


def test_offline_lock_round_trip(offline_run):
    """A lock naming a revision in the offline cache loads exactly that revision, not refs/v1's."""
    unlocked, locked = offline_run["results"]["unlocked"], offline_run["results"]["locked"]
    old, new = offline_run["old"], offline_run["new"]
    assert unlocked["loaded"] and unlocked["record"]["revision"] == new.commit and unlocked["tag"] == new.tag
    assert not unlocked["record"]["from_lock"]
    assert locked["loaded"], locked["error"]
    record = locked["record"]
    assert record["revision"] == old.commit and record["from_lock"] is True and record["source"] == "cache"
    assert locked["tag"] == old.tag and record["path"].startswith(str(old.path))
    assert locked["served"] == "locked_hub" and locked["max_error"] < 1e-5
    # the lock written by the helper reads back through the dispatcher's reader
    entries = hub.read_lock(offline_run["good_lock"])
    assert entries[old.repo_id]["revision"] == old.commit and entries[old.repo_id]["variant"] == kr.VARIANT


def test_offline_revision_ref_records_commit(offline_run):
    """HubKernel(revision="v1") offline: the record names the commit refs/v1 resolved to, not "v1"."""
    result = offline_run["results"]["ref-v1"]
    assert result["loaded"], result["error"]
    assert result["record"]["revision"] == offline_run["new"].commit and result["record"]["version"] is None
    assert result["served"] == "ref_hub"


def test_offline_lock_missing_revision(offline_run):
    result, strict = offline_run["results"]["locked-missing"], offline_run["results"]["locked-missing-strict"]
    missing = offline_run["missing_rev"]
    assert not result["loaded"] and result["error_type"] == "HubUnreachableError"  # offline, and not in the cache
    message = result["error"]
    assert offline_run["old"].repo_id in message and missing in message
    assert str(offline_run["bad_lock"]) in message and "install.py" in message
    assert "HF_HUB_OFFLINE=1 and it is not in the local kernel cache" in message
    assert result["served"] == "native" and any(missing in r for r in result["fallback_reasons"])
    assert strict["served"] is None and strict["dispatch_error"].startswith("BackendNotSupportedError")
    assert missing in strict["dispatch_error"]


def test_offline_lock_does_not_bypass_trust(offline_run):
    result = offline_run["results"]["locked-refused"]
    assert not result["loaded"] and f"{TRUST}=true" in result["error"]


def test_offline_missing_and_broken(offline_run):
    missing, broken = offline_run["results"]["missing"], offline_run["results"]["broken"]
    assert not missing["loaded"] and missing["error_type"] == "HubUnreachableError"  # offline by choice: no failure
    assert f"could not load '{TRUSTED_ORG}/attn-not-downloaded' (version 1)" in missing["error"]
    assert "HF_HUB_OFFLINE=1 and it is not in the local kernel cache" in missing["error"]
    assert "python install.py" in missing["error"] and "revision=<commit>" not in missing["error"]  # not kernels' words
    assert broken["error_type"] == "KernelLoadError"
    assert missing["served"] == "native"
    assert not broken["loaded"] and "this kernel download is corrupted" in broken["error"]
    assert broken["served"] == "native" and any("corrupted" in r for r in broken["fallback_reasons"])


def test_kernels_cache_env(tmp_path):
    """KERNELS_CACHE (read by kernels at import) is honoured instead of HF_HUB_CACHE."""
    cache = tmp_path / "kernels-cache"
    repo = kr.make_cache_repo(cache, f"{TRUSTED_ORG}/attn-kc")
    config = {"backends": [{"name": "kc_hub", "repo_id": repo.repo_id, "version": 1}],
              "cases": [{"id": "kc", "backend": "kc_hub", "repo_id": repo.repo_id, "dispatch": True}]}
    data, _ = _run_subprocess(config, tmp_path, {"KERNELS_CACHE": str(cache), "HF_HUB_CACHE": str(tmp_path / "empty"),
                                                 "HF_HUB_OFFLINE": "1"})
    result = data["results"][0]
    assert result["loaded"], result["error"]
    assert result["record"]["revision"] == repo.commit and result["served"] == "kc_hub"


# ------------------------------------------------ kernels' own publisher check: no network, and what the Hub says

# kernels >= 0.14 asks the Hub whether a repo's publisher is a trusted kernel publisher before it reads anything, the
# cache included, unless HF_HUB_OFFLINE=1 or trust_remote_code names the repo. Without network that question
# fails, and kernels refused every Hub kernel (issue 37, on the H200). The pack passes it its allowlist for the repos
# the pack trusts only where kernels cannot ask, and then reads the cache alone.
KERNELS_CANNOT_VERIFY = "could not verify publisher trust status"
KERNELS_SKIPS = "Skipping publisher trust check"


def _nonet_cases(cache: Path) -> tuple[list, list, dict]:
    """Cases for an interpreter whose Hub cannot be reached, HF_HUB_OFFLINE unset, kernels in `cache`."""
    repos = {}
    for key, repo_id, extra in [("trusted", f"{TRUSTED_ORG}/attn-nonet", {}),
                                ("opt-in", f"{UNTRUSTED_ORG}/attn-nonet-env", {}),
                                ("scope", f"{UNTRUSTED_ORG}/attn-nonet-scope", {}),
                                ("untrusted", f"{UNTRUSTED_ORG}/attn-nonet-refused", {}),
                                ("disabled", f"{TRUSTED_ORG}/attn-nonet-disabled", {}),
                                ("broken", f"{TRUSTED_ORG}/attn-nonet-broken", {"broken": "import"}),
                                ("pinned", f"{TRUSTED_ORG}/attn-nonet-pinned", {"version": None})]:
        repos[key] = kr.make_cache_repo(cache, repo_id, **extra)
    missing = f"{TRUSTED_ORG}/attn-nonet-not-downloaded"
    backends = [{"name": f"nonet_{k.replace('-', '_')}", "repo_id": r.repo_id, "version": 1} for k, r in repos.items()
                if k != "pinned"]
    backends += [{"name": "nonet_pinned", "repo_id": repos["pinned"].repo_id, "version": None,
                  "revision": repos["pinned"].commit},
                 {"name": "nonet_missing", "repo_id": missing, "version": 1}]
    env_of = {"opt-in": {TRUST: "true"}, "disabled": {DISABLE: "true", TRUST: "true"}}
    cases = [{"id": k, "backend": f"nonet_{k.replace('-', '_')}", "repo_id": r.repo_id, "kernel_id": r.kernel_id,
              "env": env_of.get(k, {}), "scope": [UNTRUSTED_ORG] if k == "scope" else None, "dispatch": True}
             for k, r in repos.items()]
    cases += [{"id": "missing", "backend": "nonet_missing", "repo_id": missing, "dispatch": True},
              {"id": "missing-strict", "backend": "nonet_missing", "repo_id": missing, "dispatch": True,
               "policy": "strict"}]
    return backends, cases, repos


@pytest.fixture(scope="module")
def nonet_run(tmp_path_factory):
    """One interpreter whose Hub endpoint refuses every connection (a machine without network), HF_HUB_OFFLINE
    unset, with kernels already in its HF cache: what the H200 of issue 37 had, plus a cache."""
    tmp = tmp_path_factory.mktemp("nonet")
    backends, cases, repos = _nonet_cases(tmp / "hub-cache")
    data, stderr = _run_subprocess({"backends": backends, "cases": cases}, tmp,
                                   {"HF_HUB_CACHE": str(tmp / "hub-cache"), "HF_ENDPOINT": dead_endpoint()})
    return {"data": data, "stderr": stderr, "results": {r["id"]: r for r in data["results"]}, "repos": repos}


def test_no_network_subprocess_is_online_mode(nonet_run):
    assert nonet_run["data"]["offline"] is False and nonet_run["data"]["kernels"] == kernels.__version__


@pytest.mark.parametrize("key", ["trusted", "opt-in", "scope", "pinned"])
def test_no_network_loads_a_cached_kernel_the_pack_trusts(key, nonet_run):
    """Before: kernels' `could not verify publisher trust status` for every one (it asks the Hub first). Now the
    cache's build loads, recorded as read from the cache, and the trust record says the Hub could not confirm it."""
    result, repo = nonet_run["results"][key], nonet_run["repos"][key]
    assert result["loaded"], result["error"]
    record = result["record"]
    assert record["source"] == "cache" and record["revision"] == repo.commit
    assert record["path"] == str(repo.variant_dir / python_name(repo.repo_id))
    assert "the Hugging Face Hub could not be reached" in record["trust"]
    assert record["trust"].startswith({"trusted": f"'{TRUSTED_ORG}' is a trusted kernel publisher",
                                       "opt-in": f"{TRUST}=true trusts '{UNTRUSTED_ORG}'",
                                       "scope": f"a Trust Remote Kernels scope allows '{UNTRUSTED_ORG}'",
                                       "pinned": f"'{TRUSTED_ORG}' is a trusted kernel publisher"}[key])
    assert result["tag"] == repo.tag
    assert result["served"] == f"nonet_{key.replace('-', '_')}" and result["max_error"] < 1e-5
    stderr = nonet_run["stderr"]
    assert f"cannot reach the Hugging Face Hub to confirm the publisher of '{repo.repo_id}'" in stderr
    # the pack named the repo to kernels (its allowlist): kernels neither refused nor skipped its check
    assert KERNELS_CANNOT_VERIFY not in stderr and f"{KERNELS_SKIPS} for '{repo.repo_id}'" not in stderr


@pytest.mark.parametrize("key", ["untrusted", "disabled"])
def test_no_network_never_reads_the_cache_for_a_kernel_the_pack_refuses(key, nonet_run):
    result, repo = nonet_run["results"][key], nonet_run["repos"][key]
    assert not result["loaded"] and not result["imported"], "a refused kernel's code must never run"
    assert (f"{DISABLE}=true forbids remote kernel code" if key == "disabled"
            else f"'{repo.repo_id}' is not published by a trusted kernel publisher") in result["error"]
    assert result["served"] == "native"


def test_no_network_and_not_cached_says_no_network(nonet_run):
    """Not in the cache and no Hub: HubUnreachableError (the GPU tests skip on it), in the pack's words, never
    kernels' advice to pass trust_remote_code (which is no setting of the pack)."""
    result, strict = nonet_run["results"]["missing"], nonet_run["results"]["missing-strict"]
    message = result["error"]
    assert result["error_type"] == "HubUnreachableError", message
    assert message.startswith(f"could not load '{TRUSTED_ORG}/attn-nonet-not-downloaded' (version 1): ")
    assert "no network here? the Hugging Face Hub cannot be reached" in message
    assert "ConnectError" in message and "not in the local kernel cache" in message and "python install.py" in message
    assert "trust_remote_code" not in message and "untrusted" not in message
    assert result["served"] == "native" and any("cannot be reached" in r for r in result["fallback_reasons"])
    assert strict["dispatch_error"].startswith("BackendNotSupportedError") and "cannot be reached" in \
        strict["dispatch_error"]


def test_no_network_broken_cached_kernel_is_a_failure_not_the_network(nonet_run):
    result = nonet_run["results"]["broken"]
    assert not result["loaded"] and result["error_type"] == "KernelLoadError"
    assert "this kernel download is corrupted" in result["error"] and "from the local cache" in result["error"]


@pytest.fixture(scope="module")
def hub_says_run(tmp_path_factory):
    """One interpreter against a fake Hub that answers kernels' publisher question as each case sets it."""
    from helpers.fake_hub import FakeHub
    tmp = tmp_path_factory.mktemp("hub-says")
    fake = FakeHub().start()
    repos, commits = {}, {}
    for key, repo_id in [("listed", f"{TRUSTED_ORG}/attn-says-listed"), ("revoked", f"{TRUSTED_ORG}/attn-says-revoked"),
                         ("revoked-opt-in", f"{TRUSTED_ORG}/attn-says-opted"),
                         ("unknown", f"{TRUSTED_ORG}/attn-says-unknown"), ("token", f"{TRUSTED_ORG}/attn-says-token"),
                         ("opt-in", f"{UNTRUSTED_ORG}/attn-says-opt-in")]:
        repos[key] = kr.make_local_repo(tmp / "repos", repo_id)
        commits[key] = fake.add_version(repo_id, 1, repos[key].path)
    orgs = {"listed": {TRUSTED_ORG: "trusted"}, "revoked": {TRUSTED_ORG: "untrusted"},
            "revoked-opt-in": {TRUSTED_ORG: "untrusted"}, "unknown": {TRUSTED_ORG: "unknown"},
            "token": {TRUSTED_ORG: "401"}, "opt-in": {UNTRUSTED_ORG: "untrusted"}}
    backends = [{"name": f"says_{k.replace('-', '_')}", "repo_id": r.repo_id, "version": 1} for k, r in repos.items()]
    cases = [{"id": k, "backend": f"says_{k.replace('-', '_')}", "repo_id": r.repo_id, "kernel_id": r.kernel_id,
              "orgs": orgs[k], "env": {TRUST: "true"} if k == "revoked-opt-in" else {},
              "scope": [UNTRUSTED_ORG] if k == "opt-in" else None, "dispatch": True} for k, r in repos.items()]
    try:
        data, stderr = _run_subprocess({"backends": backends, "cases": cases, "fake_hub": True}, tmp,
                                       {"HF_HUB_CACHE": str(tmp / "hub-cache"), "HF_ENDPOINT": fake.url})
        requests = fake.requests_by_step()
    finally:
        fake.stop()
    return {"results": {r["id"]: r for r in data["results"]}, "stderr": stderr, "requests": requests,
            "repos": repos, "commits": commits}


def _asked_publisher(run, key, org) -> bool:
    return any(path == f"/api/organizations/{org}/overview" for _, path in run["requests"][key])


def test_online_both_checks_hold_for_a_trusted_publisher(hub_says_run):
    """Online, the pack's trusted publisher is still asked of the Hub by kernels (no allowlist is passed): the
    kernel loads from the Hub only when both say yes."""
    result = hub_says_run["results"]["listed"]
    assert result["loaded"], result["error"]
    assert result["record"]["source"] == "hub" and result["record"]["revision"] == hub_says_run["commits"]["listed"]
    assert result["record"]["trust"] == f"'{TRUSTED_ORG}' is a trusted kernel publisher"
    assert _asked_publisher(hub_says_run, "listed", TRUSTED_ORG)


def test_online_the_hub_not_listing_the_publisher_refuses_in_the_packs_words(hub_says_run):
    """The Hub says the publisher is not a trusted kernel publisher: refused before any download, and the reason is
    the pack's sentence with its fix (the opt-in), not kernels' advice to pass trust_remote_code."""
    result, repo = hub_says_run["results"]["revoked"], hub_says_run["repos"]["revoked"]
    assert not result["loaded"] and not result["imported"]
    message = result["error"]
    assert result["error_type"] == "KernelLoadError"
    assert f"the Hugging Face Hub does not list '{TRUSTED_ORG}' as a trusted kernel publisher" in message
    assert f"{TRUST}=true" in message and f"allow '{TRUSTED_ORG}' in a Trust Remote Kernels node" in message
    assert "trust_remote_code" not in message and "cannot be reached" not in message
    assert not any("/resolve/" in path for _, path in hub_says_run["requests"]["revoked"]), "nothing downloaded"
    assert result["served"] == "native" and any("does not list" in r for r in result["fallback_reasons"])


def test_online_an_explicit_opt_in_reaches_kernels_as_its_allowlist(hub_says_run):
    """An opt-in (env or Trust Remote Kernels scope) is passed on: kernels loads the repo without asking the Hub,
    whatever the Hub says of its publisher."""
    for key, org in (("revoked-opt-in", TRUSTED_ORG), ("opt-in", UNTRUSTED_ORG)):
        result = hub_says_run["results"][key]
        assert result["loaded"], result["error"]
        assert result["record"]["source"] == "hub" and result["served"] == f"says_{key.replace('-', '_')}"
        assert not _asked_publisher(hub_says_run, key, org)


def test_online_an_unanswered_publisher_question_is_not_called_untrusted(hub_says_run):
    """The Hub answers, but not whether the publisher is trusted (404; 401 for a bad token): the pack says the Hub
    could not confirm it (or that the token was refused), never that the publisher is untrusted or the network gone."""
    unknown, token = hub_says_run["results"]["unknown"], hub_says_run["results"]["token"]
    assert not unknown["loaded"] and not unknown["imported"]
    assert (f"could not confirm with the Hugging Face Hub that '{TRUSTED_ORG}' is a trusted kernel publisher"
            in unknown["error"])
    assert "404" in unknown["error"] and "cannot be reached" not in unknown["error"]
    assert "does not list" not in unknown["error"] and unknown["error_type"] == "KernelLoadError"
    assert not token["loaded"] and not token["imported"]
    if at_least(kernels.__version__, "0.19"):  # kernels 0.19+ re-raises a 401 as such
        assert "rejected your token" in token["error"] and "hf auth login" in token["error"]
        assert "HF_TOKEN" in token["error"] and "could not confirm" not in token["error"]
    else:  # kernels 0.17/0.18: any failure of the question is "could not verify"
        assert "could not confirm" in token["error"] and "401" in token["error"]


def test_install_py_says_kernels_refusal_in_the_packs_words(tmp_path):
    """install.py (dispatcher.tools.fetch) against a Hub that does not list the publisher: refused in the pack's
    words, and fetched once the user opts in (the opt-in reaches kernels as its allowlist)."""
    from helpers.fake_hub import FakeHub
    fake = FakeHub().start()
    fake.add_org(TRUSTED_ORG, trusted=False)
    repo = kr.make_local_repo(tmp_path / "repos", f"{TRUSTED_ORG}/attn-fetch-unlisted")
    commit = fake.add_version(repo.repo_id, 1, repo.path)
    only = ["--json", "--only", "unlisted_hub"]
    config = {"backends": [{"name": "unlisted_hub", "repo_id": repo.repo_id, "version": 1}],
              "steps": [{"id": "plain", "argv": only}, {"id": "opt-in", "argv": only, "env": {TRUST: "true"}}]}
    (tmp_path / "install.json").write_text(json.dumps(config))
    child_env = {k: v for k, v in os.environ.items()
                 if k not in HUB_VARS + ("HF_HUB_OFFLINE", "HF_HOME", "HF_HUB_DISABLE_TELEMETRY")}
    child_env.update({"HF_ENDPOINT": fake.url, "HF_HUB_CACHE": str(tmp_path / "cache"),
                      env.KERNEL_LOCK: str(tmp_path / "kernels.lock.json")})
    try:
        proc = subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "install_runner.py"),
                               str(tmp_path / "install.json")], cwd=ROOT, env=child_env, capture_output=True,
                              text=True, timeout=300)
    finally:
        fake.stop()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = {s["id"]: s for s in json.loads(proc.stdout.split("RESULTS ", 1)[1])}
    (plain,) = json.loads(steps["plain"]["stdout"])["fetch"]
    assert plain["status"] == "refused", plain
    assert f"the Hugging Face Hub does not list '{TRUSTED_ORG}' as a trusted kernel publisher" in plain["message"]
    assert f"{TRUST}=true" in plain["message"] and "trust_remote_code" not in plain["message"]
    (opted,) = json.loads(steps["opt-in"]["stdout"])["fetch"]
    assert opted["status"] == "fetched" and opted["revision"] == commit, opted


def test_gpu_tests_skip_for_want_of_network_and_fail_for_anything_else(monkeypatch, tmp_path):
    """tests/gpu loads each Hub backend's kernel through `load_or_skip_without_network` first: a kernel that is not in
    the cache where the Hub cannot be reached (HF_HUB_OFFLINE here: no network in CI is not guaranteed) skips with
    "no network here"; a broken kernel raises, and so fails its GPU test."""
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # kernels and the pack read it per call
    monkeypatch.setenv("KERNELS_CACHE", str(tmp_path / "empty-cache"))  # kernels 0.19 reads it per call
    register("absent_gpu_hub", f"{TRUSTED_ORG}/attn-not-fetched-anywhere")
    with pytest.raises(pytest.skip.Exception, match=r"^no network here: could not load .*not in the local kernel"):
        kr.load_or_skip_without_network(registry.get("absent_gpu_hub"))
    broken = kr.make_local_repo(tmp_path, f"{TRUSTED_ORG}/attn-gpu-broken", broken="import")
    use_local(monkeypatch, broken)
    register("broken_gpu_hub", broken.repo_id)
    with pytest.raises(dispatcher.KernelLoadError, match="this kernel download is corrupted"):
        kr.load_or_skip_without_network(registry.get("broken_gpu_hub"))
    kr.load_or_skip_without_network(registry.get("native"))  # no Hub kernel: nothing to load


# ------------------------------------------------------------------------------------- trust details in process

def test_local_kernels_read_per_call(monkeypatch, tmp_path):
    """kernels reads LOCAL_KERNELS on each get_kernel call, so setting it after import works."""
    first = kr.make_local_repo(tmp_path / "a", f"{UNTRUSTED_ORG}/attn-one")
    second = kr.make_local_repo(tmp_path / "b", f"{UNTRUSTED_ORG}/attn-two")
    monkeypatch.setenv(TRUST, "1")
    register("one_hub", first.repo_id)
    register("two_hub", second.repo_id)
    use_local(monkeypatch, first)
    assert hub.load(registry.get("one_hub").hub)[1].path.startswith(str(first.path))
    use_local(monkeypatch, second)
    assert hub.load(registry.get("two_hub").hub)[1].path.startswith(str(second.path))


@pytest.mark.parametrize("value, allowed", [("true", True), ("1", True), ("YES", True), (" on ", True),
                                            ("false", False), ("0", False), ("", False), ("no", False)])
def test_trust_env_values(value, allowed, monkeypatch):
    monkeypatch.setenv(TRUST, value)
    assert trust.decide(f"{UNTRUSTED_ORG}/x").allowed is allowed
    monkeypatch.delenv(TRUST)
    monkeypatch.setenv(DISABLE, value)
    assert trust.decide(f"{TRUSTED_ORG}/x").allowed is (not allowed)


def test_disable_wins_over_everything(monkeypatch):
    monkeypatch.setenv(DISABLE, "true")
    monkeypatch.setenv(TRUST, "true")
    with dispatcher.trusted_publishers([UNTRUSTED_ORG, TRUSTED_ORG]):
        for repo_id in (f"{UNTRUSTED_ORG}/x", f"{TRUSTED_ORG}/x"):
            decision = trust.decide(repo_id)
            assert not decision.allowed and f"unset {DISABLE}" in decision.reason
            assert TRUST not in decision.reason  # the opt-in is already there: only DISABLE stands in the way


def test_disable_refusal_names_both_vars_for_untrusted(monkeypatch):
    monkeypatch.setenv(DISABLE, "yes")
    reason = trust.decide(f"{UNTRUSTED_ORG}/x").reason
    assert f"unset {DISABLE}" in reason and f"{TRUST}=true" in reason


def test_scope_is_scoped(monkeypatch, tmp_path, qkv):
    """A scope trusts only inside the block: a kernel loaded inside is refused again outside, and the
    cached dispatch decision made inside is not reused outside."""
    repo = kr.make_local_repo(tmp_path, f"{UNTRUSTED_ORG}/attn-scope")
    use_local(monkeypatch, repo)
    register("scope_hub", repo.repo_id)
    q, k, v = qkv
    recorder = dispatcher.Recorder()
    with dispatcher.recording(recorder):
        with dispatcher.trusted_publishers(UNTRUSTED_ORG):  # a plain string is one publisher
            dispatcher.dispatch_attention_fn(q, k, v, backend="scope_hub")
            assert hub.load(registry.get("scope_hub").hub)[1].trust.startswith("a Trust Remote Kernels scope")
        dispatcher.dispatch_attention_fn(q, k, v, backend="scope_hub")
        with pytest.raises(dispatcher.KernelLoadError, match=TRUST):
            hub.load(registry.get("scope_hub").hub)  # cached, but trust is decided first
    served = {row["served"]: row["calls"] for row in recorder.snapshot()["rows"]}
    assert served == {"scope_hub": 1, "native": 1}
    assert len(calls_of(repo)) == 1


def test_scope_does_not_leak_to_other_threads():
    seen = {}
    with dispatcher.trusted_publishers([UNTRUSTED_ORG]):
        assert trust.decide(f"{UNTRUSTED_ORG}/x").allowed
        thread = threading.Thread(target=lambda: seen.setdefault("allowed", trust.decide(f"{UNTRUSTED_ORG}/x").allowed))
        thread.start()
        thread.join()
    assert seen["allowed"] is False
    assert not trust.decide(f"{UNTRUSTED_ORG}/x").allowed


def test_scope_string_is_not_split_into_letters():
    with dispatcher.trusted_publishers("someorg, otherorg") as names:
        assert names == frozenset({"someorg", "otherorg"})
        assert trust.decide("s/x").allowed is False
        assert trust.decide("otherorg/x").allowed
    with dispatcher.trusted_publishers(["", "  "]) as names:
        assert names == frozenset()


def test_scope_key_tracks_trust_inputs(monkeypatch):
    base = trust.scope_key()
    with dispatcher.trusted_publishers(["a"]):
        assert trust.scope_key() != base
    monkeypatch.setenv(TRUST, "true")
    assert trust.scope_key() != base
    monkeypatch.setenv(DISABLE, "true")
    assert trust.scope_key() != base


@settings(max_examples=200, deadline=None)
@given(publisher=st.sampled_from([TRUSTED_ORG, UNTRUSTED_ORG, "kernels-communityx", "Kernels-Community", "x"]),
       disable=st.sampled_from([None, "true", "1", "0", "false"]),
       trust_value=st.sampled_from([None, "true", "on", "", "no"]),
       scope=st.lists(st.sampled_from([UNTRUSTED_ORG, "x", "other", TRUSTED_ORG]), max_size=3))
def test_decide_property(publisher, disable, trust_value, scope):
    """allowed == not disabled and (trusted publisher or opted in); every refusal names a var that helps."""
    saved = {var: os.environ.get(var) for var in (DISABLE, TRUST)}
    try:
        for var, value in ((DISABLE, disable), (TRUST, trust_value)):
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
        with dispatcher.trusted_publishers(scope):
            decision = trust.decide(f"{publisher}/kernel")
        disabled = env.flag(DISABLE)
        trusted = publisher == TRUSTED_ORG  # exact match: look-alike orgs are not trusted
        opted = env.flag(TRUST) or publisher in scope
        assert decision.allowed == (not disabled and (trusted or opted))
        assert decision.opt_in == (decision.allowed and opted)  # what kernels is told: the user's opt-in only
        if not decision.allowed:
            assert (DISABLE if disabled else TRUST) in decision.reason
            if not trusted and not opted:
                assert TRUST in decision.reason
    finally:
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


# ------------------------------------------------------------------------------------- results of a real kernel

def test_kernel_results_match_sdpa(monkeypatch, tmp_path):
    """Causal, custom scale, GQA and LSE through flash.dense -> the loaded kernel, BSHD and BHSD."""
    repo = kr.make_local_repo(tmp_path, f"{TRUSTED_ORG}/attn-math")
    use_local(monkeypatch, repo)
    register("math_hub", repo.repo_id)
    torch.manual_seed(1)
    q = torch.randn(2, 12, 8, 16, dtype=torch.float64)
    k, v = torch.randn(2, 12, 2, 16, dtype=torch.float64), torch.randn(2, 12, 2, 16, dtype=torch.float64)
    with dispatcher.attention_backend("math_hub", policy="strict"):
        out, lse = dispatcher.dispatch_attention_fn(q, k, v, is_causal=True, scale=0.3, enable_gqa=True,
                                                    return_lse=True)
        out_bhsd = dispatcher.dispatch_attention_fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                    is_causal=True, scale=0.3, enable_gqa=True, layout="BHSD")
    kr_ = k.repeat_interleave(4, dim=2)
    vr = v.repeat_interleave(4, dim=2)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), kr_.transpose(1, 2), vr.transpose(1, 2), is_causal=True, scale=0.3).transpose(1, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kr_) * 0.3
    scores = scores.masked_fill(~torch.ones(12, 12, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(out_bhsd, expected.transpose(1, 2))
    assert lse.shape == (2, 12, 8) and lse.dtype == torch.float32  # (B, S, H) like every BSHD backend
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1).transpose(1, 2).float())
    assert {c["causal"] for c in calls_of(repo)} == {True} and {c["scale"] for c in calls_of(repo)} == {0.3}


def test_attention_backend_loads_eagerly(monkeypatch, tmp_path):
    repo = kr.make_local_repo(tmp_path, f"{TRUSTED_ORG}/attn-eager")
    use_local(monkeypatch, repo)
    register("eager_hub", repo.repo_id)
    with dispatcher.attention_backend("eager_hub"):
        assert [k.repo_id for k in dispatcher.loaded_kernels()] == [repo.repo_id]  # before any call
        assert calls_of(repo) == []
    statuses = {s.name: s for s in dispatcher.list_backends()}
    assert statuses["eager_hub"].available and statuses["eager_hub"].loaded[0]["repo_id"] == repo.repo_id


# ------------------------------------------------------------------------------ validation before any call

def test_attention_backend_refused_raises_before_any_call(monkeypatch, tmp_path, spy):
    repo = kr.make_local_repo(tmp_path, f"{UNTRUSTED_ORG}/attn-refused")
    use_local(monkeypatch, repo)
    register("refused_hub", repo.repo_id)
    with pytest.raises(dispatcher.BackendUnavailableError) as info:
        with dispatcher.attention_backend("refused_hub"):
            pytest.fail("the block must not run")
    assert TRUST in str(info.value) and repo.repo_id in str(info.value)
    assert info.value.name == "refused_hub"
    with pytest.raises(dispatcher.BackendUnavailableError, match=DISABLE):
        monkeypatch.setenv(DISABLE, "1")
        dispatcher.validate_backend("refused_hub")
    with pytest.raises(dispatcher.BackendUnavailableError, match=TRUST):
        dispatcher.set_attention_backend("refused_hub")
    assert spy == [] and repo.kernel_id not in sys.modules


def test_attention_backend_broken_kernel_raises_before_any_call(monkeypatch, tmp_path):
    repo = kr.make_local_repo(tmp_path, f"{TRUSTED_ORG}/attn-broken-eager", broken="import")
    use_local(monkeypatch, repo)
    register("broken_eager_hub", repo.repo_id)
    with pytest.raises(dispatcher.KernelLoadError, match="corrupted"):
        with dispatcher.attention_backend("broken_eager_hub"):
            pytest.fail("the block must not run")


# --------------------------------------------------------------------------- the kernels library itself

@pytest.mark.parametrize("version, hint", [
    (None, "pip install 'kernels>=0.12'"),
    ("0.11.0", "pip install 'kernels>=0.12' --upgrade"),
])
def test_kernels_missing_or_too_old(version, hint, monkeypatch, tmp_path, qkv, spy):
    repo = kr.make_local_repo(tmp_path, f"{TRUSTED_ORG}/attn-nolib")
    use_local(monkeypatch, repo)
    register("nolib_hub", repo.repo_id)
    machine = current_machine().with_packages(kernels=version)
    with use_machine(machine):
        with pytest.raises(dispatcher.KernelLoadError) as info:
            hub.load(registry.get("nolib_hub").hub)
        assert hint in str(info.value) and repo.repo_id in str(info.value)
        reasons = dispatcher.availability_reasons("nolib_hub", machine)
        assert any("kernels" in r and "pip install" in r for r in reasons), reasons
        assert any(r in str(info.value) for r in reasons), (reasons, str(info.value))  # the load says the same words
        with pytest.raises(dispatcher.BackendUnavailableError, match="pip install"):
            dispatcher.validate_backend("nolib_hub")
        recorder = dispatcher.Recorder()
        with dispatcher.recording(recorder):
            dispatcher.dispatch_attention_fn(*qkv, backend="nolib_hub")
        assert recorder.snapshot()["rows"][0]["served"] == "native"
    assert spy == []


def test_trust_checked_before_kernels_version(monkeypatch):
    """With kernels missing, an untrusted kernel is still explained by trust first (the rule holds for any kernels)."""
    register("order_hub", f"{UNTRUSTED_ORG}/attn-order")
    with use_machine(current_machine().with_packages(kernels=None)):
        with pytest.raises(dispatcher.KernelLoadError, match=TRUST):
            hub.load(registry.get("order_hub").hub)


def test_old_kernels_gets_no_trust_remote_code(monkeypatch, tmp_path, spy):
    """kernels 0.12/0.13 have no trust_remote_code (and no trust check): ours is the only gate there."""
    repo = kr.make_local_repo(tmp_path, f"{UNTRUSTED_ORG}/attn-old")
    use_local(monkeypatch, repo)
    register("old_hub", repo.repo_id)
    with use_machine(current_machine().with_packages(kernels="0.13.0")):
        with pytest.raises(dispatcher.KernelLoadError, match=TRUST):
            hub.load(registry.get("old_hub").hub)
        assert spy == []
        monkeypatch.setenv(TRUST, "true")
        _, record = hub.load(registry.get("old_hub").hub)
    assert spy == [(repo.repo_id, {"version": 1})]
    assert record.trust == f"{TRUST}=true trusts '{UNTRUSTED_ORG}'"


def test_online_record_uses_repo_info(monkeypatch, tmp_path):
    """A Hub download carries kernels' RepoInfo: recorded as source 'hub' (no network here, so the
    library's registry entry is given the RepoInfo a download would have)."""
    import dataclasses

    RepoInfo = kernels.RepoInfo  # exported at the top level by every kernels version that has it (0.16+)
    repo = kr.make_local_repo(tmp_path, f"{TRUSTED_ORG}/attn-online")
    use_local(monkeypatch, repo)
    register("online_hub", repo.repo_id)
    real = kernels.get_loaded_kernels

    def with_repo_info():
        return [dataclasses.replace(k, repo_info=RepoInfo(repo.repo_id, "c" * 40))
                if k.metadata.id == repo.kernel_id else k for k in real()]

    monkeypatch.setattr(kernels, "get_loaded_kernels", with_repo_info)
    _, record = hub.load(registry.get("online_hub").hub)
    assert record.source == "hub" and record.revision == "c" * 40


def test_kernels_import_failure(monkeypatch):
    register("noimport_hub", f"{TRUSTED_ORG}/attn-noimport")
    monkeypatch.setitem(sys.modules, "kernels", None)  # installed per metadata, but `import kernels` fails
    with pytest.raises(dispatcher.KernelLoadError, match="kernels library fails to import.*pip install --upgrade"):
        hub.load(registry.get("noimport_hub").hub)


# --------------------------------------------------------------------------------- missing and broken kernels

def test_missing_kernel_repo_online_without_network(spy):
    """Not in LOCAL_KERNELS, not offline, no network: KernelLoadError naming the repo and version."""
    repo_id = f"{TRUSTED_ORG}/attn-does-not-exist-7f3a9c"
    register("absent_hub", repo_id)
    with pytest.raises(dispatcher.KernelLoadError) as info:
        hub.load(registry.get("absent_hub").hub)
    assert f"could not load '{repo_id}' (version 1)" in str(info.value)
    assert spy and spy[0][0] == repo_id


def test_missing_local_checkout(monkeypatch, tmp_path):
    repo_id = f"{TRUSTED_ORG}/attn-empty"
    monkeypatch.setenv("LOCAL_KERNELS", f"{repo_id}={tmp_path / 'empty'}")
    (tmp_path / "empty").mkdir()
    register("empty_hub", repo_id)
    with pytest.raises(dispatcher.KernelLoadError) as info:
        hub.load(registry.get("empty_hub").hub)
    assert repo_id in str(info.value) and "FileNotFoundError" in str(info.value)


def test_missing_function(monkeypatch, tmp_path):
    repo = kr.make_local_repo(tmp_path, f"{TRUSTED_ORG}/attn-nofn")
    use_local(monkeypatch, repo)
    dispatcher.register_backend("nofn_hub", FLASH_HUB_FN, devices=("cpu",),
                                hub_kernel=HubKernel(repo.repo_id, "flash_attn_varlen_func", version=1))
    with pytest.raises(dispatcher.KernelLoadError, match="has no attribute 'flash_attn_varlen_func'"):
        hub.load(registry.get("nofn_hub").hub)


@pytest.mark.parametrize("broken", ["metadata", "import"])
@pytest.mark.parametrize("policy", ["fallback", "strict"])
def test_corrupted_download(broken, policy, monkeypatch, tmp_path, qkv):
    repo = kr.make_local_repo(tmp_path, f"{TRUSTED_ORG}/attn-corrupt", broken=broken)
    use_local(monkeypatch, repo)
    register("corrupt_hub", repo.repo_id)
    with pytest.raises(dispatcher.KernelLoadError) as info:
        hub.load(registry.get("corrupt_hub").hub)
    message = str(info.value)
    assert f"could not load '{repo.repo_id}'" in message
    if broken == "import":
        assert "this kernel download is corrupted" in message
    recorder = dispatcher.Recorder()
    q, k, v = qkv
    with dispatcher.recording(recorder):
        if policy == "strict":
            with pytest.raises(dispatcher.BackendNotSupportedError) as strict:
                dispatcher.dispatch_attention_fn(q, k, v, backend="corrupt_hub", policy="strict")
            assert repo.repo_id in str(strict.value) and "strict" in str(strict.value)
            assert recorder.snapshot()["rows"] == []
        else:
            out = dispatcher.dispatch_attention_fn(q, k, v, backend="corrupt_hub", policy="fallback")
            torch.testing.assert_close(out, reference(q, k, v), atol=1e-5, rtol=1e-5)
            row = recorder.snapshot()["rows"][0]
            assert row["requested"] == "corrupt_hub" and row["served"] == "native" and row["fell_back"]
            assert any(r.startswith("corrupt_hub: could not load") and repo.repo_id in r for r in row["reasons"])
    assert dispatcher.loaded_kernels() == []
    assert repo.kernel_id not in sys.modules  # kernels removes a half-imported module


# ------------------------------------------------------------------------------------------------ lock files

def test_lock_pins_revision_argument(monkeypatch, tmp_path, spy):
    """In process with LOCAL_KERNELS: the lock's revision is what is asked for; LOCAL_KERNELS ignores it,
    and the record says so (source 'local', no revision) instead of claiming the pinned commit ran."""
    repo = kr.make_local_repo(tmp_path, f"{TRUSTED_ORG}/attn-lock")
    use_local(monkeypatch, repo)
    pinned = "a" * 40
    lock = kr.write_lock(tmp_path / "lock.json", [{"repo_id": repo.repo_id, "version": 1, "revision": pinned}])
    monkeypatch.setenv(env.KERNEL_LOCK, str(lock))
    assert hub.lock_path() == lock
    register("lock_hub", repo.repo_id)
    _, record = hub.load(registry.get("lock_hub").hub)
    assert spy == [(repo.repo_id, {"revision": pinned})]
    assert record.from_lock and record.source == "local" and record.revision is None


def test_lock_for_another_version_is_ignored(monkeypatch, tmp_path, spy, caplog):
    repo = kr.make_local_repo(tmp_path, f"{TRUSTED_ORG}/attn-lockv")
    use_local(monkeypatch, repo)
    lock = kr.write_lock(tmp_path / "lock.json", [{"repo_id": repo.repo_id, "version": 2, "revision": "b" * 40}])
    monkeypatch.setenv(env.KERNEL_LOCK, str(lock))
    register("lockv_hub", repo.repo_id)
    with caplog.at_level(logging.WARNING, logger="attention_dispatch"):
        _, record = hub.load(registry.get("lockv_hub").hub)
    assert spy == [(repo.repo_id, {"version": 1})] and not record.from_lock
    assert "pins" in caplog.text and repo.repo_id in caplog.text


@pytest.mark.parametrize("content, why", [
    ("{not json", "JSONDecodeError"),
    ("[1, 2]", '"kernels"'),
    ('{"kernels": {"repo_id": "x"}}', '"kernels"'),
    ('{"kernels": [{"version": 1}]}', "entry 0 has no repo_id"),
    ('{"kernels": ["kernels-community/x"]}', "entry 0 has no repo_id"),
    ('{"kernels": [{"repo_id": "kernels-community/x", "revision": 5}]}', "invalid revision 5"),
    ('{"kernels": [{"repo_id": "kernels-community/x", "version": "one"}]}', "invalid version 'one'"),
    (None, "IsADirectoryError"),
    (b"\xff\xfe\x00garbage", "UnicodeDecodeError"),
])
def test_unreadable_lock(content, why, monkeypatch, tmp_path, spy):
    lock = tmp_path / "bad.lock.json"
    if content is None:
        lock.mkdir()
    elif isinstance(content, bytes):
        lock.write_bytes(content)
    else:
        lock.write_text(content)
    monkeypatch.setenv(env.KERNEL_LOCK, str(lock))
    with pytest.raises(dispatcher.KernelLoadError) as info:
        hub.read_lock()
    message = str(info.value)
    assert str(lock) in message and why in message and "install.py" in message and env.KERNEL_LOCK in message
    register("badlock_hub", f"{TRUSTED_ORG}/attn-badlock")
    with pytest.raises(dispatcher.KernelLoadError, match="unreadable"):
        hub.load(registry.get("badlock_hub").hub)
    assert spy == []


def test_lock_absent_means_unpinned(tmp_path):
    assert hub.read_lock(tmp_path / "absent.json") == {}
    assert hub.read_lock() == {}  # the fixture points ATTN_DISPATCH_KERNEL_LOCK at a missing file
    assert hub.lock_path() == tmp_path / "no-such-lock.json"


def test_lock_path_default(monkeypatch):
    monkeypatch.delenv(env.KERNEL_LOCK)
    assert hub.lock_path() == hub.DEFAULT_LOCK


# ----------------------------------------------------------------------------------------- built-in specs

BUILTIN_HUB = {
    "flash_hub": ("kernels-community/flash-attn2", "flash_attn_func"),
    "_flash_3_hub": ("kernels-community/flash-attn3", "flash_attn_func"),
    "flash_4_hub": ("kernels-community/flash-attn4", "flash_attn_func"),
    "aiter_fa2_hub": ("kernels-community/aiter-flash-attn-ck", "flash_attn_func"),
    "aiter_sage_hub": ("kernels-community/aiter-sage-attention", "sageattn"),
    "sage_hub": (None, "sageattn"),
    "sage_blackwell_hub": (None, "sageattn3_blackwell"),
}
UNTRUSTED_BUILTINS = ("sage_hub", "sage_blackwell_hub")


@pytest.mark.parametrize("name", sorted(BUILTIN_HUB))
def test_builtin_hub_specs_declare_kernel(name):
    spec = registry.get(name)
    repo_id, function = BUILTIN_HUB[name]
    assert spec.hub is not None
    assert spec.hub.repo_id.count("/") == 1 and all(spec.hub.repo_id.split("/"))
    if repo_id:
        assert spec.hub.repo_id == repo_id
    assert spec.hub.function == function
    assert isinstance(spec.hub.version, int) and spec.hub.revision is None  # kernels>=0.15 needs one of them
    assert any(getattr(r, "dist", None) == "kernels" for r in spec.requires)
    assert spec.constraints()["hub"] == {"repo_id": spec.hub.repo_id, "version": spec.hub.version,
                                         "revision": None, "function": function}
    trusted = spec.hub.publisher in dispatcher.TRUSTED_PUBLISHERS
    assert trusted == (name not in UNTRUSTED_BUILTINS)


def _gpu(device_type="cuda", capability=(9, 0), arch=None) -> Machine:
    return Machine(torch_version=torch.__version__, device_type=device_type, device_name="simulated",
                   cuda_capability=capability if device_type == "cuda" else None, rocm_arch=arch,
                   cuda_version="12.8" if device_type == "cuda" else None,
                   packages={"torch": torch.__version__, "kernels": "0.17.2"}, simulated=True)


MACHINES = {"flash_hub": _gpu(), "_flash_3_hub": _gpu(), "flash_4_hub": _gpu(), "sage_hub": _gpu(),
            "sage_blackwell_hub": _gpu(capability=(10, 0)), "aiter_fa2_hub": _gpu("rocm", arch="gfx942"),
            "aiter_sage_hub": _gpu("rocm", arch="gfx1201")}


@pytest.mark.parametrize("name", sorted(BUILTIN_HUB))
def test_builtin_hub_trust_on_simulated_gpu(name, monkeypatch):
    machine = MACHINES[name]
    spec = registry.get(name)
    with use_machine(machine):
        reasons = dispatcher.availability_reasons(name, machine)
        if name in UNTRUSTED_BUILTINS:
            assert len(reasons) == 1 and TRUST in reasons[0] and spec.hub.repo_id in reasons[0]
            assert not trust.decide(spec.hub.repo_id).allowed
            with pytest.raises(dispatcher.BackendUnavailableError, match=TRUST):
                dispatcher.validate_backend(name)  # raises before any download is attempted
            with dispatcher.trusted_publishers([spec.hub.publisher]):
                assert dispatcher.availability_reasons(name, machine) == []
        else:
            assert reasons == []
            assert trust.decide(spec.hub.repo_id).reason == f"'{TRUSTED_ORG}' is a trusted kernel publisher"
        monkeypatch.setenv(TRUST, "true")
        assert dispatcher.availability_reasons(name, machine) == []
        decision = trust.decide(spec.hub.repo_id)
        assert decision.allowed and decision.opt_in  # the env opts in to every publisher, trusted ones too
        monkeypatch.setenv(DISABLE, "true")
        reasons = dispatcher.availability_reasons(name, machine)
        assert len(reasons) == 1 and DISABLE in reasons[0]
        with pytest.raises(dispatcher.BackendUnavailableError, match=DISABLE):
            dispatcher.validate_backend(name)


def test_builtin_hub_kernels_missing_on_gpu():
    machine = _gpu().with_packages(kernels=None)
    with use_machine(machine):
        reasons = dispatcher.availability_reasons("flash_hub", machine)
    assert "kernels is not installed: pip install 'kernels>=0.12'" in reasons
    machine = _gpu().with_packages(kernels="0.11.0")
    with use_machine(machine):
        reasons = dispatcher.availability_reasons("flash_4_hub", machine)
    assert any("kernels 0.11.0 is older than the required 0.12.3" in r for r in reasons)

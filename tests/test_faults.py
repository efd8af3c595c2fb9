"""Faults never cost a run: a backend that fails mid-sampling, broken Hub kernels, corrupted caches and locks.

Under `fallback` the call completes on the next backend of the chain and the Recorder says what happened;
under `strict` it raises with the reason and the next call works. Nothing stays half-patched: the active
backend (context variable), the process default, the policy and checks are as before, and a ComfyUI model
patched by Set Attention Backend (a FakeModel: model_options deep-copied by clone(), like ModelPatcher) is
unchanged, its original untouched.
"""

from __future__ import annotations

import threading
import copy
import functools
import importlib
import sys

import pytest
import torch

import dispatcher
from dispatcher import (AttentionInputError, BackendNotSupportedError, BackendUnavailableError, KernelLoadError,
                        Recorder, attention_backend, attention_checks, dispatch_attention_fn, env, hub, recording,
                        register_backend, registry)
from dispatcher.machine import current_machine, use_machine
from dispatcher.requirements import Package, Probe, forget_imports

from helpers import kernel_repos as kr
from helpers import node_stub, tensors
from helpers.dispatcher_state import remove_custom_backends, reset
from helpers.pack import PACK, comfy_func, load_pack
from helpers.tensors import sdpa

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
kernels = pytest.importorskip("kernels")
adapter, pack_dispatcher, _ = load_pack()
ORG = "kernels-community"


qkv = functools.partial(tensors.qkv, b=1, lq=6, lk=6, h=2, d=16)


def snapshot_state(d=dispatcher):
    return (d.state.active_backend(), d.state.default_backend(), d.state.active_policy(), d.state.active_checks(),
            d.trust.scope_key())


class Faulty:
    """A backend that serves SDPA except on the calls listed in `fail_on` (1-based), where it fails `how`."""

    def __init__(self, how="oom", fail_on=(3,), every=False):
        self.how, self.fail_on, self.every, self.calls = how, set(fail_on), every, 0

    def __call__(self, q, k, v, *, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse):
        self.calls += 1
        if self.every or self.calls in self.fail_on:
            if self.how == "oom":
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated)")
            if self.how == "illegal":
                raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated illegal argument)")
            if self.how == "nan":
                return torch.full_like(q, float("nan"))
            if self.how == "inf":
                return torch.full_like(q, float("inf"))
            if self.how == "type":  # a kernel whose signature changed between versions
                raise TypeError("flash_attn_func() got an unexpected keyword argument 'softmax_scale'")
        return sdpa(q, k, v)


FAULTS = ["oom", "illegal", "nan", "inf", "type"]


def sampling(steps, calls_per_step, backend=None, policy=None, seed=0):
    """A sampling run: `steps` x `calls_per_step` attention calls, each with its own inputs; the outputs."""
    outs = []
    for step in range(steps):
        for i in range(calls_per_step):
            q, k, v = qkv(seed=seed + 100 * step + i)
            outs.append((dispatch_attention_fn(q, k, v, backend=backend, policy=policy), sdpa(q, k, v)))
    return outs


# ------------------------------------------------------------------------------------------ a faulty backend

@pytest.mark.parametrize("how", ["nan", "inf"])
@pytest.mark.parametrize("policy", ["fallback", "strict"])
def test_non_finite_output_with_checks_raise_fails_under_every_policy(how, policy):
    """Checks "raise" mean what they say: a non-finite output fails the call, under the default fallback policy
    too (it is not handed to the next backend as if the kernel had raised); "warn" logs and keeps the output."""
    fn = Faulty(how, fail_on=(3,))
    register_backend("faulty", fn, devices=("cpu",))
    recorder = Recorder()
    # the quality guard, which checks a custom kernel's outputs by default and recomputes a NaN one exactly
    # (tests/test_guard.py), is off: this is about what checks do with the output they are given
    with recording(recorder), attention_checks("raise"), attention_backend("faulty", policy=policy), \
            dispatcher.quality_guard("off"):
        with pytest.raises(AttentionInputError, match="output of attention backend 'faulty'"):
            sampling(steps=4, calls_per_step=2)
    assert {row["served"]: row["calls"] for row in recorder.snapshot()["rows"]} == {"faulty": 2}
    assert fn.calls == 3
    with attention_checks("warn"), attention_backend("faulty", policy=policy), dispatcher.quality_guard("off"):
        fn.calls, fn.fail_on = 0, (1,)
        ((out, _),) = sampling(steps=1, calls_per_step=1)
    assert not torch.isfinite(out).all()


@pytest.mark.parametrize("how", ["oom", "illegal", "type"])
def test_fault_mid_run_fallback_completes_and_reports(how):
    fn = Faulty(how, fail_on=(3,))
    register_backend("faulty", fn, devices=("cpu",))
    recorder = Recorder()
    before = snapshot_state()
    checks = "off"  # non-finite outputs with checks "raise": test_non_finite_output_with_checks_raise_fails_...
    # the quality guard checks a custom kernel's outputs by default (tests/test_guard.py): off here, this is about
    # the fallback chain
    with recording(recorder), attention_checks(checks), attention_backend("faulty"), dispatcher.quality_guard("off"):
        outs = sampling(steps=4, calls_per_step=2)
    assert snapshot_state() == before
    for out, expected in outs:
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    snap = recorder.snapshot()
    counts = {row["served"]: row["calls"] for row in snap["rows"]}
    # call 3 failed and fell back; the signature is the same for every call, so faulty stays demoted after it
    assert counts == {"faulty": 2, "native": 6}, snap
    (row,) = [r for r in snap["rows"] if r["served"] == "native"]
    assert row["requested"] == "faulty" and row["fell_back"]
    word = {"oom": "OutOfMemoryError", "illegal": "illegal", "nan": "NaN", "inf": "Inf", "type": "TypeError"}[how]
    assert any(word in r for r in row["reasons"]), row["reasons"]
    (error,) = snap["errors"]
    assert error["backend"] == "faulty" and word in error["error"]
    assert fn.calls == 3
    assert "faulty" in recorder.summary() and word in recorder.summary()


@pytest.mark.parametrize("how", FAULTS)
def test_fault_mid_run_strict_raises_and_the_next_call_works(how):
    fn = Faulty(how, fail_on=(3,))
    register_backend("faulty", fn, devices=("cpu",))
    before = snapshot_state()
    checks = "raise" if how in ("nan", "inf") else "off"
    recorder = Recorder()
    expected_type = {"oom": torch.OutOfMemoryError, "illegal": RuntimeError, "nan": AttentionInputError,
                     "inf": AttentionInputError, "type": TypeError}[how]
    with recording(recorder), attention_checks(checks), dispatcher.quality_guard("off"):  # checks alone (above)
        inside = snapshot_state()
        with pytest.raises(expected_type) as info:
            with attention_backend("faulty", policy="strict"):
                sampling(steps=4, calls_per_step=2)
        assert snapshot_state() == inside  # the context manager exited by the exception
        if how in ("nan", "inf"):
            assert "output of attention backend 'faulty'" in str(info.value)
        # The next prompt works, on the same backend (strict never demotes): the failure was transient.
        with attention_backend("faulty", policy="strict"):
            for out, expected in sampling(steps=2, calls_per_step=2, seed=7):
                torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert snapshot_state() == before
    counts = {row["served"]: row["calls"] for row in recorder.snapshot()["rows"]}
    assert counts == {"faulty": 2 + 4} and fn.calls == 3 + 4


@pytest.mark.parametrize("how", ["oom", "illegal"])
def test_persistent_fault_strict_then_fallback_and_other_backends_work(how):
    register_backend("broken", Faulty(how, every=True), devices=("cpu",))
    q, k, v = qkv()
    for _ in range(2):  # the same error every time, never a different or half-initialised state
        with pytest.raises(RuntimeError):
            dispatch_attention_fn(q, k, v, backend="broken", policy="strict")
    torch.testing.assert_close(dispatch_attention_fn(q, k, v, backend="broken"), sdpa(q, k, v), atol=1e-5, rtol=1e-5)
    for name in ("native", "flex", "_native_math"):
        torch.testing.assert_close(dispatch_attention_fn(q, k, v, backend=name, policy="strict"), sdpa(q, k, v),
                                   atol=1e-5, rtol=1e-5)


def test_every_backend_of_the_chain_failing_raises_and_demotes_nothing(monkeypatch):
    """Memory exhausted everywhere: the caller gets the error, and no decision is changed by it."""
    from dispatcher.backends import native as native_module
    register_backend("oomy", Faulty("oom", every=True), devices=("cpu",))
    q, k, v = qkv()

    def sdpa_oom(*args, **kwargs):
        raise torch.OutOfMemoryError("out of memory (simulated)")
    monkeypatch.setattr(native_module, "F", type("F", (), {"scaled_dot_product_attention": staticmethod(sdpa_oom)}))
    monkeypatch.setattr(native_module, "_scaled_dot_product_attention", sdpa_oom)
    monkeypatch.setattr(native_module, "_math", sdpa_oom)
    recorder = Recorder()
    with recording(recorder), pytest.raises(torch.OutOfMemoryError):
        dispatch_attention_fn(q, k, v, backend="oomy")
    (decision,) = [d for d in dispatcher.decisions._decisions.values() if d.requested == "oomy"]
    assert [c[0] for c in decision.candidates] == ["oomy", "native", "_native_math"] and not decision.skipped
    assert recorder.snapshot()["rows"] == []
    monkeypatch.undo()  # memory is back: the chain is tried from its start again
    with recording(recorder):
        torch.testing.assert_close(dispatch_attention_fn(q, k, v, backend="oomy"), sdpa(q, k, v))
    assert recorder.snapshot()["rows"][0]["served"] == "native"


def test_fault_in_a_new_signature_only_demotes_that_signature():
    fn = Faulty("oom", fail_on=(1,))
    register_backend("faulty", fn, devices=("cpu",))
    recorder = Recorder()
    with recording(recorder):
        dispatch_attention_fn(*qkv(lq=6), backend="faulty")  # fails, falls back, demoted for lq=6
        dispatch_attention_fn(*qkv(lq=5), backend="faulty")  # another signature: faulty serves it
        dispatch_attention_fn(*qkv(lq=6), backend="faulty")
    served = {(row["served"]): row["calls"] for row in recorder.snapshot()["rows"]}
    assert served == {"native": 2, "faulty": 1} and fn.calls == 2


def test_sdpa_failing_on_a_call_found_by_its_shapes_falls_back_and_is_demoted_once(monkeypatch):
    """Repeat calls of SDPA's chain are found by their shapes alone (eager.py); a kernel failure there takes the
    full path (validated, then the fallback), demotes SDPA for that signature once, and later calls go straight
    to the math kernel without trying SDPA again."""
    from dispatcher.backends import native
    calls, real = [], native._scaled_dot_product_attention

    def failing_sdpa(*args, **kwargs):
        calls.append(1)
        if len(calls) > 2:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(native, "_scaled_dot_product_attention", failing_sdpa)
    recorder = Recorder()
    inputs = qkv(lq=7)
    with recording(recorder):
        outs = [dispatch_attention_fn(*inputs) for _ in range(5)]  # 2 served by SDPA, then it fails
    for out in outs:
        torch.testing.assert_close(out, sdpa(*inputs))
    served = {row["served"]: row["calls"] for row in recorder.snapshot()["rows"]}
    assert served == {"native": 2, "_native_math": 3}
    assert len(calls) == 4  # the failing call tried SDPA by its shapes, then once more on the full path; no more


# ------------------------------------------------------------------------------------ packages and probes

def test_package_that_imports_but_fails_its_first_call(monkeypatch, tmp_path):
    (tmp_path / "fake_attn_pkg").mkdir()
    (tmp_path / "fake_attn_pkg" / "__init__.py").write_text(
        "CALLS = []\n"
        "def attn(q, k, v):\n"
        "    CALLS.append(1)\n"
        "    raise RuntimeError('CUDA error: no kernel image is available for execution on the device')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    forget_imports()

    def run(q, k, v, **kwargs):
        import fake_attn_pkg
        return fake_attn_pkg.attn(q, k, v)

    machine = current_machine().with_packages(**{"fake-attn-pkg": "1.0"})
    with use_machine(machine):
        register_backend("fakepkg", run, devices=("cpu",), requires=(Package("fake-attn-pkg", module="fake_attn_pkg"),))
        assert dispatcher.availability_reasons("fakepkg") == []  # installed, imports: looks available
        q, k, v = qkv()
        with pytest.raises(RuntimeError, match="no kernel image"):
            dispatch_attention_fn(q, k, v, backend="fakepkg", policy="strict")
        recorder = Recorder()
        with recording(recorder):
            out = dispatch_attention_fn(q, k, v, backend="fakepkg")
        torch.testing.assert_close(out, sdpa(q, k, v), atol=1e-5, rtol=1e-5)
        (row,) = recorder.snapshot()["rows"]
        assert row["served"] == "native" and any("no kernel image" in r for r in row["reasons"])
    forget_imports()


@pytest.mark.parametrize("body,fix", [
    # pip brings a missing requirement without --force-reinstall, which would reinstall torch too
    ("import cutlass_ns.cute\n", "a package it needs is missing or incomplete (no `cutlass_ns.cute`)"
                                          ": install it with its requirements, pip install 'fake-attn-dep'"),
    ("raise ImportError('undefined symbol: _ZN3c10')\n", "reinstall it for this torch"),
], ids=["a_dependency_missing", "built_for_another_torch"])
def test_a_package_that_fails_to_import_names_the_fix_its_error_asks_for(monkeypatch, tmp_path, body, fix):
    """flash-attn-4 without its CuTe DSL's `cutlass` (seen on the H200) wants its requirements, not a rebuild."""
    (tmp_path / "fake_attn_dep").mkdir()
    (tmp_path / "fake_attn_dep" / "__init__.py").write_text(body)
    (tmp_path / "cutlass_ns").mkdir()  # a namespace package without `cute`, as the DSL's half-installed `cutlass`
    monkeypatch.syspath_prepend(str(tmp_path))
    forget_imports()
    machine = current_machine().with_packages(**{"fake-attn-dep": "1.0"})
    reason = Package("fake-attn-dep", module="fake_attn_dep").reason(machine)
    forget_imports()
    assert reason.startswith("fake-attn-dep 1.0 is installed but `import fake_attn_dep` fails (")
    assert reason.endswith(fix), reason


def test_package_whose_probe_fails_is_unavailable_with_the_reason():
    def probe():
        raise RuntimeError("CUDA error: no kernel image is available (simulated)")
    register_backend("probed", Faulty(every=False), devices=("cpu",), requires=(Probe("probed-pkg-x", probe),))
    reasons = dispatcher.availability_reasons("probed")
    assert reasons and "imports but a tiny probed-pkg-x call fails" in reasons[0]
    before = snapshot_state()
    with pytest.raises(BackendUnavailableError, match="no kernel image"):
        with attention_backend("probed"):
            pass
    with pytest.raises(BackendUnavailableError):
        dispatcher.set_attention_backend("probed")
    assert snapshot_state() == before
    recorder = Recorder()
    with recording(recorder):
        dispatch_attention_fn(*qkv(), backend="probed")
    assert recorder.snapshot()["rows"][0]["served"] == "native"


# -------------------------------------------------------------------------------------------- Hub kernels

@pytest.fixture
def hub_env(monkeypatch, tmp_path):
    for var in ("LOCAL_KERNELS", env.DISABLE_REMOTE_CODE, env.TRUST_REMOTE_KERNELS):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(env.KERNEL_LOCK, str(tmp_path / "no-lock.json"))
    hub.forget_loaded()
    pack_dispatcher.hub.forget_loaded()
    yield tmp_path
    hub.forget_loaded()
    pack_dispatcher.hub.forget_loaded()


FLASH_HUB_FN = registry.get("flash_hub").fn


def register_hub(name, repo_id, d=dispatcher, **kw):
    return d.register_backend(name, d.registry.get("flash_hub").fn, devices=("cpu",), causal=True, lse=True, gqa=True,
                              hub_kernel=d.HubKernel(repo_id, "flash_attn_func", version=1, **kw))


def hub_case(name, policy, q, k, v):
    """(output or exception, recorder snapshot, state before == after)."""
    before = snapshot_state()
    recorder = Recorder()
    result = None
    with recording(recorder):
        try:
            result = dispatch_attention_fn(q, k, v, backend=name, policy=policy)
        except Exception as exc:  # noqa: BLE001
            result = exc
    return result, recorder.snapshot(), snapshot_state() == before


@pytest.mark.parametrize("broken", ["import", "metadata"])
def test_hub_kernel_that_fails_to_import(broken, hub_env, monkeypatch):
    bad = kr.make_local_repo(hub_env / "bad", f"{ORG}/attn-fault-{broken}", broken=broken)
    monkeypatch.setenv("LOCAL_KERNELS", kr.local_kernels_value(bad))
    register_hub("badhub", bad.repo_id)
    q, k, v = qkv()
    before = snapshot_state()
    with pytest.raises(KernelLoadError, match=bad.repo_id):  # eager: the context manager loads before any call
        with attention_backend("badhub"):
            pytest.fail("entered")
    with pytest.raises(KernelLoadError):
        dispatcher.set_attention_backend("badhub")
    assert snapshot_state() == before
    out, snap, same = hub_case("badhub", "fallback", q, k, v)
    assert same and isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, sdpa(q, k, v), atol=1e-5, rtol=1e-5)
    (row,) = snap["rows"]
    assert row["served"] == "native" and any(bad.repo_id in r and "could not load" in r for r in row["reasons"])
    err, snap, same = hub_case("badhub", "strict", q, k, v)
    assert same and isinstance(err, BackendNotSupportedError) and bad.repo_id in str(err) and snap["rows"] == []
    assert hub.loaded_kernels() == [] and bad.kernel_id not in sys.modules
    # The kernel is repaired (reinstalled): the next strict call loads it and works, no restart needed.
    good = kr.make_local_repo(hub_env / "good", bad.repo_id)
    monkeypatch.setenv("LOCAL_KERNELS", kr.local_kernels_value(good))
    out, snap, same = hub_case("badhub", "strict", q, k, v)
    assert same and isinstance(out, torch.Tensor), out
    torch.testing.assert_close(out, sdpa(q, k, v), atol=1e-5, rtol=1e-5)
    assert snap["rows"][0]["served"] == "badhub" and [r.repo_id for r in hub.loaded_kernels()] == [bad.repo_id]


@pytest.mark.parametrize("broken", ["import", "metadata"])
def test_corrupted_kernel_cache_pinned_by_the_lock(broken, hub_env, monkeypatch):
    """install.py fetched a build into the HF cache and pinned it; the cached files are corrupted since."""
    cache = hub_env / "hf-cache"
    repo = kr.make_cache_repo(cache, f"{ORG}/attn-fault-cache-{broken}", broken=broken)
    lock = kr.write_lock(hub_env / "lock.json", [{"repo_id": repo.repo_id, "version": 1, "revision": repo.commit,
                                                 "path": str(repo.variant_dir)}])
    monkeypatch.setenv(env.KERNEL_LOCK, str(lock))
    calls = []
    real = kernels.get_kernel

    def get_kernel(repo_id, **kwargs):  # the library's own resolution of the pinned revision: no network here
        calls.append((repo_id, kwargs))
        return real(repo_id, **kwargs)
    monkeypatch.setattr(kernels, "get_kernel", get_kernel)
    register_hub("cachehub", repo.repo_id)
    q, k, v = qkv()
    out, snap, same = hub_case("cachehub", "fallback", q, k, v)
    assert same and isinstance(out, torch.Tensor), out
    torch.testing.assert_close(out, sdpa(q, k, v), atol=1e-5, rtol=1e-5)
    (row,) = snap["rows"]
    assert row["served"] == "native"
    reason = " ".join(row["reasons"])
    assert repo.repo_id in reason and repo.commit in reason and "install.py" in reason
    assert calls and calls[0] == (repo.repo_id, {"revision": repo.commit})  # pinned, never "latest"
    err, _, same = hub_case("cachehub", "strict", q, k, v)
    assert same and isinstance(err, BackendNotSupportedError) and "install.py" in str(err)
    assert hub.loaded_kernels() == []
    assert [s.name for s in dispatcher.list_backends()]  # listing still works


def test_lock_file_pointing_at_a_missing_kernel(hub_env, monkeypatch, caplog):
    repo_id = f"{ORG}/attn-fault-gone"
    missing = hub_env / "hf-cache" / f"kernels--{ORG}--attn-fault-gone" / "snapshots" / ("d" * 40) / "build" / kr.VARIANT
    lock = kr.write_lock(hub_env / "lock.json", [{"repo_id": repo_id, "version": 1, "revision": "d" * 40,
                                                 "path": str(missing)}])
    monkeypatch.setenv(env.KERNEL_LOCK, str(lock))
    register_hub("gonehub", repo_id)
    q, k, v = qkv()
    with caplog.at_level("WARNING", logger="attention_dispatch"):
        out, snap, same = hub_case("gonehub", "fallback", q, k, v)
    assert same and isinstance(out, torch.Tensor), out
    assert "no longer in the cache" in caplog.text
    reason = " ".join(snap["rows"][0]["reasons"])
    assert snap["rows"][0]["served"] == "native" and repo_id in reason and "rerun `python install.py`" in reason
    err, _, same = hub_case("gonehub", "strict", q, k, v)
    assert same and isinstance(err, BackendNotSupportedError) and "d" * 40 in str(err)
    # The user reinstalls (a local checkout here): the next call loads it, the pin no longer applies to it.
    good = kr.make_local_repo(hub_env / "good", repo_id)
    monkeypatch.setenv("LOCAL_KERNELS", kr.local_kernels_value(good))
    out, snap, same = hub_case("gonehub", "strict", q, k, v)
    assert same and isinstance(out, torch.Tensor) and snap["rows"][0]["served"] == "gonehub"


def test_unreadable_lock_file_falls_back(hub_env, monkeypatch):
    (hub_env / "lock.json").write_text('{"kernels": [{"repo_id": ')
    monkeypatch.setenv(env.KERNEL_LOCK, str(hub_env / "lock.json"))
    register_hub("lockhub", f"{ORG}/attn-fault-lock")
    out, snap, same = hub_case("lockhub", "fallback", *qkv())
    assert same and isinstance(out, torch.Tensor)
    assert any("unreadable" in r for r in snap["rows"][0]["reasons"])
    err, _, same = hub_case("lockhub", "strict", *qkv())
    assert same and isinstance(err, BackendNotSupportedError) and "unreadable" in str(err)


# ------------------------------------------------------------------------- a ComfyUI model through the nodes

@pytest.fixture
def nodes(monkeypatch):
    module = node_stub.install(monkeypatch)
    pd = pack_dispatcher
    before = set(pd.registry.names())
    yield module
    remove_custom_backends(pd, before)
    reset(pd)


comfy_qkv = functools.partial(tensors.qkv, b=1, lq=8, lk=8, h=2, d=16, flat=True)  # ComfyUI's (B, L, H*D)


def served_calls(rows) -> dict:
    """Calls per serving backend, over every block's row (the override names each block: "self #0")."""
    out = {}
    for row in rows:
        out[row["served"]] = out.get(row["served"], 0) + row["calls"]
    return out


def sample(model, steps=3, calls=2, seed=0):
    """What KSampler does with a patched model: the OUTER_SAMPLE wrappers around the steps, each step calling
    the attention override with ComfyUI's convention; returns the outputs and ComfyUI's own results."""
    to = model.model_options["transformer_options"]
    override = to["optimized_attention_override"]
    outs = []

    def executor():
        for step in range(steps):
            sigmas = torch.linspace(1.0, 0.0, steps + 1)
            options = {**to, "sample_sigmas": sigmas, "sigmas": sigmas[step:step + 1]}
            for i in range(calls):
                q, k, v = comfy_qkv(seed=seed + 10 * step + i)
                outs.append((override(comfy_func, q, k, v, 2, transformer_options=options),
                             comfy_func(q, k, v, 2)))
        return "latent"

    run = executor
    for wrapper in reversed(model.outer_wrappers()):
        run = (lambda w, inner: (lambda: w(lambda *a, **kw: inner())))(wrapper, run)
    return run(), outs


@pytest.mark.parametrize("how", ["oom", "illegal", "nan"])
@pytest.mark.parametrize("policy", ["fallback", "strict"])
def test_patched_model_survives_a_fault_mid_sampling(nodes, how, policy):
    pd = pack_dispatcher
    reports = importlib.import_module(f"{PACK}.nodes.reports")
    reports.clear()
    fn = Faulty(how, fail_on=(3,))
    pd.register_backend("faulty", fn, devices=("cpu",))
    assert nodes.SetAttentionBackend.check_inputs("faulty", policy, 0.0, 1.0) is True
    original = node_stub.FakeModel({"transformer_options": {"marker": 1}, "extra": [1, 2]})
    pristine = copy.deepcopy(original.model_options)
    before = snapshot_state(pd)
    # NaN: the Attention Checks node after Set Attention Backend (the guard, which would also see it, is off here:
    # tests/test_guard.py has the guard's own NaN check)
    guard = "off" if how == "nan" else "quantised kernels"
    (patched,) = nodes.SetAttentionBackend.execute(original, "faulty", policy, 0.0, 1.0, None,
                                                   quality_guard=guard).result
    if how == "nan":
        (patched,) = nodes.AttentionChecks.execute(patched, "raise", False, 10).result
    assert original.model_options == pristine and patched is not original
    patched_options = copy.copy(patched.model_options["transformer_options"])
    fails = policy == "strict" or how == "nan"  # Attention Checks "raise" fail the prompt under fallback too
    if not fails:
        result, outs = sample(patched)
        assert result == "latent"
        for out, expected in outs:
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    else:
        with pytest.raises((RuntimeError, AttentionInputError, pd.AttentionInputError)):
            sample(patched)
    assert snapshot_state(pd) == before
    assert original.model_options == pristine  # the model the user loaded is untouched
    assert patched.model_options["transformer_options"] == patched_options  # and the clone keeps its patch
    report = [r for r in reports.latest()["reports"] if r["kind"] == "model"][-1]  # published even on failure
    if how == "nan":  # the Attention Checks report says what it checked and what failed the prompt
        checks = [r for r in reports.latest()["reports"] if r["kind"] == "checks"][-1]
        assert checks["checked"] == {"mode": "raise", "calls": 3, "non_finite": 1,
                                     "messages": [checks["checked"]["messages"][0]]}, checks
        assert checks["summary"].startswith("NaN/Inf found, the prompt failed (checks: raise) after 3 attention "
                                            "calls: output of attention backend 'faulty' has"), checks["summary"]
    rows = report["recorder"]["rows"]
    if not fails:
        assert served_calls(rows) == {"faulty": 2, "native": 4}
        assert report["recorder"]["errors"][0]["backend"] == "faulty"
    else:
        assert served_calls(rows) == {"faulty": 2}
    # The next prompt with the same patched model works (and under strict is served by faulty again).
    result, outs = sample(patched, seed=50)
    assert result == "latent" and len(outs) == 6
    for out, expected in outs:
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    report = [r for r in reports.latest()["reports"] if r["kind"] == "model"][-1]
    counts = served_calls(report["recorder"]["rows"])
    assert counts == ({"faulty": 6} if fails else {"native": 6})


def test_patched_model_with_a_broken_hub_kernel(nodes, hub_env, monkeypatch):
    pd = pack_dispatcher
    bad = kr.make_local_repo(hub_env / "bad", f"{ORG}/attn-fault-node", broken="import")
    monkeypatch.setenv("LOCAL_KERNELS", kr.local_kernels_value(bad))
    register_hub("badhub", bad.repo_id, d=pd)
    original = node_stub.FakeModel()
    pristine = copy.deepcopy(original.model_options)
    # strict: the queue-time check cannot know the kernel is broken (it loads nothing); the run says why
    assert nodes.SetAttentionBackend.check_inputs("badhub", "strict", 0.0, 1.0) is True
    for policy in ("fallback", "strict"):
        (patched,) = nodes.SetAttentionBackend.execute(original, "badhub", policy, 0.0, 1.0, None).result
        if policy == "fallback":
            _, outs = sample(patched)
            for out, expected in outs:
                torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        else:
            with pytest.raises(pd.BackendNotSupportedError, match=bad.repo_id):
                sample(patched)
        assert original.model_options == pristine
    assert pd.hub.loaded_kernels() == []


@pytest.mark.parametrize("mode", ["warn", "raise"])
def test_checks_report_says_what_was_checked(nodes, mode):
    """The Attention Checks report is never empty: calls checked and, under warn, the NaN/Inf it logged and kept."""
    reports = importlib.import_module(f"{PACK}.nodes.reports")
    pack_dispatcher.register_backend("faulty", Faulty("nan", fail_on=(2,)), devices=("cpu",))
    # the guard off: it would recompute the custom kernel's NaN output exactly before checks see it (test_guard.py)
    (patched,) = nodes.SetAttentionBackend.execute(node_stub.FakeModel(), "faulty", "fallback", 0.0, 1.0, None,
                                                   quality_guard="off").result
    (patched,) = nodes.AttentionChecks.execute(patched, mode, False, 10).result
    if mode == "raise":
        (patched_clean,) = nodes.AttentionChecks.execute(
            nodes.SetAttentionBackend.execute(node_stub.FakeModel(), "native", "fallback", 0.0, 1.0, None).result[0],
            mode, False, 10).result
        sample(patched_clean)
        checks = [r for r in reports.latest()["reports"] if r["kind"] == "checks"][-1]
        assert checks["summary"] == "Checked 6 attention calls for NaN/Inf: all finite.", checks
        assert checks["checked"]["non_finite"] == 0 and "no_calls" not in checks
        return
    result, outs = sample(patched)
    assert result == "latent" and not torch.isfinite(outs[1][0]).all()  # warn keeps the output
    checks = [r for r in reports.latest()["reports"] if r["kind"] == "checks"][-1]
    assert checks["checked"]["calls"] == 6 and checks["checked"]["non_finite"] == 1, checks
    assert checks["summary"].startswith("NaN/Inf in 1 of 6 attention calls (checks: warn, logged; the prompt went "
                                        "on): output of attention backend 'faulty' has"), checks["summary"]


@pytest.mark.parametrize("mode", ["warn", "raise"])
def test_checks_see_the_kernels_own_output_before_the_guard_replaces_it(nodes, mode, caplog):
    """A custom kernel returning NaN under the default quality guard (which recomputes it exactly): the Attention
    Checks node reports the NaN the kernel produced, and under `raise` the prompt fails (docs/nodes.md). It once
    succeeded with "all finite": the guard had replaced the output before the checks saw it."""
    reports = importlib.import_module(f"{PACK}.nodes.reports")
    pack_dispatcher.register_backend("faulty", Faulty("nan", fail_on=(2,)), devices=("cpu",))
    (patched,) = nodes.SetAttentionBackend.execute(node_stub.FakeModel(), "faulty", "fallback", 0.0, 1.0,
                                                   None).result  # the default guard
    (patched,) = nodes.AttentionChecks.execute(patched, mode, False, 10).result
    if mode == "raise":
        with pytest.raises(pack_dispatcher.AttentionInputError, match="output of attention backend 'faulty' has"):
            sample(patched)
    else:
        result, outs = sample(patched)
        assert result == "latent" and all(torch.isfinite(out).all() for out, _ in outs)  # the guard replaced it
    checks = [r for r in reports.latest()["reports"] if r["kind"] == "checks"][-1]
    assert checks["checked"]["non_finite"] == 1, checks
    assert checks["summary"].startswith("NaN/Inf") and "output of attention backend 'faulty' has" in checks["summary"]
    if mode == "warn":
        logged = [r.getMessage() for r in caplog.records if "output of attention backend 'faulty'" in r.getMessage()]
        assert len(logged) == 1, logged  # once, not once by the dispatcher and once by the node


def test_a_probe_whose_call_imports_a_package_does_not_deadlock(monkeypatch, tmp_path):
    """FlashAttention-3's FP8 probe imports FA3 through import_error while the probe holds the import lock: on the
    H100 (2026-12-05) availability_reasons('flash_3_fp8') hung for ever, and with it every `auto` in that process."""
    (tmp_path / "fake_probe_pkg").mkdir()
    (tmp_path / "fake_probe_pkg" / "__init__.py").write_text("def attn():\n    return 'ran'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    forget_imports()

    def probe():
        from dispatcher.requirements import import_error
        assert import_error("fake_probe_pkg") is None  # what flash.py's _fa3_module does inside the FP8 probe

    register_backend("probe_imports", Faulty(every=False), devices=("cpu",),
                     requires=(Probe("probe-imports-x", probe),))
    done = []
    worker = threading.Thread(target=lambda: done.append(dispatcher.availability_reasons("probe_imports")),
                              daemon=True)
    worker.start()
    worker.join(timeout=20)
    # before forget_imports, which takes the same lock: a deadlocked worker would hang the test instead of failing it
    assert done == [[]], "availability_reasons deadlocked on a probe that imports"
    forget_imports()

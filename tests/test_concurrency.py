"""ComfyUI runs prompts on a worker thread while the server thread answers routes: shared state must hold.

Threads hammer the attention_backend context manager, the Recorder, the decision cache, trust scopes and
the tuner cache while other threads read the routes' payloads, list backends and change the registry.
Every test asserts that no thread raised and that the counts are exact. The interpreter switches threads
every 10 µs during these tests (instead of every 5 ms) so interleavings actually happen.
"""

from __future__ import annotations

import functools
import importlib
import json
import sys
import threading
import time

import pytest
import torch

import dispatcher
from dispatcher import (Recorder, attention_backend, dispatch_attention_fn, env, hub, recording, register_backend,
                        registry, state, trust)
from dispatcher import auto as tuner
from dispatcher.auto import cache as disk_cache

from helpers import kernel_repos as kr
from helpers import tensors
from helpers.pack import PACK, comfy_func, load_pack
from helpers.tensors import sdpa

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
adapter, pack_dispatcher, _ = load_pack()
routes = importlib.import_module(f"{PACK}.nodes.routes")
reports = importlib.import_module(f"{PACK}.nodes.reports")
THREADS, CALLS = 6, 30


@pytest.fixture(autouse=True)
def fast_switching():
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(old)


qkv = functools.partial(tensors.qkv, b=1, lq=6, lk=6, h=2, d=8)  # k and v keep length 6 whatever lq is


class Hammer:
    """Run `workers` (callables taking their index) in threads started together, with `readers` looping
    alongside until the workers end; collect every exception."""

    def __init__(self):
        self.errors: list[BaseException] = []
        self.reads = 0

    def run(self, worker, n=THREADS, readers=()):
        barrier = threading.Barrier(n + len(readers))
        done = threading.Event()

        def guard(fn, *args):
            try:
                barrier.wait()
                fn(*args)
            except BaseException as exc:  # noqa: BLE001
                self.errors.append(exc)

        def loop(reader):
            while not done.is_set():
                reader()
                self.reads += 1
                time.sleep(0.002)  # a server answers requests, it does not spin: leave the workers some GIL

        workers = [threading.Thread(target=guard, args=(worker, i)) for i in range(n)]
        others = [threading.Thread(target=guard, args=(loop, r)) for r in readers]
        for t in workers + others:
            t.start()
        for t in workers:
            t.join(timeout=120)
        done.set()
        for t in others:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in workers + others), "a thread hung"
        if self.errors:
            raise self.errors[0]
        return self


def server_reads():
    """What the server thread does meanwhile: the two routes' payloads (JSON-encoded) and the listings."""
    def backends_route():
        json.dumps(routes.backends_payload(), default=str)

    def report_route():
        json.dumps(routes.report_payload() if hasattr(routes, "report_payload") else reports.latest(), default=str)

    def listing():
        assert dispatcher.list_backends()
        dispatcher.loaded_kernels()
        tuner.report()
    return (backends_route, report_route, listing)


# ---------------------------------------------------------------------------------- context manager state

def test_attention_backend_context_is_per_thread_under_load():
    names = ["native", "flex", "_native_math", "_native_flash"]
    recorders = [Recorder() for _ in range(THREADS)]
    q, k, v = qkv()
    expected = sdpa(q, k, v)

    def worker(i):
        mine, policy = names[i % len(names)], ("strict", "fallback")[i % 2]
        with recording(recorders[i]):
            for j in range(CALLS):
                with attention_backend(mine, policy=policy):
                    assert state.active_backend() == mine and state.active_policy() == policy
                    out = dispatch_attention_fn(q, k, v)
                    with attention_backend("native"):  # nested, restored on exit
                        assert state.active_backend() == "native"
                    assert state.active_backend() == mine
                torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
                assert state.active_policy() == "fallback"

    def toggle_default():  # the process default changes underneath; context overrides win
        dispatcher.set_attention_backend("flex")
        dispatcher.set_attention_backend("native")

    Hammer().run(worker, readers=server_reads() + (toggle_default,))
    for i, rec in enumerate(recorders):
        snap = rec.snapshot()
        assert snap["calls"] == CALLS and [r["served"] for r in snap["rows"]] == [names[i % len(names)]], snap
    assert state.default_backend() == "native" and state.active_backend() == "native"


def test_context_exited_by_exceptions_in_many_threads():
    def worker(i):
        for _ in range(CALLS):
            try:
                with attention_backend("flex"), dispatcher.fallback_policy("strict"), dispatcher.attention_checks("raise"):
                    raise RuntimeError("boom")
            except RuntimeError:
                pass
            assert (state.active_backend(), state.active_policy(), state.active_checks()) == ("native", "fallback", "off")

    Hammer().run(worker)


# ------------------------------------------------------------------------------------------------ recorder

def test_recorder_counts_are_exact():
    rec = Recorder()
    sites = ("self", "cross", "text")

    def worker(i):
        for j in range(CALLS * 5):
            rec.record(sites[j % 3], "flex", "native" if i % 2 else "flex", (f"reason {j % 4}",) if i % 2 else ())
            if j % 50 == 0:
                rec.record_error(sites[j % 3], "flex", f"error from thread {i}")

    def reader():
        snap = rec.snapshot()
        assert snap["calls"] == sum(r["calls"] for r in snap["rows"])
        rec.summary()
        rec.total_calls

    Hammer().run(worker, readers=(reader, reader))
    snap = rec.snapshot()
    assert snap["calls"] == rec.total_calls == THREADS * CALLS * 5
    by_served = {}
    for row in snap["rows"]:
        by_served[row["served"]] = by_served.get(row["served"], 0) + row["calls"]
    assert by_served == {"flex": THREADS // 2 * CALLS * 5, "native": THREADS // 2 * CALLS * 5}
    assert all(sorted(r["reasons"]) == [f"reason {n}" for n in range(4)] for r in snap["rows"] if r["served"] == "native")


def test_shared_recorder_through_the_dispatcher_and_the_adapter():
    """One model's Recorder is shared by every clone of the model (ComfyUI may run clones in parallel)."""
    rec = Recorder()
    pack_rec = pack_dispatcher.Recorder()
    override = adapter.make_override("flex", "fallback", pack_rec)
    g = torch.Generator().manual_seed(3)
    flat = tuple(torch.randn(1, 6, 16, generator=g) for _ in range(3))
    q, k, v = qkv()

    def worker(i):
        for j in range(CALLS):
            with recording(rec):
                dispatch_attention_fn(q, k, v, backend=("native", "flex")[j % 2], call_site=f"site{i % 2}")
            override(comfy_func, *flat, 2, transformer_options={})

    Hammer().run(worker, readers=server_reads())
    assert rec.total_calls == THREADS * CALLS and pack_rec.total_calls == THREADS * CALLS
    assert {r["served"]: r["calls"] for r in pack_rec.snapshot()["rows"]} == {"flex": THREADS * CALLS}, pack_rec.summary()
    counts = {}
    for row in rec.snapshot()["rows"]:
        counts[(row["site"], row["served"])] = row["calls"]
    assert counts == {(f"site{s}", b): THREADS // 2 * CALLS // 2 for s in (0, 1) for b in ("native", "flex")}


def test_eager_flex_from_two_copies_of_the_pack_takes_turns():
    """torch's eager flex is not thread-safe: each call enters torch.fx.traceback.annotate, which adds a key to a
    module-level dict and deletes it on exit. Threads running it through two copies of the pack at once (the one
    ComfyUI loaded and another import) take turns under one lock; with a lock per copy, one thread raised
    KeyError: 'custom' now and then (flex fell back to native), and every run left the key in torch's dict."""
    copies = (dispatcher, pack_dispatcher)
    flex_modules = [importlib.import_module(f"{d.__name__}.backends.flex") for d in copies]
    assert flex_modules[0] is not flex_modules[1] and flex_modules[0]._eager_lock is flex_modules[1]._eager_lock
    recorders = [d.Recorder() for d in copies]
    q, k, v = qkv()
    expected = sdpa(q, k, v)
    annotations = dict(torch.fx.traceback.current_meta)

    calls = 4 * CALLS  # without the shared lock, the key was left behind in about half the runs of 1 x CALLS

    def worker(i):
        d = copies[i % 2]
        for _ in range(calls):
            with d.recording(recorders[i % 2]):
                out = d.dispatch_attention_fn(q, k, v, backend="flex")
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)

    Hammer().run(worker)
    for rec in recorders:  # no call fell back
        assert {r["served"]: r["calls"] for r in rec.snapshot()["rows"]} == {"flex": THREADS // 2 * calls}, rec.summary()
    assert torch.fx.traceback.current_meta == annotations


# ------------------------------------------------------------------------------------------- decision cache

def test_decision_cache_under_registry_changes():
    """Many signatures decided concurrently while another thread registers and removes a backend (each change
    clears the decisions) and the server lists backends: every call correct, every call recorded once."""
    rec = Recorder()
    inputs = [qkv(lq=lq, seed=lq) for lq in range(1, 9)]
    expected = [sdpa(*x) for x in inputs]
    flips = {"n": 0}

    def worker(i):
        with recording(rec):
            for j in range(CALLS):
                n = (i + j) % len(inputs)
                out = dispatch_attention_fn(*inputs[n], backend=("native", "flex", "_native_math")[j % 3])
                torch.testing.assert_close(out, expected[n], atol=1e-5, rtol=1e-5)

    def churn():
        register_backend("churn", lambda q, k, v, **kw: sdpa(q, k, v), devices=("cpu",), replace=True)
        dispatcher.list_backends()
        dispatcher.unregister_backend("churn")
        dispatcher.caches.forget()
        flips["n"] += 1

    Hammer().run(worker, readers=server_reads() + (churn,))
    assert rec.total_calls == THREADS * CALLS and flips["n"] > 0
    assert "churn" not in registry.names()


def test_demotion_from_many_threads_is_recorded_once():
    calls = {"n": 0}
    lock = threading.Lock()

    def flaky(q, k, v, **kwargs):
        with lock:
            calls["n"] += 1
        raise RuntimeError("illegal argument (simulated)")

    register_backend("flaky", flaky, devices=("cpu",))
    rec = Recorder()
    q, k, v = qkv()

    def worker(i):
        with recording(rec):
            for _ in range(CALLS):
                torch.testing.assert_close(dispatch_attention_fn(q, k, v, backend="flaky"), sdpa(q, k, v),
                                           atol=1e-5, rtol=1e-5)

    Hammer().run(worker)
    (row,) = rec.snapshot()["rows"]
    assert row["served"] == "native" and row["calls"] == THREADS * CALLS
    assert 1 <= calls["n"] <= THREADS  # tried by the threads that raced the first call, then demoted
    (decision,) = [d for d in dispatcher.decisions._decisions.values() if d.requested == "flaky"]
    assert [name for name, _ in decision.skipped].count("flaky") == 1


# ------------------------------------------------------------------------------------------------ trust scopes

def test_trust_scopes_are_per_thread():
    orgs = [f"org{i}" for i in range(THREADS)]

    def worker(i):
        for _ in range(CALLS):
            with dispatcher.trusted_publishers([orgs[i]]):
                for j, org in enumerate(orgs):
                    assert trust.decide(f"{org}/kernel").allowed == (i == j)
                assert trust.scope_key()[0] == frozenset({orgs[i]})
            assert not trust.decide(f"{orgs[i]}/kernel").allowed

    Hammer().run(worker, readers=server_reads())


def test_trust_scopes_with_a_real_hub_kernel(monkeypatch, tmp_path):
    """Half the threads trust the publisher (and get its kernel), half do not (and get native, with the reason)."""
    pytest.importorskip("kernels")
    monkeypatch.setenv(env.KERNEL_LOCK, str(tmp_path / "no-lock.json"))
    repo = kr.make_local_repo(tmp_path, "someorg/attn-concurrent")
    monkeypatch.setenv("LOCAL_KERNELS", kr.local_kernels_value(repo))
    hub.forget_loaded()
    register_backend("someorg_hub", registry.get("flash_hub").fn, devices=("cpu",), causal=True, lse=True,
                     hub_kernel=dispatcher.HubKernel(repo.repo_id, "flash_attn_func", version=1))
    recorders = [Recorder() for _ in range(THREADS)]
    q, k, v = qkv()
    expected = sdpa(q, k, v)

    def worker(i):
        trusted = i % 2 == 0
        with recording(recorders[i]):
            for _ in range(CALLS):
                scope = dispatcher.trusted_publishers(["someorg"]) if trusted else dispatcher.trusted_publishers([])
                with scope:
                    out = dispatch_attention_fn(q, k, v, backend="someorg_hub")
                torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)

    Hammer().run(worker, readers=server_reads())
    for i, rec in enumerate(recorders):
        (row,) = rec.snapshot()["rows"]
        assert row["calls"] == CALLS
        if i % 2 == 0:
            assert row["served"] == "someorg_hub" and not row["fell_back"]
        else:
            assert row["served"] == "native" and any("not published by a trusted" in r for r in row["reasons"])
    assert [k.repo_id for k in hub.loaded_kernels()] == [repo.repo_id]  # loaded once
    assert len(sys.modules[repo.kernel_id].CALLS) == THREADS // 2 * CALLS
    hub.forget_loaded()


# ------------------------------------------------------------------------------------------------ the tuner

def test_tuner_cache_under_threads(tmp_path):
    """`auto` from many threads: each signature is measured once, every thread gets the same choice."""
    t = tuner.Tuner(cache_path=tmp_path / "tune.json", time_budget_s=0.3, runs=1, warmup=0,
                    backends=("native", "flex", "_native_math"))
    inputs = [qkv(lq=lq, seed=lq) for lq in (3, 5, 7)]
    expected = [sdpa(*x) for x in inputs]
    rec = Recorder()
    seen: dict[int, set] = {n: set() for n in range(len(inputs))}
    lock = threading.Lock()

    def worker(i):
        for j in range(CALLS // 2):
            n = (i + j) % len(inputs)
            local = Recorder()
            with recording(local):
                out = dispatch_attention_fn(*inputs[n], backend="auto")
            rec.record("auto", "auto", local.snapshot()["rows"][0]["served"])
            with lock:
                seen[n].add(local.snapshot()["rows"][0]["served"])
            torch.testing.assert_close(out, expected[n], atol=1e-5, rtol=1e-5)

    def read_tuner():
        t.report()
        t.explain()

    with tuner.using(t):
        Hammer().run(worker, readers=server_reads() + (read_tuner,))
        records = t.records()
        assert len(records) == len(inputs)  # one measurement per signature, however many threads asked
        assert all(len(s) == 1 for s in seen.values()), seen  # every thread got the same choice
        assert {r.chosen for r in records} == set().union(*seen.values())
        assert rec.total_calls == THREADS * (CALLS // 2)
        on_disk = disk_cache.dump(tmp_path / "tune.json")
        assert on_disk  # written once per signature, readable (no torn write)


def test_adapter_full_precision_auto_keeps_the_process_tuner(monkeypatch):
    """WAN I2V calls ask for full precision (low_precision_attention=False): their `auto` must not swap the
    process-wide default tuner, which other threads (and later prompts) use."""
    pd = pack_dispatcher
    monkeypatch.setenv("ATTN_DISPATCH_TUNE_CACHE", "off")
    monkeypatch.setenv("ATTN_DISPATCH_TUNE_MAX_SIGNATURES", "0")
    original = pd.auto.Tuner(cache_path=None, max_signatures=0)
    previous = pd.auto.set_default_tuner(original)
    rec = pd.Recorder()
    override = adapter.make_override("auto", "fallback", rec)
    g = torch.Generator().manual_seed(5)
    flat = tuple(torch.randn(1, 6, 16, generator=g) for _ in range(3))
    expected = comfy_func(*flat, 2)
    q, k, v = (t.unflatten(-1, (2, 8)) for t in flat)

    def worker(i):
        for j in range(CALLS):
            out = override(comfy_func, *flat, 2, transformer_options={}, low_precision_attention=bool(j % 2))
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
            assert pd.auto.default_tuner() is original
            pd.dispatch_attention_fn(q, k, v, backend="auto")

    try:
        Hammer().run(worker, readers=server_reads())
        assert pd.auto.default_tuner() is original
        assert rec.total_calls == THREADS * CALLS
        assert all(pd.get_backend_spec(r["served"]).family != "sage" for r in rec.snapshot()["rows"])
    finally:
        pd.auto.set_default_tuner(previous)


# ------------------------------------------------------------------------------------------------ reports

def test_reports_store_under_publishers_and_readers():
    reports.clear()
    live = []

    def worker(i):
        for j in range(CALLS):
            rec = pack_dispatcher.Recorder(label=f"t{i}")
            rec.record("self", "native", "native")
            reports.publish("model", f"{i}-{j}", {"recorder": rec.snapshot()})
            live.append(rec)  # keeps the live recorder alive
            reports.track_live(f"clip:{i}-{j}", rec)

    def reader():
        data = reports.latest()
        json.dumps(data, default=str)

    Hammer().run(worker, readers=(reader, reader, server_reads()[0]))
    data = reports.latest()
    assert len(data["reports"]) == 64  # the newest 64 (the store's bound), never more
    assert len(data["live"]) == THREADS * CALLS
    reports.clear()


def test_registry_listing_while_backends_are_registered():
    """The server lists backends while a node (or a user script) registers and removes custom ones."""
    names = [f"custom_{i}" for i in range(THREADS)]

    def worker(i):
        for _ in range(CALLS // 2):
            register_backend(names[i], lambda q, k, v, **kw: sdpa(q, k, v), devices=("cpu",), replace=True)
            assert names[i] in registry.names()
            dispatcher.unregister_backend(names[i])

    def lister():
        rows = dispatcher.list_backends()
        assert rows[0].name == dispatcher.BUILTIN_NAMES[0]  # the priority order, whatever is registering
        routes.backends_payload()

    Hammer().run(worker, readers=(lister, lister))
    assert not set(names) & set(registry.names())


def test_hammer_reports_its_reads():
    """The readers loop alongside the workers until the workers end: workers that wait for three reads see them
    (a worker that slept a fixed time instead could end before a starved reader ran once on a loaded machine)."""
    h = Hammer()

    def worker(i):
        deadline = time.monotonic() + 60
        while h.reads < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
    h.run(worker, n=2, readers=server_reads())
    assert h.reads >= 3

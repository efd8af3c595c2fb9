"""Hostile kernels and hostile requests: remote code only with the opt-in, DIFFUSERS_DISABLE_REMOTE_CODE wins
everywhere, kernels are pinned and what ran is recorded, routes leak no file paths and read no input, and
importing the pack downloads nothing.

Hub kernels are real kernel repositories on disk loaded by the real `kernels` library (LOCAL_KERNELS);
a spy on `kernels.get_kernel` / `get_local_kernel` says whether any kernel code was even asked for.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import json
import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

import dispatcher
from dispatcher import env, hub, registry, trust

from helpers import kernel_repos as kr
from helpers import node_stub
from helpers.dispatcher_state import remove_custom_backends, reset
from helpers.pack import PACK, comfy_func, load_pack

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
kernels = pytest.importorskip("kernels")
adapter, pack_dispatcher, _ = load_pack()
routes = importlib.import_module(f"{PACK}.nodes.routes")
reports = importlib.import_module(f"{PACK}.nodes.reports")
ROOT = Path(__file__).resolve().parent.parent
DISABLE, TRUST = env.DISABLE_REMOTE_CODE, env.TRUST_REMOTE_KERNELS
UNTRUSTED, TRUSTED = "someorg", "kernels-community"


# ------------------------------------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    root = tmp_path_factory.mktemp("security-repos")
    return {org: kr.make_local_repo(root, f"{org}/attn-security") for org in (UNTRUSTED, TRUSTED)}


@pytest.fixture
def spy(monkeypatch):
    """Every request for kernel code: the library's loaders, wrapped."""
    seen = []
    for name in ("get_kernel", "get_local_kernel", "install_kernel"):
        real = getattr(kernels, name, None)
        if real is None:
            continue

        def wrapped(*args, _real=real, _name=name, **kwargs):
            seen.append((_name, args, kwargs))
            return _real(*args, **kwargs)
        monkeypatch.setattr(kernels, name, wrapped)
    return seen


@pytest.fixture
def nodes(monkeypatch, repos, tmp_path):
    """The node classes (stand-in comfy_api), both test repos on LOCAL_KERNELS, a hub backend per publisher
    in the pack's dispatcher (what ComfyUI runs), and clean trust state before and after."""
    module = node_stub.install(monkeypatch)
    for var in (DISABLE, TRUST):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(env.KERNEL_LOCK, str(tmp_path / "no-lock.json"))
    monkeypatch.setenv("LOCAL_KERNELS", kr.local_kernels_value(*repos.values()))
    pd = pack_dispatcher
    before = set(pd.registry.names())
    for org, repo in repos.items():
        spec = pd.register_backend(f"{org.replace('-', '_')}_hub", pd.registry.get("flash_hub").fn, devices=("cpu",),
                                   causal=True, lse=True, gqa=True,
                                   hub_kernel=pd.HubKernel(repo.repo_id, "flash_attn_func", version=1))
        pd.registry.set_priority((spec.name,) + pd.registry.priority())  # what `auto` would pick first
    yield module
    remove_custom_backends(pd, before)
    pd.hub.forget_loaded()
    reset(pd)


def flat_qkv():
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 8, 2 * 16, generator=g) for _ in range(3))


def run_model(model):
    override = model.model_options["transformer_options"]["optimized_attention_override"]
    q, k, v = flat_qkv()
    out = override(comfy_func, q, k, v, 2, transformer_options={})
    torch.testing.assert_close(out, comfy_func(q, k, v, 2), atol=1e-5, rtol=1e-5)
    rec = override.config.recorder
    (row,) = rec.snapshot()["rows"]
    return row


# ------------------------------------------------------------------------------------------------ the matrix

ENV_VALUES = {None: False, "true": True, "1": True, "YES": True, "0": False, "no": False, "": False}
PUBLISHER_TEXTS = ["", UNTRUSTED, f"other, {UNTRUSTED}", f"\n {UNTRUSTED} \n", "SomeOrg", f"{UNTRUSTED}/attn-security",
                   "other"]


def allowed(disable, trust_env, org, names, backend_mode):
    if ENV_VALUES[disable]:
        return False
    if backend_mode == "auto":  # auto never downloads: a Hub kernel counts only once fetched (none is here)
        return False
    return org == TRUSTED or ENV_VALUES[trust_env] or org in names


MATRIX = list(itertools.product([None, "true", "1", "0", ""], [None, "true", "YES", "no"], PUBLISHER_TEXTS,
                                [UNTRUSTED, TRUSTED], ["explicit", "auto"]))


@pytest.mark.parametrize("disable, trust_env", sorted({(d, t) for d, t, *_ in MATRIX}, key=str))
def test_no_remote_code_without_opt_in_through_the_nodes(nodes, repos, spy, monkeypatch, disable, trust_env):
    """Trust Remote Kernels -> Set Attention Backend -> the model's override, for every env combination,
    publisher text, publisher and backend choice: kernel code is asked for exactly when it is allowed."""
    for var, value in ((DISABLE, disable), (TRUST, trust_env)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    pd = pack_dispatcher
    for texts, org, mode in itertools.product(PUBLISHER_TEXTS, [UNTRUSTED, TRUSTED], ["explicit", "auto"]):
        pd.hub.forget_loaded()
        pd.caches.forget()
        spy.clear()
        trust_out = nodes.TrustRemoteKernels.execute(texts)
        (names,) = trust_out.result
        text = trust_out.ui["text"][0]
        if ENV_VALUES[disable]:
            assert f"{DISABLE}=true wins" in text
        backend = f"{org.replace('-', '_')}_hub" if mode == "explicit" else "auto"
        model = node_stub.FakeModel()
        (patched,) = nodes.SetAttentionBackend.execute(model, backend, "fallback", 0.0, 1.0, names).result
        calls = len(sys.modules[repos[org].kernel_id].CALLS) if repos[org].kernel_id in sys.modules else 0
        row = run_model(patched)
        after = len(sys.modules[repos[org].kernel_id].CALLS) if repos[org].kernel_id in sys.modules else 0
        expect = allowed(disable, trust_env, org, names, mode)
        case = f"{DISABLE}={disable!r} {TRUST}={trust_env!r} publishers={texts!r} org={org} {mode}"
        asked = [s for s in spy if repos[org].repo_id in repr(s)]
        if expect:
            assert row["served"] == backend if mode == "explicit" else row["served"].endswith("_hub"), case
            assert asked and after == calls + 1, case
            # kernels is told to trust exactly this repo when the user opted in to its publisher: never True (the
            # kernel's own dependencies still meet kernels' check), and nothing for kernels-community alone
            opted = ENV_VALUES[trust_env] or org in names
            assert [kwargs.get("trust_remote_code") for _, _, kwargs in asked] == \
                [[repos[org].repo_id] if opted else None], case
        else:
            assert not row["served"].endswith("_hub"), case
            assert not asked and after == calls, f"{case}: kernel code was requested: {spy}"
            if mode == "explicit":
                assert row["fell_back"] and row["reasons"], case
                reasons = " ".join(row["reasons"])
                assert (DISABLE in reasons) if ENV_VALUES[disable] else ("trusted" in reasons), case
        # The other publisher's kernel was never touched in any case.
        other = repos[UNTRUSTED if org == TRUSTED else TRUSTED]
        assert not [s for s in spy if other.repo_id in repr(s)], case
    assert model.model_options == {"transformer_options": {}}  # the user's model is never patched itself


def test_trust_node_never_widens_the_default_scope(nodes):
    (names,) = nodes.TrustRemoteKernels.execute("a, b\nc").result
    assert names == ("a", "b", "c")
    assert not trust.decide(f"{UNTRUSTED}/x").allowed  # nothing outside the model that was given the list
    with pack_dispatcher.trusted_publishers(names):
        assert not pack_dispatcher.trust.decide(f"{UNTRUSTED}/x").allowed
        assert pack_dispatcher.trust.decide("b/x").allowed


@pytest.mark.parametrize("disable", ["true", "1", "ON"])
def test_disable_wins_in_queue_time_validation(nodes, monkeypatch, disable):
    monkeypatch.setenv(DISABLE, disable)
    monkeypatch.setenv(TRUST, "true")
    for name in ("someorg_hub", "kernels_community_hub", "flash_hub"):
        message = nodes.SetAttentionBackend.check_inputs(name, "strict", 0.0, 1.0)
        assert message is not True, name
        machine = importlib.import_module(f"{PACK}.dispatcher.registry").requirement_check(name)  # the pack's copy
        if machine.machine_bound:  # flash_hub on a CPU: the machine's reason alone (no trust or install advice, #41)
            assert machine.reasons[0] in message and "trust" not in message.lower(), message
        else:
            assert DISABLE in message, message
        assert nodes.SetAttentionBackend.check_inputs(name, "fallback", 0.0, 1.0) is True  # runs native, says why


def test_disable_wins_in_the_dispatcher_for_every_trust_source(monkeypatch, repos, spy, tmp_path):
    monkeypatch.setenv(env.KERNEL_LOCK, str(tmp_path / "no-lock.json"))
    monkeypatch.setenv("LOCAL_KERNELS", kr.local_kernels_value(*repos.values()))
    monkeypatch.setenv(DISABLE, "true")
    monkeypatch.setenv(TRUST, "true")
    q = torch.randn(1, 8, 2, 16)
    for org, repo in repos.items():
        name = f"sec_{org.replace('-', '_')}"
        dispatcher.register_backend(name, registry.get("flash_hub").fn, devices=("cpu",),
                                    hub_kernel=dispatcher.HubKernel(repo.repo_id, "flash_attn_func", version=1))
        with dispatcher.trusted_publishers([org]):
            with pytest.raises(dispatcher.KernelLoadError, match=DISABLE):
                hub.load(registry.get(name).hub)
            with pytest.raises(dispatcher.BackendUnavailableError, match=DISABLE):
                dispatcher.set_attention_backend(name)
            with pytest.raises(dispatcher.BackendNotSupportedError, match=DISABLE):
                dispatcher.dispatch_attention_fn(q, q, q, backend=name, policy="strict")
            rec = dispatcher.Recorder()
            with dispatcher.recording(rec):
                dispatcher.dispatch_attention_fn(q, q, q, backend=name)
            assert rec.snapshot()["rows"][0]["served"] == "native"
    assert spy == [] and hub.loaded_kernels() == []


def test_dispatcher_auto_never_downloads(monkeypatch, repos, spy, tmp_path):
    """`auto` considers a Hub kernel only once it was fetched (lock file) or loaded; not with the opt-in alone."""
    monkeypatch.setenv(env.KERNEL_LOCK, str(tmp_path / "no-lock.json"))
    monkeypatch.setenv("LOCAL_KERNELS", kr.local_kernels_value(*repos.values()))
    monkeypatch.setenv(TRUST, "true")
    for org, repo in repos.items():
        spec = dispatcher.register_backend(f"auto_{org.replace('-', '_')}", registry.get("flash_hub").fn,
                                           devices=("cpu",),
                                           hub_kernel=dispatcher.HubKernel(repo.repo_id, "flash_attn_func", version=1))
        registry.set_priority((spec.name,) + registry.priority())
    q = torch.randn(1, 8, 2, 16)
    with dispatcher.auto.using(dispatcher.auto.Tuner(cache_path=None, max_signatures=0)):
        rec = dispatcher.Recorder()
        with dispatcher.recording(rec):
            dispatcher.dispatch_attention_fn(q, q, q, backend="auto")
        assert not rec.snapshot()["rows"][0]["served"].startswith("auto_")
    assert spy == []


# ------------------------------------------------------------------------------------------------ pinning

def test_every_builtin_hub_kernel_is_pinned():
    hub_specs = [registry.get(n) for n in registry.names() if registry.get(n).hub is not None]
    assert len(hub_specs) >= 7
    for spec in hub_specs:
        assert spec.hub.version is not None or spec.hub.revision, f"{spec.name}: {spec.hub} is not pinned"
        assert spec.hub.repo_id.count("/") == 1


def test_loads_ask_for_a_version_or_revision_and_record_what_ran(monkeypatch, repos, spy, tmp_path):
    monkeypatch.setenv(env.KERNEL_LOCK, str(tmp_path / "no-lock.json"))
    monkeypatch.setenv("LOCAL_KERNELS", kr.local_kernels_value(repos[TRUSTED]))
    dispatcher.register_backend("pinned_hub", registry.get("flash_hub").fn, devices=("cpu",),
                                hub_kernel=dispatcher.HubKernel(repos[TRUSTED].repo_id, "flash_attn_func", version=1))
    _, record = hub.load(registry.get("pinned_hub").hub)
    assert spy and all("version" in kw or "revision" in kw for name, _, kw in spy if name == "get_kernel")
    # LOCAL_KERNELS ignores version and revision: the record says so instead of claiming a revision ran
    assert record.source == "local" and record.revision is None and record.version == 1
    hub.forget_loaded()
    # A build fetched by install.py into the HF cache and pinned by the lock: the commit is recorded.
    monkeypatch.delenv("LOCAL_KERNELS")
    cached = kr.make_cache_repo(tmp_path / "cache", f"{TRUSTED}/attn-security-cached")
    lock = kr.write_lock(tmp_path / "lock.json", [{"repo_id": cached.repo_id, "version": 1,
                                                   "revision": cached.commit, "path": str(cached.variant_dir)}])
    monkeypatch.setenv(env.KERNEL_LOCK, str(lock))
    dispatcher.register_backend("cached_hub", registry.get("flash_hub").fn, devices=("cpu",),
                                hub_kernel=dispatcher.HubKernel(cached.repo_id, "flash_attn_func", version=1))
    _, record = hub.load(registry.get("cached_hub").hub)
    assert record.revision == cached.commit and record.from_lock and record.source == "cache"
    assert [k.revision for k in dispatcher.loaded_kernels() if k.repo_id == cached.repo_id] == [cached.commit]
    hub.forget_loaded()


# ------------------------------------------------------------------------------------------------ routes

ABSOLUTE_PATH = re.compile(r"(?:^|[\s'\"(=\[,])(?:/[\w.~-]|[A-Za-z]:[\\/]|~/)")


def leaks(obj, where="payload") -> list[str]:
    """Every 'path' key and every string holding an absolute file path, anywhere in a JSON-able value."""
    found = []
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key == "path" or (isinstance(key, str) and key.endswith("_path")):
                found.append(f"{where}.{key}")
            found += leaks(value, f"{where}.{key}")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            found += leaks(value, f"{where}[{i}]")
    elif isinstance(obj, str) and ABSOLUTE_PATH.search(obj):
        found.append(f"{where}: {obj[:160]!r}")
    return found


def test_leak_detector_detects():
    assert leaks({"path": "x"}) and leaks(["see /etc/passwd"]) and leaks({"a": "C:\\Users\\x"})
    assert not leaks({"repo": "kernels-community/flash-attn2", "url": "https://huggingface.co/x", "s": "1/sqrt(d)"})


def payloads():
    return {"backends": json.loads(json.dumps(routes.backends_payload(), default=str)),
            "report": json.loads(json.dumps(reports.latest(), default=str))}


def test_routes_expose_no_file_paths(nodes, repos, monkeypatch, tmp_path):
    """With kernels loaded (their records hold local paths), failed loads and bad lock files (their messages
    name paths) and import errors in the reports: neither route shows a path."""
    pd = pack_dispatcher
    monkeypatch.setenv(TRUST, "true")
    reports.clear()
    # a loaded kernel: its LoadedKernel.path is an absolute directory
    (patched,) = nodes.SetAttentionBackend.execute(node_stub.FakeModel(), "someorg_hub", "fallback", 0, 1, ()).result
    assert run_model(patched)["served"] == "someorg_hub"
    assert any(k.path and k.path.startswith("/") for k in pd.loaded_kernels())
    # a failed load whose reason names the lock file's absolute path, published by the run wrapper
    (tmp_path / "bad.lock.json").write_text("{broken")
    monkeypatch.setenv(env.KERNEL_LOCK, str(tmp_path / "bad.lock.json"))
    pd.hub.forget_loaded()
    pd.caches.forget()
    (patched,) = nodes.SetAttentionBackend.execute(node_stub.FakeModel(), "kernels_community_hub", "fallback", 0, 1,
                                                   ()).result
    (wrapper,) = patched.outer_wrappers()
    wrapper(lambda: run_model(patched))
    published = reports.latest()["reports"][-1]
    assert published["recorder"]["rows"][0]["served"] == "native"
    assert str(tmp_path) not in json.dumps(payloads()), "the routes show a temp path"
    # an import error with a library path, as a live (text encoder) recorder
    live = pd.Recorder()
    live.record("text_encoder.self", "flash", "native", (f"flash: `import flash_attn` fails (OSError: "
                                                          f"{tmp_path}/lib/libcudart.so.12: cannot open)",))
    reports.track_live("clip:9", live)
    found = {name: leaks(value, name) for name, value in payloads().items()}
    assert found == {"backends": [], "report": []}, found


class Untouchable:
    """A request whose every attribute raises: a handler that reads the query, the body or the path fails."""

    def __init__(self, url):
        object.__setattr__(self, "_url", url)

    def __getattr__(self, name):
        raise AssertionError(f"the route read request.{name} ({self._url})")


def registered_handlers(monkeypatch):
    handlers = {}

    class Routes:
        def get(self, path):
            def add(fn):
                handlers[path] = fn
                return fn
            return add

        def post(self, path):  # pragma: no cover - there must be none
            raise AssertionError(f"a POST route was registered: {path}")

    web = types.SimpleNamespace(json_response=lambda data, dumps=json.dumps, **kw: ("json", dumps(data)))
    aiohttp = types.ModuleType("aiohttp")
    aiohttp.web = web
    server = types.ModuleType("server")
    prompt_handlers = []  # the raw-prompt hook (nodes/raw_prompt.py): it reads the prompt, serves nothing
    server.PromptServer = types.SimpleNamespace(instance=types.SimpleNamespace(
        routes=Routes(), add_on_prompt_handler=prompt_handlers.append))
    monkeypatch.setitem(sys.modules, "aiohttp", aiohttp)
    monkeypatch.setitem(sys.modules, "aiohttp.web", web)
    monkeypatch.setitem(sys.modules, "server", server)
    monkeypatch.setattr(routes, "_registered", False)
    routes.register()
    return handlers


def test_routes_take_no_input(monkeypatch):
    import asyncio
    handlers = registered_handlers(monkeypatch)
    assert set(handlers) == {"/attention_dispatch/report", "/attention_dispatch/backends"}
    hostile = ["", "?path=/etc/passwd", "?file=../../../../etc/shadow", "?cmd=$(rm%20-rf%20/)", "?backend=;ls",
               "?q=" + "A" * 10000, "/../../etc/passwd"]
    for path, handler in handlers.items():
        answers = {asyncio.run(handler(Untouchable(path + query)))[1] for query in hostile}
        assert len(answers) == 1, f"{path}: the answer depends on the query string"
        body = json.loads(answers.pop())
        assert not leaks(body), leaks(body)


# ------------------------------------------------------------------------------------------------ import

GUARD = '''
import json, os, socket, sys
LOG = os.environ["ATTN_GUARD_LOG"]

def _log(what):
    with open(LOG, "a") as f:
        f.write(json.dumps(what) + "\\n")

def _blocked(*args, **kwargs):
    _log(["socket", repr(args)[:200]])
    raise OSError("network access is blocked by the test guard")

socket.socket.connect = _blocked
socket.socket.connect_ex = _blocked
socket.create_connection = _blocked
socket.getaddrinfo = _blocked
if os.environ.get("ATTN_GUARD_KERNELS"):
    import kernels
    _modules = [m for n, m in list(sys.modules.items()) if m is not None and (n == "kernels" or n.startswith("kernels."))]
    for _name in ("get_kernel", "get_local_kernel", "install_kernel", "load_kernel", "get_locked_kernel"):
        def _refuse(*a, _n=_name, **k):
            _log(["kernels." + _n, repr(a)[:200]])
            raise RuntimeError("kernel code requested: " + _n)
        for _mod in _modules:
            if callable(getattr(_mod, _name, None)):
                setattr(_mod, _name, _refuse)
    _log(["guard-ready", len(_modules)])
'''

IMPORT_ALL = textwrap.dedent(f'''
    import importlib, importlib.util, sys, types
    sys.path.insert(0, {str(ROOT)!r})
    sys.path.insert(0, {str(ROOT / "tests")!r})  # a child process: pytest's pythonpath does not reach it
    import dispatcher, dispatcher.auto, dispatcher.tools.doctor, dispatcher.tools.bench, dispatcher.tools.installer
    spec = importlib.util.spec_from_file_location("packundertest", {str(ROOT / "__init__.py")!r},
                                                  submodule_search_locations=[{str(ROOT)!r}])
    pack = importlib.util.module_from_spec(spec)
    sys.modules["packundertest"] = pack
    spec.loader.exec_module(pack)
    from helpers import node_stub
    for name, module in node_stub.stub_modules().items():
        sys.modules[name] = module
    for sub in ("nodes.adapter", "nodes.routes", "nodes.reports", "nodes.model_nodes", "nodes.clip_patch",
                "nodes.compare", "nodes.window"):
        importlib.import_module("packundertest." + sub)
    import asyncio
    extension = asyncio.run(pack.comfy_entrypoint())
    sys.modules["server"] = types.SimpleNamespace(PromptServer=None)  # on_load registers routes: none to reach
    print("IMPORTED", sorted(m for m in sys.modules if m.startswith(("dispatcher", "packundertest"))).__len__())
''')


def guarded_python(tmp_path, code, extra_env=None, kernels_guard=True, args=()):
    site = tmp_path / "guard-site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(GUARD)
    log = tmp_path / "guard.log"
    log.write_text("")
    child = {k: v for k, v in os.environ.items() if k not in (DISABLE, TRUST, "LOCAL_KERNELS", env.KERNEL_LOCK,
                                                                "HF_ENDPOINT", "HF_HUB_OFFLINE")}
    child.update({"PYTHONPATH": str(site), "ATTN_GUARD_LOG": str(log), env.KERNEL_LOCK: str(tmp_path / "lock.json"),
                  "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_CACHE": str(tmp_path / "hf-cache"),
                  **({"ATTN_GUARD_KERNELS": "1"} if kernels_guard else {}), **(extra_env or {})})
    argv = [sys.executable, "-c", code] if code is not None else [sys.executable, *args]
    proc = subprocess.run(argv, cwd=ROOT, env=child, capture_output=True, text=True, timeout=240)
    events = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    if kernels_guard:
        assert events and events[0][0] == "guard-ready", (events, proc.stderr[-2000:])
        events = events[1:]
    assert "Error in sitecustomize" not in proc.stderr, proc.stderr[-2000:]
    return proc, events


def test_guard_catches_a_download(tmp_path):
    proc, events = guarded_python(tmp_path, "import kernels\ntry:\n    kernels.get_kernel('a/b', version=1)\n"
                                            "except Exception as e:\n    print(type(e).__name__)\n"
                                            "import urllib.request\ntry:\n    urllib.request.urlopen('http://example.com', timeout=2)\n"
                                            "except Exception as e:\n    print(type(e).__name__)\n")
    assert proc.returncode == 0, proc.stderr
    assert [e[0] for e in events][:1] == ["kernels.get_kernel"] and any(e[0] == "socket" for e in events)


def test_nothing_is_downloaded_at_import_time(tmp_path):
    for extra in ({}, {TRUST: "true"}, {"DIFFUSERS_ATTN_BACKEND": "flash_hub"}):
        proc, events = guarded_python(tmp_path, IMPORT_ALL, extra)
        assert proc.returncode == 0 and "IMPORTED" in proc.stdout, proc.stderr[-3000:]
        assert events == [], events


def test_install_py_fetches_nothing_with_disable(tmp_path, repos):
    """install.py (plan, dry run and real run) with DIFFUSERS_DISABLE_REMOTE_CODE=true and a Hub backend that
    fits this machine: no connection, no kernel code asked for, no lock written. The same run without it
    does try to fetch (so the guard would have seen it)."""
    config = {"backends": [{"name": "sec_fetch_hub", "repo_id": repos[TRUSTED].repo_id, "version": 1},
                           {"name": "sec_untrusted_hub", "repo_id": repos[UNTRUSTED].repo_id, "version": 1}],
              "steps": [{"id": f"{mode}-{value}", "argv": [*argv, "--json", "--only", "sec_fetch_hub,sec_untrusted_hub"],
                         "env": {DISABLE: value, TRUST: "true"}}
                        for value in ("true", "1") for mode, argv in (("plan", ["--plan"]), ("dry", ["--dry-run"]),
                                                                       ("fetch", []))]}
    path = tmp_path / "install.json"
    path.write_text(json.dumps(config))
    proc, events = guarded_python(tmp_path, None, {"INSTALL_RUNNER_NO_MARKS": "1"}, kernels_guard=True,
                                  args=(str(ROOT / "tests" / "helpers" / "install_runner.py"), str(path)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = {s["id"]: s for s in json.loads([ln for ln in proc.stdout.splitlines()
                                             if ln.startswith("RESULTS ")][-1][len("RESULTS "):])}
    assert events == [], events
    for sid, step in steps.items():
        assert step["rc"] in (0, None) and step["lock"] is None and step["cache"] == [], sid
        document = json.loads(step["stdout"])
        assert document.get("fetch", []) == [] and "error" not in document, (sid, document)
        assert DISABLE in step["stderr"] + json.dumps(document), sid
    # control: without the variable the same fetch step asks for the kernel (and the guard sees it)
    config["steps"] = [{"id": "control", "argv": ["--json", "--only", "sec_fetch_hub"], "env": {TRUST: "true"}}]
    path.write_text(json.dumps(config))
    proc, events = guarded_python(tmp_path, None, {"INSTALL_RUNNER_NO_MARKS": "1"}, kernels_guard=True,
                                  args=(str(ROOT / "tests" / "helpers" / "install_runner.py"), str(path)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert events, "the control run fetched nothing: the guard proves nothing"

"""The override on ComfyUI 0.38.x's attention contract: both call forms, the kwargs, chaining with the core attention
nodes in both orders, bad input. ComfyUI 0.38 cannot run here: the calls go through stand-ins of its wrapper,
containers and core nodes written from the contract (tests/helpers/comfy038.py cites the file and commit of each
source read: comfy/ldm/modules/attention.py @ 05080f60, comfy/model_patcher.py @ e59d85a0,
comfy_extras/nodes_model_advanced.py @ 691e8278, comfy_extras/nodes_sparse_attention.py @ 01dafad3).
The same rules on ComfyUI 0.3.64 itself: tests/integration. Which rule is tested where: docs/comfyui-versions.md.
"""

from __future__ import annotations

import dataclasses
import importlib
import types

import pytest
import torch

from helpers import comfy038 as c38
from helpers import node_stub
from helpers.pack import CALLS, PACK, load_pack

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

adapter, dispatcher, _ = load_pack()
overrides = importlib.import_module(f"{PACK}.nodes.overrides")
comfy_versions = importlib.import_module(f"{PACK}.nodes.comfy_versions")
registry = importlib.import_module(f"{PACK}.dispatcher.registry")
support = importlib.import_module(f"{PACK}.dispatcher.support")
FULL_PRECISION = support.Rules(low_precision=False)


@pytest.fixture(autouse=True)
def _clear():
    CALLS.clear()
    c38.SPARSE_SERVED.clear()
    c38.KITCHEN_TAKES.clear()


def ref(q, k, v, heads=2):
    """Exact attention on ComfyUI's (B, L, H*D) layout (not through comfy_func, which counts its calls)."""
    b, lq, _ = q.shape
    q, k, v = (t.unflatten(-1, (heads, -1)).transpose(1, 2) for t in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, lq, -1)


def ours(backend="native", **kw):
    kw.setdefault("recorder", dispatcher.Recorder())
    kw.setdefault("default_attention", lambda: c38.attention_pytorch)
    return adapter.make_override(backend, **kw)


def served(rec) -> dict:
    out: dict = {}
    for row in rec.snapshot()["rows"]:
        out[row["served"]] = out.get(row["served"], 0) + row["calls"]
    return out


def options(override, **extra):
    return {c38.OVERRIDE_KEY: override, **extra}


# ------------------------------------------------------------------------------------------------ call forms

@pytest.mark.parametrize("as_containers", [False, True])
def test_both_call_forms_are_served_and_match_exact_attention(as_containers):
    fn = ours()
    q, k, v = c38.flat_qkv(lk=8)
    out = c38.call_site(c38.attention_pytorch, q, k, v, 2, options(fn), as_containers)
    torch.testing.assert_close(out, ref(q, k, v), atol=2e-5, rtol=1e-4)
    assert not CALLS  # ComfyUI's attention was not used
    assert served(fn.config.recorder) == {"native": 1}


def test_container_call_takes_each_container_once_and_gets_no_func():
    """wrap_attn calls `container_function` (no func) for container calls; the override takes each container once."""
    fn = ours()
    seen = []
    original = fn.container_function
    fn.container_function = lambda *a, **kw: seen.append(a) or original(*a, **kw)
    q, k, v = c38.flat_qkv()
    boxes = c38.containers(q, k, v)
    out = c38.attention_pytorch(*boxes, 2, transformer_options=options(fn))
    assert all(isinstance(a, c38.Container) for a in seen[0][:3]) and seen[0][3] == 2  # no func in front
    assert [b.takes for b in boxes] == [1, 1, 1] and all(b.tensor is None for b in boxes)
    torch.testing.assert_close(out, ref(q, k, v), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("as_containers", [False, True])
def test_preferred_attention_is_popped_and_the_override_wins(as_containers):
    """A checkpoint's embedded method (preferred_attention) runs only without an override; the override never sees
    it. The pack does not honour it (it cannot: it is gone before the override is called)."""
    embedded = []
    preferred = c38.Preferred(c38.wrap_attn(lambda *a, **kw: embedded.append(1) or c38.comfy_func(*a, **kw)))
    got_kwargs = []
    fn = ours()
    call = fn.__call__

    class Spy:  # records the kwargs the override is called with, in either form
        def __call__(self, func, *a, **kw):
            got_kwargs.append(kw)
            return call(func, *a, **kw)

        def container_function(self, *a, **kw):
            got_kwargs.append(kw)
            return fn.container_function(*a, **kw)

    q, k, v = c38.flat_qkv()
    out = c38.call_site(c38.attention_pytorch, q, k, v, 2, options(Spy()), as_containers,
                        preferred_attention=preferred)
    assert not embedded and "preferred_attention" not in got_kwargs[0]
    assert got_kwargs[0]["_inside_attn_wrapper"] is True
    torch.testing.assert_close(out, ref(q, k, v), atol=2e-5, rtol=1e-4)
    # without an override the embedded method runs (the stand-in's own rule)
    c38.call_site(c38.attention_pytorch, q, k, v, 2, {}, as_containers, preferred_attention=preferred)
    assert embedded == [1]


@pytest.mark.parametrize("as_containers", [False, True])
@pytest.mark.parametrize("backend, note", [
    ("sage", "'sage' refused, '"),
    ("auto_fast", "auto_fast kept to exact kernels (auto_exact)"),
    ("native", "'native' is exact"),
    ("auto_exact", "auto_exact picks exact kernels only"),
])
def test_low_precision_false_is_kept_exact_and_counted(as_containers, backend, note):
    """WAN I2V image cross-attention passes low_precision_attention=False (quantised attention gives NaN there)."""
    fn = ours(backend)
    q, k, v = c38.flat_qkv(lk=8)
    for _ in range(3):
        out = c38.call_site(c38.attention_pytorch, q, k, v, 2, options(fn), as_containers,
                            low_precision_attention=False)
        torch.testing.assert_close(out, ref(q, k, v), atol=2e-5, rtol=1e-4)
    c38.call_site(c38.attention_pytorch, q, k, v, 2, options(fn), as_containers)  # not counted
    (site, what), = fn.config.precision_notes  # kept per block (each call here is a forward of its own: block 0)
    assert site == "cross #0" and what.startswith(note) and fn.config.precision_notes[(site, what)] == 3
    if backend == "sage":  # the refusal in support.why_not's words
        assert what.endswith(" serves instead: " + support.why_not("sage", rules=FULL_PRECISION).rules[0])
    served_by = set(served(fn.config.recorder))
    assert not any(registry.get(name).quantised for name in served_by if name in registry.names())


def test_no_exact_backend_falls_back_to_a_quantised_one():
    """What `low_precision_attention=False` relies on: a quantised backend's replacement, and every fallback after it,
    is exact."""
    for name in registry.names():
        if not registry.get(name).quantised:
            assert not [b for b in dispatcher.fallback_order(name) if registry.get(b).quantised], name


def test_low_precision_false_passed_on_keeps_the_flag_and_is_counted():
    fn = ours("sage", window=(0.5, 1.0))
    q, k, v = c38.flat_qkv()
    schedule = torch.tensor([2.0, 1.0, 0.0])
    c38.call_site(c38.attention_pytorch, q, k, v, 2, options(fn, sample_sigmas=schedule, sigmas=schedule[:1]), True,
                  low_precision_attention=False)
    assert CALLS[0]["low_precision_attention"] is False
    (site, what), = fn.config.precision_notes
    assert what == "passed on to comfy:attention_pytorch with the flag (it decides the kernel)"


def test_inside_attn_wrapper_keeps_a_chained_backend_from_recursing():
    """A previous override that calls a wrapped backend with the kwargs it got (so `_inside_attn_wrapper` stays) runs
    that backend; one that drops the flag would re-enter the installed override: a clear error, not a RecursionError."""
    def polite(func, *args, **kwargs):
        return c38.attention_pytorch(*args, **kwargs)

    def rude(func, *args, **kwargs):
        kwargs.pop("_inside_attn_wrapper")
        return c38.attention_pytorch(*args, **kwargs)

    q, k, v = c38.flat_qkv()
    for as_containers in (False, True):
        fn = ours(window=(0.0, 0.0), previous=polite)
        to = options(fn, sample_sigmas=torch.tensor([2.0, 1.0, 0.0]), sigmas=torch.tensor([1.0]))
        torch.testing.assert_close(c38.call_site(c38.attention_pytorch, q, k, v, 2, to, as_containers), ref(q, k, v))
        fn = ours(window=(0.0, 0.0), previous=rude)
        to = options(fn, sample_sigmas=torch.tensor([2.0, 1.0, 0.0]), sigmas=torch.tensor([1.0]))
        with pytest.raises(overrides.OverrideChainError, match="chain loops.*_inside_attn_wrapper"):
            c38.call_site(c38.attention_pytorch, q, k, v, 2, to, as_containers)


# ------------------------------------------------------------------------------------------------ chaining

WINDOW_OUT = {"sample_sigmas": torch.tensor([2.0, 1.0, 0.0]), "sigmas": torch.tensor([2.0])}  # step 0 of 2


@pytest.mark.parametrize("as_containers", [False, True])
@pytest.mark.parametrize("backend_fn", [c38.attention_pytorch, c38.attention_kitchen])
def test_model_attention_backend_upstream_serves_what_the_pack_passes_on(as_containers, backend_fn):
    """Model Attention Backend, then Set Attention Backend: calls outside the window go to the core node's backend
    (its container form takes the containers itself) and the report names it."""
    model_options = {}
    c38.set_model_optimized_attention(model_options, backend_fn)
    core = model_options["transformer_options"][c38.OVERRIDE_KEY]
    fn = ours(window=(0.5, 1.0), previous=core)
    q, k, v = c38.flat_qkv()
    out = c38.call_site(c38.attention_pytorch, q, k, v, 2, options(fn, **WINDOW_OUT), as_containers)
    torch.testing.assert_close(out, ref(q, k, v), atol=2e-5, rtol=1e-4)
    inside = c38.call_site(c38.attention_pytorch, q, k, v, 2, options(fn), as_containers)
    torch.testing.assert_close(inside, ref(q, k, v), atol=2e-5, rtol=1e-4)
    label = f"previous override: ComfyUI Model Attention Backend ({backend_fn.__name__})"
    assert served(fn.config.recorder) == {label: 1, "native": 1}
    assert len(CALLS) == 1  # only the call passed on ran ComfyUI's backend
    assert len(c38.KITCHEN_TAKES) == (1 if as_containers and backend_fn is c38.attention_kitchen else 0)


def test_model_attention_backend_downstream_replaces_the_pack_and_the_report_says_so(monkeypatch):
    """Set Attention Backend, then Model Attention Backend: ComfyUI's last writer wins and the core override never
    passes a call on, so the pack's node serves nothing; its report says who replaced it."""
    nodes = node_stub.install(monkeypatch)
    monkeypatch.setattr(nodes.SetAttentionBackend, "hidden", types.SimpleNamespace(unique_id="3"), raising=False)
    (patched,) = nodes.SetAttentionBackend.execute(node_stub.FakeModel(), "native", "fallback", 0.0, 1.0).result
    after = patched.clone()
    c38.set_model_optimized_attention(after.model_options, c38.attention_pytorch)
    q, k, v = c38.flat_qkv()
    c38.call_site(c38.attention_pytorch, q, k, v, 2, after.model_options["transformer_options"], True)
    report = _run(nodes, after)
    assert report["overridden_by"]["label"] == "ComfyUI Model Attention Backend (attention_pytorch)"
    assert report["overridden_by"]["short"] == "Model Attention Backend"  # the badge's words
    assert report["notes"][-1].startswith("Overridden: ComfyUI Model Attention Backend (attention_pytorch) was "
                                          "installed after this node")
    assert report["recorder"]["calls"] == 0
    # The other order: the node names the core override it takes over from, and the run has no override note.
    model = node_stub.FakeModel()
    c38.set_model_optimized_attention(model.model_options, c38.attention_pytorch)
    (ours_after,) = nodes.SetAttentionBackend.execute(model, "native", "fallback", 0.5, 1.0).result
    report = _run(nodes, ours_after)
    assert report["previous_override"] == "ComfyUI Model Attention Backend (attention_pytorch)"
    assert "overridden_by" not in report and report["notes"][0].startswith("Takes over from ComfyUI Model Attention")


def _run(nodes, model):
    reports = importlib.import_module(f"{PACK}.nodes.reports")
    reports.clear()
    executor = types.SimpleNamespace(class_obj=types.SimpleNamespace(model_options=model.model_options))
    executor_call = type("Executor", (), {"__call__": lambda self, *a, **kw: None,
                                         "class_obj": executor.class_obj})()
    for wrapper in model.outer_wrappers():
        wrapper(executor_call)
    (report,) = reports.latest()["reports"]
    return report


@pytest.mark.parametrize("as_containers", [False, True])
@pytest.mark.parametrize("order", ["sparse_first", "pack_first"])
def test_sparse_attention_in_either_order(as_containers, order):
    """Model Sparse Attention re-installs itself on top every step: in either order it gets each call first, runs
    long self-attention itself and passes the rest on; the pack serves what reaches it and passes on what it does not
    take, and nothing loops."""
    patch = c38.SparsePatch(min_tokens=16)
    to = {}
    if order == "sparse_first":
        patch.install(to)  # the node
        fn = ours(window=(0.5, 1.0), previous=to[c38.OVERRIDE_KEY])
        to[c38.OVERRIDE_KEY] = fn
    else:
        fn = ours(window=(0.5, 1.0))
        to[c38.OVERRIDE_KEY] = fn
        patch.install(to)
    for _ in range(2):  # two steps: the per-step re-install puts it on top once, then leaves it
        patch.install(to)
    assert to[c38.OVERRIDE_KEY] is patch.installed[-1] and overrides.reaches(to[c38.OVERRIDE_KEY], fn)
    long_self, short = c38.flat_qkv(lq=16, lk=16), c38.flat_qkv(lq=8, lk=8)
    for step in (WINDOW_OUT, {}):
        for q, k, v in (long_self, short):
            out = c38.call_site(c38.attention_pytorch, q, k, v, 2, {**to, **step}, as_containers)
            torch.testing.assert_close(out, ref(q, k, v), atol=2e-5, rtol=1e-4)
    assert c38.SPARSE_SERVED == [16, 16]  # the long self-attention, both steps
    label = "previous override: ComfyUI Model Sparse Attention"
    expected = {"native": 1, label: 1} if order == "sparse_first" else {"native": 1, "comfy:comfy_func": 1}
    assert served(fn.config.recorder) == expected  # the short call: inside the window ours, outside passed on
    assert overrides.describe(to[c38.OVERRIDE_KEY]) == "ComfyUI Model Sparse Attention"


@pytest.mark.parametrize("as_containers", [False, True])
def test_another_packs_plain_override_upstream_gets_func_for_container_calls(as_containers):
    """A plain override (no container_function) before the pack: a container call the pack passes on reaches it with
    ComfyUI's default attention as func and the taken tensors."""
    got = []

    def other_pack(func, q, k, v, heads, **kwargs):
        got.append((func, type(q)))
        return func(q, k, v, heads, **kwargs)

    fn = ours(window=(0.5, 1.0), previous=other_pack)
    q, k, v = c38.flat_qkv()
    boxes = c38.containers(q, k, v) if as_containers else (q, k, v)
    out = c38.attention_pytorch(*boxes, 2, transformer_options=options(fn, **WINDOW_OUT))
    torch.testing.assert_close(out, ref(q, k, v), atol=2e-5, rtol=1e-4)
    assert got == [(c38.comfy_func if not as_containers else c38.attention_pytorch, torch.Tensor)]
    assert list(served(fn.config.recorder)) == [f"previous override: {__name__}.test_another_packs_plain_override_upstream_"
                                         "gets_func_for_container_calls.<locals>.other_pack"]


def test_container_call_passed_on_outside_comfyui_is_a_clear_error():
    """By default a container call passed on runs ComfyUI's default attention, imported from ComfyUI when needed."""
    fn = adapter.make_override("comfy default")
    q, k, v = c38.flat_qkv()
    with pytest.raises(RuntimeError, match="ComfyUI's default attention function cannot be imported here"):
        c38.call_site(c38.attention_pytorch, q, k, v, 2, options(fn), True)


# ------------------------------------------------------------------------------------------------ bad input

def test_the_same_container_twice_is_a_clear_error():
    fn = ours()
    q, _, v = c38.flat_qkv()
    box = c38.Container(q)
    with pytest.raises(dispatcher.AttentionInputError, match="same AttentionTensorContainer was passed as q and k"):
        fn.container_function(box, box, c38.Container(v), 2, transformer_options={})
    assert box.takes == 0  # nothing was taken


@pytest.mark.parametrize("k_value, message", [(None, "got no k"), ("tensor", "got k as Tensor, not an Attention")])
def test_a_missing_container_is_a_clear_error(k_value, message):
    fn = ours()
    q, k, v = c38.flat_qkv()
    with pytest.raises(TypeError, match=message):
        fn.container_function(c38.Container(q), k if k_value == "tensor" else None, c38.Container(v), 2,
                              transformer_options={})


@pytest.mark.parametrize("plain", [False, True])
def test_a_consumed_container_is_a_clear_error(plain):
    fn = ours()
    q, k, v = c38.flat_qkv()
    boxes = c38.containers(q, k, v)
    boxes[1].take()
    with pytest.raises(dispatcher.AttentionInputError, match="k AttentionTensorContainer was already taken"):
        if plain:
            fn(c38.comfy_func, *boxes, 2, transformer_options={})
        else:
            fn.container_function(*boxes, 2, transformer_options={})


def test_an_override_chain_that_loops_is_a_clear_error():
    q, k, v = c38.flat_qkv()
    a = ours(window=(0.5, 1.0))
    b = ours(window=(0.5, 1.0), previous=a)
    a.config = dataclasses.replace(a.config, previous=b)  # rewired by hand: a -> b -> a
    with pytest.raises(overrides.OverrideChainError, match="chain loops"):
        overrides.chain(b)
    with pytest.raises(overrides.OverrideChainError, match="chain loops"):
        ours(previous=b)  # the node refuses to build on it
    for as_containers in (False, True):
        with pytest.raises(overrides.OverrideChainError, match="passed a call on .* got the same call back"):
            c38.call_site(c38.attention_pytorch, q, k, v, 2, options(b, **WINDOW_OUT), as_containers)


# ------------------------------------------------------------------------------------------------ names

@pytest.mark.parametrize("name, ours_name", [("sage", "sage"), ("sage3", "sage_blackwell_hub"), ("flash", "flash"),
                                             ("xformers", "xformers"), ("pytorch", "native")])
def test_comfy_names_that_are_our_kernels_are_aliases(monkeypatch, name, ours_name):
    nodes = node_stub.install(monkeypatch)
    assert comfy_versions.resolve(name) == ours_name and comfy_versions.not_offered(name) is None
    assert nodes.SetAttentionBackend.check_inputs(name, "fallback", 0.0, 1.0) is True
    if name == "pytorch":  # runs the pack's native and the report says why
        (m,) = nodes.SetAttentionBackend.execute(node_stub.FakeModel(), name, "fallback", 0.0, 1.0).result
        assert m.override.config.backend == "native"
        assert "'pytorch' is ComfyUI's name for torch scaled_dot_product_attention" in _run(nodes, m)["notes"][0]


@pytest.mark.parametrize("name, fragment", [
    ("sub_quad", "ComfyUI's own sub-quadratic chunked attention"),
    ("split", "ComfyUI's own sliced attention"),
])
def test_comfy_only_names_are_explained_at_queue_time(monkeypatch, name, fragment):
    nodes = node_stub.install(monkeypatch)
    answer = nodes.SetAttentionBackend.check_inputs(name, "fallback", 0.0, 1.0)
    assert isinstance(answer, str) and fragment in answer and "Pick 'comfy default'" in answer


def test_comfy_kitchen_int8_is_ours():
    """ComfyUI's name for comfy-kitchen's INT8 attention is the pack's backend of the same name."""
    assert "comfy_kitchen_int8" in registry.names()
    assert comfy_versions.resolve("comfy_kitchen_int8") == "comfy_kitchen_int8"
    assert comfy_versions.not_offered("comfy_kitchen_int8") is None


def test_another_packs_override_is_named_by_its_folder_not_its_path():
    """ComfyUI 0.3.64 imports a custom node pack under its folder's path; a report never shows a path."""
    def override(func, *args, **kwargs):
        return func(*args, **kwargs)
    override.__module__ = "/home/user/ComfyUI/custom_nodes/OtherPack"
    assert overrides.describe(override) == "OtherPack.test_another_packs_override_is_named_by_its_folder_not_its_" \
                                           "path.<locals>.override"


def test_backends_route_lists_comfy_names():
    routes = importlib.import_module(f"{PACK}.nodes.routes")
    names = routes.backends_payload()["comfy_names"]
    assert set(names) == {"sage", "sage3", "flash", "xformers", "pytorch", "sub_quad", "split", "comfy_kitchen_int8"}
    assert names["pytorch"]["backend"] == "native" and names["pytorch"]["refused"] is None
    assert names["split"]["backend"] is None and "comfy default" in names["split"]["refused"]


def test_embedded_attention_method_is_reported(monkeypatch):
    nodes = node_stub.install(monkeypatch)
    layer = torch.nn.Linear(2, 2)
    layer.comfy_attention = types.SimpleNamespace(config={"attention": "comfy_kitchen_int8"})
    model = node_stub.FakeModel()
    model.model = types.SimpleNamespace(diffusion_model=torch.nn.Sequential(layer, torch.nn.Linear(2, 2)))
    assert comfy_versions.embedded_methods(model) == {"comfy_kitchen_int8": 1}
    (m,) = nodes.SetAttentionBackend.execute(model, "native", "fallback", 0.0, 1.0).result
    note, = [n for n in _run(nodes, m)["notes"] if "embeds" in n]
    assert "'comfy_kitchen_int8' in 1 modules" in note and "does not show it to an override" in note


# ------------------------------------------------------------------------------------------------ node reports

def _sample(nodes, model, *calls):
    """One sampling run of `model`: its OUTER_SAMPLE wrappers around an executor that makes `calls` (transformer
    options -> None) on the run's model options; the node's report."""
    reports = importlib.import_module(f"{PACK}.nodes.reports")
    reports.clear()
    guider = types.SimpleNamespace(model_options=model.model_options)

    class Executor:
        class_obj = guider

        def __call__(self, *args, **kwargs):
            for call in calls:
                call(guider.model_options["transformer_options"])

    for wrapper in model.outer_wrappers():
        wrapper(Executor())
    (report,) = [r for r in reports.latest()["reports"] if r["kind"] == "model"]
    return report


def test_report_counts_the_calls_kept_exact(monkeypatch):
    nodes = node_stub.install(monkeypatch)
    (m,) = nodes.SetAttentionBackend.execute(node_stub.FakeModel(), "sage", "fallback", 0.0, 1.0).result
    q, k, v = c38.flat_qkv(lk=8)

    def image_cross_attention(to):
        c38.call_site(c38.attention_pytorch, q, k, v, 2, to, True, low_precision_attention=False)

    report = _sample(nodes, m, image_cross_attention, image_cross_attention)
    (row,) = report["full_precision"]
    assert row["site"] == "cross" and row["calls"] == 2
    assert row["reason"].startswith("'sage' refused, '") and row["reason"].endswith(
        " serves instead: " + support.why_not("sage", rules=FULL_PRECISION).rules[0])
    assert any(n.startswith("Kept exact: 2 calls with low_precision_attention=False") for n in report["notes"])


@pytest.mark.parametrize("checks_after", [False, True])
def test_report_of_a_node_under_sparse_attention_and_one_replaced(monkeypatch, checks_after):
    """Model Sparse Attention installed after the node: the node still serves the dense calls, and its report says the
    sparse node sees each call first. Attention Checks rebuilding the node's override is still the node."""
    nodes = node_stub.install(monkeypatch)
    (m,) = nodes.SetAttentionBackend.execute(node_stub.FakeModel(), "native", "fallback", 0.0, 1.0).result
    if checks_after:
        (m,) = nodes.AttentionChecks.execute(m, "warn", False, 1).result
    patch = c38.SparsePatch(min_tokens=16)
    short = c38.flat_qkv(lq=8, lk=8)

    def step(to):
        patch.install(to)  # the sparse node's per-step re-install
        c38.call_site(c38.attention_pytorch, *short, 2, to, True)

    report = _sample(nodes, m, step, step)
    assert report["recorder"]["calls"] == 2 and "overridden_by" not in report
    assert any("ComfyUI Model Sparse Attention gets each attention call before this node" in n
               for n in report["notes"])

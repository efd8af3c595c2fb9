"""Issue #14 on the ComfyUI side, without ComfyUI: the two autos in the dropdown, the quality guard and the block
range of Set Attention Backend (inputs, queue-time checks, what the override passes to the dispatcher), the model
identity, and what the report says (guard results, fallbacks on every call, a block range that cannot apply).
A stub recorder sees every event the override forwards. The same in a real ComfyUI: tests/integration/test_issue14.py.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import importlib
import types

import pytest
import torch
import torch.nn.functional as F

from helpers import node_stub, tensors
from helpers.pack import CALLS, PACK, comfy_func, load_pack

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

adapter, dispatcher, _ = load_pack()
blocks = importlib.import_module(f"{PACK}.nodes.blocks")
comfy_versions = importlib.import_module(f"{PACK}.nodes.comfy_versions")
identity = importlib.import_module(f"{PACK}.nodes.model_identity")
reports = importlib.import_module(f"{PACK}.nodes.reports")
events = dispatcher.events  # the pack's copy: its guard sends these

qkv = functools.partial(tensors.qkv, b=1, lq=16, lk=16, h=2, d=16, flat=True)  # ComfyUI's (B, L, H*D)


def opts(**to):
    return {"transformer_options": to}


def ref(q, k, v, heads=2):
    d = q.shape[-1] // heads
    q, k, v = (t.unflatten(-1, (heads, d)).transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)


class StubRecorder:
    """Every event, in order: what the dispatcher records in the override's recorder (the guard's as
    dispatcher.events objects)."""

    def __init__(self):
        self.events = []

    def record(self, site, requested, served, reasons=()):
        self.events.append(("record", site, requested, served, tuple(reasons)))

    def record_error(self, site, backend, error):
        self.events.append(("error", site, backend, error))

    def record_guard(self, event):
        self.events.append(event)

    def of(self, kind):
        """The events of `kind`: "record", "error", or a class of dispatcher.events."""
        if isinstance(kind, str):
            return [e for e in self.events if isinstance(e, tuple) and e[0] == kind]
        return [e for e in self.events if isinstance(e, kind)]


@pytest.fixture(autouse=True)
def _clear():
    CALLS.clear()


@pytest.fixture
def spy(monkeypatch):
    """The dispatcher's keyword arguments of every call the override makes: a prepared call's fixed ones (one
    per plan, `PreparedAttention`, called plain or `keyed`), or those of a direct `dispatch_attention_fn` call (a
    plan not kept)."""
    seen = []
    prepared, direct = adapter.PreparedAttention, adapter.dispatch_attention_fn

    class Spy(prepared):
        __slots__ = ("fixed", "keying")

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.fixed, self.keying = kwargs, False

        def __call__(self, *args):
            if not self.keying:  # a keyed call that goes the full way is counted once, as keyed
                seen.append(self.fixed)
            return super().__call__(*args)

        def keyed(self, *args):
            seen.append(self.fixed)
            self.keying = True
            try:
                return super().keyed(*args)
            finally:
                self.keying = False

    def fn(*args, **kwargs):
        seen.append(kwargs)
        return direct(*args, **kwargs)

    monkeypatch.setattr(adapter, "PreparedAttention", Spy)
    monkeypatch.setattr(adapter, "dispatch_attention_fn", fn)
    return seen


@pytest.fixture
def custom_backend():
    """Register pack-dispatcher backends for one test (the suite's fixture cleans the top-level dispatcher only)."""
    names = []

    def add(name, fn, quantised=True):
        dispatcher.register_backend(name, fn, devices=("cpu",), quantised=quantised)
        names.append(name)
        return name

    yield add
    for name in names:
        dispatcher.unregister_backend(name)


# ------------------------------------------------------------------------------------------------ the adapter


def test_override_passes_model_and_guard_settings_once_worked_out(spy):
    fn = adapter.make_override("native", model="TestModel:abc", guard="all", guard_every=3)
    assert fn.guard_setting == ("all", 3)  # the dispatcher's (mode, every), computed once, taken as is per call
    fn(comfy_func, *qkv(), 2, **opts())
    assert spy[-1]["model"] == "TestModel:abc" and spy[-1]["guard"] == ("all", 3)
    plain = adapter.make_override("native")
    plain(comfy_func, *qkv(), 2, **opts())
    assert spy[-1]["model"] is None and spy[-1]["guard"] is None  # the dispatcher's scope and default
    only_every = adapter.make_override("native", guard_every=7)
    assert only_every.guard_setting == ("quantised", 7)
    with pytest.raises(ValueError):
        adapter.make_override("native", guard="sometimes")


def test_auto_fast_is_auto_exact_where_the_model_asks_for_full_precision(spy):
    q, k, v = qkv()
    for backend, kept in (("auto_fast", "auto_fast kept to exact kernels (auto_exact)"),
                          ("auto", "auto kept to exact kernels (auto_exact)"),
                          ("auto_exact", "auto_exact picks exact kernels only")):
        rec = dispatcher.Recorder()
        fn = adapter.make_override(backend, recorder=rec)
        out = fn(comfy_func, q, k, v, 2, low_precision_attention=False, **opts())
        torch.testing.assert_close(out, ref(q, k, v), atol=2e-5, rtol=1e-4)
        assert spy[-1]["backend"] == backend and spy[-1]["rules"] == adapter.FULL_PRECISION
        assert list(fn.config.precision_notes) == [("self", kept)]  # the dispatcher's decision, counted
        assert {r["requested"] for r in rec.snapshot()["rows"]} == {backend}  # the report shows what was asked
        fn(comfy_func, q, k, v, 2, **opts())
        assert spy[-1]["backend"] == backend and spy[-1]["rules"] is None  # elsewhere as asked


def test_quantised_backend_swap_is_kept(spy):
    """The override asks for the backend the node names, with the rules that keep the call exact: the dispatcher
    swaps the kernel and records the call under the backend asked for, in the node's own recorder."""
    rec = StubRecorder()
    fn = adapter.make_override("sage", recorder=rec)
    for _ in range(3):  # the first call decides, the next ones take the lane: each says why another served it
        fn(comfy_func, *qkv(), 2, low_precision_attention=False, **opts())
    assert spy[-1]["backend"] == "sage" and spy[-1]["rules"] == dispatcher.Rules(low_precision=False)
    assert spy[-1]["recorder"] is rec  # no recorder of the override's own in between
    ((_, note),) = fn.config.precision_notes
    records = rec.of("record")
    assert len(records) == 3 and len(set(records)) == 1
    (_, site, requested, served, reasons), = set(records)
    assert requested == "sage" and not dispatcher.get_backend_spec(served).quantised and reasons == (note,)
    assert note.startswith(f"'sage' refused, '{served}' serves instead: ") and "low_precision_attention=False" in note


def test_guard_catches_a_kernel_that_goes_wrong_mid_run_through_the_override(custom_backend):
    """A quantised kernel, exact for 3 calls and then noisy: with guard_every=1 the first bad call is recomputed
    (the caller gets exact attention), the stub recorder hears the failure and its replacement, and the kernel is
    demoted for this model: later calls are served by the replacement."""
    calls = {"n": 0}

    def drifting(q, k, v, **_):
        calls["n"] += 1
        out = tensors.sdpa(q, k, v)
        return out if calls["n"] <= 3 else out + torch.randn_like(out)

    name = custom_backend("t14_drift", drifting)
    stub = StubRecorder()
    fn = adapter.make_override(name, recorder=stub, model="t14:drift-model", guard="quantised", guard_every=1)
    q, k, v = qkv()
    for _ in range(6):
        torch.testing.assert_close(fn(comfy_func, q, k, v, 2, **opts()), ref(q, k, v), atol=2e-5, rtol=1e-4)
    # the node's own recorder hears the guard: the override puts no recorder of its own in between
    assert isinstance(stub, events.RecorderProtocol)
    assert len(stub.of(events.GuardChecked)) == 3
    (failure,) = stub.of(events.GuardFailed)
    assert failure.backend == name and failure.replacement
    assert not dispatcher.get_backend_spec(failure.replacement).quantised
    served = [e[3] for e in stub.of("record")]
    assert served[:3] == [name] * 3 and name not in served[3:], served
    # another model's verdict is its own: the kernel serves it again
    other = StubRecorder()
    adapter.make_override(name, recorder=other, model="t14:another-model", guard="off")(comfy_func, q, k, v, 2,
                                                                                       **opts())
    assert [e[3] for e in other.of("record")] == [name]


def test_guard_off_never_checks(custom_backend):
    name = custom_backend("t14_noisy", lambda q, k, v, **_: torch.randn_like(q))
    stub = StubRecorder()
    fn = adapter.make_override(name, recorder=stub, model="t14:off", guard="off", guard_every=1)
    fn(comfy_func, *qkv(), 2, **opts())
    assert not stub.of(events.GuardChecked) and not stub.of(events.GuardFailed)


# ------------------------------------------------------------------------------------------------ blocks


@pytest.mark.parametrize("to, expected", [
    ({"block_index": 3, "total_blocks": 10}, (3, 10, None)),
    ({"transformer_index": 2, "block_index": 0, "block": ("input", 1)}, (2, None, 0)),  # the UNet: inner = block_index
    ({"block_index": 3, "total_blocks": 0, "transformer_index": 7}, (3, None, None)),  # a DiT's index, no count
    ({"block_index": 3}, None),  # no count and no transformer index: unusable
    ({}, None),
    (None, None),
    ({"block_index": True, "total_blocks": 4}, None),
])
def test_block_position(to, expected):
    assert comfy_versions.block_position(to) == expected


@pytest.mark.parametrize("rng, index, total, expected", [
    ((2, 5), 1, 10, False), ((2, 5), 2, 10, True), ((2, 5), 5, 10, True), ((2, 5), 6, 10, False),
    ((0, -3), 7, 10, True), ((0, -3), 8, 10, False), ((-2, -1), 8, 10, True), ((-2, -1), 7, 10, False),
    ((5, -10), 5, 10, False),  # resolves to 5..0: no block
    ((1, -1), 0, None, False), ((1, -1), 15, None, True), ((1, 2), 3, None, False),
])
def test_in_blocks(rng, index, total, expected):
    to = {"block_index": index, "total_blocks": total} if total else {"transformer_index": index}
    assert blocks.in_blocks(comfy_versions.block_position(to), rng) is expected


def test_in_blocks_says_why_the_range_cannot_apply():
    assert blocks.in_blocks(comfy_versions.block_position({}), (2, -1)) == blocks.NO_POSITION
    assert "ComfyUI 0.3.64's WAN and Flux do not" in blocks.NO_POSITION
    assert blocks.in_blocks(comfy_versions.block_position({"transformer_index": 3}), (-2, -1)) == blocks.NO_COUNT
    assert blocks.in_blocks(comfy_versions.block_position({"transformer_index": 3}), (0, -2)) == blocks.NO_COUNT


def test_range_problem_at_queue_time():
    assert blocks.range_problem(5, 2).startswith("block_start 5 is after block_end 2")
    assert blocks.range_problem(-1, -3).startswith("block_start -1 is after block_end -3")
    assert blocks.range_problem(2, 5) is None and blocks.range_problem(3, -1) is None
    assert blocks.range_problem(-3, 2) is None  # depends on the model's block count


def test_calls_outside_the_block_range_go_to_the_previous_override_with_the_reason():
    seen = []

    def previous(func, *args, **kwargs):
        seen.append(kwargs["transformer_options"]["block_index"])
        return func(*args, **kwargs)

    rec = dispatcher.Recorder()
    fn = adapter.make_override("native", recorder=rec, blocks=(1, -2), previous=previous)
    q, k, v = qkv()
    for i in range(4):
        out = fn(comfy_func, q, k, v, 2, **opts(block_index=i, total_blocks=4))
        torch.testing.assert_close(out, ref(q, k, v), atol=2e-5, rtol=1e-4)
    assert seen == [0, 3]
    # one row per block; "previous override: <its name>"
    rows = {(r["site"], r["served"].split(":")[0]): r for r in rec.snapshot()["rows"]}
    assert {site: served for site, served in rows} == {"self #0": "previous override", "self #1": "native",
                                                        "self #2": "native", "self #3": "previous override"}
    assert rows[("self #0", "previous override")]["reasons"] == ["outside the block range 1..-2"]
    assert not fn.config.block_notes
    # without a previous override: ComfyUI's own attention
    fn2 = adapter.make_override("native", blocks=(0, 0))
    fn2(comfy_func, q, k, v, 2, **opts(transformer_index=1))
    assert len(CALLS) == 3


# ------------------------------------------------------------------------------------------------ block identity


def sites_of(spy, start=0):
    return [kw["call_site"] for kw in spy[start:]]


@pytest.mark.parametrize("to, site", [
    ({"block_index": 5, "total_blocks": 30}, "self #5"),  # newer ComfyUI's WAN, Lumina, Qwen
    ({"block_index": 3, "total_blocks": 19, "block_type": "double"}, "double.self #3"),  # newer Flux
    ({"transformer_index": 4, "block_index": 1, "block": ("input", 7)}, "input.self #4.1"),  # the SD/SDXL UNet
    ({"transformer_index": 2}, "self #2"),
])
def test_call_sites_name_the_block_comfyui_passes(spy, to, site):
    fn = adapter.make_override("native")
    fn(comfy_func, *qkv(), 2, **opts(**to))
    assert sites_of(spy) == [site]


def wan_forward(fn, n_blocks, **to):
    """One forward of a model that passes no block position (ComfyUI 0.3.64's WAN): each block calls self- then
    cross-attention with the same options dict, which ComfyUI makes anew for each forward (its cond_or_uncond)."""
    q, k, v = qkv()
    _, k2, v2 = qkv(lk=8)
    options = {"cond_or_uncond": [0, 1], "sigmas": torch.ones(1), **to}
    for _ in range(n_blocks):
        fn(comfy_func, q, k, v, 2, transformer_options=options)
        fn(comfy_func, q, k2, v2, 2, transformer_options=options)


def test_without_positions_a_call_is_named_by_its_ordinal_in_the_forward(spy):
    """Counted per kind of call and reset at each forward: cond and uncond batched (one forward) or run one after
    the other (two forwards, each its own cond_or_uncond list) number the blocks the same way."""
    fn = adapter.make_override("native")
    wan_forward(fn, 3)
    expected = ["self #0", "cross #0", "self #1", "cross #1", "self #2", "cross #2"]
    assert sites_of(spy) == expected
    for start in (6, 12, 18):  # three more forwards: cond, uncond run apart, then batched again
        wan_forward(fn, 3)
        assert sites_of(spy, start) == expected
    # a copy of the options made inside the forward (a patch) still counts as the same forward: it shares the list
    options = {"cond_or_uncond": [0], "sigmas": torch.ones(1)}
    q, k, v = qkv()
    fn(comfy_func, q, k, v, 2, transformer_options=options)
    fn(comfy_func, q, k, v, 2, transformer_options=dict(options))
    assert sites_of(spy, 24) == ["self #0", "self #1"]


def test_delegated_calls_are_counted_too_so_ordinals_stay_block_numbers(spy):
    fn = adapter.make_override("native", window=(0.0, 1.0))
    wan_forward(fn, 2)
    assert sites_of(spy) == ["self #0", "cross #0", "self #1", "cross #1"]


def test_calls_without_transformer_options_name_no_block(spy):
    fn = adapter.make_override("native")
    q, k, v = qkv()
    fn(comfy_func, q, k, v, 2)
    fn(comfy_func, q, k, v, 2)
    assert sites_of(spy) == ["self", "self"]


def test_a_quantised_kernel_wrong_on_one_block_is_caught_there_through_the_override(custom_backend):
    """Three WAN-like blocks without positions share one signature; the kernel is wrong where the queries are
    large (block 1 only). Its first call there is compared and recomputed: every output is exact, the kernel is
    demoted for "self #1" only, and the report names that block."""
    def kernel(q, k, v, **_):  # (B, S, H, D)
        out = tensors.sdpa(q, k, v)
        return out + torch.randn_like(out) if q.abs().amax() > 20 else out

    name = custom_backend("t_one_block_int8", kernel)
    rec = dispatcher.Recorder()
    fn = adapter.make_override(name, recorder=rec, model="t29:one-block")
    q, k, v = qkv()
    for step in range(3):
        options = {"cond_or_uncond": [0], "sigmas": torch.ones(1)}
        for block in range(3):
            qb = q * 30 if block == 1 else q
            out = fn(comfy_func, qb, k, v, 2, transformer_options=options)
            torch.testing.assert_close(out, ref(qb, k, v), atol=1e-4, rtol=1e-4)
    served = {(r["site"], r["served"]) for r in rec.snapshot()["rows"]}
    assert served == {("self #0", name), ("self #1", "native"), ("self #2", name)}, served
    failed = [g for g in reports.guard_results(rec.snapshot()) if g["failures"]]
    assert [g["site"] for g in failed] == ["self #1"] and "self #1" in failed[0]["text"]


def test_no_block_position_uses_the_backend_everywhere_and_notes_each_site_once():
    notes = {}
    rec = dispatcher.Recorder()
    fn = adapter.make_override("native", recorder=rec, blocks=(2, -1), block_notes=notes)
    q, k, v = qkv()
    _, k2, v2 = qkv(lk=8)
    for _ in range(3):
        fn(comfy_func, q, k, v, 2, **opts())
        fn(comfy_func, q, k2, v2, 2, **opts())
    assert notes == {"self": blocks.NO_POSITION, "cross": blocks.NO_POSITION}
    assert {r["served"] for r in rec.snapshot()["rows"]} == {"native"} and rec.total_calls == 6
    assert not CALLS


def test_the_default_range_costs_nothing_per_call(monkeypatch):
    def boom(*_):
        raise AssertionError("in_blocks called for the default range")

    monkeypatch.setattr(adapter, "in_blocks", boom)
    for rng in (None, (0, -1)):
        fn = adapter.make_override("native", blocks=rng)
        assert fn.config.blocks is None
        fn(comfy_func, *qkv(), 2, **opts(block_index=1, total_blocks=4))


def test_checks_node_rebuild_keeps_model_guard_and_blocks():
    notes = {}
    fn = adapter.make_override("native", model="M:1", guard="all", guard_every=2, blocks=(1, 2), block_notes=notes)
    rebuilt = adapter.override_for(dataclasses.replace(fn.config, checks="warn"))
    assert (rebuilt.config.model, rebuilt.guard_setting, rebuilt.config.blocks) == ("M:1", ("all", 2), (1, 2))
    assert rebuilt.config.block_notes is notes and rebuilt.config.checks == "warn"
    assert copy.deepcopy(fn) is fn


# ------------------------------------------------------------------------------------------------ model identity


class Patcher:
    def __init__(self, net, patches=None):
        self.model = types.SimpleNamespace(diffusion_model=net)
        self.patches = patches or {}


def _net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))


def test_model_key_is_stable_and_tells_models_apart():
    net = _net()
    key = identity.model_key(Patcher(net))
    assert key.startswith("Sequential:") and len(key.split(":")[1]) == 12
    assert identity.model_key(Patcher(net)) == key
    assert identity.model_key(Patcher(copy.deepcopy(net))) == key  # same weights, another object
    assert identity.model_key(Patcher(_net(seed=1))) != key
    lora = {"0.weight": [(1.0, (torch.ones(8, 1), torch.ones(1, 8)), 1.0, None, None)]}
    with_lora = identity.model_key(Patcher(net, lora))
    assert with_lora != key
    weaker = {"0.weight": [(0.5, lora["0.weight"][0][1], 1.0, None, None)]}
    assert identity.model_key(Patcher(net, weaker)) not in (key, with_lora)
    other_lora = {"0.weight": [(1.0, (torch.zeros(8, 1), torch.ones(1, 8)), 1.0, None, None)]}
    assert identity.model_key(Patcher(net, other_lora)) not in (key, with_lora)


def test_two_checkpoints_of_one_architecture_are_two_models():
    """The key once read the first, middle and last parameter only: two checkpoints that differed elsewhere (here
    the second layer's weight, as a fine-tune that froze the rest leaves them) shared one key, so a kernel admitted
    on one served the other unjudged. Every tensor is read now (SAMPLES elements of each)."""
    base = _net()
    tuned = copy.deepcopy(base)
    with torch.no_grad():
        tuned[1].weight.add_(1e-3 * torch.randn_like(tuned[1].weight))
    assert [p.shape for p in base.parameters()] == [p.shape for p in tuned.parameters()]
    assert identity.model_key(Patcher(base)) != identity.model_key(Patcher(tuned))
    with torch.no_grad():  # a buffer differs (a norm's running statistics)
        bn, bn2 = torch.nn.BatchNorm1d(8), torch.nn.BatchNorm1d(8)
        bn2.running_mean.add_(0.5)
    assert identity.model_key(Patcher(bn)) != identity.model_key(Patcher(bn2))


def test_model_key_is_the_same_whatever_the_weights_memory_layout_or_in_place_patches():
    """The same values give the same key: in another memory layout (a transposed copy, as channels_last is), and
    with a LoRA applied in place by ComfyUI while the model is loaded (the patcher's backup holds the original)."""
    net = _net()
    key = identity.model_key(Patcher(net))
    strided = copy.deepcopy(net)
    strided[1].weight.data = strided[1].weight.data.t().contiguous().t()
    assert not strided[1].weight.is_contiguous() and identity.model_key(Patcher(strided)) == key
    lora = {"diffusion_model.0.weight": [(1.0, (torch.ones(8, 1), torch.ones(1, 8)), 1.0, None, None)]}
    unloaded = Patcher(net, lora)
    loaded = Patcher(copy.deepcopy(net), lora)
    original = loaded.model.diffusion_model[0].weight.detach().clone()
    with torch.no_grad():
        loaded.model.diffusion_model[0].weight.add_(torch.ones(8, 8))  # ComfyUI's patch_model, in place
    Dimension = collections.namedtuple("Dimension", ["weight", "inplace_update"])
    loaded.backup = {"diffusion_model.0.weight": Dimension(original, True)}
    assert identity.model_key(loaded) == identity.model_key(unloaded) != key


def test_model_key_never_fails_on_odd_objects():
    for odd in (None, object(), types.SimpleNamespace(model=None), Patcher(torch.nn.Module()),
                Patcher(_net(), patches={"x": "not a list", 3: [None, ("odd",)]}), node_stub.FakeModel()):
        key = identity.model_key(odd)
        assert isinstance(key, str) and key
    meta = torch.nn.Linear(4, 4, device="meta")
    assert identity.model_key(Patcher(meta)).startswith("Linear:")
    half = _net().to(torch.bfloat16)
    assert identity.model_key(Patcher(half)) != identity.model_key(Patcher(_net()))


# ------------------------------------------------------------------------------------------------ reports


def _snapshot(rows, guard=()):
    autos = dispatcher.auto.PSEUDO_BACKENDS  # serving an auto's choice is no fallback
    return {"rows": [{"site": s, "requested": r, "served": v, "calls": n, "fell_back": r != v and r not in autos,
                      "reasons": list(why)} for s, r, v, n, why in rows], "guard": list(guard)}


def test_every_call_fallbacks():
    every = reports.every_call_fallbacks(_snapshot([
        ("self", "flex", "native", 8, ["flex: needs torch.compile"]),
        ("cross", "flex", "native", 8, ["flex: needs torch.compile"]),
        ("self", "flex", "comfy:attention_pytorch", 4, ["outside the step window 0.5..1"]),  # delegated
    ]))
    assert len(every) == 1 and every[0]["every_site"] and every[0]["sites"] == ["cross", "self"]
    assert every[0]["text"] == "flex fell back to native on every call: flex: needs torch.compile"
    partial = reports.every_call_fallbacks(_snapshot([
        ("self", "flash", "flash", 8, []), ("cross", "flash", "native", 8, ["flash: no masks"])]))
    assert [e["text"] for e in partial] == ["flash fell back to native on every call at cross: flash: no masks"]
    assert reports.every_call_fallbacks(_snapshot([("self", "flash", "flash", 8, []),
                                                   ("self", "flash", "native", 1, ["once"])])) == []
    assert reports.every_call_fallbacks(_snapshot([("self", "auto_exact", "native", 8, [])])) == []
    assert reports.every_call_fallbacks({}) == []
    # a kernel the guard demoted at each site (another reason per site): one line, every call
    (demoted,) = reports.every_call_fallbacks(_snapshot([("self", "k", "native", 6, ["guard at self"]),
                                                         ("cross", "k", "native", 6, ["guard at cross"])]))
    assert demoted["every_site"] and demoted["text"] == "k fell back to native on every call: guard at cross; guard at self"


def test_every_call_fallbacks_name_a_kind_of_site_once_when_all_its_blocks_fell_back():
    rows = [(name(index=i), "flash", "native", 4, ["no flash-attn"]) for i in range(3)]
    (every,) = reports.every_call_fallbacks(_snapshot(rows + [(name("cross", index=0), "flash", "native", 4,
                                                               ["no flash-attn"])]))
    assert every["sites"] == ["cross", "self"] and every["every_site"]
    # the guard demoted the kernel on one block of three: that block alone, by name
    rows = [(name(index=0), "sage", "sage", 4, []), (name(index=1), "sage", "fa3", 4, ["quality guard at self #1"]),
            (name(index=2), "sage", "sage", 4, [])]
    (every,) = reports.every_call_fallbacks(_snapshot(rows))
    assert every["sites"] == ["self #1"] and not every["every_site"]
    assert every["text"] == "sage fell back to fa3 on every call at self #1: quality guard at self #1"


def name(kind="self", stream=None, index=None, inner=None) -> str:
    """The call site the override names a block by (as `blocks.block_id` makes it: its fields kept for the report)."""
    to = {"block_type": stream} if stream else {"cond_or_uncond": []}
    return blocks.block_id(to, None if index is None else (index, None, inner), None, kind == "self",
                           compiling=False).text


def test_guard_results_and_block_results():
    out = reports.guard_results(_snapshot([], guard=[
        {"site": "self", "backend": "sage", "checks": 4, "max_error": 0.012, "failures": []},
        {"site": "cross", "backend": "sage", "checks": 2, "max_error": None,
         "failures": [{"reason": "its output has 3 NaN/Inf values", "replacement": "native"}]}]))
    assert out[1]["text"] == "quality guard: sage at self: 4 checks, max error 1.2e-02"  # failures first
    assert "FAILED (its output has 3 NaN/Inf values): that call was recomputed with native" in out[0]["text"]
    # blocks: the ones that passed fold into one entry per kind of site, a failed one keeps its block
    out = reports.guard_results(_snapshot([], guard=[
        *({"site": name(index=i), "backend": "sage", "checks": 2, "max_error": 0.001 * i, "every": 8 + i % 3,
           "failures": []} for i in range(30) if i != 5),
        {"site": "self #5", "backend": "sage", "checks": 1, "max_error": None,
         "failures": [{"reason": "relative error 4.9e-01", "replacement": "fa3"}]}]))
    assert [(g["site"], g["blocks"], g["checks"]) for g in out] == [("self #5", 1, 1), ("self", 29, 58)]
    assert [g["block"] for g in out] == [{"kind": "self", "stream": None, "index": 5, "inner": None},
                                         {"kind": "self", "stream": None, "index": None, "inner": None}]
    assert out[0]["text"].startswith("quality guard: sage at self #5: 1 check; FAILED (relative error 4.9e-01)")
    assert "demoted for this block of this model" in out[0]["text"]
    assert out[1]["text"] == ("quality guard: sage at self (29 blocks): 58 checks, max error 2.9e-02; each block "
                              "checked again within 10 of its calls")  # the longest interval of the blocks folded
    assert reports.site_kind(name("self", "input", 4, 1)) == "input.self" and reports.site_kind("cross") == "cross"
    b = reports.block_results({"range": [2, -1]}, {"self": blocks.NO_POSITION, "cross": blocks.NO_POSITION})
    assert b["range"] == [2, -1] and b["unapplied"][0]["sites"] == ["cross", "self"]
    assert b["unapplied"][0]["text"].startswith("block range 2..-1 not applied at cross, self: this model tells")


# ------------------------------------------------------------------------------------------------ the node


@pytest.fixture
def nodes(monkeypatch):
    return node_stub.install(monkeypatch)


class SamplingRun:
    """ComfyUI's WrapperExecutor for OUTER_SAMPLE: the 'sampling' makes attention calls through the model's
    override (the same transformer options every call)."""

    def __init__(self, model, calls=2, **to):
        self.model, self.calls, self.to = model, calls, to
        self.class_obj = types.SimpleNamespace(model_options=model.model_options)

    def __call__(self, *args, **kwargs):
        q, k, v = qkv()
        for _ in range(self.calls):
            self.model.override(comfy_func, q, k, v, 2, transformer_options=dict(self.to))
        return "latent"


def _report(model, **run):
    reports.clear()
    for wrapper in model.outer_wrappers():
        wrapper(SamplingRun(model, **run))
    return reports.latest()["reports"][-1]


def test_dropdown_lists_the_two_autos_first_and_still_accepts_auto(nodes):
    options = nodes.backend_options()
    assert options[:3] == ["auto_exact", "auto_fast", "comfy default"] and "auto" not in options
    assert nodes.SET_FIELDS[0].default == "auto_exact" and nodes.CLIP_FIELDS[0].default == "auto_exact"
    good = {"policy": "strict", "start_percent": 0.0, "end_percent": 1.0}
    for backend in ("auto", "auto_exact", "auto_fast"):
        assert nodes.SetAttentionBackend.check_inputs(backend, **good) is True
        assert nodes.SetClipAttentionBackend.check_inputs(backend, "strict") is True
    assert "auto_exact, auto_fast, comfy default" in nodes.SetAttentionBackend.check_inputs("aut", **good)
    tooltip = nodes.SET_FIELDS[0].tooltip
    assert "never a quantised kernel" in tooltip and "5e-02" in tooltip and "quality guard" in tooltip


@pytest.mark.parametrize("inputs, expected", [
    ({"quality_guard": "sometimes"}, "quality_guard: unknown quality guard mode 'sometimes'. Valid: quantised kernels, "
                                     "every kernel, off"),
    ({"quality_guard": "Off"}, "Did you mean 'off'?"),
    ({"guard_every": -1}, "guard_every: -1 is below the minimum 0"),
    ({"guard_every": 2.5}, "guard_every: 2.5 is not a whole number"),
    ({"block_start": 5, "block_end": 2}, "block_start 5 is after block_end 2"),
    ({"block_start": -1, "block_end": -4}, "block_start -1 is after block_end -4"),
    ({"block_start": "x"}, "block_start: 'x' is not a whole number"),
])
def test_new_inputs_are_checked_at_queue_time(nodes, inputs, expected):
    values = {"backend": "native", "policy": "fallback", "start_percent": 0.0, "end_percent": 1.0, **inputs}
    answer = nodes.SetAttentionBackend.check_inputs(**values)
    assert isinstance(answer, str) and expected in answer, answer


def test_new_inputs_are_optional_for_older_prompts(nodes):
    fields = {f.name: f for f in nodes.SET_FIELDS}
    assert all(fields[n].optional for n in ("block_start", "block_end", "quality_guard", "guard_every"))
    assert not any(fields[n].optional for n in ("backend", "policy", "start_percent", "end_percent"))
    assert nodes.SetAttentionBackend.check_inputs("native", "fallback", 0.0, 1.0) is True
    assert nodes.SetAttentionBackend.check_inputs("native", "fallback", 0.0, 1.0, -3, 4, "off", 1) is True
    (m,) = nodes.SetAttentionBackend.execute(node_stub.FakeModel(), "native", "fallback", 0.0, 1.0).result
    assert m.override.guard_setting == ("quantised", nodes.guard.DEFAULT_EVERY) and m.override.config.blocks is None
    assert m.override.config.model.startswith("FakeModel:")


def test_set_node_passes_guard_blocks_and_model_and_reports_them(nodes):
    (m,) = nodes.SetAttentionBackend.execute(node_stub.FakeModel(), "native", "fallback", 0.0, 1.0, None, 2, -1,
                                             "every kernel", 5).result
    override = m.override
    config = override.config
    assert override.guard_setting == ("all", 5) and config.blocks == (2, -1) and config.model
    report = _report(m)  # calls with no block position (like ComfyUI 0.3.64's WAN)
    assert report["quality_guard"] == {"mode": "all", "every": 5} and report["model"] == config.model
    (unapplied,) = report["blocks"]["unapplied"]
    assert unapplied["sites"] == ["self"] and unapplied["reason"] == blocks.NO_POSITION
    assert report["guard"] and report["guard"][0]["backend"] == "native" and report["guard"][0]["checks"] == 1
    assert report["fallback_every_call"] == []
    # a run whose calls carry their block (newer DiTs): blocks 0 and 1 go to ComfyUI's attention
    again = _report(m, calls=1, block_index=1, total_blocks=4)
    assert again["blocks"]["unapplied"] == []  # notes are per run
    (row,) = again["recorder"]["rows"]
    assert row["served"].startswith("comfy:") and row["reasons"] == ["outside the block range 2..-1"]
    # the row carries its block's fields beside the site's text: the browser folds by them, reading no text
    assert (row["site"], row["block"]) == ("self #1", {"kind": "self", "stream": None, "index": 1, "inner": None})


def test_set_node_reports_a_fallback_on_every_call(nodes):
    (m,) = nodes.SetAttentionBackend.execute(node_stub.FakeModel(), "flash", "fallback", 0.0, 1.0).result
    report = _report(m)
    (every,) = report["fallback_every_call"]
    assert every["requested"] == "flash" and every["every_site"] and every["text"].startswith(
        f"flash fell back to {every['served'][0]} on every call: ")


def test_chained_block_ranges_name_the_scope(nodes, monkeypatch):
    monkeypatch.setattr(nodes.SetAttentionBackend, "hidden", types.SimpleNamespace(unique_id="1"), raising=False)
    (a,) = nodes.SetAttentionBackend.execute(node_stub.FakeModel(), "native", "fallback", 0.0, 1.0).result
    monkeypatch.setattr(nodes.SetAttentionBackend, "hidden", types.SimpleNamespace(unique_id="2"), raising=False)
    (b,) = nodes.SetAttentionBackend.execute(a, "flex", "fallback", 0.0, 1.0, None, 2, 5).result
    reports.clear()
    for wrapper in b.outer_wrappers():
        wrapper(SamplingRun(b, calls=0))
    got = {r["node"]: r for r in reports.latest()["reports"]}
    assert "wins inside its block range 2..5" in got["1"]["notes"][0]
    assert "outside this node's block range 2..5 #1's backend runs" in got["2"]["notes"][0]
    # calls from blocks outside 2..5 reach the upstream node's override
    rec_up = a.override.config.recorder
    rec_up.clear()
    q, k, v = qkv()
    b.override(comfy_func, q, k, v, 2, transformer_options={"block_index": 7, "total_blocks": 10})
    assert rec_up.served_by("native") == 1


def test_options_that_never_mark_a_new_forward_stop_being_numbered(spy):
    """A caller that passes the same options dict forever (no cond_or_uncond): past MAX_ORDINAL calls the calls are
    no longer numbered, so plans and verdicts do not pile up one per call."""
    fn = adapter.make_override("native")
    q, k, v = qkv()
    options = {"sigmas": torch.ones(1)}
    for _ in range(blocks.MAX_ORDINAL + 3):
        fn(comfy_func, q, k, v, 2, transformer_options=options)
    assert sites_of(spy)[:2] == ["self #0", "self #1"] and sites_of(spy)[-3:] == ["self"] * 3
    assert len(fn._plans) == blocks.MAX_ORDINAL + 1

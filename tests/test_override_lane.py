"""The override's config value (one frozen OverrideConfig, not 17 restated parameters) and its per-site lane:
a repeat call of a planned site reaches the kernel without re-deciding, and leaves the lane whenever anything the
lane was made for changes (shape, dtype, mask, scope, a guard check due, a forget)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import tensors
from helpers.pack import CALLS, comfy_func, load_pack
from helpers.python_steps import entered

adapter, dispatcher, _ = load_pack()

qkv = functools.partial(tensors.qkv, b=2, lq=16, lk=16, h=2, d=32, flat=True)  # ComfyUI's (B, L, H*D)


@pytest.fixture(autouse=True)
def _clear():
    CALLS.clear()


def test_the_override_is_made_from_one_frozen_config_value():
    notes: dict = {}
    fn = adapter.make_override("native", "strict", window=[0.1, 0.9], trust=["b", "a", "a"], model="m",
                               guard="all", guard_every=3, blocks=(0, 4), block_notes=notes)
    config = fn.config
    assert isinstance(config, adapter.OverrideConfig)
    assert (config.backend, config.policy, config.window, config.trust, config.blocks) == \
        ("native", "strict", (0.1, 0.9), ("a", "b"), (0, 4))
    assert config.block_notes is notes  # shared with the node's report
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.backend = "flex"
    # the override keeps no copy of a field: each is read as fn.config.<field>
    assert not [f.name for f in dataclasses.fields(config) if hasattr(fn, f.name)]
    # a node rebuilds it with dataclasses.replace: the same values but the one it changes, normalised again
    rebuilt = adapter.override_for(dataclasses.replace(config, checks="warn", blocks=(0, -1)))
    assert rebuilt.config.checks == "warn" and rebuilt.config.blocks is None
    assert dataclasses.astuple(dataclasses.replace(rebuilt.config, checks=None, blocks=(0, 4))) == \
        dataclasses.astuple(config)
    assert rebuilt.config.block_notes is notes
    # the class takes the value itself, not restated fields
    direct = adapter.AttentionOverride(config)
    q, k, v = qkv()
    torch.testing.assert_close(direct(comfy_func, q, k, v, 2, transformer_options={}),
                               fn(comfy_func, q, k, v, 2, transformer_options={}))


# ------------------------------------------------------------------------------------------------ the lane

eager = __import__(f"{dispatcher.__name__}.eager", fromlist=["eager"])
caches = __import__(f"{dispatcher.__name__}.caches", fromlist=["caches"])
decisions = __import__(f"{dispatcher.__name__}.decisions", fromlist=["decisions"])


def reference(q, k, v, heads, mask=None):
    b, lq, hd = q.shape
    d = hd // heads
    qb, kb, vb = (t.unflatten(-1, (-1, d)).transpose(1, 2).double() for t in (q, k, v))
    if mask is not None:
        mask = mask[None, None] if mask.ndim == 2 else mask[:, None]
        mask = mask if mask.dtype == torch.bool else mask.double()
    return F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask).transpose(1, 2).flatten(2)


# the eager path's steps (a repeat call of a shapes_only chain is keyed by shapes_key; the override's own plan key is
# a tensors_key, so that name is no sign of the full path)
FULL_PATH = {"dispatch_eager", "shapes_key", "_first_call", "decision_for"}


def test_a_repeat_call_runs_the_lane_not_the_dispatcher():
    """The first call plans and decides; the second checks the plan's key and the lane's, then runs the kernel:
    neither the dispatcher's entry, nor its key, nor its decision."""
    rec = dispatcher.Recorder()
    fn = adapter.make_override("native", recorder=rec)
    q, k, v = qkv()
    first, _ = entered(lambda: fn(comfy_func, q, k, v, 2, transformer_options={}))
    assert {"dispatch_eager", "tensors_key", "_first_call"} <= first
    held = len(decisions._decisions), len(eager._fast)
    steps, out = entered(lambda: fn(comfy_func, q, k, v, 2, transformer_options={}))
    assert "run_lane" in steps and not steps & (FULL_PATH | {"_plan"}), steps
    assert (len(decisions._decisions), len(eager._fast)) == held
    torch.testing.assert_close(out, reference(q, k, v, 2).float(), atol=1e-5, rtol=1e-4)
    assert rec.snapshot()["rows"][0]["calls"] == 2 and not CALLS  # counted as the full path counts it


@pytest.mark.parametrize("what", ["checks on", "another model scope", "grad", "a forget", "a context_parallel block",
                                  "another machine"])
def test_what_the_lane_was_made_under_changing_leaves_it(what):
    """The scope (checks, model), the machine, the grad mode, the caches' epoch and an open context_parallel() block
    (whose calls are routed) are the lane's to re-check: a change sends the call the full way, which serves it correctly (and
    then keeps a lane for the new state where it can)."""
    fn = adapter.make_override("native")  # no model: the active scope's
    q, k, v = qkv()
    if what == "checks on":
        change = lambda: dispatcher.attention_checks("raise")  # noqa: E731
    elif what == "another model scope":
        change = lambda: dispatcher.model_scope("another model")  # noqa: E731
    elif what == "a context_parallel block":  # None: the block is open, its calls run locally (routed first)
        parallel = __import__(f"{dispatcher.__name__}.parallel", fromlist=["parallel"])
        change = lambda: parallel.context_parallel(None)  # noqa: E731
    elif what == "another machine":  # the same machine, described again: its own decisions
        machine = __import__(f"{dispatcher.__name__}.machine", fromlist=["machine"])
        change = lambda: machine.use_machine(dataclasses.replace(machine.current_machine()))  # noqa: E731
    elif what == "grad":
        q = q.detach().requires_grad_()
        change = contextlib.nullcontext
    else:
        change = contextlib.nullcontext
    for _ in range(2):
        fn(comfy_func, q.detach(), k, v, 2, transformer_options={})
    if what == "a forget":
        caches.forget()
    with change():
        steps, out = entered(lambda: fn(comfy_func, q, k, v, 2, transformer_options={}))
    assert "dispatch_eager" in steps, what  # the lane was left (or, for context parallelism, not tried)
    if what == "a context_parallel block":
        assert "dispatch_call" in steps and "run_lane" not in steps  # routed through context parallelism first
    torch.testing.assert_close(out, reference(q.detach(), k, v, 2).float(), atol=1e-5, rtol=1e-4)
    if what == "grad":
        assert out.requires_grad


@pytest.mark.parametrize("what", ["shape", "dtype", "mask shape", "mask dtype", "no mask"])
def test_a_call_the_lane_was_not_made_for_never_takes_it(what):
    """Another shape, dtype or mask is another plan key: never served by the lane of the first."""
    fn = adapter.make_override("native")
    q, k, v = qkv()
    mask = torch.zeros(16, 16)
    for _ in range(2):
        fn(comfy_func, q, k, v, 2, mask=mask, transformer_options={})
    if what == "shape":
        q, k, v = qkv(lq=8, lk=8)
        mask = torch.zeros(8, 8)
    elif what == "dtype":
        q, k, v = (t.double() for t in (q, k, v))
        mask = mask.double()
    elif what == "mask shape":
        mask = torch.randn(2, 16, 16)  # (B, Lq, Lk): per batch item
    elif what == "mask dtype":
        mask = torch.rand(16, 16) > 0.3
        mask[:, 0] = True
    else:
        mask = None
    steps, out = entered(lambda: fn(comfy_func, q, k, v, 2, mask=mask, transformer_options={}))
    assert "dispatch_eager" in steps and "run_lane" not in steps, what
    torch.testing.assert_close(out.double(), reference(q, k, v, 2, mask), atol=1e-5, rtol=1e-4)
    # and the new call's repeat takes its own lane
    steps, out = entered(lambda: fn(comfy_func, q, k, v, 2, mask=mask, transformer_options={}))
    assert "run_lane" in steps and "dispatch_eager" not in steps, what
    torch.testing.assert_close(out.double(), reference(q, k, v, 2, mask), atol=1e-5, rtol=1e-4)


def test_new_mask_values_of_the_same_kind_run_on_the_lane_with_those_values():
    fn = adapter.make_override("native")
    q, k, v = qkv()
    for seed in range(3):
        mask = torch.randn(16, 16, generator=torch.Generator().manual_seed(seed))
        out = fn(comfy_func, q, k, v, 2, mask=mask, transformer_options={})
        torch.testing.assert_close(out.double(), reference(q, k, v, 2, mask), atol=1e-5, rtol=1e-4)


def test_the_guard_checks_as_often_on_the_lane_as_on_the_full_path():
    """A guarded kernel: the lane counts each unchecked call (the guard's tick) and leaves when a check falls due,
    so the checks made through the override are those the dispatcher makes for the same calls."""
    name = "t_lane_guarded"
    dispatcher.register_backend(name, lambda q, k, v, **_: tensors.sdpa(q, k, v), devices=("cpu",), quantised=True)
    try:
        counts = []
        for through_override in (True, False):
            rec = dispatcher.Recorder()
            model = f"lane-guard-{through_override}"
            fn = adapter.make_override(name, recorder=rec, model=model, guard="quantised", guard_every=3)
            q, k, v = qkv()
            for _ in range(10):
                if through_override:
                    fn(comfy_func, q, k, v, 2, transformer_options={})
                else:
                    dispatcher.dispatch_attention_fn(q.unflatten(-1, (2, -1)), k.unflatten(-1, (2, -1)),
                                                     v.unflatten(-1, (2, -1)), backend=name, recorder=rec,
                                                     model=model, guard=("quantised", 3), call_site="self")
            snap = rec.snapshot()
            counts.append((sum(r["calls"] for r in snap["rows"]),
                           [(g["site"], g["backend"], g["checks"]) for g in snap["guard"]]))
        assert counts[0] == counts[1] and counts[0][0] == 10
        assert counts[0][1] and counts[0][1][0][2] >= 3, counts  # the first call, then 1 in 3
    finally:
        dispatcher.unregister_backend(name)


def test_a_kernel_that_starts_failing_leaves_the_lane_and_is_demoted():
    """The lane does not demote: a raising kernel sends the call the full way, which demotes it and falls back."""
    name, state = "t_lane_breaks", {"broken": False}

    def kernel(q, k, v, **_):
        if state["broken"]:
            raise RuntimeError("kernel broke")
        return tensors.sdpa(q, k, v)

    dispatcher.register_backend(name, kernel, devices=("cpu",))
    try:
        rec = dispatcher.Recorder()
        fn = adapter.make_override(name, recorder=rec, guard="off")
        q, k, v = qkv()
        for _ in range(2):
            fn(comfy_func, q, k, v, 2, transformer_options={})
        state["broken"] = True
        for _ in range(2):
            out = fn(comfy_func, q, k, v, 2, transformer_options={})
            torch.testing.assert_close(out.double(), reference(q, k, v, 2), atol=1e-5, rtol=1e-4)
        served = {r["served"]: r["calls"] for r in rec.snapshot()["rows"]}
        assert served == {name: 2, "native": 2}, served
    finally:
        dispatcher.unregister_backend(name)


def test_a_fallback_runs_on_the_lane_and_is_recorded_with_its_reasons_as_the_full_path_records_it():
    """A kernel that cannot run here (a CUDA-only one on the CPU): its decision's first candidate is the fallback,
    which the lane serves, each call recorded with the reasons the full path gives."""
    name = "t_lane_cuda_only"
    dispatcher.register_backend(name, lambda q, k, v, **_: tensors.sdpa(q, k, v), devices=("cuda",))
    try:
        snapshots = []
        for through_override in (True, False):
            rec = dispatcher.Recorder()
            fn = adapter.make_override(name, recorder=rec)
            q, k, v = qkv()
            for call in range(3):
                if through_override:
                    steps, out = entered(lambda: fn(comfy_func, q, k, v, 2, transformer_options={}))
                    assert ("run_lane" in steps and "dispatch_eager" not in steps) == (call > 0), steps
                else:
                    out = dispatcher.dispatch_attention_fn(*(t.unflatten(-1, (2, -1)) for t in (q, k, v)),
                                                           backend=name, recorder=rec, call_site="self").flatten(2)
                torch.testing.assert_close(out.double(), reference(q, k, v, 2), atol=1e-5, rtol=1e-4)
            snapshots.append(rec.snapshot()["rows"])
        assert snapshots[0] == snapshots[1]
        (row,) = snapshots[0]
        assert row["served"] == "native" and row["fell_back"] and row["calls"] == 3 and row["reasons"], row
    finally:
        dispatcher.unregister_backend(name)


# ------------------------------------------------------------------------------------------------ one key

dispatch_module = __import__(f"{dispatcher.__name__}.dispatch", fromlist=["dispatch"])
state = __import__(f"{dispatcher.__name__}.state", fromlist=["state"])
machine_module = __import__(f"{dispatcher.__name__}.machine", fromlist=["machine"])

# Each part of a ComfyUI call and the values it takes (hidden size 32 over 1 or 2 heads).
COMFY_PARTS = {
    "lq": (8, 16), "lk": (8, 16), "heads": (1, 2), "dtype": (torch.float32, torch.float64, torch.bfloat16),
    "mask": (None, "bool (Lq, Lk)", "additive (B, Lq, Lk)", "additive (B, 1, Lq, Lk)"),
    "skip_reshape": (False, True), "skip_output_reshape": (False, True), "attn_precision": (None, torch.float32),
    "scale": (None, 0.3), "low_precision_attention": (True, False),
}


def _comfy_call(parts: dict):
    h, lq, lk = parts["heads"], parts["lq"], parts["lk"]
    q, k, v = (t.to(parts["dtype"]) for t in tensors.qkv(b=2, lq=lq, lk=lk, h=h, d=32 // h, flat=True))
    if parts["skip_reshape"]:
        q, k, v = (t.unflatten(-1, (h, -1)).transpose(1, 2) for t in (q, k, v))
    mask = {None: None, "bool (Lq, Lk)": torch.ones(lq, lk, dtype=torch.bool), "additive (B, Lq, Lk)":
            torch.zeros(2, lq, lk), "additive (B, 1, Lq, Lk)": torch.zeros(2, 1, lq, lk)}[parts["mask"]]
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(parts["dtype"])
    return (q, k, v, h), dict(mask=mask, attn_precision=parts["attn_precision"], skip_reshape=parts["skip_reshape"],
                              skip_output_reshape=parts["skip_output_reshape"], scale=parts["scale"],
                              low_precision_attention=parts["low_precision_attention"], transformer_options={})


def _plan_key_and_lane_key(parts: dict):
    """(the override's plan key, the eager path's key of the call that plan makes) for one ComfyUI call."""
    fn = adapter.make_override("native")  # a fresh override: its one plan is this call's
    made = []
    real = dispatch_module.dispatch_eager
    dispatch_module.dispatch_eager = lambda call: made.append(call) or real(call)
    try:
        args, kwargs = _comfy_call(parts)
        fn(comfy_func, *args, **kwargs)
    finally:
        dispatch_module.dispatch_eager = real
    (plan_key,) = fn._plans
    (call,) = made
    (backend, policy, model, guard), _ = state.current()
    site = call.site
    lane_key = eager.lane_key(call, site.backend or backend, site.policy or policy, site.model or model,
                              site.guard or guard, id(machine_module.current_machine()), False)
    return plan_key, lane_key


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.fixed_dictionaries({name: st.sampled_from(values) for name, values in COMFY_PARTS.items()}),
       st.sets(st.sampled_from(sorted(COMFY_PARTS)), min_size=1, max_size=2), st.data())
def test_one_plan_key_is_one_dispatcher_key(base, changed, data):
    """The override's plan key (call.tensors_key of ComfyUI's tensors, with what ComfyUI passes besides) is at least
    as fine as the eager path's key of the call the plan makes: two ComfyUI calls of one plan key make calls of one
    eager key, so a plan's lane (which skips the eager key) never serves a call another decision is for."""
    other = {**base, **{name: data.draw(st.sampled_from(COMFY_PARTS[name])) for name in changed}}
    plan_a, lane_a = _plan_key_and_lane_key(base)
    plan_b, lane_b = _plan_key_and_lane_key(other)
    if plan_a == plan_b:
        assert lane_a == lane_b, (base, other)

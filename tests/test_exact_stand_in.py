"""One choice of the exact stand-in (`decisions.exact_stand_in`): which exact backend serves instead of a quantised
or approximate kernel. Its callers must agree on every call: the ComfyUI adapter's swap for
low_precision_attention=False, a decision's order (the exact pick second), and the quality guard's replacement of a
kernel it caught. The calls below are those where the adapter used to choose differently (the first exact backend
of the chain, whether or not it could run the call), so its call failed under policy 'strict'."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from helpers import fake_clock, tensors
from helpers.pack import comfy_func, load_pack

adapter, dispatcher, _ = load_pack()
decisions, guard = dispatcher.decisions, dispatcher.guard

qkv = functools.partial(tensors.qkv, b=1, lq=16, lk=16, h=2, d=32)  # (B, L, H, D)


def sdpa(q, k, v, attn_mask=None, **_):  # BSHD in and out; a bool mask (True = attend)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask)
    return out.transpose(1, 2)


def spoiled(q, k, v, attn_mask=None, **_):  # a quantised kernel gone wrong: off by 50% (the guard catches it)
    return sdpa(q, k, v, attn_mask) * 1.5


@pytest.fixture(scope="module", autouse=True)
def backends():
    register = functools.partial(dispatcher.register_backend, mask_format="bool", replace=True)
    register("t_si_exact_cuda", sdpa, devices=("cuda",))  # exact, but not on this machine's CPU
    register("t_si_exact_unmasked", sdpa, devices=("cpu",))  # exact, takes no mask
    register("t_si_q_cuda_first", spoiled, devices=("cpu",), masks=("bool",), quantised=True,
             fallback=("t_si_exact_cuda", "native"))
    register("t_si_q_unmasked_first", spoiled, devices=("cpu",), masks=("bool",), quantised=True,
             fallback=("t_si_exact_unmasked", "native"))
    yield
    for name in ("t_si_q_cuda_first", "t_si_q_unmasked_first", "t_si_exact_cuda", "t_si_exact_unmasked"):
        dispatcher.registry.remove(name)


CASES = [  # (quantised backend, masked call, its exact stand-in)
    ("t_si_q_cuda_first", False, "native"),  # the chain's first exact backend cannot run on this machine
    ("t_si_q_unmasked_first", True, "native"),  # ... cannot run this (masked) call
    ("t_si_q_unmasked_first", False, "t_si_exact_unmasked"),  # ... runs it
]


def _call(masked):
    q, k, v = qkv()
    mask = torch.ones(16, 16, dtype=torch.bool).tril() if masked else None
    return q, k, v, mask


@pytest.mark.parametrize("backend, masked, expected", CASES)
def test_the_function_itself(backend, masked, expected):
    q, k, v, mask = _call(masked)
    inputs = dispatcher.inputs.describe_call(q, k, v, None if mask is None else mask[None, None], 0.0, False, None,
                                             False, False, "BSHD")
    assert decisions.exact_stand_in(backend, inputs) == expected
    assert decisions.exact_stand_in(backend) == ("t_si_exact_cuda" if backend == "t_si_q_cuda_first"
                                                 else "t_si_exact_unmasked")  # without inputs: the chain's first
    assert decisions.exact_stand_in("native", inputs) == "native"  # an exact backend stands in for itself
    assert decisions.exact_stand_in(backend, inputs, exact="_native_math") == "_native_math"  # the caller's pick first


@pytest.mark.parametrize("backend, masked, expected", CASES)
def test_the_adapter_and_the_guard_choose_the_same_stand_in(backend, masked, expected):
    q, k, v, mask = _call(masked)
    # the quality guard: the kernel is off by 50%, so the call is recomputed with the stand-in
    caught = dispatcher.Recorder()
    out = dispatcher.dispatch_attention_fn(q, k, v, None if mask is None else mask[None, None], backend=backend,
                                           call_site="self", recorder=caught, guard="quantised", guard_every=1)
    failure, = [f for g in caught.snapshot()["guard"] for f in g["failures"]]
    torch.testing.assert_close(out, sdpa(q, k, v, None if mask is None else mask[None, None]))
    # the adapter: the model asks for full precision; under policy 'strict' the stand-in must run the call itself
    kept = dispatcher.Recorder()
    flat = [t.flatten(2) for t in (q, k, v)]  # ComfyUI's (B, L, H*D)
    override = adapter.make_override(backend, policy="strict", recorder=kept)
    out = override(comfy_func, *flat, 2, mask=mask, low_precision_attention=False,
                   transformer_options={"optimized_attention_override": None}, _inside_attn_wrapper=True)
    row, = kept.snapshot()["rows"]
    torch.testing.assert_close(out, comfy_func(*flat, 2, mask=mask))
    # a decision made with an exact pick that cannot run the call puts the stand-in second, as the guard reads it
    inputs = dispatcher.inputs.describe_call(q, k, v, None if mask is None else mask[None, None], 0.0, False, None,
                                             False, False, "BSHD")
    decision = decisions.decide(backend, "fallback", inputs, "BSHD", guard.DEFAULT, exact="t_si_exact_cuda")
    assert (failure["replacement"], row["served"], decision.candidates[1].name,
            decisions.exact_stand_in(backend, inputs)) == (expected,) * 4
    assert any(f"'{backend}' refused, '{expected}' serves instead" in r for r in row["reasons"]), row["reasons"]


def test_auto_fasts_exact_pick_is_the_stand_in_of_every_caller(monkeypatch):
    """`auto_fast` picked a quantised kernel (exact while judged, off by 50% later): the eager path hands the decision
    `auto_exact`'s pick, and that one kernel recomputes the call the guard caught, serves the model's full-precision
    calls through the adapter, and is what `exact_stand_in` says given the pick (the chain alone says another)."""
    clock = fake_clock.FakeClock()  # the tuner's clock moves only by the kernels' declared times: no load noise
    monkeypatch.setattr(dispatcher.auto.measure, "now", clock)
    wrong = []

    def drifting(q, k, v, attn_mask=None, **_):
        clock.advance(1)
        out = sdpa(q, k, v, attn_mask)
        return out * 1.5 if wrong else out

    names = ("t_si_q_auto", "t_si_exact_slow", "t_si_exact_fast")
    dispatcher.register_backend(names[0], drifting, devices=("cpu",), quantised=True, fallback=(names[1], "native"))
    dispatcher.register_backend(names[1], clock.kernel(30, sdpa), devices=("cpu",))
    dispatcher.register_backend(names[2], clock.kernel(10, sdpa), devices=("cpu",))
    try:
        q, k, v, _ = _call(False)
        caught, kept = dispatcher.Recorder(), dispatcher.Recorder()
        with dispatcher.auto.using(dispatcher.auto.Tuner(cache_path=None, backends=names)):
            for _ in range(2):
                dispatcher.dispatch_attention_fn(q, k, v, backend="auto_fast", call_site="self", recorder=caught,
                                                 model="m", guard="quantised", guard_every=1)
                wrong.append(True)
            flat = [t.flatten(2) for t in (q, k, v)]
            adapter.make_override("auto_fast", policy="strict", recorder=kept, model="m")(
                comfy_func, *flat, 2, low_precision_attention=False,
                transformer_options={"optimized_attention_override": None}, _inside_attn_wrapper=True)
        served = [(r["served"], r["calls"]) for r in caught.snapshot()["rows"]]
        assert (names[0], 1) in served, served  # auto_fast's pick served the first call
        failure, = [f for g in caught.snapshot()["guard"] for f in g["failures"]]
        row, = kept.snapshot()["rows"]
        inputs = dispatcher.inputs.describe_call(q, k, v, None, 0.0, False, None, False, False, "BSHD")
        assert (failure["replacement"], row["served"], decisions.exact_stand_in(names[0], inputs, exact=names[2])) \
            == (names[2],) * 3
        assert decisions.exact_stand_in(names[0], inputs) == names[1]
    finally:
        for name in names:
            dispatcher.registry.remove(name)


FULL_PRECISION = dispatcher.Rules(low_precision=False)


@pytest.mark.parametrize("backend, masked, expected", CASES)
def test_a_call_kept_exact_by_its_rules_is_decided_and_recorded_by_the_dispatcher(backend, masked, expected):
    """The library's entry takes the rules that keep a call exact (the ComfyUI override's low_precision_attention=False):
    the stand-in serves, every call is recorded under the backend asked for with why another served it, on the
    first call, on repeat calls and on a prepared call's lane, under either fallback policy; `kept_exact` gives a
    host the same decision."""
    q, k, v, mask = _call(masked)
    mask = None if mask is None else mask[None, None]
    for policy in ("fallback", "strict"):
        rec = dispatcher.Recorder()
        prepared = dispatcher.PreparedAttention(backend=backend, policy=policy, call_site="cross", recorder=rec,
                                                rules=FULL_PRECISION)
        for _ in range(2):
            out = dispatcher.dispatch_attention_fn(q, k, v, mask, backend=backend, policy=policy, call_site="cross",
                                                   recorder=rec, rules=FULL_PRECISION)
            torch.testing.assert_close(out, sdpa(q, k, v, mask))
            torch.testing.assert_close(prepared.keyed(q, k, v, mask), out)  # the second keyed call: its lane
        kept = dispatcher.kept_exact(q, k, v, mask, backend=backend, rules=FULL_PRECISION)
        row, = rec.snapshot()["rows"]
        assert (row["requested"], row["served"], row["calls"], row["reasons"]) == (backend, expected, 4, [kept.note])
        assert kept.backend == expected and kept.note.startswith(f"'{backend}' refused, '{expected}' serves instead: ")


def test_rules_keep_an_auto_to_its_exact_twin_and_an_exact_backend_to_itself():
    q, k, v, _ = _call(False)
    for backend, twin, note in (("auto_fast", "auto_exact", "auto_fast kept to exact kernels (auto_exact)"),
                                ("auto", "auto_exact", "auto kept to exact kernels (auto_exact)"),
                                ("auto_exact", "auto_exact", "auto_exact picks exact kernels only"),
                                ("native", "native", "'native' is exact")):
        assert tuple(dispatcher.kept_exact(q, k, v, backend=backend, rules=FULL_PRECISION)) == (twin, note, ())
    assert dispatcher.kept_exact(q, k, v, backend="native", rules=dispatcher.Rules()) == ("native", "", ())


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_a_compiled_call_keeps_its_rules():
    q, k, v, _ = _call(False)
    rec = dispatcher.Recorder()

    def step(q, k, v):
        return dispatcher.dispatch_attention_fn(q, k, v, backend="t_si_q_unmasked_first", call_site="cross",
                                                recorder=rec, rules=FULL_PRECISION)

    compiled = torch.compile(step, backend="eager", fullgraph=True)
    for _ in range(2):
        torch.testing.assert_close(compiled(q, k, v), sdpa(q, k, v))
    row, = rec.snapshot()["rows"]
    assert (row["requested"], row["served"], row["calls"]) == ("t_si_q_unmasked_first", "t_si_exact_unmasked", 2)
    assert row["reasons"] == [dispatcher.kept_exact(q, k, v, backend="t_si_q_unmasked_first", rules=FULL_PRECISION).note]


def test_a_call_takes_only_the_rules_that_keep_it_exact():
    q, k, v, _ = _call(False)
    with pytest.raises(ValueError, match="memory_cap are rules of auto's candidates"):
        dispatcher.dispatch_attention_fn(q, k, v, backend="native", rules=dispatcher.Rules(memory_cap=1 << 20))
    with pytest.raises(TypeError, match="rules must be a dispatcher.Rules value"):
        dispatcher.dispatch_attention_fn(q, k, v, backend="native", rules={"low_precision": False})
    with pytest.raises(ValueError, match="memory_cap"):
        dispatcher.PreparedAttention(backend="native", rules=dispatcher.Rules(memory_cap=1))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_a_compiled_call_with_other_rules_raises_the_same_clear_error():
    q, k, v, _ = _call(False)

    def step(q, k, v, rules):
        return dispatcher.dispatch_attention_fn(q, k, v, backend="native", rules=rules)

    for rules, error, said in (({"low_precision": False}, TypeError, "rules must be a dispatcher.Rules value"),
                               (dispatcher.Rules(memory_cap=1), ValueError, "memory_cap")):
        torch._dynamo.reset()
        with pytest.raises(error, match=said):
            torch.compile(functools.partial(step, rules=rules), backend="eager")(q, k, v)

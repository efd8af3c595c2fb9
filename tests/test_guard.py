"""The quality guard: kernels that go wrong during sampling are caught within the interval, the call is
recomputed exactly, the kernel demoted for that signature and model, and the report says so."""

from __future__ import annotations

import pytest
import torch

import dispatcher
from dispatcher import eager
from dispatcher import AttentionQualityError, Recorder, dispatch_attention_fn, guard, recording
from dispatcher.reference import exact_attention
from helpers.tensors import qkv, sdpa as exact


class Drifting:
    """Exact for `good_calls` calls, then wrong in the way `how` says (counts its own calls)."""

    def __init__(self, good_calls=0, how="noise", only_len=None, over=None):
        self.calls, self.good_calls, self.how, self.only_len, self.over = 0, good_calls, how, only_len, over

    def __call__(self, q, k, v, **_):
        self.calls += 1
        out = exact(q, k, v)
        if self.calls <= self.good_calls:
            return out
        if self.only_len is not None and q.shape[1] != self.only_len:
            return out
        if self.over is not None and q.abs().amax() < self.over:
            return out
        if self.how == "nan":
            out = out.clone()
            out[0, 0, 0, 0] = float("nan")
            return out
        return out + torch.randn_like(out)  # a noisy picture


def register(name, fn, quantised=True):
    dispatcher.register_backend(name, fn, devices=("cpu",), quantised=quantised)
    return name


def run_calls(name, n, inputs=None, site="self", rec=None, **kw):
    q, k, v = inputs or qkv(1, 32, h=2, d=16)
    outs = []
    with recording(rec) if rec is not None else dispatcher.report.recording(Recorder()):
        for _ in range(n):
            outs.append(dispatch_attention_fn(q, k, v, backend=name, call_site=site, **kw))
    return outs, exact(q, k, v)


@pytest.mark.parametrize("every", [1, 4, 7])
@pytest.mark.parametrize("sites", [("self",), ("self", "cross")])
def test_checks_fall_on_the_first_and_every_nth_call_per_site_and_the_rest_take_the_fast_lane(every, sites, monkeypatch):
    """Calls the guard does not check are counted in the eager path's fast lane, checked ones on its long way:
    together they keep one count per call site (the first call and every `every`-th after it are checked)."""
    name = register("t_count", Drifting(good_calls=10**9))  # always right: nothing is demoted
    rec = Recorder()
    long_way = []
    real = eager._guarded
    monkeypatch.setattr(eager, "_guarded", lambda *a, **kw: long_way.append(1) or real(*a, **kw))
    calls = 15
    for _ in range(calls):
        for site in sites:
            run_calls(name, 1, site=site, rec=rec, guard="quantised", guard_every=every)
    checks = {g["site"]: g["checks"] for g in rec.snapshot()["guard"]}
    assert checks == {site: -(-calls // every) for site in sites}
    assert len(long_way) == sum(checks.values())  # only the checked calls went the long way
    served = {(r["site"], r["served"]): r["calls"] for r in rec.snapshot()["rows"]}
    assert served == {(site, name): calls for site in sites}


@pytest.mark.parametrize("how", ["noise", "nan"])
def test_a_kernel_that_goes_wrong_after_k_calls_is_caught_within_the_interval(how):
    kernel = Drifting(good_calls=7, how=how)
    name = register("t_drift", kernel)
    rec = Recorder()
    every = 5
    outs, ref = run_calls(name, 30, rec=rec, guard="quantised", guard_every=every)
    # calls 1..7 are good; the first check after call 7 is call 11 (checks on calls 1, 6, 11): calls 8..10 are
    # wrong (the guard samples, it does not check every call), call 11 is recomputed, and the rest run exactly
    bad = [i for i, out in enumerate(outs, 1) if not torch.allclose(out, ref, atol=1e-5)]
    assert bad == [8, 9, 10]
    snap = rec.snapshot()
    (g,) = snap["guard"]
    assert g["backend"] == name and g["checks"] == 3 and len(g["failures"]) == 1
    assert g["failures"][0]["replacement"] == "native"
    assert ("NaN" in g["failures"][0]["reason"]) == (how == "nan")
    assert {row["served"]: row["calls"] for row in snap["rows"]} == {name: 10, "native": 20}
    assert "quality guard" in rec.summary() and "FAILED" in rec.summary()
    assert kernel.calls == 11  # demoted: never called again for this signature and model


def test_the_first_call_is_always_checked():
    name = register("t_bad", Drifting(good_calls=0))
    rec = Recorder()
    outs, ref = run_calls(name, 3, rec=rec, guard_every=1000)
    assert all(torch.allclose(out, ref, atol=1e-5) for out in outs)


def test_a_kernel_wrong_only_on_some_shapes_is_demoted_for_those_only():
    kernel = Drifting(only_len=48)
    name = register("t_shapes", kernel)
    rec = Recorder()
    small, ref_small = run_calls(name, 4, qkv(1, 32, h=2, d=16), rec=rec, guard_every=2)
    big, ref_big = run_calls(name, 4, qkv(1, 48, h=2, d=16), rec=rec, guard_every=2)
    assert all(torch.allclose(o, ref_small, atol=1e-5) for o in small)
    assert all(torch.allclose(o, ref_big, atol=1e-5) for o in big)
    served = {}
    for row in rec.snapshot()["rows"]:
        served[row["served"]] = served.get(row["served"], 0) + row["calls"]
    assert served == {name: 4, "native": 4}  # the 32-long calls stay on the kernel


def test_a_kernel_wrong_only_on_large_activations():
    name = register("t_large", Drifting(over=20))
    rec = Recorder()
    q, k, v = qkv(1, 32, h=2, d=16)
    fine, _ = run_calls(name, 3, (q, k, v), rec=rec, guard_every=1)
    loud = (q * 30, k, v)
    outs, ref = run_calls(name, 3, loud, rec=rec, guard_every=1)
    assert all(torch.allclose(o, ref, atol=1e-4) for o in outs)
    assert len(rec.snapshot()["guard"][0]["failures"]) == 1


def test_demotion_is_per_model():
    kernel = Drifting(good_calls=0)
    name = register("t_model", kernel)
    rec = Recorder()
    run_calls(name, 2, rec=rec, guard_every=1, model="model-a")
    calls = kernel.calls
    run_calls(name, 1, rec=rec, guard_every=1, model="model-b")
    assert kernel.calls == calls + 1  # model b tries it again (and catches it again)


def test_exact_kernels_are_unguarded_by_default_and_guarded_with_all():
    kernel = Drifting(good_calls=0)
    name = register("t_exactish", kernel, quantised=False)
    outs, ref = run_calls(name, 2)
    assert not torch.allclose(outs[0], ref, atol=1e-3)  # default: quantised kernels only
    outs, ref = run_calls(name, 2, guard="all", guard_every=1)
    assert all(torch.allclose(o, ref, atol=1e-5) for o in outs)
    with dispatcher.quality_guard("all", 1):
        outs, ref = run_calls(name, 1, qkv(1, 24, h=2, d=16))
    assert torch.allclose(outs[0], ref, atol=1e-5)


def test_off_turns_it_off():
    name = register("t_off", Drifting(good_calls=0))
    outs, ref = run_calls(name, 1, guard="off")
    assert not torch.allclose(outs[0], ref, atol=1e-3)


def test_strict_policy_fails_the_call_with_the_reason():
    name = register("t_strict", Drifting(good_calls=0))
    q, k, v = qkv(1, 32, h=2, d=16)
    with pytest.raises(AttentionQualityError, match="quality guard.*strict"):
        dispatch_attention_fn(q, k, v, backend=name, policy="strict")


def test_bad_settings_are_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match="quantised, all, off"):
        guard.settings("sometimes")
    with pytest.raises(ValueError, match=">= 1"):
        guard.settings("all", 0)
    with pytest.raises(ValueError, match="quantised, all, off"):
        dispatch_attention_fn(*qkv(), guard="explode")


def test_inputs_with_nan_are_not_blamed_on_the_kernel():
    name = register("t_passes_nan", lambda q, k, v, **_: exact(q, k, v))
    q, k, v = qkv(1, 32, h=2, d=16)
    q = q.clone()
    q[0, 0, 0, 0] = float("nan")
    rec = Recorder()
    run_calls(name, 2, (q, k, v), rec=rec, guard_every=1)
    assert all(not g["failures"] for g in rec.snapshot()["guard"])


def test_a_guarded_kernel_inside_torch_compile_runs_as_one_op_and_is_guarded():
    kernel = Drifting(good_calls=2)
    name = register("t_compiled", kernel)
    q, k, v = qkv(1, 32, h=2, d=16)
    rec = Recorder()

    def step(q, k, v):
        return dispatch_attention_fn(q, k, v, backend=name, guard_every=3, recorder=rec)

    compiled = torch.compile(step, backend="eager", fullgraph=True)  # no graph break
    outs = [compiled(q, k, v) for _ in range(6)]
    ref = exact(q, k, v)
    bad = [i for i, out in enumerate(outs, 1) if not torch.allclose(out, ref, atol=1e-5)]
    assert bad == [3]  # checks on calls 1 and 4: call 3 slipped through, 4 was recomputed, then exact
    assert len(rec.snapshot()["guard"][0]["failures"]) == 1


def test_a_guarded_kernel_returning_lse_is_recomputed_in_both():
    def noisy(q, k, v, *, return_lse=False, **_):
        out, lse = exact_attention(q, k, v)  # (B, H, S, D) and (B, H, S), float64; the kernel returns BSHD
        out, lse = out.transpose(1, 2).to(q.dtype), lse.transpose(1, 2).float()
        return (out + torch.randn_like(out), lse + 3) if return_lse else out + torch.randn_like(out)

    name = dispatcher.register_backend("t_lse", noisy, devices=("cpu",), lse=True, quantised=True)
    q, k, v = qkv(1, 32, h=2, d=16)
    out, lse = dispatch_attention_fn(q, k, v, backend=name.name, return_lse=True, guard_every=1)
    ref_out, ref_lse = dispatch_attention_fn(q, k, v, backend="native", return_lse=True)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)


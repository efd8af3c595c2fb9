"""The quality guard: every block of the model is checked on its first call and again within the interval (the
blocks' checks staggered), a kernel that goes wrong is caught there, the call is recomputed with the fastest exact
kernel the decision knows, the kernel demoted for that block of that model only, and the report names the block.
A block is its call site ("self #5"; nodes/adapter.py names them in ComfyUI); here the tests pass it themselves."""

from __future__ import annotations

import pytest
import torch

import dispatcher
from dispatcher import decisions
from dispatcher import AttentionQualityError, Recorder, dispatch_attention_fn, guard, recording
from dispatcher import guard_rules, guard_schedule, guard_sizing
from dispatcher.call import AttentionCall
from dispatcher.execute import run
from dispatcher.inputs import AttentionInputs, describe_call
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
        if self.how == "shifted":
            return out + 100.0  # finite, and past the values' range
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


class Scaled:
    """Exact attention times (1 + r): a relative error of exactly r on every row (pins the guard's bound)."""

    def __init__(self, r):
        self.r, self.calls = r, 0

    def __call__(self, q, k, v, **_):
        self.calls += 1
        return exact(q, k, v) * (1 + self.r)


def blocks_inputs(n, loud=(), seed=0):
    """(q, k, v) for n blocks sharing one signature; the blocks in `loud` have queries 30x larger (a kernel made
    with Drifting(over=20) is wrong on those only)."""
    q, k, v = qkv(1, 32, h=2, d=16, seed=seed)
    return [((q * 30 if i in loud else q + 0.01 * i), k, v) for i in range(n)]


def forwards(name, inputs, steps, rec, **kw):
    """`steps` forwards of a model whose blocks are `inputs` (block i is call site "self #i"): the outputs per
    forward and the exact ones."""
    outs = []
    with recording(rec):
        for _ in range(steps):
            outs.append([dispatch_attention_fn(q, k, v, backend=name, call_site=f"self #{i}", **kw)
                         for i, (q, k, v) in enumerate(inputs)])
    return outs, [exact(q, k, v) for q, k, v in inputs]


def spoiled(outs, refs, atol=1e-5):
    """(forward, block) of every output that is not exact attention."""
    return [(f, b) for f, step in enumerate(outs) for b, (o, r) in enumerate(zip(step, refs))
            if not torch.allclose(o, r, atol=atol)]


@pytest.fixture
def compares(monkeypatch):
    """The call site of every comparison with exact attention the guard makes, in order."""
    seen = []
    real = guard_rules.Comparison.verdict
    monkeypatch.setattr(guard_rules.Comparison, "verdict",
                        lambda self, call, *rest: seen.append(call.call_site) or real(self, call, *rest))
    return seen


@pytest.mark.parametrize("every", [1, 3, 4, 7])
def test_every_block_is_checked_first_then_again_within_the_interval_staggered(every, compares):
    """The first call of each block is compared; then one call in `every` of each block, the blocks' checks
    spread over the forwards (about n / every a forward) and never more than `every` calls of a block apart."""
    name = register("t_count", Drifting(good_calls=10**9))  # always right: nothing is demoted
    n, steps = 10, 15
    inputs = blocks_inputs(n)
    checked = {}  # site -> forwards it was compared in
    for f in range(steps):
        before = len(compares)
        forwards(name, inputs, 1, Recorder(), guard="quantised", guard_every=every)
        for site in compares[before:]:
            checked.setdefault(site, []).append(f)
    for i in range(n):
        fs = checked[f"self #{i}"]
        gaps = [b - a for a, b in zip(fs, fs[1:] + [steps])]
        assert fs[0] == 0 and max(gaps) <= every, (i, fs)
    per_forward = [sum(f in fs for fs in checked.values()) for f in range(steps)]
    assert per_forward[0] == n  # the first forward checks every block
    assert all(n // every <= c <= -(-n // every) for c in per_forward[1:]), per_forward


def test_the_fast_lane_counts_unchecked_calls_and_never_serves_a_demoted_block():
    """Watch.unchecked: a block's first call and a due check take the long way; the calls between are counted
    on the fast lane; a demoted block never takes it again."""
    name = register("t_lane", Drifting(good_calls=10**9))
    spec = dispatcher.get_backend_spec(name)
    candidate = decisions.Candidate(name, spec, None, False, False,
                                    guard.GuardRules((guard_rules.Comparison(),), (), 3, False))
    watch = guard.Watch()
    assert not watch.unchecked(candidate, "self #0")  # first call: the long way
    watch.left[(name, "self #0")] = 2  # what `after` leaves after a check with every = 3
    assert [watch.unchecked(candidate, "self #0") for _ in range(3)] == [True, True, False]
    watch.demoted[(name, "self #1")] = "bad"
    watch.left[(name, "self #1")] = 0
    assert not watch.unchecked(candidate, "self #1") and not watch.serves(candidate, "self #1")
    assert watch.serves(candidate, "self #0")


def test_a_model_whose_block_1_only_is_wrong_is_caught_at_that_blocks_first_call():
    """Three blocks share one signature and one kind of site; the kernel is wrong on block 1's activations only.
    With an interval far longer than the run, block 1 is still compared on its first call: no output is
    spoiled, the kernel is demoted for block 1 only and keeps serving blocks 0 and 2."""
    kernel = Drifting(over=20)
    name = register("t_block1", kernel)
    rec = Recorder()
    outs, refs = forwards(name, blocks_inputs(3, loud={1}), 5, rec, guard_every=1000)
    assert spoiled(outs, refs, atol=1e-4) == []
    served = {(r["site"], r["served"]): r["calls"] for r in rec.snapshot()["rows"]}
    assert served == {("self #0", name): 5, ("self #1", "native"): 5, ("self #2", name): 5}, served
    (failed,) = [g for g in rec.snapshot()["guard"] if g["failures"]]
    assert failed["site"] == "self #1" and failed["backend"] == name
    assert "self #1" in rec.summary()
    reasons = [r for r in rec.snapshot()["rows"] if r["site"] == "self #1"][0]["reasons"]
    assert any("quality guard at self #1" in r for r in reasons), reasons


@pytest.mark.parametrize("how", ["noise", "nan"])
def test_a_kernel_wrong_from_its_first_call_spoils_nothing(how):
    kernel = Drifting(good_calls=0, how=how)
    name = register("t_first", kernel)
    rec = Recorder()
    outs, refs = forwards(name, blocks_inputs(4), 3, rec, guard_every=1000)
    assert spoiled(outs, refs) == []
    assert kernel.calls == 4  # each block's first call, compared and recomputed; never called again
    assert {g["site"] for g in rec.snapshot()["guard"] if g["failures"]} == {f"self #{i}" for i in range(4)}


@pytest.mark.parametrize("how", ["noise", "nan"])
def test_a_kernel_that_goes_wrong_after_n_calls_is_caught_within_the_rotation_bound(how):
    """Exact for its first 9 calls (3 forwards of 3 blocks), then wrong everywhere. every = 4: each block is
    compared again within 4 of its calls, so each spoils at most 3 outputs before its check catches it (a NaN
    from a custom kernel is caught on the call that makes it)."""
    kernel = Drifting(good_calls=9, how=how)
    name = register("t_after", kernel)
    rec = Recorder()
    every = 4
    outs, refs = forwards(name, blocks_inputs(3), 12, rec, guard_every=every)
    bad = spoiled(outs, refs)
    assert all(f >= 3 for f, _ in bad)  # nothing before the kernel went wrong
    for block in range(3):
        mine = [f for f, b in bad if b == block]
        assert len(mine) <= (every - 1 if how == "noise" else 0) and mine == list(range(3, 3 + len(mine))), mine
    if how == "noise":
        assert bad  # the guard samples: between checks a block's calls are not compared
    assert sum(len(g["failures"]) for g in rec.snapshot()["guard"]) == 3
    assert spoiled(outs[3 + every:], refs) == []  # after its check, each block is served exactly


@pytest.mark.parametrize("off_by, caught", [(0.15, True), (0.105, True), (0.095, False)])
def test_the_guard_bound_itself_is_pinned(off_by, caught):
    """A quantised kernel off by 0.15 (or just past 0.1) is caught; one just inside 0.1 is not. By value: raising
    FAST_BOUND (or GUARD_MARGIN) so that a quantised kernel's guard bound is 0.2 fails this test."""
    kernel = Scaled(off_by)
    name = register(f"t_bound_{int(off_by * 1000)}", kernel)
    assert guard.bound_for(dispatcher.get_backend_spec(name)) == 0.1
    rec = Recorder()
    outs, refs = forwards(name, blocks_inputs(2), 2, rec, guard_every=1)
    failures = [f for g in rec.snapshot()["guard"] for f in g["failures"]]
    assert bool(failures) == caught, failures
    if caught:
        assert spoiled(outs, refs) == [] and f"{off_by:.2e}" in failures[0]["reason"]
    else:
        assert max(g["max_error"] for g in rec.snapshot()["guard"]) == pytest.approx(off_by, rel=1e-3)
        assert kernel.calls == 4


@pytest.mark.parametrize("ratio, caught", [(1.05, True), (0.95, False)])
def test_the_exact_bound_is_pinned_too(ratio, caught):
    """'every kernel' holds an exact kernel to twice its spec's error_bound: 4e-2 for a custom kernel's default
    2e-2, 2e-2 for native's 1e-2 (by value)."""
    probe = register("t_exact_probe", Scaled(0), quantised=False)
    bound = guard.bound_for(dispatcher.get_backend_spec(probe))
    assert bound == 4e-2 and guard.bound_for(dispatcher.get_backend_spec("native")) == 2e-2
    name = register(f"t_exact_{int(ratio * 100)}", Scaled(bound * ratio), quantised=False)
    rec = Recorder()
    forwards(name, blocks_inputs(1), 1, rec, guard="all", guard_every=1)
    assert bool([f for g in rec.snapshot()["guard"] for f in g["failures"]]) == caught


def test_a_demoted_block_skips_the_kernel_on_its_next_call():
    kernel = Drifting(over=20)
    name = register("t_demote", kernel)
    rec = Recorder()
    inputs = blocks_inputs(2, loud={1})
    forwards(name, inputs, 1, rec, guard_every=1000, model="model-a")
    calls = kernel.calls
    assert calls == 2
    q, k, v = inputs[1]
    with recording(rec):
        out = dispatch_attention_fn(q, k, v, backend=name, call_site="self #1", guard_every=1000, model="model-a")
    assert kernel.calls == calls  # the demoted block's next call never ran the kernel
    torch.testing.assert_close(out, exact(q, k, v))
    with recording(rec):  # block 0 keeps it; another model tries it on block 1 again (and catches it)
        dispatch_attention_fn(*inputs[0], backend=name, call_site="self #0", guard_every=1000, model="model-a")
        dispatch_attention_fn(q, k, v, backend=name, call_site="self #1", guard_every=1000, model="model-b")
    assert kernel.calls == calls + 2


def test_a_custom_kernel_returning_nan_is_caught_by_default():
    """Exact and not quantised, so never compared by default: its NaN is caught on whichever call makes it."""
    kernel = Drifting(good_calls=5, how="nan")
    name = register("t_custom_nan", kernel, quantised=False)
    rec = Recorder()
    outs, refs = forwards(name, blocks_inputs(2), 6, rec)
    assert spoiled(outs, refs) == []
    failed = [g for g in rec.snapshot()["guard"] if g["failures"]]
    assert {g["site"] for g in failed} == {"self #0", "self #1"}  # wrong from its 6th call on, in both blocks
    assert all("NaN" in g["failures"][0]["reason"] for g in failed) and kernel.calls == 7
    outs, _ = run_calls(register("t_custom_nan_off", Drifting(how="nan"), quantised=False), 1, guard="off")
    assert outs[0].isnan().any()  # off is off


class Bounded:
    """A check of this test's own: attention's output lies within the range of the values (softmax weights sum to
    one), so an output past max|V| went wrong. `each_call`: on every call, or on the guard's schedule."""

    def __init__(self, each_call):
        self.each_call, self.seen = each_call, []

    def watches(self, spec, mode):
        return spec.custom

    def judges(self, call):
        return True

    def verdict(self, call, out, spec, nth, clock):
        self.seen.append(call.call_site)
        top = float(call.value.abs().amax())
        return (None if float(out.abs().amax()) <= top * 1.001 else "its output leaves the values' range"), None


@pytest.mark.parametrize("each_call", [True, False])
def test_a_new_check_is_one_object_in_the_list_the_watch_walks(each_call, monkeypatch):
    """A check is one object in guard_rules.CHECKS: added there, it watches the kernels it says, runs on every call
    or on the schedule as it says, and its failure recomputes, demotes and reaches the recorder as the built-in
    comparison's and NaN/Inf check's do; nothing else is told of it."""
    check = Bounded(each_call)
    monkeypatch.setattr(guard_rules, "CHECKS", guard_rules.CHECKS + (check,))
    kernel = Drifting(good_calls=3, how="shifted")
    name = register(f"t_bounded_{each_call}", kernel, quantised=False)
    rec = Recorder()
    outs, ref = run_calls(name, 6, rec=rec, site="self #0", guard_every=1)
    assert all(torch.allclose(out, ref, atol=1e-5) for out in outs)  # the wrong calls were recomputed
    (entry,) = rec.snapshot()["guard"]
    (failure,) = entry["failures"]
    assert failure["reason"] == "its output leaves the values' range" and failure["replacement"]
    assert kernel.calls == 4 and check.seen == ["self #0"] * 4  # demoted at its 4th call: never asked again
    rules = guard_rules.rules_for(dispatcher.get_backend_spec(name), guard.DEFAULT, describe_call(
        *qkv(1, 32, h=2, d=16), None, 0.0, False, None, False, False, "BSHD"))
    assert check in (rules.each_call if each_call else rules.scheduled)


def test_the_replacement_is_the_fastest_exact_kernel_the_decision_knows():
    """A decision told its fastest exact kernel (auto_fast tells it auto_exact's choice) recomputes with it, not
    with the next one of the kernel's own chain."""
    name = register("t_replaced", Drifting(good_calls=0))
    rec = Recorder()
    q, k, v = qkv(1, 32, h=2, d=16)
    inputs = describe_call(q, k, v, None, 0.0, False, None, False, False, "BSHD")
    plain = decisions.decide(name, "fallback", inputs, "BSHD", guard.DEFAULT)
    told = decisions.decide(name, "fallback", inputs, "BSHD", guard.DEFAULT, exact="flex")
    assert [c.name for c in plain.candidates][:2] == [name, "native"]
    assert [c.name for c in told.candidates][:2] == [name, "flex"]
    call = AttentionCall(q, k, v, call_site="self #3")
    out = run(told.candidates[0], call)
    replacement = told.watch.after(told, told.candidates[0], call, out, rec, "fallback")
    assert replacement.name == "flex"
    assert told.watch.demoted[(name, "self #3")].startswith("quality guard at self #3")
    assert not told.watch.serves(told.candidates[0], "self #3") and told.watch.serves(told.candidates[0], "self #2")


# The cost model's intervals (the prior: provisional constants, guard_sizing.py), pinned by value: (batch, heads,
# tokens, head dim, keys) -> (every with the check kernel, every with the torch path). Re-fitting the constants
# changes them here; the interval actually used is measured (tests/test_guard_sizing.py).
SIZED = {
    "WAN 1.3B self": ((1, 12, 32760, 128, 32760), (4, 120)),
    "WAN 1.3B self, cfg batch": ((2, 12, 32760, 128, 32760), (3, 119)),
    "WAN 1.3B cross": ((2, 12, 32760, 128, 512), (59, 250)),
    "Wan 14B self": ((1, 40, 32760, 128, 32760), (3, 118)),
    "Flux": ((1, 24, 4608, 128, 4608), (42, 913)),
    "SDXL 1024 self": ((2, 20, 1024, 64, 1024), (324, 2896)),
    "SDXL 4096 self": ((2, 10, 4096, 64, 4096), (91, 1159)),
    "SDXL cross": ((2, 20, 1024, 64, 77), (486, 2207)),
}


@pytest.mark.parametrize("shape", list(SIZED))
def test_the_interval_is_sized_by_the_calls_cost(shape):
    """The cost model (the prior of every = 0) sizes the interval so checks cost at most BUDGET of the calls: video
    self-attention every few calls, SDXL's short calls every few hundred; the torch path (no Triton), whose ops
    cost host time per chunk of keys, far less often. An explicit interval stands."""
    (b, h, lq, d, lk), expected = SIZED[shape]
    sig = AttentionInputs.of(b, h, lq, d, len_kv=lk)
    got = (guard_sizing.interval(sig, kernel=True), guard_sizing.interval(sig, kernel=False))
    assert got == expected, got
    for kernel, every in zip((True, False), got):
        cost = guard_sizing.check_seconds(sig, kernel) / (every * guard_sizing.call_seconds(sig))
        assert cost <= guard.BUDGET and (every == 1 or cost > guard.BUDGET * (every - 1) / every)
    spec = dispatcher.get_backend_spec(register("t_sized", Drifting(good_calls=10**9)))
    # the model is only the prior, capped so that it errs on checking more often: the Watch sizes it from timings
    prior = min(guard_sizing.PRIOR_EVERY, guard_sizing.interval(sig))
    compare, finite = guard_rules.Comparison(), guard_rules.Finite()
    assert guard_rules.rules_for(spec, guard.DEFAULT, sig) == ((compare,), (finite,), prior, True)
    # custom: the NaN check on every call
    assert guard_rules.rules_for(spec, ("quantised", 7), sig) == ((compare,), (finite,), 7, False)
    assert guard_rules.rules_for(spec, ("off", 0), sig) is None


def test_the_cost_models_check_is_the_kernels_reads_and_rows():
    """A check with the kernel: CHECK_HOST_S, K, V and the output read once at MEMORY_BYTES_S, the rows' q.k at
    KERNEL_FLOPS and P.V at CHECK_FLOPS; WAN 1.3B's self-attention: 0.25 ms against an 8.3 ms call."""
    sig = AttentionInputs.of(1, 12, 32760, 128)
    read = 3 * 32760 * 12 * 128 * 2
    flops = 2.0 * 12 * 16 * 32760 * 128
    model = guard_sizing
    expected = model.CHECK_HOST_S + read / model.MEMORY_BYTES_S + flops / model.KERNEL_FLOPS + flops / model.CHECK_FLOPS
    assert model.check_seconds(sig, kernel=True) == pytest.approx(expected)
    assert model.check_seconds(sig, kernel=True) == pytest.approx(2.53e-4, rel=1e-2)
    assert model.call_seconds(sig) == pytest.approx(8.26e-3, rel=1e-2)


def test_the_report_says_within_how_many_calls_each_block_is_checked_again():
    """The rotation bound reaches the report: a block that turns bad mid-run is caught within that many of its
    calls (an interval sized on this machine: tests/test_guard_sizing.py)."""
    name = register("t_rotation", Drifting(good_calls=10**9))
    rec = Recorder()
    forwards(name, blocks_inputs(3), 4, rec, guard="quantised", guard_every=3)
    entries = rec.snapshot()["guard"]
    assert [(g["site"], g["every"]) for g in entries] == [(f"self #{i}", 3) for i in range(3)]
    assert "self #0: quality guard checked t_rotation 2 times" in rec.summary()
    assert "each block checked again within 3 of its calls" in rec.summary()


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
    with pytest.raises(ValueError, match=">= 1, or 0"):
        guard.settings("all", -1)
    assert guard.settings("all", 0) == ("all", 0) and guard.settings() == ("quantised", 0)
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
        return dispatch_attention_fn(q, k, v, backend=name, guard_every=3, recorder=rec, call_site="self #0")

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



def test_blocks_first_re_checks_are_spread_over_the_interval():
    """SDXL's 140 blocks with an interval of 1200 calls: no forward re-checks more than two of them, and the
    first 20 forwards at most four (consecutive phases would check one a forward, 20 in 20 forwards)."""
    phases = [guard_schedule.phase(n, 1200) or 1200 for n in range(140)]
    per_forward = {p: phases.count(p) for p in phases}
    assert max(per_forward.values()) <= 2
    assert sum(p <= 20 for p in phases) <= 4
    assert all(0 <= guard_schedule.phase(n, e) < e for n in range(50) for e in (1, 2, 3, 7))


def test_the_guard_bound_is_derived_from_the_admission_bound(monkeypatch):
    """One owner: auto's admission bound moves the guard's (twice it), for quantised and approximate kernels alike."""
    import dataclasses
    from dispatcher import auto
    quantised = dispatcher.get_backend_spec(register("t_derived_bound", Scaled(0.0)))
    approximate = dataclasses.replace(dispatcher.get_backend_spec("sol_attn"), error_bound=0.3)
    for spec in (quantised, approximate):
        assert guard.bound_for(spec) == guard.GUARD_MARGIN * auto.tuner.admission_bound(spec)
    assert guard.bound_for(approximate) == 0.6
    monkeypatch.setattr(guard, "FAST_BOUND", 0.2)
    assert auto.tuner.admission_bound(quantised) == 0.2 and guard.bound_for(quantised) == 0.4
    monkeypatch.setattr(guard, "GUARD_MARGIN", 3)
    assert guard.bound_for(quantised) == pytest.approx(0.6) and guard.bound_for(approximate) == pytest.approx(0.9)

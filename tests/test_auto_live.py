"""`auto_exact` / `auto_fast` judge candidates on the call's own activations, per model.

The kernels here are the failure modes of real ones: exact on N(0,1) noise, wrong on activations of larger
magnitude or with outlier channels (what diffusion models carry), and a quantised kernel whose error is small on
some models and large on others. Each is registered as the fastest candidate so `auto` would pick it if its
verdict were wrong.
"""

from __future__ import annotations


import pytest
import torch

import dispatcher
from dispatcher import Recorder, dispatch_attention_fn, model_scope, recording
from dispatcher import auto
from dispatcher.auto import Tuner
from dispatcher.auto import cache as disk_cache
from helpers import fake_clock
from helpers.tensors import qkv, sdpa as exact


CLOCK = fake_clock.FakeClock()  # the tuner's clock in every test here: only slow_exact takes time on it
slow_exact = CLOCK.kernel(20)  # exact, and slower than every kernel it competes with


@pytest.fixture(autouse=True)
def _fake_clock(monkeypatch):
    fake_clock.use(monkeypatch, CLOCK)


def clamping(q, k, v, **_):
    """Exact on N(0,1) noise; clamps inputs to [-4, 4] (an fp8/int8 range bug): wrong on large activations."""
    return exact(q.clamp(-4, 4), k.clamp(-4, 4), v.clamp(-4, 4))


def outlier_blind(q, k, v, **_):
    """Drops channels whose magnitude is far above the rest (a per-tensor scale overflowing): fine on noise."""
    keep = (q.abs().amax(dim=(0, 1, 2)) < 20).to(q.dtype)
    return exact(q * keep, k * keep, v)


def int8_like(q, k, v, **_):
    """Quantises q and k per tensor to int8 (SageAttention's first step) and v to a coarse 5-bit grid: about 3e-2
    off on N(0,1) values, 7e-2 to 1e-1 when one channel of v is 40x the rest (measured for seeds 1-3)."""
    def quant(t, levels):
        s = t.abs().amax().clamp_min(1e-6) / levels
        return (t / s).round() * s
    return exact(quant(q, 127), quant(k, 127), quant(v, 31))


def register(name, fn, **kw):
    dispatcher.register_backend(name, fn, devices=("cpu",), **kw)
    dispatcher.registry.set_priority((name,) + tuple(dispatcher.registry.names()))  # ranked first: ties go to it
    return name


@pytest.fixture
def tuner(tmp_path):
    def make(*names, **kw):
        t = Tuner(cache_path=tmp_path / "tune.json", backends=names, **kw)
        return auto.using(t)
    return make


def large(seed=0, scale=8.0):
    """Activations of standard deviation `scale`, as real diffusion activations often are."""
    q, k, v = qkv(1, 64, h=2, d=16, seed=seed)
    return q * scale, k * scale, v * scale


def served(rec) -> set[str]:
    return {row["served"] for row in rec.snapshot()["rows"]}


@pytest.mark.parametrize("wrong", [clamping, outlier_blind], ids=["clamps", "outlier channels"])
def test_a_kernel_exact_on_noise_but_wrong_on_live_values_is_rejected(tuner, wrong):
    bad, good = register("t_bad", wrong), register("t_good", slow_exact)
    noise_record = Tuner(cache_path=None, backends=(bad, good)).tune(
        dispatcher.AttentionInputs.of(1, 2, 64, 16, dtype=torch.float32, device="cpu"))
    assert {c.name: c.status for c in noise_record.candidates}[bad] in ("valid", "chosen")  # noise is fooled
    q, k, v = large()
    if wrong is outlier_blind:
        q[..., 3] *= 10  # an outlier channel
    rec = Recorder()
    with tuner(bad, good) as t, recording(rec), model_scope("wan-a"):
        out = dispatch_attention_fn(q, k, v, backend="auto_exact")
    torch.testing.assert_close(out, exact(q, k, v))
    assert served(rec) == {good}
    (record,) = t.records()
    assert record.judged_on == "live values" and record.model == "wan-a"
    rejected = {c.name: c for c in record.rejected}
    assert rejected[bad].rel_error > 5e-2 and "own activations" in rejected[bad].reason


def test_auto_exact_never_runs_a_quantised_kernel_and_auto_fast_judges_it(tuner):
    quantised = register("t_int8", int8_like, quantised=True)
    exactly = register("t_exact", slow_exact)
    q, k, v = qkv(1, 64, h=2, d=16, seed=2)
    with tuner(quantised, exactly) as t, model_scope("sd15"):
        rec = Recorder()
        with recording(rec):
            dispatch_attention_fn(q, k, v, backend="auto_exact")
            dispatch_attention_fn(q, k, v, backend="auto")  # the older name: the same as auto_exact
        assert served(rec) == {exactly}
        rec = Recorder()
        with recording(rec):
            dispatch_attention_fn(q, k, v, backend="auto_fast")
        assert served(rec) == {quantised}  # within FAST_BOUND on these values, and faster
        fast = next(r for r in t.records() if not r.exact)
        chosen = next(c for c in fast.candidates if c.name == quantised)
        assert chosen.rel_error < auto.FAST_BOUND and chosen.error_bound == auto.FAST_BOUND


def test_auto_fast_rejects_a_quantised_kernel_past_the_bound_on_this_models_values(tuner):
    quantised = register("t_int8", int8_like, quantised=True)
    exactly = register("t_exact", slow_exact)
    q, k, v = qkv(1, 64, h=2, d=16, seed=2)
    v = v.clone()
    v[:, :, :, 0] *= 40  # one outlier channel in v: a coarse per-tensor grid wipes out the rest
    rec = Recorder()
    with tuner(quantised, exactly) as t, model_scope("flux"), recording(rec):
        dispatch_attention_fn(q, k, v, backend="auto_fast")
    assert served(rec) == {exactly}
    (record,) = t.records()
    bad = {c.name: c for c in record.rejected}[quantised]
    assert bad.rel_error > auto.FAST_BOUND and "own activations" in bad.reason


def test_noise_never_admits_a_quantised_kernel():
    quantised = register("t_int8", int8_like, quantised=True)
    exactly = register("t_exact", slow_exact)
    record = Tuner(cache_path=None, backends=(quantised, exactly)).tune(
        dispatcher.AttentionInputs.of(1, 2, 64, 16, dtype=torch.float32, device="cpu"))
    assert record.chosen == exactly and record.judged_on == "noise"
    assert {c.name: c.status for c in record.candidates}[quantised] == "unjudged"


def test_verdicts_belong_to_their_model_timings_are_shared(tuner, tmp_path):
    quantised = register("t_int8", int8_like, quantised=True)
    exactly = register("t_exact", slow_exact)
    fine = qkv(1, 64, h=2, d=16, seed=3)
    hostile = list(qkv(1, 64, h=2, d=16, seed=3))
    hostile[2] = hostile[2].clone()
    hostile[2][..., 0] *= 40
    with tuner(quantised, exactly) as t:
        rec_a, rec_b = Recorder(), Recorder()
        with model_scope("model-a"), recording(rec_a):
            dispatch_attention_fn(*fine, backend="auto_fast")
        timed = t.timing_calls
        with model_scope("model-b"), recording(rec_b):
            dispatch_attention_fn(*hostile, backend="auto_fast")
        assert t.timing_calls == timed  # model b reused model a's timings ...
    assert served(rec_a) == {quantised} and served(rec_b) == {exactly}  # ... but not its verdict
    saved = disk_cache.dump(tmp_path / "tune.json")
    (entry,) = saved["machines"].values()
    (decision,) = entry["decisions"].values()
    assert decision["verdicts"]["model-a"]["attention"][quantised]["status"] == "valid"  # per model and block
    assert decision["verdicts"]["model-b"]["attention"][quantised]["status"] == "rejected"
    assert set(decision["timings"]) == {quantised, exactly}
    # A new process for model a reads its verdict from disk; for an unknown model it judges again.
    again = Tuner(cache_path=tmp_path / "tune.json", backends=(quantised, exactly))
    assert again.tune(*fine, model="model-a").source == "disk"
    other = again.tune(*fine, model="model-c")
    assert other.source == "judged" and other.judged_on == "live values" and again.timing_calls == 0


def hostile_block(seed=3):
    """One block's activations where int8_like is off by more than FAST_BOUND (one channel of v 40x the rest)."""
    q, k, v = qkv(1, 64, h=2, d=16, seed=seed)
    v = v.clone()
    v[..., 0] *= 40
    return q, k, v


def test_auto_fast_judges_every_block_on_its_own_activations(tuner, tmp_path):
    """Three blocks share one signature; the quantised kernel is wrong on block 1's activations only. auto_fast
    judges it on each block's first call: blocks 0 and 2 get it, block 1 the exact kernel, and no output of the
    quantised kernel on block 1 ever reaches the caller. Timing is per signature: blocks 1 and 2 time nothing."""
    quantised = register("t_int8", int8_like, quantised=True)
    exactly = register("t_exact", slow_exact)
    fine = qkv(1, 64, h=2, d=16, seed=3)
    blocks = [fine, hostile_block(), tuple(t * 1.01 for t in fine)]
    rec = Recorder()
    with tuner(quantised, exactly) as t, model_scope("model-a"), recording(rec):
        outs = [dispatch_attention_fn(*blocks[0], backend="auto_fast", call_site="self #0")]
        timed = t.timing_calls
        outs += [dispatch_attention_fn(*b, backend="auto_fast", call_site=f"self #{i}") for i, b in
                 enumerate(blocks[1:], 1)]
        assert t.timing_calls == timed
        for _ in range(2):  # later forwards: the choices are kept per block
            outs += [dispatch_attention_fn(*b, backend="auto_fast", call_site=f"self #{i}") for i, b in
                     enumerate(blocks)]
        records = {r.block: r for r in t.records()}
    served = {(r["site"], r["served"]): r["calls"] for r in rec.snapshot()["rows"]}
    assert served == {("self #0", quantised): 3, ("self #1", exactly): 3, ("self #2", quantised): 3}, served
    for i, out in enumerate(outs):
        if i % 3 == 1:
            torch.testing.assert_close(out, exact(*blocks[1]))  # the exact kernel's output, never int8_like's
    assert records["self #1"].chosen == exactly and records["self #1"].judged_on == "live values"
    assert {c.name: c.status for c in records["self #1"].candidates}[quantised] == "rejected"
    saved = disk_cache.dump(tmp_path / "tune.json")
    (entry,) = saved["machines"].values()
    (decision,) = [d for key, d in entry["decisions"].items() if not key.startswith("step|")]  # not the step's
    verdicts = decision["verdicts"]["model-a"]
    assert {b: verdicts[b][quantised]["status"] for b in verdicts} == {"self #0": "valid", "self #1": "rejected",
                                                                        "self #2": "valid"}
    # a new process reads each block's verdict from disk and judges a block it never saw
    again = Tuner(cache_path=tmp_path / "tune.json", backends=(quantised, exactly))
    assert again.tune(*hostile_block(), model="model-a", block="self #1").source == "disk"
    assert again.tune(*hostile_block(), model="model-a", block="self #1").chosen == exactly
    new = again.tune(*fine, model="model-a", block="self #7")
    assert new.source == "judged" and new.chosen == quantised and again.timing_calls == 0


def test_a_block_where_the_quantised_kernel_fails_later_is_recomputed_with_auto_exacts_choice(tuner):
    """auto_fast tells the decision of its quantised pick the fastest exact kernel (auto_exact's choice for the
    signature): when the guard catches the kernel on a block, that kernel recomputes the call, not the next one
    of the quantised kernel's own chain (here 'native'), and only that block moves."""
    state = {"calls": 0}

    def drifting(q, k, v, **_):
        state["calls"] += 1
        out = exact(q, k, v)
        return out + torch.randn_like(out) if state["calls"] > 4 and q.abs().amax() > 20 else out

    quantised = register("t_drift8", drifting, quantised=True, fallback=("native",))
    exactly = register("t_exact", slow_exact)
    q, k, v = qkv(1, 64, h=2, d=16, seed=3)
    blocks = [(q, k, v), (q * 1.5, k, v)]
    rec = Recorder()
    with tuner(quantised, exactly), model_scope("model-g"), recording(rec):
        for _ in range(2):
            for i, b in enumerate(blocks):
                dispatch_attention_fn(*b, backend="auto_fast", call_site=f"self #{i}", guard_every=1)
        loud = (q * 30, k, v)  # the same signature, now with activations the kernel gets wrong
        out = dispatch_attention_fn(*loud, backend="auto_fast", call_site="self #1", guard_every=1)
        torch.testing.assert_close(out, exact(*loud))
        after = dispatch_attention_fn(*blocks[0], backend="auto_fast", call_site="self #0", guard_every=1)
        torch.testing.assert_close(after, exact(*blocks[0]))
    (failure,) = [f for g in rec.snapshot()["guard"] for f in g["failures"]]
    assert failure["replacement"] == exactly
    served = {(r["site"], r["served"]): r["calls"] for r in rec.snapshot()["rows"]}
    assert served[("self #1", exactly)] == 1 and served[("self #0", quantised)] == 3, served


def test_unscoped_verdicts_stay_in_memory(tuner, tmp_path):
    quantised = register("t_int8", int8_like, quantised=True)
    exactly = register("t_exact", slow_exact)
    with tuner(quantised, exactly):
        dispatch_attention_fn(*qkv(1, 64, h=2, d=16), backend="auto_fast")
    saved = disk_cache.dump(tmp_path / "tune.json")
    (entry,) = saved["machines"].values()
    (decision,) = entry["decisions"].values()
    assert decision["verdicts"] == {} and decision["timings"]


def test_model_must_be_a_name():
    with pytest.raises(ValueError, match="non-empty string"):
        with model_scope(""):
            pass
    with pytest.raises(ValueError, match="non-empty string"):
        Tuner(cache_path=None).tune(*qkv(), model=3)


def test_a_new_process_starts_the_next_block_and_auto_exact_from_what_the_disk_had(tuner, tmp_path):
    """Block 0 of model a from disk in a new process: block 5 (never judged) judges only the quantised kernel, and
    auto_exact's choice for the signature (what replaces a failing quantised pick) times nothing."""
    quantised = register("t_int8", int8_like, quantised=True)
    exactly = register("t_exact", slow_exact)
    fine = qkv(1, 64, h=2, d=16, seed=3)
    Tuner(cache_path=tmp_path / "tune.json", backends=(quantised, exactly)).tune(*fine, model="model-a",
                                                                                  block="self #0")
    again = Tuner(cache_path=tmp_path / "tune.json", backends=(quantised, exactly))
    assert again.tune(*fine, model="model-a", block="self #0").source == "disk"
    new = again.tune(*fine, model="model-a", block="self #5")
    assert new.source == "judged" and again.timing_calls == 0
    assert {c.name: c.status for c in new.candidates} == {quantised: "chosen", exactly: "valid"}
    assert new.reason.startswith("judged and timed earlier") or new.judged_on == "live values"
    exact_record = again.tune(*fine, model="model-a", exact=True)
    assert exact_record.chosen == exactly and again.timing_calls == 0


def test_a_200_block_model_logs_one_line_per_decision_group_then_a_summary(tuner, caplog):
    """A 200-block WAN under `auto_fast` once logged 1,200 lines on its first prompt (a decision line and a
    warning per rejected kernel, per block and site): now the first block of each outcome is logged, the other
    blocks counted, and the summary says how many."""
    import logging
    auto.log_summary()  # nothing left from another test
    quantised = register("t_int8", int8_like, quantised=True)
    exactly = register("t_exact", slow_exact)
    caplog.set_level(logging.INFO, logger="attention_dispatch")
    with tuner(quantised, exactly) as t:
        caplog.clear()
        for block in range(200):
            q, k, v = qkv(1, 64, h=2, d=16, seed=2)
            if block % 50 == 49:  # a few blocks with an outlier channel: the quantised kernel is rejected there
                v = v.clone()
                v[:, :, :, 0] *= 40
            t.tune(q, k, v, model="wan", block=f"self #{block}")
    lines = [r.getMessage() for r in caplog.records if r.name == "attention_dispatch"]
    assert len(lines) == 2, lines  # one per outcome
    assert all("same outcome are counted, not logged" in line for line in lines), lines
    assert sum("rejected: t_int8" in line for line in lines) == 1, lines  # said once, in the line
    caplog.clear()
    auto.log_summary()
    (summary,) = [r.getMessage() for r in caplog.records]
    assert "this run decided 198 more blocks" in summary, summary
    assert "-> t_int8 for 196 blocks of model wan" in summary and "-> t_exact for 4 blocks" in summary, summary
    caplog.clear()
    auto.log_summary()
    assert not caplog.records  # said once

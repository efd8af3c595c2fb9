"""`auto_exact` / `auto_fast` judge candidates on the call's own activations, per model.

The kernels here are the failure modes of real ones: exact on N(0,1) noise, wrong on activations of larger
magnitude or with outlier channels (what diffusion models carry), and a quantised kernel whose error is small on
some models and large on others. Each is registered as the fastest candidate so `auto` would pick it if its
verdict were wrong.
"""

from __future__ import annotations

import json

import pytest
import torch

import dispatcher
from dispatcher import Recorder, dispatch_attention_fn, model_scope, recording
from dispatcher import auto
from dispatcher.auto import Tuner
from helpers.tensors import qkv, sdpa as exact


def slow_exact(q, k, v, **kw):
    import time
    time.sleep(0.02)
    return exact(q, k, v)


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
        kw.setdefault("time_budget_s", 2.0)  # not the 0.5 s CPU default: these kernels sleep, the machine is loaded
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
    saved = json.loads((tmp_path / "tune.json").read_text())
    (entry,) = saved["machines"].values()
    (decision,) = entry["decisions"].values()
    assert decision["verdicts"]["model-a"][quantised]["status"] == "valid"
    assert decision["verdicts"]["model-b"][quantised]["status"] == "rejected"
    assert set(decision["timings"]) == {quantised, exactly}
    # A new process for model a reads its verdict from disk; for an unknown model it judges again.
    again = Tuner(cache_path=tmp_path / "tune.json", backends=(quantised, exactly))
    assert again.tune(*fine, model="model-a").source == "disk"
    other = again.tune(*fine, model="model-c")
    assert other.source == "judged" and other.judged_on == "live values" and again.timing_calls == 0


def test_unscoped_verdicts_stay_in_memory(tuner, tmp_path):
    quantised = register("t_int8", int8_like, quantised=True)
    exactly = register("t_exact", slow_exact)
    with tuner(quantised, exactly):
        dispatch_attention_fn(*qkv(1, 64, h=2, d=16), backend="auto_fast")
    saved = json.loads((tmp_path / "tune.json").read_text())
    (entry,) = saved["machines"].values()
    (decision,) = entry["decisions"].values()
    assert decision["verdicts"] == {} and decision["timings"]


def test_model_must_be_a_name():
    with pytest.raises(ValueError, match="non-empty string"):
        with model_scope(""):
            pass
    with pytest.raises(ValueError, match="non-empty string"):
        Tuner(cache_path=None).tune(*qkv(), model=3)

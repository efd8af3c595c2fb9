"""`auto` decides for the model's step, not for each call alone (dispatcher/auto/step.py, issue #39).

Two kernels and two signatures on the fake clock (helpers/fake_clock.py): each kernel takes a fixed time per call on
each signature, and a call that follows the other kernel may pay a switch (the host time of changing SDPA's flags,
a kernel's own set-up), which timing a kernel back to back never shows. The forward is two call sites, one of each
signature; the tuner records it, and once the next forward begins, replays it for the mix of per-signature picks
and for each single kernel, and keeps the winner.
"""

from __future__ import annotations

import pytest
import torch

import dispatcher
from dispatcher import Recorder, dispatch_attention_fn, model_scope, recording
from dispatcher import auto
from dispatcher.auto import Tuner, step
from helpers import fake_clock
from helpers.tensors import sdpa as exact

SHORT, LONG = 32, 48  # the two signatures' lengths


@pytest.fixture
def clock(monkeypatch):
    return fake_clock.use(monkeypatch)


@pytest.fixture(autouse=True)
def _own_default_tuner(tmp_path):
    with auto.using(Tuner(cache_path=tmp_path / "default-tune.json", backends=())):
        yield


def kernels(clock, times: dict, switch_ms: float = 0.0) -> list[str]:
    """Register one CPU backend per entry of times ({name: {length: ms}}), in priority order; a call that follows
    another of these kernels pays `switch_ms` more."""
    last = [None]

    def make(name):
        def kernel(q, k, v, **_):
            clock.advance(times[name][q.shape[1]] + (switch_ms if last[0] not in (None, name) else 0.0))
            last[0] = name
            return exact(q, k, v)
        return kernel

    names = list(times)
    for name in names:
        dispatcher.register_backend(name, make(name), devices=("cpu",))
    dispatcher.registry.set_priority(tuple(names) + tuple(n for n in dispatcher.registry.names() if n not in names))
    return names


def run_forwards(tmp_path, names, forwards=3, model="step-model", **kw):
    """`forwards` forwards of two call sites (SHORT then LONG) under auto_exact; (tuner, served per site)."""
    short = [torch.randn(1, SHORT, 2, 16) for _ in range(3)]
    long = [torch.randn(1, LONG, 2, 16) for _ in range(3)]
    rec = Recorder()
    tuner = Tuner(cache_path=tmp_path / "tune.json", backends=names, time_budget_s=2, **kw)
    with auto.using(tuner), model_scope(model), recording(rec):
        for _ in range(forwards):
            for site, (q, k, v) in (("self #0", short), ("self #1", long)):
                out = dispatch_attention_fn(q, k, v, backend="auto_exact", call_site=site)
                torch.testing.assert_close(out, exact(q, k, v))
    served = {}
    for row in rec.snapshot()["rows"]:
        served.setdefault(row["site"], {})[row["served"]] = row["calls"]
    return tuner, served


def picks(tuner) -> dict[int, str]:
    return {r.signature.len_q: r.chosen for r in tuner.records()}


def test_a_mix_that_loses_to_one_kernel_in_the_step_gives_way_to_it(tmp_path, clock):
    """Each kernel is 3x faster on one signature when timed alone, but a call after the other kernel pays 3 ms:
    the mix runs 8 ms a forward, either kernel alone 4 ms. The step goes to one kernel (the first in priority)."""
    names = kernels(clock, {"s_x": {SHORT: 1, LONG: 3}, "s_y": {SHORT: 3, LONG: 1}}, switch_ms=3)
    tuner, served = run_forwards(tmp_path, names)
    assert picks(tuner) == {SHORT: "s_x", LONG: "s_y"}  # each signature alone
    (decision,) = tuner.steps()
    assert decision.source == "timed" and decision.chosen == "s_x"
    assert decision.step_ms[step.MIX] == pytest.approx(8) and decision.step_ms["s_x"] == pytest.approx(4)
    # the first forward is served by the provisional per-signature picks, every later one by the step's kernel
    assert served == {"self #0": {"s_x": 3}, "self #1": {"s_y": 1, "s_x": 2}}
    assert "s_x for every call" in tuner.explain()


def test_a_mix_that_really_wins_is_kept(tmp_path, clock):
    names = kernels(clock, {"s_x2": {SHORT: 1, LONG: 5}, "s_y2": {SHORT: 5, LONG: 1}})
    tuner, served = run_forwards(tmp_path, names)
    (decision,) = tuner.steps()
    assert decision.source == "timed" and decision.chosen == step.MIX
    assert decision.step_ms[step.MIX] == pytest.approx(2) and decision.step_ms["s_x2"] == pytest.approx(6)
    assert served == {"self #0": {"s_x2": 3}, "self #1": {"s_y2": 3}}


def test_within_the_noise_one_kernel_serves_every_call(tmp_path, clock):
    """The mix is 0.75% faster than either kernel alone: below the noise a step resolves (step.STEP_FLOOR), so one
    kernel serves every call."""
    names = kernels(clock, {"s_x3": {SHORT: 1.0, LONG: 1.015}, "s_y3": {SHORT: 1.015, LONG: 1.0}})
    tuner, served = run_forwards(tmp_path, names)
    assert picks(tuner) == {SHORT: "s_x3", LONG: "s_y3"}
    (decision,) = tuner.steps()
    assert decision.chosen == "s_x3" and decision.step_ms[step.MIX] < decision.step_ms["s_x3"]
    assert served["self #1"] == {"s_y3": 1, "s_x3": 2}


def test_the_step_decision_is_kept_on_disk_for_the_model(tmp_path, clock):
    names = kernels(clock, {"s_x4": {SHORT: 1, LONG: 3}, "s_y4": {SHORT: 3, LONG: 1}}, switch_ms=3)
    run_forwards(tmp_path, names)
    again, served = run_forwards(tmp_path, names)  # a new process: the same model's forward
    (decision,) = again.steps()
    assert decision.source == "disk" and decision.chosen == "s_x4" and again.timing_calls == 0
    assert served["self #1"] == {"s_y4": 1, "s_x4": 2}


def test_no_step_check_keeps_each_calls_pick(tmp_path, clock):
    names = kernels(clock, {"s_x5": {SHORT: 1, LONG: 3}, "s_y5": {SHORT: 3, LONG: 1}}, switch_ms=3)
    tuner, served = run_forwards(tmp_path, names, step_check=False)
    assert not tuner.steps() and served == {"self #0": {"s_x5": 3}, "self #1": {"s_y5": 3}}

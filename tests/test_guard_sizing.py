"""The quality guard's interval sized on this machine (dispatcher/guard_sizing.py): `guard_every` = 0 checks one call
in ceil(check / (BUDGET * call)) of each block, the call's and the check's times measured by the first checks
themselves. Before, the interval came from the H200's constants on every machine: on a CPU a (1, 1024, 4, 64) call
"cost" microseconds and the interval came out at 2,171, so a block that turned bad at step 5 spoiled all its calls."""

from __future__ import annotations

import time

import pytest
import torch

import dispatcher
from dispatcher import Recorder, dispatch_attention_fn, guard, guard_rules, guard_sizing, recording
from dispatcher.events import GuardChecked
from dispatcher.inputs import describe_call
from dispatcher.report import rotation_text
from helpers.tensors import qkv, sdpa as exact


def test_the_prior_errs_on_checking_more_often():
    """Before anything is measured the interval is the cost model's capped at PRIOR_EVERY: the H200's figures that
    gave 2,171 on the issue's CPU shape give 8 until this machine has timed its checks."""
    q, k, v = qkv(1, 1024, h=4, d=64)
    sig = describe_call(q, k, v, None, 0.0, False, None, False, False, "BSHD")
    assert guard_sizing.interval(sig) > 1000  # what the constants alone say on a CPU
    spec = dispatcher.get_backend_spec(dispatcher.register_backend("t_prior", exact, devices=("cpu",),
                                                                   quantised=True).name)
    assert guard_rules.rules_for(spec, guard.DEFAULT, sig).every == guard_sizing.PRIOR_EVERY


class Sleepy:
    """Exact attention after `seconds` of sleep: a kernel whose calls take a known time."""

    def __init__(self, seconds):
        self.seconds = seconds

    def __call__(self, q, k, v, **_):
        time.sleep(self.seconds)
        return exact(q, k, v)


def sized(name, blocks, forwards) -> tuple[dict, Recorder]:
    """`forwards` forwards of `blocks` named blocks at the default interval: the recorder's sizing entry."""
    q, k, v = qkv(1, 16, h=1, d=8)
    rec = Recorder()
    with recording(rec), dispatcher.model_scope(name):
        for _ in range(forwards):
            for block in range(blocks):
                dispatch_attention_fn(q, k, v, backend=name, call_site=f"self #{block}")
    (entry,) = rec.snapshot()["guard_sizing"]
    return entry, rec


def test_the_interval_is_sized_from_the_calls_and_checks_this_machine_timed():
    """The first TIMED_CHECKS checks time the call they check and themselves; the interval is then sized from
    those times (the check's least, the call's median): a kernel whose calls take 30 ms is checked far more often
    than the same kernel without the sleep, the report says so and says the rotation bound that follows."""
    slow = dispatcher.register_backend("t_sized_slow", Sleepy(0.03), devices=("cpu",), quantised=True).name
    fast = dispatcher.register_backend("t_sized_fast", exact, devices=("cpu",), quantised=True).name
    blocks = guard_sizing.TIMED_CHECKS
    slow_entry, rec = sized(slow, blocks, 4)
    fast_entry, _ = sized(fast, blocks, 1)
    assert slow_entry["timed_checks"] >= guard_sizing.TIMED_CHECKS and slow_entry["call_ms"] >= 30
    assert slow_entry["interval"] == guard_sizing.interval_of(slow_entry["call_ms"] / 1e3,
                                                              slow_entry["check_ms"] / 1e3)
    assert slow_entry["interval"] < fast_entry["interval"]
    text = rec.summary()
    assert f"one call in {slow_entry['interval']} of each block, sized on this machine" in text
    assert rotation_text(slow_entry["interval"]) in text  # "each block checked again within N of its calls"


class StepRecorder(Recorder):
    """A Recorder that also keeps, in order, each passed check's (step, block, interval in force after it)."""

    step = 0

    def __init__(self):
        super().__init__()
        self.checks = []

    def record_guard(self, event):
        super().record_guard(event)
        if isinstance(event, GuardChecked):
            self.checks.append((self.step, event.site, event.every))


def test_the_blocks_are_then_checked_at_the_measured_interval():
    """Each named block is checked again within the interval in force at its last check: the prior's for the first
    checks, then the measured one, which the report then says."""
    name = dispatcher.register_backend("t_sized_rotation", Sleepy(0.02), devices=("cpu",), quantised=True).name
    blocks = guard_sizing.TIMED_CHECKS
    q, k, v = qkv(1, 16, h=1, d=8)
    rec = StepRecorder()
    with recording(rec), dispatcher.model_scope(name):
        for rec.step in range(12):
            for block in range(blocks):
                dispatch_attention_fn(q, k, v, backend=name, call_site=f"self #{block}")
    assert rec.snapshot()["guard_sizing"][0]["timed_checks"] >= guard_sizing.TIMED_CHECKS
    for block in range(blocks):
        mine = [(step, every) for step, site, every in rec.checks if site == f"self #{block}"]
        assert mine[0][0] == 0 and all(b - a <= every for (a, every), (b, _) in zip(mine, mine[1:])), mine


def test_the_sizing_takes_the_least_check_and_the_median_call_and_sizes_again_as_checks_come():
    """A first call and check that compile a kernel (here 1 s) are left out; sized at 5, 10, 15, ... 80 timed
    checks, from all of them, each sizing at most GROWTH times the interval before: a start slowed by other work
    neither stretches the interval at once nor stays; the checks after 80 time nothing."""
    sizing = guard_sizing.Sizing(8)
    assert sizing.add(1.0, 1.0) is None and sizing.every == 8  # the prior until TIMED_CHECKS
    for _ in range(3):
        assert sizing.add(0.010, 0.00395) is None
    assert sizing.add(0.010, 0.00395) is True  # 0.00395 / (0.01 * 0.010) = 39.5: 40, at most 2 x 8
    assert sizing.every == guard_sizing.GROWTH * 8 == 16 and sizing.measured
    for _ in range(4):
        assert sizing.add(0.010, 0.00395) is None
    assert sizing.add(0.010, 0.00395) is True and sizing.every == 32  # 10 timed: at most 2 x 16
    assert sizing.add(0.010, 0.00095) is None  # the machine is quieter now: cheaper checks
    for _ in range(4):
        sizing.add(0.010, 0.00095)
    assert sizing.every == 10 and sizing.call_s == 0.010 and sizing.check_s == 0.00095
    while sizing.timing:
        sizing.add(0.010, 0.00095)
    assert len(sizing.checks) == guard_sizing.LAST_TIMED


def test_the_cpu_clock_times_the_call_and_the_check():
    clock = guard_sizing.Clock(torch.device("cpu"))
    time.sleep(0.02)
    clock.called()
    time.sleep(0.01)
    clock.launched()
    call_s, check_s = clock.seconds()
    assert 0.02 <= call_s < 0.2 and 0.01 <= check_s < 0.2


def test_an_interval_given_is_not_timed(monkeypatch):
    """guard_every=N stands: no check times itself, nothing is sized."""
    name = dispatcher.register_backend("t_sized_given", exact, devices=("cpu",), quantised=True).name
    monkeypatch.setattr(guard_sizing, "Clock", lambda device: pytest.fail("a given interval timed a check"))
    q, k, v = qkv(1, 16, h=1, d=8)
    rec = Recorder()
    with recording(rec):
        for block in range(8):
            dispatch_attention_fn(q, k, v, backend=name, call_site=f"self #{block}", guard_every=3)
    assert rec.snapshot()["guard_sizing"] == []

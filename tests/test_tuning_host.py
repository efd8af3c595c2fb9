"""Tuning as a host (ComfyUI) sees it: a budget that covers every call, first ones included; progress events;
an interrupt that stops tuning with the host's own exception; one failing custom backend left out with its reason,
never the end of tuning.

Custom CPU backends and tuners restricted to them, as in test_tuner.py; the hooks are reset after each test. The
tuner's clock is a fake one (helpers/fake_clock.py): each kernel takes the time a test gives it, so the budget
runs out, and the final round runs, exactly where the test says, however loaded the machine is.
"""

from __future__ import annotations

import pytest
import torch

import dispatcher
from dispatcher import dispatch_attention_fn, model_scope
from dispatcher import auto as tuner
from dispatcher.auto import Tuner, hooks
from helpers import fake_clock
from helpers.tensors import sdpa as exact

SIG = dispatcher.AttentionInputs.of(1, 2, 32, 16, dtype=torch.float32, device="cpu")


def register(name, fn, **kw):
    dispatcher.register_backend(name, fn, devices=("cpu",), **kw)
    return name


@pytest.fixture(autouse=True)
def clock(monkeypatch):
    return fake_clock.use(monkeypatch)


@pytest.fixture(autouse=True)
def _clean(tmp_path):
    with tuner.using(Tuner(cache_path=tmp_path / "default-tune.json", backends=())):
        yield
    hooks.set_progress_hook(None)
    hooks.set_interrupt_check(None)


def make(tmp_path, *names, **kw) -> Tuner:
    return Tuner(cache_path=tmp_path / "tune.json", backends=names, **kw)


def slow_first_call(clock, ms):
    """A kernel whose first call loads or compiles for `ms`, then runs in 1 ms."""
    return clock.kernel(lambda call: ms if call == 1 else 1)


def test_the_default_budget_is_short_on_a_cpu(monkeypatch):
    monkeypatch.delenv(tuner.ENV_BUDGET, raising=False)
    t = Tuner(cache_path=None)
    assert t.budget("cpu") == tuner.tuner.CPU_BUDGET_S < t.budget("cuda") == tuner.DEFAULT_BUDGET_S
    assert Tuner(cache_path=None, time_budget_s=3).budget("cpu") == 3
    monkeypatch.setenv(tuner.ENV_BUDGET, "0.25")
    assert Tuner(cache_path=None).budget("cuda") == 0.25


def test_first_calls_count_against_the_budget(tmp_path, clock):
    """Three kernels that each spend 0.2 s in their first call, with a 0.3 s budget: the first is tried and timed
    (a pick needs one), the second's first call runs past the budget (it is judged, not timed), the third is
    never tried."""
    names = [register(f"h_loads{i}", slow_first_call(clock, 200)) for i in range(3)]
    record = make(tmp_path, *names, time_budget_s=0.3).tune(SIG)
    by = {c.name: c for c in record.candidates}
    assert record.chosen == names[0] and record.source == "timed"
    assert by[names[0]].first_call_ms == pytest.approx(200) and by[names[0]].median_ms == pytest.approx(1)
    assert by[names[1]].first_call_ms == pytest.approx(200) and by[names[1]].median_ms is None
    assert "not timed" in by[names[1]].reason and "budget" in by[names[1]].reason
    assert by[names[2]].first_call_ms is None and "not tried" in by[names[2]].reason
    assert "budget" in by[names[2]].reason
    # the budget, and at most the one step that began before it ran out: 0.2 s + 1 ms x (warm + 5 runs) + 0.2 s
    assert record.seconds == pytest.approx(0.406)


def test_progress_events_from_start_to_the_pick(tmp_path):
    names = register("h_a", exact), register("h_b", exact)
    events = []
    hooks.set_progress_hook(events.append)
    with model_scope("unet"):
        record = make(tmp_path, *names, time_budget_s=1).tune(torch.randn(1, 32, 2, 16))
    stages = [e.stage for e in events]
    assert stages[0] == "start" and stages[-1] == "done" and stages.count("candidate") == 2
    assert [e.candidate for e in events if e.stage == "candidate"] == list(names)
    assert events[-1].chosen == record.chosen and events[-1].model == "unet" and events[-1].kind == "auto_fast"
    assert all(e.budget_s == 1 for e in events)
    assert "trying h_b (2 of 2)" in [e.text() for e in events if e.stage == "candidate"][1]
    assert events[-1].text().startswith(f"auto_fast: {record.chosen} for q 1x32x2x16 (")


def test_a_failing_progress_hook_is_said_once_and_never_breaks_tuning(tmp_path, caplog):
    names = register("h_a", exact), register("h_b", exact)

    def broken(event):
        raise ValueError("display gone")
    hooks.set_progress_hook(broken)
    t = make(tmp_path, *names, time_budget_s=1)
    assert t.tune(SIG).source == "timed"
    assert t.tune(dispatcher.AttentionInputs.of(1, 2, 48, 16, dtype=torch.float32, device="cpu")).source == "timed"
    said = [r for r in caplog.records if "progress hook" in r.getMessage()]
    assert len(said) == 1 and "display gone" in said[0].getMessage()


class HostInterrupt(Exception):
    """Stands for ComfyUI's InterruptProcessingException (an Exception subclass, as there)."""


def test_an_interrupt_stops_tuning_with_the_hosts_exception(tmp_path):
    names = register("h_a", exact), register("h_b", exact), register("h_c", exact)
    asked = {"n": 0}

    def check():  # the user presses Cancel while the second candidate is tried
        asked["n"] += 1
        if asked["n"] == 3:
            raise HostInterrupt("cancelled")
    hooks.set_interrupt_check(check)
    t = make(tmp_path, *names, time_budget_s=1)
    q = torch.randn(1, 32, 2, 16)
    with tuner.using(t), pytest.raises(HostInterrupt, match="cancelled"):
        dispatch_attention_fn(q, q, q, backend="auto_exact")
    assert t.records() == [] and not (tmp_path / "tune.json").exists()  # nothing half-decided was kept
    hooks.set_interrupt_check(None)
    with tuner.using(t):  # the next prompt tunes again
        out = dispatch_attention_fn(q, q, q, backend="auto_exact")
    torch.testing.assert_close(out, exact(q, q, q))
    assert [r.source for r in t.records()] == ["timed"] and t.report()["timed_signatures"] == 1


def test_an_interrupt_during_the_final_round_stops_it_too(tmp_path, clock):
    names = register("h_a", clock.kernel(1.0)), register("h_b", clock.kernel(1.02))  # front-runners both
    asked = {"n": 0}

    def check():  # 2 candidates x 2 checks each, then the first round
        asked["n"] += 1
        if asked["n"] == 5:
            raise HostInterrupt("cancelled in the final round")
    hooks.set_interrupt_check(check)
    with pytest.raises(HostInterrupt, match="final round"):
        make(tmp_path, *names, time_budget_s=1).tune(SIG)


def test_a_backend_that_raises_when_timed_is_left_out_with_its_reason(tmp_path):
    """Its first call passes (and is judged); later calls raise: it is rejected with the reason, the others are
    timed and one is picked, and the next signature is tuned as usual."""
    state = {"calls": 0}

    def flaky(q, k, v, **kw):
        state["calls"] += 1
        if state["calls"] > 1:
            raise RuntimeError("illegal memory access")
        return exact(q, k, v)
    names = register("h_flaky", flaky), register("h_good", exact), register("h_other", exact)
    t = make(tmp_path, *names, time_budget_s=1)
    record = t.tune(SIG)
    by = {c.name: c for c in record.candidates}
    assert by["h_flaky"].status == "rejected" and "illegal memory access" in by["h_flaky"].reason
    assert record.source == "timed" and record.chosen in ("h_good", "h_other")
    again = t.tune(dispatcher.AttentionInputs.of(1, 2, 48, 16, dtype=torch.float32, device="cpu"))
    assert again.source == "timed" and again.chosen != "h_flaky"


def test_a_backend_that_raises_in_the_final_round_is_left_out(tmp_path, clock):
    state = {"calls": 0}

    def late(q, k, v, **kw):  # first call, the timed warm call and 5 runs pass; the final round's raise
        state["calls"] += 1
        if state["calls"] > 7:
            raise RuntimeError("out of resources")
        return exact(q, k, v)
    names = register("h_late", clock.kernel(1.0, late)), register("h_good", clock.kernel(1.02))  # front-runners
    record = make(tmp_path, *names, time_budget_s=1, runs=5, warmup=1).tune(SIG)
    by = {c.name: c for c in record.candidates}
    assert by["h_late"].status == "rejected" and "out of resources" in by["h_late"].reason
    assert record.chosen == "h_good" and by["h_good"].median_ms is not None


def test_a_support_check_that_raises_drops_only_that_backend(tmp_path):
    class Broken:
        def reason(self, machine):
            raise KeyError("no such device property")
    names = register("h_checks", exact, requires=(Broken(),)), register("h_good", exact)
    record = make(tmp_path, *names, time_budget_s=1).tune(SIG)
    assert record.chosen == "h_good" and record.source in ("timed", "only-candidate")
    skipped = dict(record.skipped)
    assert "h_checks" in skipped and "no such device property" in skipped["h_checks"][0]

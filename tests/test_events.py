"""What the dispatcher tells a recorder (dispatcher/events.py): the library's Recorder implements the
`RecorderProtocol`, takes every event the guard sends, and `recording()` refuses an object that is no recorder."""

from __future__ import annotations

import typing

import pytest

from dispatcher import Recorder, events, recording


def test_the_librarys_recorder_is_a_recorder_protocol():
    assert isinstance(Recorder(), events.RecorderProtocol)


def test_the_recorder_takes_every_guard_event():
    rec = Recorder()
    samples = {events.GuardChecked: events.GuardChecked("self #1", "sage", error=0.02, every=8),
               events.GuardFailed: events.GuardFailed("self #1", "sage", "relative error 0.8", "native"),
               events.GuardSized: events.GuardSized("sage", "q (1, 16, 2, 8)", 12, 0.004, 0.0002, 5)}
    assert set(samples) == set(typing.get_args(events.GuardEvent))  # a new event comes with its line here
    for event in samples.values():
        rec.record_guard(event)
    snap = rec.snapshot()
    (entry,) = snap["guard"]
    assert entry["checks"] == 2 and entry["max_error"] == 0.02 and entry["every"] == 8
    assert entry["failures"] == [{"reason": "relative error 0.8", "replacement": "native"}]
    assert snap["guard_sizing"] == [{"backend": "sage", "calls": "q (1, 16, 2, 8)", "interval": 12, "call_ms": 4.0,
                                     "check_ms": 0.2, "timed_checks": 5}]
    with pytest.raises(TypeError, match="dispatcher/events.py"):
        rec.record_guard(("self #1", "sage"))


def test_recording_refuses_what_is_no_recorder():
    class CountsOnly:  # the methods a recorder had before the guard's events
        def record(self, site, requested, served, reasons=()):
            pass

        def record_error(self, site, backend, error):
            pass

    with pytest.raises(TypeError, match="CountsOnly lacks record_guard"):
        with recording(CountsOnly()):
            pass

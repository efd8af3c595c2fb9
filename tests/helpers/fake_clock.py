"""A fake clock for the tuner (`dispatcher.auto.measure.now`): it moves only when a kernel made by `kernel` runs,
by that kernel's fixed time, so what the tuner times, and how much of its budget it spends, come out exactly
however loaded the machine is. A kernel that sleeps instead times whatever the scheduler gives it: under load a
cold first kernel timed 400x its twin, and a 10 ms sleep timed over a 28 ms one.

Only the time moves; every kernel still computes its real output, which the tuner judges as usual."""

from __future__ import annotations

from .tensors import sdpa


class FakeClock:
    def __init__(self):
        self.microseconds = 0  # an integer: sums of kernel times stay exact

    def __call__(self) -> float:
        """Seconds, as time.perf_counter gives them."""
        return self.microseconds / 1e6

    def advance(self, ms: float) -> None:
        self.microseconds += round(ms * 1000)

    def kernel(self, ms, fn=sdpa):
        """A backend function that takes `ms` milliseconds on this clock (a callable `ms(call number)`: a time
        per call, from 1) and returns `fn(q, k, v)`, exact attention unless told."""
        calls = 0

        def timed(q, k, v, **kw):
            nonlocal calls
            calls += 1
            self.advance(ms(calls) if callable(ms) else ms)
            return fn(q, k, v)
        return timed


def use(monkeypatch, clock: FakeClock | None = None) -> FakeClock:
    """Make `clock` (a new one unless given) the tuner's clock for this test; the clock."""
    from dispatcher.auto import measure
    clock = clock if clock is not None else FakeClock()
    monkeypatch.setattr(measure, "now", clock)
    return clock


def slow_and_fast(monkeypatch, clock: FakeClock, names: tuple[str, str]):
    """A fixture's body: on `clock`, register CPU backends `names` taking 30 and 1 ms (exact attention each), with
    the pack's said-once warnings forgotten before and after; yields the names."""
    import dispatcher
    from dispatcher.log import forget_warnings
    use(monkeypatch, clock)
    for name, ms in zip(names, (30, 1)):
        dispatcher.register_backend(name, clock.kernel(ms), devices=("cpu",))
    forget_warnings()
    yield names
    forget_warnings()

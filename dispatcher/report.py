"""What actually ran: per call site, which backend served how many calls, which fell back and why."""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import threading
import weakref
from collections import Counter

from . import registry
from .events import GuardChecked, GuardEvent, GuardFailed, GuardSized, RecorderProtocol
from .log import counted

# Recorders by serial number: a compiled graph cannot hold a recorder object, so it names one by its
# `serial` (a plain int dynamo can bake in) and the call looks it up (see compiled.py).
_by_serial: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_serials = itertools.count(1)


def register(recorder: RecorderProtocol) -> int:
    """Give `recorder` (a Recorder, or any other `RecorderProtocol`) a serial number."""
    serial = next(_serials)
    _by_serial[serial] = recorder
    recorder.serial = serial
    return serial


def by_serial(serial: int):
    """The recorder registered under `serial` (0 or a collected one: None)."""
    return _by_serial.get(serial) if serial else None


class Recorder:
    """Thread-safe counters of served calls, fallbacks and the quality guard's events; one per model (or per run) in
    ComfyUI. The library's `RecorderProtocol` (events.py)."""

    def __init__(self, label: str = ""):
        self.label = label
        register(self)
        self._lock = threading.Lock()
        self._calls: Counter = Counter()  # (site, requested, served) -> calls
        self._reasons: dict[tuple[str, str, str], list[str]] = {}
        self._errors: dict[tuple[str, str], str] = {}
        self._guard: dict[tuple[str, str], dict] = {}  # (site, backend) -> checks, max_error, failures
        self._guard_sizing: dict[tuple[str, str], dict] = {}  # (backend, calls) -> the guard's interval sized here

    def __deepcopy__(self, memo):  # ComfyUI deep-copies model options; a recorder is shared, not copied
        return self

    def record(self, site: str, requested: str, served: str, reasons: tuple[str, ...] = ()) -> None:
        key = (site, requested, served)
        with self._lock:
            self._calls[key] += 1
            if reasons:  # every distinct reason, not just the first signature's (shapes can differ per call)
                known = self._reasons.setdefault(key, [])
                known.extend(r for r in reasons if r not in known)

    def record_error(self, site: str, backend: str, error: str) -> None:
        with self._lock:
            self._errors[(site, backend)] = error

    def record_guard(self, event: GuardEvent) -> None:
        """What the quality guard did (events.py): a passed check adds to its block's count, keeps the largest
        error and the rotation bound in force (the latest check's: an interval sized on this machine replaces its
        prior); a failed one is listed with its replacement; the latest sizing of each kernel and calls replaces
        the one before."""
        with self._lock:
            if type(event) is GuardChecked:
                entry = self._guard_entry(event.site, event.backend)
                entry["checks"] += 1
                if event.every is not None:
                    entry["every"] = event.every
                if event.error is not None and (entry["max_error"] is None or event.error > entry["max_error"]):
                    entry["max_error"] = event.error
            elif type(event) is GuardFailed:
                entry = self._guard_entry(event.site, event.backend)
                entry["checks"] += 1
                entry["failures"].append({"reason": event.reason, "replacement": event.replacement})
            elif type(event) is GuardSized:
                self._guard_sizing[(event.backend, event.calls)] = {
                    "backend": event.backend, "calls": event.calls, "interval": event.every,
                    "call_ms": round(event.call_s * 1e3, 4), "check_ms": round(event.check_s * 1e3, 4),
                    "timed_checks": event.timed}
            else:
                raise TypeError(f"Recorder.record_guard takes an event of dispatcher/events.py; got {event!r}")

    def _guard_entry(self, site, backend) -> dict:
        return self._guard.setdefault((site, backend), {"checks": 0, "max_error": None, "every": None,
                                                         "failures": []})

    def clear(self) -> None:
        with self._lock:
            self._calls.clear()
            self._reasons.clear()
            self._errors.clear()
            self._guard.clear()
            self._guard_sizing.clear()

    @property
    def total_calls(self) -> int:
        with self._lock:
            return sum(self._calls.values())

    def served_by(self, backend: str) -> int:
        with self._lock:
            return sum(n for (_, _, served), n in self._calls.items() if served == backend)

    def snapshot(self) -> dict:
        with self._lock:
            rows = [{"site": site, "requested": requested, "served": served, "calls": calls,
                     # a pseudo-backend (an auto) names no kernel: serving its choice is no fallback, unless
                     # reasons say otherwise
                     "fell_back": requested != served and (registry.resolver(requested) is None
                                                           or bool(self._reasons.get((site, requested, served)))),
                     "reasons": self._reasons.get((site, requested, served), [])}
                    for (site, requested, served), calls in sorted(self._calls.items())]
            errors = [{"site": site, "backend": backend, "error": error} for (site, backend), error in self._errors.items()]
            guard = [{"site": site, "backend": backend, "checks": e["checks"], "max_error": e["max_error"],
                      "every": e["every"], "failures": list(e["failures"])} for (site, backend), e in sorted(self._guard.items())]
            sizing = [dict(entry) for _, entry in sorted(self._guard_sizing.items())]
        return {"label": self.label, "calls": sum(r["calls"] for r in rows), "rows": rows, "errors": errors,
                "guard": guard, "guard_sizing": sizing}

    def summary(self) -> str:
        snap = self.snapshot()
        if not snap["rows"]:
            return f"{self.label or 'attention'}: no attention calls recorded"
        lines = [f"{self.label or 'attention'}: {counted(snap['calls'], 'attention call')}"]
        for row in snap["rows"]:
            line = f"  {row['site']}: {row['served']} served {counted(row['calls'], 'call')}"
            if row["fell_back"]:
                line += f" (asked for {row['requested']}: {fallback_text(row['requested'], row['reasons']) or 'fell back'})"
            lines.append(line)
        for err in snap["errors"]:
            lines.append(f"  {err['site']}: {err['backend']} failed: {err['error']}")
        for g in snap["guard"]:
            line = f"  {g['site']}: quality guard checked {g['backend']} {counted(g['checks'], 'time')}"
            if g["max_error"] is not None:
                line += f", max error {g['max_error']:.1e}"
            if g["every"]:
                line += f"; {rotation_text(g['every'])}"
            for failure in g["failures"]:
                line += (f"; FAILED: {failure['reason']}, " + (f"recomputed with {failure['replacement']} and demoted"
                                                              if failure["replacement"] else "no exact backend left"))
            lines.append(line)
        for sized in snap["guard_sizing"]:
            lines.append(f"  quality guard interval for {sized['backend']} on {sized['calls']}: one call in "
                         f"{sized['interval']} of each block, sized on this machine (call {sized['call_ms']:.3g} ms, "
                         f"check {sized['check_ms']:.3g} ms, {counted(sized['timed_checks'], 'timed check')})")
        return "\n".join(lines)


def fallback_text(requested: str, reasons) -> str:
    """The reasons of a fallback (`decisions.Decision.reasons_for`'s 'name: reason') as one text after "asked for <requested>":
    each backend's name once, before its first reason, and `requested`'s not at all when its reasons lead (the
    sentence has just named it): "needs an NVIDIA CUDA GPU; this machine has a CPU; sage_hub: ...", never "asked for
    sage: sage: ...; sage: ..."."""
    parts, last = [], None
    for reason in reasons:
        name, labelled, text = str(reason).partition(": ")
        if not labelled or not registry.is_known(name):
            part, last = str(reason), None
        elif name == last or (name == requested and not parts):
            part, last = text, name
        else:
            part, last = reason, name
        if part not in parts:
            parts.append(part)
    return "; ".join(parts)


def rotation_text(every: int) -> str:
    """The guard's rotation bound in words: how late a block that turns bad mid-run is caught."""
    return ("each block checked on every call" if every == 1 else
            f"each block checked again within {every} of its calls")


_recorder: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar("attn_dispatch_recorder", default=None)


# The active recording() block's recorder, or None: the ContextVar's own get, so the eager path's call of it enters
# no Python frame.
current_recorder = _recorder.get


@contextlib.contextmanager
def recording(recorder: RecorderProtocol):
    """The calls inside the block are counted in `recorder` (a Recorder, or any other `RecorderProtocol`)."""
    if not isinstance(recorder, RecorderProtocol):
        missing = [name for name in ("record", "record_error", "record_guard")
                   if not callable(getattr(recorder, name, None))]
        raise TypeError(f"recording() takes a recorder (dispatcher.Recorder, or an object with the methods of "
                        f"dispatcher.events.RecorderProtocol); {type(recorder).__name__} lacks {', '.join(missing)}")
    token = _recorder.set(recorder)
    try:
        yield recorder
    finally:
        _recorder.reset(token)

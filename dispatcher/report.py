"""What actually ran: per call site, which backend served how many calls, which fell back and why."""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import threading
import weakref
from collections import Counter

from . import registry
from .log import counted

# Recorders by serial number: a compiled graph cannot hold a recorder object, so it names one by its
# `serial` (a plain int dynamo can bake in) and the call looks it up (see compiled.py).
_by_serial: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_serials = itertools.count(1)


def register(recorder) -> int:
    """Give `recorder` (a Recorder, or any object with its record/record_error) a serial number."""
    serial = next(_serials)
    _by_serial[serial] = recorder
    recorder.serial = serial
    return serial


def by_serial(serial: int):
    """The recorder registered under `serial` (0 or a collected one: None)."""
    return _by_serial.get(serial) if serial else None


class Recorder:
    """Thread-safe counters of served calls and fallbacks; one per model (or per run) in ComfyUI."""

    def __init__(self, label: str = ""):
        self.label = label
        register(self)
        self._lock = threading.Lock()
        self._calls: Counter = Counter()  # (site, requested, served) -> calls
        self._reasons: dict[tuple[str, str, str], list[str]] = {}
        self._errors: dict[tuple[str, str], str] = {}
        self._guard: dict[tuple[str, str], dict] = {}  # (site, backend) -> checks, max_error, failures

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

    def record_guard(self, site: str, backend: str, checks: int = 1, error: float | None = None,
                     every: int | None = None) -> None:
        """A passed quality-guard check (error: relative error on the sampled rows; every: the block is checked
        again within this many of its calls, the rotation bound)."""
        with self._lock:
            entry = self._guard_entry(site, backend)
            entry["checks"] += checks
            if every is not None and (entry["every"] is None or every > entry["every"]):
                entry["every"] = every
            if error is not None and (entry["max_error"] is None or error > entry["max_error"]):
                entry["max_error"] = error

    def record_guard_failure(self, site: str, backend: str, reason: str, replacement: str) -> None:
        """A failed check: the call was recomputed with `replacement` ("" when none could), the kernel demoted."""
        with self._lock:
            entry = self._guard_entry(site, backend)
            entry["checks"] += 1
            entry["failures"].append({"reason": reason, "replacement": replacement})

    def _guard_entry(self, site, backend) -> dict:
        return self._guard.setdefault((site, backend), {"checks": 0, "max_error": None, "every": None,
                                                         "failures": []})

    def clear(self) -> None:
        with self._lock:
            self._calls.clear()
            self._reasons.clear()
            self._errors.clear()
            self._guard.clear()

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
        return {"label": self.label, "calls": sum(r["calls"] for r in rows), "rows": rows, "errors": errors,
                "guard": guard}

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
def recording(recorder: Recorder):
    token = _recorder.set(recorder)
    try:
        yield recorder
    finally:
        _recorder.reset(token)

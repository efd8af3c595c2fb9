"""What the dispatcher tells a recorder: the `RecorderProtocol` every recorder implements, and the guard's events.

`report.Recorder` implements it (counts, the report, the ComfyUI node's badge); a caller's own recorder implements
the same three methods. A served call is counted by `record` with plain arguments (it runs on every call, where
building an object would cost); what happens rarely comes as an event object, so a new kind of event is a new
dataclass here, never a new method every recorder must grow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Union, runtime_checkable


@dataclass(frozen=True, slots=True)
class GuardChecked:
    """A passed quality-guard check of `backend` at `site`."""
    site: str
    backend: str
    error: float | None = None  # relative error against exact attention on the sampled rows (None: not compared)
    every: int | None = None  # the block is checked again within this many of its calls (the rotation bound)


@dataclass(frozen=True, slots=True)
class GuardFailed:
    """A failed check: the call was recomputed with `replacement` ("" when none could), the kernel demoted there."""
    site: str
    backend: str
    reason: str
    replacement: str


@dataclass(frozen=True, slots=True)
class GuardSized:
    """The guard's interval for `backend` on the calls `calls` describes, sized on this machine: one call in `every`
    of each block, from `timed` checks that timed themselves (the call's and the check's seconds)."""
    backend: str
    calls: str
    every: int
    call_s: float
    check_s: float
    timed: int


GuardEvent = Union[GuardChecked, GuardFailed, GuardSized]


@runtime_checkable
class RecorderProtocol(Protocol):
    """What the dispatcher calls on a recorder (`recorder=` of a call, or the active `recording()` block's)."""

    def record(self, site: str, requested: str, served: str, reasons: tuple[str, ...] = ()) -> None:
        """One served call: `served` ran it where `requested` was asked for, with why (when it is another)."""

    def record_error(self, site: str, backend: str, error: str) -> None:
        """`backend` raised on a call at `site` (another served it, or the call failed)."""

    def record_guard(self, event: GuardEvent) -> None:
        """What the quality guard did: a check passed, failed, or its interval was sized on this machine."""

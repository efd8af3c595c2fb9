"""What a host application sees of tuning, and how it stops it, without the library importing the host.

ComfyUI's nodes register two hooks (nodes/host_hooks.py): a progress callback that shows each step as progress
text on the node that is running, and an interrupt check (ComfyUI's Cancel) that raises to stop tuning. The
check's exception leaves the attention call unchanged, so the host sees its own interrupt, not a tuning failure.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

from ..log import warn_once

_hooks_lock = threading.Lock()
_progress: Callable[["TuningProgress"], None] | None = None
_interrupt: Callable[[], None] | None = None


@dataclass(frozen=True)
class TuningProgress:
    """One step of tuning a call signature: `stage` is "start", "candidate" (about to try `candidate`, the
    `done`+1-th of `total`), "final round" (the front-runners side by side) or "done" (`chosen` picked)."""
    kind: str  # auto_exact | auto_fast
    signature: str  # short: "q 2x1024x8x40" (batch x length x heads x head dim), the k/v length if it differs
    model: str
    stage: str
    done: int
    total: int
    elapsed_s: float
    budget_s: float
    candidate: str | None = None
    chosen: str | None = None

    def text(self) -> str:
        """One line for a progress display."""
        head = f"{self.kind}: tuning attention for {self.signature}"
        if self.stage == "done":
            return f"{self.kind}: {self.chosen} for {self.signature} ({self.elapsed_s:.2f} s)"
        where = {"start": f"{self.total} candidates",
                 "candidate": f"trying {self.candidate} ({self.done + 1} of {self.total})",
                 "final round": "timing the front-runners side by side"}.get(self.stage, self.stage)
        return f"{head}: {where}, {self.elapsed_s:.1f} of {self.budget_s:g} s"


class TuningInterrupted(BaseException):
    """Carries the interrupt check's own exception past the tuner's handlers of failing kernels (a
    BaseException, so no `except Exception` takes it for a kernel error); the tuner re-raises the original."""

    def __init__(self, original: BaseException):
        super().__init__(original)
        self.original = original


def set_progress_hook(hook: Callable[[TuningProgress], None] | None):
    """Call `hook(TuningProgress)` at each tuning step (None: no hook); returns the previous hook."""
    global _progress
    with _hooks_lock:
        previous, _progress = _progress, hook
    return previous


def set_interrupt_check(check: Callable[[], None] | None):
    """Call `check()` between tuning steps; whatever it raises stops tuning and leaves the attention call
    unchanged (ComfyUI: `comfy.model_management.throw_exception_if_processing_interrupted`). Returns the
    previous check."""
    global _interrupt
    with _hooks_lock:
        previous, _interrupt = _interrupt, check
    return previous


def progress(event: TuningProgress) -> None:
    hook = _progress
    if hook is None:
        return
    try:
        hook(event)
    except Exception as exc:  # a display must never break the call; said once per hook
        warn_once(("progress-hook", id(hook)), "the tuning progress hook %r raised %s: %s (its further failures "
                  "are not logged)", hook, type(exc).__name__, exc)


def check_interrupt() -> None:
    check = _interrupt
    if check is None:
        return
    try:
        check()
    except BaseException as exc:
        raise TuningInterrupted(exc) from exc

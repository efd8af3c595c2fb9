"""What an Attention Checks node saw in one sampling run: calls checked, and the NaN/Inf it found.

Why a tally of its own: the node's report must say what was checked (a report that says nothing reads as
"nothing to say"), and in `warn` mode the dispatcher only logs. Shared between ModelPatcher clones
(`__deepcopy__` returns self), like the Recorder and the Comparison.
"""

from __future__ import annotations

import threading

KEPT = 3  # messages kept per run: the first ones say where it started


class CheckTally:
    def __init__(self, mode: str):
        self.mode = mode
        self._lock = threading.Lock()
        self.calls = self.found = 0
        self.messages: list[str] = []

    def __deepcopy__(self, memo):
        return self

    def clear(self) -> None:
        with self._lock:
            self.calls = self.found = 0
            self.messages = []

    def checked(self) -> None:
        with self._lock:
            self.calls += 1

    def non_finite(self, message: str) -> None:
        with self._lock:
            self.calls += 1
            self.found += 1
            if len(self.messages) < KEPT:
                self.messages.append(message)

    def snapshot(self) -> dict:
        with self._lock:
            return {"mode": self.mode, "calls": self.calls, "non_finite": self.found, "messages": list(self.messages)}

    def summary(self) -> str:
        s = self.snapshot()
        calls = f"{s['calls']} attention call{'' if s['calls'] == 1 else 's'}"
        if not s["non_finite"]:
            return f"Checked {calls} for NaN/Inf: all finite."
        first = s["messages"][0] if s["messages"] else ""
        if s["mode"] == "raise":
            return f"NaN/Inf found, the prompt failed (checks: raise) after {calls}: {first}"
        return f"NaN/Inf in {s['non_finite']} of {calls} (checks: warn, logged; the prompt went on): {first}"

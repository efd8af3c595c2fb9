"""Where the current model call sits in the sampling run, as a percent from 0 (first step) to 1 (last).

Why from `sample_sigmas`/`sigmas`: they are the only run position the attention override sees
(comfy/samplers.py puts both into transformer_options). The percent is the step index of the current
sigma in the schedule, interpolated between steps for samplers that evaluate in between (Heun, DPM2).
"""

from __future__ import annotations


def _floats(value) -> list[float]:
    if value is None:
        return []
    if hasattr(value, "detach"):
        return [float(x) for x in value.detach().flatten().cpu().tolist()]
    if isinstance(value, (list, tuple)):
        return [float(x) for x in value]
    return [float(value)]


def sampling_percent(transformer_options: dict | None) -> float | None:
    """0.0 at the first sigma of the schedule, 1.0 at the last; None when the options do not say."""
    to = transformer_options or {}
    schedule = _floats(to.get("sample_sigmas"))
    current = _floats(to.get("sigmas"))
    if len(schedule) < 2 or not current:
        return None
    sigma = current[0]
    steps = len(schedule) - 1
    for i in range(steps):
        hi, lo = schedule[i], schedule[i + 1]
        if abs(sigma - hi) <= 1e-4 * max(abs(hi), 1e-8):
            return i / steps
        if lo <= sigma <= hi and hi > lo:  # between two steps: interpolate
            return (i + (hi - sigma) / (hi - lo)) / steps
    return 1.0 if sigma <= schedule[-1] else 0.0


def in_window(transformer_options: dict | None, window: tuple[float, float] | None) -> bool:
    """True when no window is set, the position is unknown, or start <= percent <= end."""
    if window is None:
        return True
    start, end = window
    if start <= 0.0 and end >= 1.0:
        return True
    percent = sampling_percent(transformer_options)
    return percent is None or start <= percent <= end


def percent_text(x: float) -> str:
    """A window bound as text that reads back as the same number: 0.5, 1, 1e-300, 0.3333333333333333 (a
    fixed 2 decimals would show 1e-300 as 0.00, and a call at 0 'outside the step window 0.00..1.00')."""
    x = float(x)
    short = format(x, "g")
    return short if float(short) == x else repr(x)


def window_text(start: float, end: float) -> str:
    return f"{percent_text(start)}..{percent_text(end)}"

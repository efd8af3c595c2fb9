"""The quality guard's checks (guard.py's `Check`): what each finds wrong in a guarded kernel's output, which kernels
it watches under which guard mode, and whether it runs on every served call or on the guard's schedule (a block's
first call, then one in `every`: guard_schedule.py; `every` sized by guard_sizing.py).

A new check is one object here, listed in CHECKS, plus its test: `rules_for` gives a decision's candidate the checks
that watch it, in CHECKS's order; the decision's Watch runs them, recomputes and demotes on the first that finds the
output wrong, and tells the recorder. Nothing else names a check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from . import guard_check, guard_sizing
from .guard import GuardRules, bound_for
from .reference import non_finite, to_bhsd


@dataclass(frozen=True)
class Comparison:
    """The output's sampled query rows against exact attention computed from the same live tensors (guard_check.py),
    and NaN/Inf anywhere in the output, in one pass and one sync. Wrong past the kernel's guard bound (`bound_for`).
    Watches every kernel under mode 'all', those that are not exact under 'quantised'."""

    each_call: ClassVar[bool] = False

    def watches(self, spec, mode: str) -> bool:
        return mode == "all" or (mode == "quantised" and not spec.exact)

    def judges(self, call) -> bool:
        """Dropout or a BlockMask leave nothing exact to compare with."""
        mask = call.attn_mask
        return call.dropout_p == 0 and (mask is None or isinstance(mask, torch.Tensor))

    def verdict(self, call, out: torch.Tensor, spec, nth: int, clock) -> tuple[str | None, float | None]:
        """The check kernel leaves its three figures on the device (the error's two squared norms, the output's
        non-finite term); they are read in one go. The rows rotate with `nth` (guard_check.rotating_rows)."""
        offset, stride = guard_check.rotating_rows(call.query.shape[1 if call.layout == "BSHD" else 2],
                                                   guard_check.ROWS, call.call_site, nth)
        with torch.no_grad():
            terms = guard_check.check_terms(
                call.query, call.key, call.value, out, offset=offset, stride=stride, attn_mask=call.attn_mask,
                is_causal=call.is_causal, scale=call.scale, layout=call.layout)
            if clock is not None:
                clock.launched()
            distance2, size2, non_finite_term = terms.tolist()
        if non_finite_term != 0:  # NaN/Inf anywhere in the output (NaN != 0 too)
            return non_finite_problem(call, out), None
        error = math.sqrt(distance2) / max(math.sqrt(size2), 1e-30)
        bound = bound_for(spec)
        if not error <= bound:
            sampled = guard_check.sampled_count(to_bhsd(out, call.layout).shape[2], offset, stride)
            return f"relative error {error:.2e} against exact attention on {sampled} sampled query rows " \
                   f"exceeds its guard bound {bound:.0e}", error
        return None, error


@dataclass(frozen=True)
class Finite:
    """NaN/Inf anywhere in the output (one reduction, one sync), on every call: a custom (user-registered) kernel's
    NaN is caught whatever else is guarded, under every mode but 'off'."""

    each_call: ClassVar[bool] = True

    def watches(self, spec, mode: str) -> bool:
        return spec.custom

    def judges(self, call) -> bool:
        return True

    def verdict(self, call, out: torch.Tensor, spec, nth: int, clock) -> tuple[str | None, None]:
        with torch.no_grad():
            term = float(guard_check.non_finite_term(out))
        return (None if term == 0 else non_finite_problem(call, out)), None


CHECKS = (Comparison(), Finite())  # in the order the Watch runs them (the scheduled ones first, when due)


def non_finite_problem(call, out) -> str | None:
    """Why NaN/Inf in `out` is the kernel's fault, or None where the inputs already had them (checks mode reports
    inputs)."""
    if any(non_finite(t) for t in (call.query, call.key, call.value)):
        return None
    return f"its output has {non_finite(out)} NaN/Inf values from finite inputs"


def rules_for(spec, guard: tuple[str, int], inputs) -> GuardRules | None:
    """The guard's rules for this backend on these inputs under the guard setting (mode, every), or None:
    unguarded."""
    mode, every = guard
    if mode == "off":
        return None
    watching = [check for check in CHECKS if check.watches(spec, mode)]
    if not watching:
        return None
    scheduled = tuple(check for check in watching if not check.each_call)
    each_call = tuple(check for check in watching if check.each_call)
    if not scheduled:
        return GuardRules(scheduled, each_call, 0, False)
    if every:
        return GuardRules(scheduled, each_call, every, False)
    return GuardRules(scheduled, each_call, guard_sizing.prior(inputs), True)

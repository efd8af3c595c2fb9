"""The quality guard: watches the picture while sampling, every block of the model.

A guarded kernel's calls are compared, on a sample of query rows, with exact attention computed from the same
live tensors by the check (guard_check.py: one pass over K and V in their own dtype with float32 accumulation, a
Triton kernel on CUDA, the torch path elsewhere; its own error ~1e-6 against float64): the first call of every block
(its call site: "self #5"; nodes/adapter.py names the block), then one call in `every` of that block's calls
(guard_schedule.py: the blocks' checks staggered so each forward checks a few of them, and every block is checked
again within `every` of its own calls). A site that names no block (the library default "attention", which several
blocks share) gets a schedule no number of blocks aliases with: each of them is checked again within a bound of
about 3 to 5 times `every` of its calls (`guard_schedule.shared`); the site is demoted as a whole. Each check of a
block samples other rows (rotating: ceil(L / ROWS) checks cover every query row). A NaN/Inf anywhere in the output,
or a relative error past the kernel's guard bound, means the kernel went wrong on this block's activations: that
call is recomputed with the fastest exact backend the decision knows (the caller gets a right result), the kernel is
demoted for that block of this model for the rest of the process (other blocks keep it), one warning is logged, and
the call's recorder gets the event (the ComfyUI node shows it on its badge and report route).

The checks are objects (`Check`; guard_rules.py holds them in `CHECKS`): the comparison above, run on the schedule,
and a NaN/Inf check run on every call of a custom kernel. A decision's candidate carries the `GuardRules` that say
which of them watch it (`guard_rules.rules_for`; not `support.Rules`, a caller's rules of which kernels may serve);
its `Watch` (one per decision) counts, runs the scheduled checks when one falls due and then those of every call,
demotes, names the replacement and tells the recorder (events.py: the `RecorderProtocol`, and `GuardChecked`,
`GuardFailed`, `GuardSized`). A new check is one object in guard_rules.py plus its test. The eager path calls the Watch once per served call of a guarded kernel.

`every` = 0 (the default) sizes the interval on this machine (guard_sizing.py): the first checks of a kernel time
themselves and the call they check, and one call in `every` is checked so that checks cost at most `BUDGET` of the
attention time; until they have, a prior from the cost model (the H200's figures, capped so that it errs on checking
more often). A check waits for its verdict (one sync, three floats read): a failed check must recompute the call
before the caller gets it. Checking without the wait (the exact result computed beside the kernel's, chosen on the
device) was built and measured twice on the H200: the extra exact call cost more than the wait. Figures:
docs/auto.md and bench/results/README.md.

Modes: 'quantised' (the default: every kernel that is not exact, i.e. whose spec says `quantised`, e.g.
SageAttention, or `approximate`, e.g. block-sparse sol_attn; and a NaN/Inf check on every output of a custom
(user-registered) kernel), 'all' (every kernel compared, for a custom or untrusted one) and 'off'. Bounds: a kernel's
guard bound is `GUARD_MARGIN` times its admission bound (`admission_bound`: what `auto_fast` admits it within,
`FAST_BOUND` for quantised kernels, the spec's own `error_bound` for exact and approximate ones): a 16-row sample is
noisier than the 64 rows a verdict uses, and a kernel that spoils a picture is off by far more, 0.3-1.0, measured in
tests/test_guard.py.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from . import guard_schedule, guard_sizing
from .events import GuardChecked, GuardFailed, GuardSized
from .guard_check import ROWS  # noqa: F401  (query rows a check samples: the guard's public name)
from .guard_sizing import BUDGET  # noqa: F401  (the checks' share of the attention time: the guard's public name)
from .log import logger


GUARD_MODES = ("quantised", "all", "off")
DEFAULT_MODE = "quantised"
DEFAULT_EVERY = 0  # 0: sized on this machine by the calls' and the checks' own times (guard_sizing.py)
DEFAULT = (DEFAULT_MODE, DEFAULT_EVERY)  # the (mode, every) form calls and decisions carry
# `auto_fast` admits a quantised kernel whose relative error on the model's own activations (sampled query rows
# against float64 exact attention) is at most this; see docs/auto.md for the measurements behind it. Owned here, in
# the core, because the guard's bound is derived from it (`bound_for`); `auto` reads it from here.
FAST_BOUND = 5e-2
GUARD_MARGIN = 2  # the guard's bound over the admission bound (16 sampled rows against a verdict's 64)


class AttentionQualityError(RuntimeError):
    """A guarded kernel went wrong under policy 'strict' (no other backend may serve the call)."""


def settings(mode: str | None = None, every: int | None = None) -> tuple[str, int]:
    """(mode, every), checked: the form calls and decisions carry; None: the default mode / interval (0: sized
    on this machine by the calls' and the checks' times)."""
    mode = DEFAULT_MODE if mode is None else mode
    if mode not in GUARD_MODES:
        raise ValueError(f"unknown quality guard mode {mode!r}; valid modes: {', '.join(GUARD_MODES)} "
                         f"('{DEFAULT_MODE}' guards quantised kernels only)")
    every = DEFAULT_EVERY if every is None else every
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ValueError(f"the quality guard checks one call in N of each block: N must be an int >= 1, or 0 to "
                         f"size it on this machine by the calls' and the checks' times; got {every!r}")
    return mode, every


class Check(Protocol):
    """One check the guard makes of a guarded kernel's output. The checks are objects in guard_rules.py (`CHECKS`):
    which of them watch a kernel is its `GuardRules`, and the decision's Watch runs them."""

    each_call: bool  # run on every served call (no call of its kernel then takes the fast lane); else scheduled

    def watches(self, spec, mode: str) -> bool:
        """Whether it watches the kernel `spec` under guard mode `mode` ('quantised' or 'all')."""

    def judges(self, call) -> bool:
        """Whether it can judge this call's output at all (a comparison cannot with dropout or a BlockMask)."""

    def verdict(self, call, out: torch.Tensor, spec, nth: int, clock) -> tuple[str | None, float | None]:
        """(why `out` is wrong, or None; the relative error it measured, or None). nth: how many scheduled checks of
        this kernel the block had before (a sampling check takes other rows each time); clock: a guard_sizing.Clock
        timing this scheduled check, told `launched()` once its kernels are queued (before it waits for them)."""


class GuardRules(NamedTuple):
    """The quality guard's rules for one backend on one signature (a decision's `Candidate.guard`, made by
    guard_rules.rules_for): the checks that watch it, in guard_rules.CHECKS's order, and when they run. (Not
    `support.Rules`: those are a caller's rules of which kernels may serve a call; these watch the one that does.)"""
    scheduled: tuple  # Checks run on a block's first call, then on one call in `every` of the block
    each_call: tuple  # Checks run on every served call
    every: int  # the schedule's interval (0: nothing scheduled); when `sized`, the prior until this machine measured
    sized: bool  # `every` was 0: the decision's Watch sizes the interval from this machine's timings


def admission_bound(spec) -> float:
    """A kernel's admission bound: `FAST_BOUND` for quantised kernels, the spec's own for exact and approximate
    ones (an approximate kernel declares how far from exact attention it may be)."""
    return FAST_BOUND if spec.quantised and not spec.approximate else spec.error_bound


def bound_for(spec) -> float:
    """The guard's bound: derived from the admission bound, so the two cannot drift apart."""
    return GUARD_MARGIN * admission_bound(spec)


class Watch:
    """What the guard keeps for one decision (one signature of one model): when each block's next scheduled check
    of each guarded kernel falls, the blocks a kernel failed on, and each kernel's interval as sized on this machine.
    The eager path asks `unchecked` on its fast lane; any other served call of a guarded kernel it runs with `clock`
    started (None unless that call times itself) and hands to `after`, which runs the checks due (the candidate's
    `GuardRules`) and says what recomputes the call when one found it wrong."""

    __slots__ = ("left", "sites", "demoted", "checks", "sizing")

    def __init__(self):
        self.left: dict = {}  # (kernel, site) -> calls still served unchecked before its next scheduled check
        self.sites: dict = {}  # kernel -> named blocks seen (a new one's first re-check is staggered by this count)
        self.demoted: dict = {}  # (kernel, site) -> why: the kernel no longer serves that block
        # (kernel, site) -> scheduled checks made: which rows the next one samples, where a shared site's schedule is
        self.checks: dict = {}
        self.sizing: dict = {}  # kernel -> guard_sizing.Sizing (every = 0): its interval on this machine

    def unchecked(self, candidate, site) -> bool:
        """Whether this call may take the fast lane without a check (then it is counted)."""
        key = (candidate.name, site)
        left = self.left.get(key)
        if left and not candidate.guard.each_call:
            self.left[key] = left - 1
            return True
        return False  # a block's first call, a check falls due, a demoted block, or a check on every call

    def serves(self, candidate, site) -> bool:
        return (candidate.name, site) not in self.demoted

    def clock(self, candidate, call):
        """A guard_sizing.Clock started now, before `call` runs, when the check due on it times itself (its kernel's
        interval is still being sized on this machine); else None."""
        rules = candidate.guard
        if not rules.sized or self.left.get((candidate.name, call.call_site)):
            return None  # an interval given, or no check due on this call
        sizing = self.sizing.get(candidate.name)
        if (sizing is not None and not sizing.timing) or not any(check.judges(call) for check in rules.scheduled):
            return None
        return guard_sizing.Clock(call.query.device)

    def after(self, decision, candidate, call, out, recorder, policy, clock=None):
        """The guard after `candidate` served `call` (the long path): its scheduled checks when due, then those of
        every call. None when the output stands; on a failure the kernel is demoted for this block and the fastest
        exact backend of the decision is returned: the caller recomputes the call with it. clock: `clock`'s answer
        for this call, started before it ran."""
        if clock is not None:
            clock.called()
        rules = candidate.guard
        output = out[0] if call.return_lse else out
        why = self._scheduled(candidate, call, output, recorder, clock) if rules.every else None
        if why is None and rules.each_call:
            why = _run(rules.each_call, call, output, candidate.spec, 0, None)[0]
        if why is None:
            return None
        return self._failed(decision, candidate, call, why, recorder, policy)

    def _scheduled(self, candidate, call, output, recorder, clock) -> str | None:
        """Counts the call; on a block's first call and when a check falls due, runs the scheduled checks, times
        them while the interval is being sized, and sets when the block's next one falls. Why the output is wrong,
        or None."""
        kernel, site, rules = candidate.name, call.call_site, candidate.guard
        key = (kernel, site)
        left = self.left.get(key)
        if left:
            self.left[key] = left - 1
            return None
        sizing = None
        if rules.sized:
            sizing = self.sizing.get(kernel)
            if sizing is None:
                sizing = self.sizing[kernel] = guard_sizing.Sizing(rules.every)  # `every`: the prior
        made = self.checks.get(key, 0)
        why, error, judged = _run(rules.scheduled, call, output, candidate.spec, made, clock)
        if judged:  # dropout or a BlockMask leave nothing to compare with (counted all the same)
            self.checks[key] = made + 1
            if why is None and clock is not None:
                changed = sizing.add(*clock.seconds())
                if changed is not None:
                    _sized(kernel, sizing, call, recorder, changed)
                    if changed:
                        self._resized(kernel, sizing.every)
        gap, bound = self._next(kernel, site, rules.every if sizing is None else sizing.every, left is None, made)
        self.left[key] = gap - 1
        if why is None and recorder is not None:
            recorder.record_guard(GuardChecked(site, kernel, error, bound))
        return why

    def _resized(self, kernel: str, every: int) -> None:
        """A kernel's interval was sized anew: no block of it waits longer than the new interval for its next check
        (a block waiting L calls now waits L mod every: the blocks stay staggered)."""
        for key, left in self.left.items():
            if key[0] == kernel and left >= every and key not in self.demoted:
                self.left[key] = left % every

    def _next(self, kernel: str, site: str, every: int, first: bool, made: int) -> tuple[int, int]:
        """(calls until this block's next check, within how many of its calls each block is checked again)."""
        if site == guard_schedule.SHARED_SITE:  # blocks unknown to the guard take turns here: no fixed period
            schedule = guard_schedule.shared(every)
            return schedule.gaps[made % len(schedule.gaps)], schedule.bound
        if first:  # a named block's first re-check: staggered among the blocks
            seen = self.sites.get(kernel, 0)
            self.sites[kernel] = seen + 1
            return guard_schedule.phase(seen, every) or every, every
        return every, every

    def _failed(self, decision, candidate, call, why, recorder, policy):
        site = call.call_site
        replacement = decision.stand_in(lambda c: c.name != candidate.name and (not c.guard or self.serves(c, site)))
        if recorder is not None:
            recorder.record_guard(GuardFailed(site, candidate.name, why, replacement.name if replacement else ""))
        if policy == "strict" or replacement is None:
            raise AttentionQualityError(
                f"attention backend '{candidate.name}' failed the quality guard at {site}: {why}. "
                + ("Policy 'strict' lets no other backend serve the call: use policy 'fallback' to recompute such "
                   "calls exactly, or pick an exact backend." if policy == "strict" else
                   "No exact backend can serve it."))
        reason = (f"quality guard at {site}: {why}; from then on '{replacement.name}' serves this block's calls "
                  f"of these inputs for this model")
        key = (candidate.name, site)
        if key not in self.demoted:
            self.demoted[key] = reason
            self.left[key] = 0  # the fast lane never serves it there again
            logger.warning("attention backend '%s' failed (%s)", candidate.name, reason)
        return replacement


def _run(checks, call, out, spec, nth: int, clock) -> tuple[str | None, float | None, bool]:
    """The checks in order, up to the first that finds `out` wrong: (why, or None; the relative error measured;
    whether any of them could judge the call)."""
    error, judged = None, False
    for check in checks:
        if check.judges(call):
            judged = True
            why, measured = check.verdict(call, out, spec, nth, clock)
            if measured is not None:
                error = measured
            if why is not None:
                return why, error, True
    return None, error, judged


def _sized(kernel: str, sizing, call, recorder, changed: bool) -> None:
    """A kernel's interval was sized on this machine: told to the recorder, and logged when it changed."""
    what = f"q {tuple(call.query.shape)}, k {tuple(call.key.shape)} ({call.layout})"
    if changed:
        logger.info("quality guard: %s on %s is checked once in %d calls of each block, sized on this machine "
                    "(call %.3g ms, check %.3g ms, from %d timed checks)", kernel, what, sizing.every,
                    sizing.call_s * 1e3, sizing.check_s * 1e3, len(sizing.calls))
    if recorder is not None:
        recorder.record_guard(GuardSized(kernel, what, sizing.every, sizing.call_s, sizing.check_s,
                                         len(sizing.calls)))

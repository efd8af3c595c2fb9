"""The quality guard: watches the picture while sampling, every block of the model.

A guarded kernel's calls are compared, on a sample of query rows, with exact attention computed in float64 from
the same live tensors: the first call of every block (its call site: "self #5"; nodes/adapter.py names the block),
then one call in `every` of that block's calls, the blocks' checks staggered so each forward checks a few of them
and every block is checked again within `every` of its own calls (the rotation bound). A NaN/Inf anywhere in the
output, or a relative error past the kernel's guard bound, means the kernel went wrong on this block's activations:
that call is recomputed with the fastest exact backend the decision knows (the caller gets a right result), the
kernel is demoted for that block of this model for the rest of the process (other blocks keep it), one warning is
logged, and the call's recorder gets the event (the ComfyUI node shows it on its badge and report route).
`Watch` (one per decision) counts, checks, demotes and names the replacement; the eager path calls it once per
served call of a guarded kernel.

`every` = 0 (the default) sizes the interval by the call's cost (`interval`): a check costs about `CHECK_HOST_S`
of host ops and a device sync plus its float64 work, a call what its flops take; one call in `every` is checked
so that checks cost at most `BUDGET` of the attention time, and so of a step. Checking without the sync (the
exact result computed beside the kernel's, chosen on the device, the verdict read later) was built and measured
twice on the H200: the extra exact call cost more than the wait, so checks wait. Figures: docs/auto.md and
bench/results/README.md.

Modes: 'quantised' (the default: every kernel that is not exact, i.e. whose spec says `quantised`, e.g.
SageAttention, or `approximate`, e.g. block-sparse sol_attn; and a NaN/Inf check on every output of a custom
(user-registered) kernel), 'all' (every kernel compared, for a custom or untrusted one) and 'off'. Bounds:
`QUANTISED_BOUND` for quantised kernels (twice `auto_fast`'s admission bound: a 16-row sample is noisier than the
64 rows a verdict uses, and a kernel that spoils a picture is off by far more, 0.3-1.0, measured in
tests/test_guard.py), twice the spec's `error_bound` for exact and approximate ones (an approximate kernel's bound
is its own declaration).
"""

from __future__ import annotations

import math

import torch

from .log import logger
from .reference import error_terms, exact_attention, non_finite, strided_rows, to_bhsd


GUARD_MODES = ("quantised", "all", "off")
DEFAULT_MODE = "quantised"
DEFAULT_EVERY = 0  # 0: sized by each call's cost (`interval`)
DEFAULT = (DEFAULT_MODE, DEFAULT_EVERY)  # the (mode, every) form calls and decisions carry
ROWS = 16
QUANTISED_BOUND = 1e-1

# The cost model behind `every` = 0, from the H200 (bench/results/README.md): a check's host ops and sync cost
# 0.5-0.6 ms on SDXL's calls (fourth and fifth sessions, `added_ms_per_check`); its data work is the float64 casts
# of key and value, one read of the output (the NaN/Inf sum) and the float64 products on ROWS query rows. A call
# costs its flops at a fused kernel's rate plus its launch. `bench/guard_cost.py` measures what this gives.
BUDGET = 0.01  # of the attention time (so of a step, which also has other layers)
CHECK_HOST_S = 5e-4
CALL_HOST_S = 2e-5
KERNEL_FLOPS = 7e14  # FA3 on WAN 1.3B's self-attention on the H200: 6.6e12 flops in 9.4 ms (issue 29's figures)
# The float64 products' rate as the check gets it: 16-row products run far below the chip's float64 peak. Fitted
# to the WAN 1.3B step on the H200 (2026-12-05: a check of its self-attention added 4.45 ms, where 5e13 had
# predicted 0.94 and sized the interval at 10 calls, so the guard took 2.5% of the step); SDXL's calls (0.6-1.1
# ms a check, fourth session) agree.
F64_FLOPS = 8e11
MEMORY_BYTES_S = 3e12
MAX_EVERY = 100_000


class AttentionQualityError(RuntimeError):
    """A guarded kernel went wrong under policy 'strict' (no other backend may serve the call)."""


def settings(mode: str | None = None, every: int | None = None) -> tuple[str, int]:
    """(mode, every), checked: the form calls and decisions carry; None: the default mode / interval (0: sized
    by each call's cost)."""
    mode = DEFAULT_MODE if mode is None else mode
    if mode not in GUARD_MODES:
        raise ValueError(f"unknown quality guard mode {mode!r}; valid modes: {', '.join(GUARD_MODES)} "
                         f"('{DEFAULT_MODE}' guards quantised kernels only)")
    every = DEFAULT_EVERY if every is None else every
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ValueError(f"the quality guard checks one call in N of each block: N must be an int >= 1, or 0 to "
                         f"size it by each call's cost; got {every!r}")
    return mode, every


def interval(inputs) -> int:
    """One call in how many of a block is checked so that checks cost at most BUDGET of the calls' time."""
    b, h, hk, lq, lk = inputs.batch, inputs.heads_q, inputs.heads_kv, inputs.len_q, inputs.len_kv
    d, dv = inputs.head_dim, inputs.head_dim_v
    size = torch.empty((), dtype=inputs.dtype).element_size()
    call_s = CALL_HOST_S + 2.0 * b * h * lq * lk * (d + dv) / KERNEL_FLOPS
    check_s = (CHECK_HOST_S + 2.0 * b * h * min(ROWS, lq) * lk * (d + dv) / F64_FLOPS
               + (b * hk * lk * (d + dv) * (size + 8) + b * h * lq * dv * size) / MEMORY_BYTES_S)
    return max(1, min(MAX_EVERY, math.ceil(check_s / (BUDGET * call_s))))


def rules_for(spec, guard: tuple[str, int], inputs) -> tuple[int, bool] | None:
    """(compare one call in N of each block (0: never), check every output for NaN/Inf) for this backend on these
    inputs, or None: unguarded."""
    mode, every = guard
    compare = mode == "all" or (mode == "quantised" and not spec.exact)
    finite = mode != "off" and spec.custom  # a custom kernel's NaN is caught whatever else is guarded
    if not compare and not finite:
        return None
    return (every or interval(inputs)) if compare else 0, finite


def bound_for(spec) -> float:
    return QUANTISED_BOUND if spec.quantised and not spec.approximate else 2 * spec.error_bound


def checkable(call) -> bool:
    """Whether a call's output can be compared with exact attention (no dropout, no BlockMask)."""
    mask = call.attn_mask
    return call.dropout_p == 0 and (mask is None or isinstance(mask, torch.Tensor))


def problem(call, out: torch.Tensor, spec) -> tuple[str | None, float | None]:
    """(why the output is wrong, or None; the relative error on the sampled rows). One device sync.

    The rows are a strided view (no gather), the error's two norms and the output's float64 sum (NaN/Inf
    anywhere makes it non-finite: one reduction instead of isfinite + all) are read in one go."""
    got = to_bhsd(out, call.layout)
    rows = strided_rows(got.shape[2], ROWS)
    with torch.no_grad():
        ref, _ = exact_attention(call.query, call.key, call.value, call.attn_mask, call.is_causal, call.scale,
                                 call.layout, rows, with_lse=False)
        picked = got if rows is None else got[:, :, rows]
        distance, size, total = torch.stack((*error_terms(picked, ref), out.sum(dtype=torch.float64))).tolist()
    if not math.isfinite(total):
        return _non_finite_problem(call, out), None
    error = distance / max(size, 1e-30)
    bound = bound_for(spec)
    if not error <= bound:
        return f"relative error {error:.2e} against exact attention on {picked.shape[2]} sampled query rows " \
               f"exceeds its guard bound {bound:.0e}", error
    return None, error


def finite_problem(call, out: torch.Tensor) -> str | None:
    """The NaN/Inf check alone (one float64 sum, one sync): why the output is wrong, or None."""
    with torch.no_grad():
        total = float(out.sum(dtype=torch.float64))
    return None if math.isfinite(total) else _non_finite_problem(call, out)


def _non_finite_problem(call, out) -> str | None:
    if any(non_finite(t) for t in (call.query, call.key, call.value)):
        return None  # the inputs already were: not this kernel's fault (checks mode reports inputs)
    return f"its output has {non_finite(out)} NaN/Inf values from finite inputs"


def _phase(n: int, every: int) -> int:
    """Where in [0, every) the n-th block's checks fall: the golden-ratio sequence, so the blocks seen so far (their
    number is not known in advance) are spread evenly over the interval and each forward checks about
    blocks / every of them, never a burst of consecutive ones."""
    return int((n * 0.6180339887498949) % 1.0 * every)


class Watch:
    """What the guard keeps for one decision (one signature of one model): when each block's next check of each
    guarded kernel falls, and the blocks a kernel failed on. The eager path asks `unchecked` on its fast lane and
    hands every other served call of a guarded kernel to `after`, which says what recomputes it when it failed."""

    __slots__ = ("left", "sites", "demoted")

    def __init__(self):
        self.left: dict = {}  # (kernel, site) -> calls still served unchecked before its next check
        self.sites: dict = {}  # kernel -> blocks seen (a new one's first re-check is staggered by this count)
        self.demoted: dict = {}  # (kernel, site) -> why: the kernel no longer serves that block

    def unchecked(self, candidate, site) -> bool:
        """Whether this call may take the fast lane without a check (then it is counted)."""
        key = (candidate.name, site)
        left = self.left.get(key)
        if left and not candidate.guard[1]:
            self.left[key] = left - 1
            return True
        return False  # a block's first call, a check falls due, a demoted block, or a NaN check on every call

    def serves(self, candidate, site) -> bool:
        return (candidate.name, site) not in self.demoted

    def after(self, decision, candidate, call, out, recorder, policy):
        """The guard after `candidate` served `call` (the long path): check when due. None when the output stands;
        on a failure the kernel is demoted for this block and the fastest exact backend of the decision is returned:
        the caller recomputes the call with it."""
        every, finite = candidate.guard
        site = call.call_site
        why = error = None
        if every:
            key = (candidate.name, site)
            left = self.left.get(key)
            if left:
                self.left[key] = left - 1
            else:
                if left is None:  # the block's first call: its next check is staggered among the blocks
                    seen = self.sites.get(candidate.name, 0)
                    self.sites[candidate.name] = seen + 1
                    self.left[key] = (_phase(seen, every) or every) - 1
                else:
                    self.left[key] = every - 1
                if checkable(call):  # dropout or a BlockMask: nothing to compare with (counted all the same)
                    why, error = problem(call, out[0] if call.return_lse else out, candidate.spec)
                    if why is None and recorder is not None and hasattr(recorder, "record_guard"):
                        recorder.record_guard(site, candidate.name, error=error, every=every)
        if why is None and finite:
            why = finite_problem(call, out[0] if call.return_lse else out)
        if why is None:
            return None
        return self._failed(decision, candidate, call, why, recorder, policy)

    def _failed(self, decision, candidate, call, why, recorder, policy):
        site = call.call_site
        replacement = next((c for c in decision.candidates if c.name != candidate.name and c.spec.exact
                            and (not c.guard or self.serves(c, site))), None)
        if recorder is not None and hasattr(recorder, "record_guard_failure"):
            recorder.record_guard_failure(site, candidate.name, why, replacement.name if replacement else "")
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

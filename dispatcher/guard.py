"""The quality guard: watches the picture while sampling, every block of the model.

A guarded kernel's calls are compared, on a sample of query rows, with exact attention computed from the same
live tensors by the check (guard_check.py: one pass over K and V in their own dtype with float32 accumulation, a
Triton kernel on CUDA, the torch path elsewhere; its own error ~1e-6 against float64): the first call of every block
(its call site: "self #5"; nodes/adapter.py names the block), then one call in `every` of that block's calls, the
blocks' checks staggered so each forward checks a few of them and every block is checked again within `every` of
its own calls (the rotation bound). Each check of a block samples other rows (rotating: ceil(L / ROWS) checks cover
every query row). A NaN/Inf anywhere in the output, or a relative error past the kernel's guard bound, means the
kernel went wrong on this block's activations: that call is recomputed with the fastest exact backend the decision
knows (the caller gets a right result), the kernel is demoted for that block of this model for the rest of the
process (other blocks keep it), one warning is logged, and the call's recorder gets the event (the ComfyUI node
shows it on its badge and report route). `Watch` (one per decision) counts, checks, demotes and names the
replacement; the eager path calls it once per served call of a guarded kernel. A site several blocks share (a
library caller that passes no call_site) is one block to the guard: checked every call it is covered whole.

`every` = 0 (the default) sizes the interval by the call's cost (`interval`, the cost model below): one call in
`every` is checked so that checks cost at most `BUDGET` of the attention time, and so of a step. A check waits for
its verdict (one sync, three floats read): a failed check must recompute the call before the caller gets it.
Checking without the wait (the exact result computed beside the kernel's, chosen on the device) was built and
measured twice on the H200: the extra exact call cost more than the wait. Figures: docs/auto.md and
bench/results/README.md.

Modes: 'quantised' (the default: every kernel that is not exact, i.e. whose spec says `quantised`, e.g.
SageAttention, or `approximate`, e.g. block-sparse sol_attn; and a NaN/Inf check on every output of a custom
(user-registered) kernel), 'all' (every kernel compared, for a custom or untrusted one) and 'off'. Bounds: a kernel's
guard bound is `GUARD_MARGIN` times its admission bound (`admission_bound`: what `auto_fast` admits it within,
`FAST_BOUND` for quantised kernels, the spec's own `error_bound` for exact and approximate ones): a 16-row sample is
noisier than the 64 rows a verdict uses, and a kernel that spoils a picture is off by far more, 0.3-1.0, measured in
tests/test_guard.py.
"""

from __future__ import annotations

import math

import torch

from . import guard_check
from .log import logger
from .reference import non_finite, to_bhsd


GUARD_MODES = ("quantised", "all", "off")
DEFAULT_MODE = "quantised"
DEFAULT_EVERY = 0  # 0: sized by each call's cost (`interval`)
DEFAULT = (DEFAULT_MODE, DEFAULT_EVERY)  # the (mode, every) form calls and decisions carry
ROWS = 16
# `auto_fast` admits a quantised kernel whose relative error on the model's own activations (sampled query rows
# against float64 exact attention) is at most this; see docs/auto.md for the measurements behind it. Owned here, in
# the core, because the guard's bound is derived from it (`bound_for`); `auto` reads it from here.
FAST_BOUND = 5e-2
GUARD_MARGIN = 2  # the guard's bound over the admission bound (16 sampled rows against a verdict's 64)

# The cost model behind `every` = 0. PROVISIONAL constants, derived from the H200 figures below; to be re-fitted on
# the next lease (`bench/guard_cost.py --scenario check-time` and the WAN 1.3B step, bench/results/README.md).
# A check is the check kernel (guard_check.py: K, V and the output read once, exact attention on ROWS rows) and
# one wait for its verdict; a call costs its flops at the watched kernel's rate plus its launch.
BUDGET = 0.01  # of the attention time (so of a step, which also has other layers)
CALL_HOST_S = 2e-5
# Sage per warp on Wan 14B's shape: 796 TFLOP/s-equivalent (27.62 ms), FA3 610-690 (/work/shared/docs/gpu.md): the
# fastest kernel the guard watches, so the call it checks is no shorter than this says.
KERNEL_FLOPS = 8e14
# What a check adds to the GPU's timeline beyond its kernels: the GPU idles from the end of its queue until the host
# has woken, read the verdict (3 floats) and launched the next op; plus the check's 3 launches. A bare sync cost
# 0.31 ms per check on SDXL's attention calls alone (fourth session), a host-bound loop where the wait also holds
# the host's queued launches back; on calls the GPU is busy with for milliseconds (video, Flux) the host is ahead
# and only its wake-up, the check's Python (~30 us, the pack's per-call cost on that host) and one launch remain.
CHECK_HOST_S = 1e-4
# The torch path (no Triton: Windows without triton-windows, CPU) issues ~8 small ops per chunk of keys plus ~10,
# each ~20 us of host time on the H200's host (fourth session: 177-194 us for a dozen ops).
OP_HOST_S = 2e-5
# The check kernel streams K, V and the output: 73% of the H200's 4.8 TB/s, a streaming read's usual share.
MEMORY_BYTES_S = 3.5e12
# P·V in true float32 (the `ieee` dot: FMA units, not tensor cores) on 16-row tiles: about a third of the H200's
# 67 TFLOP/s float32 peak. q·k runs on the tensor cores at KERNEL_FLOPS (bf16/fp16 products are exact in float32).
CHECK_FLOPS = 2.5e13
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


def interval(inputs, kernel: bool | None = None) -> int:
    """One call in how many of a block is checked so that checks cost at most BUDGET of the calls' time.
    kernel: whether the Triton check kernel serves these inputs (None: as on this machine)."""
    return max(1, min(MAX_EVERY, math.ceil(check_seconds(inputs, kernel) / (BUDGET * call_seconds(inputs)))))


def call_seconds(inputs) -> float:
    b, h, lq, lk = inputs.batch, inputs.heads_q, inputs.len_q, inputs.len_kv
    return CALL_HOST_S + 2.0 * b * h * lq * lk * (inputs.head_dim + inputs.head_dim_v) / KERNEL_FLOPS


def check_seconds(inputs, kernel: bool | None = None) -> float:
    """What one check of a call of these inputs costs (the cost model above)."""
    b, h, hk, lq, lk = inputs.batch, inputs.heads_q, inputs.heads_kv, inputs.len_q, inputs.len_kv
    d, dv = inputs.head_dim, inputs.head_dim_v
    size = torch.empty((), dtype=inputs.dtype).element_size()
    rows = min(ROWS, lq)
    read = (b * hk * lk * (d + dv) + b * h * lq * dv) * size  # K and V once, the output once (NaN/Inf)
    qk, pv = 2.0 * b * h * rows * lk * d, 2.0 * b * h * rows * lk * dv
    if kernel is None:
        kernel = (guard_check.triton is not None and inputs.device.type == "cuda" and inputs.mask_kind == "none"
                  and inputs.dtype in (torch.bfloat16, torch.float16))
    if kernel:
        return CHECK_HOST_S + read / MEMORY_BYTES_S + qk / KERNEL_FLOPS + pv / CHECK_FLOPS
    # the torch path: each chunk of keys cast to float32 (written and read again), its ops' host time
    chunk_bytes = b * hk * (d + dv) * 4 + b * h * rows * 12
    chunks = math.ceil(lk * chunk_bytes / guard_check.CHUNK_BYTES)
    return (CHECK_HOST_S + (10 + 8 * chunks) * OP_HOST_S + (read + 2 * lk * chunk_bytes) / MEMORY_BYTES_S
            + (qk + pv) / CHECK_FLOPS)


def rules_for(spec, guard: tuple[str, int], inputs) -> tuple[int, bool] | None:
    """(compare one call in N of each block (0: never), check every output for NaN/Inf) for this backend on these
    inputs, or None: unguarded."""
    mode, every = guard
    compare = mode == "all" or (mode == "quantised" and not spec.exact)
    finite = mode != "off" and spec.custom  # a custom kernel's NaN is caught whatever else is guarded
    if not compare and not finite:
        return None
    return (every or interval(inputs)) if compare else 0, finite


def admission_bound(spec) -> float:
    """A kernel's admission bound: `FAST_BOUND` for quantised kernels, the spec's own for exact and approximate
    ones (an approximate kernel declares how far from exact attention it may be)."""
    return FAST_BOUND if spec.quantised and not spec.approximate else spec.error_bound


def bound_for(spec) -> float:
    """The guard's bound: derived from the admission bound, so the two cannot drift apart."""
    return GUARD_MARGIN * admission_bound(spec)


def checkable(call) -> bool:
    """Whether a call's output can be compared with exact attention (no dropout, no BlockMask)."""
    mask = call.attn_mask
    return call.dropout_p == 0 and (mask is None or isinstance(mask, torch.Tensor))


def problem(call, out: torch.Tensor, spec, rows: tuple[int, int]) -> tuple[str | None, float | None]:
    """(why the output is wrong, or None; the relative error on the sampled rows). One device sync.

    rows: (offset, stride) of the sampled query rows (guard_check.rotating_rows). The check kernel leaves its three
    figures on the device (the error's two squared norms, the output's non-finite term); they are read in one go."""
    offset, stride = rows
    with torch.no_grad():
        distance2, size2, non_finite = guard_check.check_terms(
            call.query, call.key, call.value, out, offset=offset, stride=stride, attn_mask=call.attn_mask,
            is_causal=call.is_causal, scale=call.scale, layout=call.layout).tolist()
    if non_finite != 0:  # NaN/Inf anywhere in the output (NaN != 0 too)
        return _non_finite_problem(call, out), None
    error = math.sqrt(distance2) / max(math.sqrt(size2), 1e-30)
    bound = bound_for(spec)
    if not error <= bound:
        sampled = guard_check.sampled_count(to_bhsd(out, call.layout).shape[2], offset, stride)
        return f"relative error {error:.2e} against exact attention on {sampled} sampled query rows " \
               f"exceeds its guard bound {bound:.0e}", error
    return None, error


def finite_problem(call, out: torch.Tensor) -> str | None:
    """The NaN/Inf check alone (one reduction, one sync): why the output is wrong, or None."""
    with torch.no_grad():
        term = float(guard_check.non_finite_term(out))
    return None if term == 0 else _non_finite_problem(call, out)


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

    __slots__ = ("left", "sites", "demoted", "checks")

    def __init__(self):
        self.left: dict = {}  # (kernel, site) -> calls still served unchecked before its next check
        self.sites: dict = {}  # kernel -> blocks seen (a new one's first re-check is staggered by this count)
        self.demoted: dict = {}  # (kernel, site) -> why: the kernel no longer serves that block
        self.checks: dict = {}  # (kernel, site) -> comparisons made: which rows the next one samples

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
                    made = self.checks.get(key, 0)
                    self.checks[key] = made + 1
                    rows = guard_check.rotating_rows(call.query.shape[1 if call.layout == "BSHD" else 2], ROWS,
                                                     site, made)
                    why, error = problem(call, out[0] if call.return_lse else out, candidate.spec, rows)
                    if why is None and recorder is not None and hasattr(recorder, "record_guard"):
                        recorder.record_guard(site, candidate.name, error=error, every=every)
        if why is None and finite:
            why = finite_problem(call, out[0] if call.return_lse else out)
        if why is None:
            return None
        return self._failed(decision, candidate, call, why, recorder, policy)

    def _failed(self, decision, candidate, call, why, recorder, policy):
        site = call.call_site
        replacement = decision.stand_in(lambda c: c.name != candidate.name and (not c.guard or self.serves(c, site)))
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

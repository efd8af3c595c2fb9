"""The quality guard: watches the picture while sampling.

Every `every`-th call of a guarded kernel per call site (and always the first) is compared, on a sample of
query rows, with exact attention computed in float64 from the same live tensors. A NaN/Inf anywhere in the
output, or a relative error past the kernel's guard bound, means the kernel went wrong on this model's
activations: that call is recomputed with the next exact backend of its decision (the caller gets a right
result), the kernel is demoted for this signature and model for the rest of the process, one warning is
logged, and the call's recorder gets the event (the ComfyUI node shows it on its badge and report route).
The eager path (eager.py `_guarded`) counts, demotes and recomputes; this module holds the rules and the
comparison.

A check is about a dozen host ops (the float64 reference on the sampled rows: three casts, two matmuls, one
softmax) and one device sync; on SDXL-sized calls these host ops are its cost, so it has no more of them than
it needs. Checking without the sync (the exact result computed beside the kernel's, chosen on the device, the
verdict read later) was built and measured twice on the H200: the extra exact call cost more than the wait, so
checks wait. Figures: docs/auto.md and bench/results/README.md.

Modes: 'quantised' (the default: every kernel that is not exact, i.e. whose spec says `quantised`, e.g.
SageAttention, or `approximate`, e.g. block-sparse sol_attn), 'all' (every kernel, for a custom or untrusted one)
and 'off'. Bounds: `QUANTISED_BOUND` for quantised kernels (twice
`auto_fast`'s admission bound: a 16-row sample is noisier than the 64 rows a verdict uses, and a kernel that
spoils a picture is off by far more, 0.3-1.0, measured in tests/test_guard.py), twice the spec's
`error_bound` for exact and approximate ones (an approximate kernel's bound is its own declaration). bench/results/README.md has the overhead measured per sampling step.
"""

from __future__ import annotations

import math

import torch

from .reference import error_terms, exact_attention, non_finite, strided_rows, to_bhsd

GUARD_MODES = ("quantised", "all", "off")
DEFAULT_MODE = "quantised"
DEFAULT_EVERY = 200  # SDXL (140 calls a step, the worst case): 0.7 checks a step, ~1% of it (docs/auto.md)
DEFAULT = (DEFAULT_MODE, DEFAULT_EVERY)  # the (mode, every) form calls and decisions carry
ROWS = 16
QUANTISED_BOUND = 1e-1


class AttentionQualityError(RuntimeError):
    """A guarded kernel went wrong under policy 'strict' (no other backend may serve the call)."""


def settings(mode: str | None = None, every: int | None = None) -> tuple[str, int]:
    """(mode, every), checked: the form calls and decisions carry; None: the default mode / interval."""
    mode = DEFAULT_MODE if mode is None else mode
    if mode not in GUARD_MODES:
        raise ValueError(f"unknown quality guard mode {mode!r}; valid modes: {', '.join(GUARD_MODES)} "
                         f"('{DEFAULT_MODE}' guards quantised kernels only)")
    every = DEFAULT_EVERY if every is None else every
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"the quality guard checks every Nth call: N must be an int >= 1; got {every!r}")
    return mode, every


def every_for(spec, guard: tuple[str, int]) -> int:
    """How often the guard checks this backend's calls (0: never)."""
    mode, every = guard
    if mode == "all" or (mode == "quantised" and not spec.exact):
        return every
    return 0


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
        if any(non_finite(t) for t in (call.query, call.key, call.value)):
            return None, None  # the inputs already were: not this kernel's fault (checks mode reports inputs)
        return f"its output has {non_finite(out)} NaN/Inf values from finite inputs", None
    error = distance / max(size, 1e-30)
    bound = bound_for(spec)
    if not error <= bound:
        return f"relative error {error:.2e} against exact attention on {picked.shape[2]} sampled query rows " \
               f"exceeds its guard bound {bound:.0e}", error
    return None, error

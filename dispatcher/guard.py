"""The quality guard: watches the picture while sampling.

Every `every`-th call of a guarded kernel per call site (and always the first) is compared, on a sample of
query rows, with exact attention computed in float64 from the same live tensors. A NaN/Inf anywhere in the
output, or a relative error past the kernel's guard bound, means the kernel went wrong on this model's
activations: that call is recomputed with the next exact backend of its decision (the caller gets a right
result), the kernel is demoted for this signature and model for the rest of the process, one warning is
logged, and the call's recorder gets the event (the ComfyUI node shows it on its badge and report route).
The eager path (eager.py `_guarded`) counts, demotes and recomputes; this module holds the rules and the
comparison.

A check is a handful of host ops (the float64 reference is one call of SDPA's math kernel on the sampled rows in
the common case) and one device sync. Checking without the sync (the verdict read later, the exact result
computed beside the kernel's and chosen on the device) was built and measured: on SDXL's attention calls it cost
more per check than waiting (+24% against +19% of the calls' own time on the H200, bench/guard_cost.py): the
extra exact call and host ops outweigh the wait, so checks wait.

Modes: 'quantised' (the default: kernels whose spec says `quantised`, e.g. SageAttention), 'all' (every
kernel, for a custom or untrusted one) and 'off'. Bounds: `QUANTISED_BOUND` for quantised kernels (twice
`auto_fast`'s admission bound: a 16-row sample is noisier than the 64 rows a verdict uses, and a kernel that
spoils a picture is off by far more, 0.3-1.0, measured in tests/test_guard.py), twice the spec's
`error_bound` for exact ones. bench/results/README.md has the overhead measured per sampling step.
"""

from __future__ import annotations

import torch

from .reference import exact_attention, non_finite, relative_error_tensor, sample_rows, to_bhsd

GUARD_MODES = ("quantised", "all", "off")
DEFAULT_MODE = "quantised"
DEFAULT_EVERY = 100  # SDXL's worst case (Sage on every call): 20 cost +9% of a step; see docs/auto.md
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
    if mode == "all" or (mode == "quantised" and spec.quantised):
        return every
    return 0


def bound_for(spec) -> float:
    return QUANTISED_BOUND if spec.quantised else 2 * spec.error_bound


def checkable(call) -> bool:
    """Whether a call's output can be compared with exact attention (no dropout, no BlockMask)."""
    mask = call.attn_mask
    return call.dropout_p == 0 and (mask is None or isinstance(mask, torch.Tensor))


_rows: dict = {}  # (len_q, device) -> the sampled query rows, made once (no host-to-device copy per check)


def _sampled(len_q: int, device) -> torch.Tensor | None:
    key = (len_q, device)
    if key not in _rows:
        rows = sample_rows(len_q, ROWS)
        _rows[key] = None if rows is None else rows.to(device)
    return _rows[key]


def problem(call, out: torch.Tensor, spec) -> tuple[str | None, float | None]:
    """(why the output is wrong, or None; the relative error on the sampled rows). One device sync."""
    got = to_bhsd(out, call.layout)
    rows = _sampled(got.shape[2], got.device)
    with torch.no_grad():
        ref, _ = exact_attention(call.query, call.key, call.value, call.attn_mask, call.is_causal, call.scale,
                                 call.layout, rows, with_lse=False)
        picked = got if rows is None else got.index_select(2, rows)
        error, finite = torch.stack((relative_error_tensor(picked, ref), torch.isfinite(out).all().double())).tolist()
    if not finite:
        if any(non_finite(t) for t in (call.query, call.key, call.value)):
            return None, None  # the inputs already were: not this kernel's fault (checks mode reports inputs)
        return f"its output has {non_finite(out)} NaN/Inf values from finite inputs", None
    bound = bound_for(spec)
    if not error <= bound:
        return f"relative error {error:.2e} against exact attention on {picked.shape[2]} sampled query rows " \
               f"exceeds its guard bound {bound:.0e}", error
    return None, error

"""The quality guard: watches the picture while sampling.

Every `every`-th call of a guarded kernel per call site (and always the first) is compared, on a sample of
query rows, with exact attention computed in float64 from the same live tensors. A NaN/Inf anywhere in the
output, or a relative error past the kernel's guard bound, means the kernel went wrong on this model's
activations: that call is recomputed with the next exact backend of its decision (the caller gets a right
result), the kernel is demoted for this signature and model for the rest of the process, one warning is
logged, and the call's recorder gets the event (the ComfyUI node shows it on its badge and report route).
The eager path (eager.py `_guarded`) counts, demotes and recomputes; this module holds the rules, the
comparison and the checks still in flight.

A check never makes the host wait for the GPU unless the call is large: waiting for a verdict drains the GPU's
queue, and on a model of many small calls (SDXL) the GPU then idles while the host catches up (measured: +4% of
an SDXL step at one check per 100 calls). So a call under `WAIT_ABOVE_FLOPS` is checked on the device: the
verdict is a device tensor, the next exact backend's result is computed too and chosen on the device where the
verdict is bad (the call is right either way), and the figures reach the host without blocking it; they are read
on a later guarded call, or by `settle()` (a report's snapshot settles first), and a failure demotes the kernel
then. Larger calls, and every call under policy 'strict' (it must raise on the call itself), wait for the
verdict: there one more exact call would cost more than the wait.

Modes: 'quantised' (the default: kernels whose spec says `quantised`, e.g. SageAttention), 'all' (every
kernel, for a custom or untrusted one) and 'off'. Bounds: `QUANTISED_BOUND` for quantised kernels (twice
`auto_fast`'s admission bound: a 16-row sample is noisier than the 64 rows a verdict uses, and a kernel that
spoils a picture is off by far more, 0.3-1.0, measured in tests/test_guard.py), twice the spec's
`error_bound` for exact ones. Cost: one check is a few small kernels and one device sync (see
bench/results/README.md for the overhead measured per sampling step).
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, NamedTuple

import torch

from . import report
from .reference import exact_attention, non_finite, sample_rows, to_bhsd

GUARD_MODES = ("quantised", "all", "off")
DEFAULT_MODE = "quantised"
DEFAULT_EVERY = 100  # SDXL's worst case (Sage on every call): 20 cost +9% of a step; see docs/auto.md
DEFAULT = (DEFAULT_MODE, DEFAULT_EVERY)  # the (mode, every) form calls and decisions carry
ROWS = 16
QUANTISED_BOUND = 1e-1
# Calls of more FLOPs (4·B·H·Lq·Lk·D) wait for their verdict; smaller ones are checked without waiting, at the
# price of one more exact call per check. 5e11 is about 1 ms of exact attention on an H200 (Flux's 4608-token
# call: 2.6e11, checked on the device; a Wan 480p call: 6.6e12, waits), about what a wait cost per check on SDXL.
WAIT_ABOVE_FLOPS = 5e11


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


def waits(call) -> bool:
    """Whether checking this call waits for the verdict (see the module's text): large calls only."""
    lk = call.key.shape[1 if call.layout == "BSHD" else 2]
    return 4 * call.query.numel() * lk > WAIT_ABOVE_FLOPS


def _figures(call, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(relative error on the sampled rows, whether the output is all finite) as float64 device scalars, and how
    many rows were compared. Only device work: nothing waits for it."""
    got = to_bhsd(out, call.layout)
    rows = _sampled(got.shape[2], got.device)
    with torch.no_grad():
        ref, _ = exact_attention(call.query, call.key, call.value, call.attn_mask, call.is_causal, call.scale,
                                 call.layout, rows, with_lse=False)
        picked = got if rows is None else got.index_select(2, rows)
        error = (picked.double() - ref).norm() / ref.norm().clamp_min(1e-30)
        finite = torch.isfinite(out).all().double()
    return error, finite, picked.shape[2]


def _reason(error: float, finite: bool, inputs_to_blame: bool, rows: int, spec, out_nan: int | None = None):
    """Why figures read on the host mean the output is wrong, or None: NaN/Inf that the inputs themselves
    carry is not the kernel's fault (checks mode reports inputs)."""
    if not finite:
        if inputs_to_blame:
            return None
        count = f"{out_nan} " if out_nan is not None else ""
        return f"its output has {count}NaN/Inf values from finite inputs"
    bound = bound_for(spec)
    if not error <= bound:
        return f"relative error {error:.2e} against exact attention on {rows} sampled query rows " \
               f"exceeds its guard bound {bound:.0e}"
    return None


def problem(call, out: torch.Tensor, spec) -> tuple[str | None, float | None]:
    """(why the output is wrong, or None; the relative error on the sampled rows). Waits for the verdict."""
    error, finite, rows = _figures(call, out)
    error, finite = torch.stack((error, finite)).tolist()
    if finite:
        return _reason(error, True, False, rows, spec), error
    inputs_to_blame = any(non_finite(t) for t in (call.query, call.key, call.value))
    return _reason(error, False, inputs_to_blame, rows, spec, non_finite(out)), None


class _InFlight(NamedTuple):
    figures: torch.Tensor  # on the host (pinned for a GPU call), filled when `done` has passed
    done: object  # a torch.cuda.Event, or None when the figures were computed on the host
    rows: int
    spec: object
    judged: Callable[[str | None, float | None], None]  # gets (why, error) once the figures are read


_in_flight: collections.deque = collections.deque()
_in_flight_lock = threading.Lock()


def check_without_waiting(call, out, exact_result, spec, judged):
    """`out` where the check passes and `exact_result` where it fails, chosen on the device; the verdict reaches
    `judged(why, error)` later (see `resolve_ready`), or now when the call ran on the host. `out` and
    `exact_result` are results as the call returns them (a tensor, or (out, lse)). NaN/Inf in the exact result
    too means the inputs carry it: not the kernel's fault, and its output stays."""
    with_lse = isinstance(out, tuple)
    error, finite, rows = _figures(call, out[0] if with_lse else out)
    exact_finite = torch.isfinite(exact_result[0] if with_lse else exact_result).all()
    bad = ((error > bound_for(spec)) | (finite == 0)) & exact_finite
    if with_lse:
        result = tuple(torch.where(bad, exact, got) for exact, got in zip(exact_result, out))
    else:
        result = torch.where(bad, exact_result, out)
    figures, done = _hand_over(torch.stack((error, finite, exact_finite.double())))
    with _in_flight_lock:
        _in_flight.append(_InFlight(figures, done, rows, spec, judged))
    resolve_ready()
    return result


def _hand_over(figures: torch.Tensor) -> tuple[torch.Tensor, object]:
    """(a host tensor the figures will be in, the event to wait for: None when they already are). A GPU's
    figures are copied into pinned memory without blocking the host."""
    if not figures.is_cuda:
        return figures, None
    host = torch.empty(3, dtype=torch.float64, pin_memory=True)
    host.copy_(figures, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(figures.device))
    return host, done


def resolve_ready(wait: bool = False) -> None:
    """Hand every finished check's verdict to its `judged` (in the order the checks were made); with wait=True,
    wait for those still running first."""
    while _in_flight:
        with _in_flight_lock:
            if not _in_flight:
                return
            entry = _in_flight[0]
            if entry.done is not None and not (wait or entry.done.query()):
                return
            _in_flight.popleft()
        if entry.done is not None:
            entry.done.synchronize()
        error, finite, exact_finite = entry.figures.tolist()
        why = _reason(error, bool(finite), not exact_finite, entry.rows, entry.spec)
        entry.judged(why, error if finite else None)


def settle() -> None:
    """Wait for the checks still in flight and hand their verdicts on (demotions, recorder events)."""
    resolve_ready(wait=True)


report.before_snapshot(settle)

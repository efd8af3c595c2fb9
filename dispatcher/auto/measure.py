"""Measuring one candidate: inputs of a signature (seeded noise, or the caller's own tensors), its time and
its error against exact attention."""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch

from ..inputs import AttentionInputs
from ..reference import non_finite, relative_error, to_bhsd

# The tuner's one clock, in seconds: its budget and its timings on a CPU read it (a GPU's calls are timed by CUDA
# events). A test replaces it (tests/helpers/fake_clock.py) with a clock whose kernels take fixed times, so what
# it asserts on timings holds exactly however loaded the machine is; nothing else in the tuner measures time.
now = time.perf_counter


def spread(times_ms: list[float]) -> float:
    """Relative interquartile range of timing samples (their noise)."""
    if len(times_ms) < 2:
        return 0.0
    low, _, high = statistics.quantiles(times_ms, n=4) if len(times_ms) >= 4 else (min(times_ms), 0, max(times_ms))
    return (high - low) / max(statistics.median(times_ms), 1e-12)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(call, device: torch.device, warmup: int, runs: int) -> list[float]:
    """Milliseconds of each of `runs` calls after `warmup` calls (CUDA events on GPUs)."""
    for _ in range(warmup):
        call()
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(runs)]
        sync(device)
        for begin, end in events:
            begin.record()
            call()
            end.record()
        sync(device)
        return [begin.elapsed_time(end) for begin, end in events]
    times = []
    for _ in range(runs):
        t0 = now()
        call()
        sync(device)
        times.append((now() - t0) * 1e3)
    return times


def balanced_order(count: int, rounds: int) -> list[list[int]]:
    """The order of `count` calls in each of `rounds` rounds: the rows of a balanced Latin square (Williams'
    design, with mirrored rows when `count` is odd), so that each call runs first, and after each other call,
    about equally often. At a power cap a GPU runs a kernel partly at the clocks the one before it left: turned
    by one place each round, a call followed the same one in all rounds but one, and on the H200 the Sage kernel
    that always followed FA3 timed 1.3-2.0% slower than the same kernel under another name (bench/results)."""
    if count < 1:
        return [[] for _ in range(rounds)]
    base, low, high = [0], 1, count - 1
    for place in range(1, count):  # 0, 1, n-1, 2, n-2, ...: every step between neighbours differs
        if place % 2:
            base.append(low)
            low += 1
        else:
            base.append(high)
            high -= 1
    rows = []
    for shift in range(count):
        row = [(x + shift) % count for x in base]
        rows += [row, row[::-1]] if count % 2 else [row]
    return [rows[r % len(rows)] for r in range(rounds)]


def time_rounds(calls: list, device: torch.device, rounds: int, per_sample: list[int] | None = None,
                between=None) -> list[list[float]]:
    """Milliseconds per call of each call over `rounds` rounds. A round takes one sample of each call in turn:
    drift (clocks, other work) falls on all of them alike, which timing one after the other does not give (the
    same kernel under two names timed 5% apart that way on the H200). A sample is one untimed call, then
    `per_sample[i]` back-to-back calls timed together: at its power cap the H200's clocks follow what ran just
    before, so single calls alternating time each kernel partly at the others' clocks: on Wan 14B attention FA3
    and Sage came out 2.4% apart that way and 13% apart in samples of several calls, which is what a model step
    shows (bench/results, 2026-12-04). The order changes each round (`balanced_order`). `between()` runs before
    each round (the host's interrupt check)."""
    per_sample = per_sample or [1] * len(calls)
    times: list[list[float]] = [[] for _ in calls]
    order = balanced_order(len(calls), rounds)
    if device.type == "cuda":
        events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in calls]
                  for _ in order]
        sync(device)
        for turn, round_events in zip(order, events):
            if between is not None:
                between()
            for i in turn:
                calls[i]()  # settles the clocks on this kernel
                begin, end = round_events[i]
                begin.record()
                for _ in range(per_sample[i]):
                    calls[i]()
                end.record()
        sync(device)
        for round_events in events:
            for i, (begin, end) in enumerate(round_events):
                times[i].append(begin.elapsed_time(end) / per_sample[i])
        return times
    for turn in order:
        if between is not None:
            between()
        for i in turn:
            calls[i]()
            sync(device)
            t0 = now()
            for _ in range(per_sample[i]):
                calls[i]()
            sync(device)
            times[i].append((now() - t0) * 1e3 / per_sample[i])
    return times


def validate(out, lse, ref_out, ref_lse, rows, layout, bound, result) -> str | None:
    """Why `out` (and `lse`) is not exact attention within `bound` on the sampled rows, or None; sets
    result.rel_error."""
    if not isinstance(out, torch.Tensor):
        return f"returned {type(out).__name__}, not a tensor"
    expected = ref_out.shape
    got = to_bhsd(out, layout)
    if got.shape[:2] != expected[:2] or got.shape[-1] != expected[-1]:
        return f"returned shape {tuple(out.shape)}, which does not match the inputs"
    bad = non_finite(out)
    if bad:
        return f"output has {bad} NaN/Inf values"
    picked = got if rows is None else got[:, :, rows.to(got.device)]
    err = relative_error(picked, ref_out)
    result.rel_error = err
    if not err <= bound:
        return f"relative error {err:.2e} vs exact attention exceeds its bound {bound:.0e}"
    if lse is not None:
        lse_b = lse if layout == "BHSD" else lse.transpose(1, 2)
        if non_finite(lse_b):
            return f"log-sum-exp has {non_finite(lse_b)} NaN/Inf values"
        picked = lse_b if rows is None else lse_b[:, :, rows.to(lse_b.device)]
        lse_err = relative_error(picked, ref_lse)
        if not lse_err <= bound:
            return f"log-sum-exp relative error {lse_err:.2e} exceeds the bound {bound:.0e}"
    return None


def shrink(sig: AttentionInputs, cap: int) -> AttentionInputs:
    """The signature with both lengths scaled down until q, k, v, out and a workspace fit `cap` bytes."""
    item = torch.empty((), dtype=sig.dtype).element_size()

    def need(lq, lk):
        per_q = sig.batch * sig.heads_q * (sig.head_dim + sig.head_dim_v) * 2  # q, out, workspace
        per_k = sig.batch * sig.heads_kv * (sig.head_dim + sig.head_dim_v)
        return item * (lq * per_q + lk * per_k)

    if need(sig.len_q, sig.len_kv) <= cap:
        return sig
    factor = cap / need(sig.len_q, sig.len_kv)
    lq, lk = max(1, int(sig.len_q * factor)), max(1, int(sig.len_kv * factor))
    mask_shape = None
    if sig.mask_shape is not None:
        shape = list(sig.mask_shape)
        if len(shape) >= 2:
            shape[-1] = lk if shape[-1] == sig.len_kv else shape[-1]
            shape[-2] = lq if shape[-2] == sig.len_q else shape[-2]
        mask_shape = tuple(shape)
    return replace(sig, len_q=lq, len_kv=lk, mask_shape=mask_shape)


def random_inputs(sig: AttentionInputs, layout: str, live=None):
    """Seeded random q, k, v in `layout` (the strides of live tensors when given and compact) and a mask."""
    device, dtype = torch.device(sig.device), sig.dtype
    gen = torch.Generator(device=device).manual_seed(1234)

    def shape(heads, length, dim):
        return (sig.batch, length, heads, dim) if layout == "BSHD" else (sig.batch, heads, length, dim)

    shapes = (shape(sig.heads_q, sig.len_q, sig.head_dim), shape(sig.heads_kv, sig.len_kv, sig.head_dim),
              shape(sig.heads_kv, sig.len_kv, sig.head_dim_v))
    tensors = []
    for i, size in enumerate(shapes):
        template = live[i] if live is not None else None
        t = None
        if template is not None and tuple(template.shape) == size:
            strides = template.stride()
            extent = 1 + sum((s - 1) * st for s, st in zip(size, strides))
            if min(strides) >= 0 and extent <= 4 * template.numel():  # same strides, e.g. Flux's permuted views
                t = torch.empty_strided(size, strides, dtype=dtype, device=device)
                t.as_strided((extent,), (1,)).copy_(torch.randn(extent, generator=gen, device=device, dtype=dtype))
        tensors.append(t if t is not None else torch.randn(size, generator=gen, device=device, dtype=dtype))
    mask = None
    if live is not None and live[3] is not None:
        mask = live[3]  # masks are small and decide the kernel's work: use the caller's
    elif sig.mask_kind in ("bool", "key_padding", "additive") and sig.mask_shape is not None:
        keep = torch.rand(sig.mask_shape, generator=gen, device=device) > 0.2
        keep[..., 0] = True  # no fully masked row
        mask = keep if sig.mask_kind != "additive" else torch.zeros(
            sig.mask_shape, dtype=dtype, device=device).masked_fill_(~keep, float("-inf"))
    return tensors[0], tensors[1], tensors[2], mask

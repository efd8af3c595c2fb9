"""Configurations timed side by side: every round runs each once, in a new shuffled order, so drift and noise
fall on all of them alike. The bench scripts share these (bench/ is on sys.path when one of them runs)."""

from __future__ import annotations

import random
import statistics
import time

import torch


def shuffled_rounds(names, rounds: int, seed: int = 0):
    """Each of `names` once per round, `rounds` times, in a new shuffled order every round."""
    order = list(names)
    rng = random.Random(seed)
    for _ in range(rounds):
        rng.shuffle(order)
        yield from order


def interleaved_ms(fns: dict, rounds: int, per_sample: int = 1) -> dict[str, float]:
    """GPU: median ms of one `fns[name]()` over `rounds` samples of `per_sample` calls each, CUDA events around
    each sample."""
    samples = {name: [] for name in fns}
    for name in shuffled_rounds(fns, rounds):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        begin.record()
        for _ in range(per_sample):
            fns[name]()
        end.record()
        torch.cuda.synchronize()
        samples[name].append(begin.elapsed_time(end) / per_sample)
    return {name: statistics.median(v) for name, v in samples.items()}


def host_us_per_call(fns: dict, rounds: int, calls: int) -> dict[str, float]:
    """GPU: median host time per call of each, with the GPU kept busy by a sleep kernel so no call waits for it."""
    samples = {name: [] for name in fns}
    for name in shuffled_rounds(fns, rounds, seed=1):
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)  # tens of ms of GPU time: longer than the calls take to queue
        begin = time.perf_counter()
        for _ in range(calls):
            fns[name]()
        samples[name].append((time.perf_counter() - begin) / calls * 1e6)
    torch.cuda.synchronize()
    return {name: statistics.median(v) for name, v in samples.items()}


def cpu_us_per_call(fns: dict, rounds: int, calls: int, stat=statistics.median) -> dict[str, float]:
    """CPU: median clock time per call of each, in µs (on the CPU the host's time is the call's time); stat=min: the
    fastest round of each, which a machine shared with other work disturbs least."""
    samples = {name: [] for name in fns}
    for name in shuffled_rounds(fns, rounds, seed=1):
        fn = fns[name]
        begin = time.perf_counter()
        for _ in range(calls):
            fn()
        samples[name].append((time.perf_counter() - begin) / calls * 1e6)
    return {name: stat(v) for name, v in samples.items()}


def gpu_us_per_call(fns: dict, rounds: int, calls: int) -> dict[str, float]:
    """GPU: median GPU time per call of each, in µs: the calls are queued behind a sleep kernel and run back to
    back, so the host's pace never shows (what the kernels cost, not what the host makes the GPU wait)."""
    samples = {name: [] for name in fns}
    for name in shuffled_rounds(fns, rounds, seed=2):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)
        begin.record()
        for _ in range(calls):
            fns[name]()
        end.record()
        torch.cuda.synchronize()
        samples[name].append(begin.elapsed_time(end) / calls * 1e3)
    return {name: statistics.median(v) for name, v in samples.items()}

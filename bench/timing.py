"""Configurations timed side by side on a GPU: shuffled every round, each sample timed with CUDA events."""

from __future__ import annotations

import random
import statistics

import torch


def interleaved_ms(fns: dict, rounds: int, per_sample: int = 1) -> dict[str, float]:
    """Median ms of one `fns[name]()` over `rounds` samples of `per_sample` calls each, configurations in a new
    shuffled order every round so drift and noise fall on all of them alike."""
    samples = {name: [] for name in fns}
    order = list(fns)
    rng = random.Random(0)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            begin.record()
            for _ in range(per_sample):
                fns[name]()
            end.record()
            torch.cuda.synchronize()
            samples[name].append(begin.elapsed_time(end) / per_sample)
    return {name: statistics.median(v) for name, v in samples.items()}

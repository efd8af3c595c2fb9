"""How many calls apart the quality guard checks a block when `guard_every` is 0 (the default): sized on this machine.

One call in `every` of a block is checked, `every` = ceil(check / (BUDGET * call)), so that the checks cost at most
BUDGET of the attention time. Both times are measured where the guard runs, by the first checks themselves (`Clock`):
a checked call is timed as it is served and its check until its verdict is read, which the check waits for anyway.

- CPU: the clock around the kernel's call and around the check (both run to completion on the host).
- CUDA: events around the kernel's call and the check's kernels, read once the verdict is in (its wait has
  synchronised them: no extra sync). The call counts the larger of its GPU time and its host time (a call the host
  cannot launch faster than the GPU runs it costs its launch); the check its host time to launch plus its GPU time.
  Not seen: the GPU's idle time while the host relaunches after the wait, which `bench/guard_cost.py --scenario
  call-cost` measures with the whole.

The first checks of a kernel on one signature (one decision) time themselves; once TIMED_CHECKS have, the interval is
sized from the check's least time and the call's median time (a first call or check that compiles a kernel is left
out by both; the check's noise is left out, the call's kept: erring on checking more often), and sized again from
all of them every TIMED_CHECKS more, up to LAST_TIMED (a start slowed by other work on the machine is corrected);
each sizing at most doubles the interval in force (GROWTH), and a shorter one applies at once to every block
(guard.Watch). Then it holds for the process.

Before that, the interval is the prior: the cost model below, priced from the H200's figures, capped at PRIOR_EVERY,
so a machine those figures misprice (a CPU, where a call "cost" microseconds and the interval came out at 2,171) is
checked more often, not less, until it has measured itself. The model's constants are re-fitted from a GPU run
(`bench/guard_cost.py --scenario check-time` and `call-cost` print the measured times beside the modelled ones).
"""

from __future__ import annotations

import math
import statistics
from time import perf_counter

import torch

from . import guard_check

BUDGET = 0.01  # of the attention time (so of a step, which also has other layers)
TIMED_CHECKS = 5  # per kernel and signature: timed checks before the interval is first sized from them
LAST_TIMED = 80  # sized again every TIMED_CHECKS more timed checks up to this many; the later checks time nothing
GROWTH = 2  # a sizing at most multiplies the interval in force by this: checks slowed by other work on the machine
# cannot stretch it at once (those few checks would then be far apart, and so would the next sizing)
PRIOR_EVERY = 8  # the most the prior may give: checks are frequent until this machine has measured itself
MAX_EVERY = 100_000

# The cost model: the prior. PROVISIONAL constants, derived from the H200's figures below; re-fitted from the next
# GPU run (bench/guard_cost.py --scenario check-time and call-cost, bench/results/README.md). A check is the check
# kernel (guard_check.py: K, V and the output read once, exact attention on ROWS rows) and one wait for its
# verdict; a call costs its flops at the watched kernel's rate plus its launch.
CALL_HOST_S = 2e-5
# Sage per warp on Wan 14B's shape: 796 TFLOP/s-equivalent (27.62 ms), FA3 610-690 (H200, 2026-12-03): the fastest
# kernel the guard watches, so the call it checks is no shorter than this says.
KERNEL_FLOPS = 8e14
# What a check adds to the GPU's timeline beyond its kernels: the GPU idles from the end of its queue until the host
# has woken, read the verdict (3 floats) and launched the next op; plus the check's 3 launches. A bare sync cost
# 0.31 ms per check on SDXL's attention calls alone (H200, 2026-12-03), a host-bound loop where the wait also holds
# the host's queued launches back; on calls the GPU is busy with for milliseconds (video, Flux) the host is ahead
# and only its wake-up, the check's Python (~30 us, the pack's per-call cost on that host) and one launch remain.
CHECK_HOST_S = 1e-4
# The torch path (no Triton: Windows without triton-windows, CPU) issues ~8 small ops per chunk of keys plus ~10,
# each ~20 us of host time on the H200's host (177-194 us for a dozen ops, 2026-12-03).
OP_HOST_S = 2e-5
# The check kernel streams K, V and the output: 73% of the H200's 4.8 TB/s, a streaming read's usual share.
MEMORY_BYTES_S = 3.5e12
# P·V in true float32 (the `ieee` dot: FMA units, not tensor cores) on 16-row tiles: about a third of the H200's
# 67 TFLOP/s float32 peak. q·k runs on the tensor cores at KERNEL_FLOPS (bf16/fp16 products are exact in float32).
CHECK_FLOPS = 2.5e13


def interval_of(call_s: float, check_s: float) -> int:
    """One call in how many is checked so that checks of `check_s` cost at most BUDGET of calls of `call_s`."""
    if not call_s > 0:
        return 1
    return max(1, min(MAX_EVERY, math.ceil(check_s / (BUDGET * call_s))))


def prior(inputs) -> int:
    """The interval before this machine has timed any check of these inputs: the cost model's, at most PRIOR_EVERY."""
    return min(PRIOR_EVERY, interval(inputs))


def interval(inputs, kernel: bool | None = None) -> int:
    """The cost model's interval for these inputs (the H200's figures). kernel: whether the Triton check kernel
    serves these inputs (None: as on this machine)."""
    return interval_of(call_seconds(inputs), check_seconds(inputs, kernel))


def call_seconds(inputs) -> float:
    b, h, lq, lk = inputs.batch, inputs.heads_q, inputs.len_q, inputs.len_kv
    return CALL_HOST_S + 2.0 * b * h * lq * lk * (inputs.head_dim + inputs.head_dim_v) / KERNEL_FLOPS


def check_seconds(inputs, kernel: bool | None = None) -> float:
    """What one check of a call of these inputs costs (the cost model above)."""
    b, h, hk, lq, lk = inputs.batch, inputs.heads_q, inputs.heads_kv, inputs.len_q, inputs.len_kv
    d, dv = inputs.head_dim, inputs.head_dim_v
    size = torch.empty((), dtype=inputs.dtype).element_size()
    rows = min(guard_check.ROWS, lq)
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


class Sizing:
    """One kernel's interval on one signature (kept by its decision's guard.Watch): the prior until TIMED_CHECKS
    checks have timed themselves, then sized from their times (again every TIMED_CHECKS more, up to LAST_TIMED)."""

    __slots__ = ("every", "calls", "checks", "measured")

    def __init__(self, prior_every: int):
        self.every = prior_every
        self.calls: list[float] = []  # seconds of each timed call
        self.checks: list[float] = []  # seconds of each timed check
        self.measured = False

    @property
    def timing(self) -> bool:
        """Whether the next check still times itself."""
        return len(self.calls) < LAST_TIMED

    def add(self, call_s: float, check_s: float) -> bool | None:
        """One timed check: None, or when it sized the interval, whether that changed it (True the first time)."""
        self.calls.append(call_s)
        self.checks.append(check_s)
        timed = len(self.calls)
        if timed % TIMED_CHECKS:
            return None
        before = self.every if self.measured else None
        self.every, self.measured = min(interval_of(self.call_s, self.check_s), GROWTH * self.every), True
        return self.every != before

    @property
    def call_s(self) -> float:
        return statistics.median(self.calls)

    @property
    def check_s(self) -> float:
        return min(self.checks)


class Clock:
    """Times one checked call on its device: the kernel's call (started before it runs, `called` after), then its
    check (`launched` once its kernels are queued); `seconds` once the verdict was read."""

    __slots__ = ("stream", "marks", "start", "call_s", "launch_s")

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        if self.stream is not None:
            self.marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            self.marks[0].record(self.stream)
        self.start = perf_counter()

    def called(self) -> None:
        if self.stream is not None:
            self.marks[1].record(self.stream)
        now = perf_counter()
        self.call_s, self.start = now - self.start, now

    def launched(self) -> None:
        if self.stream is not None:
            self.marks[2].record(self.stream)
            self.launch_s = perf_counter() - self.start

    def seconds(self) -> tuple[float, float]:
        """(the call's seconds, the check's seconds); only once the check's verdict has been read."""
        if self.stream is None:
            return self.call_s, perf_counter() - self.start
        first, middle, last = self.marks
        return (max(self.call_s, first.elapsed_time(middle) / 1e3),
                self.launch_s + middle.elapsed_time(last) / 1e3)

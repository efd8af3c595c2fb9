"""`quantise.quantise` fused for the GPU: each of q, k and v in three Triton launches instead of torch's passes.

1. `_stats`: each program streams a run of tokens of one (batch, head) once and writes its per-channel sum, largest
   and smallest value (float32) to a small buffer, (B·H, runs, D) each: 1-10% of the tensor's bytes.
2. `_finish`: one program per (batch, key/value head) reduces them to the head's shift per channel (K: its mean
   over tokens; V: its mean in the channels where that is an offset) and the largest magnitude left after it,
   over the query heads of its group for Q: the float32 descale FlashAttention-3 takes (largest / 448).
3. `_cast`: each program writes one tile of tokens as e4m3, (x - shift) / descale.

Read twice (a head's scale must be known before any of its values is cast, and FlashAttention-3 takes one scale per
head: no single pass can know it), written once in e4m3: 5 bytes per bf16 value against the torch path's ~19. Runs
and tiles are sized from the GPU's SM count so that every SM streams (16 programs per SM in the first launch).

Same numbers as the float64 reference (`quantise.reference_one`): Q's exactly, K's and V's but where the float32
sums give a channel's mean another float32 than the float64 mean rounds to (then values within that ulp of an e4m3
midpoint move one step). Every division is correctly rounded (`div_rn`; Triton's `/` is the approximate
`div.full.f32` on NVIDIA GPUs, up to 2 ulp off) and the cast divides by the descale rather than multiplying by its
reciprocal: a bf16 value over a bf16 head maximum / 448 lands exactly on an e4m3 midpoint far more often than
chance (448 = 7 * 2^6, so 448 x / max is a short binary fraction wherever the maximum's 8-bit significand
divides 7 * 2^k times x's: up to 6% of a head's values), where the correctly rounded quotient rounds to even as torch's cast does, but x * (1 / d) lands an ulp to
either side (0.02-0.13% of Q's values differed, emulated at Flux's shape; 0.1% on an H100 on 2026-12-06).

The rounding to e4m3 is done in float32 arithmetic (round-to-nearest-even on the e4m3 grid, then saturated to
+-448), so the final cast is exact: Triton's CPU interpreter (3.6 to 3.9) rounds fp32 -> e4m3 wrongly where the
mantissa carries into the exponent (126.3 -> 64), and the tests run the same code the GPU runs.
"""

from __future__ import annotations

import os

import torch

try:  # import-guarded: triton ships with torch's Linux wheels, not with every platform's
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 (any failure to import means: the torch path serves)
    triton = None

E4M3_MAX = 448.0
TINY = 1e-12  # the descale of an all-zero head: its values stay 0
BLOCK_L = 32  # tokens per step of a run in `_stats`: a (32, D) float32 tile per accumulator
CAST_TOKENS = 64  # tokens per `_cast` program
PROGRAMS_PER_SM = 16  # `_stats` programs per SM: enough that the last wave is a small share of the work
MAX_RUNS = 256  # runs per head: `_finish` reduces at most this many partials per channel
FINISH_RUNS = 32  # partials `_finish` reduces per step
# Smoothing modes: nothing subtracted; each channel's mean over tokens (K); a channel's mean only where it is an
# offset, larger than 1/OFFSET_SHARE of the channel's range (V; about half a standard deviation of 10^3-10^5
# Gaussian tokens): see `quantise`'s docstring for why V's zero-mean channels are left alone.
SMOOTHING = {"none": 0, "mean": 1, "offsets": 2}
OFFSET_SHARE = 16.0

_SM_COUNTS: dict = {}


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: on a CUDA GPU (or Triton's CPU interpreter), 16/32-bit floats, head
    dims up to 256, none empty."""
    on_device = all(t.is_cuda for t in tensors) or os.environ.get("TRITON_INTERPRET") == "1"
    return (triton is not None and on_device and all(
        t.dtype in (torch.bfloat16, torch.float16, torch.float32) and t.dim() == 4 and 0 < t.shape[-1] <= 256
        and t.numel() > 0 for t in tensors))


def _runs(device: torch.device, heads: int, length: int) -> tuple[int, int]:
    """(runs per head, tokens per run) for `_stats`: PROGRAMS_PER_SM programs per SM, runs of whole BLOCK_L steps."""
    sms = _SM_COUNTS.get(device)
    if sms is None:
        sms = _SM_COUNTS[device] = (torch.cuda.get_device_properties(device).multi_processor_count
                                    if device.type == "cuda" else 4)
    runs = max(1, min(MAX_RUNS, -(-PROGRAMS_PER_SM * sms // heads), -(-length // BLOCK_L)))
    per_run = -(-length // runs)
    per_run = -(-per_run // BLOCK_L) * BLOCK_L
    return -(-length // per_run), per_run


def quantise_one(x: torch.Tensor, heads_kv: int, smooth: str
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(B, L, H, D) -> (its e4m3 (B, L, H, D) contiguous, float32 descale (B, Hk), float32 shift (B, Hk, D) or None).

    One descale per key/value head: query heads j*G..j*G+G-1 share head j's (FlashAttention-3's order). `smooth`
    (a SMOOTHING key; keys and values only, H == Hk) says what is subtracted per channel first: the shift."""
    b, length, heads, dim = x.shape
    group = heads // heads_kv
    mode = SMOOTHING[smooth]
    if mode and group != 1:
        raise ValueError("smoothing is per key/value head: x must have heads_kv heads")
    runs, per_run = _runs(x.device, b * heads, length)
    f32 = dict(device=x.device, dtype=torch.float32)
    partials = torch.empty((3, b * heads, runs, dim), **f32)
    descale = torch.empty((b, heads_kv), **f32)
    shift = torch.empty((b, heads_kv, dim), **f32) if mode else descale  # unread without smoothing
    out = torch.empty((b, length, heads, dim), device=x.device, dtype=torch.float8_e4m3fn)
    block_d = max(16, triton.next_power_of_2(dim))
    # sm_90 (ptxas): `_cast`'s 64 x 128 tile over 4 warps takes 64 registers a thread, `_stats`' three 32 x 128
    # accumulators over 8 warps as many: 4 programs an SM or more, 32 kB of reads or more in flight an SM
    warps = 8 if block_d > 128 else 4
    _stats[(b * heads, runs)](x, partials[0], partials[1], partials[2], *x.stride(), heads, length, dim, per_run,
                              per_run // BLOCK_L, BLOCK_L=BLOCK_L, BLOCK_D=block_d, num_warps=2 * warps)
    _finish[(b * heads_kv,)](partials[0], partials[1], partials[2], descale, shift, group, length, dim, runs,
                             -(-runs // FINISH_RUNS), SMOOTH=mode, BLOCK_S=FINISH_RUNS, BLOCK_D=block_d,
                             num_warps=warps)
    _cast[(b * heads, -(-length // CAST_TOKENS))](x, out, descale, shift, *x.stride(), *out.stride()[:3], heads,
                                                  group, length, dim, SHIFT=bool(mode), BLOCK_L=CAST_TOKENS,
                                                  BLOCK_D=block_d, num_warps=warps)
    return out, descale, shift if mode else None


if triton is not None:
    OFFSET_SHARE_C = tl.constexpr(OFFSET_SHARE)
    # Lengths and run counts change from model to model: specialising on them (Triton's default for ints equal to 1
    # or divisible by 16) would compile more variants of the kernels and gain nothing (the tensors' strides and
    # pointers, which make the loads 16-byte vectors, are still specialised).

    @triton.jit(do_not_specialize=["length", "per_run", "steps"])
    def _stats(x_ptr, sum_ptr, max_ptr, min_ptr, sxb, sxl, sxh, sxd, heads, length, dim, per_run, steps,
               BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
        """Per-channel sum, max and min of one run of tokens of one (batch, head)."""
        bh = tl.program_id(0)
        run = tl.program_id(1)
        b = bh // heads
        h = bh % heads
        d = tl.arange(0, BLOCK_D)
        d_ok = d < dim
        base = x_ptr + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh
        total = tl.zeros((BLOCK_L, BLOCK_D), dtype=tl.float32)
        high = tl.full((BLOCK_L, BLOCK_D), float("-inf"), dtype=tl.float32)
        low = tl.full((BLOCK_L, BLOCK_D), float("inf"), dtype=tl.float32)
        for step in range(0, steps):
            tok = run * per_run + step * BLOCK_L + tl.arange(0, BLOCK_L)
            ok = (tok < length)[:, None] & d_ok[None, :]
            x = tl.load(base + tok.to(tl.int64)[:, None] * sxl + d[None, :] * sxd, mask=ok, other=0.0)
            x = x.to(tl.float32)
            total += x
            high = tl.maximum(high, tl.where(ok, x, float("-inf")))
            low = tl.minimum(low, tl.where(ok, x, float("inf")))
        at = (bh * tl.num_programs(1) + run) * dim + d
        tl.store(sum_ptr + at, tl.sum(total, 0), mask=d_ok)
        tl.store(max_ptr + at, tl.max(high, 0), mask=d_ok)
        tl.store(min_ptr + at, tl.min(low, 0), mask=d_ok)

    @triton.jit(do_not_specialize=["length", "runs", "chunks"])
    def _finish(sum_ptr, max_ptr, min_ptr, descale_ptr, shift_ptr, group, length, dim, runs, chunks,
                SMOOTH: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
        """One (batch, key/value head): its shift per channel (SMOOTH) and its descale, over its group's heads."""
        bj = tl.program_id(0)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < dim
        s = tl.arange(0, BLOCK_S)
        largest = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for g in range(0, group):
            row = (bj * group + g) * runs  # heads j*G..j*G+G-1 of batch b are rows (b*H + j*G + g)
            high = tl.full((BLOCK_D,), float("-inf"), dtype=tl.float32)
            low = tl.full((BLOCK_D,), float("inf"), dtype=tl.float32)
            total = tl.zeros((BLOCK_D,), dtype=tl.float32)
            for chunk in range(0, chunks):
                rs = chunk * BLOCK_S + s
                ok = (rs < runs)[:, None] & d_ok[None, :]
                at = (row + rs)[:, None] * dim + d[None, :]
                high = tl.maximum(high, tl.max(tl.load(max_ptr + at, mask=ok, other=float("-inf")), 0))
                low = tl.minimum(low, tl.min(tl.load(min_ptr + at, mask=ok, other=float("inf")), 0))
                if SMOOTH > 0:
                    total += tl.sum(tl.load(sum_ptr + at, mask=ok, other=0.0), 0)
            shift = tl.zeros((BLOCK_D,), dtype=tl.float32)
            if SMOOTH > 0:
                shift = tl.math.div_rn(total, length.to(tl.float32))
                if SMOOTH == 2:  # offsets only
                    shift = tl.where(tl.abs(shift) * OFFSET_SHARE_C > tl.where(d_ok, high - low, 0.0), shift, 0.0)
                tl.store(shift_ptr + bj * dim + d, shift, mask=d_ok)
            largest = tl.maximum(largest, tl.where(d_ok, tl.maximum(high - shift, shift - low), 0.0))
        tl.store(descale_ptr + bj, tl.maximum(tl.math.div_rn(tl.max(largest, 0), 448.0), 1e-12))

    @triton.jit
    def _e4m3_grid(y):
        """y rounded to the nearest e4m3 value (ties to even; 3 mantissa bits, subnormals 2^-9 apart), saturated
        to +-448: adding and subtracting 1.5 * 2^23 times the grid's step rounds in float32's own rounding."""
        exponent = (y.to(tl.int32, bitcast=True) >> 23) & 0xFF
        step = (tl.maximum(exponent - 3, 127 - 9) << 23).to(tl.float32, bitcast=True)
        magic = step * 12582912.0
        y = (y + magic) - magic
        return tl.minimum(tl.maximum(y, -448.0), 448.0)

    @triton.jit(do_not_specialize=["length"])
    def _cast(x_ptr, out_ptr, descale_ptr, shift_ptr, sxb, sxl, sxh, sxd, sob, sol, soh, heads, group, length, dim,
              SHIFT: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
        """One tile of tokens of one (batch, head): (x - shift) / descale in e4m3."""
        bh = tl.program_id(0)
        b = bh // heads
        h = bh % heads
        bj = b * (heads // group) + h // group
        d = tl.arange(0, BLOCK_D)
        d_ok = d < dim
        descale = tl.load(descale_ptr + bj)
        shift = tl.zeros((BLOCK_D,), dtype=tl.float32)
        if SHIFT:
            shift = tl.load(shift_ptr + bj * dim + d, mask=d_ok, other=0.0)
        tok = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
        ok = (tok < length)[:, None] & d_ok[None, :]
        x = tl.load(x_ptr + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh + tok.to(tl.int64)[:, None] * sxl
                    + d[None, :] * sxd, mask=ok, other=0.0)
        y = _e4m3_grid(tl.math.div_rn(x.to(tl.float32) - shift[None, :], descale))
        tl.store(out_ptr + b.to(tl.int64) * sob + h.to(tl.int64) * soh + tok.to(tl.int64)[:, None] * sol + d[None, :],
                 y.to(tl.float8e4nv), mask=ok)

"""`quantise.quantise` fused for the GPU: each of q, k and v in two Triton launches instead of torch's five passes.

1. `_stats`: each program streams a run of tokens of one (batch, head) once and writes its per-channel sum, largest
   and smallest value (float32) to a small buffer, (B·H, splits, D) each.
2. `_cast`: each program reduces its head's (or query group's) partials, a few kB from L2, to the head's mean per
   channel (K and V smoothing) and the largest magnitude left after it (the e4m3 scale), then streams its run of
   tokens again and writes (x - mean) / descale as e4m3; the first program of a head writes its descale and mean.

Read twice (the scale of a head must be known before any of its values is cast, and FlashAttention-3 takes one
scale per head: no single pass can know it), written once in e4m3: 5 bytes per bf16 value against the torch path's
~19. Same numbers as the float64 reference (`quantise.reference`) but for values within float32 rounding of an e4m3
rounding midpoint: one step in a few million values (tests/test_fp8_kernel.py, under Triton's CPU interpreter).

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
TINY = 1e-12  # the descale of an all-zero head (quantise._TINY): its values stay 0
BLOCK_L = 32  # tokens per loop step: a (32, D) float32 tile per accumulator
MAX_SPLITS = 32  # runs of tokens per head: the cast reduces at most this many partials per channel
MIN_TOKENS_PER_SPLIT = 256  # below it a run costs more to launch and reduce than it streams
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


def _splits(device: torch.device, heads: int, length: int) -> tuple[int, int]:
    """(splits, tokens per split): enough programs (4 per SM) for the GPU to stream the tensor, runs of whole
    BLOCK_L steps."""
    sms = _SM_COUNTS.get(device)
    if sms is None:
        sms = _SM_COUNTS[device] = (torch.cuda.get_device_properties(device).multi_processor_count
                                    if device.type == "cuda" else 4)
    splits = max(1, min(MAX_SPLITS, -(-4 * sms // heads), -(-length // MIN_TOKENS_PER_SPLIT)))
    per_split = -(-length // splits)
    per_split = -(-per_split // BLOCK_L) * BLOCK_L
    return -(-length // per_split), per_split


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
    splits, per_split = _splits(x.device, b * heads, length)
    partials = torch.empty((3, b * heads, splits, dim), device=x.device, dtype=torch.float32)
    out = torch.empty((b, length, heads, dim), device=x.device, dtype=torch.float8_e4m3fn)
    descale = torch.empty((b, heads_kv), device=x.device, dtype=torch.float32)
    mean = torch.empty((b, heads_kv, dim), device=x.device, dtype=torch.float32) if mode else descale
    block_d = max(16, triton.next_power_of_2(dim))
    warps = 8 if block_d > 128 else 4
    grid = (b * heads, splits)
    _stats[grid](x, partials[0], partials[1], partials[2], *x.stride(), heads, length, dim, per_split,
                 per_split // BLOCK_L, BLOCK_L=BLOCK_L, BLOCK_D=block_d, num_warps=warps)
    _cast[grid](x, out, partials[0], partials[1], partials[2], descale, mean, *x.stride(), *out.stride()[:3],
                heads, group, length, dim, per_split, per_split // BLOCK_L, splits, SMOOTH=mode,
                BLOCK_L=BLOCK_L, BLOCK_D=block_d, BLOCK_S=max(2, triton.next_power_of_2(splits)), num_warps=warps)
    return out, descale, mean if mode else None


if triton is not None:
    @triton.jit
    def _stats(x_ptr, sum_ptr, max_ptr, min_ptr, sxb, sxl, sxh, sxd, heads, length, dim, per_split, steps,
               BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
        """Per-channel sum, max and min of one run of tokens of one (batch, head)."""
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b = bh // heads
        h = bh % heads
        d = tl.arange(0, BLOCK_D)
        d_ok = d < dim
        base = x_ptr + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh
        total = tl.zeros((BLOCK_L, BLOCK_D), dtype=tl.float32)
        high = tl.full((BLOCK_L, BLOCK_D), float("-inf"), dtype=tl.float32)
        low = tl.full((BLOCK_L, BLOCK_D), float("inf"), dtype=tl.float32)
        for step in range(0, steps):
            tok = split * per_split + step * BLOCK_L + tl.arange(0, BLOCK_L)
            ok = (tok < length)[:, None] & d_ok[None, :]
            x = tl.load(base + tok.to(tl.int64)[:, None] * sxl + d[None, :] * sxd, mask=ok, other=0.0)
            x = x.to(tl.float32)
            total += x
            high = tl.maximum(high, tl.where(ok, x, float("-inf")))
            low = tl.minimum(low, tl.where(ok, x, float("inf")))
        at = (bh * tl.num_programs(1) + split) * dim + d
        tl.store(sum_ptr + at, tl.sum(total, 0), mask=d_ok)
        tl.store(max_ptr + at, tl.max(high, 0), mask=d_ok)
        tl.store(min_ptr + at, tl.min(low, 0), mask=d_ok)

    @triton.jit
    def _e4m3_grid(y):
        """y rounded to the nearest e4m3 value (ties to even; 3 mantissa bits, subnormals 2^-9 apart), saturated
        to +-448: adding and subtracting 1.5 * 2^23 times the grid's step rounds in float32's own rounding."""
        exponent = (y.to(tl.int32, bitcast=True) >> 23) & 0xFF
        step = (tl.maximum(exponent - 3, 127 - 9) << 23).to(tl.float32, bitcast=True)
        magic = step * 12582912.0
        y = (y + magic) - magic
        return tl.minimum(tl.maximum(y, -448.0), 448.0)

    OFFSET_SHARE_C = tl.constexpr(OFFSET_SHARE)

    @triton.jit
    def _cast(x_ptr, out_ptr, sum_ptr, max_ptr, min_ptr, descale_ptr, mean_ptr, sxb, sxl, sxh, sxd, sob, sol, soh,
              heads, group, length, dim, per_split, steps, splits,
              SMOOTH: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
        """The head's scale (and shift) from the partials of its key/value head's group, then its run of tokens
        cast to e4m3."""
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b = bh // heads
        h = bh % heads
        kv = h // group
        d = tl.arange(0, BLOCK_D)
        d_ok = d < dim
        s = tl.arange(0, BLOCK_S)
        tile_ok = (s < splits)[:, None] & d_ok[None, :]
        largest = tl.zeros((BLOCK_D,), dtype=tl.float32)
        mean = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for g in range(0, group):
            rows = (b * heads + kv * group + g) * splits + s
            at = rows[:, None] * dim + d[None, :]
            high = tl.max(tl.load(max_ptr + at, mask=tile_ok, other=float("-inf")), 0)
            low = tl.min(tl.load(min_ptr + at, mask=tile_ok, other=float("inf")), 0)
            if SMOOTH > 0:
                mean = tl.sum(tl.load(sum_ptr + at, mask=tile_ok, other=0.0), 0) / length
                if SMOOTH == 2:  # offsets only
                    mean = tl.where(tl.abs(mean) * OFFSET_SHARE_C > tl.where(d_ok, high - low, 0.0), mean, 0.0)
            largest = tl.maximum(largest, tl.where(d_ok, tl.maximum(high - mean, mean - low), 0.0))
        descale = tl.maximum(tl.max(largest, 0) / 448.0, 1e-12)
        inv = 1.0 / descale
        first = split == 0
        tl.store(descale_ptr + b * (heads // group) + kv, descale, mask=first & (h % group == 0))
        if SMOOTH > 0:
            tl.store(mean_ptr + (b * heads + h) * dim + d, mean, mask=d_ok & ((d * 0 + split) == 0))
        base = x_ptr + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh
        out = out_ptr + b.to(tl.int64) * sob + h.to(tl.int64) * soh
        for step in range(0, steps):
            tok = split * per_split + step * BLOCK_L + tl.arange(0, BLOCK_L)
            ok = (tok < length)[:, None] & d_ok[None, :]
            x = tl.load(base + tok.to(tl.int64)[:, None] * sxl + d[None, :] * sxd, mask=ok, other=0.0)
            y = _e4m3_grid((x.to(tl.float32) - mean[None, :]) * inv)
            tl.store(out + tok.to(tl.int64)[:, None] * sol + d[None, :], y.to(tl.float8e4nv), mask=ok)

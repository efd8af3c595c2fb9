"""FP8 (e4m3) attention inputs for FlashAttention-3's FP8 forward, and that forward emulated on any device.

`quantise(q, k, v)` gives what FA3's `flash_attn_func` takes in FP8 (float8_e4m3fn q/k/v of the caller's (B, L, H, D)
shape and one float32 descale per batch and key/value head, `CHECK_SHAPE(q_descale, batch_size, num_heads_k)` in its
flash_api.cpp), and what its bfloat16 output needs afterwards (`restore`, `lse_shift`):

- Scales per head: each head's largest magnitude maps to e4m3's 448. e4m3 is floating point (3 mantissa bits,
  normal over 2^-6..448), so every value keeps about 2^-4 relative precision whatever its size within 2^15 of the
  head's largest: an outlier channel does not flatten the others as it does on an INT8 grid. Finer scales (per
  channel or per block) would buy precision only for values 2^15 below their head's largest, and FA3 takes one scale
  per head.
- K smoothed: its mean over tokens is subtracted. q.(k_j - m) = q.k_j - q.m shifts each query's scores by one
  constant, which softmax ignores (the output is unchanged; the log-sum-exp moves by scale * q.m: `lse_shift`). What
  it removes is a shared offset that would otherwise take the e4m3 precision: an offset of 20 rounds to +-1.25,
  the size of the whole signal.
- V smoothed: its mean over tokens is subtracted and added back to the output (softmax rows sum to 1, so
  P.(V - m) + m = P.V): e4m3 rounds only what varies between tokens, and the rounding of P (FA3 rounds P to e4m3
  too) no longer multiplies the offset.

Cost: per tensor one read for the mean (K, V), one for the per-channel extremes (`aminmax`), one multiply-add that
writes the scaled bfloat16 and one cast to e4m3: plain torch ops, eager. Under torch.compile they fuse.

`fa3_fp8_forward` is FA3's FP8 forward (its `flash_attn_func` contract) computed in float64 from these e4m3 inputs, with P rounded to e4m3 as the
kernel rounds it (at 2^8 times its value relative to the row's maximum: FA3's `Max_offset` 8 for FP8, so P's largest
lands on 256, within e4m3's range) and the row sums taken before that rounding. It does not model the online
softmax's running maximum (the kernel scales P by the maximum so far, which only moves values up the e4m3 grid): the
CPU reference the quantisation is tested against, and the bench's expectation for the GPU kernel.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
P_OFFSET = 256.0  # FA3 computes P as exp2(s - max + 8) for FP8: P's largest is 2^8
_TINY = 1e-12  # the scale of an all-zero head: its values stay 0


class Fp8Inputs(NamedTuple):
    """FA3's FP8 inputs (e4m3, the caller's (B, L, H, D) shape, contiguous) and what its output needs after."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_descale: torch.Tensor  # float32 (B, Hk): value = e4m3 value * descale
    k_descale: torch.Tensor
    v_descale: torch.Tensor
    k_mean: torch.Tensor | None  # float32 (B, Hk, D): subtracted from k (the LSE moves by scale * q.k_mean)
    v_mean: torch.Tensor | None  # (B, 1, Hk, Dv) in v's dtype: subtracted from v, added back to the output


def _groups(q: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """q as (B, L, Hk, G, D): the G query heads that share key/value head j are heads j*G..j*G+G-1 (FA3's order)."""
    return q.unflatten(2, (heads_kv, q.shape[2] // heads_kv))


def _amax(x: torch.Tensor, dims) -> torch.Tensor:
    """The largest magnitude over `dims` in one read (no |x| temporary)."""
    return torch.linalg.vector_norm(x, ord=math.inf, dim=dims)


def _scale(amax: torch.Tensor) -> torch.Tensor:
    return (amax.float() / E4M3_MAX).clamp_min(_TINY)


def _cast(x: torch.Tensor, descale: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
    """(x - shift) / descale in e4m3; descale (B, Hk) broadcast over tokens and channels, shift (B, 1, Hk, D)."""
    inv = (1.0 / descale)[:, None, :, None].to(x.dtype)
    scaled = x * inv if shift is None else torch.addcmul(-shift * inv, x, inv)
    return scaled.to(E4M3)


def _centred(x: torch.Tensor, smooth: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(x's mean over tokens as (B, 1, H, D) in x's dtype, or None; the (B, H) amax of x minus it): one read for the
    mean, one for the channels' extremes (the amax of x - m is max(max - m, m - min) per channel)."""
    if not smooth:
        return None, _amax(x, (1, 3))
    low, high = torch.aminmax(x, dim=1, keepdim=True)
    mean = x.mean(dim=1, keepdim=True, dtype=torch.float32).to(x.dtype)
    return mean, torch.maximum(high - mean, mean - low).amax(dim=(1, 3))


def quantise(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, smooth_k: bool = True, smooth_v: bool = True
             ) -> Fp8Inputs:
    """(B, L, H, D) query, key and value (float16/bfloat16/float32; key/value may have fewer heads) -> FA3's FP8
    inputs, with per-head scales computed on their device."""
    heads_kv = k.shape[2]
    q_descale = _scale(_amax(_groups(q, heads_kv), (1, 3, 4)))
    k_mean, k_amax = _centred(k, smooth_k)
    v_mean, v_amax = _centred(v, smooth_v)
    k_descale, v_descale = _scale(k_amax), _scale(v_amax)
    q8 = (_groups(q, heads_kv) * (1.0 / q_descale)[:, None, :, None, None].to(q.dtype)).to(E4M3).flatten(2, 3)
    return Fp8Inputs(q8, _cast(k, k_descale, k_mean), _cast(v, v_descale, v_mean), q_descale, k_descale, v_descale,
                     None if k_mean is None else k_mean[:, 0].float(), v_mean)


def dequantise(x8: torch.Tensor, descale: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    """The values an e4m3 tensor (B, L, H, D) stands for, with `descale` per (B, Hk) (query heads in groups)."""
    heads_kv = descale.shape[1]
    return (_groups(x8.to(dtype), heads_kv) * descale.to(dtype)[:, None, :, None, None]).flatten(2, 3)


def restore(out: torch.Tensor, prepared: Fp8Inputs) -> torch.Tensor:
    """The kernel's output (B, L, H, Dv) with v's mean added back, in place (one pass)."""
    if prepared.v_mean is not None:
        _groups(out, prepared.v_mean.shape[2]).add_(prepared.v_mean.to(out.dtype).unsqueeze(3))
    return out


def lse_shift(q: torch.Tensor, prepared: Fp8Inputs, scale: float) -> torch.Tensor | None:
    """(B, L, H) float32 to add to the kernel's log-sum-exp (of the scores against the smoothed keys) to get the
    log-sum-exp of the caller's scores: scale * q.k_mean."""
    if prepared.k_mean is None:
        return None
    shift = torch.einsum("blkgd,bkd->blkg", _groups(q.float(), prepared.k_mean.shape[1]), prepared.k_mean)
    return shift.flatten(2) * scale


def round_p(p: torch.Tensor) -> torch.Tensor:
    """P (each row's largest 1) rounded as FA3's FP8 path rounds it: e4m3 of 256 p, over 256."""
    return (p * P_OFFSET).to(E4M3).to(p.dtype) / P_OFFSET


def fa3_fp8_forward(q, k, v, softmax_scale=None, causal=False, *, q_descale, k_descale, v_descale,
                    return_attn_probs=False, round_probabilities=True):
    """FlashAttention-3's FP8 `flash_attn_func` emulated in float64 on any device (see the module's docstring): e4m3
    (B, L, H, D) inputs and (B, Hk) descales in, bfloat16 (B, L, H, Dv) out (and the float32 (B, H, L) log-sum-exp
    with return_attn_probs), causal aligned bottom-right as FA3 aligns it. Memory: the (B, H, Lq, Lk) scores."""
    qd, kd, vd = (dequantise(x, s) for x, s in ((q, q_descale), (k, k_descale), (v, v_descale)))
    group = q.shape[2] // k.shape[2]
    kd, vd = (x.repeat_interleave(group, dim=2) for x in (kd, vd))
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    scores = torch.einsum("blhd,bmhd->bhlm", qd, kd) * scale
    if causal:
        lq, lk = scores.shape[-2:]
        allowed = torch.arange(lk, device=q.device)[None] <= torch.arange(lq, device=q.device)[:, None] + (lk - lq)
        scores = scores.masked_fill(~allowed, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    p = torch.exp(scores - top)
    total = p.sum(dim=-1, keepdim=True)
    out = torch.einsum("bhlm,bmhd->blhd", (round_p(p) if round_probabilities else p) / total, vd).to(torch.bfloat16)
    if not return_attn_probs:
        return out
    return out, (top + total.log()).squeeze(-1).float()

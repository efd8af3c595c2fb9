"""FP8 (e4m3) attention inputs for FlashAttention-3's FP8 forward, and that forward emulated on any device.

`quantise(q, k, v)` gives what FA3's `flash_attn_func` takes in FP8 (float8_e4m3fn q/k/v of the caller's (B, L, H, D)
shape and one float32 descale per batch and key/value head), and what its bfloat16 output needs afterwards
(`restore`, `lse_shift`). On a CUDA GPU with Triton it runs fused (`quantise_kernel`: three launches per tensor, which
is read twice and written once in e4m3); elsewhere `reference` computes the same numbers in torch ops (float64 on
the CPU: the reference the kernel is tested against).

- Scales per head, the finest FA3 takes: its sm_90 kernel reads one float per (batch, key/value head),
  `q_descale[b * stride0 + h_kv * stride1]` (hopper/mainloop_fwd_sm90_tma_gmma_ws.hpp; `CHECK_SHAPE(q_descale,
  batch_size, num_heads_k)` in flash_api.cpp; fa3-fwd 0.0.3 is built from that source), and multiplies the
  softmax scale by q_descale * k_descale once per tile of scores and the output by v_descale once per row.
  Per-token (or per-block) scales for Q and K would need the kernel to take q_descale as (B, H, Lq) and k_descale
  as (B, Hk, Lk) and multiply each tile of float32 scores by its rows' and columns' factors before the softmax's
  maximum (per block: the same, one factor per tile, but tied to tile sizes the kernel picks per head dim). None is
  expressible through one descale: a per-token Q scale multiplies a row of scores (a temperature, not a shift), a
  per-token K scale a column. What is exact through it: shifting K (below), shifting V and scaling V per channel
  (undone on the output after), and any per-channel scaling c of Q and 1/c of K (q.k unchanged).
  They would buy little on e4m3 anyway: it is floating point (3 mantissa bits, normal over 2^-6..448), so every
  value keeps about 2^-4 relative precision whatever its size within 2^15 of its head's largest; finer scales help
  only values further below it. Emulated on noise, local and outlier inputs: per block of 128 tokens or per token,
  the error moves by less than 2% of itself (bench/fp8_schemes.py, bench/results/2026-12-06-cpu-fp8-schemes.json).
- K smoothed: its mean over tokens is subtracted. q.(k_j - m) = q.k_j - q.m shifts each query's scores by one
  constant, which softmax ignores (the output is unchanged; the log-sum-exp moves by scale * q.m: `lse_shift`). What
  it removes is a shared offset that would otherwise take the e4m3 precision: an offset of 20 rounds to +-1.25,
  the size of the whole signal.
- V smoothed where it has an offset: a channel's mean over tokens, where it exceeds 1/16 of the channel's range,
  is subtracted and added back to the output (softmax rows sum to 1, so P.(V - m) + m = P.V). e4m3 then rounds what
  varies between tokens, not the offset: with offsets of 3 standard deviations the part of the output that varies
  between queries comes out 1.06 times as far off as exact attention's own bfloat16 output makes it, against 1.28
  times with the offsets left in (tests/test_fp8.py). A zero-mean channel is left alone: its sample mean is noise,
  and subtracting it shifts the bfloat16 values off zero, where the rounding errors of the +x and -x that one
  bfloat16 value takes no longer cancel; their sum over the tokens then comes through every query's output when
  attention is spread wide (5.64e-2 against 5.39e-2 on noise at 32760 tokens, emulated).

What no scale reaches: FA3's FP8 forward rounds Q, K, P and V to e4m3. With N(0,1) inputs the rounding of Q and K
alone costs 3.9e-2, that of P and V alone 3.7e-2, 5.3e-2 to 5.4e-2 together (emulated at Flux's and Wan's shapes);
SageAttention 2's INT8 Q.K with per-block scales rounds several times more finely than e4m3, so its error is about
P and V's alone (3.9e-2 emulated with its granularity; 3.5e-2 to 3.9e-2 measured, bench/results). Only a kernel that
takes Q and K in another format (INT8 with per-block scales, or bf16) beside FP8 P.V would reach it.

`fa3_fp8_forward` is FA3's FP8 forward (its `flash_attn_func` contract) computed in float64 from these e4m3 inputs,
with P rounded to e4m3 as the kernel rounds it (at 2^8 times its value relative to the row's maximum: FA3's `Max_offset` 8 for FP8, so P's largest
lands on 256, within e4m3's range) and the row sums taken before that rounding. It does not model the online
softmax's running maximum (the kernel scales P by the maximum so far, which only moves values up the e4m3 grid): the
CPU reference the quantisation is tested against, and the bench's expectation for the GPU kernel.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import quantise_kernel
from .log import logger

E4M3 = torch.float8_e4m3fn
E4M3_MAX = quantise_kernel.E4M3_MAX
P_OFFSET = 256.0  # FA3 computes P as exp2(s - max + 8) for FP8: P's largest is 2^8
_TINY = quantise_kernel.TINY  # the descale of an all-zero head: its values stay 0

# Why the fused kernel no longer quantises in this process ("" while it does): a triton that imports but cannot
# build or launch it here must not fail the call; the torch path gives the same numbers.
broken = ""


class Fp8Inputs(NamedTuple):
    """FA3's FP8 inputs (e4m3, the caller's (B, L, H, D) shape, contiguous) and what its output needs after."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_descale: torch.Tensor  # float32 (B, Hk): value = e4m3 value * descale
    k_descale: torch.Tensor
    v_descale: torch.Tensor
    k_mean: torch.Tensor | None  # float32 (B, Hk, D): subtracted from k (the LSE moves by scale * q.k_mean)
    v_mean: torch.Tensor | None  # float32 (B, 1, Hk, Dv): V's offsets (0 in other channels), added back after


def _groups(q: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """q as (B, L, Hk, G, D): the G query heads that share key/value head j are heads j*G..j*G+G-1 (FA3's order)."""
    return q.unflatten(2, (heads_kv, q.shape[2] // heads_kv))


def reference_one(x: torch.Tensor, heads_kv: int, smooth: str, compute=torch.float64
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`quantise_kernel.quantise_one` in torch ops, in `compute` precision: (e4m3 (B, L, H, D), float32 descale
    (B, Hk), float32 shift (B, Hk, D) or None; `smooth`: "none", "mean" or "offsets"). The shift and the descale
    are rounded to float32 before they are used (the kernel computes with, and hands back, those float32s), so
    e4m3 value * descale + shift is what the caller reconstructs. torch rounds the float64 quotient to float32 and
    that to e4m3 (ties to even): the kernel's correctly rounded float32 division and rounding give the same e4m3."""
    mode = quantise_kernel.SMOOTHING[smooth]
    grouped = _groups(x, heads_kv)  # (B, L, Hk, G, D)
    low, high = torch.aminmax(grouped, dim=1, keepdim=True)
    low, high = low.to(compute), high.to(compute)
    shift = grouped.mean(dim=1, keepdim=True, dtype=compute) if mode else None  # (B, 1, Hk, G, D)
    if mode == quantise_kernel.SMOOTHING["offsets"]:
        shift = torch.where(shift.abs() * quantise_kernel.OFFSET_SHARE > high - low, shift, 0.0)
    if shift is not None:  # the float32 shift handed back (and added back / put in the LSE) is the one subtracted
        shift = shift.float().to(compute)
        low, high = low - shift, high - shift
    descale = (torch.maximum(high, -low).amax(dim=(1, 3, 4)) / E4M3_MAX).clamp_min(_TINY).float()  # (B, Hk)
    centred = grouped.to(compute) if shift is None else grouped.to(compute) - shift
    x8 = (centred / descale.to(compute)[:, None, :, None, None]).to(E4M3).flatten(2, 3)
    return x8, descale, None if shift is None else shift[:, 0, :, 0].float()


def _smoothing(smooth_k: bool, smooth_v: bool) -> tuple[str, str, str]:
    """What is subtracted from q, k and v per channel (quantise_kernel.SMOOTHING's keys)."""
    return ("none", "mean" if smooth_k else "none", "offsets" if smooth_v else "none")


def reference(q, k, v, *, smooth_k: bool = True, smooth_v: bool = True, compute=torch.float64) -> Fp8Inputs:
    """What `quantise` gives, computed in torch ops (several passes per tensor)."""
    return _assemble(*(reference_one(x, k.shape[2], smooth, compute)
                       for x, smooth in zip((q, k, v), _smoothing(smooth_k, smooth_v))))


def _assemble(q_part, k_part, v_part) -> Fp8Inputs:
    v_mean = v_part[2]
    return Fp8Inputs(q_part[0], k_part[0], v_part[0], q_part[1], k_part[1], v_part[1], k_part[2],
                     None if v_mean is None else v_mean[:, None])


def quantise(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, smooth_k: bool = True, smooth_v: bool = True
             ) -> Fp8Inputs:
    """(B, L, H, D) query, key and value (float16/bfloat16/float32; key/value may have fewer heads) -> FA3's FP8
    inputs, with per-head scales computed on their device: fused where Triton runs, else in torch ops (float32 on
    a GPU, float64 on the CPU)."""
    global broken
    heads_kv = k.shape[2]
    # inside torch.compile the torch ops trace and fuse; a kernel launch would be traced too, its fallback would not
    if not broken and not torch.compiler.is_compiling() and quantise_kernel.usable(q, k, v):
        try:
            return _assemble(*(quantise_kernel.quantise_one(x, heads_kv, smooth)
                               for x, smooth in zip((q, k, v), _smoothing(smooth_k, smooth_v))))
        except Exception as exc:  # noqa: BLE001 (whatever stops the kernel, the torch path quantises the call)
            broken = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
            logger.warning("the fused FP8 quantisation kernel failed (%s); FP8 inputs are quantised in torch ops "
                           "for the rest of the process", broken)
    compute = torch.float32 if q.is_cuda else torch.float64
    return reference(q, k, v, smooth_k=smooth_k, smooth_v=smooth_v, compute=compute)


def dequantise(x8: torch.Tensor, descale: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    """The values an e4m3 tensor (B, L, H, D) stands for, with `descale` per (B, Hk) (query heads in groups)."""
    heads_kv = descale.shape[1]
    return (_groups(x8.to(dtype), heads_kv) * descale.to(dtype)[:, None, :, None, None]).flatten(2, 3)


def restore(out: torch.Tensor, prepared: Fp8Inputs) -> torch.Tensor:
    """The kernel's output (B, L, H, Dv) with v's mean added back, in place (one pass)."""
    if prepared.v_mean is not None:  # added in float32, rounded once to the output's dtype
        _groups(out, prepared.v_mean.shape[2]).add_(prepared.v_mean.unsqueeze(3))
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

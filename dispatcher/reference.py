"""Exact attention in float64 and the error measure: the one reference every accuracy check of the pack uses
(`auto`'s verdicts, the bench, the ComfyUI compare node, and the tests that measure the quality guard's own check,
guard_check.py, which computes exact attention in float32 on the call's device without float64 copies)."""

from __future__ import annotations

import math

import torch

from . import masks


def to_bhsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t if layout == "BHSD" else t.transpose(1, 2)


def sample_rows(len_q: int, rows: int | None) -> torch.Tensor | None:
    """Evenly spaced query rows (first and last included), or None for all of them."""
    if rows is None or rows >= len_q:
        return None
    return torch.linspace(0, len_q - 1, rows).round().long().unique()


def exact_attention(query, key, value, attn_mask=None, is_causal=False, scale=None, layout="BSHD", rows=None,
                    max_bytes: int = 256 << 20, with_lse: bool = True):
    """Exact attention in float64 for query rows `rows` (an index tensor or a slice, None = all): (out, lse), lse
    None with with_lse=False (one softmax instead of logsumexp and exp: fewer host ops).

    out is (B, H, R, Dv) and lse (B, H, R), float64, from the caller's (possibly low-precision) inputs,
    so a comparison measures the kernel's error only. Grouped-query heads are expanded, causal is
    SDPA's top-left diagonal, the mask follows ComfyUI's rank rule. Heads are processed in chunks so the
    float64 scores stay under `max_bytes`.
    """
    q, k, v = to_bhsd(query, layout), to_bhsd(key, layout), to_bhsd(value, layout)
    b, h, lq, d = q.shape
    hk, lk, dv = k.shape[1], k.shape[2], v.shape[-1]
    groups = h // hk
    rows = slice(None) if rows is None else rows if isinstance(rows, slice) else rows.to(q.device)
    n_rows = len(range(lq)[rows]) if isinstance(rows, slice) else len(rows)
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    mask4 = None
    if attn_mask is not None:
        mask4 = masks.to_4d(attn_mask).expand(b, h, lq, lk)
    per_head = b * n_rows * lk * 8 * 3 + b * lk * (d + dv) * 8
    chunk = max(1, min(h, int(max_bytes // max(per_head, 1))))
    outs, lses = [], []
    for h0 in range(0, h, chunk):
        if chunk == h and groups == 1:  # all heads at once: no gathers
            heads = slice(None)
            qh, kh, vh = _float64(q[:, :, rows]), _float64(k), _float64(v)
        else:
            heads = torch.arange(h0, min(h, h0 + chunk), device=q.device)
            qh = q[:, heads][:, :, rows].double()
            kh, vh = k[:, heads // groups].double(), v[:, heads // groups].double()
        scores = torch.matmul(qh, kh.transpose(-2, -1)).mul_(scale)
        if is_causal:
            positions = torch.arange(lq, device=q.device)[rows]
            keep = torch.arange(lk, device=q.device)[None, :] <= positions[:, None]
            scores = scores.masked_fill(~keep, float("-inf"))
        if mask4 is not None:
            m = mask4[:, heads][:, :, rows]
            scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m.double()
        if with_lse:
            lse = torch.logsumexp(scores, dim=-1)
            outs.append(torch.matmul(torch.exp(scores - lse[..., None]), vh))
            lses.append(lse)
        else:
            outs.append(torch.matmul(torch.softmax(scores, dim=-1), vh))
    lse = (lses[0] if len(lses) == 1 else torch.cat(lses, dim=1)) if with_lse else None
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), lse


def _float64(t: torch.Tensor) -> torch.Tensor:
    """A float64 copy laid out contiguously as (B, H, L, D): the matmuls then need no copy of their own."""
    return t.to(torch.float64, memory_format=torch.contiguous_format)


def error_terms(out_rows: torch.Tensor, ref_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(‖out − ref‖, ‖ref‖) (Frobenius) as float64 scalars on the tensors' device: the relative error, the measure
    every accuracy check of the pack uses, is their ratio (a caller that reads other figures too reads them all
    with one sync and divides on the host)."""
    return torch.dist(out_rows, ref_rows), ref_rows.norm()


def relative_error_tensor(out_rows: torch.Tensor, ref_rows: torch.Tensor) -> torch.Tensor:
    """‖out − ref‖ / ‖ref‖ as a float64 scalar on the tensors' device."""
    distance, size = error_terms(out_rows, ref_rows)
    return distance / size.clamp_min(1e-30)


def relative_error(out_rows: torch.Tensor, ref_rows: torch.Tensor) -> float:
    return float(relative_error_tensor(out_rows, ref_rows))


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__


def non_finite(t: torch.Tensor) -> int:
    return int((~torch.isfinite(t)).sum())

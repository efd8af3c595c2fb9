"""A cheap description of one attention call: what a backend needs to know to say yes or no.

Built from shapes, dtypes and flags only (no values are read, no device sync), so it can key the
per-signature decision cache on the hot path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .machine import device_kind
from .masks import mask_kind

LAYOUTS = ("BSHD", "BHSD")


@dataclass(frozen=True)
class AttentionInputs:
    batch: int
    heads_q: int
    heads_kv: int
    len_q: int
    len_kv: int
    head_dim: int
    head_dim_v: int
    dtype: torch.dtype
    device: torch.device
    mask_kind: str  # none | bool | key_padding | additive | blockmask | integer
    mask_shape: tuple[int, ...] | None
    is_causal: bool
    dropout: bool
    custom_scale: bool
    enable_gqa: bool
    return_lse: bool
    requires_grad: bool
    key_dtype: torch.dtype | None = None
    value_dtype: torch.dtype | None = None
    key_device: torch.device | None = None
    value_device: torch.device | None = None

    @property
    def device_kind(self) -> str:
        return device_kind(self.device)

    @property
    def is_gqa(self) -> bool:
        return self.heads_kv != self.heads_q

    def describe(self) -> str:
        mask = "None" if self.mask_shape is None else f"{self.mask_kind} {tuple(self.mask_shape)}"
        return (f"q (B={self.batch}, Lq={self.len_q}, H={self.heads_q}, D={self.head_dim}), "
                f"k/v (Lk={self.len_kv}, H={self.heads_kv}, Dv={self.head_dim_v}), {str(self.dtype).replace('torch.', '')} "
                f"on {self.device}, mask {mask}, causal={self.is_causal}, dropout={self.dropout}, "
                f"scale={'custom' if self.custom_scale else 'default'}, gqa={self.enable_gqa}, lse={self.return_lse}")


def split_dims(t: torch.Tensor, layout: str) -> tuple[int, int, int, int]:
    """(B, S, H, D) of a 4-D tensor in `layout`."""
    if t.dim() != 4:
        raise ValueError(f"attention inputs must be 4-D in layout {layout}; got a tensor of shape {tuple(t.shape)}. "
                         "Pass (B, S, H, D) with layout='BSHD' or (B, H, S, D) with layout='BHSD'.")
    if layout == "BSHD":
        b, s, h, d = t.shape
    elif layout == "BHSD":
        b, h, s, d = t.shape
    else:
        raise ValueError(f"unknown layout {layout!r}; valid layouts: {', '.join(LAYOUTS)}")
    return b, s, h, d


def describe_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, layout) -> AttentionInputs:
    b, lq, hq, d = split_dims(query, layout)
    _, lk, hk, _ = split_dims(key, layout)
    _, _, _, dv = split_dims(value, layout)
    kind = mask_kind(attn_mask)
    return AttentionInputs(
        batch=b, heads_q=hq, heads_kv=hk, len_q=lq, len_kv=lk, head_dim=d, head_dim_v=dv,
        dtype=query.dtype, device=query.device, mask_kind=kind,
        mask_shape=None if attn_mask is None else tuple(getattr(attn_mask, "shape", ())),
        is_causal=bool(is_causal), dropout=bool(dropout_p and dropout_p > 0), custom_scale=scale is not None,
        enable_gqa=bool(enable_gqa), return_lse=bool(return_lse),
        requires_grad=torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad),
        key_dtype=key.dtype, value_dtype=value.dtype, key_device=key.device, value_device=value.device,
    )

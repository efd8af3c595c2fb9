"""A cheap description of one attention call: what a backend needs to know to say yes or no.

Built from shapes, dtypes and flags only (no values are read, no device sync), so it can key the
per-signature decision cache on the hot path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

import torch

from .machine import device_kind
from .masks import mask_kind

LAYOUTS = ("BSHD", "BHSD")
DEFAULT_CALL_SITE = "attention"  # the site of a caller that names no block (several blocks may share it)


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
    batch_kv: int | None = None  # the key/value batch: 1 broadcasts over the query's batch, as SDPA does

    @classmethod
    def of(cls, batch: int, heads_q: int, len_q: int, head_dim: int, *, len_kv: int | None = None,
           heads_kv: int | None = None, head_dim_v: int | None = None, dtype="bfloat16", device="cuda",
           mask_kind: str = "none", mask_shape=None, is_causal: bool = False, enable_gqa: bool | None = None,
           custom_scale: bool = False, dropout: bool = False, return_lse: bool = False,
           requires_grad: bool = False) -> "AttentionInputs":
        """A signature written by hand (the tuner's API, tests): lengths, heads and dims default to the query's,
        dtype may be a name ("bfloat16"), enable_gqa follows the head counts."""
        dtype = _DTYPES[dtype] if isinstance(dtype, str) else dtype
        device = normal_device(device)
        heads_kv = heads_q if heads_kv is None else heads_kv
        return cls(batch=batch, heads_q=heads_q, heads_kv=heads_kv, len_q=len_q,
                   len_kv=len_q if len_kv is None else len_kv, head_dim=head_dim,
                   head_dim_v=head_dim if head_dim_v is None else head_dim_v, dtype=dtype, device=device,
                   mask_kind=mask_kind, mask_shape=None if mask_shape is None else tuple(int(s) for s in mask_shape),
                   is_causal=is_causal, dropout=dropout, custom_scale=custom_scale,
                   enable_gqa=heads_kv != heads_q if enable_gqa is None else enable_gqa, return_lse=return_lse,
                   requires_grad=requires_grad, key_dtype=dtype, value_dtype=dtype, key_device=device,
                   value_device=device, batch_kv=batch)

    def as_dict(self) -> dict:
        """Plain data (JSON): the signature's own fields, dtypes and devices as text."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self) if f.name not in _PER_TENSOR}

    def key(self) -> str:
        """Stable text for the disk cache."""
        return json.dumps(self.as_dict(), sort_keys=True, separators=(",", ":"))

    @property
    def flops(self) -> int:
        """4·B·H·Lq·Lk·D (QKᵀ and PV, multiply-add = 2)."""
        return 2 * self.batch * self.heads_q * self.len_q * self.len_kv * (self.head_dim + self.head_dim_v)

    @property
    def device_kind(self) -> str:
        return device_kind(self.device)

    @property
    def empty(self) -> bool:
        """A batch, head count or length of 0: nothing to attend over or nothing asks (SDPA's result: decisions.EMPTY)."""
        return not (self.batch and self.heads_q and self.len_q and self.len_kv)

    @property
    def is_gqa(self) -> bool:
        return self.heads_kv != self.heads_q

    def describe(self) -> str:
        mask = "None" if self.mask_shape is None else f"{self.mask_kind} {tuple(self.mask_shape)}"
        return (f"q (B={self.batch}, Lq={self.len_q}, H={self.heads_q}, D={self.head_dim}), "
                f"k/v (Lk={self.len_kv}, H={self.heads_kv}, Dv={self.head_dim_v}), {str(self.dtype).replace('torch.', '')} "
                f"on {self.device}, mask {mask}, causal={self.is_causal}, dropout={self.dropout}, "
                f"scale={'custom' if self.custom_scale else 'default'}, gqa={self.enable_gqa}, lse={self.return_lse}")


_DTYPES = {str(d).replace("torch.", ""): d for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}
_PER_TENSOR = ("key_dtype", "value_dtype", "key_device", "value_device")  # equal to the query's in valid calls


def normal_device(device) -> torch.device:
    """'cuda' and 'cuda:0' are one device: one signature."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return device


def _plain(value):
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value).replace("torch.", "")
    return list(value) if isinstance(value, tuple) else value


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
    bk, lk, hk, _ = split_dims(key, layout)
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
        batch_kv=bk,
    )

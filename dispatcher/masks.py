"""Every attention-mask convention in one place.

Canonical form inside the dispatcher: a tensor broadcastable to (B, H, Lq, Lk), either bool
(True = attend) or an additive float bias (0 = keep, -inf / -max = drop). Rank rule (ComfyUI's):
2-D is (Lq, Lk), 3-D is (B, Lq, Lk), 4-D is (B, H, Lq, Lk); any size-1 axis broadcasts.
Backends ask for the form they take: additive, bool, FlexAttention `BlockMask`/`score_mod`,
or varlen key lengths.
"""

from __future__ import annotations

import torch


def mask_kind(mask) -> str:
    if mask is None:
        return "none"
    if type(mask).__name__ == "BlockMask":
        return "blockmask"
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor, a FlexAttention BlockMask or None; got {type(mask).__name__}")
    if mask.dtype == torch.bool:
        if mask.dim() >= 2 and mask.shape[-2] == 1 and all(s == 1 for s in mask.shape[1:-2]):
            return "key_padding"
        return "bool"
    if mask.is_floating_point():
        return "additive"
    return "integer"


def to_4d(mask: torch.Tensor) -> torch.Tensor:
    """A view of `mask` with exactly four axes, by ComfyUI's rank rule."""
    if mask.dim() == 2:
        return mask[None, None]
    if mask.dim() == 3:
        return mask[:, None]
    if mask.dim() == 4:
        return mask
    raise ValueError(f"attn_mask must have 2 to 4 dimensions ((Lq, Lk), (B, Lq, Lk) or (B, H, Lq, Lk)); "
                     f"got shape {tuple(mask.shape)}")


def broadcast_problem(mask_shape: tuple[int, ...], batch: int, heads: int, len_q: int, len_kv: int) -> str | None:
    """Why a mask of this shape cannot broadcast to (B, H, Lq, Lk), or None."""
    if not 2 <= len(mask_shape) <= 4:
        return f"attn_mask has {len(mask_shape)} dimensions; expected 2 to 4"
    shape = (1,) * (4 - len(mask_shape)) + tuple(mask_shape)
    if len(mask_shape) == 3:
        shape = (mask_shape[0], 1, mask_shape[1], mask_shape[2])
    for axis, have, want in zip("BHQK", shape, (batch, heads, len_q, len_kv)):
        if have not in (1, want):
            name = {"B": "batch", "H": "heads", "Q": "query length", "K": "key length"}[axis]
            return (f"attn_mask of shape {tuple(mask_shape)} does not broadcast to (B, H, Lq, Lk) = "
                    f"({batch}, {heads}, {len_q}, {len_kv}): its {name} axis is {have}, expected 1 or {want}")
    return None


def to_additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if mask.dtype == torch.bool:
        bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        return bias.masked_fill_(~mask, float("-inf"))
    return mask if mask.dtype == dtype else mask.to(dtype)


# Mask formats a backend can ask for; each converter gets the canonical 4-D view (or a BlockMask)
# and the dtype of the query, and returns what the kernel takes.
def _native(mask, dtype):
    # SDPA takes a bool mask or an additive one of the query's dtype: an additive mask of another float
    # dtype (float32 with half inputs, or with attn_precision's float32 upcast) is cast, not rejected.
    return mask if mask.dtype == torch.bool or mask.dtype == dtype else mask.to(dtype)


def _bool(mask, dtype):
    if mask.dtype != torch.bool:
        raise TypeError("a bool mask format was asked for an additive mask; declare masks={'bool', 'key_padding'} only")
    return mask


def _key_padding(mask, dtype):
    return _bool(mask, dtype)[:, 0, 0, :]  # (B|1, Lk)


_FORMATS = {"native": _native, "additive": lambda m, dtype: to_additive(m, dtype), "bool": _bool,
            "key_padding": _key_padding}


def mask_formats() -> list[str]:
    return list(_FORMATS)


def register_mask_format(name: str, converter) -> None:
    """Add a mask format (like transformers' AttentionMaskInterface.register): converter(mask_4d, dtype)."""
    if name in _FORMATS:
        raise ValueError(f"mask format {name!r} already exists")
    _FORMATS[name] = converter


def convert(mask, fmt: str, dtype: torch.dtype):
    if mask is None or type(mask).__name__ == "BlockMask":
        return mask
    return _FORMATS[fmt](to_4d(mask), dtype)

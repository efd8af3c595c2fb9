"""Every attention-mask convention in one place.

Canonical form inside the dispatcher: a tensor broadcastable to (B, H, Lq, Lk), either bool
(True = attend) or an additive float bias (0 = keep, -inf / -max = drop). Shapes are read as SDPA reads
them, right-aligned: 2-D is (Lq, Lk), 3-D is (H, Lq, Lk), 4-D is (B, H, Lq, Lk); any size-1 axis broadcasts.
One reading more, diffusers' (its `native` backend's): a 2-D (B, Lk) mask is key padding (`sdpa_view` makes it
a (B, 1, 1, Lk) view at the entry), unless B == Lq, where the two readings differ and the mask is refused with
the reshape to use (`key_padding_hint`). ComfyUI's own rule (3-D = (B, Lq, Lk)) is converted by its adapter
(nodes/adapter.py) before it calls the library.
An additive mask keeps its float32 precision wherever the kernel adds it in float32 ("native" on the CPU,
"precise"): it is cast to a half query dtype only for kernels that demand it.
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
        # one row of keys, the same for every head: (B|1, 1, 1, Lk), (1, 1, Lk) or (1, Lk)
        if mask.dim() >= 2 and mask.shape[-2] == 1 and all(s == 1 for s in mask.shape[-3:-2]):
            return "key_padding"
        return "bool"
    if mask.is_floating_point():
        return "additive"
    return "integer"


def to_4d(mask: torch.Tensor) -> torch.Tensor:
    """A view of `mask` with exactly four axes, right-aligned as SDPA broadcasts it."""
    if mask.dim() == 4:
        return mask
    if mask.dim() == 3:
        return mask[None]
    if mask.dim() == 2:
        return mask[None, None]
    raise ValueError(f"attn_mask must have 2 to 4 dimensions ((Lq, Lk), (H, Lq, Lk) or (B, H, Lq, Lk)); "
                     f"got shape {tuple(mask.shape)}")


def sdpa_view(mask, query, key, layout: str):
    """The mask as the kernels take it: a 2-D (B, Lk) key-padding mask (diffusers' reading: first axis the
    query's batch B > 1, not its length Lq) as a (B, 1, 1, Lk) view; any other mask as given. Called at the entry,
    on every call with a mask, so it reads shapes only and leaves anything it cannot read to the checks."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return mask
    try:
        seq = 1 if layout == "BSHD" else 2
        batch, len_q, len_kv = query.shape[0], query.shape[seq], key.shape[seq]
    except (AttributeError, IndexError, TypeError):
        return mask  # not tensors of rank 4: the checks name the problem
    rows, keys = mask.shape
    if rows == batch and rows not in (1, len_q) and keys == len_kv:
        return mask[:, None, None, :]
    return mask


def key_padding_hint(mask_shape: tuple[int, ...], batch: int, len_q: int, len_kv: int) -> str | None:
    """Why a 2-D mask is refused when it reads both as (Lq, Lk), as SDPA reads it, and as (B, Lk) key padding, as
    diffusers' `native` reads it (B == Lq > 1: the two readings give different results), or None.

    A (B, Lk) mask with B != Lq is key padding without doubt (SDPA would fail to broadcast it): `sdpa_view` takes
    it so at the entry. The ambiguous one is refused with the fix: say which one is meant with a 4-D mask.
    """
    if len(mask_shape) != 2 or mask_shape[1] != len_kv or mask_shape[0] == 1 or mask_shape[0] != batch \
            or mask_shape[0] != len_q:
        return None
    return (f"attn_mask of shape {tuple(mask_shape)} is ambiguous: with B == Lq == {batch} it is either (Lq, Lk), "
            f"as SDPA reads a 2-D mask, or (B, Lk) key padding, as diffusers' native backend reads it, and the two "
            f"give different results; pass attn_mask[:, None, None, :] (shape ({batch}, 1, 1, {len_kv})) for key "
            f"padding per batch element, or attn_mask[None, None] (shape (1, 1, {len_q}, {len_kv})) for one "
            f"(Lq, Lk) mask")


def broadcast_problem(mask_shape: tuple[int, ...], batch: int, heads: int, len_q: int, len_kv: int) -> str | None:
    """Why a mask of this shape cannot broadcast to (B, H, Lq, Lk), or None."""
    if not 2 <= len(mask_shape) <= 4:
        return (f"attn_mask has {len(mask_shape)} dimensions; expected 2 to 4 ((Lq, Lk), (H, Lq, Lk) or "
                f"(B, H, Lq, Lk)){'; SDPA refuses a 1-D mask too' if len(mask_shape) == 1 else ''}")
    hint = key_padding_hint(tuple(mask_shape), batch, len_q, len_kv)
    if hint:
        return hint
    shape = (1,) * (4 - len(mask_shape)) + tuple(mask_shape)  # right-aligned, as SDPA broadcasts it
    for axis, have, want in zip("BHQK", shape, (batch, heads, len_q, len_kv)):
        if have not in (1, want):
            name = {"B": "batch", "H": "heads", "Q": "query length", "K": "key length"}[axis]
            why = (f"attn_mask of shape {tuple(mask_shape)} does not broadcast to (B, H, Lq, Lk) = "
                   f"({batch}, {heads}, {len_q}, {len_kv}): its {name} axis is {have}, expected 1 or {want}")
            if len(mask_shape) == 3 and mask_shape[0] == batch:
                why += (" (a 3-D mask is (H, Lq, Lk), as SDPA reads it; for a (B, Lq, Lk) mask pass "
                        "attn_mask[:, None])")
            return why
    return None


def to_additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if mask.dtype == torch.bool:
        bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        return bias.masked_fill_(~mask, float("-inf"))
    return mask if mask.dtype == dtype else mask.to(dtype)


def precise_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype an additive mask keeps for a kernel that adds it in float32 or wider: float32 for half and
    float32 inputs, float64 for float64 ones. Casting a float32 mask to bfloat16 first rounds every bias to
    8 bits of mantissa: with a bias of std 10 the result was ~5x less accurate than SDPA's on the same call."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# Mask formats a backend can ask for; each converter gets the canonical 4-D view (the "native" one, for SDPA, the
# mask as given) and the dtype of the query, and returns what the kernel takes.
def _native(mask, dtype):
    """For SDPA (public, or one of its kernels pinned). SDPA takes a bool mask, an additive mask of the
    query's dtype, or a float32 one with any query. On the CPU both of its kernels (flash and math) add a
    float32 mask in float32, so a float32 mask is kept there (any other float mask becomes float32 for half
    inputs). On GPUs its memory-efficient kernel refuses a bias of another dtype than the query's ("invalid
    dtype for bias - should match query's dtype"), so there the mask is cast to the query's dtype."""
    if mask.dtype == torch.bool or mask.dtype == dtype:
        return mask
    if mask.device.type == "cpu":
        target = precise_dtype(dtype)
        return mask if mask.dtype == target else mask.to(target)
    return mask.to(dtype)


def _precise(mask, dtype):
    """For kernels that add the mask to float32 (or float64) scores on every device (SDPA's math kernel, which
    upcasts half inputs; FlexAttention's score_mod): a bool mask as given, an additive one kept in float32
    (float64 for float64 inputs), never rounded to the query's half dtype first."""
    if mask.dtype == torch.bool:
        return mask
    target = precise_dtype(dtype)
    return mask if mask.dtype == target else mask.to(target)


def _bool(mask, dtype):
    if mask.dtype != torch.bool:
        raise TypeError("a bool mask format was asked for an additive mask; declare masks={'bool', 'key_padding'} only")
    return mask


def _key_padding(mask, dtype):
    return _bool(mask, dtype)[:, 0, 0, :]  # (B|1, Lk)


_FORMATS = {"native": _native, "precise": _precise, "additive": lambda m, dtype: to_additive(m, dtype), "bool": _bool,
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
    if fmt == "native":  # SDPA broadcasts any rank itself, as we read it: the mask as given (bit for bit SDPA's)
        return _native(mask, dtype)
    return _FORMATS[fmt](to_4d(mask), dtype)

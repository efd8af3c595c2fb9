"""Random attention inputs for the tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def qkv(b=2, lq=16, lk=None, h=2, d=32, *, dv=None, bk=None, hk=None, dtype=torch.float32, seed=0,
        flat=False, q=None, k=None, v=None):
    """(q, k, v) in BSHD: q (b, lq, h, d), k (bk or b, lk or lq, hk or h, d), v like k with head dim dv or d.

    Drawn in float32 from a generator seeded with `seed` (q, then k, then v), then cast to `dtype`, so one
    seed gives the same values in every dtype. `flat=True` merges the heads: (B, L, H*D), ComfyUI's layout.
    `q=`, `k=` or `v=` replaces that tensor (the others keep their values)."""
    gen = torch.Generator().manual_seed(seed)
    lk = lq if lk is None else lk
    drawn = (torch.randn(b, lq, h, d, generator=gen), torch.randn(bk or b, lk, hk or h, d, generator=gen),
             torch.randn(bk or b, lk, hk or h, dv or d, generator=gen))
    drawn = tuple(t.to(dtype) for t in drawn)
    if flat:
        drawn = tuple(t.flatten(2) for t in drawn)
    return tuple(drawn[i] if given is None else given for i, given in enumerate((q, k, v)))


def sdpa(q, k, v, **_):
    """Exact attention on (B, S, H, D) tensors, in and out: the reference kernel test backends wrap or break."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def causal_folded(mask, lq, lk):
    """attn_mask with is_causal=True as one explicit mask: `mask` (bool, True = attend, or additive) and SDPA's
    top-left diagonal (query i attends to keys 0..i). The reference for mask + causal on every torch: SDPA up to
    2.13 applied both so on the CPU, 2.14 and later refuse the pair; an explicit mask runs on all of them."""
    keep = torch.ones(lq, lk, dtype=torch.bool).tril()
    return mask & keep if mask.dtype == torch.bool else mask.masked_fill(~keep, float("-inf"))

"""xFormers memory_efficient_attention, probed with a real call: a build for another torch imports
fine and then fails every call ("No operator found"), so importing proves nothing."""

from __future__ import annotations

import torch

from ..registry import add
from ..requirements import OnDevice, Package, Probe
from ..spec import BackendSpec, HeadDims


def _probe():
    import xformers.ops as xops
    q = torch.randn(1, 8, 1, 64, device="cuda", dtype=torch.float16)
    xops.memory_efficient_attention(q, q, q)
    torch.cuda.synchronize()


def xformers_call(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse):
    import xformers.ops as xops

    b, lq, h, d = q.shape
    lk, hk = k.shape[1], k.shape[2]
    bias = None
    if is_causal:
        bias = xops.LowerTriangularMask()
    elif attn_mask is not None:
        # xFormers wants a bias whose last axis is 8-aligned in memory: pad, then slice back.
        padded = (lk + 7) // 8 * 8
        full = torch.zeros(b, h, lq, padded, dtype=q.dtype, device=q.device)
        full[..., :lk] = attn_mask
        bias = full[..., :lk]
    if hk != h:  # GQA as BMGHK: (B, S, G, H/G, D) with key/value expanded (a view) over the group axis
        groups = h // hk
        q = q.view(b, lq, hk, groups, d)
        k = k[:, :, :, None].expand(b, lk, hk, groups, d)
        v = v[:, :, :, None].expand(b, lk, hk, groups, v.shape[-1])
        if bias is not None and not isinstance(bias, xops.LowerTriangularMask):
            bias = bias.reshape(b, hk, groups, lq, lk)
    out = xops.memory_efficient_attention(q, k, v, attn_bias=bias, p=dropout_p, scale=scale)
    return out.reshape(b, lq, h, -1)


add(BackendSpec(
    name="xformers", family="xformers", description="xFormers memory_efficient_attention (CUDA)",
    fn=xformers_call, layout="BSHD", devices=frozenset({"cuda"}),
    dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}), head_dims=HeadDims(1, 256),
    masks=frozenset({"additive", "bool", "key_padding"}), mask_format="additive", gqa=True, dropout=True,
    requires=(Package("xformers", "0.0.29", module="xformers.ops"), OnDevice(frozenset({"cuda"})),
                             Probe("xformers", _probe))))

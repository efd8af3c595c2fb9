"""Run one backend on one call: the kernel's layout (views, never copies) and mask format, its keywords."""

from __future__ import annotations

from . import masks
from .call import AttentionCall, CallSite
from .decisions import Candidate


def run(candidate: Candidate, call: AttentionCall):
    """The backend's result in the call's layout: out, or (out, lse) with return_lse."""
    return run_tensors(candidate, call.query, call.key, call.value, call.attn_mask, call.site)


def run_tensors(candidate: Candidate, query, key, value, attn_mask, site: CallSite):
    """`run` on a call's parts: the eager path and a lane hold them apart already (no call to build per call)."""
    return_lse, transpose = site.return_lse, candidate.transpose
    if transpose:  # permute, not transpose(1, 2): the same view, ~0.15 us cheaper each on the CPU
        query, key, value = query.permute(0, 2, 1, 3), key.permute(0, 2, 1, 3), value.permute(0, 2, 1, 3)
    if candidate.convert_mask:
        attn_mask = masks.convert(attn_mask, candidate.spec.mask_format, query.dtype)
    attention_kwargs = site.attention_kwargs
    if attention_kwargs:
        result = candidate.runner(query, key, value, attn_mask, site.dropout_p, site.is_causal, site.scale,
                                  site.enable_gqa, return_lse, **attention_kwargs)
    else:  # by position: registry.prepare's protocol
        result = candidate.runner(query, key, value, attn_mask, site.dropout_p, site.is_causal, site.scale,
                                  site.enable_gqa, return_lse)
    if not transpose:
        return result
    if return_lse:
        out, lse = result
        return out.permute(0, 2, 1, 3), lse.transpose(1, 2)
    return result.permute(0, 2, 1, 3)

"""Run one backend on one call: the kernel's layout (views, never copies) and mask format, its keywords."""

from __future__ import annotations

from . import masks
from .call import AttentionCall
from .decisions import Candidate


def run(candidate: Candidate, call: AttentionCall):
    """The backend's result in the call's layout: out, or (out, lse) with return_lse."""
    # One unpacking, not nine attribute reads: this runs on every call. Its names are AttentionCall's fields, in
    # order (tests/test_call_fields.py checks every unpacking against the definition).
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, attention_kwargs, _, _, _, return_lse, \
        _, _, _, _, _ = call
    _, spec, runner, transpose, convert_mask, _ = candidate
    if transpose:  # permute, not transpose(1, 2): the same view, ~0.15 us cheaper each on the CPU
        query, key, value = query.permute(0, 2, 1, 3), key.permute(0, 2, 1, 3), value.permute(0, 2, 1, 3)
    if convert_mask:
        attn_mask = masks.convert(attn_mask, spec.mask_format, query.dtype)
    if attention_kwargs:
        result = runner(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                        **attention_kwargs)
    else:  # by position: registry.prepare's protocol
        result = runner(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse)
    if not transpose:
        return result
    if return_lse:
        out, lse = result
        return out.permute(0, 2, 1, 3), lse.transpose(1, 2)
    return result.permute(0, 2, 1, 3)

"""FlexAttention: masks become score/block masks, causal becomes a BlockMask (never dropped)."""

from __future__ import annotations

import functools
import warnings

import torch

from ..checks import broadcast_kv, declare
from ..registry import add
from ..requirements import TorchVersion
from ..spec import FLOATS, BackendSpec, HeadDims

# Eager flex (the CPU, and the tuner's first calls) makes torch print a 9-line "called without torch.compile()"
# warning the user can do nothing about: the pack compiles flex where that pays (GPUs) and chose eager elsewhere.
warnings.filterwarnings("ignore", message="flex_attention called without torch.compile", category=UserWarning)


def _index(bias: torch.Tensor):
    """An indexer into a broadcastable 4-D tensor that maps size-1 axes to 0.

    A literal 0, not a captured 0-dim tensor: under torch.compile with inductor on the CPU, a score_mod that
    indexes with a captured tensor fails to lower (NoValidChoicesError) for any mask with a size-1 axis."""
    pick = [(lambda i: i) if size > 1 else (lambda i: 0) for size in bias.shape]

    def at(b, h, q, kv):
        return bias[pick[0](b), pick[1](h), pick[2](q), pick[3](kv)]
    return at


def score_mod_for(mask: torch.Tensor):
    at = _index(mask)
    if mask.dtype == torch.bool:
        def keep_or_drop(score, b, h, q, kv):
            return torch.where(at(b, h, q, kv), score, -float("inf"))
        return keep_or_drop

    def add_bias(score, b, h, q, kv):
        # The bias stays float32 (mask format "precise"): eager flex hands half scores, and casting the bias to
        # them first rounded it to 8 bits (5x the error of SDPA with the same float32 mask).
        return score + at(b, h, q, kv)
    return add_bias


try:
    from torch.nn.attention.flex_attention import AuxRequest as _AuxRequest
except ImportError:
    _AuxRequest = None


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@functools.lru_cache(maxsize=64)
def causal_block_mask(len_q: int, len_kv: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask
    return create_block_mask(_causal, None, None, len_q, len_kv, device=device)


_compiled: dict[tuple, object] = {}


def _axis_order(t: torch.Tensor) -> tuple[int, ...]:
    """The tensor's axes from the largest stride to the smallest: its memory layout, whatever its sizes."""
    return tuple(sorted(range(t.dim()), key=lambda axis: -t.stride(axis)))


def compiled_flex(q, k, v, *, masked: bool, blocked: bool, enable_gqa: bool, lse: bool):
    """The compiled flex_attention for one static signature (head dims, dtype, device, memory layout of
    q/k/v, mask use, GQA, LSE).

    Dynamo keeps compiled entries, and its recompile limit (8), per code object; past the limit it silently
    runs flex unfused, which materialises the scores (48 and 160 GiB asked for at Wan's 32k tokens on the
    H200 after the bench's other models had used up the shared entries). So each signature compiles its
    own copy of a small wrapper, with its own entries; lengths, batch and heads become dynamic within it.
    The layout is part of the signature rather than copied away: on the H200 flex ran ComfyUI's strided
    views as fast as contiguous inputs, and the copies cost 14-16% at SDXL/Flux/Qwen sizes."""
    key = (q.shape[-1], v.shape[-1], q.dtype, q.device, _axis_order(q), _axis_order(k), _axis_order(v), masked,
           blocked, enable_gqa, lse)
    run = _compiled.get(key)
    if run is None:
        from torch.nn.attention.flex_attention import flex_attention

        def flex(q, k, v, score_mod, block_mask, scale, enable_gqa, **aux):
            return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                                  enable_gqa=enable_gqa, **aux)
        flex.__code__ = flex.__code__.replace(co_name=f"flex_attention_{len(_compiled)}")
        run = _compiled.setdefault(key, torch.compile(flex))
    return run


def flex_attention_backend(q, k, v, *, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse):
    from torch.nn.attention.flex_attention import flex_attention

    k, v = broadcast_kv(q, k, v, enable_gqa)  # flex wants equal batches and heads; SDPA broadcasts them
    block_mask, score_mod = None, None
    if type(attn_mask).__name__ == "BlockMask":
        block_mask = attn_mask
    elif attn_mask is not None:
        score_mod = score_mod_for(attn_mask)
    if is_causal:
        block_mask = causal_block_mask(q.shape[-2], k.shape[-2], str(q.device))
    # Flex is only fast compiled; eager on the CPU (compiling there costs tens of seconds per shape).
    if q.device.type == "cpu" or torch.compiler.is_dynamo_compiling():
        run = flex_attention
    else:
        run = compiled_flex(q, k, v, masked=score_mod is not None, blocked=block_mask is not None,
                            enable_gqa=enable_gqa, lse=return_lse)
    if not return_lse:
        return run(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)
    if _AuxRequest is not None:  # torch >= 2.9 deprecates return_lse for return_aux
        out, aux = run(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                       return_aux=_AuxRequest(lse=True))
        return out, aux.lse.float()
    out, lse = run(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                   return_lse=True)
    return out, lse.float()


add(BackendSpec(
    name="flex", family="flex", description="torch FlexAttention (compiled on GPUs): bool/additive/BlockMask masks",
    fn=declare(flex_attention_backend, broadcast_kv=True), layout="BHSD", devices=frozenset({"cpu", "cuda", "rocm", "xpu"}),
    dtypes=FLOATS, head_dims=HeadDims(8), masks=frozenset({"bool", "key_padding", "additive", "blockmask"}),
    mask_format="precise", gqa=True, lse=True, different_value_dim=True, requires=(TorchVersion("2.5"),)))

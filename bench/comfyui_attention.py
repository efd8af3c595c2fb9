"""ComfyUI's attention, for the benchmark: a rewrite of its default path and an import of its own function.

Everything that knows ComfyUI lives here (the top-level bench/ folder), outside the framework-agnostic
package; `bench/bench_comfyui.py` hands these to the package's benchmark as reference paths.
"""

from __future__ import annotations

import sys

import torch.nn.functional as F


def comfy_attention_pytorch(q, k, v, heads, mask=None):
    """ComfyUI's default attention path (`attention_pytorch`), written from the call contract.

    q (B, Lq, H·D), k/v (B, Lk, H·D) -> per-head views (B, H, L, D) -> SDPA -> (B, Lq, H·D).
    """
    b, _, inner = q.shape
    dim_head = inner // heads
    q, k, v = (t.view(b, -1, heads, dim_head).transpose(1, 2) for t in (q, k, v))
    if mask is not None:  # ComfyUI's rank rule
        if mask.ndim == 2:
            mask = mask.unsqueeze(0)
        if mask.ndim == 3:
            mask = mask.unsqueeze(1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)
    return out.transpose(1, 2).reshape(b, -1, heads * dim_head)


def load_comfyui_attention(path: str | None, log=print):
    """ComfyUI's own `attention_pytorch`, imported from a checkout at `path` (nothing of it is copied here)."""
    if not path:
        return None
    saved_argv, sys.argv = sys.argv, sys.argv[:1]  # ComfyUI's modules read their flags from sys.argv
    sys.path.insert(0, path)
    try:
        from comfy.ldm.modules.attention import attention_pytorch
        return attention_pytorch
    except Exception as exc:
        log(f"ComfyUI at {path} could not be imported ({type(exc).__name__}: {exc}); comparing with the "
            "rewritten default path only")
        return None
    finally:
        sys.argv = saved_argv

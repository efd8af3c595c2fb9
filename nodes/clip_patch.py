"""Per-CLIP attention: object patches on the text encoder's attention modules (no global monkeypatch).

ComfyUI's text encoders never pass transformer_options, so the model override cannot reach them.
Instead each attention module's `forward` receives the attention function as its
`optimized_attention` argument; we patch `forward` on one CLIP clone (ModelPatcher object patches
are applied while that clone is loaded and undone afterwards) to hand it our override instead.
"""

from __future__ import annotations

import inspect

import torch

TE_OPTIONS = {"block_type": "text_encoder"}


def _takes_attention(module: torch.nn.Module) -> bool:
    forward = getattr(type(module), "forward", None)
    try:
        return forward is not None and "optimized_attention" in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False


def attention_module_paths(root: torch.nn.Module) -> list[str]:
    """Dotted paths of the innermost modules that take `optimized_attention` (the attention layers
    themselves, not the blocks/stacks that pass it down, so nothing is wrapped twice)."""
    takers = [name for name, m in root.named_modules() if name and _takes_attention(m)]
    return [n for n in takers if not any(other.startswith(n + ".") for other in takers)]


def patched_forward(module: torch.nn.Module, override, index: int | None = None, total: int | None = None):
    """A forward for `module` that swaps the attention function it is given for `override`; index / total: the
    layer's place among the encoder's attention layers, which names its call site ("text_encoder.self #3": the
    encoder's calls carry no forward a count could restart at)."""
    original = type(module).forward
    signature = inspect.signature(original)
    options = TE_OPTIONS if index is None else {**TE_OPTIONS, "block_index": index, "total_blocks": total}

    def forward(*args, **kwargs):
        bound = signature.bind(module, *args, **kwargs)
        core = bound.arguments.get("optimized_attention")
        if core is not None:
            def attention(q, k, v, heads, mask=None, **kw):
                kw.setdefault("transformer_options", options)
                return override(core, q, k, v, heads, mask, **kw)
            bound.arguments["optimized_attention"] = attention
        return original(*bound.args, **bound.kwargs)

    return forward


def patch_clip(clip, override) -> list[str]:
    """Clone-local patches on `clip` (already a clone); returns the patched module paths."""
    root = clip.patcher.model
    modules = dict(root.named_modules())
    paths = attention_module_paths(root)
    for index, path in enumerate(paths):
        clip.patcher.add_object_patch(f"{path}.forward", patched_forward(modules[path], override, index, len(paths)))
    return paths

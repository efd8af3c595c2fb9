"""ComfyUI 0.38's attention names (its `register_attention_function` registry, `--use-*-attention` flags and the
Model Attention Backend node) as the Set Attention Backend nodes take them: the one place they are resolved.

Why: users of newer ComfyUI know its names (contract §1.7, §8): `sage`, `sage3`, `flash`, `xformers`, `pytorch`,
`sub_quad`, `split`, `comfy_kitchen_int8`. Where one of the pack's backends runs the same kernel the name is an
alias for it (accepted at queue time, not listed twice in the dropdown); where none does, queueing it fails with
what the name is and what to pick instead. No ComfyUI import: these are names only.
"""

from __future__ import annotations

# ComfyUI name -> (the pack's backend running the same kernel, what it is). None: the pack has no such backend.
COMFY_NAMES: dict[str, tuple[str | None, str]] = {
    "sage": ("sage", "SageAttention from the pip package sageattention (ComfyUI's attention_sage)"),
    "sage3": ("sage_blackwell_hub", "SageAttention 3 for Blackwell (ComfyUI's attention3_sage, pip sageattn3); the "
                                    "pack loads the same kernel from the Hub"),
    "flash": ("flash", "FlashAttention-2 from the pip package flash-attn (ComfyUI's attention_flash)"),
    "xformers": ("xformers", "xFormers memory_efficient_attention (ComfyUI's attention_xformers)"),
    "pytorch": ("native", "torch scaled_dot_product_attention (ComfyUI's attention_pytorch)"),
    "comfy_kitchen_int8": ("comfy_kitchen_int8", "comfy-kitchen's INT8 attention (ComfyUI's "
                                                 "attention_comfy_kitchen_int8, --use-ck-attention)"),
    "sub_quad": (None, "ComfyUI's own sub-quadratic chunked attention (attention_sub_quad, its default on CPU)"),
    "split": (None, "ComfyUI's own sliced attention (attention_split, --use-split-cross-attention)"),
}


def resolve(name):
    """The pack's backend for `name`: a ComfyUI alias becomes the backend it names; anything else is unchanged."""
    entry = COMFY_NAMES.get(name) if isinstance(name, str) else None
    return name if entry is None or entry[0] is None else entry[0]


def not_offered(name) -> str | None:
    """Why a ComfyUI name cannot be picked here (with what to pick instead), or None."""
    entry = COMFY_NAMES.get(name) if isinstance(name, str) else None
    if entry is None:
        return None
    ours, what = entry
    if ours is None:
        return (f"'{name}' is {what}: a ComfyUI function, not a kernel this pack runs. Pick 'comfy default' to keep "
                "ComfyUI's own attention (whichever its flags chose), or an exact backend such as 'native'")
    return None


def alias_note(name) -> str | None:
    """What the report says when a ComfyUI name was resolved to another backend name."""
    entry = COMFY_NAMES.get(name) if isinstance(name, str) else None
    if entry is None or entry[0] is None or entry[0] == name:
        return None
    return f"'{name}' is ComfyUI's name for {entry[1]}: this node runs the pack's '{entry[0]}', the same kernel"

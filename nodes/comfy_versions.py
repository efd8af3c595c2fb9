"""What differs between ComfyUI versions, in one place: each contract the pack relies on, what 0.3.64 and 0.38.x do
(docs/comfyui-versions.md has the table with its tests; ../shared/docs/comfyui-contract.md §1.7 the sources). The
rest of nodes/ reads these functions and names, never a version.

- The call (contract §1.2, §1.7): 0.3.64 calls `override(func, q, k, v, ...)` with tensors; 0.38 calls an override
  that has `container_function` with single-owner AttentionTensorContainers and no `func` (`is_container`, `unwrap`,
  `peek_containers`), and a call passed on without `func` needs ComfyUI's default attention
  (`comfy_default_attention`).
- The key (§1.5, §8): 0.38's core nodes write `optimized_attention_override` too: Model Attention Backend (through
  `ModelPatcher.set_model_optimized_attention`) and Model Sparse Attention (`core_override` tells them apart).
- The checkpoint (§1.7): 0.38 checkpoints may embed an attention method per module, popped as `preferred_attention`
  before any override sees it (`embedded_methods` finds them for the node's report).
- The block a call comes from (§1.3, §1.7): newer ComfyUI's DiTs (Flux, WAN, Chroma, Lumina, ...) pass
  `block_index` with `total_blocks`; the SD/SDXL UNet (0.3.64 and later) its `transformer_index`; 0.3.64's WAN and
  Flux nothing, so a call is known by its ordinal in the forward (`block_position`, `Ordinals`, `new_forward`;
  nodes/blocks.py names the block).
- The attention names (§1.7, §8): 0.38's registry, `--use-*-attention` flags and Model Attention Backend node name
  attention `sage`, `sage3`, `flash`, `xformers`, `pytorch`, `sub_quad`, `split`, `comfy_kitchen_int8`; the Set
  Attention Backend nodes take them as aliases where the pack runs the same kernel (`COMFY_NAMES`, `resolve`), and
  say what to pick instead where it does not (`not_offered`).
- The node API: 0.3.64 leaves the node id out of a V3 node's cache key even with hidden unique_id (it looks for the
  string in a tuple), so two identical nodes would share one output and one report; `NODE_ID_OUT_OF_CACHE_KEY` is
  the `not_idempotent` each node passes, which puts the node id in the key (outputs are still cached per node).
  0.3.64 checks a V3 combo's value against nothing (its input type is "COMBO", not the list of options), skips its
  own min/max checks for every input a `validate_inputs` names, and, where its conversion of a FLOAT/INT/STRING/
  BOOLEAN value fails, still calls `validate_inputs` with the raw value ("abc", null): so each node checks every
  value itself (nodes/validation.py; §4.2).

Nothing here imports ComfyUI at import time; `comfy_default_attention` imports it when a call needs it.
"""

from __future__ import annotations

import torch

from ..dispatcher import AttentionInputError

NODE_ID_OUT_OF_CACHE_KEY = True  # ComfyUI 0.3.64: a V3 node's cache key lacks its node id (see above)

# 0.38's core nodes that write the override key, recognised by where their closures come from
SET_OPTIMIZED = "set_model_optimized_attention"  # ModelPatcher's helper: the Model Attention Backend node uses it
PATCHER_MODULE = "comfy.model_patcher"
SPARSE_MODULE = "comfy_extras.nodes_sparse_attention"  # the Model Sparse Attention node


def core_override(fn) -> str | None:
    """'core_backend' (Model Attention Backend) | 'core_sparse' (Model Sparse Attention) for an override one of
    ComfyUI 0.38's core nodes installed, else None."""
    module = getattr(fn, "__module__", "") or ""
    if module == PATCHER_MODULE or SET_OPTIMIZED in (getattr(fn, "__qualname__", "") or ""):
        return "core_backend"
    if module == SPARSE_MODULE:
        return "core_sparse"
    return None


def is_container(t) -> bool:
    """ComfyUI 0.38's AttentionTensorContainer, by what it offers (`take`; `peek` too, which a container call
    needs): this module imports no ComfyUI."""
    return not isinstance(t, torch.Tensor) and hasattr(t, "take")


def _consumed(name: str) -> AttentionInputError:
    return AttentionInputError(
        f"the {name} AttentionTensorContainer was already taken (consumed) before this attention override got it: a "
        "container is single-owner, so the override or node that took it must pass the tensor on, not the empty "
        "container")


def unwrap(name: str, t):
    """A plain-form call that still carries a container (an override passing its containers on): take it once."""
    if not is_container(t):
        return t
    try:
        return t.take()
    except RuntimeError as error:
        raise _consumed(name) from error


def peek_containers(q, k, v) -> tuple:
    """The tensors inside a container call's q/k/v, not taken: whoever serves the call takes them."""
    for name, c in (("q", q), ("k", k), ("v", v)):
        if c is None:
            raise TypeError(f"the attention override's container_function got no {name}: ComfyUI 0.38 passes q, k "
                            "and v as three AttentionTensorContainers")
        if not (is_container(c) and hasattr(c, "peek")):
            raise TypeError(f"the attention override's container_function got {name} as {type(c).__name__}, not an "
                            "AttentionTensorContainer: ComfyUI 0.38 passes all three as containers there (plain "
                            "tensors go to the override itself, with func)")
    for (a, x), (b, y) in ((("q", q), ("k", k)), (("q", q), ("v", v)), (("k", k), ("v", v))):
        if x is y:
            raise AttentionInputError(
                f"the same AttentionTensorContainer was passed as {a} and {b}: a container is single-owner (taken "
                "once), so the second take would find it empty. Wrap each of q, k and v in its own container")
    tensors = []
    for name, c in (("q", q), ("k", k), ("v", v)):
        try:
            tensors.append(c.peek())
        except RuntimeError as error:
            raise _consumed(name) from error
    return tensors


def take(q, k, v) -> tuple:
    """The tensors of a container call, taken: whoever serves the call takes each container once."""
    return q.take(), k.take(), v.take()


def passed_on(target, func, q, k, v, containers: bool, default_attention=None):
    """(the callable, func, q, k, v) that serve a call an override passes on: to `target` (the override installed
    before it; None: ComfyUI's attention `func`). A plain call goes as it came. A 0.38 container call (`containers`,
    without func) goes to a `container_function` down the chain with its containers untouched; a plain override, or
    ComfyUI's attention, gets them taken and ComfyUI's default attention as func (`default_attention()`: a
    zero-argument callable; None: `comfy_default_attention`)."""
    call = None
    if containers:
        call = None if target is None else getattr(target, "container_function", None)
        if call is None:
            func = _default_func(default_attention)
            if target is None:
                call = getattr(func, "container_function", None)
        if call is None:
            q, k, v = take(q, k, v)
    if call is None:
        call = (lambda *a, **kw: target(func, *a, **kw)) if target is not None else func
    return call, func, q, k, v


def _default_func(default_attention):
    try:
        return (comfy_default_attention if default_attention is None else default_attention)()
    except ImportError as error:
        raise RuntimeError(
            "a ComfyUI 0.38 container call (it comes without func) is passed on to ComfyUI's attention, and "
            f"ComfyUI's default attention function cannot be imported here ({error}); outside ComfyUI, make the "
            "override with default_attention=<a function returning the attention to run>") from error


def comfy_default_attention():
    """ComfyUI's default attention (the wrapped function its models call): what a container call the pack passes
    on runs, since ComfyUI 0.38 gives a `container_function` no `func`. Imported here, when first needed."""
    from comfy.ldm.modules import attention  # ComfyUI's own module (not in the dispatcher, not at import)
    return attention.get_attention_function("optimized")


def embedded_methods(model) -> dict[str, int]:
    """Attention methods a checkpoint embeds per module (ComfyUI 0.38 `ComfyAttention.config`, e.g.
    comfy_kitchen_int8) -> how many modules. ComfyUI hands them to its wrapper as `preferred_attention`, which it
    pops before any override sees it and uses only when no override is installed."""
    diffusion = getattr(getattr(model, "model", None), "diffusion_model", None)
    modules = getattr(diffusion, "modules", None)
    if not callable(modules):
        return {}
    found: dict[str, int] = {}
    for module in modules():
        config = getattr(getattr(module, "comfy_attention", None), "config", None)
        if isinstance(config, dict) and config.get("attention"):
            method = str(config["attention"])
            found[method] = found.get(method, 0) + 1
    return found


# ------------------------------------------------------------------------------------------------ block positions

def block_position(transformer_options: dict | None) -> tuple[int, int | None, int | None] | None:
    """(index, total or None, inner or None) of the block making this call, None when the options do not say: the
    one reader of the position, which both names the block (blocks.block_id) and places it in a range
    (blocks.in_blocks). A DiT's `block_index` with its `total_blocks` (newer ComfyUI; a count below 1 is no count);
    else the UNet's `transformer_index` (0.3.64 and later; no count; its `block_index` is the block inside that
    transformer: inner)."""
    to = transformer_options
    if not to:
        return None
    index, total = to.get("block_index"), to.get("total_blocks")
    if type(index) is int and type(total) is int:
        return index, (total if total > 0 else None), None
    unet = to.get("transformer_index")
    if type(unet) is int:
        return unet, None, (index if type(index) is int else None)
    return None


class Ordinals:
    """The ordinal of a call within one model forward, per kind of call (self or cross, block type), for models
    that pass no block position (ComfyUI 0.3.64's WAN and Flux): the Nth self-attention call of a forward is
    block N's. A forward is told from the next by its `cond_or_uncond` list, which ComfyUI makes anew for each
    batch it runs (cond and uncond batched together: one forward; run one after the other: two, each counted
    from 0) and which copies of the options share; without it, by the options dict itself. Both are held (not
    their ids), so a freed one's address cannot come back as the same forward."""

    __slots__ = ("forward", "counts")

    def __init__(self):
        self.forward = None
        self.counts: dict = {}

    def next(self, to: dict, kind) -> int:
        forward = to.get("cond_or_uncond", to)
        if forward is not self.forward:
            self.forward, self.counts = forward, {}
        n = self.counts.get(kind, 0)
        self.counts[kind] = n + 1
        return n


def new_forward(transformer_options: dict) -> dict:
    """A copy of a forward's transformer_options that `Ordinals` reads as a forward of its own (block ordinals from
    0 again): its own `cond_or_uncond` list."""
    fresh = dict(transformer_options)
    if isinstance(fresh.get("cond_or_uncond"), list):
        fresh["cond_or_uncond"] = list(fresh["cond_or_uncond"])
    return fresh


# ------------------------------------------------------------------------------------------------ attention names
# ComfyUI 0.38's name -> (the pack's backend running the same kernel, what it is). None: the pack has no such backend.
# No ComfyUI import: these are names only.
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

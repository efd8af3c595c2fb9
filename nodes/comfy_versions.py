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
- The node API: 0.3.64 leaves the node id out of a V3 node's cache key even with hidden unique_id (it looks for the
  string in a tuple), so two identical nodes would share one output and one report; `NODE_ID_OUT_OF_CACHE_KEY` is
  the `not_idempotent` each node passes, which puts the node id in the key (outputs are still cached per node).

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

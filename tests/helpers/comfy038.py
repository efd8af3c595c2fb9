"""Stand-ins for ComfyUI 0.38.x's attention call machinery, written from the contract as read (no ComfyUI code).

What they follow (../shared/docs/comfyui-contract.md §1.2, §1.7, §8, checked against the public source of
Comfy-Org/ComfyUI, versions stored by the search index):
- `comfy/ldm/modules/attention.py` @ 05080f6022b2572df36a0aa6bcba413209c3d265 (0.38.x, 2026): `AttentionTensorContainer`
  (single owner: `peek` reads, `take` empties it, both raise once it is empty), `wrap_attn` (pops
  `preferred_attention`; q/k/v all containers or none; with an override installed and no `_inside_attn_wrapper`:
  the override's `container_function(*args, **kwargs)` for container calls when it has one, else the override with
  `func` and the taken tensors; the preferred method only without an override; the backend's own
  `container_function` when set, else the taken tensors), the registry names;
- `comfy/model_patcher.py` @ e59d85a0f377f50b0fac62f406491d95476bece4: `set_model_optimized_attention` (a closure
  that ignores `func`, calls one backend, copies a non-None `container_function`);
- `comfy_extras/nodes_model_advanced.py` @ 691e82787be231880314d980b49b06a8105c5de6: Model Attention Backend (that
  helper with the "pytorch" or "comfy_kitchen_int8" registry function);
- `comfy_extras/nodes_sparse_attention.py` @ 01dafad3aa6ccf46e7b6f8b7b61a8138cd8b0261: Model Sparse Attention (a
  closure over `previous`, which it calls with `func` for the calls it keeps dense; re-installed on top of the key
  at patch time and every step unless it is already on top).
The stand-ins carry the identity the real ones have (module and qualified names) because the pack's report reads it.
"""

from __future__ import annotations

import functools

import torch

from helpers.pack import comfy_func

OVERRIDE_KEY = "optimized_attention_override"
SPARSE_MODULE = "comfy_extras.nodes_sparse_attention"


class Container:
    """AttentionTensorContainer: one tensor, one owner."""

    __slots__ = ("tensor", "takes")

    def __init__(self, tensor):
        self.tensor, self.takes = tensor, 0

    def peek(self):
        if self.tensor is None:
            raise RuntimeError("container already consumed")
        return self.tensor

    def take(self):
        tensor = self.peek()
        self.tensor, self.takes = None, self.takes + 1
        return tensor


def containers(*tensors):
    return tuple(Container(t) for t in tensors)


def wrap_attn(func):
    """The 0.38 wrapper, as the contract describes its steps."""
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        preferred = kwargs.pop("preferred_attention", None)
        boxed = len(args) >= 3 and isinstance(args[0], Container)
        if boxed and not all(isinstance(a, Container) for a in args[1:3]):
            raise TypeError("q, k and v must all be containers")
        added = "_inside_attn_wrapper" not in kwargs
        try:
            if added:
                kwargs["_inside_attn_wrapper"] = True
                options = kwargs.get("transformer_options")
                override = None if options is None else options.get(OVERRIDE_KEY)
                if override is not None:
                    if boxed and hasattr(override, "container_function"):
                        return override.container_function(*args, **kwargs)
                    if boxed:
                        args = tuple(c.take() for c in args[:3]) + args[3:]
                    return override(func, *args, **kwargs)
                if preferred is not None and preferred.function is not None:
                    return preferred.function(*args, **kwargs)
            if boxed:
                if wrapper.container_function is not None:
                    return wrapper.container_function(*args, **kwargs)
                args = tuple(c.take() for c in args[:3]) + args[3:]
            return func(*args, **kwargs)
        finally:
            if added:
                del kwargs["_inside_attn_wrapper"]
    wrapper.container_function = None
    return wrapper


attention_pytorch = wrap_attn(comfy_func)  # registry name "pytorch"
attention_pytorch.__name__ = "attention_pytorch"
KITCHEN_TAKES: list[int] = []  # how many container calls the kitchen stand-in took


def _kitchen(q, k, v, heads, mask=None, **kwargs):
    return comfy_func(q, k, v, heads, mask=mask, **kwargs)


def _kitchen_containers(q, k, v, heads, mask=None, **kwargs):
    """The INT8 backend's container form: takes its containers itself (here exact SDPA: the container handling is
    what is tested)."""
    KITCHEN_TAKES.append(1)
    return comfy_func(q.take(), k.take(), v.take(), heads, mask=mask, **kwargs)


attention_kitchen = wrap_attn(_kitchen)  # registry name "comfy_kitchen_int8"
attention_kitchen.__name__ = "attention_comfy_kitchen_int8"
attention_kitchen.container_function = _kitchen_containers


class Preferred:
    """ComfyAttention as a call site hands it over (`preferred_attention=`): a checkpoint's embedded method."""

    def __init__(self, function):
        self.function = function


def set_model_optimized_attention(model_options: dict, optimized_attention) -> None:
    """ModelPatcher.set_model_optimized_attention (what Model Attention Backend calls)."""
    def optimized_attention_override(_, *args, **kwargs):
        return optimized_attention(*args, **kwargs)
    optimized_attention_override.__module__ = "comfy.model_patcher"
    optimized_attention_override.__qualname__ = \
        "ModelPatcher.set_model_optimized_attention.<locals>.optimized_attention_override"
    if getattr(optimized_attention, "container_function", None) is not None:
        optimized_attention_override.container_function = optimized_attention.container_function
    model_options.setdefault("transformer_options", {})[OVERRIDE_KEY] = optimized_attention_override


SPARSE_SERVED: list[int] = []  # calls the sparse stand-in ran itself


def sparse_override(previous, min_tokens: int):
    """Model Sparse Attention's override: long self-attention "sparse" (here exact SDPA, counted), the rest dense
    through `previous` (or `func`)."""
    def override(func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                 **kwargs):
        tokens = q.shape[2] if skip_reshape else q.shape[1]
        if mask is not None or tokens < min_tokens or q.shape != k.shape:
            kw = dict(mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                      skip_output_reshape=skip_output_reshape, **kwargs)
            return func(q, k, v, heads, **kw) if previous is None else previous(func, q, k, v, heads, **kw)
        SPARSE_SERVED.append(tokens)
        return comfy_func(q, k, v, heads, skip_reshape=skip_reshape, skip_output_reshape=skip_output_reshape)
    override.__module__ = SPARSE_MODULE
    override.__qualname__ = "make_attention_override.<locals>.override"
    return override


class SparsePatch:
    """The sparse node's per-model state: puts its override on top of the key unless one of its own is there."""

    def __init__(self, min_tokens: int):
        self.min_tokens, self.installed = min_tokens, []

    def install(self, transformer_options: dict) -> None:
        current = transformer_options.get(OVERRIDE_KEY)
        if any(current is mine for mine in self.installed):
            return
        mine = sparse_override(current, self.min_tokens)
        self.installed.append(mine)
        transformer_options[OVERRIDE_KEY] = mine


def call_site(attention, q, k, v, heads, transformer_options, as_containers: bool, **kwargs):
    """A 0.38 model's attention call: q/k/v wrapped in containers (CrossAttention, WAN) or plain."""
    args = containers(q, k, v) if as_containers else (q, k, v)
    return attention(*args, heads, transformer_options=transformer_options, **kwargs)


def flat_qkv(b=2, lq=16, lk=16, heads=2, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, lq, heads * d, generator=g), torch.randn(b, lk, heads * d, generator=g),
            torch.randn(b, lk, heads * d, generator=g))

"""A stable short id of the model a Set Attention Backend node patches (the dispatcher's `model=`).

Why: `auto_fast` admits a quantised kernel per model (its error on that model's own activations) and the quality
guard demotes a kernel per model; two models must not share those verdicts, and the same model must keep them
across prompts and clones. The id is the diffusion model's class name and a cheap content fingerprint:
- a few bytes from a few parameters (the first, one in the middle, the last; at most `SLICE` elements of each,
  copied to the CPU: a few KB, also for a model on the GPU), with their names, shapes and dtypes, and the
  number of parameters;
- the patcher's weight patches (LoRAs and the like): their keys, strengths and a few bytes of each patch's first
  tensors, so the same model with a LoRA, or with another strength, is another model.
Anything odd (no parameters, meta tensors, a quantised tensor subclass, not a ModelPatcher) falls back to less:
class name and shapes, and at worst class name + id(), never an exception. Nothing here imports ComfyUI.
"""

from __future__ import annotations

import hashlib

import torch

SLICE = 256  # elements per sampled parameter
PATCH_KEYS = 16  # weight-patch keys whose tensors are sampled (all keys and strengths are hashed)


def _root(model_patcher):
    model = getattr(model_patcher, "model", model_patcher)
    return getattr(model, "diffusion_model", model)


def _tensor_bytes(t) -> bytes:
    """At most SLICE elements of `t` as raw bytes (shape and dtype only when they cannot be read)."""
    head = f"{tuple(t.shape)}:{t.dtype}".encode()
    try:
        if t.device.type == "meta":
            return head
        flat = t.detach().reshape(-1)[:SLICE]
        return head + flat.to("cpu", copy=True).contiguous().view(torch.uint8).numpy().tobytes()
    except Exception:  # a tensor subclass (GGUF, quantised), an odd dtype: its shape still says something
        return head


def _parameters(root) -> list:
    try:
        named = list(root.named_parameters())
    except Exception:
        return []
    if not named:
        return []
    picks = sorted({0, len(named) // 2, len(named) - 1})
    return [(len(named), named[i]) for i in picks]


def _first_tensors(obj, limit: int = 2, depth: int = 3) -> list:
    """The first tensors inside a patch (a tuple, a list, an adapter object with `weights`)."""
    found = []

    def walk(o, d):
        if len(found) >= limit or d < 0:
            return
        if isinstance(o, torch.Tensor):
            found.append(o)
        elif isinstance(o, (tuple, list)):
            for item in o:
                walk(item, d - 1)
        elif hasattr(o, "weights"):
            walk(getattr(o, "weights"), d - 1)

    walk(obj, depth)
    return found


def _patches_digest(model_patcher, h) -> None:
    patches = getattr(model_patcher, "patches", None)
    if not isinstance(patches, dict) or not patches:
        return
    for n, key in enumerate(sorted(patches, key=str)):
        h.update(f"|patch {key}".encode())
        entries = patches[key] if isinstance(patches[key], (list, tuple)) else [patches[key]]
        for entry in entries:
            if isinstance(entry, (list, tuple)) and entry:
                # ComfyUI: (strength_patch, patch, strength_model, offset, function)
                strengths = [x for i, x in enumerate(entry) if i != 1 and isinstance(x, (int, float))]
                h.update(repr(strengths).encode())
                if n < PATCH_KEYS and len(entry) > 1:
                    for t in _first_tensors(entry[1]):
                        h.update(_tensor_bytes(t))
            else:
                h.update(type(entry).__name__.encode())


def model_key(model_patcher) -> str:
    """'<ClassName>:<12 hex digits>', the same for the same weights and patches; never raises."""
    try:
        root = _root(model_patcher)
        name = type(root).__name__
    except Exception:
        return f"{type(model_patcher).__name__}:{id(model_patcher):x}"
    try:
        h = hashlib.sha1(name.encode())
        picked = _parameters(root)
        if not picked:
            return f"{name}:{id(root):x}"
        for count, (pname, p) in picked:
            h.update(f"|{count}|{pname}".encode())
            h.update(_tensor_bytes(p))
        _patches_digest(model_patcher, h)
        return f"{name}:{h.hexdigest()[:12]}"
    except Exception:
        return f"{name}:{id(root):x}"

"""A stable short id of the model a Set Attention Backend node patches (the dispatcher's `model=`).

Why: `auto_fast` admits a quantised kernel per model (its error on that model's own activations) and the quality
guard demotes a kernel per model; two models must not share those verdicts, and the same model must keep them
across prompts and clones. The id is the diffusion model's class name and a content fingerprint of what it reads:
- every parameter and buffer: its name, shape and dtype, and SAMPLES of its elements spread evenly over it (the
  first and the last included), gathered on the tensor's own device and copied to the CPU once per device: a few
  hundred KB for a model of a thousand tensors, whatever its size or device. Two checkpoints of one architecture
  that differ in any tensor's values (a fine-tune, another epoch, a merged LoRA) are two models; only two that
  differ solely between the sampled elements of every tensor they change share one (checkpoints do not differ so).
  Sampling only the first, middle and last parameter once gave two checkpoints that differed elsewhere one id;
- where ComfyUI holds a weight patched in place (a loaded model with LoRAs applied: `ModelPatcher.backup` keeps
  the original), the original's elements: the id is the same whether or not the model is loaded and patched;
- the patcher's weight patches (LoRAs and the like): their keys, strengths and a few bytes of each patch's first
  tensors, so the same model with a LoRA, or with another strength, is another model.
Anything odd (no parameters, meta tensors, a quantised tensor subclass, not a ModelPatcher) falls back to less:
names, shapes and dtypes, and at worst class name + id(), never an exception. Nothing here imports ComfyUI.
Cost, per Set Attention Backend run (bench/model_identity_cost.py): docs/nodes.md.
"""

from __future__ import annotations

import hashlib

import torch

SAMPLES = 64  # elements read from every parameter and buffer
PATCH_SLICE = 256  # elements read from each sampled patch tensor
PATCH_KEYS = 16  # weight-patch keys whose tensors are sampled (all keys and strengths are hashed)


def _root(model_patcher):
    model = getattr(model_patcher, "model", model_patcher)
    return getattr(model, "diffusion_model", model)


def _named_tensors(root) -> list[tuple[str, torch.Tensor]]:
    try:
        named = list(root.named_parameters())
        seen = {name for name, _ in named}
        named += [(name, b) for name, b in root.named_buffers() if name not in seen and isinstance(b, torch.Tensor)]
    except Exception:
        return []
    return named


def _originals(model_patcher, root) -> dict[str, torch.Tensor]:
    """The weights ComfyUI patched in place, as they were: {name under root: original} (from the patcher's
    `backup`, keyed under the patcher's model: 'diffusion_model.<name>')."""
    backup = getattr(model_patcher, "backup", None)
    if not isinstance(backup, dict) or not backup:
        return {}
    model = getattr(model_patcher, "model", None)
    prefix = "diffusion_model." if model is not None and getattr(model, "diffusion_model", None) is root else ""
    out = {}
    for key, entry in backup.items():
        weight = getattr(entry, "weight", None)
        if isinstance(key, str) and key.startswith(prefix) and isinstance(weight, torch.Tensor):
            out[key[len(prefix):]] = weight
    return out


def _samples(tensors: list[torch.Tensor]) -> list[bytes]:
    """SAMPLES elements of each tensor as raw bytes (b"" where they cannot be read), in order: gathered on each
    tensor's device, one copy to the CPU per device."""
    positions: dict = {}
    by_device: dict = {}
    for i, t in enumerate(tensors):
        try:
            numel = t.numel()
            if t.device.type == "meta" or numel == 0:
                continue
            where = (numel, t.device)
            if where not in positions:  # integers: the same elements on every device
                count = min(SAMPLES, numel)
                positions[where] = ((torch.arange(count, dtype=torch.int64) * (numel - 1)) // max(count - 1, 1)
                                    ).to(t.device)
            picked = torch.take(t.detach(), positions[where])  # in row-major order, whatever the memory layout
            by_device.setdefault(picked.device, []).append((i, picked.contiguous().view(torch.uint8).reshape(-1)))
        except Exception:  # a tensor subclass (GGUF, quantised), an odd dtype: its name, shape and dtype still count
            continue
    out = [b""] * len(tensors)
    for items in by_device.values():
        try:
            joined = torch.cat([s for _, s in items]).cpu().numpy().tobytes()
        except Exception:
            continue
        offset = 0
        for i, s in items:
            out[i] = joined[offset:offset + s.numel()]
            offset += s.numel()
    return out


def _patch_tensor_bytes(t) -> bytes:
    """At most PATCH_SLICE elements of a patch tensor as raw bytes (shape and dtype only when they cannot be read)."""
    head = f"{tuple(t.shape)}:{t.dtype}".encode()
    try:
        if t.device.type == "meta":
            return head
        flat = t.detach().reshape(-1)[:PATCH_SLICE]
        return head + flat.to("cpu", copy=True).contiguous().view(torch.uint8).numpy().tobytes()
    except Exception:
        return head


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
                        h.update(_patch_tensor_bytes(t))
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
        named = _named_tensors(root)
        if not named:
            return f"{name}:{id(root):x}"
        originals = _originals(model_patcher, root)
        tensors = [originals.get(pname, t) for pname, t in named]
        h = hashlib.sha1(f"{name}|{len(named)}".encode())
        for (pname, _), t, sample in zip(named, tensors, _samples(tensors)):
            h.update(f"|{pname}:{tuple(t.shape)}:{t.dtype}|".encode())
            h.update(sample)
        _patches_digest(model_patcher, h)
        return f"{name}:{h.hexdigest()[:12]}"
    except Exception:
        return f"{name}:{id(root):x}"

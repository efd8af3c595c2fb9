"""This pack imported the way ComfyUI imports it (the repository root as a package under an arbitrary name, so
its relative imports work), and a fake ComfyUI attention `func` for the override to wrap."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
PACK = "attention_dispatch_pack"
CALLS: list[dict] = []  # the extra keyword arguments of each comfy_func call; test_adapter clears it per test


def load_pack():
    """Load the pack once under PACK; returns its (nodes.adapter, dispatcher, nodes.compare) modules."""
    if PACK not in sys.modules:
        spec = importlib.util.spec_from_file_location(PACK, ROOT / "__init__.py", submodule_search_locations=[str(ROOT)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[PACK] = module
        spec.loader.exec_module(module)
    return importlib.import_module(f"{PACK}.nodes.adapter"), importlib.import_module(f"{PACK}.dispatcher"), \
        importlib.import_module(f"{PACK}.nodes.compare")


def comfy_func(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False, **kwargs):
    """What ComfyUI's attention_pytorch does, written from the contract."""
    CALLS.append(kwargs)
    if skip_reshape:
        b, _, lq, d = q.shape
        h = q.shape[1]
    else:
        b, lq, hd = q.shape
        h, d = heads, hd // heads
        q, k, v = (t.view(b, -1, h, d).transpose(1, 2) for t in (q, k, v))
    if mask is not None:
        if mask.ndim == 2:
            mask = mask.unsqueeze(0)
        if mask.ndim == 3:
            mask = mask.unsqueeze(1)
        if not (mask.dtype == torch.bool or mask.is_floating_point()):
            mask = mask.bool()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out if skip_output_reshape else out.transpose(1, 2).reshape(b, lq, h * d)

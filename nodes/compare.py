"""Compare a sample of attention calls against PyTorch SDPA and keep the largest relative error.

Why a sample: the reference costs a second attention call, so only every `every`-th call pays it.
The object is shared between ModelPatcher clones (`__deepcopy__` returns self), like the Recorder.
"""

from __future__ import annotations

import threading

import torch


class Comparison:
    def __init__(self, every: int = 10):
        self.every = max(1, int(every))
        self._lock = threading.Lock()
        self._seen = 0
        self.samples = 0
        self.max_rel_error = 0.0
        self.worst_site = None

    def __deepcopy__(self, memo):
        return self

    def clear(self) -> None:
        with self._lock:
            self._seen = self.samples = 0
            self.max_rel_error, self.worst_site = 0.0, None

    def wants(self) -> bool:
        with self._lock:
            self._seen += 1
            return (self._seen - 1) % self.every == 0

    def add(self, site: str, out_bhsd: torch.Tensor, q, k, v, mask, scale=None, enable_gqa=False) -> float:
        """Reference in float32 (B, H, L, D); relative error = max|out - ref| / max|ref|."""
        if mask is not None:
            if mask.dtype == torch.bool:
                mask = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill(~mask, float("-inf"))
            while mask.dim() < 4:  # ComfyUI's rank rule: (Lq,Lk) -> (1,1,Lq,Lk), (B,Lq,Lk) -> (B,1,Lq,Lk)
                mask = mask.unsqueeze(0) if mask.dim() == 2 else mask.unsqueeze(1)
            mask = mask.float()
        with torch.no_grad():
            ref = torch.nn.functional.scaled_dot_product_attention(
                q.float(), k.float(), v.float(), attn_mask=mask, scale=scale, enable_gqa=bool(enable_gqa))
            err = float((out_bhsd.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
        with self._lock:
            self.samples += 1
            if err >= self.max_rel_error:
                self.max_rel_error, self.worst_site = err, site
        return err

    def snapshot(self) -> dict:
        with self._lock:
            return {"every": self.every, "samples": self.samples, "max_rel_error": self.max_rel_error,
                    "worst_site": self.worst_site}

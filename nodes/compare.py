"""Compare a sample of attention calls against exact attention and keep the largest relative error.

The reference is the pack's one exact attention (float64, `dispatcher.reference`) on a sample of query
rows, and the error is its relative Frobenius error, the measure every accuracy check of the pack uses.
Why a sample: the reference costs a second attention call, so only every `every`-th call pays it.
The object is shared between ModelPatcher clones (`__deepcopy__` returns self), like the Recorder.
"""

from __future__ import annotations

import threading

import torch

from ..dispatcher import reference

ROWS = 64  # query rows compared per sampled call

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
        """out and q, k, v in (B, H, L, D); the relative error of `out` on sampled query rows."""
        rows = reference.sample_rows(q.shape[2], ROWS)
        with torch.no_grad():
            ref, _ = reference.exact_attention(q, k, v, mask, scale=scale, layout="BHSD", rows=rows)
            picked = out_bhsd if rows is None else out_bhsd[:, :, rows.to(out_bhsd.device)]
            err = reference.relative_error(picked, ref)
        with self._lock:
            self.samples += 1
            if not err < self.max_rel_error:  # NaN is the worst error there is
                self.max_rel_error, self.worst_site = err, site
        return err

    def snapshot(self) -> dict:
        with self._lock:
            return {"every": self.every, "samples": self.samples, "max_rel_error": self.max_rel_error,
                    "worst_site": self.worst_site}

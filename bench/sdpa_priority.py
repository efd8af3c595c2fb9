"""SDPA's own kernel order against cuDNN first, per shape, on the strided (B, H, L, D) views that ComfyUI's
(B, L, H*D) tensors become: what the GPU spends and what the host spends per call.

    python bench/sdpa_priority.py [--rounds 20] [--calls 50] [--json PATH]

The pack's `native` backend puts cuDNN first on NVIDIA GPUs (as ComfyUI does for its own SDPA path), because
SDPA's order picks its flash kernel for such views where cuDNN is faster on large calls. This measures, per
model shape, in one interleaved run: `gpu_us` (the kernels back to back behind a sleep kernel) and `host_us`
(the host's time per call while the GPU is kept busy) of
- `sdpa_order`: `F.scaled_dot_product_attention` under the priority order in force at start;
- `cudnn_first`: the same call with cuDNN first (set before the call and restored after it, as the pack does);
- `runner`: the pack's SDPA runner (`native.sdpa_attention`), which chooses the order itself.
A call is host-bound when its host time exceeds its GPU time: then the cheaper host path wins.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from comfy_model_step import ROOT, load_pack  # bench/ is on sys.path when a script of it runs
from output import emit
from timing import gpu_us_per_call, host_us_per_call

# (name, B, heads, query length, key length, head dim): the attention calls of the models the benches run.
SHAPES = [
    ("sd15 64x64 self", 2, 8, 4096, 4096, 40), ("sd15 32x32 self", 2, 8, 1024, 1024, 80),
    ("sdxl 64x64 self", 2, 10, 4096, 4096, 64), ("sdxl 64x64 cross", 2, 10, 4096, 77, 64),
    ("sdxl 32x32 self", 2, 20, 1024, 1024, 64), ("sdxl 32x32 cross", 2, 20, 1024, 77, 64),
    ("flux 1024 self", 1, 24, 4608, 4608, 128), ("wan1.3b self", 1, 12, 32760, 32760, 128),
    ("wan1.3b cross", 1, 12, 32760, 512, 128),
    ("h20 d64 L256", 2, 20, 256, 256, 64), ("h20 d64 L512", 2, 20, 512, 512, 64),
    ("h20 d64 L2048", 2, 20, 2048, 2048, 64), ("h20 d128 L8192", 1, 20, 8192, 8192, 128),
]


def strided_views(b, h, lq, lk, d, gen):
    """(B, H, L, D) views of (B, L, H*D) tensors, as ComfyUI's attention makes them."""
    q = torch.randn(b, lq, h * d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(b, lk, h * d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    return tuple(t.view(b, t.shape[1], h, d).transpose(1, 2) for t in (q, k, v))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    _, dispatcher = load_pack(ROOT)
    native = sys.modules[f"{dispatcher.__name__}.backends.native"]
    order = torch._C._get_sdp_priority_order()
    cudnn_first = [int(SDPBackend.CUDNN_ATTENTION)] + [p for p in order if p != int(SDPBackend.CUDNN_ATTENTION)]

    def with_cudnn_first(q, k, v):
        torch._C._set_sdp_priority_order(cudnn_first)
        try:
            return F.scaled_dot_product_attention(q, k, v)
        finally:
            torch._C._set_sdp_priority_order(order)

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, b, h, lq, lk, d in SHAPES:
        q, k, v = strided_views(b, h, lq, lk, d, gen)
        fns = {"sdpa_order": lambda: F.scaled_dot_product_attention(q, k, v),
               "cudnn_first": lambda: with_cudnn_first(q, k, v),
               "runner": lambda: native.sdpa_attention(q, k, v, None, 0.0, False, None, False, False)}
        ref = fns["sdpa_order"]().float()
        errors = {key: float((fn().float() - ref).norm() / ref.norm()) for key, fn in fns.items()}
        for fn in fns.values():
            for _ in range(10):
                fn()
        torch.cuda.synchronize()
        calls = max(3, min(args.calls, int(2e11 // (4 * b * h * lq * lk * d))))  # fewer calls of the big ones
        gpu = gpu_us_per_call(fns, args.rounds, calls)
        host = host_us_per_call(fns, args.rounds, calls)
        rows.append({"shape": name, "bhqkd": [b, h, lq, lk, d], "calls": calls,
                     "gpu_us": {key: round(x, 2) for key, x in gpu.items()},
                     "host_us": {key: round(x, 2) for key, x in host.items()},
                     "relative_difference_from_sdpa_order": {key: float(f"{x:.2e}") for key, x in errors.items()}})
        print(f"{name:18s} gpu " + " ".join(f"{key}={x:9.1f}" for key, x in gpu.items())
              + " | host " + " ".join(f"{key}={x:6.1f}" for key, x in host.items()), file=sys.stderr)
    emit({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "priority_order_at_start": order,
          "rounds": args.rounds, "rows": rows}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A small attention call through the pack against a bare SDPA call on the same views, on a GPU.

    python bench/small_call.py [--shape 2,20,1024,64] [--rounds 30] [--calls 200] [--json PATH]

SDXL's 32x32 level, (B, H, L, D) = (2, 20, 1024, 64), takes tens of microseconds on an H200: the host work
per call decides whether the GPU waits. ComfyUI hands (B, L, H*D) tensors; configurations, interleaved in a
shuffled order every round, each time `calls` back-to-back calls (CUDA events around the batch):
- bare: `F.scaled_dot_product_attention` on the (B, H, L, D) views (what ComfyUI's own path ends in);
- dispatcher: `dispatch_attention_fn` on the (B, L, H, D) views, the default backend;
- override: the ComfyUI override (nodes/adapter.py) as ComfyUI calls it, backend "native".
The ratio bare/x is the fraction of the bare call's speed the pack reaches (1.0 = no cost).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from comfy_model_step import ROOT, load_pack  # bench/ is on sys.path when a script of it runs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="2,20,1024,64", help="B,H,L,D")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json")
    parser.add_argument("--pack", type=Path, default=ROOT, help="measure the pack in this folder")
    args = parser.parse_args(argv)
    b, h, length, d = (int(x) for x in args.shape.split(","))
    adapter, dispatcher = load_pack(args.pack)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q3, k3, v3 = (torch.randn(b, length, h * d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    q4, k4, v4 = (t.view(b, length, h, d) for t in (q3, k3, v3))
    qb, kb, vb = (t.transpose(1, 2) for t in (q4, k4, v4))
    override = adapter.make_override("native")

    def comfy_func(*a, **kw):
        raise AssertionError("the override must not delegate here")

    fns = {
        "bare": lambda: F.scaled_dot_product_attention(qb, kb, vb),
        "dispatcher": lambda: dispatcher.dispatch_attention_fn(q4, k4, v4),
        "override": lambda: override(comfy_func, q3, k3, v3, h, transformer_options={}),
    }
    ref = fns["bare"]().transpose(1, 2).flatten(2)
    torch.testing.assert_close(fns["dispatcher"]().flatten(2), ref, rtol=0, atol=0)
    torch.testing.assert_close(fns["override"](), ref, rtol=0, atol=0)
    for fn in fns.values():
        for _ in range(50):
            fn()
    torch.cuda.synchronize()
    samples = {name: [] for name in fns}
    order = list(fns)
    rng = random.Random(0)
    for _ in range(args.rounds):
        rng.shuffle(order)
        for name in order:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            begin.record()
            for _ in range(args.calls):
                fns[name]()
            end.record()
            torch.cuda.synchronize()
            samples[name].append(begin.elapsed_time(end) / args.calls * 1e3)
    med = {name: statistics.median(v) for name, v in samples.items()}
    result = {"shape_bhld": [b, h, length, d], "dtype": "bfloat16", "median_us": {k: round(v, 3) for k, v in med.items()},
              "bare_over_dispatcher": round(med["bare"] / med["dispatcher"], 4),
              "bare_over_override": round(med["bare"] / med["override"], 4),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rounds": args.rounds,
              "calls": args.calls, "pack": str(args.pack)}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

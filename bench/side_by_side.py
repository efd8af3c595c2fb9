"""Backends on one attention shape, timed side by side in one run (samples alternating between them).

    python bench/side_by_side.py --shape 1,40,32760,128 --backends auto_fast,_native_cudnn,native [--runs 30]

(B, H, L, D) bf16 in the dispatcher's default (B, L, H, D) layout; each backend runs through
`dispatch_attention_fn` with policy 'strict' (an auto resolves to the kernel it picked for this shape and the
model scope `bench`). Prints and writes (`--json`) the median ms of each, every ratio to the first and the tuner's
account of each auto's pick (`auto_explain`), so a target such as "auto_fast >= x1.35 of cuDNN on Wan 14B" reads
from one run, not from two runs' tables.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import dispatcher  # noqa: E402
from dispatcher.tools.bench import time_interleaved  # noqa: E402
from output import emit  # noqa: E402  (bench/ is on sys.path when a script of it runs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="1,40,32760,128", help="B,H,L,D")
    parser.add_argument("--backends", default="auto_fast,_native_cudnn,native")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    b, h, length, d = (int(x) for x in args.shape.split(","))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b, length, h, d, device=device, dtype=dtype, generator=gen) for _ in range(3))
    names = args.backends.split(",")
    recorder = dispatcher.Recorder()
    with dispatcher.model_scope("bench"), dispatcher.recording(recorder):
        fns = [lambda name=name: dispatcher.dispatch_attention_fn(q, k, v, backend=name, policy="strict")
               for name in names]
        for fn in fns:
            fn()  # the autos decide here (timed and judged on these tensors)
        times = time_interleaved(fns, device, warmup=3, runs=args.runs, target_s=0.2)
    served = {row["requested"]: row["served"] for row in recorder.snapshot()["rows"]}
    result = {"shape_bhld": [b, h, length, d], "dtype": str(dtype).replace("torch.", ""), "runs": args.runs,
              "ms": dict(zip(names, (round(t, 3) for t in times))),
              "served": {name: served.get(name, name) for name in names},
              f"speedup_of_{names[0]}": {name: round(t / times[0], 4) for name, t in zip(names[1:], times[1:])},
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              # why each auto picked what it did: every candidate's verdict, timing and reason
              "auto_explain": dispatcher.auto.explain().splitlines()}
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the quality guard adds to a sampling step, measured on the attention calls of an SDXL step.

    python bench/guard_cost.py [--backend native] [--guard all] [--every 200] [--rounds 40] [--json PATH]

One "step" is the 140 attention calls of SDXL's UNet at 1024x1024 with cfg batch 2, in the model's order and
with its call sites: 10 blocks at 4096 tokens and 60 at 1024, each a self-attention and a cross-attention on
77 text tokens. Steps with the guard off and on (`--guard`, every `--every`-th call per call site) alternate,
each sample timing `--steps` steps with CUDA events; the medians give the guard's cost per step, in ms and as a
share of a whole SDXL step (`--step-ms`, the model's measured step time: bench/comfy_model_step.py --model sdxl).
The model's other layers are left out on purpose: the guard adds host and GPU work only to attention calls, and
timed alone they show that added work without the noise of a 60 ms step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import dispatcher  # noqa: E402
from output import emit  # noqa: E402  (bench/ is on sys.path when a script of it runs)
from timing import interleaved_ms  # noqa: E402

# (blocks, tokens, heads, site prefix) of SDXL's UNet at 1024x1024: input, middle and output transformer blocks.
SDXL_BLOCKS = [(4, 4096, 10, "input"), (20, 1024, 20, "input"), (10, 1024, 20, "middle"), (30, 1024, 20, "output"),
               (6, 4096, 10, "output")]


def sdxl_step_calls(device, dtype):
    """[(q, k, v, site)] of one step, in the model's order (batch 2, head dim 64, text length 77)."""
    gen = torch.Generator(device=device).manual_seed(0)
    tensors = {}

    def qkv(lq, lk, heads):
        if (lq, lk, heads) not in tensors:
            q = torch.randn(2, lq, heads, 64, device=device, dtype=dtype, generator=gen)
            k, v = (torch.randn(2, lk, heads, 64, device=device, dtype=dtype, generator=gen) for _ in range(2))
            tensors[lq, lk, heads] = (q, k, v)
        return tensors[lq, lk, heads]

    calls = []
    for blocks, tokens, heads, where in SDXL_BLOCKS:
        for _ in range(blocks):
            calls.append((*qkv(tokens, tokens, heads), f"{where}.self"))
            calls.append((*qkv(tokens, 77, heads), f"{where}.cross"))
    return calls


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="native")
    parser.add_argument("--guard", default="all", choices=("all", "quantised"))
    parser.add_argument("--every", type=int, default=dispatcher.guard.DEFAULT_EVERY)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--steps", type=int, default=5, help="steps per timed sample")
    parser.add_argument("--step-ms", type=float, default=60.0, help="a whole SDXL step on this GPU, for the share")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    calls = sdxl_step_calls("cuda", torch.bfloat16)
    recorder = dispatcher.Recorder()
    settings = {"off": dict(guard="off"), "on": dict(guard=args.guard, guard_every=args.every)}

    def steps(setting):
        for _ in range(args.steps):
            for q, k, v, site in calls:
                dispatcher.dispatch_attention_fn(q, k, v, backend=args.backend, call_site=site, recorder=recorder,
                                                 model="bench-guard", **settings[setting])

    for setting in settings:  # decide every signature, make the first checks
        steps(setting)
    torch.cuda.synchronize()
    med = {name: ms / args.steps for name, ms in
           interleaved_ms({name: (lambda name=name: steps(name)) for name in settings}, args.rounds).items()}
    checks = sum(g["checks"] for g in recorder.snapshot()["guard"])
    total_steps = args.steps * (args.rounds + 1)
    added = med["on"] - med["off"]
    result = {"backend": args.backend, "guard": args.guard, "every": args.every, "calls_per_step": len(calls),
              "attention_ms_per_step": {k: round(v, 4) for k, v in med.items()},
              "checks_per_step": round(checks / total_steps, 3), "added_ms_per_step": round(added, 4),
              "added_ms_per_check": round(added / max(checks / total_steps, 1e-9), 4),
              "share_of_sdxl_step": round(added / args.step_ms, 5), "sdxl_step_ms": args.step_ms,
              "failures": sum(len(g["failures"]) for g in recorder.snapshot()["guard"]),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "rounds": args.rounds,
              "steps_per_sample": args.steps}
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

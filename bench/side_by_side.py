"""Backends on one attention shape, timed side by side in one run (samples alternating between them).

    python bench/side_by_side.py --shape 1,40,32760,128 --backends auto_fast,_native_cudnn,native [--runs 30]
    python bench/side_by_side.py --shape 1,40,32760,128 --inputs local --backends \\
        _native_cudnn,_flash_3,flash_4,flash_3_fp8,sage_sm90_per_warp,comfy_kitchen_int8,sol_attn,auto_exact,auto_fast

(B, H, L, D) bf16 in the dispatcher's default (B, L, H, D) layout; each backend runs through
`dispatch_attention_fn` with policy 'strict', a pinned kernel with the quality guard off (an auto resolves to the kernel it picked for this shape and the
model scope `bench`). Prints and writes (`--json`) the median ms of each, its TFLOP/s-equivalent (4 B H L^2 D flops
of exact attention per call, over its time: what a quantised or sparse kernel "does" at exact attention's count),
every ratio to the first, each one's
relative error against exact attention in float64 (64 sampled query rows, the pack's one reference) and the tuner's
account of each auto's pick (`auto_explain`), so a target such as "auto_fast >= x1.35 of cuDNN on Wan 14B" reads
from one run, not from two runs' tables. A backend that cannot run here is listed under `skipped` with the reasons.

--inputs noise (default): N(0,1). --inputs local: video-like activations whose attention is local
(dispatcher.tools.bench.local_video_qkv; WAN's 21 x 30 x 52 grid for L = 32760), the structure block-sparse sol_attn
relies on: its error on noise says nothing of its error on a video model, and the autos judge it on these values.
--inputs outlier: N(0,1) with one key channel of random sign and size 100 that the queries ignore (exact attention
is unchanged; tests/gpu/test_gpu_guard.py's outlier block, where every Sage kernel is 0.24 off).
--inputs offset: N(0,1) with an offset per key and value channel drawn from N(0, 3^2), as DiT activations carry
(what flash_3_fp8's smoothing is for).
--tau sets sol_attn's routing threshold (default 1.0, comfy_kitchen's).
--fp8-parts (with flash_3_fp8 among the backends, where it runs): its three stages timed apart in the same rounds,
`fp8_parts_ms`: `quantise` (dispatcher/quantise.py: the fused Triton kernels where Triton runs), `kernel`
(FlashAttention-3's FP8 forward on those inputs) and `restore` (V's mean added back to the output).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import dispatcher  # noqa: E402
from dispatcher.backends.kitchen import DEFAULT_TAU, sol_attn_options  # noqa: E402
from dispatcher.reference import exact_attention, relative_error, sample_rows  # noqa: E402
from dispatcher.tools.bench import local_video_qkv, time_interleaved, video_grid  # noqa: E402
from output import emit  # noqa: E402  (bench/ is on sys.path when a script of it runs)


def inputs(kind: str, b: int, h: int, length: int, d: int, device, dtype):
    if kind == "local":
        return local_video_qkv(b, h, *video_grid(length), d, device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b, length, h, d, device=device, dtype=dtype, generator=gen) for _ in range(3))
    if kind == "outlier":
        q[..., 0] = 0
        signs = torch.randint(0, 2, k.shape[:3], device=device, generator=gen).to(dtype) * 2 - 1
        k[..., 0] = signs * 100
    if kind == "offset":
        k, v = (x + 3 * torch.randn(1, 1, h, d, device=device, generator=gen).to(dtype) for x in (k, v))
    return q, k, v


def fp8_parts(q, k, v) -> dict:
    """flash_3_fp8's stages on these tensors, each a function to time: the quantisation, the kernel on its
    inputs, the output's restore (in place on one output: timing only)."""
    from dispatcher import quantise
    from dispatcher.backends.flash import fp8_forward
    prepared = quantise.quantise(q, k, v)
    out, _ = fp8_forward(prepared, None, False, False)
    return {"quantise": lambda: quantise.quantise(q, k, v),
            "kernel": lambda: fp8_forward(prepared, None, False, False),
            "restore": lambda: quantise.restore(out, prepared)}


def cannot_run(name: str) -> list[str]:
    """Why backend `name` cannot run on this machine ([] when it can; the autos always can)."""
    if name in dispatcher.auto.PSEUDO_BACKENDS:
        return []
    if not dispatcher.registry.is_known(name):
        return [dispatcher.registry.unknown_message(name)]
    return dispatcher.availability_reasons(name)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="1,40,32760,128", help="B,H,L,D")
    parser.add_argument("--backends", default="auto_fast,_native_cudnn,native")
    parser.add_argument("--inputs", choices=("noise", "local", "outlier", "offset"), default="noise")
    parser.add_argument("--tau", type=float, default=DEFAULT_TAU, help="sol_attn's routing threshold")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--fp8-parts", action="store_true", help="also time flash_3_fp8's stages apart")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    b, h, length, d = (int(x) for x in args.shape.split(","))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v = inputs(args.inputs, b, h, length, d, device, dtype)
    wanted = args.backends.split(",")
    skipped = {name: why for name in wanted if (why := cannot_run(name))}
    names = [name for name in wanted if name not in skipped]
    rows = sample_rows(length, 64)
    reference, _ = exact_attention(q, k, v, rows=rows, with_lse=False)
    recorder = dispatcher.Recorder()
    errors = {}
    with contextlib.ExitStack() as scopes:
        scopes.enter_context(dispatcher.model_scope(f"bench-{args.inputs}"))
        scopes.enter_context(dispatcher.recording(recorder))
        scopes.enter_context(sol_attn_options(args.tau))
        # A pinned kernel runs unguarded: its own time and error are what is measured (on outlier keys the guard
        # would rightly refuse a Sage kernel under 'strict' and end the run); the autos keep the guard they ship with.
        fns = [lambda name=name: dispatcher.dispatch_attention_fn(q, k, v, backend=name, policy="strict",
                                                                  guard=None if name in dispatcher.auto.PSEUDO_BACKENDS else "off")
               for name in names]
        for name, fn in zip(names, fns):
            out = fn()  # the autos decide here (timed and judged on these tensors)
            picked = out.transpose(1, 2)[:, :, rows.to(device)] if rows is not None else out.transpose(1, 2)
            errors[name] = float(f"{relative_error(picked.double(), reference):.3e}")
            del out, picked
        parts = fp8_parts(q, k, v) if args.fp8_parts and "flash_3_fp8" in names else {}
        times = time_interleaved(fns + list(parts.values()), device, warmup=3, runs=args.runs, target_s=0.2)
        times, part_times = times[:len(fns)], times[len(fns):]
    served = {row["requested"]: row["served"] for row in recorder.snapshot()["rows"]}
    result = {"shape_bhld": [b, h, length, d], "dtype": str(dtype).replace("torch.", ""), "runs": args.runs,
              "inputs": args.inputs, "grid": list(video_grid(length)) if args.inputs == "local" else None,
              "sol_attn_tau": args.tau,
              "ms": dict(zip(names, (round(t, 3) for t in times))),
              "tflops_equivalent": {name: round(4 * b * h * length * length * d / (t * 1e-3) / 1e12, 1)
                                    for name, t in zip(names, times)},
              "served": {name: served.get(name, name) for name in names},
              f"speedup_of_{names[0]}": {name: round(t / times[0], 4) for name, t in zip(names[1:], times[1:])},
              "rel_error_vs_float64": errors,
              **({"fp8_parts_ms": {part: round(t, 3) for part, t in zip(parts, part_times)}} if parts else {}),
              "skipped": skipped,
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              # why each auto picked what it did: every candidate's verdict, timing and reason
              "auto_explain": dispatcher.auto.explain().splitlines()}
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

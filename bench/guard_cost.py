"""What the quality guard adds to a sampling step, and what it lets through, measured on attention calls alone.

    python bench/guard_cost.py [--backend native] [--guard all] [--every 0] [--rounds 40] [--json PATH]
    python bench/guard_cost.py --scenario one-bad-block [--backend auto_fast] [--blocks 30] [--steps 20]
                               [--bad-block 7] [--bad-from-step 0] [--every 0] [--outlier 100] [--shared-site]
                               [--device cuda|cpu] [--kernel int8-sim] [--json PATH]
    python bench/guard_cost.py --scenario check-time [--shapes wan1.3b,wan14b,flux,sdxl,sdxl-cross] [--json PATH]
    python bench/guard_cost.py --scenario call-cost [--shapes wan14b] [--backend auto_fast] [--blocks 30] [--json PATH]

Cost (the default scenario, `sdxl-cost`): one "step" is the 140 attention calls of SDXL's UNet at 1024x1024 with
cfg batch 2, in the model's order and with its call sites, each block named as the ComfyUI node names it
("output.self #21"): 10 blocks at 4096 tokens and 60 at 1024, each a self-attention and a cross-attention on 77
text tokens. Steps with the guard off and on (`--guard`, `--every`: one call in N of each block after its first;
0, the default, sizes N on this machine from the first checks' timings) alternate, each sample timing `--steps` steps with CUDA events; the
medians give the guard's cost per step, in ms and as a share of a whole SDXL step (`--step-ms`, the model's
measured step time: bench/comfy_model_step.py --model sdxl). The model's other layers are left out on purpose:
the guard adds host and GPU work only to attention calls, and timed alone they show that added work without the
noise of a 60 ms step. The first step (every block's first-call check) is run before the timed ones and reported
apart (`first_step_checks`).

Spoiled calls (`one-bad-block`): `--blocks` self-attention blocks of WAN 2.1 1.3B's shape (32760 tokens, 12
heads of 128; `--tokens` to change it) share one signature; block `--bad-block` has keys with a large random-sign
outlier channel the queries ignore (`--outlier` times the keys' scale), so exact attention is unchanged there and
quantised kernels go far off (every Sage kernel 0.49 on the H200, FA3 2.3e-3). `--steps` forwards of all blocks,
with the guard at its default (or `--every`); from step `--bad-from-step` on (0: from the start) the bad block has
the outlier. Every output is compared with exact attention: a call past `--spoiled-at` (relative error) that the
caller got is a spoiled call. Reports the spoiled calls, in all and per block (the goal: 0 from the start; within
the rotation bound when the block turns bad mid-run), the checks per block, the interval the guard used (with
`--every 0` sized on this machine: the call's and the check's measured times, `sizing`) and the rotation bound it
reported ("each block checked again within N of its calls"), the guard's failures with their blocks, and who
served each block. `--kernel int8-sim` registers a quantised int8 kernel written here (per-tensor int8 q and k)
that fails on the outlier block the same way, for a CPU run (`--device cpu --tokens 1024 --heads 4 --head-dim 64`,
float32) or to compare; with an auto backend the tuner then has it alone to pick from (on a CPU SDPA beats it, where
Sage beats SDPA on a GPU), and `auto_exact`'s stand-in is SDPA. `--shared-site` runs it as a library user would: no
call_site, so every block shares the default site "attention" (no block index: the guard checks the site on a
schedule no number of blocks aliases with and demotes it as a whole, see docs/auto.md).

Check time (`check-time`): the guard's check (dispatcher/guard_check.py: the Triton kernel where triton imports,
else the torch path) on the shapes of WAN 1.3B and Wan 14B self-attention, Flux and SDXL, timed with CUDA events
per call (its verdict read, as the guard reads it) against the call it checks (`--backend`, default SDPA through
the dispatcher with the guard off), with the interval those times size (guard_sizing.interval_of), beside what the
cost model says (guard_sizing.check_seconds, call_seconds: the prior before a machine has timed its checks) and the
interval it gives; and a check's extra peak memory (torch.cuda.max_memory_allocated around one check). The figures
re-fit the cost model's provisional constants (dispatcher/guard_sizing.py).

The guard's cost on one shape's calls (`call-cost`, e.g. Wan 14B's self-attention): forwards of `--blocks` calls
of that shape (block i is call site "self #i"), with the guard off, at its default interval (sized on this machine:
`sizing` says from what), every second and every call, interleaved round by round in one run (`--rounds`): ms per
call, the added share over guard off, and checks per call.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import dispatcher  # noqa: E402
from output import emit  # noqa: E402  (bench/ is on sys.path when a script of it runs)
from timing import cpu_us_per_call, interleaved_ms  # noqa: E402

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
    index = 0  # the UNet's transformer_index: the node names a block "output.self #21.0" (the index, then the
    for blocks, tokens, heads, where in SDXL_BLOCKS:  # block inside its spatial transformer; here one each)
        for _ in range(blocks):
            calls.append((*qkv(tokens, tokens, heads), f"{where}.self #{index}.0"))
            calls.append((*qkv(tokens, 77, heads), f"{where}.cross #{index}.0"))
            index += 1
    return calls


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default="sdxl-cost", choices=("sdxl-cost", "one-bad-block", "check-time",
                                                                   "call-cost"))
    parser.add_argument("--backend", default=None, help="default: native (sdxl-cost), auto_fast (one-bad-block)")
    parser.add_argument("--guard", default=None, choices=("all", "quantised"),
                        help="default: all (sdxl-cost, to guard an exact kernel), quantised (one-bad-block)")
    parser.add_argument("--every", type=int, default=dispatcher.guard.DEFAULT_EVERY,
                        help="one call in N of each block after its first (0: sized on this machine)")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per timed sample (sdxl-cost, default 5); forwards (one-bad-block, default 20)")
    parser.add_argument("--step-ms", type=float, default=60.0, help="a whole SDXL step on this GPU, for the share")
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument("--bad-block", type=int, default=7)
    parser.add_argument("--bad-from-step", type=int, default=0)
    parser.add_argument("--outlier", type=float, default=100.0)
    parser.add_argument("--spoiled-at", type=float, default=dispatcher.guard.GUARD_MARGIN * dispatcher.guard.FAST_BOUND)
    parser.add_argument("--tokens", type=int, default=32760)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--kernel", choices=("int8-sim",), default=None,
                        help="register the simulated int8 kernel (and use it as --backend unless one is given)")
    parser.add_argument("--shared-site", action="store_true",
                        help="one-bad-block: no call_site (every block shares the default site, no block index)")
    parser.add_argument("--shapes", default=",".join(n for n in CHECK_SHAPES if n != "tiny"),
                        help="check-time, call-cost: which of " + ", ".join(CHECK_SHAPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.scenario == "one-bad-block":
        return one_bad_block(args)
    if args.scenario == "check-time":
        return check_time(args)
    if args.scenario == "call-cost":
        return call_cost(args)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    args.backend = args.backend or "native"
    args.guard = args.guard or "all"
    args.steps = args.steps or 5
    calls = sdxl_step_calls("cuda", torch.bfloat16)
    recorder = dispatcher.Recorder()
    settings = {"off": dict(guard="off"), "on": dict(guard=args.guard, guard_every=args.every)}

    def steps(setting, n=args.steps):
        for _ in range(n):
            for q, k, v, site in calls:
                dispatcher.dispatch_attention_fn(q, k, v, backend=args.backend, call_site=site, recorder=recorder,
                                                 model="bench-guard", **settings[setting])

    for setting in settings:  # decide every signature, make every block's first-call check
        steps(setting, 1)
    torch.cuda.synchronize()
    first_checks = sum(g["checks"] for g in recorder.snapshot()["guard"])
    med = {name: ms / args.steps for name, ms in
           interleaved_ms({name: (lambda name=name: steps(name)) for name in settings}, args.rounds).items()}
    checks = sum(g["checks"] for g in recorder.snapshot()["guard"]) - first_checks
    total_steps = args.steps * args.rounds
    added = med["on"] - med["off"]
    result = {"scenario": args.scenario, "backend": args.backend, "guard": args.guard, "every": args.every,
              "calls_per_step": len(calls), "first_step_checks": first_checks,
              "intervals": {"given": args.every} if args.every else {"sized": recorder.snapshot()["guard_sizing"]},
              "attention_ms_per_step": {k: round(v, 4) for k, v in med.items()},
              "checks_per_step": round(checks / total_steps, 3), "added_ms_per_step": round(added, 4),
              "added_ms_per_check": round(added / max(checks / total_steps, 1e-9), 4),
              "share_of_sdxl_step": round(added / args.step_ms, 5), "sdxl_step_ms": args.step_ms,
              "failures": sum(len(g["failures"]) for g in recorder.snapshot()["guard"]),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "rounds": args.rounds,
              "steps_per_sample": args.steps}
    emit(result, args.json)
    return 0


# (batch, tokens, heads, head dim, keys) of the calls the guard watches most (bf16, BSHD)
CHECK_SHAPES = {"wan1.3b": (1, 32760, 12, 128, 32760), "wan14b": (1, 32760, 40, 128, 32760),
                "flux": (1, 4608, 24, 128, 4608), "sdxl": (2, 4096, 10, 64, 4096), "sdxl-1024": (2, 1024, 20, 64, 1024),
                "sdxl-cross": (2, 1024, 20, 64, 77), "tiny": (1, 256, 2, 32, 256)}  # tiny: a CPU try of the scenario


def _sim_kernel(args, device) -> str | None:
    """With --kernel int8-sim: the simulated int8 kernel, registered for `device` (its name)."""
    if args.kernel != "int8-sim":
        return None
    if "bench_int8_sim" not in dispatcher.backend_names():
        dispatcher.register_backend("bench_int8_sim", int8_sim, devices=(device.type,), quantised=True,
                                    description="bench: per-tensor int8 q and k")
    return "bench_int8_sim"


def _device(args):
    """The device of a check-time or call-cost run (None, said why, when it has no GPU to run on)."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --device cpu with small --shapes, to try the scenario)", file=sys.stderr)
        return None
    return device


def _device_name(device) -> str:
    return torch.cuda.get_device_name() if device.type == "cuda" else "cpu"


def _qkv(b, lq, h, d, lk, device):
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.randn(b, lq, h, d, device=device, dtype=dtype, generator=gen)
    return (q, *(torch.randn(b, lk, h, d, device=device, dtype=dtype, generator=gen) for _ in range(2)))


def _ms(fns: dict, rounds: int, device) -> dict:
    """Median ms of each, interleaved: CUDA events on the GPU, the clock on the CPU."""
    if device.type == "cuda":
        return interleaved_ms(fns, rounds)
    return {name: us / 1e3 for name, us in cpu_us_per_call(fns, rounds, 1).items()}


def check_time(args) -> int:
    """The check's time and extra memory per call against the call it checks (see the module's docstring)."""
    device = _device(args)
    if device is None:
        return 2
    from dispatcher import guard, guard_check, guard_sizing
    from dispatcher.inputs import describe_call
    backend = args.backend or "native"
    rows = {}
    for name in [n for n in args.shapes.split(",") if n]:
        b, lq, h, d, lk = CHECK_SHAPES[name]
        q, k, v = _qkv(b, lq, h, d, lk, device)
        out = dispatcher.dispatch_attention_fn(q, k, v, backend=backend, guard="off")
        offset, stride = guard_check.rotating_rows(lq, guard.ROWS, "self #0", 0)

        def check():
            return guard_check.check_terms(q, k, v, out, offset=offset, stride=stride).tolist()

        def call():
            return dispatcher.dispatch_attention_fn(q, k, v, backend=backend, guard="off")

        check()  # compiles the kernel
        extra_mib = None
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            check()
            extra_mib = round((torch.cuda.max_memory_allocated() - base) / 2**20, 2)
        med = _ms({"check": check, "call": call}, args.rounds, device)
        inputs = describe_call(q, k, v, None, 0.0, False, None, False, False, "BSHD")
        rows[name] = {"shape_bshd": [b, lq, h, d], "len_kv": lk, "check_ms": round(med["check"], 4),
                      "call_ms": round(med["call"], 4), "check_share_of_call": round(med["check"] / med["call"], 4),
                      "measured_interval": guard_sizing.interval_of(med["call"] / 1e3, med["check"] / 1e3),
                      "model_check_ms": round(guard_sizing.check_seconds(inputs) * 1e3, 4),
                      "model_call_ms": round(guard_sizing.call_seconds(inputs) * 1e3, 4),
                      "model_interval": guard_sizing.interval(inputs), "check_extra_peak_mib": extra_mib,
                      "path": "triton" if guard_check.uses_kernel(q, k, v, None) else "torch"}
        print(name, rows[name])
        del q, k, v, out
    emit({"scenario": "check-time", "backend": backend, "rounds": args.rounds, "shapes": rows,
          "device": _device_name(device), "torch": torch.__version__,
          "triton": getattr(guard_check.triton, "__version__", None)}, args.json)
    return 0


def call_cost(args) -> int:
    """The guard's cost on one shape's calls, side by side (see the module's docstring)."""
    device = _device(args)
    if device is None:
        return 2
    backend = args.backend or _sim_kernel(args, device) or "auto_fast"
    settings = {"off": dict(guard="off"), "default": dict(guard="quantised", guard_every=0),
                "every 2": dict(guard="quantised", guard_every=2), "every 1": dict(guard="quantised", guard_every=1)}
    shapes = {}
    tuner = dispatcher.auto.Tuner(cache_path=None)  # this run's verdicts only
    for name in [n for n in args.shapes.split(",") if n]:
        b, lq, h, d, lk = CHECK_SHAPES[name]
        q, k, v = _qkv(b, lq, h, d, lk, device)
        recorders = {setting: dispatcher.Recorder(setting) for setting in settings}

        def forward(setting):
            for block in range(args.blocks):
                dispatcher.dispatch_attention_fn(q, k, v, backend=backend, call_site=f"self #{block}",
                                                 model=f"bench-call-cost-{name}", recorder=recorders[setting],
                                                 **settings[setting])

        with dispatcher.auto.using(tuner):
            for setting in settings:  # decide, tune, make every block's first-call check
                forward(setting)
            first = {s: sum(g["checks"] for g in r.snapshot()["guard"]) for s, r in recorders.items()}
            med = _ms({s: (lambda s=s: forward(s)) for s in settings}, args.rounds, device)
        calls = args.rounds * args.blocks
        checks = {s: sum(g["checks"] for g in r.snapshot()["guard"]) - first[s] for s, r in recorders.items()}
        shapes[name] = {
            "shape_bshd": [b, lq, h, d], "len_kv": lk, "blocks": args.blocks,
            "ms_per_call": {s: round(ms / args.blocks, 4) for s, ms in med.items()},
            "added_share": {s: round(med[s] / med["off"] - 1, 5) for s in settings if s != "off"},
            "checks_per_call": {s: round(checks[s] / calls, 4) for s in settings if s != "off"},
            "served": sorted({r["served"] for r in recorders["default"].snapshot()["rows"]}),
            "failures": {s: sum(len(g["failures"]) for g in r.snapshot()["guard"]) for s, r in recorders.items()},
            "sizing": recorders["default"].snapshot()["guard_sizing"]}
        print(name, shapes[name])
        del q, k, v
    emit({"scenario": "call-cost", "backend": backend, "rounds": args.rounds, "shapes": shapes,
          "device": _device_name(device), "torch": torch.__version__}, args.json)
    return 0


def int8_sim(q, k, v, *, attn_mask=None, scale=None, **_):
    """A quantised kernel for the bench (BSHD): q and k rounded to int8 with one scale per tensor, as a naive int8
    attention does (SageAttention smooths k and scales per block, and still fails on the outlier block)."""
    def quant(t):
        s = t.abs().amax().float().clamp_min(1e-6) / 127
        return ((t.float() / s).round() * s).to(t.dtype)
    out = torch.nn.functional.scaled_dot_product_attention(quant(q).transpose(1, 2), quant(k).transpose(1, 2),
                                                           v.transpose(1, 2), attn_mask=attn_mask, scale=scale)
    return out.transpose(1, 2)


def one_bad_block(args) -> int:
    """Spoiled calls with one bad block of `args.blocks` sharing a signature (see the module's docstring)."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --device cpu with --kernel int8-sim and small --tokens)", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sim = _sim_kernel(args, device)
    backend = args.backend or sim or "auto_fast"
    guard_mode = args.guard or "quantised"
    steps = args.steps or 20
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (1, args.tokens, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, generator=gen) for _ in range(3))
    channel = 0
    q[..., channel] = 0  # the queries ignore the outlier channel: exact attention is the same with and without it
    signs = torch.randint(0, 2, shape[:3], device=device, generator=gen).to(dtype) * 2 - 1
    k_bad = k.clone()
    k_bad[..., channel] = signs * args.outlier
    exact = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                             v.transpose(1, 2)).transpose(1, 2).float()
    exact_norm = exact.norm()
    recorder = dispatcher.Recorder("one-bad-block")
    spoiled, errors = [], {}
    spoiled_per_block, checks_per_block = [0] * args.blocks, [0] * args.blocks
    # A tuner of its own, in memory only: verdicts an earlier run left on disk would decide the blocks before this
    # run's scenario is seen (a second run with --bad-from-step reused the first run's demotion of the bad block).
    # With the simulated kernel it is the one candidate (a CPU's SDPA is faster than it; Sage beats SDPA on a GPU).
    tuner = dispatcher.auto.Tuner(cache_path=None, backends=(sim,) if sim else None)
    checked = _checks(recorder)
    with dispatcher.auto.using(tuner), dispatcher.model_scope("bench-one-bad-block"), dispatcher.recording(recorder):
        for step in range(steps):
            for block in range(args.blocks):
                bad = block == args.bad_block and step >= args.bad_from_step
                site = {} if args.shared_site else {"call_site": f"self #{block}"}
                out = dispatcher.dispatch_attention_fn(q, k_bad if bad else k, v, backend=backend, guard=guard_mode,
                                                       guard_every=args.every, **site)
                error = float((out.float() - exact).norm() / exact_norm)
                if not error <= args.spoiled_at:
                    spoiled.append({"step": step, "block": block, "rel_error": error})
                    spoiled_per_block[block] += 1
                before, checked = checked, _checks(recorder)
                checks_per_block[block] += checked - before
                key = "bad" if bad else "good"
                errors[key] = max(errors.get(key, 0.0), error)
    snapshot = recorder.snapshot()
    sizing = [s for s in snapshot["guard_sizing"] if s["backend"] == _guarded(snapshot)]
    bounds = [g["every"] for g in snapshot["guard"] if g["every"]]
    result = {"scenario": args.scenario, "backend": backend, "guard": guard_mode, "every": args.every,
              # the interval the guard used: the one given, else sized on this machine (None: it never got there)
              "interval": args.every or (sizing[0]["interval"] if sizing else None),
              "interval_source": "given" if args.every else ("measured" if sizing else "prior"),
              "sizing": sizing, "rotation_bound": max(bounds) if bounds else None,
              "rotation": dispatcher.report.rotation_text(max(bounds)) if bounds else None,
              "blocks": args.blocks, "steps": steps,
              "calls": steps * args.blocks, "bad_block": args.bad_block, "bad_from_step": args.bad_from_step,
              "outlier": args.outlier, "spoiled_at": args.spoiled_at, "spoiled_calls": len(spoiled),
              "spoiled_per_block": spoiled_per_block, "checks_per_block": checks_per_block,
              "spoiled": spoiled[:50], "max_rel_error_served": errors,
              "guard_checks": sum(g["checks"] for g in snapshot["guard"]),
              "guard_failures": [{"site": g["site"], "backend": g["backend"], **f}
                                 for g in snapshot["guard"] for f in g["failures"]],
              "shared_site": args.shared_site,
              "served": {f"{r['site']}": r["served"] for r in snapshot["rows"]
                         if r["site"] == f"self #{args.bad_block}" or r["served"] != backend},
              "served_calls": {name: sum(r["calls"] for r in snapshot["rows"] if r["served"] == name)
                               for name in {r["served"] for r in snapshot["rows"]}},
              "guard_report": [line.strip() for line in recorder.summary().splitlines() if "quality guard" in line],
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "shape_bshd": list(shape), "dtype": str(dtype)}
    if backend in dispatcher.auto.PSEUDO_BACKENDS:
        result["auto_blocks"] = {r.block: r.chosen for r in tuner.records() if r.block}
    emit(result, args.json)
    return 0


def _checks(recorder) -> int:
    """The guard's checks so far (passed and failed): after each call, whether that call was checked."""
    return sum(g["checks"] for g in recorder.snapshot()["guard"])


def _guarded(snapshot) -> str | None:
    """The kernel the guard watched (the one it checked most)."""
    checks = {}
    for g in snapshot["guard"]:
        checks[g["backend"]] = checks.get(g["backend"], 0) + g["checks"]
    return max(checks, key=checks.get) if checks else None


if __name__ == "__main__":
    sys.exit(main())

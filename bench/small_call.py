"""A small attention call through the pack against a bare SDPA call on the same views, on a GPU.

    python bench/small_call.py [--shape 2,20,1024,64] [--rounds 30] [--calls 200] [--json PATH]
                               [--breakdown] [--order found|sdpa|cudnn] [--inference-mode] [--profile]
                               [--device cuda|cpu] [--before DIR] [--stat median|min]

SDXL's 32x32 level, (B, H, L, D) = (2, 20, 1024, 64), takes tens of microseconds on an H200: the host work
per call decides whether the GPU waits. ComfyUI hands (B, L, H*D) tensors; configurations, interleaved in a
shuffled order every round, each time `calls` back-to-back calls (CUDA events around the batch):
- bare: `F.scaled_dot_product_attention` on the (B, H, L, D) views (what ComfyUI's own path ends in);
- dispatcher: `dispatch_attention_fn` on the (B, L, H, D) views, the default backend;
- override: the ComfyUI override (nodes/adapter.py) as ComfyUI calls it, backend "native";
- comfy: ComfyUI's own `attention_pytorch` on the same (B, L, H*D) tensors, when COMFYUI_PATH names a ComfyUI;
- comfy_optimized: ComfyUI's `optimized_attention` (the function its models call, chosen at import for this
  machine, with its override check) on the same call: the fair anchor for the override's host time.
The ratio bare/x is the fraction of the bare call's speed the pack reaches (1.0 = no cost). `host_us` is each
one's host time per call measured while the GPU is kept busy (so the host never waits): when it exceeds the
kernel's GPU time, the host, not the kernel, sets the pace.

--breakdown: where the pack's host time per call goes, by timing the repeat path with its outer layers peeled off
one at a time (`breakdown_layers`; `host_us` gets each layer, `breakdown_us` the differences, `increments`): the
four views a (B, L, H, D) caller's call takes (3 in, 1 out), `native`'s GPU branch (SDPA's priority order),
`execute.run_tensors` on the decided candidate, the eager path's lookup, the entry, the override over the prepared
call it makes, and the override in a model (SDXL's block options, the node's recorder). --order sets SDPA's priority
order first: `sdpa` = torch's own (flash first: what a ComfyUI process with the override has, so `native` writes
cuDNN-first and back on every call), `cudnn` = cuDNN first (nothing written), `found` = leave it.
--inference-mode runs every call under torch.inference_mode(), as ComfyUI samples. --profile adds torch.profiler's
host-side table (self CPU time per call of each op) and the Python functions and builtins one call runs
(`python_calls`) for bare, dispatcher, override.
--before DIR: also the dispatcher and the override of the pack in another checkout (e.g. `git archive` of main),
imported beside this one and interleaved with it ("before_dispatcher", "before_override"; with --breakdown also
"before_override_model"): a change measured in one run, under the same load.
The JSON names the code measured by its commit (`pack`, `before`: bench/checkout.py), not by its folder.
--device cpu: the same configurations on float32 CPU tensors, timed by the clock alone (median_us = host_us): the
Python layers cost what they cost on a GPU's host, less the GPU-only work (the breakdown's runner line); --stat min
takes each configuration's fastest round instead of the median, on a CPU machine shared with other work.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from checkout import revision  # bench/ is on sys.path when a script of it runs
from comfy_model_step import ROOT, load_pack
from output import emit
from timing import cpu_us_per_call, host_us_per_call, interleaved_ms


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="2,20,1024,64", help="B,H,L,D")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json")
    parser.add_argument("--pack", type=Path, default=ROOT, help="measure the pack in this folder")
    parser.add_argument("--breakdown", action="store_true", help="host time per layer of the repeat path")
    parser.add_argument("--order", choices=sorted(ORDERS), default="found", help="SDPA's priority order to set first")
    parser.add_argument("--inference-mode", action="store_true", help="every call under torch.inference_mode()")
    parser.add_argument("--profile", action="store_true", help="torch.profiler's host-side table per configuration")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--stat", choices=("median", "min"), default="median",
                        help="--device cpu: per configuration, over rounds (min: a loaded machine disturbs it least)")
    parser.add_argument("--before", type=Path, help="also measure the pack in this folder, side by side in the run")
    args = parser.parse_args(argv)
    if args.inference_mode:
        with torch.inference_mode():
            return measure(args)
    return measure(args)


def measure(args) -> int:
    b, h, length, d = (int(x) for x in args.shape.split(","))
    adapter, dispatcher = load_pack(args.pack)
    set_order(args.order)
    cuda = args.device == "cuda"
    if not cuda:
        torch.set_num_threads(1)  # the least noise (as bench/hot_path.py): the kernel's threads are not what is timed
    dtype = torch.bfloat16 if cuda else torch.float32
    gen = torch.Generator(device=args.device).manual_seed(0)
    q3, k3, v3 = (torch.randn(b, length, h * d, device=args.device, dtype=dtype, generator=gen) for _ in range(3))
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
    if args.before is not None:  # another checkout's pack, interleaved with this one's
        before_adapter, before_dispatcher = load_pack(args.before, "attention_dispatch_pack_before")
        before_override = before_adapter.make_override("native")
        fns["before_dispatcher"] = lambda: before_dispatcher.dispatch_attention_fn(q4, k4, v4)
        fns["before_override"] = lambda: before_override(comfy_func, q3, k3, v3, h, transformer_options={})
    comfy = comfy_attention()
    optimized = None
    if comfy is not None:  # what ComfyUI runs without the pack, on the same (B, L, H*D) tensors
        comfy, optimized = comfy
        fns["comfy"] = lambda: comfy(q3, k3, v3, h)
        fns["comfy_optimized"] = lambda: optimized(q3, k3, v3, h, transformer_options={})
    # Where the host time goes, layer by layer (host_us only): the pack's SDPA runner alone, and SDPA with the
    # cuDNN-first priority the runner sets (flipped per call, as the runner does, and held for the whole loop).
    native = sys.modules[f"{dispatcher.__name__}.backends.native"]
    layers = {
        "runner": lambda: native.sdpa_attention(qb, kb, vb, attn_mask=None, dropout_p=0.0, is_causal=False,
                                                scale=None, enable_gqa=False, return_lse=False),
        "priority_flip": lambda: native._select(native.CUDA_PRIORITY, True,
                                                lambda: F.scaled_dot_product_attention(qb, kb, vb)),
    }
    if args.breakdown:
        layers.update(breakdown_layers(dispatcher, q4, k4, v4))
        if not cuda:  # what the runner's GPU branch costs in Python, on these CPU tensors (SDPA's order read, ...)
            layers["gpu_branch"] = lambda: native._sdpa_cuda(qb, kb, vb, None, 0.0, False, None, False)
        # the override as a model's call reaches it: SDXL's block options (a block name per call) and the node's recorder
        in_model = adapter.make_override("native", recorder=dispatcher.Recorder("small_call"))
        layers["override_model"] = lambda: in_model(comfy_func, q3, k3, v3, h, transformer_options=SDXL_OPTIONS)
        if args.before is not None:
            before_model = before_adapter.make_override("native", recorder=before_dispatcher.Recorder("small_call"))
            layers["before_override_model"] = lambda: before_model(comfy_func, q3, k3, v3, h,
                                                                   transformer_options=SDXL_OPTIONS)
    # The pack's `native` tries cuDNN first on GPUs (as ComfyUI does): its output is SDPA's under that order, which
    # is bare SDPA's too unless --order put another kernel first (then bare runs that one: its own rounding).
    ref = layers["priority_flip"]().transpose(1, 2).flatten(2)
    torch.testing.assert_close(fns["bare"]().transpose(1, 2).flatten(2), ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fns["dispatcher"]().flatten(2), ref, rtol=0, atol=0)
    torch.testing.assert_close(fns["override"](), ref, rtol=0, atol=0)
    for name in ("before_dispatcher", "before_override", "before_override_model"):
        if name in fns or name in layers:
            out = (fns.get(name) or layers[name])()
            torch.testing.assert_close(out.flatten(2) if out.ndim == 4 else out, ref, rtol=0, atol=0)
    if "comfy" in fns:
        torch.testing.assert_close(fns["comfy"](), ref, rtol=2e-2, atol=2e-2)  # its own kernel choice
        torch.testing.assert_close(fns["comfy_optimized"](), ref, rtol=2e-2, atol=2e-2)
    for name in BREAKDOWN + ("override_model",) if args.breakdown else ():
        out = layers[name]()
        exact = name != "views"  # bare SDPA on the views: its own kernel under --order, like "bare"
        torch.testing.assert_close((out.transpose(1, 2) if name == "prepared" else out).flatten(2), ref,
                                   rtol=0 if exact else 2e-2, atol=0 if exact else 2e-2)
    for fn in fns.values():
        for _ in range(50):
            fn()
    if cuda:
        torch.cuda.synchronize()
        med = {name: ms * 1e3 for name, ms in interleaved_ms(fns, args.rounds, args.calls).items()}  # µs
        host = host_us_per_call({**fns, **layers}, args.rounds, min(args.calls, 100))
    else:  # the CPU computes as it goes: its clock time is its host time
        host = cpu_us_per_call({**fns, **layers}, args.rounds, min(args.calls, 100),
                               stat=min if args.stat == "min" else statistics.median)
        med = {name: host[name] for name in fns}
    extra = {}
    if args.breakdown:
        extra["breakdown_us"] = {k: round(v, 3) for k, v in increments(host).items()}
    if args.profile:
        extra["profile"] = {name: host_profile(fns[name]) for name in ("bare", "dispatcher", "override")}
        extra["python_calls"] = {name: python_calls(fns[name]) for name in ("bare", "dispatcher", "override")}
    result = {"shape_bhld": [b, h, length, d], "dtype": str(dtype).replace("torch.", ""), "device": args.device,
              "median_us": {k: round(v, 3) for k, v in med.items()},
              "sdpa_priority_order": torch._C._get_sdp_priority_order(), "order_set": args.order,
              "inference_mode": torch.is_inference_mode_enabled(), **({"statistic": args.stat} if not cuda else {}),
              **({"comfy_optimized_is": getattr(optimized, "__name__", "?")} if optimized is not None else {}),
              **({"kernels": {name: gpu_kernels(fn) for name, fn in fns.items()}} if cuda else {}),
              "bare_over_dispatcher": round(med["bare"] / med["dispatcher"], 4),
              "bare_over_override": round(med["bare"] / med["override"], 4),
              **({"comfy_over_override": round(med["comfy"] / med["override"], 4),
                  "override_minus_comfy_optimized_host_us": round(host["override"] - host["comfy_optimized"], 3),
                  "dispatcher_minus_bare_host_us": round(host["dispatcher"] - host["bare"], 3)}
                 if "comfy" in med else {"dispatcher_minus_bare_host_us": round(host["dispatcher"] - host["bare"], 3)}),
              **({"before_minus_after_host_us": {name: round(host[f"before_{name}"] - host[name], 3)
                                                  for name in ("dispatcher", "override", "override_model")
                                                  if f"before_{name}" in host}, "before": revision(args.before)}
                 if args.before is not None else {}),
              "host_us": {k: round(v, 3) for k, v in host.items()},
              "gpu": torch.cuda.get_device_name() if cuda else None, "torch": torch.__version__, "rounds": args.rounds,
              "calls": args.calls, "pack": revision(args.pack), **extra}
    emit(result, args.json)
    return 0


# SDPA's priority orders --order sets: torch's own (what a process has unless something set another) and cuDNN first
# (what `native` asks for on GPUs, so it writes nothing).
ORDERS = {"found": None, "sdpa": ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH", "CUDNN_ATTENTION"),
          "cudnn": ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")}


def set_order(name: str) -> None:
    first = ORDERS[name]
    if first is None:
        return
    from torch.nn.attention import SDPBackend
    order = [int(getattr(SDPBackend, member)) for member in first]
    torch._C._set_sdp_priority_order(order + [p for p in torch._C._get_sdp_priority_order() if p not in order])


# What SDXL's UNet passes an input block's attention (ComfyUI 0.3.64: openaimodel.py, attention.py): the override
# names the block "#3.0" from it on every call.
SDXL_OPTIONS = {"block": ("input", 4), "block_index": 0, "transformer_index": 3, "cond_or_uncond": [1, 0]}
BREAKDOWN = ("views", "run", "eager", "prepared")  # breakdown_layers' names ("prepared" returns (B, H, L, D))


def breakdown_layers(dispatcher, q4, k4, v4) -> dict:
    """The repeat path of `dispatch_attention_fn(q4, k4, v4)` ((B, L, H, D) views) with its outer layers peeled off,
    each returning the same tensor: "views" (bare SDPA plus the four views a (B, L, H, D) call takes), "run" (the
    decided candidate through `execute.run_tensors`, on a site made once, as the eager path runs it), "eager" (the
    eager path on that call), and "prepared" (the call the override makes, on (B, H, L, D) views: no view of its own).
    With "bare", "runner", "dispatcher" and "override" from main, `increments` attributes the host time."""
    modules = sys.modules
    eager, execute = modules[f"{dispatcher.__name__}.eager"], modules[f"{dispatcher.__name__}.execute"]
    call_type = modules[f"{dispatcher.__name__}.call"].AttentionCall
    sdpa = F.scaled_dot_product_attention
    dispatcher.dispatch_attention_fn(q4, k4, v4)  # decided: its candidate is the one the repeat calls run
    lanes = [d.lane for d in eager._fast.values() if getattr(d, "lane", None) is not None and d.lane.transpose]
    call = call_type(q4, k4, v4)
    site = call.site
    qb, kb, vb = (t.transpose(1, 2) for t in (q4, k4, v4))
    prepared = dispatcher.PreparedAttention(layout="BHSD")
    return {
        "views": lambda: sdpa(q4.permute(0, 2, 1, 3), k4.permute(0, 2, 1, 3), v4.permute(0, 2, 1, 3)).permute(0, 2, 1, 3),
        "run": lambda: execute.run_tensors(lanes[0], q4, k4, v4, None, site),
        "eager": lambda: eager.dispatch_eager(call),
        "prepared": lambda: prepared(qb, kb, vb),
    }


def increments(host: dict) -> dict:
    """Host us per call added by each layer, from `host_us` of the breakdown's configurations."""
    return {
        "views (3 in, 1 out)": host["views"] - host["bare"],
        "native runner (on a GPU: SDPA's priority order)": host["runner"] - host["bare"],
        "execute.run": host["run"] - host["views"] - (host["runner"] - host["bare"]),
        "eager path (lookup, scope, fast lane)": host["eager"] - host["run"],
        "entry (dispatch_attention_fn)": host["dispatcher"] - host["eager"],
        "prepared call on (B, H, L, D) views": host["prepared"] - host["bare"],
        "override over its prepared call (4 views, plan)": host["override"] - host["prepared"],
        **({"override in a model (block name, the node's recorder)": host["override_model"] - host["override"]}
           if "override_model" in host else {}),
    }


def python_calls(fn, calls: int = 10) -> dict[str, float]:
    """Every Python function and builtin one call of `fn` runs, with how many times (sys.setprofile: the inventory
    of a repeat call, e.g. a torch.cuda query or a context manager that should not be there), most frequent first."""
    import collections
    import types
    counts: collections.Counter = collections.Counter()

    def seen(frame, event, arg):
        if event == "call":
            code = frame.f_code
            counts[f"{Path(code.co_filename).name}:{code.co_name}"] += 1
        elif event == "c_call" and arg is not sys.setprofile:
            owner = getattr(arg, "__self__", None)
            if owner is None or isinstance(owner, types.ModuleType):
                prefix = getattr(arg, "__module__", None) or "builtins"
            else:
                prefix = owner.__name__ if isinstance(owner, type) else type(owner).__name__
            counts[f"{prefix}.{getattr(arg, '__name__', '?')}"] += 1

    fn()
    sys.setprofile(seen)
    try:
        for _ in range(calls):
            fn()
    finally:
        sys.setprofile(None)
    return {name: n / calls for name, n in counts.most_common() if name != "small_call.py:<lambda>"}


def host_profile(fn, calls: int = 50, rows: int = 25) -> list[dict]:
    """torch.profiler's host-side account of `calls` calls of `fn`: self CPU us per call of each op (aten ops and
    CUDA runtime calls), the most expensive first. The profiler slows every op: compare rows, not totals."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    fn()
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:rows]
    return [{"name": e.key[:80], "count_per_call": round(e.count / calls, 2),
             "self_cpu_us_per_call": round(e.self_cpu_time_total / calls, 3)} for e in events]


def gpu_kernels(fn) -> list[str]:
    """The names of the GPU kernels one call of `fn` launches (which SDPA kernel each configuration ran)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name[:80] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})


def comfy_attention():
    """(ComfyUI's `attention_pytorch`, its `optimized_attention`) from COMFYUI_PATH, or None."""
    path = os.environ.get("COMFYUI_PATH")
    if not path:
        return None
    sys.argv = sys.argv[:1]
    sys.path.insert(0, path)
    import comfy.options
    comfy.options.enable_args_parsing()
    if not torch.cuda.is_available() and "--cpu" not in sys.argv:
        sys.argv.append("--cpu")  # ComfyUI's device setup, as main.py parses it
    from comfy.ldm.modules.attention import attention_pytorch, optimized_attention
    return attention_pytorch, optimized_attention


if __name__ == "__main__":
    sys.exit(main())

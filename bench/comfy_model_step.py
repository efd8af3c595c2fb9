"""One diffusion step of a model built with ComfyUI's own classes at real size, random weights:
ComfyUI's default attention against the pack's override (`auto` and single backends).
WAN 2.1 1.3B at 480p x 81 frames (32760 tokens: large kernels), Flux dev at 1024x1024 (4096 image + 512 text
tokens, 57 blocks), the SDXL UNet at 1024x1024 or the SD1.5 UNet at 512x512, both with cfg batch 2 (kernels of
0.03-0.2 ms, where the per-call cost of the Python around them shows).

    COMFYUI_PATH=/path/to/ComfyUI python bench/comfy_model_step.py --model sdxl --json out.json
    (--model tiny, tiny-sd1.5 or tiny-flux for a CPU smoke run)

--table runs every model of --models (default sd1.5,sdxl,flux,wan1.3b) for ComfyUI's own attention, each exact
kernel that can run here pinned (policy strict; --kernels names them), auto_exact and auto_fast, eager, and compiled
for the models of --compiled-models (default wan1.3b,flux), and writes one table (--json; bench/step_table.py draws
its chart and fills the README's slot); --modes eager or compiled runs one mode only:

    COMFYUI_PATH=/path/to/ComfyUI python bench/comfy_model_step.py --table --runs 20 --json step-table.json

--backends takes backend names, each optionally with a quality-guard setting: `auto_fast:guard=off`,
`sage:guard=all/10` (mode/every; without one, the guard's default: quantised kernels, the interval sized by each
call's cost). Each guarded configuration reports the guard's checks in the warm-up step (every block's first
call) and per timed step, the blocks it checked and its failures with their blocks (`guard_summary`), so the
guard's cost reads side by side: `--backends auto_fast,auto_fast:guard=off`.
`auto_fast:verdict` asks for the prediction-level verdict on approximate kernels (dispatcher/prediction.py) as the
Set Attention Backend node does: its first warm-up forward runs the model with them refused and allowed, keeps one,
and the JSON's `sparse_verdicts` says what it admitted or refused and how far the prediction moved.
`--steps N` also runs N Euler steps of a sampling run from the same start for every configuration and reports
how far each final latent is from `auto_exact`'s and from ComfyUI's default.
`--compile` times the model under torch.compile (inductor) instead and counts its graph breaks.

It imports ComfyUI from COMFYUI_PATH at run time (nothing of ComfyUI lives in this repository) and
the pack from this checkout, and times the model's forward pass with CUDA events.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {  # WAN 2.1 t2v 1.3B at 480p x 81 frames: latent (16, 21, 60, 104) -> 32760 tokens
    "wan1.3b": dict(dim=1536, ffn_dim=8960, num_heads=12, num_layers=30, latent=(16, 21, 60, 104)),
    "tiny": dict(dim=256, ffn_dim=512, num_heads=2, num_layers=2, latent=(16, 2, 8, 8)),
    # ComfyUI's SD1.5 UNet config (model_detection.py), cond + uncond at 512x512 -> latent 64x64
    "sd1.5": dict(unet=dict(use_checkpoint=False, image_size=32, out_channels=4, use_spatial_transformer=True,
                            legacy=False, adm_in_channels=None, in_channels=4, model_channels=320,
                            num_res_blocks=[2, 2, 2, 2], transformer_depth=[1, 1, 1, 1, 1, 1, 0, 0],
                            channel_mult=[1, 2, 4, 4], transformer_depth_middle=1, use_linear_in_transformer=False,
                            context_dim=768, num_heads=8,
                            transformer_depth_output=[1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
                            use_temporal_attention=False, use_temporal_resblock=False), latent=(2, 4, 64, 64)),
    "tiny-sd1.5": dict(unet=dict(use_checkpoint=False, image_size=32, out_channels=4, use_spatial_transformer=True,
                                 legacy=False, adm_in_channels=None, in_channels=4, model_channels=32,
                                 num_res_blocks=[1, 1], transformer_depth=[1, 1, 0, 0], channel_mult=[1, 2],
                                 transformer_depth_middle=1, use_linear_in_transformer=False, context_dim=64,
                                 num_heads=2, transformer_depth_output=[1, 1, 1, 0, 0, 0],
                                 use_temporal_attention=False, use_temporal_resblock=False), latent=(2, 4, 16, 16)),
    # Flux dev (model_detection.py: hidden 3072, 24 heads, 19 double and 38 single blocks), 1024x1024 -> latent
    # 16x128x128, 2x2 patches: 4096 image tokens and 512 text tokens; guidance distilled, one batch (no cfg)
    "flux": dict(flux=dict(in_channels=16, out_channels=16, vec_in_dim=768, context_in_dim=4096, hidden_size=3072,
                           mlp_ratio=4.0, num_heads=24, depth=19, depth_single_blocks=38, axes_dim=[16, 56, 56],
                           theta=10000, patch_size=2, qkv_bias=True, guidance_embed=True),
                 latent=(1, 16, 128, 128), text=512),
    "tiny-flux": dict(flux=dict(in_channels=16, out_channels=16, vec_in_dim=32, context_in_dim=64, hidden_size=64,
                                mlp_ratio=2.0, num_heads=2, depth=1, depth_single_blocks=1, axes_dim=[4, 14, 14],
                                theta=10000, patch_size=2, qkv_bias=True, guidance_embed=True),
                      latent=(1, 16, 16, 16), text=8),
    # ComfyUI's SDXL UNet config (model_detection.py), cond + uncond at 1024x1024 -> latent 128x128
    "sdxl": dict(unet=dict(use_checkpoint=False, image_size=32, out_channels=4, use_spatial_transformer=True,
                           legacy=False, num_classes="sequential", adm_in_channels=2816, in_channels=4,
                           model_channels=320, num_res_blocks=[2, 2, 2], transformer_depth=[0, 0, 2, 2, 10, 10],
                           channel_mult=[1, 2, 4], transformer_depth_middle=10, use_linear_in_transformer=True,
                           context_dim=2048, num_head_channels=64,
                           transformer_depth_output=[0, 0, 0, 2, 2, 2, 10, 10, 10], use_temporal_attention=False,
                           use_temporal_resblock=False), latent=(2, 4, 128, 128)),
}


def load_pack(folder: Path = ROOT, name: str = "attention_dispatch_pack"):
    """(adapter, dispatcher) of the pack in `folder`, imported as a package the way ComfyUI loads it (as `name`:
    another name imports a second checkout beside the first, for a before/after in one run)."""
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    pack = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = pack
    spec.loader.exec_module(pack)
    return importlib.import_module(f"{name}.nodes.adapter"), importlib.import_module(f"{name}.dispatcher")


def build_model(cfg: dict, device: str, dtype, operations):
    """(model, positional inputs, keyword inputs) of one step, random weights and inputs."""
    import torch
    if "unet" in cfg:
        from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel
        model = UNetModel(**cfg["unet"], dtype=dtype, device=device, operations=operations)
        batch = cfg["latent"][0]
        inputs = (torch.randn(*cfg["latent"], device=device, dtype=dtype), torch.full((batch,), 500.0, device=device))
        extra = {"context": torch.randn(batch, 77, cfg["unet"]["context_dim"], device=device, dtype=dtype)}
        if cfg["unet"].get("adm_in_channels"):  # SDXL's pooled text and size conditioning; SD1.5 has none
            extra["y"] = torch.randn(batch, cfg["unet"]["adm_in_channels"], device=device, dtype=dtype)
    elif "flux" in cfg:
        from comfy.ldm.flux.model import Flux
        params = cfg["flux"]
        model = Flux(dtype=dtype, device=device, operations=operations, **params)
        batch = cfg["latent"][0]
        inputs = (torch.randn(*cfg["latent"], device=device, dtype=dtype), torch.full((batch,), 0.5, device=device),
                  torch.randn(batch, cfg["text"], params["context_in_dim"], device=device, dtype=dtype))
        extra = {"y": torch.randn(batch, params["vec_in_dim"], device=device, dtype=dtype),
                 "guidance": torch.full((batch,), 3.5, device=device)}
    else:
        from comfy.ldm.wan.model import WanModel
        model = WanModel(model_type="t2v", dim=cfg["dim"], ffn_dim=cfg["ffn_dim"], num_heads=cfg["num_heads"],
                         num_layers=cfg["num_layers"], device=device, dtype=dtype, operations=operations)
        inputs = (torch.randn(1, *cfg["latent"], device=device, dtype=dtype), torch.tensor([500.0], device=device),
                  torch.randn(1, 512, 4096, device=device, dtype=dtype))
        extra = {}
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model.eval(), inputs, extra


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(CONFIGS), default="wan1.3b")
    parser.add_argument("--backends", default="auto_exact,auto_fast,native,_native_cudnn,_flash_3,flex,sage")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed forwards per configuration first: auto tunes in the first and decides for the "
                             "model's step at the start of the second")
    parser.add_argument("--steps", type=int, default=0, help="also run a sampling run of this many Euler steps")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model; count graph breaks")
    parser.add_argument("--table", action="store_true", help="the models x attention table (see the docstring)")
    parser.add_argument("--models", default="sd1.5,sdxl,flux,wan1.3b", help="--table: the models")
    parser.add_argument("--compiled-models", default="wan1.3b,flux", help="--table: the models also timed compiled")
    parser.add_argument("--modes", default="eager,compiled",
                        help="--table: eager, compiled (for --compiled-models) or both; one mode of a model fits a "
                             "short GPU run (bench/gpu_run.py splits the table so)")
    parser.add_argument("--kernels", default=None,
                        help="--table: the exact kernels pinned (default: every exact kernel that can run here)")
    parser.add_argument("--json")
    args = parser.parse_args()
    comfy_path = os.environ.get("COMFYUI_PATH")
    if not comfy_path:
        print("set COMFYUI_PATH to a ComfyUI checkout", file=sys.stderr)
        return 2
    import torch

    # ComfyUI reads its flags only when args parsing is enabled (main.py does that); --cpu without a GPU.
    sys.argv = [sys.argv[0]] + ([] if torch.cuda.is_available() else ["--cpu"])
    sys.path.insert(0, comfy_path)
    import comfy.options
    comfy.options.enable_args_parsing()
    import comfy.ops

    adapter, dispatcher = load_pack()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    operations = comfy.ops.disable_weight_init
    if args.table:
        return table(args, adapter, dispatcher, device, dtype, operations)
    cfg = CONFIGS[args.model]
    torch.manual_seed(0)
    forward_args = build_model(cfg, device, dtype, operations)
    configs = {"comfy default": ({}, None)}
    judged = {}  # config -> its model key, for the configurations that ask for the prediction-level verdict
    for entry in [b for b in args.backends.split(",") if b]:
        backend, _, option = entry.removesuffix(":verdict").partition(":guard=")
        mode, _, every = option.partition("/")
        if backend not in dispatcher.auto.PSEUDO_BACKENDS and dispatcher.availability_reasons(backend):
            print(f"{backend:16} unavailable: {'; '.join(dispatcher.availability_reasons(backend))[:90]}")
            continue
        guard = dict(guard=mode or None, guard_every=int(every) if every else None)
        model = f"{args.model}-verdict" if entry.endswith(":verdict") else args.model  # its own verdicts
        configs[entry] = make_config(adapter, dispatcher, model, backend, entry, **guard)
        if model != args.model:
            judged[entry] = f"bench-{model}"
            dispatcher.prediction.require(judged[entry])
    if args.compile:
        rows = compiled_step(args.runs, forward_args, configs, device)
        if args.json:
            Path(args.json).write_text(json.dumps({"model": args.model, "compiled": True, "torch": torch.__version__,
                                                   "rows": rows}, indent=1, default=str))
        return 0
    rows, warmup_checks, failed, verdicts = eager_step(args.runs, args.warmup, forward_args, configs, device, judged)
    for row in rows:
        recorder = configs[row["attention"]][1]
        if recorder is not None:
            row["guard"] = recorder.snapshot()["guard"]
            row["guard_summary"] = guard_summary(row["guard"], warmup_checks[row["attention"]], args.runs)
            print(f"{row['attention']:16} guard: {row['guard_summary']['text']}")
    report = None
    if any(name.split(":")[0] in dispatcher.auto.PSEUDO_BACKENDS for name in configs):
        report = dispatcher.auto.report()  # per signature: every candidate's error on the model's own values
        print(dispatcher.auto.explain())
    sampling = sampling_run(args.steps, forward_args, configs) if args.steps else None
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": args.model, "config": cfg, "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
            "torch": torch.__version__, "dtype": str(dtype), "runs": args.runs, "rows": rows, "failed": failed,
            "tuning": report, "sampling": sampling, "sparse_verdicts": verdicts,
            "packages": dispatcher.current_machine().packages},
            indent=1, default=str))
    return 0


def make_config(adapter, dispatcher, model: str, backend: str, label: str, policy: str = "fallback", **guard):
    """(transformer_options with the pack's override for `backend`, its recorder)."""
    recorder = dispatcher.Recorder(label)
    override = adapter.make_override(backend, policy, recorder, model=f"bench-{model}", **guard)
    return {"optimized_attention_override": override}, recorder


def eager_step(runs: int, warmup: int, forward_args, configs: dict, device: str, judged: dict | None = None):
    """(rows, guard checks in the warm-up per configuration, {configuration: error} of those that failed,
    {configuration: its prediction-level verdict} of those in `judged` (configuration -> model key)): each
    configuration's median step time, its speed-up over ComfyUI's own attention and its output's relative
    difference to it, what served its calls. Warm-up forwards each first (`auto` tunes, flex compiles), then rounds
    that run every configuration once in turn: drift of the host or the GPU clock hits all of them alike (the SDXL
    step is partly CPU-bound). A configuration that raises (a kernel pinned with policy strict that cannot run a
    call) is dropped with its error."""
    import torch
    from attention_dispatch_pack.dispatcher import prediction_trial
    from attention_dispatch_pack.dispatcher.reference import relative_error
    from attention_dispatch_pack.dispatcher.tools.bench import sample_ms  # CUDA events on GPUs, a clock on a CPU
    model, args_, kwargs = forward_args
    judged = judged or {}

    def forward(transformer_options):
        with torch.no_grad():
            return model(*args_, **kwargs, transformer_options=dict(transformer_options))

    outputs, failed, verdicts = {}, {}, {}
    for name, (options, recorder) in list(configs.items()):
        try:
            if name in judged:  # the first forward: the model with approximate kernels refused, then allowed
                verdict, out = prediction_trial.judge(judged[name], lambda: forward(options), lambda: forward(options),
                                                recorder=recorder)  # it counts what the trial's calls ran on
                outputs[name], verdicts[name] = out.float(), verdict.as_dict()
                print(f"{name}: {verdict.text}")
            else:
                outputs[name] = forward(options).float()
            for _ in range(warmup - 1):
                forward(options)
        except Exception as exc:
            failed[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            print(f"{name:16} failed: {failed[name]}")
    live = {name: configs[name] for name in outputs}
    warmup_checks = {name: _checks(recorder) for name, (_, recorder) in live.items()}
    times = {name: [] for name in live}
    for _ in range(runs):
        for name, (options, _) in live.items():
            times[name].append(sample_ms(lambda: forward(options), torch.device(device), 1))
    base_ms = statistics.median(times["comfy default"])
    baseline = outputs["comfy default"]
    rows = []
    print(f"{'attention':16} {'ms':>9} {'speedup':>8} {'rel diff':>9}  served by")
    for name, (options, recorder) in live.items():
        ms = statistics.median(times[name])
        diff = relative_error(outputs[name], baseline)
        row = {"attention": name, "ms": ms, "speedup": base_ms / ms, "rel_diff": diff, "samples_ms": times[name]}
        if recorder is not None:
            snapshot = recorder.snapshot()["rows"]
            row["served"] = sorted({r["served"] for r in snapshot})
            row["calls"] = [{k: r[k] for k in ("site", "served", "calls")} for r in snapshot]
        rows.append(row)
        print(f"{name:16} {ms:9.1f} {base_ms / ms:8.3f} {diff:9.2e}  {', '.join(row.get('served', []))}")
    return rows, warmup_checks, failed, verdicts


def exact_kernels(dispatcher) -> list[str]:
    """Every exact kernel that can run here, in priority order, but those that materialise the score matrix (SDPA's
    math kernel: 51 GB for WAN's self-attention) and custom ones."""
    names = []
    for name in dispatcher.registry.names():
        spec = dispatcher.get_backend_spec(name)
        if spec.exact and not spec.quadratic_memory and not spec.custom and not dispatcher.availability_reasons(name):
            names.append(name)
    return names


def table(args, adapter, dispatcher, device, dtype, operations) -> int:
    """Each model of --models x {ComfyUI's own attention, each exact kernel pinned, auto_exact, auto_fast}, eager
    (and compiled for --compiled-models): one row per (model, mode, attention) with its median step, its speed-up
    over ComfyUI's own, and, for the autos, their ratio to the best pinned exact kernel of that model and mode."""
    import gc

    import torch
    rows, failed, tuning = [], {}, {}
    kernels = exact_kernels(dispatcher)
    if args.kernels:  # those asked for that can run here; the others are named with their reasons
        kernels = []
        for name in [k for k in args.kernels.split(",") if k]:
            if dispatcher.availability_reasons(name):
                failed[f"pinned {name}"] = "unavailable: " + "; ".join(dispatcher.availability_reasons(name))
                print(f"{name:16} {failed[f'pinned {name}'][:100]}")
            else:
                kernels.append(name)
    compiled_models = {m for m in args.compiled_models.split(",") if m}
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - {"eager", "compiled"}:
        raise SystemExit(f"--modes {args.modes}: eager, compiled or eager,compiled")
    for model_name in [m for m in args.models.split(",") if m]:
        print(f"== {model_name}")
        torch.manual_seed(0)
        forward_args = build_model(CONFIGS[model_name], device, dtype, operations)
        for mode in [m for m in ("eager", "compiled")
                     if m in modes and (m == "eager" or model_name in compiled_models)]:
            configs = {"comfy default": ({}, None)}
            for name in kernels:  # strict: a pinned kernel that cannot run a call fails its row, never falls back
                configs[name] = make_config(adapter, dispatcher, model_name, name, name, policy="strict")
            for name in ("auto_exact", "auto_fast"):
                configs[name] = make_config(adapter, dispatcher, model_name, name, name)
            if mode == "eager":
                measured, _, errors, _ = eager_step(args.runs, args.warmup, forward_args, configs, device)
            else:
                measured = compiled_step(args.runs, forward_args, configs, device)
                errors = {r["attention"]: r["error"] for r in measured if "error" in r}
                measured = [r for r in measured if "error" not in r]
            failed.update({f"{model_name} {mode} {k}": v for k, v in errors.items()})
            rows += table_rows(model_name, mode, measured, kernels)
        tuning[model_name] = dispatcher.auto.report()
        del forward_args
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    print(table_text(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "table": rows, "failed": failed, "kernels": kernels, "runs": args.runs, "warmup": args.warmup,
            "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "torch": torch.__version__,
            "dtype": str(dtype), "packages": dispatcher.current_machine().packages, "tuning": tuning},
            indent=1, default=str))
    return 0


def table_rows(model: str, mode: str, measured: list, kernels: list) -> list:
    """The table's rows of one model and mode: ms, speed-up over ComfyUI's own, and for the autos their ratio to
    the best pinned exact kernel (above 1: faster) and which kernels served their calls."""
    by = {r["attention"]: r for r in measured}
    base = by.get("comfy default", {}).get("ms")
    pinned = [by[k]["ms"] for k in kernels if k in by]
    best = min(pinned) if pinned else None
    rows = []
    for r in measured:
        row = {"model": model, "mode": mode, "attention": r["attention"], "ms": r["ms"],
               "vs_comfy": base / r["ms"] if base else None, "served": r.get("served", []),
               "samples_ms": r.get("samples_ms", [])}
        if r["attention"].startswith("auto") and best:
            row["vs_best_pinned"] = best / r["ms"]
        rows.append(row)
    return rows


def table_text(rows: list) -> str:
    """The table as Markdown: one line per (model, mode, attention)."""
    lines = ["| model | mode | attention | ms | x ComfyUI's own | x best pinned | served by |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        best = f"{r['vs_best_pinned']:.3f}" if r.get("vs_best_pinned") else ""
        comfy = f"{r['vs_comfy']:.3f}" if r.get("vs_comfy") else ""
        lines.append(f"| {r['model']} | {r['mode']} | {r['attention']} | {r['ms']:.2f} | {comfy} | {best} | "
                     f"{', '.join(r['served'])} |")
    return "\n".join(lines)


def _checks(recorder) -> int:
    return 0 if recorder is None else sum(g["checks"] for g in recorder.snapshot()["guard"])


def guard_summary(entries: list, warmup_checks: int, runs: int) -> dict:
    """What the guard did: checks in the warm-up step (each block's first call) and per timed step, how many
    blocks it checked, its failures with their blocks."""
    checks = sum(g["checks"] for g in entries)
    failures = [{"site": g["site"], "backend": g["backend"], **f} for g in entries for f in g["failures"]]
    errors = [g["max_error"] for g in entries if g["max_error"] is not None]
    summary = {"warmup_checks": warmup_checks, "checks_per_timed_step": round((checks - warmup_checks) / runs, 3),
               "blocks_checked": len({g["site"] for g in entries}), "max_error": max(errors, default=None),
               "failures": failures}
    summary["text"] = (f"{warmup_checks} checks in the warm-up step, {summary['checks_per_timed_step']} per timed "
                       f"step, {summary['blocks_checked']} blocks" +
                       (f", max error {summary['max_error']:.1e}" if errors else "") +
                       "".join(f"; FAILED at {f['site']}: {f['reason']}" for f in failures))
    return summary


def sampling_run(steps: int, forward_args, configs) -> dict:
    """`steps` Euler steps of x' = x - dt * model(x, t) from the same start for each configuration: the final
    latents' relative differences to auto_exact's and to ComfyUI's default (how far a run drifts, not a step)."""
    import torch
    from attention_dispatch_pack.dispatcher.reference import relative_error
    model, args_, kwargs = forward_args
    start = args_[0].clone()
    finals = {}
    for name, (options, _) in configs.items():
        x = start.clone()
        with torch.no_grad():
            for i in range(steps):
                t = torch.full_like(args_[1], 999.0 * (1 - i / steps))
                x = x - (1.0 / steps) * model(x, t, *args_[2:], **kwargs, transformer_options=dict(options))
        finals[name] = x.float()
    result = {"steps": steps, "vs_comfy_default": {}, "vs_auto_exact": {}}
    for name, x in finals.items():
        for ref_name, key in (("comfy default", "vs_comfy_default"), ("auto_exact", "vs_auto_exact")):
            if ref_name in finals:
                ref = finals[ref_name]
                result[key][name] = relative_error(x, ref)
    print(f"sampling run of {steps} steps, final latent relative difference:")
    for name in finals:
        print(f"  {name:24} vs comfy default {result['vs_comfy_default'].get(name, float('nan')):.2e}"
              f"   vs auto_exact {result['vs_auto_exact'].get(name, float('nan')):.2e}")
    return result


def compiled_step(runs: int, forward_args, configs, device) -> list:
    """Each configuration with the model under torch.compile (inductor): graph breaks, compile time, step time.
    A configuration that raises gets a row with its error."""
    import time

    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters
    model, args_, kwargs = forward_args
    rows = []
    for name, (options, recorder) in configs.items():
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model)
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                compiled(*args_, **kwargs, transformer_options=dict(options))
                compiled(*args_, **kwargs, transformer_options=dict(options))  # auto's step decision, as eager's
        except Exception as exc:
            rows.append({"attention": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            print(f"compiled {name:24} failed: {rows[-1]['error']}")
            continue
        if device == "cuda":
            torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        breaks = sum(counters["graph_break"].values())
        times = []
        for _ in range(runs):
            with torch.no_grad():
                if device == "cuda":
                    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    begin.record()
                    compiled(*args_, **kwargs, transformer_options=dict(options))
                    end.record()
                    torch.cuda.synchronize()
                    times.append(begin.elapsed_time(end))
                else:
                    t1 = time.perf_counter()
                    compiled(*args_, **kwargs, transformer_options=dict(options))
                    times.append((time.perf_counter() - t1) * 1e3)
        row = {"attention": name, "compile_s": compile_s, "graph_breaks": breaks,
               "graph_break_reasons": sorted(counters["graph_break"])[:10], "ms": statistics.median(times),
               "samples_ms": times}
        if recorder is not None:
            row["served"] = sorted({r["served"] for r in recorder.snapshot()["rows"]})
        rows.append(row)
        print(f"compiled {name:24} {row['ms']:9.1f} ms  graph breaks {breaks}  compile {compile_s:.0f} s  "
              f"{', '.join(row.get('served', []))}")
    return rows


if __name__ == "__main__":
    raise SystemExit(main())

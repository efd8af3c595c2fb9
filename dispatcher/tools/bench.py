"""`python -m dispatcher bench`: every attention backend on the shapes of common models, measured.

For each shape (SD1.5, SDXL, Flux, Qwen-Image, Wan 1.3B/14B, HunyuanVideo, or `--shape B,H,L,D[,Lk]`)
and every backend that can run it here: time (ms, median), TFLOP/s (4·B·H·Lq·Lk·D / t), relative error
against exact attention (float64, on sampled query rows), peak memory (GPUs), the ratio to the best;
the same kernel called directly (no dispatcher) and the dispatcher/direct speed ratio; `auto` against
the best single backend (the oracle); and, when a caller passes reference paths (callables on flat
(B, L, H·D) inputs, e.g. a framework's own attention function), each of them against the pack's path on
the same inputs (`bench/bench_comfyui.py` passes ComfyUI's; this package knows no framework).
A table in the terminal, `--json PATH`, `--png PATH` (matplotlib). On a CPU the lengths are scaled
down (`--small`, the default there; `--full` for real sizes) so the whole run takes seconds.

Only torch (>= 2.5) is needed, plus matplotlib for the chart.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import auto as tuner
from ..auto.measure import balanced_order
from .. import registry, support
from ..dispatch import dispatch_attention_fn
from ..inputs import AttentionInputs
from ..machine import current_machine


@dataclass(frozen=True)
class BenchShape:
    name: str
    label: str
    batch: int
    heads: int
    len_q: int
    head_dim: int
    len_kv: int | None = None

    @property
    def lk(self) -> int:
        return self.len_kv or self.len_q

    def flops(self) -> int:
        return 4 * self.batch * self.heads * self.len_q * self.lk * self.head_dim

    def dims(self) -> str:
        text = f"({self.batch}, {self.heads}, {self.len_q}, {self.head_dim})"
        return text if self.len_kv is None else text[:-1] + f", Lk={self.len_kv})"


# (B, H, L, D) of one self-attention call at the usual resolution; cond+uncond batched where ComfyUI does.
MODELS = (
    BenchShape("sd15", "SD1.5 512x512", 2, 8, 4096, 40),
    BenchShape("sdxl", "SDXL 1024x1024, 64x64 level", 2, 10, 4096, 64),
    BenchShape("sdxl-32", "SDXL 1024x1024, 32x32 level", 2, 20, 1024, 64),
    BenchShape("sdxl-cross", "SDXL 1024x1024, 64x64 level, text cross-attention", 2, 10, 4096, 64, 77),
    BenchShape("sdxl-32-cross", "SDXL 1024x1024, 32x32 level, text cross-attention", 2, 20, 1024, 64, 77),
    BenchShape("flux", "Flux 1024x1024 (4096 image + 512 text)", 1, 24, 4608, 128),
    BenchShape("qwen-image", "Qwen-Image 1024x1024 (4096 image + 256 text)", 1, 24, 4352, 128),
    BenchShape("wan-1.3b", "Wan 2.1 1.3B 480p, 81 frames", 1, 12, 32760, 128),
    BenchShape("wan-14b", "Wan 2.1 14B 480p, 81 frames", 1, 40, 32760, 128),
    BenchShape("hunyuan-video", "HunyuanVideo 544x960, 53 frames (+256 text)", 1, 24, 28816, 128),
)
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "half": torch.float16, "fp32": torch.float32, "float32": torch.float32}


def small_length(length: int) -> int:
    """CPU-sized: 1/256 of the length, a multiple of 8, between 16 and 128."""
    return max(16, min(128, int(math.ceil(length / 256 / 8)) * 8))


def smaller(shape: BenchShape) -> BenchShape:
    return BenchShape(shape.name, shape.label + " [small]", shape.batch, shape.heads, small_length(shape.len_q),
                      shape.head_dim, None if shape.len_kv is None else small_length(shape.len_kv))


def parse_shape(text: str) -> BenchShape:
    try:
        parts = [int(p) for p in text.replace("x", ",").split(",") if p.strip()]
    except ValueError:
        parts = []
    if len(parts) not in (4, 5) or min(parts) <= 0:
        raise argparse.ArgumentTypeError(f"--shape wants B,H,L,D or B,H,L,D,Lk (positive integers); got {text!r}")
    b, h, lq, d = parts[:4]
    lk = parts[4] if len(parts) == 5 else None
    return BenchShape(f"custom-{b}x{h}x{lq}x{d}" + (f"x{lk}" if lk else ""), "your shape", b, h, lq, d, lk)


# ------------------------------------------------------------------------------------------------------ inputs

def video_grid(length: int) -> tuple[int, int, int]:
    """(frames, height, width) of a token grid of `length` tokens: WAN 2.1 480p x 81 frames for 32760 (latent
    21 x 60 x 104, patches of 2 x 2), else one frame as near square as the length allows."""
    if length == 32760:
        return 21, 30, 52
    height = max(h for h in range(1, int(math.isqrt(length)) + 1) if length % h == 0)
    return 1, height, length // height


def local_video_qkv(batch: int, heads: int, frames: int, height: int, width: int, head_dim: int, *, device,
                    dtype=torch.bfloat16, scale: float = 1.5, noise: float = 0.5, seed: int = 0):
    """(q, k, v) in (B, L, H, D), L = frames x height x width in raster order (as video DiTs lay out patches), whose
    query and key carry a 3-D positional code (frequencies 0.1..3.2 per axis) plus noise: each token's scores peak
    at its neighbours in space and time, the locality block-sparse routing relies on (on a 4x16x32 grid, 99% of each
    64-token query block's attention falls in its top 16% of key blocks, the share sol_attn's tau 1.0 keeps exact).
    Noise inputs have none of it: sol_attn's error there (0.76) says nothing of its error on a video model."""
    gen = torch.Generator(device=device).manual_seed(seed)
    axes = torch.meshgrid(*(torch.arange(n, device=device, dtype=torch.float32) for n in (frames, height, width)),
                          indexing="ij")
    freqs = torch.logspace(-1, 0.5, head_dim // 6, device=device)
    code = torch.cat([f(axis.reshape(-1, 1) * freqs) for axis in axes for f in (torch.cos, torch.sin)], -1)
    code = F.pad(code, (0, head_dim - code.shape[-1])) * (scale * math.sqrt(head_dim / (head_dim // 6 * 3)))
    length = code.shape[0]
    base = code[None, :, None, :].expand(batch, length, heads, head_dim)

    def draw():
        return torch.randn(batch, length, heads, head_dim, device=device, generator=gen)
    q, k, v = base + noise * draw(), base + noise * draw(), draw()
    return tuple(t.to(dtype).contiguous() for t in (q, k, v))


# ----------------------------------------------------------------------------------------------- reference paths

def pack_attention(q, k, v, heads, backend):
    """What the pack's override does with the same (B, L, H·D) inputs: free views in, dispatcher, flatten out."""
    b, lq, inner = q.shape
    dim = inner // heads
    qs, ks, vs = q.view(b, lq, heads, dim), k.view(b, k.shape[1], -1, dim), v.view(b, v.shape[1], -1, dim)
    return dispatch_attention_fn(qs, ks, vs, backend=backend, layout="BSHD").flatten(2)


def _sdpa_pins():
    from torch.nn.attention import SDPBackend
    return {"_native_flash": SDPBackend.FLASH_ATTENTION, "_native_efficient": SDPBackend.EFFICIENT_ATTENTION,
            "_native_cudnn": SDPBackend.CUDNN_ATTENTION, "_native_math": SDPBackend.MATH}


def direct_call(name: str, q4, k4, v4):
    """The kernel of backend `name` called without the dispatcher, on views of the same storage."""
    spec = registry.get(name)
    q, k, v = (q4, k4, v4) if spec.layout == "BSHD" else (q4.transpose(1, 2), k4.transpose(1, 2), v4.transpose(1, 2))
    gqa = q4.shape[2] != k4.shape[2]
    extra = {"enable_gqa": True} if gqa else {}
    if name == "native":
        return lambda: F.scaled_dot_product_attention(q, k, v, **extra)
    pins = _sdpa_pins()
    if name in pins:
        from torch.nn.attention import sdpa_kernel
        pin = pins[name]

        def pinned():
            with sdpa_kernel(pin):
                return F.scaled_dot_product_attention(q, k, v, **extra)
        return pinned
    if name == "flex":
        from torch.nn.attention.flex_attention import flex_attention

        from ..backends.flex import compiled_flex
        if q.device.type == "cpu":
            return lambda: flex_attention(q, k, v, enable_gqa=gqa)
        fn = compiled_flex(q, k, v, masked=False, blocked=False, enable_gqa=gqa, lse=False)
        return lambda: fn(q, k, v, None, None, None, gqa)
    runner = registry.prepare(name)  # any other backend: its function, as the dispatcher would hand it
    return lambda: runner(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=gqa,
                          return_lse=False)


# ----------------------------------------------------------------------------------------------- timing

def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _inner_count(fn, device, target_s: float) -> int:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    once = max(time.perf_counter() - t0, 1e-6)
    return max(1, min(100, int(target_s / once)))


def sample_ms(fn, device, inner: int) -> float:
    """Milliseconds per call over `inner` back-to-back calls (CUDA events on GPUs)."""
    if device.type == "cuda":
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / inner
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) * 1e3 / inner


def time_interleaved(fns, device, warmup: int, runs: int, target_s: float, budget_s: float | None = None
                     ) -> list[float]:
    """Median ms per call of each function, samples alternating between them (drift hits all alike), in an
    order that changes each round (`balanced_order`: each follows each other one about equally often).

    With `budget_s`, fewer samples (at least one) when all of them would take longer than that.
    """
    for fn in fns:
        for _ in range(warmup):
            fn()
    inner = [_inner_count(fn, device, target_s) for fn in fns]
    if budget_s is not None:
        t0 = time.perf_counter()
        first = [[sample_ms(fn, device, n)] for fn, n in zip(fns, inner)]
        per_run = time.perf_counter() - t0
        runs = max(0, min(runs, int(budget_s / max(per_run, 1e-9))) - 1)
    else:
        first = [[] for _ in fns]
    samples = first
    for turn in balanced_order(len(fns), runs):
        for i in turn:
            samples[i].append(sample_ms(fns[i], device, inner[i]))
    return [statistics.median(s) for s in samples]


def peak_memory_mb(fn, device) -> float | None:
    """Memory the call allocates beyond what existed before it (GPUs; None on a CPU)."""
    if device.type != "cuda":
        return None
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out = fn()
    _sync(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del out
    return round(peak / 2**20, 2)


def measure_overhead(device="cpu", dtype=torch.float32, calls: int = 2000, repeats: int = 5) -> dict:
    """The dispatcher's own cost per call on a tiny shape: µs per call, dispatcher vs the same SDPA call."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, 16, 2 * 8, generator=gen, device=device, dtype=dtype).view(1, 16, 2, 8)
               for _ in range(3))

    def direct():  # what a caller with (B, S, H, D) tensors writes by hand
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    def dispatched():
        return dispatch_attention_fn(q, k, v, backend="native")

    def auto():
        return dispatch_attention_fn(q, k, v, backend="auto")

    result = {}
    for label, fn in (("direct_us", direct), ("dispatch_us", dispatched), ("auto_us", auto)):
        for _ in range(50):
            fn()
        best = math.inf
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            _sync(device)
            best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        result[label] = round(best, 2)
    result["overhead_us"] = round(result["dispatch_us"] - result["direct_us"], 2)
    result["auto_overhead_us"] = round(result["auto_us"] - result["direct_us"], 2)
    result["shape"] = "(1, 16, 2, 8) BSHD"
    return result


# ----------------------------------------------------------------------------------------------- one shape

def _inputs_of(shape: BenchShape, dtype, device) -> AttentionInputs:
    return AttentionInputs.of(shape.batch, shape.heads, shape.len_q, shape.head_dim, len_kv=shape.lk, dtype=dtype,
                              device=str(device))


def _memory_rule(device, dtype) -> support.Rules | None:
    """The bench's memory cap: a kernel that materialises the scores holds them in the input dtype about three
    times over (scores, softmax, a copy), within half the free GPU memory; as a cap on the float32 score matrix
    (`support.score_matrix_bytes`). None off CUDA (no cap)."""
    if device.type != "cuda":
        return None
    free = torch.cuda.mem_get_info(device)[0]
    return support.Rules(memory_cap=2 * free // (3 * torch.empty((), dtype=dtype).element_size()))


def _backends_for(shape: BenchShape, dtype, device, wanted: list[str] | None):
    names, skipped, _ = tuner.default_tuner().candidates(_inputs_of(shape, dtype, device))
    skipped = dict(skipped)
    if wanted is None:
        return names, {}
    chosen = [n for n in names if n in wanted]
    missing = {n: (skipped.get(n) or ["not a registered backend"]) for n in wanted if n not in names}
    return chosen, missing


def bench_shape(shape: BenchShape, *, dtype, device, backends=None, warmup=2, runs=7, target_s=0.02, rows=64,
                auto=True, references=None, budget_s=None, log=print) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    b, h, lq, lk, d = shape.batch, shape.heads, shape.len_q, shape.lk, shape.head_dim
    q3 = torch.randn(b, lq, h * d, generator=gen, device=device, dtype=dtype)
    k3 = torch.randn(b, lk, h * d, generator=gen, device=device, dtype=dtype)
    v3 = torch.randn(b, lk, h * d, generator=gen, device=device, dtype=dtype)
    q4, k4, v4 = q3.view(b, lq, h, d), k3.view(b, lk, h, d), v3.view(b, lk, h, d)  # free views, as ComfyUI's
    idx = tuner.sample_rows(lq, rows)
    with torch.no_grad():
        ref, _ = tuner.exact_attention(q4, k4, v4, rows=idx)

    def error_of(out_bshd):
        picked = out_bshd.transpose(1, 2)
        picked = picked if idx is None else picked[:, :, idx.to(picked.device)]
        return tuner.relative_error(picked, ref), tuner.non_finite(out_bshd)

    names, missing = _backends_for(shape, dtype, device, backends)
    result = {"name": shape.name, "label": shape.label, "B": b, "H": h, "Lq": lq, "Lk": lk, "D": d,
              "flops": shape.flops(), "rows": [], "skipped": missing}
    inputs, memory = _inputs_of(shape, dtype, device), _memory_rule(device, dtype)
    with torch.no_grad():
        for name in names:
            spec = registry.get(name)
            quantised = not spec.exact
            # Noise passes no verdict on a kernel that is not exact (its error depends on the values): shown, not
            # judged. "quantised" here: not exact (quantised or approximate); "precision" says which.
            row = {"shape": shape.name, "backend": name, "ms": None, "tflops": None, "rel_error": None,
                   "error_bound": None if quantised else spec.error_bound, "quantised": quantised,
                   "precision": spec.precision,
                   "valid": False, "peak_mb": None,
                   "ratio_to_best": None, "direct_ms": None, "dispatch_vs_direct": None, "error": None}
            result["rows"].append(row)
            over_cap = support.why_not(name, inputs, rules=memory).rules if memory is not None else ()
            if over_cap:
                row["error"] = "skipped: " + "; ".join(over_cap)
                continue

            def dispatched(name=name):
                return dispatch_attention_fn(q4, k4, v4, backend=name, policy="strict")
            try:
                out = dispatched()
                _sync(device)
                row["rel_error"], bad = error_of(out)
                del out
                row["valid"] = bad == 0 and (quantised or row["rel_error"] <= row["error_bound"])
                if bad:
                    row["error"] = f"{bad} NaN/Inf values in the output"
                direct = direct_call(name, q4, k4, v4)
                row["peak_mb"] = peak_memory_mb(dispatched, device)
                row["direct_ms"], row["ms"] = time_interleaved([direct, dispatched], device, warmup, runs, target_s,
                                                               budget_s)
            except Exception as exc:
                row["error"] = tuner.first_line(exc)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            row["tflops"] = shape.flops() / (row["ms"] * 1e-3) / 1e12
            row["dispatch_vs_direct"] = row["direct_ms"] / row["ms"]
            log(f"  {shape.name:14} {name:28} {row['ms']:10.3f} ms")
        timed = [r for r in result["rows"] if r["ms"] is not None and r["valid"] and not r["quantised"]]
        best = min(timed, key=lambda r: r["ms"]) if timed else None  # the exact oracle: what auto_exact may reach
        admitted = [r for r in result["rows"] if r["ms"] is not None and r["valid"]
                    and (not r["quantised"] or r["rel_error"] <= tuner.admission_bound(registry.get(r["backend"])))]
        best_fast = min(admitted, key=lambda r: r["ms"]) if admitted else None  # what auto_fast may reach
        for r in result["rows"]:
            if best is not None and r["ms"] is not None:
                r["ratio_to_best"] = best["ms"] / r["ms"]
        result["best"] = best["backend"] if best else None

        if auto:
            result["auto"] = _bench_auto(shape, q4, k4, v4, best, device, warmup, runs, target_s, error_of, budget_s)
            if best_fast is not None and best_fast is not best:
                result["auto_fast"] = _bench_auto(shape, q4, k4, v4, best_fast, device, warmup, runs, target_s,
                                                  error_of, budget_s, tuner.AUTO_FAST)
        if references:
            result["references"] = _bench_references(shape, q3, k3, v3, device, warmup, runs, target_s, error_of, auto,
                                                     budget_s, references)
    return result


def _bench_auto(shape, q4, k4, v4, best, device, warmup, runs, target_s, error_of, budget_s,
                name=tuner.AUTO_EXACT) -> dict:
    """`name` (auto_exact, or auto_fast when a quantised kernel is admitted here) against the best kernel it may
    pick, timed alternately."""
    exact = name != tuner.AUTO_FAST

    def auto():
        return dispatch_attention_fn(q4, k4, v4, backend=name)
    try:
        t0 = time.perf_counter()
        out = auto()  # tunes this signature
        _sync(device)
        first_s = time.perf_counter() - t0
        err, _ = error_of(out)
        del out
        record = next((r for r in tuner.default_tuner().records() if r.exact == exact
                       and (r.signature.batch, r.signature.heads_q, r.signature.len_q, r.signature.len_kv,
                           r.signature.head_dim) == (shape.batch, shape.heads, shape.len_q, shape.lk, shape.head_dim)),
                      None)
        fns = [auto]
        if best is not None:
            fns.append(lambda: dispatch_attention_fn(q4, k4, v4, backend=best["backend"], policy="strict"))
        times = time_interleaved(fns, device, warmup, runs, target_s, budget_s)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    entry = {"chosen": record.chosen if record else None, "source": record.source if record else None,
             "ms": times[0], "tflops": shape.flops() / (times[0] * 1e-3) / 1e12, "rel_error": err,
             "tune_seconds": round(record.seconds, 3) if record else None, "first_call_s": round(first_s, 3),
             "rejected": {c.name: c.reason for c in record.rejected} if record else {},
             "oracle": best["backend"] if best else None}
    if best is not None:
        entry["oracle_ms"] = times[1]
        entry["auto_vs_oracle"] = times[1] / times[0]
    return entry


def _auto_line(label: str, a: dict | None) -> list[str]:
    if not a:
        return []
    if "ms" not in a:
        return [f"  {label}: {a.get('error')}"]
    return [f"  {label} -> {a['chosen']} ({a['source']}, tuned in {a['tune_seconds']} s): {a['ms']:.3f} ms, "
            f"{a['tflops']:.2f} TFLOP/s, vs the best it may pick ({a['oracle']}): "
            f"{_fmt(a.get('auto_vs_oracle'), '.3f', 0)}" + (f"; rejected {', '.join(a['rejected'])}" if a["rejected"]
                                                            else "")]


def _bench_references(shape, q3, k3, v3, device, warmup, runs, target_s, error_of, with_auto, budget_s,
                      references) -> dict:
    """Each reference path (name -> fn(q, k, v, heads) on (B, L, H·D) inputs) against the pack's path, interleaved."""
    h = shape.heads
    fns = {"pack native": lambda: pack_attention(q3, k3, v3, h, "native")}
    if with_auto:
        fns["pack auto"] = lambda: pack_attention(q3, k3, v3, h, "auto")
    paths = {}
    try:
        for name, fn in references.items():
            fns[name] = (lambda fn=fn: fn(q3, k3, v3, h))
            out = fns[name]()
            paths[name] = {"rel_error": error_of(out.unflatten(-1, (h, -1)))[0]}
            del out
        times = dict(zip(fns, time_interleaved(list(fns.values()), device, warmup, runs, target_s, budget_s)))
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    for name, entry in paths.items():
        entry.update(ms=times[name], tflops=shape.flops() / (times[name] * 1e-3) / 1e12,
                     native_vs=times[name] / times["pack native"])
        if "pack auto" in times:
            entry["auto_vs"] = times[name] / times["pack auto"]
    return {"pack_native_ms": times["pack native"], "pack_auto_ms": times.get("pack auto"), "paths": paths}


# ----------------------------------------------------------------------------------------------- output

def flat_rows(results: list[dict]) -> list[dict]:
    """One row per (shape, backend), plus 'auto' and one row per reference path: what the table and chart show."""
    rows = []
    for res in results:
        rows.extend(res["rows"])
        best = next((r for r in res["rows"] if r["backend"] == res.get("best")), None)
        a = res.get("auto") or {}
        if "ms" in a:
            rows.append({"shape": res["name"], "backend": "auto", "chosen": a["chosen"], "ms": a["ms"],
                         "tflops": a["tflops"], "rel_error": a["rel_error"], "valid": True, "peak_mb": None,
                         "ratio_to_best": a.get("auto_vs_oracle"), "direct_ms": None, "dispatch_vs_direct": None,
                         "error": None})
        for name, c in ((res.get("references") or {}).get("paths") or {}).items():
            rows.append({"shape": res["name"], "backend": name, "reference": True, "ms": c["ms"],
                         "tflops": c["tflops"], "rel_error": c["rel_error"], "valid": True,
                         "peak_mb": None, "ratio_to_best": (best["ms"] / c["ms"]) if best else None,
                         "direct_ms": None, "dispatch_vs_direct": None, "error": None})
    return rows


def _fmt(value, spec, width):
    return f"{value:{width}{spec}}" if isinstance(value, (int, float)) else f"{'-':>{width}}"


def render(data: dict) -> str:
    meta = data["meta"]
    lines = [f"Attention benchmark: {meta['device_name']} ({meta['device']}), torch {meta['torch']}, "
             f"{meta['dtype']}{', small CPU-sized shapes' if meta['small'] else ''}", ""]
    header = (f"  {'backend':28} {'ms':>10} {'TFLOP/s':>8} {'rel err':>8} {'peak MB':>8} {'vs best':>8} "
              f"{'direct ms':>10} {'disp/dir':>8}")
    for res in data["shapes"]:
        lines.append(f"{res['label']}  B,H,Lq,Lk,D = {res['B']},{res['H']},{res['Lq']},{res['Lk']},{res['D']}  "
                     f"({res['flops'] / 1e9:.2f} GFLOP)")
        lines.append(header)
        for r in res["rows"]:
            if r["ms"] is None:
                lines.append(f"  {r['backend']:28} {r['error'] or 'not timed'}")
                continue
            flag = ("  INVALID (error over its bound)" if not r["valid"] else
                    f"  {r.get('precision', 'quantised')}: error on noise; auto_fast judges it on the model's own "
                    "activations" if r.get("quantised") else "")
            lines.append(f"  {r['backend']:28} {_fmt(r['ms'], '.3f', 10)} {_fmt(r['tflops'], '.2f', 8)} "
                         f"{_fmt(r['rel_error'], '.1e', 8)} {_fmt(r['peak_mb'], '.0f', 8)} "
                         f"{_fmt(r['ratio_to_best'], '.3f', 8)} {_fmt(r['direct_ms'], '.3f', 10)} "
                         f"{_fmt(r['dispatch_vs_direct'], '.3f', 8)}{flag}")
        for name, reasons in res.get("skipped", {}).items():
            lines.append(f"  {name:28} cannot run: {'; '.join(reasons)[:150]}")
        for label, a in (("auto_exact", res.get("auto")), ("auto_fast", res.get("auto_fast"))):
            lines.extend(_auto_line(label, a))
        refs = res.get("references") or {}
        if refs.get("error"):
            lines.append(f"  reference paths: {refs['error']}")
        for name, c in (refs.get("paths") or {}).items():
            lines.append(f"  {name} (reference path, flat inputs): {c['ms']:.3f} ms; the pack's path with native "
                         f"{refs['pack_native_ms']:.3f} ms (x{c['native_vs']:.3f})"
                         + (f", with auto {refs['pack_auto_ms']:.3f} ms (x{c['auto_vs']:.3f})" if "auto_vs" in c else ""))
        lines.append("")
    o = data.get("overhead")
    if o:
        lines.append(f"Dispatcher overhead on {o['shape']}: direct SDPA {o['direct_us']} µs, through the dispatcher "
                     f"{o['dispatch_us']} µs (+{o['overhead_us']} µs), auto {o['auto_us']} µs per call")
    return "\n".join(lines)


AUTO_LABEL = "auto_exact"  # what a result's "auto" entry timed (results before the rename called it "auto")


def write_png(data: dict, path: str) -> None:
    """The chart (`chart`) as a PNG at `path`."""
    import matplotlib.pyplot as plt
    fig = chart(data)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def chart(data: dict):
    """One panel per quantity, each ratio with its own labelled reference line, axes scaled to the data so no bar
    is ever cut off, legends beside the panels (never over a bar): TFLOP/s per backend; dispatcher / direct kernel
    per backend; auto_exact / best single backend per shape; and, when reference paths were timed, the pack's path
    against each of them per shape. Returns the matplotlib figure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = data["shapes"]
    rows = flat_rows(shapes)
    labels = [f"{s['name']}\n{s['B']},{s['H']},{s['Lq']},{s['D']}" for s in shapes]
    backends = []
    for r in rows:
        if r["backend"] not in backends and r["tflops"] is not None and not r.get("reference") and r["backend"] != "auto":
            backends.append(r["backend"])
    refs = []
    for res in shapes:
        for name in ((res.get("references") or {}).get("paths") or {}):
            if name not in refs:
                refs.append(name)
    panels = ["tflops", "direct", "auto"] + (["references"] if refs else [])
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8, 1.6 * len(shapes) + 3), 3.4 * len(panels)),
                             constrained_layout=True, squeeze=False)
    axes = {name: ax for name, ax in zip(panels, axes[:, 0])}

    def label_of(name):
        name = AUTO_LABEL if name == "auto" else name
        return " " + name if name.startswith("_") else name  # matplotlib hides labels starting with "_"

    def legend(ax, **kwargs):
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0), borderaxespad=0.0, **kwargs)

    def grouped(ax, series, value):
        width = 0.8 / max(1, len(series))
        top, low = 0.0, math.inf
        for i, name in enumerate(series):
            xs, ys = [], []
            for j, res in enumerate(shapes):
                y = value(res, name)
                if y is not None:
                    xs.append(j + (i - (len(series) - 1) / 2) * width)
                    ys.append(y)
                    top, low = max(top, y), min(low, y) if y > 0 else low
            ax.bar(xs, ys, width, label=label_of(name), hatch="//" if name == "auto" else None)
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.low = low
        return top

    def row(res, name):
        return next((r for r in res["rows"] if r["backend"] == name), None)

    def reference_line(ax, top, text, ylabel):
        ax.set_ylabel(ylabel)
        ax.axhline(1.0, color="black", linestyle="--", linewidth=0.9, label=text)
        if top > 0 and getattr(ax, "low", 1.0) > 0 and max(top, 1) / min(ax.low, 1) > 20:
            ax.set_yscale("log")  # ratios spanning decades (a noisy host): log, so 0.5 and 2 look alike
            ax.set_ylim(min(ax.low, 1.0) / 1.5, max(top, 1.0) * 1.5)
            ax.set_ylabel(ax.get_ylabel() + " (log)")
        else:
            ax.set_ylim(0, max(1.15, top * 1.08))  # never clipped: the tallest bar sets the scale

    meta = data["meta"]
    everything = backends + ["auto"] if any("ms" in (s.get("auto") or {}) for s in shapes) else backends
    top_tflops = grouped(axes["tflops"], everything,
            lambda res, n: (res["auto"].get("tflops") if n == "auto" and res.get("auto") else
                            (row(res, n) or {}).get("tflops")))
    axes["tflops"].set_ylabel("TFLOP/s")
    axes["tflops"].set_title(f"Attention backends on {meta['device_name']} ({meta['dtype']}, torch {meta['torch']}"
                             + (", CPU-sized shapes" if meta.get("small") else "") + ")")
    axes["tflops"].set_ylim(0, top_tflops * 1.08)
    legend(axes["tflops"])

    top = grouped(axes["direct"], backends, lambda res, n: (row(res, n) or {}).get("dispatch_vs_direct"))
    reference_line(axes["direct"], top, "1.0 = as fast as calling the kernel directly", "direct ms / dispatcher ms")
    axes["direct"].set_title("Dispatcher overhead per backend (above 1: faster through the dispatcher)")
    legend(axes["direct"])

    top = grouped(axes["auto"], ["auto"], lambda res, n: (res.get("auto") or {}).get("auto_vs_oracle"))
    reference_line(axes["auto"], top, "1.0 = as fast as the best single backend",
                   f"best backend ms / {AUTO_LABEL} ms")
    axes["auto"].set_title(f"{AUTO_LABEL} against the best single exact backend of each shape")
    legend(axes["auto"])

    if refs:
        series = [f"native vs {n}" for n in refs] + [f"{AUTO_LABEL} vs {n}" for n in refs]

        def ratio(res, label):
            kind, name = label.split(" vs ", 1)
            entry = ((res.get("references") or {}).get("paths") or {}).get(name) or {}
            return entry.get("native_vs" if kind == "native" else "auto_vs")
        top = grouped(axes["references"], series, ratio)
        reference_line(axes["references"], top, "1.0 = as fast as the reference path", "reference ms / pack ms")
        axes["references"].set_title("The pack's path against each reference path on the same flat inputs")
        legend(axes["references"])
    return fig


# ----------------------------------------------------------------------------------------------- command

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default=None,
                        help="comma-separated model shapes (default: all): " + ", ".join(m.name for m in MODELS))
    parser.add_argument("--shape", action="append", type=parse_shape, default=[],
                        help="your own shape B,H,L,D[,Lk] (repeatable; replaces the model list)")
    parser.add_argument("--dtype", default=None, help="bf16 | fp16 | fp32 (default: bf16 on GPUs, fp32 on a CPU)")
    parser.add_argument("--device", default=None, help="cuda | cpu | cuda:1 ... (default: cuda when available)")
    parser.add_argument("--backends", default=None, help="comma-separated backends (default: every one that can run)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--small", action="store_true", help="CPU-sized lengths (the default on a CPU)")
    size.add_argument("--full", action="store_true", help="the real lengths, even on a CPU")
    parser.add_argument("--runs", type=int, default=None,
                        help="timed samples per backend (default 10 GPU, 5 CPU, 3 CPU --small)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="warm-up calls per backend besides the validation call (default 3 GPU, 1 CPU, 0 --small)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="timing budget per backend and shape, after warm-up (default 30 GPU, 5 CPU, 0.3 CPU --small)")
    parser.add_argument("--rows", type=int, default=64, help="query rows checked against exact attention")
    parser.add_argument("--no-auto", action="store_true", help="skip `auto`")
    parser.add_argument("--no-overhead", action="store_true", help="skip the tiny-shape overhead measurement")
    parser.add_argument("--tune-budget", type=float, default=None, help="auto's seconds per signature (default 2 on a GPU, 0.5 on a CPU)")
    parser.add_argument("--tune-cache", default=None,
                        help="auto's decision cache file (default: none, so auto is measured from scratch)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    parser.add_argument("--png", default=None, metavar="PATH", help="write a chart (needs matplotlib)")
    parser.add_argument("--quiet", action="store_true", help="no per-backend progress lines")


def main(args: argparse.Namespace, references: dict | None = None) -> int:
    """Run the benchmark. `references`: name -> fn(q, k, v, heads) on (B, L, H·D) inputs, each timed against
    the pack's path on the same inputs (a framework's own attention function, say)."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = DTYPES.get((args.dtype or ("bf16" if device.type == "cuda" else "fp32")).lower())
    if dtype is None:
        print(f"unknown --dtype {args.dtype!r}; use one of {', '.join(DTYPES)}", file=sys.stderr)
        return 2
    small = args.small or (device.type == "cpu" and not args.full and not args.shape)  # your shape: as given
    shapes = list(args.shape)
    if not shapes:
        wanted = [m.strip() for m in args.models.split(",")] if args.models else [m.name for m in MODELS]
        unknown = [m for m in wanted if m not in {s.name for s in MODELS}]
        if unknown:
            print(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(m.name for m in MODELS)}", file=sys.stderr)
            return 2
        shapes = [m for m in MODELS if m.name in wanted]
    if small:
        shapes = [smaller(s) for s in shapes]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()] if args.backends else None
    gpu = device.type == "cuda"
    runs = args.runs if args.runs is not None else (10 if gpu else 3 if small else 5)
    # On a CPU the validation call before timing is warm-up enough (no compilation, no clocks to ramp).
    warmup = args.warmup if args.warmup is not None else (3 if gpu else 0 if small else 1)
    target_s = 0.02 if gpu else 0.005 if small else 0.01
    budget = args.tune_budget  # None: the tuner's default for the device
    per_backend = args.max_seconds if args.max_seconds is not None else (30.0 if gpu else 0.3 if small else 5.0)
    log = (lambda *a: None) if args.quiet else (lambda text: print(text, file=sys.stderr, flush=True))

    machine = current_machine()
    device_name = torch.cuda.get_device_name(device) if gpu else tuner.cpu_model()
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": str(device), "device_name": device_name,
            "capability": list(torch.cuda.get_device_capability(device)) if gpu else None,
            "torch": torch.__version__, "cuda": torch.version.cuda, "dtype": str(dtype).replace("torch.", ""),
            "small": small, "runs": runs, "warmup": warmup, "packages": dict(sorted(machine.packages.items())),
            "machine": tuner.machine_fingerprint(machine), "argv": sys.argv[1:]}
    bench_tuner = tuner.Tuner(cache_path=args.tune_cache, time_budget_s=budget)
    meta["references"] = sorted(references or {})
    if not gpu:  # a CPU run starts cold (lazy imports, thread pools, allocator): one untimed pass first, so the
        # first shapes are not measured with the process's warm-up in them (auto vs oracle read 7.8 without it)
        with tuner.using(tuner.Tuner(cache_path=None, time_budget_s=0)):
            bench_shape(shapes[0], dtype=dtype, device=device, backends=backends, warmup=1, runs=1, target_s=target_s,
                        rows=args.rows, auto=True, references=references, budget_s=per_backend, log=lambda *a: None)
    results = []
    with tuner.using(bench_tuner):
        for shape in shapes:
            log(f"{shape.label} {shape.dims()}")
            results.append(bench_shape(shape, dtype=dtype, device=device, backends=backends, warmup=warmup, runs=runs,
                                       target_s=target_s, rows=args.rows, auto=not args.no_auto,
                                       references=references, budget_s=per_backend, log=log))
            if gpu:
                torch.cuda.empty_cache()
        overhead = None if args.no_overhead else measure_overhead(device, dtype, calls=1000, repeats=3)
        data = {"meta": meta, "shapes": results, "rows": flat_rows(results), "overhead": overhead,
                "tuning": bench_tuner.report()}
    print(render(data))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(data, fh, indent=1, default=str)
        print(f"\nwrote {args.json}")
    if args.png:
        try:
            write_png(data, args.png)
            print(f"wrote {args.png}")
        except ImportError:
            print("--png needs matplotlib: pip install matplotlib", file=sys.stderr)
            return 1
    return 0

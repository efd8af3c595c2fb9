"""Per-call cost of the dispatcher against diffusers' own `dispatch_attention_fn`, side by side in one run.

    python bench/hot_path.py [--rounds 400] [--calls 200] [--device cpu|cuda] [--shape 1,2,16,64] [--json PATH]

Tiny inputs (the kernel costs little, so the dispatcher's own work shows), (B, S, H, D) as diffusers takes
them. Configurations, each timed as `calls` back-to-back calls, are interleaved in a shuffled order every
round so drift and noise fall on all of them alike; the medians over rounds are compared (`--stat min`: the
fastest round of each, which a busy machine disturbs least):
- raw: what diffusers' `native` backend does itself (permute, SDPA, permute back): the floor;
- diffusers: `diffusers.models.attention_dispatch.dispatch_attention_fn` (pip install diffusers==0.42.1);
- pack: this package's `dispatch_attention_fn` on its default backend, every check it does on by default;
- before (`--before DIR`): the pack of another checkout, imported beside this one (a change measured in one run);
each without a mask and with a bool mask (B, 1, Sq, Sk). Needs diffusers only for its column.
The JSON names the code measured by its commit (`pack`, `before`: bench/checkout.py), not by its folder.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from checkout import revision  # bench/ is on sys.path when a script of it runs
from output import emit
from timing import shuffled_rounds

ROOT = Path(__file__).resolve().parents[1]


def _pack(folder: Path | None = None):
    """The dispatcher of the pack in `folder` (default: this checkout)."""
    sys.path.insert(0, str(folder or ROOT))
    import dispatcher as pack
    return pack


def _pack_as(folder: Path, name: str):
    """The dispatcher package of another checkout, imported under `name` beside this one's."""
    spec = importlib.util.spec_from_file_location(name, folder / "dispatcher" / "__init__.py",
                                                  submodule_search_locations=[str(folder / "dispatcher")])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def configurations(shape, device, folder=None, before=None):
    b, h, s, d = shape
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, generator=gen).to(device) for _ in range(3))
    mask = (torch.rand(b, 1, s, s, generator=gen) > 0.2).to(device)
    mask[..., 0] = True
    pack = _pack(folder)
    calls = {}

    def raw(m):
        return lambda: F.scaled_dot_product_attention(q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3),
                                                      v.permute(0, 2, 1, 3), attn_mask=m).permute(0, 2, 1, 3)

    earlier = _pack_as(before, "dispatcher_before") if before is not None else None
    for label, m in (("", None), (" +mask", mask)):
        calls["raw" + label] = raw(m)
        calls["pack" + label] = (lambda m=m: pack.dispatch_attention_fn(q, k, v, attn_mask=m))
        if earlier is not None:
            calls["before" + label] = (lambda m=m: earlier.dispatch_attention_fn(q, k, v, attn_mask=m))
    try:
        from diffusers.models.attention_dispatch import dispatch_attention_fn as diffusers_fn
        for label, m in (("", None), (" +mask", mask)):
            calls["diffusers" + label] = (lambda m=m: diffusers_fn(q, k, v, attn_mask=m))
    except ImportError:
        print("diffusers is not installed: its column is left out (pip install diffusers==0.42.1)")
    # Same result first: a faster wrong path is no comparison.
    for label in ("", " +mask"):
        ref = calls["raw" + label]()
        for name in ("pack", "before", "diffusers"):
            if name + label in calls:
                torch.testing.assert_close(calls[name + label](), ref, rtol=0, atol=0)
    return calls


def measure(calls: dict, rounds: int, per_round: int, device: str) -> dict[str, list[float]]:
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for fn in calls.values():  # warm-up: first calls decide and cache
        for _ in range(50):
            fn()
    sync()
    samples = {name: [] for name in calls}
    for name in shuffled_rounds(calls, rounds):
        fn = calls[name]
        t0 = time.perf_counter()
        for _ in range(per_round):
            fn()
        sync()
        samples[name].append((time.perf_counter() - t0) / per_round * 1e6)
    return samples


def summarise(samples: dict[str, list[float]], stat: str = "median") -> dict:
    pick = statistics.median if stat == "median" else min
    med = {name: pick(v) for name, v in samples.items()}
    out = {"statistic": stat, f"{stat}_us": {k: round(v, 3) for k, v in med.items()}}
    for label in ("", " +mask"):
        raw = med["raw" + label]
        row = {"pack_over_raw_us": round(med["pack" + label] - raw, 3)}
        if "diffusers" + label in med:
            row["diffusers_over_raw_us"] = round(med["diffusers" + label] - raw, 3)
            row["pack_vs_diffusers"] = round(med["pack" + label] / med["diffusers" + label], 4)
            if "before" + label in med:
                row["before_vs_diffusers"] = round(med["before" + label] / med["diffusers" + label], 4)
        out["no mask" if not label else "bool mask"] = row
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--calls", type=int, default=200, help="calls per configuration per round")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", default="1,2,16,64", help="B,H,S,D")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: the least noise)")
    parser.add_argument("--stat", choices=("median", "min"), default="median", help="per configuration, over rounds")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--pack", type=Path, help="measure the pack in this folder (e.g. another commit's checkout)")
    parser.add_argument("--before", type=Path, help="also measure the pack in this folder, side by side in the run")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = tuple(int(x) for x in args.shape.split(","))
    calls = configurations(shape, args.device, args.pack, args.before)
    result = summarise(measure(calls, args.rounds, args.calls, args.device), args.stat)
    result.update(pack=revision(args.pack or ROOT), **({"before": revision(args.before)} if args.before else {}),
                  shape_bhsd=shape, device=args.device, rounds=args.rounds, calls=args.calls,
                  torch=torch.__version__, python=sys.version.split()[0])
    try:
        import diffusers
        result["diffusers"] = diffusers.__version__
    except ImportError:
        pass
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

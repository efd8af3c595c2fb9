"""The doctor: which Python and machine it inspects, which backend to use there, every backend that can run (first)
and why the others cannot (each reason once, with the backends it holds back)."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

from .. import env, hub, registry
from . import command
from .install_plan import machine_facts, machine_text  # noqa: F401  (the one machine line, shared with install.py)
from .install_plan import wrap
from ..machine import cpu_model as machine_cpu_model
from ..machine import current_machine
from ..support import list_backends

def cpu_model() -> str:
    return machine_cpu_model() or "unknown CPU"


def default_backend_info(backends: list[dict] | None = None) -> dict:
    """The process default backend and where it comes from, read the way the dispatcher reads it, without
    setting anything: {"backend", "source", "problem", "available", "reasons"}."""
    raw = os.environ.get(env.ATTN_BACKEND)
    wanted = env.value(env.ATTN_BACKEND)
    info = {"backend": "native", "source": f"{env.ATTN_BACKEND} is not set", "problem": None,
            "available": None, "reasons": []}
    if raw is not None and wanted is None:
        info["source"] = f"{env.ATTN_BACKEND} is set but empty"
    elif wanted is not None:
        if wanted == "auto" or wanted in registry.names():
            info.update(backend=wanted, source=f"{env.ATTN_BACKEND}={wanted}")
        else:
            import difflib
            close = difflib.get_close_matches(wanted, [*registry.names(), "auto"], n=1)
            info["problem"] = (f"{env.ATTN_BACKEND}={wanted!r} is not a backend name"
                               + (f" (did you mean {close[0]!r}?)" if close else "")
                               + "; the dispatcher ignores it and uses 'native'. Valid: auto or a name in the "
                                 "backend column below")
            info["source"] = f"{env.ATTN_BACKEND}={wanted!r} is ignored"
    by_name = {b["name"]: b for b in backends or []}
    if info["backend"] in by_name:
        info["available"] = by_name[info["backend"]]["available"]
        info["reasons"] = by_name[info["backend"]]["reasons"]
    elif info["backend"] == "auto":
        info["available"] = True
    return info


HUB_NOT_HERE = "not fetched (no backend using it can run here)"
LIBRARY_DEFAULT = "As a library, without backend="


def source_builds(lock: dict) -> list[dict]:
    """Packages `python install.py --build ...` built here and recorded in the lock file."""
    if not isinstance(lock, dict) or "error" in lock:
        return []
    return [e for e in lock.values() if isinstance(e, dict) and e.get("kind") == "source-build"]


def python_info() -> dict:
    """The interpreter this report describes, and whose it is (the `./doctor` script says when it found ComfyUI's)."""
    import torch
    which = os.environ.get("ATTN_DISPATCH_DOCTOR_PYTHON")
    pack = Path(__file__).resolve().parents[2]  # the pack's folder when this runs from the ComfyUI pack
    if not which:
        if pack.parent.name == "custom_nodes" and not Path(sys.prefix).resolve().is_relative_to(pack.parent.parent):
            which = (f"the Python that ran this command, which may not be ComfyUI's ({pack.parent.parent}): "
                     f"run {pack / 'doctor'} to inspect ComfyUI's own")
        elif pack.parent.name == "custom_nodes":
            which = f"ComfyUI's Python (inside {pack.parent.parent})"
        else:
            which = "the Python that ran this command"
    return {"executable": sys.executable, "version": platform.python_version(), "torch": torch.__version__,
            "which": which}


def report() -> dict:
    machine = current_machine()
    backends = [status.as_dict() for status in list_backends()]
    try:
        lock = hub.read_lock()
    except hub.KernelLoadError as exc:
        lock = {"error": str(exc)}
    from .install_plan import build
    plan = build(machine)
    return {
        "python": python_info(),
        "recommendation": recommendation(machine, backends, plan),
        "groups": groups(backends, plan),
        "machine": {**machine_facts(machine), "packages": machine.packages},
        "default_backend": default_backend_info(backends),
        "source_builds": source_builds(lock),
        "backends": backends,
        "fetched_kernels": lock,
        "hub_kernels": hub_kernels(lock, backends),
        "loaded_kernels": [k.as_dict() for k in hub.loaded_kernels()],
    }


def hub_kernels(lock: dict, backends: list[dict] | None = None) -> list[dict]:
    """Each Hub kernel a backend uses: fetched by install.py (pinned in the lock and still cached) or not."""
    usable = {b["name"] for b in backends or [] if b["available"]}
    from ..registry import get, names
    kernels: dict[tuple, dict] = {}
    for name in names():
        spec = get(name).hub
        if spec is None:
            continue
        key = (spec.repo_id, spec.version, spec.revision)
        row = kernels.setdefault(key, {"repo_id": spec.repo_id, "version": spec.version, "revision": spec.revision,
                                       "backends": [], "fetched": False, "pinned": None, "variant": None,
                                       "path": None, "status": "not fetched: run `python install.py`"})
        row["backends"].append(name)
        if name in usable:
            row["status"] = ("not fetched: `python install.py` fetches and pins it (otherwise the first use "
                             "downloads it, which needs the network)")
    for row in kernels.values():
        if not any(n in usable for n in row["backends"]) and not row["status"].startswith("not fetched: `"):
            row["status"] = HUB_NOT_HERE
    entries = lock if isinstance(lock, dict) and "error" not in lock else {}
    for row in kernels.values():
        entry = entries.get(row["repo_id"])
        if not entry:
            continue
        if row["revision"] is None and hub._version_number(entry.get("version")) != row["version"]:
            row["status"] = (f"the lock pins version {entry.get('version')}, not {row['version']}: "
                             "rerun `python install.py`")
            continue
        build, why = hub.fetched_build(entry)
        row.update(pinned=entry.get("revision"), variant=entry.get("variant"), path=entry.get("path"),
                   signature=entry.get("signature"), fetched_at=entry.get("fetched_at"))
        if build is not None:
            row["fetched"] = True
            row["status"] = "fetched"
        else:
            row["status"] = f"pinned, but {why}: rerun `python install.py`"
    return list(kernels.values())


# ------------------------------------------------------------------------------------------------ recommendation

AUTOS = {"auto_exact": "Set Attention Backend's default: the fastest exact kernel, timed on your model's own calls",
         "auto_fast": "also quantised kernels (SageAttention int8/fp8), each admitted only if it keeps your model's "
                      "own attention within 5% of exact",
         "comfy default": "ComfyUI's own attention, untouched (Set Attention Backend only)"}


def _typical_signature(machine):
    """A call like a diffusion model's (SDXL's 64x64 level) in the dtype models run in on this device."""
    import torch
    from ..inputs import AttentionInputs
    gpu = machine.device_type not in ("cpu",)
    device = {"rocm": "cuda"}.get(machine.device_type, machine.device_type)
    return AttentionInputs.of(2, 10, 4096 if gpu else 1024, 64, dtype=torch.bfloat16 if gpu else torch.float32,
                              device=device)


def auto_candidates(machine, exact: bool) -> list[str]:
    """The backends `auto_exact` (or `auto_fast`) chooses among for a typical call here, in preference order."""
    from ..auto import Tuner
    try:
        names, _, _ = Tuner(cache_path=None).candidates(_typical_signature(machine), exact=exact)
    except Exception:  # a device string torch cannot build here (simulated machines): the availability list
        return []
    return names


def bench_figures(machine, root: Path | None = None) -> dict | None:
    """The newest `python -m dispatcher bench` result with native among its backends in bench/results for this GPU
    model (the pack's folder only): {"file", "date", "shapes": [{"label", "native_ms", "exact": (name, ms),
    "quantised": (name, ms) | None}]}."""
    root = root or Path(__file__).resolve().parents[2] / "bench" / "results"
    if not root.is_dir():
        return None
    found = []
    for path in root.glob("*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or "shapes" not in data or \
                data.get("meta", {}).get("device_name") != machine.device_name:
            continue
        shapes = []
        for shape in data["shapes"]:
            rows = [r for r in shape.get("rows", []) if r.get("valid") and r.get("ms")]
            native = next((r["ms"] for r in rows if r["backend"] == "native"), None)
            exact = min((r for r in rows if not r.get("quantised")), key=lambda r: r["ms"], default=None)
            fast = min((r for r in rows if r.get("quantised")), key=lambda r: r["ms"], default=None)
            if exact is None:
                continue
            shapes.append({"label": shape.get("label", shape.get("name")), "native_ms": native,
                           "exact": (exact["backend"], exact["ms"]),
                           "quantised": (fast["backend"], fast["ms"]) if fast else None})
        if any(shape["native_ms"] for shape in shapes):
            found.append({"file": f"bench/results/{path.name}", "date": str(data["meta"].get("date") or path.name),
                          "shapes": shapes})
    return max(found, key=lambda f: (f["date"], len(f["shapes"])), default=None)


def recommendation(machine, backends: list[dict], plan) -> dict:
    """What to use on this machine and what would add more: {"use", "lines", "exact", "fast", "install",
    "measured"}."""
    exact, fast = auto_candidates(machine, True), auto_candidates(machine, False)
    quantised = [n for n in fast if n not in exact]
    where = "this CPU" if machine.device_type == "cpu" else machine.device_name
    lines = []
    if exact:
        lines.append(f"auto_exact (Set Attention Backend's default) chooses among {', '.join(exact)} on {where}: it times them on your "
                     f"model's first calls of each shape and keeps the fastest; {exact[0]} is preferred on a tie.")
    else:
        lines.append("auto_exact finds no exact kernel for a typical call here; it falls back to native.")
    if quantised:
        lines.append(f"auto_fast adds {', '.join(quantised)}: faster, slightly inexact, each admitted only on your "
                     "model's own values. Use it for speed; the quality guard watches it while sampling.")
    else:
        lines.append("auto_fast gains nothing here: no quantised kernel (SageAttention) can run on this machine.")
    from .install_plan import BROKEN, FETCH, OPT_IN
    install = []
    fetchable = [b.name for b in plan.by_status(FETCH)]
    if fetchable:
        install.append(f"python install.py fetches the Hub kernels of {', '.join(fetchable)}")
    install += [f"{step.command}  ({step.package})" if step.package and step.package not in step.command
                else step.command for step in plan.pip_commands() + plan.build_commands()]
    waiting = [b.name for b in plan.by_status(OPT_IN)]
    if waiting:
        install.append(f"{', '.join(waiting)} wait for an opt-in (see below)")
    broken = [b.name for b in plan.by_status(BROKEN)]
    if broken:
        install.append(f"{', '.join(broken)}: installed but broken here (see below)")
    if not install:
        usable = sum(1 for b in backends if b["available"])
        install.append(f"nothing to install: the other {len(backends) - usable} backends need hardware this "
                       "machine does not have" if machine.device_type == "cpu" else
                       "nothing to install: every backend for this machine is there")
    use = "auto_fast" if quantised else "auto_exact"
    return {"use": use, "lines": lines, "exact": exact, "fast": fast, "install": install,
            "measured": bench_figures(machine)}


def groups(backends: list[dict], plan) -> dict:
    """Backends that run here (in preference order), those one step away, and the rest grouped by the one reason
    that decides (the device before any package: a pip hint is no use without the GPU it needs): the install plan's
    own grouping (`install_plan.not_here`), so the doctor and install.py group alike."""
    from .install_plan import DISABLED, UNSUPPORTED, not_here
    statuses = {b.name: b for b in plan.backends}
    usable = [b["name"] for b in backends if b["available"]]
    step_away = []
    for b in backends:
        planned = statuses.get(b["name"])
        if b["available"] or planned is None or planned.status in (UNSUPPORTED, DISABLED):
            continue
        step_away.append({"name": b["name"], "status": planned.status,
                          "why": "; ".join(planned.why or b["reasons"]),
                          "todo": "; ".join(s.command for s in planned.steps)})
    return {"usable": usable, "step_away": step_away,
            "not_here": [{"reason": r, "backends": names} for r, names in not_here(plan)]}


# ------------------------------------------------------------------------------------------------ text

def render(data: dict, width: int = 110) -> str:
    m = data["machine"]
    lines = []
    py = data.get("python")
    if py:
        lines.append(f"Python: {py['executable']} (Python {py['version']}, torch {py['torch']}): {py['which']}")
    lines += [f"Machine: {machine_text(m)}",
              "Attention packages: " + (", ".join(f"{k} {v}" for k, v in sorted(m["packages"].items())
                                                  if k != "torch") or "none")]
    d = data.get("default_backend")
    if d:  # the library's process default; in ComfyUI a model without Set Attention Backend keeps ComfyUI's own
        if d["problem"]:
            lines.append(f"{LIBRARY_DEFAULT}: PROBLEM: {d['problem']}")
        else:
            state = ("" if d["available"] in (None, True) else
                     f" (cannot run here: {'; '.join(d['reasons'])[:160]}; calls fall back)")
            lines.append(f"{LIBRARY_DEFAULT}: {d['backend']} ({d['source']}){state}")
    for build in data.get("source_builds", []):
        lines.append(f"Built here: {build.get('package')} {build.get('package_version')} for {build.get('variant')} "
                     f"from {build.get('source')} @ {str(build.get('revision'))[:12]} in {build.get('build_seconds')} s "
                     f"({build.get('fetched_at')})")

    def wrapped(text: str, indent: str) -> list[str]:
        return wrap(text, width, indent, indent + "  ")

    r = data.get("recommendation")
    if r:
        lines += ["", f"Recommended here: {r['use']} (in ComfyUI: Set Attention Backend's backend; as a library: "
                      f"backend=\"{r['use']}\")"]
        for line in r["lines"]:
            lines += wrapped(line, "  ")
        lines.append("  For more:")
        for line in r["install"]:
            lines += wrapped(line, "    ")
        measured = r.get("measured")
        if measured:
            lines.append(f"  Measured on this GPU model ({measured['file']}):")
            for shape in measured["shapes"]:
                name, ms = shape["exact"]
                text = f"{shape['label']}: {name} {ms:.3f} ms"
                if shape["native_ms"]:
                    text += f" (native {shape['native_ms']:.3f} ms, x{shape['native_ms'] / ms:.2f})"
                if shape["quantised"]:
                    qname, qms = shape["quantised"]
                    text += f"; quantised {qname} {qms:.3f} ms (x{(shape['native_ms'] or ms) / qms:.2f})"
                lines += wrapped(text, "    ")
        else:
            lines.append(f"  Measured: no figures for this machine in bench/results; `{command()} bench` measures "
                         "every backend here.")
    g = data.get("groups")
    by_name = {b["name"]: b for b in data["backends"]}
    usable = (g or {}).get("usable", [])
    lines += ["", f"Run here ({len(usable)} of {len(data['backends'])} backends, in preference order, after the "
                  "autos; what Set Attention Backend's dropdown offers):"]
    for name, text in AUTOS.items():
        lines += wrapped(f"{name:24} {text}", "  ")
    for name in usable:
        if not registry.is_variant(name):
            lines += wrapped(f"{name:24} {by_name[name]['description']}", "  ")
    variants = [name for name in usable if registry.is_variant(name)]
    if variants:
        lines += wrapped(f"Kernel variants that run here ({len(variants)}): auto_exact times them and fallbacks pick "
                         "them; the dropdown leaves them out, the library's backend= and an API prompt take them "
                         "by name: " + ", ".join(f"{n} ({by_name[n]['description']})" for n in variants), "  ")
    if g and g["step_away"]:
        lines += ["", "One step away:"]
        for row in g["step_away"]:
            lines += wrapped(f"{row['name']:24} {row['status']}: {row['why']}"
                             + (f" -> {row['todo']}" if row["todo"] and row["todo"] not in row["why"] else ""), "  ")
    if g and g["not_here"]:
        lines += ["", "Not for this machine:"]
        for row in g["not_here"]:
            lines += wrapped(f"{row['reason']} ({len(row['backends'])}): {', '.join(row['backends'])}", "  ")
    fetched = data["fetched_kernels"]
    lines.append("")
    if isinstance(fetched, dict) and "error" in fetched:
        lines.append(f"Lock file: {fetched['error']}")
    lock = hub.lock_path()
    lines.append(f"Hub kernels (lock file {lock}):" if lock.exists() else
                 f"Hub kernels (no lock file yet: `python install.py` writes {lock.name} when it fetches one):")
    idle = sorted((row["repo_id"] for row in data.get("hub_kernels", []) if not row["fetched"]
                   and row["status"] == HUB_NOT_HERE), key=str.lower)
    if idle:
        lines += wrapped(f"{HUB_NOT_HERE} ({len(idle)}): {', '.join(idle)}", "  ")
    for row in data.get("hub_kernels", []):
        if row["repo_id"] in idle:
            continue
        label = f"{row['repo_id']} " + (f"v{row['version']}" if row["revision"] is None else f"@{row['revision']}")
        if row["fetched"]:
            state = f"fetched @ {str(row['pinned'])[:12]} ({row['variant']}, signature {row.get('signature') or '?'})"
        else:
            state = row["status"]
        lines.append(f"  {label:45} {state}  [{', '.join(row['backends'])}]")
    return "\n".join(lines)


def main(as_json: bool = False) -> int:
    data = report()
    print(json.dumps(data, indent=2, default=str) if as_json else render(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The doctor: this machine, every backend, what can run and why the others cannot."""

from __future__ import annotations

import json
import os
import textwrap

from .. import env, hub, registry
from ..machine import cpu_model as machine_cpu_model
from ..machine import current_machine
from ..registry import list_backends

DEVICE_NAMES = {"cuda": "NVIDIA CUDA GPU", "rocm": "AMD ROCm GPU", "mps": "Apple GPU (MPS)", "xpu": "Intel GPU (XPU)",
                "npu": "Ascend NPU", "xla": "XLA device", "cpu": "CPU only"}


def cpu_model() -> str:
    return machine_cpu_model() or "unknown CPU"


def machine_text(m: dict) -> str:
    """One readable line: 'NVIDIA H200 (NVIDIA CUDA GPU, sm_90), torch 2.11.0+cu130, CUDA 13.0' or
    'CPU only: no GPU visible to torch (Intel Xeon ..., 16 cores), torch 2.13.0+cpu'."""
    versions = f"torch {m['torch']}" + (f", CUDA {m['cuda']}" if m.get("cuda") else "") + \
        (f", HIP {m['hip']}" if m.get("hip") else "")
    if m["device"] == "cpu":
        cores = os.cpu_count()
        return (f"CPU only: no GPU visible to torch ({m.get('cpu') or cpu_model()}"
                + (f", {cores} cores" if cores else "") + f"), {versions}")
    kind = DEVICE_NAMES.get(m["device"], m["device"])
    arch = f", {m['arch']}" if m.get("arch") and m["arch"] != m["device"] else ""
    return f"{m['name']} ({kind}{arch}), {versions}"


def default_backend_info(backends: list[dict] | None = None) -> dict:
    """The process default backend and where it comes from, read the way the dispatcher reads it, without
    setting anything: {"backend", "source", "problem", "available", "reasons"}."""
    raw = os.environ.get(env.ATTN_BACKEND)
    wanted = env.value(env.ATTN_BACKEND)
    info = {"backend": "native", "source": f"default ({env.ATTN_BACKEND} is not set)", "problem": None,
            "available": None, "reasons": []}
    if raw is not None and wanted is None:
        info["source"] = f"default ({env.ATTN_BACKEND} is set but empty)"
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
            info["source"] = f"default ({env.ATTN_BACKEND}={wanted!r} is ignored)"
    by_name = {b["name"]: b for b in backends or []}
    if info["backend"] in by_name:
        info["available"] = by_name[info["backend"]]["available"]
        info["reasons"] = by_name[info["backend"]]["reasons"]
    elif info["backend"] == "auto":
        info["available"] = True
    return info


def source_builds(lock: dict) -> list[dict]:
    """Packages `python install.py --build ...` built here and recorded in the lock file."""
    if not isinstance(lock, dict) or "error" in lock:
        return []
    return [e for e in lock.values() if isinstance(e, dict) and e.get("kind") == "source-build"]


def report() -> dict:
    machine = current_machine()
    backends = [status.as_dict() for status in list_backends()]
    try:
        lock = hub.read_lock()
    except hub.KernelLoadError as exc:
        lock = {"error": str(exc)}
    return {
        "machine": {"device": machine.device_type, "name": machine.device_name, "arch": machine.arch,
                    "torch": machine.torch_version, "cuda": machine.cuda_version, "hip": machine.hip_version,
                    "cpu": cpu_model() if machine.device_type == "cpu" else None, "packages": machine.packages},
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
            row["status"] = "not fetched (no backend using it can run here)"
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


def render(data: dict, width: int = 110) -> str:
    m = data["machine"]
    lines = [f"Machine: {machine_text(m)}",
             "Attention packages: " + (", ".join(f"{k} {v}" for k, v in sorted(m["packages"].items()) if k != "torch")
                                       or "none")]
    d = data.get("default_backend")
    if d:
        if d["problem"]:
            lines.append(f"Default backend: PROBLEM: {d['problem']}")
        else:
            state = ("" if d["available"] in (None, True) else
                     f" (cannot run here: {'; '.join(d['reasons'])[:160]}; calls fall back)")
            lines.append(f"Default backend: {d['backend']}, from {d['source']}{state}")
    for build in data.get("source_builds", []):
        lines.append(f"Built here: {build.get('package')} {build.get('package_version')} for {build.get('variant')} "
                     f"from {build.get('source')} @ {str(build.get('revision'))[:12]} in {build.get('build_seconds')} s "
                     f"({build.get('fetched_at')})")
    lines.append("")
    available = [b for b in data["backends"] if b["available"]]
    lines.append(f"{len(available)} of {len(data['backends'])} backends can run here:")
    header = f"  {'backend':32} {'family':9} {'status':11} details"
    lines.append(header)
    lines.append("  " + "-" * (len(header) - 2))
    for b in data["backends"]:
        status = "available" if b["available"] else "unavailable"
        detail = b["description"] if b["available"] else "; ".join(b["reasons"])
        wrapped = textwrap.wrap(detail, width - 56) or [""]
        lines.append(f"  {b['name']:32} {b['family']:9} {status:11} {wrapped[0]}")
        lines.extend(f"  {'':32} {'':9} {'':11} {more}" for more in wrapped[1:])
    fetched = data["fetched_kernels"]
    lines.append("")
    if isinstance(fetched, dict) and "error" in fetched:
        lines.append(f"Lock file: {fetched['error']}")
    lines.append(f"Hub kernels (lock file {hub.lock_path()}):")
    for row in data.get("hub_kernels", []):
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

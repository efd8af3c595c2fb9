"""The doctor: this machine, every backend, what can run and why the others cannot."""

from __future__ import annotations

import json
import textwrap

from . import hub
from .machine import current_machine
from .registry import list_backends


def report() -> dict:
    machine = current_machine()
    try:
        lock = hub.read_lock()
    except hub.KernelLoadError as exc:
        lock = {"error": str(exc)}
    return {
        "machine": {"device": machine.device_type, "name": machine.device_name, "arch": machine.arch,
                    "torch": machine.torch_version, "cuda": machine.cuda_version, "hip": machine.hip_version,
                    "packages": machine.packages},
        "backends": [status.as_dict() for status in list_backends()],
        "fetched_kernels": lock,
        "loaded_kernels": [k.as_dict() for k in hub.loaded_kernels()],
    }


def render(data: dict, width: int = 110) -> str:
    m = data["machine"]
    lines = [f"Machine: {m['name']} ({m['device']}, {m['arch']}), torch {m['torch']}"
             + (f", CUDA {m['cuda']}" if m["cuda"] else "") + (f", HIP {m['hip']}" if m["hip"] else ""),
             "Attention packages: " + (", ".join(f"{k} {v}" for k, v in sorted(m["packages"].items()) if k != "torch")
                                       or "none"), ""]
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
    lines.append("Fetched Hub kernels (lock file): " + (", ".join(
        f"{repo} v{e.get('version')} @ {str(e.get('revision'))[:12]}" for repo, e in fetched.items()) if fetched else "none"))
    return "\n".join(lines)


def main(as_json: bool = False) -> int:
    data = report()
    print(json.dumps(data, indent=2, default=str) if as_json else render(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What a measurement depends on: the device, torch and every attention package's version."""

from __future__ import annotations

import functools
import hashlib
import json
import platform
from pathlib import Path
from typing import Any

from ..machine import Machine, current_machine


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def machine_fingerprint(machine: Machine | None = None) -> dict[str, Any]:
    """What a measurement depends on: the device, torch and every attention package's version."""
    m = machine or current_machine()
    return {"device": m.device_type, "name": m.device_name if m.device_type != "cpu" else cpu_model(),
            "capability": list(m.cuda_capability) if m.cuda_capability else None, "rocm_arch": m.rocm_arch,
            "torch": m.torch_version, "cuda": m.cuda_version, "hip": m.hip_version,
            "packages": dict(sorted(m.packages.items()))}


def fingerprint_key(fingerprint: dict) -> str:
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]

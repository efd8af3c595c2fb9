"""What a measurement depends on: the device, torch and every attention package's version."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ..machine import Machine, current_machine
from ..machine import cpu_model as machine_cpu_model


def cpu_model() -> str:
    """The CPU's name as the disk cache keys it ('cpu' when unknown)."""
    return machine_cpu_model() or "cpu"


def machine_fingerprint(machine: Machine | None = None) -> dict[str, Any]:
    """What a measurement depends on: the device, torch and every attention package's version."""
    m = machine or current_machine()
    return {"device": m.device_type, "name": m.device_name if m.device_type != "cpu" else cpu_model(),
            "capability": list(m.cuda_capability) if m.cuda_capability else None, "rocm_arch": m.rocm_arch,
            "torch": m.torch_version, "cuda": m.cuda_version, "hip": m.hip_version,
            "packages": dict(sorted(m.packages.items()))}


def fingerprint_key(fingerprint: dict) -> str:
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]

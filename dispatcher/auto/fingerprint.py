"""What a measurement depends on: the machine's fingerprint (`Machine.fingerprint`, `Machine.key`), as `auto` names
it in its records and its disk cache."""

from __future__ import annotations

from typing import Any

from ..machine import Machine, current_machine
from ..machine import cpu_model as machine_cpu_model
from ..machine import fingerprint_key  # noqa: F401  (the disk cache's machine key, for a stored fingerprint)


def cpu_model() -> str:
    """The CPU's name as the disk cache keys it ('cpu' when unknown)."""
    return machine_cpu_model() or "cpu"


def machine_fingerprint(machine: Machine | None = None) -> dict[str, Any]:
    """What a measurement depends on: the device, torch and every attention package's version."""
    return (machine or current_machine()).fingerprint()

"""Where `python install.py --build sageattention` applies: shared by the plan and the build (no imports back)."""

from __future__ import annotations

from ..machine import Machine

COMMAND = "python install.py --build sageattention"
# GPU architecture -> the oldest CUDA toolkit that builds SageAttention 2 for it
SUPPORTED = {(8, 0): "12.0", (8, 6): "12.0", (8, 9): "12.4", (9, 0): "12.3", (10, 0): "12.8", (12, 0): "12.8",
             (12, 1): "12.8"}


def applies(machine: Machine) -> str | None:
    """None when `python install.py --build sageattention` can help on this machine, else why not (for the plan)."""
    if machine.device_type != "cuda" or machine.cuda_capability is None:
        return "SageAttention 2 has CUDA kernels only (NVIDIA GPUs)"
    if tuple(machine.cuda_capability) not in SUPPORTED:
        return (f"SageAttention 2 has no kernels for {machine.arch} (it builds for "
                + ", ".join(f"sm_{a}{b}" for a, b in SUPPORTED) + ")")
    if not machine.cuda_version:
        return "this torch is not a CUDA build"
    return None

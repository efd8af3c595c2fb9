"""What this machine is: torch, accelerator, architecture and installed attention packages.

One seam for the whole package: everything that asks "can this run here?" reads a `Machine`.
`detect()` builds it from the real torch; tests and `install.py --simulate` inject their own with
`use_machine(...)`, so nothing patches torch internals.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import importlib.metadata
import json
import platform
import threading
from dataclasses import dataclass, field, replace

import torch

# Distributions whose versions decide backend availability: torch and triton, plus every package a
# registered backend requires (the registry adds them: `track`). A distribution can be installed while its
# import fails (ABI mismatch), which is why requirements also probe the import and a real call.
_tracked: list[str] = ["torch", "triton"]


def track(*distributions: str) -> None:
    """Look up these distributions' versions too (from the next detection on)."""
    global _detected
    new = [d for d in distributions if d not in _tracked]
    if new:
        _tracked.extend(new)
        _detected = None


def tracked_distributions() -> tuple[str, ...]:
    return tuple(_tracked)


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's model name ('AMD EPYC ...'), else what the platform module says; '' when nothing does."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or ""


@dataclass(frozen=True)
class Machine:
    """A description of one machine, real or simulated."""

    torch_version: str
    device_type: str  # "cuda", "rocm", "mps", "xpu", "npu", "xla" or "cpu": the accelerator torch would use
    device_name: str = "cpu"
    cuda_capability: tuple[int, int] | None = None
    rocm_arch: str | None = None  # e.g. "gfx942"
    cuda_version: str | None = None
    hip_version: str | None = None
    packages: dict[str, str] = field(default_factory=dict)  # distribution name -> version (installed only)
    simulated: bool = False

    @property
    def arch(self) -> str:
        if self.cuda_capability:
            return f"sm_{self.cuda_capability[0]}{self.cuda_capability[1]}"
        return self.rocm_arch or self.device_type

    def fingerprint(self) -> dict:
        """What a measurement depends on: the device, torch and every attention package's version (plain data: the
        disk cache stores it beside its decisions). A simulated machine says so: it never shares a real one's."""
        found = {"device": self.device_type,
                 "name": self.device_name if self.device_type != "cpu" else (cpu_model() or "cpu"),
                 "capability": list(self.cuda_capability) if self.cuda_capability else None,
                 "rocm_arch": self.rocm_arch, "torch": self.torch_version, "cuda": self.cuda_version,
                 "hip": self.hip_version, "packages": dict(sorted(self.packages.items()))}
        if self.simulated:
            found["simulated"] = True
        return found

    @functools.cached_property
    def key(self) -> str:
        """The machine's identity in every cache key (decisions, availability, `auto`'s choices and disk cache): its
        fingerprint's hash, worked out once per Machine. Two Machines that describe the same machine share it."""
        return fingerprint_key(self.fingerprint())

    def package_version(self, dist: str) -> str | None:
        return self.packages.get(dist)

    def with_packages(self, **versions: str | None) -> "Machine":
        packages = dict(self.packages)
        for dist, version in versions.items():
            dist = dist.replace("_", "-")
            if version is None:
                packages.pop(dist, None)
            else:
                packages[dist] = version
        return replace(self, packages=packages)


def fingerprint_key(fingerprint: dict) -> str:
    """A fingerprint's short hash (16 hex digits), as the disk cache has always keyed machines."""
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]


def _installed_packages() -> dict[str, str]:
    found = {}
    for dist in tuple(_tracked):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    found["torch"] = torch.__version__
    return found


def detect() -> Machine:
    packages = _installed_packages()
    base = dict(torch_version=torch.__version__, packages=packages,
                cuda_version=torch.version.cuda, hip_version=getattr(torch.version, "hip", None))
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        if base["hip_version"]:
            arch = getattr(props, "gcnArchName", "") or ""
            return Machine(device_type="rocm", device_name=props.name, rocm_arch=arch.split(":")[0] or None, **base)
        return Machine(device_type="cuda", device_name=props.name,
                       cuda_capability=tuple(torch.cuda.get_device_capability(0)), **base)
    if hasattr(torch, "npu") and _safe(lambda: torch.npu.is_available()):
        return Machine(device_type="npu", device_name="Ascend NPU", **base)
    if hasattr(torch, "xpu") and _safe(lambda: torch.xpu.is_available()):
        return Machine(device_type="xpu", device_name=_safe(lambda: torch.xpu.get_device_name(0)) or "Intel XPU", **base)
    if _safe(lambda: torch.backends.mps.is_available()):
        return Machine(device_type="mps", device_name="Apple MPS", **base)
    return Machine(device_type="cpu", device_name="cpu", **base)


def _safe(fn):
    try:
        return fn()
    except Exception:
        return None


_detected: Machine | None = None
_detect_lock = threading.Lock()
_override: contextvars.ContextVar[Machine | None] = contextvars.ContextVar("attn_dispatch_machine", default=None)


def current_machine() -> Machine:
    override = _override.get()
    if override is not None:
        return override
    global _detected
    if _detected is None:
        with _detect_lock:
            if _detected is None:
                _detected = detect()
    return _detected


def refresh() -> Machine:
    """Forget the cached detection (after installing a package in-process)."""
    global _detected
    with _detect_lock:
        _detected = None
    return current_machine()


@contextlib.contextmanager
def use_machine(machine: Machine):
    """Answer every availability question as if running on `machine` (simulation seam)."""
    token = _override.set(machine)
    try:
        yield machine
    finally:
        _override.reset(token)


def device_kind(device: torch.device) -> str:
    """The spec-level device kind of a tensor's device: ROCm GPUs report 'cuda' in torch."""
    if device.type == "cuda" and getattr(torch.version, "hip", None):
        return "rocm"
    return device.type


_capability_cache: dict[int, tuple[int, int]] = {}


def capability_of(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda":
        return None
    machine = current_machine()
    if machine.simulated:
        return machine.cuda_capability
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capability_cache:
        _capability_cache[index] = tuple(torch.cuda.get_device_capability(index))
    return _capability_cache[index]

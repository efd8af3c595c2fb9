"""What a backend needs from the machine, as data, each able to say why it is not met.

A requirement answers `reason(machine) -> str | None`; None means satisfied. Messages name the
problem and the fix (the pip command, the env var, the GPU needed). `unmet` is the one answer for a backend's
requirements: what the machine itself lacks (`machine_bound`: device, GPU generation, torch) decides alone, so an
install hint is given only where installing would make the backend run here.
"""

from __future__ import annotations

import importlib
import re
import threading
from dataclasses import dataclass
from typing import Callable, NamedTuple

from . import env
from .machine import Machine
from .versions import at_least

_import_errors: dict[str, str | None] = {}
# Re-entrant: a Probe runs under it, and a probe's call may import through import_error (FA3's FP8 probe does).
_import_lock = threading.RLock()


def import_error(module: str) -> str | None:
    """The error importing `module` raises on this machine (cached), or None if it imports."""
    if module in _import_errors:  # no lock once known: kernels call this per call, also inside torch.compile
        return _import_errors[module]
    with _import_lock:
        if module not in _import_errors:
            try:
                importlib.import_module(module)
                _import_errors[module] = None
            except Exception as exc:  # ImportError, OSError (ABI), RuntimeError (CUDA init)
                _import_errors[module] = f"{type(exc).__name__}: {exc}"
        return _import_errors[module]


def forget_imports() -> None:
    """Try the imports again (after an install). Not caches.forget's job: an input of availability (see
    registry.forget_availability), not a decision."""
    with _import_lock:
        _import_errors.clear()


def with_flags(hint: str, flags: str) -> str:
    """An install command with pip flags added before its closing remark in parentheses, if any."""
    remark = re.search(r"\s*\(.*\)\s*$", hint)
    core = hint[: remark.start()] if remark else hint
    return f"{core} {flags}" + (hint[remark.start():] if remark else "")


@dataclass(frozen=True)
class Package:
    remedy = "install"  # what fixes it when unmet (see Lack): a pip install (or a build) names the command
    dist: str
    min_version: str | None = None
    module: str | None = None  # the import that must work, e.g. "flash_attn.flash_attn_interface"
    pip: str | None = None  # the install command when it differs from `pip install dist>=min`
    torch: str | None = None  # the oldest torch its compiled code loads on (a wheel built for torch's stable ABI)
    vetted: bool = True  # False: a build from a publisher we cannot vouch for; install.py prints it, never runs it
    device: str | None = None  # a device stack ("an Ascend NPU"): the device exists only through it, so missing
    #                            means not this machine; it must match torch and its drivers, never pip-installed here

    # Modules of its requirements that come in a distribution of their own, which an install without dependencies
    # (--no-deps, a hand-picked wheel set) leaves out: (top-level module, the distribution carrying it, the
    # distribution whose version it must equal). The repair then names that distribution at that version.
    carriers: tuple[tuple[str, str, str], ...] = ()

    @property
    def machine_bound(self) -> bool:
        return self.device is not None

    @property
    def install_hint(self) -> str:
        if self.pip:
            return self.pip
        spec = f"{self.dist}>={self.min_version}" if self.min_version else self.dist
        return f"pip install '{spec}'"

    def describe(self) -> str:
        return f"{self.dist}>={self.min_version}" if self.min_version else self.dist

    @property
    def distributions(self) -> tuple[str, ...]:
        return (self.dist,) + tuple(dict.fromkeys(d for _, _, d in self.carriers))

    def reason(self, machine: Machine) -> str | None:
        if self.torch and not at_least(machine.torch_version, self.torch):
            return f"{self.dist} needs torch>={self.torch}; this torch is {machine.torch_version}"
        version = machine.package_version(self.dist)
        if version is None and self.device:
            return (f"needs {self.device} ({self.dist} is not installed; a device stack is installed with its "
                    "drivers, matching torch, never by this pack)")
        if version is None:
            return f"{self.dist} is not installed: {self.install_hint}"
        if self.min_version and not at_least(version, self.min_version):
            return f"{self.dist} {version} is older than the required {self.min_version}: {self.install_hint} --upgrade"
        if self.module and not machine.simulated:
            error = import_error(self.module)
            if error:
                return f"{self.dist} {version} is installed but `import {self.module}` fails ({error}); " \
                       + self.repair(machine, error)[1]
        return None

    def repair(self, machine: Machine, error: str | None = None) -> tuple[str, str]:
        """(the command, what it fixes) for this package installed but failing to import with `error` (default:
        this machine's own). A module of another package missing (flash-attn-4 without its CuTe DSL's
        `cutlass.cute`) wants that package: its carrier at the matching version when it is one, else the install
        command, which brings the missing requirements (never --force-reinstall, which would reinstall torch and
        every other requirement too); anything else a build of this one for this torch."""
        error = error if error is not None else (import_error(self.module) or "") if self.module else ""
        missing = re.search(r"No module named '([^']+)'", error)
        if missing and missing.group(1).split(".")[0] != (self.module or self.dist).split(".")[0]:
            name = missing.group(1)
            for root, carrier, matched in self.carriers:
                if name.split(".")[0] == root:
                    version = machine.package_version(matched)
                    command = f"pip install '{carrier}=={version}'" if version else f"pip install '{carrier}'"
                    return command, (f"`{name}` comes in {carrier}, which an install without dependencies leaves "
                                     f"out: {command}")
            return self.install_hint, (f"a package it needs is missing or incomplete (no `{name}`): install it "
                                       f"with its requirements, {self.install_hint}")
        return with_flags(self.install_hint, "--force-reinstall --no-deps"), "reinstall it for this torch"


@dataclass(frozen=True)
class OneOf:
    """Packages that each provide the same kernel (FlashAttention-3 from a source build, or a wheel):
    met when any one is; the reason lists what each one lacks, so every fix is named."""

    remedy = "install"
    packages: tuple[Package, ...]

    def describe(self) -> str:
        return " or ".join(p.describe() for p in self.packages)

    @property
    def distributions(self) -> tuple[str, ...]:
        return tuple(p.dist for p in self.packages)

    def reason(self, machine: Machine) -> str | None:
        reasons = []
        for package in self.packages:
            why = package.reason(machine)
            if why is None:
                return None
            reasons.append(why)
        return "; or ".join(reasons)


@dataclass(frozen=True)
class TorchVersion:
    machine_bound = True  # no install changes it (install.py never touches torch)
    min_version: str

    def describe(self) -> str:
        return f"torch>={self.min_version}"

    def reason(self, machine: Machine) -> str | None:
        if at_least(machine.torch_version, self.min_version):
            return None
        return f"torch {machine.torch_version} is older than the required {self.min_version}"


_DEVICE_NAMES = {"cuda": "an NVIDIA CUDA GPU", "rocm": "an AMD ROCm GPU", "npu": "an Ascend NPU (torch_npu)",
                 "xla": "an XLA device (torch_xla)", "mps": "Apple MPS", "xpu": "an Intel XPU", "cpu": "a CPU"}


@dataclass(frozen=True)
class OnDevice:
    machine_bound = True  # no install changes it (install.py never touches torch)
    kinds: frozenset[str]

    def describe(self) -> str:
        return "device in " + "/".join(sorted(self.kinds))

    def reason(self, machine: Machine) -> str | None:
        # The CPU is always present, and xla/npu devices exist only through their packages.
        if machine.device_type in self.kinds or "cpu" in self.kinds or self.kinds & {"xla", "npu"}:
            return None
        wanted = " or ".join(_DEVICE_NAMES.get(k, k) for k in sorted(self.kinds))
        return f"needs {wanted}; this machine has {_DEVICE_NAMES.get(machine.device_type, machine.device_type)}"


@dataclass(frozen=True)
class CudaCapability:
    machine_bound = True  # no install changes it (install.py never touches torch)
    minimum: tuple[int, int] | None = None
    maximum: tuple[int, int] | None = None  # inclusive
    exact: tuple[tuple[int, int], ...] | None = None  # kernels built for specific archs only (e.g. "9.0a")

    def describe(self) -> str:
        if self.exact:
            return "sm in " + ", ".join(f"{a}.{b}" for a, b in self.exact)
        low = f">= {self.minimum[0]}.{self.minimum[1]}" if self.minimum else ""
        high = f"<= {self.maximum[0]}.{self.maximum[1]}" if self.maximum else ""
        return "compute capability " + " and ".join(p for p in (low, high) if p)

    def check(self, capability: tuple[int, int] | None) -> str | None:
        if capability is None:
            return "needs an NVIDIA CUDA GPU"
        have = f"sm_{capability[0]}{capability[1]}"
        if self.exact and tuple(capability) not in self.exact:
            return f"built for {', '.join(f'sm_{a}{b}' for a, b in self.exact)} only; this GPU is {have}"
        if self.minimum and tuple(capability) < self.minimum:
            return f"needs compute capability >= {self.minimum[0]}.{self.minimum[1]}; this GPU is {have} (too old)"
        if self.maximum and tuple(capability) > self.maximum:
            return f"needs compute capability <= {self.maximum[0]}.{self.maximum[1]}; this GPU is {have} (too new)"
        return None

    def reason(self, machine: Machine) -> str | None:
        if machine.device_type != "cuda":
            return None  # OnDevice reports the missing GPU once
        return self.check(machine.cuda_capability)


@dataclass(frozen=True)
class RocmArch:
    machine_bound = True  # no install changes it (install.py never touches torch)
    archs: tuple[str, ...]

    def describe(self) -> str:
        return "ROCm arch in " + ", ".join(self.archs)

    def reason(self, machine: Machine) -> str | None:
        if machine.device_type != "rocm":
            return None
        if machine.rocm_arch in self.archs:
            return None
        return f"built for {', '.join(self.archs)} only; this GPU is {machine.rocm_arch or 'an unknown ROCm arch'}"


@dataclass(frozen=True)
class EnvOptIn:
    remedy = "opt-in"  # setting `var`
    var: str

    def describe(self) -> str:
        return f"{self.var}=1"

    def reason(self, machine: Machine) -> str | None:
        return None if env.flag(self.var) else f"experimental: set {self.var}=1 to enable it"


@dataclass(frozen=True)
class Probe:
    """A real tiny call on the real device: catches packages that import but cannot run
    (xformers built for another torch imports fine and then fails every call)."""

    remedy = "repair"  # its package is there but cannot run: reinstall it for this torch/GPU
    checked_last = True  # a real call: made only once every other requirement is met
    name: str
    run: Callable[[], None]

    def describe(self) -> str:
        return f"a working {self.name} call"

    def reason(self, machine: Machine) -> str | None:
        if machine.simulated:
            return None
        return _probe_result(self)


_probe_results: dict[str, str | None] = {}


def _probe_result(probe: Probe) -> str | None:
    with _import_lock:
        if probe.name not in _probe_results:
            try:
                probe.run()
                _probe_results[probe.name] = None
            except Exception as exc:
                first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                _probe_results[probe.name] = (f"imports but a tiny {probe.name} call fails "
                                              f"({type(exc).__name__}: {first_line[:300]}); reinstall it for this torch/GPU")
        return _probe_results[probe.name]



class Lack(NamedTuple):
    """One requirement a machine does not meet: the requirement (its `remedy` and `machine_bound` say what would
    fix it) and its reason, the words every caller says."""
    requirement: object
    reason: str


class Unmet(NamedTuple):
    """What a machine lacks of a backend's requirements: `reasons`, and whether the machine itself rules the
    backend out (`machine_bound`), when no install, opt-in or trust setting would make it run; `lacks`: the same
    reasons as records that name their requirement."""
    reasons: tuple[str, ...] = ()
    machine_bound: bool = False
    lacks: tuple[Lack, ...] = ()


def unmet(requirements, machine: Machine) -> Unmet:
    """Every requirement `machine` does not meet, in order. What the machine itself lacks (a device, a GPU
    generation, a torch) comes alone when it fails: a package's install command, an opt-in or a trust setting is
    no fix without the GPU it needs. A requirement `checked_last` (a Probe: a real call) is checked only once
    everything else is met."""
    bound = tuple(Lack(req, reason) for req in requirements if getattr(req, "machine_bound", False)
                  for reason in [req.reason(machine)] if reason)
    if bound:
        return _unmet(bound, True)
    found: list[Lack] = []
    for req in requirements:
        if found and getattr(req, "checked_last", False):
            continue
        reason = req.reason(machine)
        if reason:
            found.append(Lack(req, reason))
    return _unmet(tuple(found), False)


def _unmet(lacks: tuple[Lack, ...], machine_bound: bool) -> Unmet:
    return Unmet(tuple(lack.reason for lack in lacks), machine_bound, lacks)

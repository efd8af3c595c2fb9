"""What `install.py` would do on a machine: which backends run now, which after a Hub kernel fetch,
which need a pip package, and which cannot run there, all read from the registry's requirements.

Nothing here downloads or installs anything. A plan is computed for any `Machine`: the detected one,
or a simulated one from `SIMULATED` (`python install.py --simulate h200`), through the same
`use_machine` seam the rest of the dispatcher uses.
"""

from __future__ import annotations

import re
import shlex
import textwrap
from dataclasses import asdict, dataclass, field
from typing import Callable

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from .. import env, hub, registry, support, trust
from ..machine import Machine, current_machine, use_machine
from ..requirements import Package, with_flags
from ..versions import at_least

# Statuses, most usable first.
READY = "ready"  # runs now (a Hub backend whose kernel is already fetched and cached is also ready)
FETCH = "fetch"  # runs after `python install.py` fetches its Hub kernel
OPT_IN = "opt-in"  # fits this machine, but waits for a trust opt-in or an experimental switch
PIP = "pip"  # fits this machine, but needs a package installed (the exact command is given)
BROKEN = "broken"  # its package is installed but cannot run here (import or a tiny call fails)
DISABLED = "disabled"  # a Hub kernel while DIFFUSERS_DISABLE_REMOTE_CODE=true
UNSUPPORTED = "unsupported"  # not for this machine (device, architecture, torch version)
STATUSES = (READY, FETCH, OPT_IN, PIP, BROKEN, DISABLED, UNSUPPORTED)

# Never installed or changed by install.py (ComfyUI-Manager's pip blacklist; device stacks, which must match torch
# exactly and only make sense on their own hardware, are declared as such: Package.device).
PROTECTED = frozenset({"torch", "torchvision", "torchaudio", "torchsde"})


def _m(name: str, device_type: str, *, torch_version: str = "2.10.0+cu128", cuda: str | None = "12.8",
       hip: str | None = None, capability=None, rocm_arch=None, **packages: str) -> Machine:
    base = {"torch": torch_version, "kernels": "0.17.2"}
    if device_type in ("cuda", "rocm"):
        base["triton"] = "3.5.0"
    base.update({k.replace("_", "-"): v for k, v in packages.items()})
    return Machine(torch_version=torch_version, device_type=device_type, device_name=name,
                   cuda_capability=capability, rocm_arch=rocm_arch, cuda_version=cuda, hip_version=hip,
                   packages=base, simulated=True)


# Named machines for `install.py --simulate NAME`, the README and the tests.
SIMULATED: dict[str, Machine] = {
    "t4": _m("NVIDIA Tesla T4", "cuda", capability=(7, 5)),
    "rtx3090": _m("NVIDIA GeForce RTX 3090", "cuda", capability=(8, 6)),
    "a100": _m("NVIDIA A100-SXM4-80GB", "cuda", capability=(8, 0), flash_attn="2.8.3"),
    "rtx4090": _m("NVIDIA GeForce RTX 4090", "cuda", capability=(8, 9), sageattention="2.2.0"),
    "h100": _m("NVIDIA H100 80GB HBM3", "cuda", capability=(9, 0)),
    "h200": _m("NVIDIA H200", "cuda", capability=(9, 0)),
    "b200": _m("NVIDIA B200", "cuda", torch_version="2.10.0+cu130", cuda="13.0", capability=(10, 0)),
    "rtx5090": _m("NVIDIA GeForce RTX 5090", "cuda", torch_version="2.10.0+cu130", cuda="13.0", capability=(12, 0)),
    "mi300x": _m("AMD Instinct MI300X", "rocm", torch_version="2.10.0+rocm7.0", cuda=None, hip="7.0",
                 rocm_arch="gfx942"),
    "mi355x": _m("AMD Instinct MI355X", "rocm", torch_version="2.10.0+rocm7.0", cuda=None, hip="7.0",
                 rocm_arch="gfx950"),
    "rx9070": _m("AMD Radeon RX 9070 XT", "rocm", torch_version="2.10.0+rocm7.0", cuda=None, hip="7.0",
                 rocm_arch="gfx1201"),
    "rx7900": _m("AMD Radeon RX 7900 XTX", "rocm", torch_version="2.10.0+rocm7.0", cuda=None, hip="7.0",
                 rocm_arch="gfx1100"),
    "mac": _m("Apple M3 Max", "mps", torch_version="2.10.0", cuda=None),
    "arc": _m("Intel Arc B580", "xpu", torch_version="2.10.0+xpu", cuda=None),
    "ascend": _m("Ascend 910B", "npu", torch_version="2.10.0", cuda=None, torch_npu="2.10.0"),
    "cpu": _m("cpu", "cpu", torch_version="2.10.0+cpu", cuda=None),
}


def simulated(name: str) -> Machine:
    try:
        return SIMULATED[name]
    except KeyError:
        raise ValueError(f"unknown simulated machine {name!r}; choose one of: {', '.join(SIMULATED)}") from None


def safe_detect() -> tuple[Machine, str | None]:
    """The detected machine, or a CPU-only description plus the error when detection itself fails
    (a broken driver can make torch.cuda raise): install.py must still run."""
    try:
        return current_machine(), None
    except Exception as exc:  # noqa: BLE001
        try:
            import torch
            version = torch.__version__
        except Exception:  # noqa: BLE001
            version = "unknown"
        return (Machine(torch_version=version, device_type="cpu", device_name="cpu (detection failed)",
                        packages={"torch": version}),
                f"GPU detection failed ({type(exc).__name__}: {exc}); planning as a CPU-only machine")


@dataclass
class Step:
    """One action that would make a backend usable."""

    kind: str  # "fetch" | "pip" | "build" | "manual" | "env"
    command: str  # the fetch target, the pip command, the build command, the manual instruction or the env var to set
    package: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class BackendPlan:
    name: str
    family: str
    status: str
    reasons: list[str] = field(default_factory=list)  # every reason it cannot run here (support.why_not)
    why: list[str] = field(default_factory=list)  # the reasons that decide `status`
    steps: list[Step] = field(default_factory=list)
    hub: dict | None = None  # {"repo_id", "version", "revision", "function"}
    trust: str | None = None
    fetched: dict | None = None  # the lock entry when this kernel was fetched

    def as_dict(self) -> dict:
        data = asdict(self)
        data["steps"] = [s.as_dict() for s in self.steps]
        return data


@dataclass
class Plan:
    machine: Machine
    backends: list[BackendPlan]
    notes: list[str] = field(default_factory=list)

    def by_status(self, status: str) -> list[BackendPlan]:
        return [b for b in self.backends if b.status == status]

    def get(self, name: str) -> BackendPlan:
        for b in self.backends:
            if b.name == name:
                return b
        raise KeyError(name)

    def fetch_targets(self) -> list["FetchTarget"]:
        """The Hub kernels to fetch, one per (repo, version, revision), with the backends they serve."""
        targets: dict[tuple, FetchTarget] = {}
        for b in self.backends:
            if b.hub is None or b.status not in (FETCH, READY):
                continue
            key = (b.hub["repo_id"], b.hub["version"], b.hub["revision"])
            target = targets.get(key)
            if target is None:
                spec = registry.get(b.name).hub
                target = targets[key] = FetchTarget(spec.repo_id, spec.version, spec.revision, spec.min_kernels)
            target.backends.append(b.name)
            target.functions.append(b.hub["function"])
        return list(targets.values())

    def pip_commands(self) -> list[Step]:
        """Each distinct pip/manual step, in registry order (deduplicated)."""
        seen, steps = set(), []
        for b in self.backends:
            for step in b.steps:
                key = tuple(_pip_words(step.command) or [step.command])
                if step.kind in ("pip", "manual") and key not in seen:
                    seen.add(key)
                    steps.append(step)
        return steps

    def build_commands(self) -> list[Step]:
        """Each distinct source build (`python install.py --build ...`), run only when asked for by name."""
        seen, steps = set(), []
        for b in self.backends:
            for step in b.steps:
                if step.kind == "build" and step.command not in seen:
                    seen.add(step.command)
                    steps.append(step)
        return steps

    def as_dict(self) -> dict:
        m = self.machine
        return {
            "machine": {"device": m.device_type, "name": m.device_name, "arch": m.arch, "torch": m.torch_version,
                        "cuda": m.cuda_version, "hip": m.hip_version, "packages": dict(m.packages),
                        "simulated": m.simulated},
            "backends": [b.as_dict() for b in self.backends],
            "summary": {s: [b.name for b in self.by_status(s)] for s in STATUSES},
            "fetch": [t.as_dict() for t in self.fetch_targets()],
            "pip": [s.as_dict() for s in self.pip_commands()],
            "build": [s.as_dict() for s in self.build_commands()],
            "notes": list(self.notes),
        }


@dataclass
class FetchTarget:
    repo_id: str
    version: int | None
    revision: str | None
    min_kernels: str
    backends: list[str] = field(default_factory=list)
    functions: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.repo_id} " + (f"v{self.version}" if self.revision is None else f"@{self.revision}")

    def as_dict(self) -> dict:
        return {"repo_id": self.repo_id, "version": self.version, "revision": self.revision,
                "backends": list(self.backends), "functions": list(self.functions)}


# ------------------------------------------------------------------------------------------------ planning


def _package_step(req: Package, machine: Machine) -> tuple[str, Step | None, str | None]:
    """(status, step, what install.py adds to its reason) for an unmet Package requirement."""
    version = machine.package_version(req.dist)
    if req.device and version is None:  # the device exists only through its stack: missing means not this machine
        return UNSUPPORTED, None, None
    if req.dist in PROTECTED:
        return UNSUPPORTED, None, f"install.py never installs or changes {req.dist}"
    if req.torch and not at_least(machine.torch_version, req.torch):  # install.py never changes torch
        return UNSUPPORTED, None, None
    hint = req.install_hint
    if req.dist == "sageattention" and req.min_version and at_least(req.min_version, "2"):
        # PyPI stops at 1.0.6: SageAttention 2 is built from source, by install.py when asked (minutes of compiling)
        from .sage_support import COMMAND, applies
        why_not = applies(machine)
        if why_not is None:
            status = PIP if version is None or not at_least(version, req.min_version) else BROKEN
            return status, Step("build", COMMAND, req.dist), None
    if version is None:
        command, status = hint, PIP
    elif req.min_version and not at_least(version, req.min_version):
        command, status = with_flags(hint, "--upgrade"), PIP
    else:  # installed, new enough, but `import` fails: what its error asks for (a requirement, or a rebuild)
        command, status = req.repair(machine)[0], BROKEN
    argv = _pip_words(command) if req.vetted else None  # an unvetted build is the user's call, never ours
    return status, Step("pip" if argv else "manual", command, req.dist), None


def _requirement_step(req, machine: Machine) -> tuple[str, Step | None, str | None]:
    """`_package_step` of a Package, or of alternatives the first one install.py can install with pip, else
    the first with an instruction to print (one that fits this torch), else the first."""
    if isinstance(req, Package):
        return _package_step(req, machine)
    results = [_package_step(package, machine) for package in req.packages]
    for kind in ("pip", "manual"):
        for result in results:
            if result[1] is not None and result[1].kind == kind:
                return result
    return results[0]


def _pip_words(command: str) -> list[str] | None:
    """The pip arguments of `command` ('pip install X --flag (a remark)' -> ['install', 'X', '--flag']),
    or None when it is not a plain pip install (build from source, ...)."""
    core = re.sub(r"\s*\(.*\)\s*$", "", command.strip())
    try:
        words = shlex.split(core)
    except ValueError:
        return None
    if words[:2] != ["pip", "install"] or len(words) < 3 or any(_protected(w) for w in words[2:]):
        return None
    return words[1:]


def _protected(word: str) -> bool:
    """Whether a pip argument names a PROTECTED distribution, however it is spelled ('torch', 'Torch>=2.5',
    'torch[opt]==2.13.0; python_version>"3"'); flags and paths are not requirements."""
    if word.startswith("-"):
        return False
    try:
        return canonicalize_name(Requirement(word).name) in PROTECTED
    except InvalidRequirement:
        return False


def _classify(name: str, machine: Machine, why: support.WhyNot) -> tuple[str, list[Step], list[str]]:
    """(status, steps that would make it usable, the reasons that decide the status): `why`'s reasons (the machine's,
    as records naming their requirement, and trust's; support.why_not), each sorted by what would fix it (the
    requirement's declared `remedy`)."""
    spec = registry.get(name)
    found: dict[str, list[str]] = {}
    steps = []
    for requirement, reason in why.lacks:
        remedy = getattr(requirement, "remedy", None)
        if remedy == "install":  # a package (or one of several): its step, or why install.py cannot install it
            status, step, note = _requirement_step(requirement, machine)
            found.setdefault(status, []).append(f"{reason}; {note}" if note else reason)
            if step is not None:
                steps.append(step)
        elif remedy == "opt-in":
            found.setdefault(OPT_IN, []).append(reason)
            steps.append(Step("env", f"{requirement.var}=1"))
        elif remedy == "repair":  # the package imports but a real call fails
            found.setdefault(BROKEN, []).append(reason)
        else:  # the machine itself (device, GPU generation, torch), or a custom requirement: reported, not fixed
            found.setdefault(UNSUPPORTED, []).append(reason)
    for reason in why.trust:
        if env.flag(env.DISABLE_REMOTE_CODE):
            found.setdefault(DISABLED, []).append(reason)
        else:
            found.setdefault(OPT_IN, []).append(reason)
            steps.append(Step("env", f"{env.TRUST_REMOTE_KERNELS}=true"))
    if not found:
        return (FETCH if spec.hub is not None else READY), steps, []
    status = next(s for s in (UNSUPPORTED, DISABLED, BROKEN, PIP, OPT_IN) if s in found)
    if status in (UNSUPPORTED, DISABLED):
        steps = []  # nothing install.py or the user can install makes it run on this machine
    deciding = found[status] + [r for s in (BROKEN, PIP, OPT_IN) if s != status and status not in
                                (UNSUPPORTED, DISABLED) for r in found.get(s, [])]
    return status, steps, deciding


def _fetched_entry(spec, lock: dict[str, dict]) -> dict | None:
    entry = lock.get(spec.hub.repo_id)
    if not entry or not entry.get("revision"):
        return None
    if spec.hub.revision is None and hub._version_number(entry.get("version")) != spec.hub.version:
        return None
    return entry


def build(machine: Machine | None = None, *, lock: dict[str, dict] | None = None,
          is_cached: Callable[[dict], bool] | None = None) -> Plan:
    """The plan for `machine` (default: this one). `lock`: the lock file's entries (default: read it);
    `is_cached(entry)`: whether a fetched kernel is still in the cache (only asked for a real machine)."""
    notes = []
    if machine is None:
        machine, problem = safe_detect()
        if problem:
            notes.append(problem)
    if lock is None:
        try:
            lock = hub.read_lock()
        except hub.KernelLoadError as exc:
            notes.append(str(exc))
            lock = {}
    backends = []
    with use_machine(machine):
        for name in registry.names():
            spec = registry.get(name)
            why_not = support.why_not(name, machine=machine)
            status, steps, why = _classify(name, machine, why_not)
            plan = BackendPlan(name=name, family=spec.family, status=status, reasons=why_not.reasons, steps=steps,
                               why=why)
            if spec.hub is not None:
                plan.hub = {"repo_id": spec.hub.repo_id, "version": spec.hub.version,
                            "revision": spec.hub.revision, "function": spec.hub.function}
                plan.trust = trust.decide(spec.hub.repo_id).reason
                entry = _fetched_entry(spec, lock)
                if status == FETCH:
                    if entry is not None and not machine.simulated and (is_cached is None or is_cached(entry)):
                        plan.status, plan.fetched = READY, entry
                    else:
                        plan.steps.insert(0, Step("fetch", _label(spec.hub)))
                elif status == PIP:
                    plan.steps.append(Step("fetch", _label(spec.hub)))  # after the package, the kernel
            backends.append(plan)
    if env.flag(env.DISABLE_REMOTE_CODE):
        notes.append(f"{env.DISABLE_REMOTE_CODE}=true: no Hub kernel is fetched or loaded")
    return Plan(machine, backends, notes)


def _label(hub_kernel) -> str:
    return f"{hub_kernel.repo_id} " + (f"v{hub_kernel.version}" if hub_kernel.revision is None
                                       else f"@{hub_kernel.revision}")


# ----------------------------------------------------------------------------------------------- rendering

_STATUS_TEXT = {READY: "ready", FETCH: "after fetch", OPT_IN: "needs opt-in", PIP: "needs package",
                BROKEN: "broken", DISABLED: "disabled", UNSUPPORTED: "not here"}


def _detail(b: BackendPlan) -> str:
    if b.status == READY:
        if b.fetched:
            return (f"fetched {b.hub['repo_id']} v{b.fetched.get('version')} "
                    f"@ {str(b.fetched.get('revision'))[:12]} ({b.fetched.get('variant')})")
        return "runs now"
    if b.status == FETCH:
        return f"fetch {_label(registry.get(b.name).hub)} ({b.trust})"
    todo = []
    for step in b.steps:
        if step.kind in ("pip", "manual", "build"):
            todo.append(step.command)
        elif step.kind == "env":
            todo.append(f"set {step.command}")
        elif step.kind == "fetch":
            todo.append(f"then fetch {step.command}")
    if b.status in (UNSUPPORTED, DISABLED, BROKEN) or not todo:
        return "; ".join(b.why + todo)
    return "; ".join(todo)


DEVICE_NAMES = {"cuda": "NVIDIA CUDA GPU", "rocm": "AMD ROCm GPU", "mps": "Apple GPU (MPS)", "xpu": "Intel GPU (XPU)",
                "npu": "Ascend NPU", "xla": "XLA device", "cpu": "CPU only"}


def machine_facts(machine: Machine) -> dict:
    """What `machine_text` says of `machine`: {"device", "name", "arch", "torch", "cuda", "hip", "cpu"}."""
    from ..machine import cpu_model
    cpu = None
    if machine.device_type == "cpu":
        cpu = "a simulated CPU" if machine.simulated else (cpu_model() or "unknown CPU")
    return {"device": machine.device_type, "name": machine.device_name, "arch": machine.arch,
            "torch": machine.torch_version, "cuda": machine.cuda_version, "hip": machine.hip_version, "cpu": cpu}


def machine_text(m: dict) -> str:
    """One readable line: 'NVIDIA H200 (NVIDIA CUDA GPU, sm_90), torch 2.11.0+cu130, CUDA 13.0' or
    'CPU only: no GPU visible to torch (Intel Xeon ..., 16 cores), torch 2.13.0+cpu'."""
    import os
    versions = f"torch {m['torch']}" + (f", CUDA {m['cuda']}" if m.get("cuda") else "") + \
        (f", HIP {m['hip']}" if m.get("hip") else "")
    if m["device"] == "cpu":
        cores = os.cpu_count() if m.get("cpu") != "a simulated CPU" else None
        return (f"CPU only: no GPU visible to torch ({m.get('cpu') or 'unknown CPU'}"
                + (f", {cores} cores" if cores else "") + f"), {versions}")
    kind = DEVICE_NAMES.get(m["device"], m["device"])
    arch = f", {m['arch']}" if m.get("arch") and m["arch"] != m["device"] else ""
    return f"{m['name']} ({kind}{arch}), {versions}"


def machine_line(machine: Machine) -> str:
    tag = " [simulated]" if machine.simulated else ""
    packages = ", ".join(f"{k} {v}" for k, v in sorted(machine.packages.items()) if k != "torch") or "none"
    return f"Machine: {machine_text(machine_facts(machine))}{tag}\nAttention packages: {packages}"


def not_here(plan: Plan) -> list[tuple[str, list[str]]]:
    """The backends this machine cannot run whatever is installed (not here, or disabled), grouped by the reasons
    that decide, each group once, in the order first met, its backends by name: [(reason, [backend, ...])]."""
    groups: dict[str, list[str]] = {}
    for b in plan.backends:
        if b.status in (UNSUPPORTED, DISABLED):
            groups.setdefault("; ".join(b.why) or "cannot run here", []).append(b.name)
    return [(reason, sorted(names, key=by_name)) for reason, names in groups.items()]


def by_name(name: str) -> tuple[str, str]:
    """A backend's place in a list sorted by name: a variant beside its family (`_flash_3` by `flash_3_fp8`)."""
    return name.lstrip("_").lower(), name


def wrap(text: str, width: int, indent: str = "", more: str | None = None) -> list[str]:
    """`text` in lines of at most `width`, broken only between words: a repo id ("kernels-community/flash-attn4"), a
    command or a backend name stays whole, so it copies as one (a word longer than a line gets its own line)."""
    return textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=indent if more is None else more,
                         break_on_hyphens=False, break_long_words=False) or [indent]


def render(plan: Plan, width: int = 120) -> str:
    lines = [machine_line(plan.machine), ""]
    counts = ", ".join(f"{len(plan.by_status(s))} {_STATUS_TEXT[s]}" for s in STATUSES if plan.by_status(s))
    lines.append(f"Plan ({counts}):")
    header = f"  {'backend':30} {'status':14} what to do / why not"
    lines += [header, "  " + "-" * (len(header) - 2)]
    for status in STATUSES:  # ready first, then what one step would enable; what cannot run here is grouped below
        if status in (UNSUPPORTED, DISABLED):
            continue
        for b in plan.by_status(status):
            wrapped = wrap(_detail(b), max(40, width - 48))
            lines.append(f"  {b.name:30} {_STATUS_TEXT[b.status]:14} {wrapped[0]}")
            lines.extend(f"  {'':30} {'':14} {more}" for more in wrapped[1:])
    groups = not_here(plan)
    if groups:
        lines += ["", f"Not for this machine ({sum(len(names) for _, names in groups)}):"]
        for reason, names in groups:
            lines += wrap(f"{reason} ({len(names)}): {', '.join(names)}", width, "  ", "    ")
    targets = plan.fetch_targets()
    lines.append("")
    lines.append("Hub kernels for this machine: " + (", ".join(
        f"{t.label} ({', '.join(t.backends)})" for t in targets) if targets else "none"))
    pip = plan.pip_commands()
    if pip:
        lines.append("Packages that would enable more backends (never installed without --yes-pip):")
        lines.extend(f"  {s.command}" for s in pip)
    for step in plan.build_commands():
        owners = [b.name for b in plan.backends if any(s.command == step.command for s in b.steps)]
        lines.append(f"Build from source (only when you ask: it compiles for this GPU for a few minutes; "
                     f"{', '.join(owners)}):")
        lines.append(f"  {step.command}")
    for note in plan.notes:
        lines.append(f"Note: {note}")
    return "\n".join(lines)


def pip_argv(step: Step) -> list[str] | None:
    """`pip install 'x>=1' --flag` -> ['install', 'x>=1', '--flag'] (for `python -m pip`); None for a manual step."""
    return _pip_words(step.command) if step.kind == "pip" else None


__all__ = ["SIMULATED", "STATUSES", "BackendPlan", "FetchTarget", "Plan", "Step", "build", "machine_facts", "machine_line",
           "machine_text", "not_here", "pip_argv", "render", "safe_detect", "simulated"]

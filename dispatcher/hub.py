"""Loading Hub kernels through the real `kernels` library: trust first, pinned, recorded.

A kernel is loaded once per (repo, version, revision) and every load is recorded with the
revision and local path the library resolved, so reports can say exactly what code ran.
A lock file written by `install.py` (or named by ATTN_DISPATCH_KERNEL_LOCK) pins each repo to
the revision that was fetched, so an offline ComfyUI loads exactly what was installed.
"""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from . import env, trust
from .machine import current_machine
from .spec import HubKernel
from .versions import at_least

DEFAULT_LOCK = Path(__file__).resolve().parent.parent / "kernels.lock.json"


class KernelLoadError(RuntimeError):
    """A Hub kernel could not be loaded: refused by trust rules, missing, or broken."""


@dataclass(frozen=True)
class LoadedKernel:
    repo_id: str
    version: int | None
    revision: str | None
    path: str | None
    function: str
    trust: str
    from_lock: bool = False

    def as_dict(self) -> dict:
        return asdict(self)


_lock = threading.Lock()
_loaded: dict[tuple, tuple[Callable, LoadedKernel]] = {}


def lock_path() -> Path:
    return Path(env.value(env.KERNEL_LOCK) or DEFAULT_LOCK)


def read_lock(path: Path | None = None) -> dict[str, dict]:
    """repo_id -> entry ({"repo_id", "version", "revision", "variant", ...}) from the lock file, if any."""
    path = path or lock_path()
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        return {entry["repo_id"]: entry for entry in data.get("kernels", [])}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise KernelLoadError(f"the kernel lock file {path} is unreadable ({exc}); rerun `python install.py` "
                              "or delete the file") from exc


def _resolve(module, dotted: str):
    target = module
    for part in dotted.split("."):
        if not hasattr(target, part):
            raise KernelLoadError(f"kernel module '{getattr(module, '__name__', module)}' has no attribute '{dotted}'")
        target = getattr(target, part)
    return target


def _module_path(module) -> str | None:
    file = getattr(module, "__file__", None)
    return str(Path(file).parent) if file else None


def load(hub: HubKernel) -> tuple[Callable, LoadedKernel]:
    """The kernel function of `hub`, loaded once; raises KernelLoadError with the fix."""
    decision = trust.decide(hub.repo_id)
    if not decision.allowed:
        raise KernelLoadError(decision.reason)
    machine = current_machine()
    kernels_version = machine.package_version("kernels")
    if kernels_version is None:
        raise KernelLoadError(f"loading '{hub.repo_id}' needs the kernels library: pip install 'kernels>={hub.min_kernels}'")
    if not at_least(kernels_version, hub.min_kernels):
        raise KernelLoadError(f"kernels {kernels_version} is older than the required {hub.min_kernels}: "
                              f"pip install --upgrade 'kernels>={hub.min_kernels}'")
    locked = read_lock().get(hub.repo_id)
    revision = locked.get("revision") if locked and locked.get("version") == hub.version else hub.revision
    key = (hub.repo_id, hub.version if revision is None else None, revision, hub.function)
    with _lock:
        if key in _loaded:
            return _loaded[key]
        try:
            import kernels
        except Exception as exc:
            raise KernelLoadError(f"the kernels library fails to import ({type(exc).__name__}: {exc})") from exc
        kwargs = {"revision": revision} if revision else {"version": hub.version}
        if decision.opt_in and at_least(kernels_version, "0.14"):
            kwargs["trust_remote_code"] = True
        try:
            module = kernels.get_kernel(hub.repo_id, **kwargs)
        except Exception as exc:
            where = f"revision {revision} from {lock_path()}" if revision and locked else f"version {hub.version}"
            raise KernelLoadError(f"could not load '{hub.repo_id}' ({where}): {type(exc).__name__}: {exc}") from exc
        fn = _resolve(module, hub.function)
        record = LoadedKernel(repo_id=hub.repo_id, version=hub.version, revision=revision or _revision_of(module),
                              path=_module_path(module), function=hub.function, trust=decision.reason,
                              from_lock=bool(revision and locked))
        _loaded[key] = (fn, record)
        return fn, record


def _revision_of(module) -> str | None:
    try:
        import kernels
        for loaded in kernels.get_loaded_kernels():
            if loaded.module is module and loaded.repo_info is not None:
                return loaded.repo_info.revision
    except Exception:
        pass
    return None


def loaded_kernels() -> list[LoadedKernel]:
    with _lock:
        return [record for _, record in _loaded.values()]


def forget_loaded() -> None:
    with _lock:
        _loaded.clear()

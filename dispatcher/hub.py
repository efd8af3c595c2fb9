"""Loading Hub kernels through the real `kernels` library: trust first, pinned, recorded.

A kernel is loaded once per (repo, version, revision) and every load is recorded with the
revision and local path the library resolved, so reports can say exactly what code ran.
A lock file written by `install.py` (or named by ATTN_DISPATCH_KERNEL_LOCK) pins each repo to
the revision that was fetched, so an offline ComfyUI loads exactly what was installed: the build
directory it records is loaded straight from the cache (`fetched_build`), with no network and no
HF_HUB_OFFLINE needed, while the kernels library would still pick that build for this machine.

The kernels library checks a publisher itself before it reads anything, the cache included (`kernels_api`): where
the Hub cannot be reached to ask, a kernel the pack trusts is read from the cache alone, with kernels told to trust
that repo; a kernel that is not there fails with HubUnreachableError ("no network here"), not a trust refusal.
"""

from __future__ import annotations

import json
import os
import re
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, NamedTuple

from . import env, kernels_api, trust
from .machine import current_machine
from .spec import HubKernel
from .versions import at_least
from .log import logger

DEFAULT_LOCK = Path(__file__).resolve().parent.parent / "kernels.lock.json"


# <cache>/kernels--org--name/snapshots/<commit>/build/<variant>: where an HF-cache load came from.
_SNAPSHOT = re.compile(r"[\\/]snapshots[\\/]([0-9a-f]{40})[\\/]build[\\/]")


class KernelLoadError(RuntimeError):
    """A Hub kernel could not be loaded: refused by trust rules, missing, or broken."""


class HubUnreachableError(KernelLoadError):
    """The kernel is not in the local cache, and the Hub cannot be reached to download it (no network, or
    HF_HUB_OFFLINE=1): nothing is wrong with the kernel or the trust settings; it needs fetching once with network."""


@dataclass(frozen=True)
class LoadedKernel:
    repo_id: str
    version: int | None
    revision: str | None
    path: str | None
    function: str
    trust: str
    from_lock: bool = False  # the revision was pinned by the lock file
    # Where the code came from: "hub" (downloaded by `kernels`), "cache" (the offline HF cache) or
    # "local" (a LOCAL_KERNELS override, which ignores version and revision: revision is then None).
    source: str = "hub"

    def as_dict(self) -> dict:
        return asdict(self)


_lock = threading.RLock()  # a kernel's import may itself ask what is loaded
class LoadKey(NamedTuple):
    """Which build of a Hub kernel a load gets (the key of `_loaded`): a pinned revision, else the version."""
    repo_id: str
    version: int | None  # None where a revision is pinned: the revision alone names the build
    revision: str | None
    function: str

    @classmethod
    def of(cls, hub: HubKernel, revision: str | None) -> "LoadKey":
        return cls(hub.repo_id, hub.version if revision is None else None, revision, hub.function)


_loaded: dict[LoadKey, tuple[Callable, LoadedKernel]] = {}


def lock_path() -> Path:
    return Path(env.value(env.KERNEL_LOCK) or DEFAULT_LOCK)


def read_lock(path: Path | None = None) -> dict[str, dict]:
    """repo_id -> entry ({"repo_id", "version", "revision", "variant", ...}) from the lock file, if any.

    No file means nothing is pinned; a file that cannot be read or parsed raises KernelLoadError.
    """
    path = Path(path) if path is not None else lock_path()
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:  # IsADirectoryError, PermissionError, JSONDecodeError, UnicodeDecodeError
        raise _unreadable(path, f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("kernels", []), list):
        raise _unreadable(path, 'expected {"kernels": [{"repo_id", "version", "revision", "variant"}, ...]}')
    entries = {}
    for index, entry in enumerate(data.get("kernels", [])):
        if not isinstance(entry, dict) or not isinstance(entry.get("repo_id"), str) or not entry["repo_id"]:
            raise _unreadable(path, f"entry {index} has no repo_id")
        revision, version = entry.get("revision"), entry.get("version")
        if revision is not None and not (isinstance(revision, str) and revision.strip()):
            raise _unreadable(path, f"entry {index} ({entry['repo_id']}) has an invalid revision {revision!r}")
        if version is not None and _version_number(version) is None:
            raise _unreadable(path, f"entry {index} ({entry['repo_id']}) has an invalid version {version!r}")
        entries[entry["repo_id"]] = entry
    return entries


def _unreadable(path: Path, why: str) -> KernelLoadError:
    return KernelLoadError(f"the kernel lock file {path} is unreadable ({why}); rerun `python install.py` "
                           f"or delete the file (or point {env.KERNEL_LOCK} at a valid one)")


def _version_number(version) -> int | None:
    if isinstance(version, bool):
        return None
    if isinstance(version, int):
        return version
    if isinstance(version, str) and version.strip().lstrip("v").isdigit():
        return int(version.strip().lstrip("v"))
    return None


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
    lacking = hub.requirement.reason(machine)  # the words support.why_not says of the same requirement
    if lacking:
        raise KernelLoadError(f"could not load '{hub.repo_id}': {lacking}")
    kernels_version = machine.package_version("kernels")
    locked = read_lock().get(hub.repo_id)
    if locked and locked.get("revision") and _version_number(locked.get("version")) != hub.version:
        logger.warning("the kernel lock file %s pins '%s' version %s, but version %s is wanted; not using the pin "
                       "(rerun `python install.py`)", lock_path(), hub.repo_id, locked.get("version"), hub.version)
        locked = None
    if locked and not locked.get("revision"):
        locked = None
    revision = locked["revision"].strip() if locked else hub.revision
    key = LoadKey.of(hub, revision)
    with _lock:
        if key in _loaded:
            return _loaded[key]
        try:
            import kernels
        except Exception as exc:
            raise KernelLoadError(f"the kernels library fails to import ({type(exc).__name__}: {exc}); "
                                  f"reinstall it: pip install --upgrade 'kernels>={hub.min_kernels}'") from exc
        request = {"revision": revision} if revision else {"version": hub.version}
        # an opt-in reaches kernels' own check; a trusted publisher alone does not: kernels asks the Hub about it too
        opt_in = kernels_api.trust_argument(kernels_version, hub.repo_id) if decision.opt_in else {}
        if locked:
            where = f"revision {revision} pinned by {lock_path()}"
        else:
            where = f"revision {revision}" if revision else f"version {hub.version}"
        module = _load_fetched(kernels, hub.repo_id, locked, {**request, **opt_in}) if locked else None
        fetched = module is not None
        trusted_because = decision.reason
        if module is None:
            hint = (f"; the pinned revision is not available: rerun `python install.py`, or delete {lock_path()}"
                    if locked else "")
            module, fetched = _get_kernel(kernels, hub.repo_id, request, opt_in, kernels_version,
                                          f"could not load '{hub.repo_id}' ({where}): ", hint, decision.reason)
            if fetched:
                trusted_because += ("; the Hugging Face Hub could not be reached to confirm it, so the build in the "
                                    "local cache was loaded")
        fn = _resolve(module, hub.function)
        if not callable(fn):
            raise KernelLoadError(f"'{hub.function}' of kernel '{hub.repo_id}' is not callable "
                                  f"(it is {type(fn).__name__})")
        path = _module_path(module)
        resolved, source = _origin_of(module, path, fetched)
        if source == "local" and revision:
            logger.warning("'%s' is overridden by LOCAL_KERNELS (%s), which ignores the requested %s", hub.repo_id,
                           path, where)
        record = LoadedKernel(repo_id=hub.repo_id, version=hub.version,
                              revision=resolved or (revision if source != "local" else None),
                              path=path, function=hub.function, trust=trusted_because,
                              from_lock=bool(locked), source=source)
        _loaded[key] = (fn, record)
        return fn, record


def _get_kernel(kernels, repo_id: str, request: dict, opt_in: dict, kernels_version: str, failed: str, hint: str,
                trusted_because: str):
    """(module, read from the cache without the Hub) through `kernels.get_kernel`; where the Hub cannot be reached,
    the build already in the local cache. `failed` begins every error message. Raises KernelLoadError, with the
    pack's words for kernels' trust refusals, and HubUnreachableError where only the network is missing."""
    try:
        return kernels.get_kernel(repo_id, **request, **opt_in), False
    except Exception as exc:  # noqa: BLE001  (kernels raises ValueError, OSError, ImportError, httpx errors, ...)
        failure = exc
    if _hub_offline():  # get_kernel has read the cache alone already
        if kernels_api.not_cached(failure):
            raise HubUnreachableError(
                failed + "HF_HUB_OFFLINE=1 and it is not in the local kernel cache: run `python install.py` once "
                "with network and without HF_HUB_OFFLINE (it fetches and pins the kernel, which then loads "
                "offline)" + hint) from failure
        raise KernelLoadError(failed + _said(failure) + hint) from failure
    unreachable = kernels_api.hub_unreachable(failure)
    if unreachable is None:
        refusal = kernels_api.trust_refusal(failure)
        if refusal is not None:
            kind, cause = refusal
            raise KernelLoadError(failed + trust.kernels_refusal(repo_id, kind, _said(cause, 200))) from failure
        raise KernelLoadError(failed + _said(failure) + hint) from failure
    # The pack trusts this repo (it decided before any call) and the Hub cannot be asked: tell kernels so, and let it
    # read the cache alone, as HF_HUB_OFFLINE=1 would; nothing is downloaded.
    no_network = f"no network here? the Hugging Face Hub cannot be reached ({_said(unreachable, 200)})"
    if not at_least(kernels_version, "0.17"):
        raise HubUnreachableError(failed + no_network + f"; kernels {kernels_version} reads its cache only with "
                                  "HF_HUB_OFFLINE=1: set it, or pip install --upgrade 'kernels>=0.17.1'") from failure
    try:
        module = kernels_api.load_cached(kernels, repo_id, request,
                                         kernels_api.trust_argument(kernels_version, repo_id))
    except Exception as exc:  # noqa: BLE001
        if kernels_api.not_cached(exc):
            raise HubUnreachableError(
                failed + no_network + ", and it is not in the local kernel cache: run `python install.py` once on "
                "this machine with network (it fetches and pins the kernel, which then loads without network)"
                + hint) from exc
        raise KernelLoadError(failed + no_network + f", and loading it from the local cache failed: {_said(exc)}"
                              + hint) from exc
    logger.warning("cannot reach the Hugging Face Hub to confirm the publisher of '%s' (%s); loading it from the local "
                   "cache, since %s", repo_id, _said(unreachable, 200), trusted_because)
    return module, True


def _said(exc: BaseException, limit: int | None = None) -> str:
    """An error as one line of a message: its type and its words (the first `limit` characters), and the fix where the
    cause is a known version clash."""
    text = f"{type(exc).__name__}: {str(exc).strip()}"
    if limit is not None:
        text = " ".join(text.split())
        text = text if len(text) <= limit else text[:limit] + "..."
    return text + kernels_api.known_cause(exc)


def local_override(repo_id: str) -> str | None:
    """The LOCAL_KERNELS path that overrides `repo_id` (kernels' own 'org/name=/path:...' syntax), if any."""
    for item in (os.environ.get("LOCAL_KERNELS") or "").split(":"):
        name, sep, path = item.partition("=")
        if sep and name.strip() == repo_id:
            return path
    return None


def fetched_build(entry: dict) -> tuple[Path | None, str | None]:
    """(the variant directory of a lock entry, None) while it is still in the cache and is still the build
    the kernels library picks for this machine; (None, why not) otherwise.

    `install.py` records the directory `kernels.install_kernel` returned. Loading that directory needs
    no network and no Hub metadata, which an offline cache lookup by commit does (and which fails
    once only some of a repository's build variants were downloaded).
    """
    raw = entry.get("path")
    if not raw:
        return None, "the lock entry records no path"
    variant = Path(raw)
    if not (variant / "metadata.json").is_file():
        return None, f"{variant} is no longer in the cache"
    match = _SNAPSHOT.search(str(variant) + "/")
    if entry.get("revision") and (match is None or match.group(1) != str(entry["revision"]).strip()):
        return None, f"{variant} is not the snapshot of revision {entry.get('revision')}"
    try:
        chosen = kernels_api.chosen_variant(variant)
    except ImportError:  # a kernels with no variant resolution of its own (before 0.12): trust the recorded build
        return variant, None
    except Exception as exc:  # noqa: BLE001
        return None, f"the kernels library cannot check {variant.name} ({type(exc).__name__}: {exc})"
    if chosen is None or chosen.variant_str != variant.name:
        better = f" (it would pick {chosen.variant_str})" if chosen is not None else ""
        return None, f"the fetched build {variant.name} no longer fits this torch/GPU{better}"
    return variant, None


def _load_fetched(kernels, repo_id: str, locked: dict, kwargs: dict):
    """The module of the build `install.py` fetched for a lock entry, from the cache (no network), or None
    to let `get_kernel` resolve the pinned revision itself."""
    if local_override(repo_id):
        return None  # LOCAL_KERNELS wins, as it does inside get_kernel
    build, why = fetched_build(locked)
    if build is None:
        if locked.get("path"):
            logger.warning("not loading the fetched build of '%s' from the cache: %s; rerun `python install.py`",
                           repo_id, why)
        return None
    try:
        extra = {"trust_remote_code": kwargs["trust_remote_code"]} if "trust_remote_code" in kwargs else {}
        return kernels.get_local_kernel(build, **extra)
    except Exception as exc:  # noqa: BLE001
        logger.warning("the fetched build of '%s' at %s does not load (%s: %s); trying the kernels library's own "
                       "resolution of the pinned revision", repo_id, build, type(exc).__name__, exc)
        return None


def _origin_of(module, path: str | None, fetched: bool) -> tuple[str | None, str]:
    """(the commit that was loaded, where from: "hub" | "cache" | "local").

    The snapshot directory names the commit of every HF-cache load (a requested "v1" or "main" is a ref, not a
    commit). Whether that snapshot was just resolved on the Hub or read offline is the Hub's offline switch, which
    `kernels` itself reads to choose (every version since 0.12): `repo_info` cannot tell, since kernels 0.19
    fills it for offline loads too. A lock's fetched build (`fetched`) is read from the cache by path.
    """
    match = _SNAPSHOT.search((path or "") + "/")
    if match:
        return match.group(1), "cache" if fetched or _hub_offline() else "hub"
    try:
        import kernels
        for loaded in kernels.get_loaded_kernels():
            if loaded.module is module and loaded.repo_info is not None:
                return loaded.repo_info.revision, "hub"
    except Exception:  # noqa: BLE001  (kernels < 0.16 has no registry of loaded kernels)
        pass
    return None, "local"


def _hub_offline() -> bool:
    try:
        from huggingface_hub import constants
    except Exception:  # noqa: BLE001
        return False
    return bool(constants.HF_HUB_OFFLINE)


def loaded_kernels() -> list[LoadedKernel]:
    with _lock:
        return [record for _, record in _loaded.values()]


def fetched_repos() -> set[str]:
    """Hub repos whose kernel is loaded in this process or fetched (in the lock file): what `auto` may run without
    downloading code."""
    repos = {k.repo_id for k in loaded_kernels()}
    try:
        repos |= set(read_lock())
    except Exception:  # noqa: BLE001  (an unreadable lock file: nothing fetched)
        pass
    return repos


def forget_loaded() -> None:
    """Load Hub kernels again on their next use. Not caches.forget's job: this is the loader's cache, not a
    decision; a decision keeps running the kernel it holds until decisions are forgotten."""
    with _lock:
        _loaded.clear()

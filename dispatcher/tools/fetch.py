"""Fetching the Hub kernels a plan asks for, through the `kernels` library, and pinning them.

For each kernel the plan says fits this machine: the dispatcher's trust rules first (`trust.decide`:
untrusted publishers only with DIFFUSERS_TRUST_REMOTE_KERNELS=true, nothing at all with
DIFFUSERS_DISABLE_REMOTE_CODE=true), then `kernels.install_kernel(repo_id, version=N)`, which picks
the build variant for this torch/GPU and downloads it into the standard cache. The download is
checked the way a load would use it (architecture, import, the backend's functions), its sigstore
signature is verified where the library can, and the commit, variant and path are written to the
lock file `dispatcher.hub` reads, so a ComfyUI without network loads exactly that build.

Nothing here raises for a machine, network or Hub problem: each becomes one clear result line.
pip packages are only ever installed with explicit consent (`install_packages(..., yes=True)`), with
torch pinned by a constraint so pip cannot change it.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from .. import env, hub, kernels_api, trust
from ..log import PREFIX
from .install_plan import PROTECTED, FetchTarget, Plan, Step, pip_argv
from ..versions import at_least


# Result statuses.
FETCHED = "fetched"  # downloaded now and pinned in the lock file
PRESENT = "present"  # already pinned and still in the cache: nothing to do
WOULD_FETCH = "would-fetch"  # --dry-run
LOCAL = "local"  # LOCAL_KERNELS overrides the repo: nothing to fetch
REFUSED = "refused"  # trust rules forbid it
OFFLINE = "offline"  # the Hub cannot be reached (or HF_HUB_OFFLINE=1 and not cached)
FAILED = "failed"  # the Hub answered with an error, or the download is unusable


@dataclass
class FetchResult:
    repo_id: str
    version: int | None
    backends: list[str]
    status: str
    message: str
    revision: str | None = None  # the commit that was fetched / is pinned
    variant: str | None = None
    path: str | None = None
    signature: str | None = None
    seconds: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class PipResult:
    command: str
    status: str  # "suggested" | "installed" | "failed" | "manual" | "would-install"
    message: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Context:
    kernels: object
    out: Callable[[str], None]
    lock: dict[str, dict]
    lock_file: Path
    reachable: tuple[bool, str] | None = None
    offline_mode: bool = False
    written: list[str] = field(default_factory=list)


def _say(out: Callable[[str], None], message: str) -> None:
    out(f"{PREFIX} {message}")


def _why(exc: BaseException) -> str:
    """A one-line explanation of a failure, with the fix for the causes we know."""
    chain, seen = [], set()
    cursor: BaseException | None = exc
    while cursor is not None and id(cursor) not in seen:
        seen.add(id(cursor))
        chain.append(cursor)
        cursor = cursor.__cause__ or cursor.__context__
    raw = str(exc).strip()
    if "Cannot find a build variant" in raw:  # keep kernels' per-variant trace: it says why each was rejected
        text = " ".join(raw.split())
    else:
        text = " ".join((raw.splitlines() or [""])[0].split())
    if len(text) > 600:
        text = text[:600] + "..."
    message = f"{type(exc).__name__}: {text}"
    root = chain[-1]
    if root is not exc and not isinstance(root, (KeyboardInterrupt, SystemExit)):
        # huggingface_hub wraps HTTP errors in generic "check your connection" ones: name the real cause
        root_text = " ".join((str(root).strip().splitlines() or [""])[0].split())[:300]
        message += f" (caused by {type(root).__name__}: {root_text})"
    return message + kernels_api.known_cause(exc)


# ---------------------------------------------------------------------------------------------- lock file

def read_lock_for_update(out: Callable[[str], None]) -> dict[str, dict]:
    try:
        return dict(hub.read_lock())
    except hub.KernelLoadError as exc:
        _say(out, f"{exc}; it will be rewritten with what this run fetches")
        return {}


def write_lock(path: Path, entries: dict[str, dict]) -> None:
    """Atomically write {"kernels": [...]} (the format `dispatcher.hub.read_lock` reads)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"written_by": "install.py (attention-dispatch)",
            "kernels": [entries[k] for k in sorted(entries)]}
    fd, tmp = tempfile.mkstemp(prefix=".kernels.lock.", dir=str(path.parent))
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=2)
            handle.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _pinned(target: FetchTarget, entry: dict | None) -> bool:
    if not entry or not entry.get("revision"):
        return False
    if target.revision is not None:
        return entry.get("requested_revision") == target.revision
    return hub._version_number(entry.get("version")) == target.version


def is_cached(entry: dict) -> bool:
    """Whether a lock entry's build is still in the cache and still the one for this machine."""
    return hub.fetched_build(entry)[0] is not None


# ------------------------------------------------------------------------------------------ connectivity

def _hub_reachable(timeout: float = 10.0) -> tuple[bool, str]:
    """One quick request to the Hub endpoint (any HTTP answer counts), so an offline machine gets one
    clear line at once instead of retries per kernel."""
    try:
        from huggingface_hub import constants
        from huggingface_hub.utils import get_session
    except Exception as exc:  # noqa: BLE001
        return False, f"huggingface_hub is unusable ({_why(exc)})"
    endpoint = constants.ENDPOINT
    try:
        get_session().head(endpoint, timeout=timeout)
    except Exception as exc:  # noqa: BLE001  (httpx ConnectError, timeouts, proxy errors)
        return False, f"cannot reach the Hugging Face Hub at {endpoint} ({_why(exc)})"
    return True, endpoint


def _offline_mode() -> bool:
    try:
        from huggingface_hub import constants
        return bool(constants.HF_HUB_OFFLINE)
    except Exception:  # noqa: BLE001
        return False


# -------------------------------------------------------------------------------------------- signatures

def verify_signature(variant_path: Path) -> str:
    """'verified', 'unsigned', 'failed: ...' (the files differ from the signed digest) or 'unverified: ...'.

    The kernels library's own check (kernels>=0.16, with its optional sigstore; the kernels-community build
    workflows are the trusted signers), wherever the installed version keeps it (`kernels_api`). Never raises.
    """
    try:
        kind, detail = kernels_api.signature_result(Path(variant_path), *_repo_and_commit_of(Path(variant_path)))
    except ImportError as exc:  # older kernels, sigstore missing, or no Hub snapshot to name
        return f"unverified: this kernels install cannot verify signatures ({type(exc).__name__})"
    except Exception as exc:  # noqa: BLE001  (sigstore's trust root needs the network, ...)
        return f"unverified: {_why(exc)}"
    if kind in ("verified", "unsigned"):
        return kind
    if kind == "digest-failed":
        return "failed: the downloaded files differ from the signed digest " + detail
    if kind in ("digest-missing", "metadata-missing"):
        return "unverified: the metadata has no digest" if kind == "digest-missing" else "unverified: no metadata"
    return f"unverified: {detail}"


def _repo_and_commit_of(path: Path) -> tuple[str | None, str | None]:
    """(repo_id, commit) of a build in the HF cache (<cache>/kernels--org--name/snapshots/<commit>/build/<v>)."""
    commit = _commit_of(path)
    for parent in path.parents:
        if parent.name.startswith("kernels--") and commit:
            return parent.name[len("kernels--"):].replace("--", "/", 1), commit
    return None, commit


# ----------------------------------------------------------------------------------------------- fetching

def _check_build(ctx: _Context, target: FetchTarget, path: Path, trust_kwargs: dict) -> str | None:
    """Why the downloaded build cannot be used, or None: the library's architecture check, then the
    import and the functions the backends call (what a load will do)."""
    try:
        kernels_api.check_arch(path)
    except ImportError:
        pass  # a kernels without the check: the import below still checks the build
    except Exception as exc:  # noqa: BLE001
        return f"the build does not support this device: {_why(exc)}"
    try:
        try:
            module = ctx.kernels.get_local_kernel(path, **trust_kwargs)
        except TypeError:  # kernels<0.14: get_local_kernel(repo_path, package_name); load the pinned commit instead
            module = ctx.kernels.get_kernel(target.repo_id, revision=_commit_of(path), **trust_kwargs)
    except Exception as exc:  # noqa: BLE001
        return f"the download does not import (corrupted or incomplete?): {_why(exc)}"
    for function in dict.fromkeys(target.functions):
        try:
            fn = hub._resolve(module, function)
        except hub.KernelLoadError as exc:
            return str(exc)
        if not callable(fn):
            return f"'{function}' of '{target.repo_id}' is not callable"
    return None


def _commit_of(path: Path) -> str | None:
    match = hub._SNAPSHOT.search(str(path) + "/")
    return match.group(1) if match else None


def _fetch_one(ctx: _Context, target: FetchTarget, machine_kernels: str | None, dry_run: bool) -> FetchResult:
    result = FetchResult(target.repo_id, target.version, list(target.backends), FAILED, "")

    def done(status: str, message: str, **extra) -> FetchResult:
        result.status, result.message = status, message
        for key, value in extra.items():
            setattr(result, key, value)
        return result

    decision = trust.decide(target.repo_id)
    if not decision.allowed:
        return done(REFUSED, decision.reason)
    if machine_kernels is None:
        return done(FAILED, f"the kernels library is not installed: pip install 'kernels>={target.min_kernels}'")
    if not at_least(machine_kernels, target.min_kernels):
        return done(FAILED, f"kernels {machine_kernels} is older than the required {target.min_kernels}: "
                            f"pip install --upgrade 'kernels>={target.min_kernels}'")
    override = hub.local_override(target.repo_id)
    if override:
        return done(LOCAL, f"LOCAL_KERNELS points '{target.repo_id}' at {override}: nothing to fetch "
                           "(the dispatcher loads it from there)")
    entry = ctx.lock.get(target.repo_id)
    if _pinned(target, entry):
        build, why = hub.fetched_build(entry)
        if build is not None:
            return done(PRESENT, f"already fetched: {target.label} @ {entry['revision'][:12]} ({entry.get('variant')})",
                        revision=entry["revision"], variant=entry.get("variant"), path=entry.get("path"),
                        signature=entry.get("signature"))
        _say(ctx.out, f"{target.label}: the pinned build cannot be used any more ({why}); fetching it again")
    if dry_run:
        return done(WOULD_FETCH, f"would fetch {target.label} for {', '.join(target.backends)} ({decision.reason})")

    # an opt-in reaches kernels' own publisher check as its allowlist; a trusted publisher alone is asked of the Hub
    trust_kwargs = kernels_api.trust_argument(machine_kernels, target.repo_id) if decision.opt_in else {}
    request = {"revision": target.revision} if target.revision is not None else {"version": target.version}
    if ctx.offline_mode:
        request["local_files_only"] = True
    elif ctx.reachable is None:
        ctx.reachable = _hub_reachable()
    if not ctx.offline_mode and not ctx.reachable[0]:
        return done(OFFLINE, f"{ctx.reachable[1]}: {target.label} not fetched")

    where = "the offline cache (HF_HUB_OFFLINE=1)" if ctx.offline_mode else "the Hub"
    _say(ctx.out, f"fetching {target.label} from {where} for {', '.join(target.backends)} ...")
    started = time.monotonic()
    try:
        path = Path(ctx.kernels.install_kernel(target.repo_id, **request, **trust_kwargs))
    except Exception as exc:  # noqa: BLE001  (Hub errors, no build for this system, trust, network)
        offline = ctx.offline_mode or kernels_api.hub_unreachable(exc)
        refusal = None if offline else kernels_api.trust_refusal(exc)
        if refusal is not None:  # kernels' own publisher check said no: the pack's words and fix
            return done(REFUSED, f"{target.label}: " + trust.kernels_refusal(target.repo_id, refusal[0],
                                                                               _why(refusal[1])))
        hint = "; it is not in the local cache" if ctx.offline_mode else ""
        return done(OFFLINE if offline else FAILED, f"could not fetch {target.label}: {_why(exc)}{hint}")
    seconds = round(time.monotonic() - started, 2)
    commit = _commit_of(path)
    _say(ctx.out, f"  got {path.name} @ {(commit or '?')[:12]} in {seconds:.1f}s; checking it")
    problem = _check_build(ctx, target, path, trust_kwargs)
    if problem:
        return done(FAILED, f"{target.label}: {problem}; not pinned", path=str(path), variant=path.name,
                    revision=commit, seconds=seconds)
    signature = verify_signature(path)
    if signature.startswith("failed"):
        return done(FAILED, f"{target.label}: signature check {signature}; not pinned", path=str(path),
                    variant=path.name, revision=commit, seconds=seconds, signature=signature)
    if commit is None:
        return done(FAILED, f"{target.label}: downloaded to {path}, which is not a Hub cache snapshot, so no "
                            "commit can be pinned", path=str(path), variant=path.name, seconds=seconds)
    new_entry = {"repo_id": target.repo_id, "version": target.version, "revision": commit, "variant": path.name,
                 "path": str(path), "fetched_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                 "backends": list(target.backends), "signature": signature, "trust": decision.reason,
                 "kernels": machine_kernels}
    if target.revision is not None:
        new_entry["requested_revision"] = target.revision
    ctx.lock[target.repo_id] = new_entry
    write_lock(ctx.lock_file, ctx.lock)
    ctx.written.append(target.repo_id)
    return done(FETCHED, f"fetched {target.label} @ {commit[:12]} ({path.name}, signature {signature})",
                revision=commit, variant=path.name, path=str(path), signature=signature, seconds=seconds)


def fetch(plan: Plan, *, dry_run: bool = False, only: set[str] | None = None,
          out: Callable[[str], None] = print) -> list[FetchResult]:
    """Fetch every Hub kernel the plan says fits this machine. Never raises for machine, network or Hub
    problems; each target gets one FetchResult (and one or two progress lines)."""
    if plan.machine.simulated:
        _say(out, "simulated machine: nothing is fetched")
        return []
    if env.flag(env.DISABLE_REMOTE_CODE):
        _say(out, f"{env.DISABLE_REMOTE_CODE}=true: no Hub kernel is fetched (unset it to allow Hub kernels)")
        return []
    targets = [t for t in plan.fetch_targets() if only is None or set(t.backends) & only]
    if not targets:
        _say(out, "no Hub kernel fits this machine" + (" among the selected backends" if only else "")
             + ": nothing to fetch")
        return []
    try:
        import kernels
    except Exception as exc:  # noqa: BLE001
        need = max((t.min_kernels for t in targets), key=lambda v: tuple(map(int, v.split("."))))
        message = (f"the kernels library does not import ({_why(exc)}): pip install --upgrade 'kernels>={need}'; "
                   "nothing fetched")
        _say(out, message)
        return [FetchResult(t.repo_id, t.version, list(t.backends), FAILED, message) for t in targets]
    ctx = _Context(kernels=kernels, out=out, lock=read_lock_for_update(out), lock_file=hub.lock_path(),
                   offline_mode=_offline_mode())
    machine_kernels = plan.machine.package_version("kernels")
    results = []
    for target in targets:
        try:
            result = _fetch_one(ctx, target, machine_kernels, dry_run)
        except Exception as exc:  # noqa: BLE001  (a bug or an unexpected library error: still never break)
            result = FetchResult(target.repo_id, target.version, list(target.backends), FAILED,
                                 f"unexpected error fetching {target.label}: {_why(exc)}")
        _say(out, result.message)
        results.append(result)
    if ctx.written:
        _say(out, f"pinned {len(ctx.written)} kernel(s) in {ctx.lock_file}")
    return results


# ---------------------------------------------------------------------------------------------------- pip

def _constraints() -> str:
    """pip constraints that keep torch (and its companions) exactly as installed."""
    lines = []
    for dist in sorted(PROTECTED):
        try:
            lines.append(f"{dist}=={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return "\n".join(lines) + "\n"


def install_packages(plan: Plan, *, yes: bool = False, dry_run: bool = False, only: set[str] | None = None,
                     out: Callable[[str], None] = print,
                     runner: Callable[[list[str]], int] | None = None) -> list[PipResult]:
    """Print (default) or, with `yes=True`, run the pip commands of the plan, torch pinned by a constraint."""
    steps: list[Step] = []
    for step in plan.pip_commands():
        owners = [b.name for b in plan.backends if any(s.command == step.command for s in b.steps)]
        if only is None or set(owners) & only:
            steps.append(step)
    if not steps:
        return []
    results = []
    if not yes or dry_run or plan.machine.simulated:
        for step in steps:
            status = "manual" if step.kind == "manual" else ("would-install" if yes else "suggested")
            results.append(PipResult(step.command, status))
        if not plan.machine.simulated:
            runnable = [s.command for s in steps if s.kind == "pip"]
            if runnable and not dry_run:
                _say(out, "more backends need packages; install them yourself, or rerun with --yes-pip to let "
                          "install.py run: " + " && ".join(runnable))
        return results
    runner = runner or _run_pip
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp) / "keep-torch.txt"
        constraints.write_text(_constraints())
        before = _constraints()
        for step in steps:
            argv = pip_argv(step)
            if argv is None:
                results.append(PipResult(step.command, "manual", "not a pip command: do it yourself"))
                _say(out, f"manual step (not run): {step.command}")
                continue
            command = [sys.executable, "-m", "pip", *argv, "-c", str(constraints)]
            _say(out, f"running: {' '.join(command)}")
            try:
                code = runner(command)
            except Exception as exc:  # noqa: BLE001
                code, why = -1, _why(exc)
            else:
                why = f"pip exited with {code}"
            if code == 0:
                results.append(PipResult(step.command, "installed"))
            else:
                results.append(PipResult(step.command, "failed", why))
                _say(out, f"failed ({why}): {step.command}; the pack works without it")
        after = _constraints()
        if after != before:  # cannot happen through the constraint; say so loudly if it ever does
            _say(out, f"WARNING: torch packages changed during pip installs: {before.split()} -> {after.split()}")
    from .. import machine, registry, requirements
    requirements.forget_imports()
    registry.forget_availability()
    machine.refresh()
    return results


def _run_pip(command: list[str]) -> int:
    return subprocess.run(command, check=False).returncode

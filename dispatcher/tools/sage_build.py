"""`python install.py --build sageattention`: build SageAttention 2 for this GPU, verify it, record it.

PyPI stops at sageattention 1.0.6 (Triton only); the CUDA kernels of 2.x (INT8 QK with FP8/FP16 PV, the
fastest attention on Hopper and Ada) are built from source. This step runs only when asked for by name
(it compiles for minutes), never from a plain `python install.py` or ComfyUI-Manager. It:

1. checks the machine: a CUDA build of torch, a GPU SageAttention 2 has kernels for, `nvcc` whose major
   version matches torch's CUDA, a C++ compiler, setuptools (the build runs without isolation, against
   this torch);
2. takes the source from `--source PATH` (a checkout of https://github.com/thu-ml/SageAttention) or clones
   that repository at the pinned commit `SAGE_COMMIT`;
3. builds a wheel in a temporary folder for this GPU's architecture only (`TORCH_CUDA_ARCH_LIST`), showing
   progress, with the whole log in a file;
4. installs the wheel into a temporary folder and calls each SageAttention backend through the dispatcher
   (`policy="strict"`) on the GPU, against exact attention; only then installs it into this environment
   and calls it again there;
5. records the build in the kernel lock file next to the fetched Hub kernels (`kind: "source-build"`).

On any failure it says why, and the environment is as it was: a previously installed sageattention is
put back, the temporary folders are removed (the build log is kept when the build failed).
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .. import hub
from ..log import PREFIX
from ..machine import Machine
from .sage_support import COMMAND, SUPPORTED, applies  # noqa: F401  (the plan reads them here too)

SAGE_REPO = "https://github.com/thu-ml/SageAttention"
SAGE_REPO_ID = "thu-ml/SageAttention"
SAGE_COMMIT = "d1a57a546c3d395b1ffcbeecc66d81db76f3b4b5"  # 2026-01-17, sageattention 2.2.0
# Architectures the SageAttention 2 setup.py builds kernels for, and the nvcc each needs (its own checks).
# The backends the verification calls on each architecture (each must run and stay within its error bound).
VERIFY_BACKENDS = {(8, 0): ["sage", "_sage_qk_int8_pv_fp16_cuda"], (8, 6): ["sage", "_sage_qk_int8_pv_fp16_cuda"],
                   (8, 9): ["sage", "_sage_qk_int8_pv_fp8_cuda"],
                   (9, 0): ["sage", "_sage_qk_int8_pv_fp8_cuda_sm90", "sage_sm90_per_warp"]}
BUILD_SOURCES = ("setup.py", "csrc", "sageattention")


class BuildRefused(Exception):
    """The machine or the source cannot build SageAttention 2; the message says why and what to do."""


@dataclass
class BuildResult:
    status: str  # "built" | "refused" | "failed" | "dry-run"
    message: str
    seconds: float | None = None
    checks: dict = field(default_factory=dict)
    verification: list[dict] = field(default_factory=list)
    entry: dict | None = None
    log: str | None = None

    def as_dict(self) -> dict:
        return {"status": self.status, "message": self.message, "seconds": self.seconds, "checks": self.checks,
                "verification": self.verification, "lock_entry": self.entry, "log": self.log}


# ------------------------------------------------------------------------------------------------ checks

def _version_tuple(text: str | None) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text or "")[:2])


def find_nvcc() -> tuple[str | None, str | None]:
    """(path of nvcc, its release 'X.Y') from CUDA_HOME / CUDA_PATH, PATH, or /usr/local/cuda; (None, None)."""
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "bin" / "nvcc")
    which = shutil.which("nvcc")
    if which:
        candidates.append(Path(which))
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            try:
                text = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=30).stdout
            except (OSError, subprocess.SubprocessError):
                continue
            match = re.search(r"release (\d+\.\d+)", text)
            return str(path), (match.group(1) if match else None)
    return None, None


def preflight(machine: Machine, *, nvcc: tuple[str | None, str | None] | None = None,
              which: Callable[[str], str | None] = shutil.which,
              has_module: Callable[[str], bool] | None = None) -> tuple[list[str], dict]:
    """(every reason this machine cannot build SageAttention 2, the facts found). Empty reasons: it can."""
    import importlib.util
    has_module = has_module or (lambda name: importlib.util.find_spec(name) is not None)
    problems, facts = [], {"torch": machine.torch_version, "torch_cuda": machine.cuda_version,
                           "gpu": machine.device_name, "arch": None}
    if not machine.cuda_version:
        problems.append(f"this torch ({machine.torch_version}) is not a CUDA build: SageAttention 2 needs an NVIDIA "
                        "GPU and a CUDA build of torch")
    elif machine.device_type != "cuda" or machine.cuda_capability is None:
        problems.append("no NVIDIA GPU is visible to torch (torch.cuda.is_available() is False)")
    elif tuple(machine.cuda_capability) not in SUPPORTED:
        problems.append(applies(machine))
    else:
        major, minor = machine.cuda_capability
        facts["arch"] = f"{major}.{minor}"
    if machine.cuda_version:
        path, release = nvcc if nvcc is not None else find_nvcc()
        facts.update(nvcc=path, nvcc_version=release)
        if path is None:
            problems.append(f"no CUDA toolkit found (nvcc): install CUDA {machine.cuda_version.split('.')[0]}.x, the "
                            f"major version of this torch (CUDA {machine.cuda_version}), and set CUDA_HOME")
        elif _version_tuple(release)[:1] != _version_tuple(machine.cuda_version)[:1]:
            problems.append(f"nvcc {release} ({path}) does not match this torch's CUDA {machine.cuda_version}: "
                            f"install CUDA {machine.cuda_version.split('.')[0]}.x and point CUDA_HOME at it")
        elif facts["arch"] and _version_tuple(release) < _version_tuple(SUPPORTED[tuple(machine.cuda_capability)]):
            problems.append(f"nvcc {release} is too old for sm_{facts['arch'].replace('.', '')}: SageAttention 2 needs "
                            f"CUDA {SUPPORTED[tuple(machine.cuda_capability)]} or newer there")
    compiler = which("c++") or which("g++")
    facts["compiler"] = compiler
    if compiler is None:
        problems.append("no C++ compiler (c++ / g++) on PATH: install your system's build tools (e.g. build-essential)")
    needed = ["setuptools"]
    try:  # setuptools >= 70.1 builds wheels itself; older ones need the `wheel` package
        if _version_tuple(importlib.metadata.version("setuptools")) < (70, 1):
            needed.append("wheel")
    except importlib.metadata.PackageNotFoundError:
        pass
    for module in needed:
        if not has_module(module):
            problems.append(f"{module} is not installed in this environment (the build runs against this torch, "
                            f"without isolation): {sys.executable} -m pip install {module}")
    facts["ninja"] = which("ninja") or (has_module("ninja") and "python package") or None
    return problems, facts


# ------------------------------------------------------------------------------------------------ source

def _source_version(folder: Path) -> str | None:
    try:
        match = re.search(r"version\s*=\s*['\"]([^'\"]+)['\"]", (folder / "setup.py").read_text())
    except OSError:
        return None
    return match.group(1) if match else None


def _check_source(folder: Path) -> str:
    missing = [name for name in BUILD_SOURCES if not (folder / name).exists()]
    if missing:
        raise BuildRefused(f"{folder} is not a SageAttention source tree (missing {', '.join(missing)}); pass a "
                           f"checkout of {SAGE_REPO}")
    version = _source_version(folder)
    if version is None or _version_tuple(version) < (2, 1):
        raise BuildRefused(f"{folder} holds sageattention {version or '(unknown version)'}; this step builds 2.1 or "
                           f"newer ({SAGE_REPO})")
    return version


def _git_commit(folder: Path) -> str | None:
    if not (folder / ".git").exists():
        return None
    try:
        done = subprocess.run(["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def _clone(into: Path, say) -> None:
    if shutil.which("git") is None:
        raise BuildRefused(f"git is not installed, so the source cannot be fetched: install git, or download "
                           f"{SAGE_REPO} yourself and pass --source PATH")
    say(f"fetching {SAGE_REPO} @ {SAGE_COMMIT[:12]} ...")
    into.mkdir(parents=True)
    steps = (["git", "init", "-q"], ["git", "remote", "add", "origin", SAGE_REPO],
             ["git", "fetch", "-q", "--depth", "1", "origin", SAGE_COMMIT], ["git", "checkout", "-q", "FETCH_HEAD"])
    for step in steps:
        done = subprocess.run(step, cwd=into, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise BuildRefused(f"could not fetch {SAGE_REPO} ({tail[0]}); without network, download it elsewhere "
                               "and pass --source PATH")


def _copy_source(source: Path, into: Path) -> None:
    """The build writes build/ and *.egg-info next to setup.py: build a copy, never the user's checkout."""
    shutil.copytree(source, into, ignore=shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__",
                                                                "assets", "bench", "example"))
    if not (into / "README.md").exists():  # setup.py reads it for the long description
        (into / "README.md").write_text("SageAttention\n")


# ------------------------------------------------------------------------------------------------ build

_STEP = re.compile(r"^\[(\d+)/(\d+)\]")


def _run_streamed(command: list[str], *, cwd: Path, env: dict, log_path: Path, say, heartbeat_s: float = 20.0,
                  timeout_s: float | None = None) -> int:
    """Run `command`, all output to `log_path`; one progress line per finished compile step (at most every
    few seconds) and a heartbeat while a long step compiles."""
    started = time.monotonic()
    steps, last_said = 0, started
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, bufsize=1)
        import selectors
        selector = selectors.DefaultSelector()
        selector.register(process.stdout, selectors.EVENT_READ)
        while True:
            ready = selector.select(timeout=1.0)
            now = time.monotonic()
            if ready:
                line = process.stdout.readline()
                if not line:
                    break
                log.write(line)
                if _STEP.match(line.strip()):
                    steps += 1
                    if now - last_said >= 5:
                        say(f"  {now - started:5.0f} s: {steps} compile steps done")
                        last_said = now
            if now - last_said >= heartbeat_s:
                say(f"  {now - started:5.0f} s: compiling ({steps} compile steps done so far)")
                last_said = now
            if timeout_s is not None and now - started > timeout_s:
                process.kill()
                log.write(f"\n[install.py] stopped after {timeout_s:.0f} s\n")
                break
        selector.close()
        return process.wait()


def _tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [l for l in text if re.search(r"error|Error|fatal", l)]
    picked = (errors[-8:] if errors else []) or text[-lines:]
    return "\n".join("    " + l[:200] for l in picked)


# ------------------------------------------------------------------------------------------------ verification

_VERIFY = r"""
import importlib, json, sys
sys.path.insert(0, sys.argv[1])
package = importlib.import_module(sys.argv[2])
import torch
device = sys.argv[4]
try:
    import sageattention
    from importlib.metadata import version
    found = {"version": version("sageattention"), "file": sageattention.__file__}
except ImportError as exc:
    found = {"version": None, "file": None, "import_error": str(exc)}
from torch.nn.functional import scaled_dot_product_attention as sdpa
registry = importlib.import_module(sys.argv[2] + ".registry")
relative_error = importlib.import_module(sys.argv[2] + ".reference").relative_error
results = []
gen = torch.Generator(device=device).manual_seed(0)
q, k, v = (torch.randn(1, 1024, 8, 128, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(3))
ref = sdpa(*(t.transpose(1, 2).double() for t in (q, k, v))).transpose(1, 2)
for name in sys.argv[3].split(","):
    row = {"backend": name, "ok": False}
    try:
        out = package.dispatch_attention_fn(q, k, v, backend=name, policy="strict")
        if device == "cuda":
            torch.cuda.synchronize()
        err = relative_error(out, ref)
        # a broken build gives noise (error near 1.4) or NaN; the quantised kernels stay near 1e-2..4e-2 here
        bound = max(registry.get(name).error_bound, 0.1)
        row.update(rel_error=err, error_bound=registry.get(name).error_bound,
                   ok=bool(torch.isfinite(out).all()) and err <= bound)
        if not row["ok"]:
            row["error"] = f"relative error {err:.2e} over {bound:.0e}, or non-finite output"
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
    results.append(row)
print("VERIFY " + json.dumps(dict(found, results=results)))
"""


def _package_root() -> tuple[str, str]:
    """(the folder holding the dispatcher package, its import name): `dispatcher` in the ComfyUI pack,
    `attention_dispatch` when installed from the wheel."""
    name = __name__.rsplit(".", 2)[0]
    return str(Path(sys.modules[name].__file__).resolve().parent.parent), name


def verify(backends: list[str], *, extra_path: str | None = None, timeout_s: float = 600,
           device: str = "cuda") -> tuple[list[dict], str | None]:
    """Call each backend through the dispatcher in a fresh interpreter (with `extra_path` first on sys.path).
    ([per-backend results], None) or ([...], why it failed)."""
    root, name = _package_root()
    env = dict(os.environ)
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, env.get("PYTHONPATH")) if p)
    try:
        done = subprocess.run([sys.executable, "-c", _VERIFY, root, name, ",".join(backends), device], capture_output=True,
                              text=True, env=env, timeout=timeout_s, cwd=tempfile.gettempdir())
    except subprocess.TimeoutExpired:
        return [], f"the test call did not finish in {timeout_s:.0f} s"
    line = next((l for l in done.stdout.splitlines() if l.startswith("VERIFY ")), None)
    if line is None:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        return [], f"the test call failed: {tail[0][:300]}"
    data = json.loads(line[len("VERIFY "):])
    if extra_path and not str(Path(data["file"] or "/").resolve()).startswith(str(Path(extra_path).resolve())):
        return data["results"], f"the test call imported another sageattention ({data['file']})"
    bad = [r for r in data["results"] if not r["ok"]]
    if bad:
        return data["results"], "; ".join(f"{r['backend']}: {r.get('error')}" for r in bad)
    return data["results"], None


# ------------------------------------------------------------------------------------------------ install / restore

def _installed() -> tuple[str | None, list[Path]]:
    """(installed sageattention version, its files) or (None, [])."""
    try:
        dist = importlib.metadata.distribution("sageattention")
    except importlib.metadata.PackageNotFoundError:
        return None, []
    files = [Path(dist.locate_file(f)).resolve() for f in (dist.files or [])]
    return dist.version, [f for f in files if f.is_file()]


def _installed_folder() -> str | None:
    files = [f for f in _installed()[1] if f.name == "__init__.py" and f.parent.name == "sageattention"]
    return str(files[0].parent) if files else None


def _backup(files: list[Path], into: Path) -> list[tuple[Path, Path]]:
    saved = []
    for index, path in enumerate(files):
        target = into / f"{index}-{path.name}"
        shutil.copy2(path, target)
        saved.append((path, target))
    return saved


def _restore(saved: list[tuple[Path, Path]], pip: Callable[[list[str]], int], say) -> None:
    pip(["uninstall", "-y", "-q", "sageattention"])
    for original, copy in saved:
        original.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(copy, original)
    if saved:
        say(f"the sageattention that was installed before is back ({len(saved)} files)")


def _pip(args: list[str]) -> int:
    return subprocess.run([sys.executable, "-m", "pip", *args], check=False, capture_output=True).returncode


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def wheel_cache() -> Path:
    return Path(os.environ.get("ATTN_DISPATCH_WHEEL_CACHE") or Path.home() / ".cache" / "attention_dispatch" / "wheels")


# ------------------------------------------------------------------------------------------------ the step

def build(source: str | None = None, *, machine: Machine | None = None, dry_run: bool = False,
          out: Callable[[str], None] = print, jobs: int | None = None, timeout_s: float | None = None,
          keep_wheel: bool = True) -> BuildResult:
    def say(message: str) -> None:
        out(f"{PREFIX} {message}")

    if machine is None:
        from .install_plan import safe_detect
        machine, _ = safe_detect()
    problems, facts = preflight(machine)
    if problems:
        message = ("cannot build SageAttention 2 here: " + "; ".join(problems)
                   + ". Nothing was changed; the pack runs without it.")
        say(message)
        return BuildResult("refused", message, checks=facts)
    arch = facts["arch"]
    backends = VERIFY_BACKENDS.get(tuple(machine.cuda_capability), ["sage"])
    jobs = jobs or max(1, os.cpu_count() or 1)
    say(f"building SageAttention 2 for sm_{arch.replace('.', '')} only ({machine.device_name}), torch "
        f"{machine.torch_version}, nvcc {facts['nvcc_version']}, {jobs} jobs"
        + ("" if facts["ninja"] else "; ninja is missing, so the build is much slower (pip install ninja)"))
    if dry_run:
        message = (f"dry run: would build {source or f'{SAGE_REPO} @ {SAGE_COMMIT[:12]}'} with TORCH_CUDA_ARCH_LIST="
                   f"{arch}, verify {', '.join(backends)} through the dispatcher, install the wheel and record it in "
                   f"{hub.lock_path()}; nothing changed")
        say(message)
        return BuildResult("dry-run", message, checks=facts)

    work = Path(tempfile.mkdtemp(prefix="attention-dispatch-sage-"))
    log_path = Path(tempfile.gettempdir()) / "attention-dispatch-sage-build.log"
    keep_log = False
    installing, saved = False, []
    started = time.monotonic()
    try:
        if source:
            origin = Path(source).expanduser().resolve()
            version = _check_source(origin)
            commit = _git_commit(origin)
        else:
            origin = work / "clone"
            _clone(origin, say)
            version, commit = _check_source(origin), SAGE_COMMIT
        src = work / "src"
        _copy_source(origin, src)
        env = dict(os.environ, TORCH_CUDA_ARCH_LIST=arch, MAX_JOBS=str(jobs), EXT_PARALLEL=str(min(4, jobs)),
                   NVCC_APPEND_FLAGS=(os.environ.get("NVCC_APPEND_FLAGS", "") + " --threads=2").strip())
        if facts.get("nvcc"):
            env.setdefault("CUDA_HOME", str(Path(facts["nvcc"]).parent.parent))
        say(f"compiling sageattention {version} from {source or SAGE_REPO} (a few minutes; log: {log_path})")
        wheels = work / "wheel"
        code = _run_streamed([sys.executable, "-m", "pip", "wheel", "-v", "--no-build-isolation", "--no-deps",
                              "--no-index", "-w", str(wheels), str(src)], cwd=work, env=env, log_path=log_path,
                             say=say, timeout_s=timeout_s)
        build_s = time.monotonic() - started
        built = sorted(wheels.glob("sageattention-*.whl")) if wheels.is_dir() else []
        if code != 0 or not built:
            keep_log = True
            raise BuildRefused(f"the build failed (exit status {code}) after {build_s:.0f} s; the last lines of "
                               f"{log_path}:\n{_tail(log_path)}")
        wheel = built[0]
        say(f"built {wheel.name} ({wheel.stat().st_size / 2**20:.1f} MB) in {build_s:.0f} s; testing it before "
            "installing ...")

        trial = work / "trial"
        if _pip(["install", "-q", "--no-deps", "--no-index", "--target", str(trial), str(wheel)]) != 0:
            raise BuildRefused("the built wheel does not install into a test folder")
        results, why = verify(backends, extra_path=str(trial))
        if why:
            raise BuildRefused(f"the new build does not run correctly here: {why}")

        previous, files = _installed()
        (work / "backup").mkdir(exist_ok=True)
        saved = _backup(files, work / "backup") if files else []
        installing = True
        if _pip(["install", "-q", "--no-deps", "--no-index", "--force-reinstall", str(wheel)]) != 0:
            _restore(saved, _pip, say)
            raise BuildRefused("pip could not install the built wheel into this environment (a read-only or "
                               "externally managed Python? use a virtual environment)")
        results, why = verify(backends)
        if why:
            _restore(saved, _pip, say)
            raise BuildRefused(f"installed, but the call through the dispatcher fails in this environment: {why}")

        seconds = round(time.monotonic() - started, 1)
        kept = None
        if keep_wheel:
            with_cache = wheel_cache()
            try:
                with_cache.mkdir(parents=True, exist_ok=True)
                kept = with_cache / wheel.name
                shutil.copy2(wheel, kept)
            except OSError:
                kept = None
        entry = {"repo_id": SAGE_REPO_ID, "kind": "source-build", "package": "sageattention",
                 "package_version": version, "revision": commit or "local source", "source": source or SAGE_REPO,
                 "variant": f"torch{machine.torch_version.split('+')[0]}-cu{machine.cuda_version}-sm{arch.replace('.', '')}",
                 "path": _installed_folder(),
                 "wheel": str(kept) if kept else None, "wheel_sha256": _sha256(wheel), "build_seconds": round(build_s, 1),
                 "torch": machine.torch_version, "nvcc": facts["nvcc_version"], "replaced": previous,
                 "verified": {r["backend"]: r.get("rel_error") for r in results},
                 "fetched_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        try:
            from .fetch import read_lock_for_update, write_lock
            lock = read_lock_for_update(out)
            lock[SAGE_REPO_ID] = entry
            write_lock(hub.lock_path(), lock)
            where = f"recorded in {hub.lock_path()}"
        except OSError as exc:
            where = f"not recorded ({exc})"
        errors = ", ".join(f"{r['backend']} {r['rel_error']:.1e}" for r in results)
        message = (f"SageAttention {version} built for sm_{arch.replace('.', '')} in {build_s:.0f} s and installed"
                   + (f" (replacing {previous})" if previous else "") + f"; verified through the dispatcher "
                   f"(relative error {errors}); {where}. `python -m dispatcher doctor` lists its backends.")
        say(message)
        return BuildResult("built", message, seconds=seconds, checks=facts, verification=results, entry=entry)
    except BuildRefused as exc:
        message = f"SageAttention 2 was not installed: {exc}. The environment is as it was."
        say(message)
        return BuildResult("failed", message, seconds=round(time.monotonic() - started, 1), checks=facts,
                           log=str(log_path) if keep_log else None)
    except (Exception, KeyboardInterrupt) as exc:  # our own bug, a full disk, Ctrl-C: undo, then say so
        if installing:
            _restore(saved, _pip, say)
        why = "interrupted" if isinstance(exc, KeyboardInterrupt) else f"{type(exc).__name__}: {exc}"
        message = f"SageAttention 2 was not installed ({why}). The environment is as it was."
        say(message)
        if isinstance(exc, KeyboardInterrupt):
            raise
        return BuildResult("failed", message, seconds=round(time.monotonic() - started, 1), checks=facts)
    finally:
        if not keep_log and log_path.exists():
            log_path.unlink()
        shutil.rmtree(work, ignore_errors=True)

"""One command for a bare GPU machine: install what the call carried, build SageAttention in the background, run
bench/gpu_items.py's items in priority order under a deadline, and leave at most 8 files to bring back.

    python3 bench/gpu_run.py [--out DIR (default $OUT)] [--deadline 540] [--only ITEM|GROUP,...] [--commit SHA]
    python3 bench/gpu_run.py --dry-run [--json] [--check-args]     # here, on a CPU: the items, commands, needs

What it does, in order:
1. Resumes: the markers and results of earlier calls, from this machine's work folder (`--work`, a warm machine) or
   from `--resume` (default .gpu/resume: the unpacked results of the last call, carried back; bench/gpu_carry.py
   unpack puts them there). An item with a marker is not run again (`--retry-failed` reruns the failed ones).
2. Installs the carried wheels (.whl/gpu/*: bench/device_wheels.py's batches and a SageAttention wheel an earlier
   call returned) into a folder on PYTHONPATH (`pip install --no-index --no-deps --target`; a wheel whose parts did
   not all come is left out and named).
3. Records the machine: nvidia-smi, driver, Python, torch, CUDA, cuDNN, triton, nvcc, the packages, the backends
   that can run and why the others cannot, the pack's commit (`--commit`, else git) and a digest of its code.
4. Starts the SageAttention 2 build (`install.py --build sageattention --source .gpu/sage-src`) unless SageAttention
   2 is installed: detached (setsid: a warm machine's next call finds it running or done), at the lowest CPU
   priority, without the carried wheels on its path, with a marker file when done. Items that need it wait; items
   that time the host (`quiet`) wait for it to end.
5. Runs the items, the first whose needs are met and whose estimate fits in the time left, each in its own process
   group with its own limit (killed with its children past it); each writes DATE-MACHINE-NAME.{json,txt,xml} into
   the results folder and a marker (done/NAME.json: status, exit code, seconds, files). An item whose needs may
   still be met (SageAttention building) is tried again later in the call; one whose needs cannot be (nothing
   carried for it) is skipped with the reason; one stopped by the deadline rather than its own limit gets no
   marker, so the next call runs it again.
6. Leaves in --out: gpu-run-summary.json (machine, versions, each item's status, timings, what was skipped and
   why, the figures so far), gpu-run.log, gpu-run-results.tar.gz (every result and marker, this call's and the
   earlier ones), and sage/ (the SageAttention wheel built here, in parts, for the next call to carry instead of
   building again).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
import device_wheels  # noqa: E402  (bench/ is on sys.path when a script of it runs)
import gpu_items  # noqa: E402

MET, LATER, NEVER = "met", "later", "never"
DONE = ("ok", "failed", "timeout")  # a marker's status: the item is not run again (failed, timeout: --retry-failed)
FILES_BACK, FILE_BYTES = 8, 16 * 2**20  # what a call brings back: 8 files of 16 MiB
SAGE_BACKENDS = ("sage", "sage_sm90_per_warp", "_sage_qk_int8_pv_fp8_cuda_sm90")
PROBE_BACKENDS = ("_native_cudnn", "_flash_3", "flash_3_fp8", "flash_4", "flex", *SAGE_BACKENDS,
                  "comfy_kitchen_int8", "sol_attn")
PACKAGES = ("torch", "triton", "numpy", "sageattention", "fa3-fwd", "kernels", "comfy-kitchen", "flash-attn-4",
            "nvidia-cutlass-dsl", "huggingface-hub")
CODE = ("__init__.py", "install.py", "dispatcher", "nodes", "bench", "tests")  # what the code digest covers
PROBE = r"""
import importlib.metadata as md, json, sys
out = {"python": sys.version.split()[0], "executable": sys.executable}
try:
    import torch
    out.update(torch=torch.__version__, cuda=torch.version.cuda, gpu=torch.cuda.is_available())
    if torch.cuda.is_available():
        out.update(device=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
                   cudnn=torch.backends.cudnn.version(), memory_gib=round(torch.cuda.mem_get_info()[1] / 2**30, 1))
except Exception as exc:
    out["torch_error"] = f"{type(exc).__name__}: {exc}"
out["packages"] = {}
for name in sys.argv[2].split(","):
    try:
        out["packages"][name] = md.version(name)
    except md.PackageNotFoundError:
        out["packages"][name] = None
try:
    sys.path.insert(0, sys.argv[1])
    import dispatcher
    out["backends"] = {name: dispatcher.availability_reasons(name) for name in sys.argv[3].split(",")}
except Exception as exc:
    out["dispatcher_error"] = f"{type(exc).__name__}: {exc}"
print("PROBE " + json.dumps(out))
"""


def utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def machine_slug(name: str | None) -> str:
    """A results file's MACHINE from the GPU's name: 'NVIDIA H100 80GB HBM3' -> h100, 'NVIDIA GeForce RTX 4090' ->
    rtx-4090, 'NVIDIA A100-SXM4-80GB' -> a100; no GPU: cpu."""
    words = [w for w in re.split(r"[\s_-]+", (name or "").lower()) if w and w not in ("nvidia", "geforce", "tesla")]
    kept = []
    for word in words:
        kept.append(re.sub(r"[^a-z0-9.]", "", word))
        if re.search(r"\d", word):
            break
    return "-".join(w for w in kept if w) or "cpu"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:  # a zombie answers kill(0) too
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return True


class Background:
    """A command that outlives this call (detached with setsid: a warm machine's next call finds it running or
    done), with marker files in `folder`: started.json, then done (its exit status) once it ended."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.proc: subprocess.Popen | None = None

    def start(self, argv: list[str], env: dict, nice: int = 19) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        f = {name: shlex.quote(str(self.folder / name)) for name in ("stdout", "log", "rc.tmp", "done")}
        script = (f"nice -n {nice} {shlex.join(argv)} > {f['stdout']} 2> {f['log']}; "
                  f"echo $? > {f['rc.tmp']} && mv {f['rc.tmp']} {f['done']}")
        self.proc = subprocess.Popen(["sh", "-c", script], cwd=ROOT, env=env, start_new_session=True,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        (self.folder / "started.json").write_text(json.dumps({"pid": self.proc.pid, "argv": argv, "at": utc(),
                                                              "epoch": time.time()}))

    def state(self) -> tuple[str, int | None]:
        """('absent' | 'running' | 'done' | 'died', exit status when done)."""
        if (self.folder / "done").exists():
            return "done", int((self.folder / "done").read_text().strip() or -1)
        if not (self.folder / "started.json").exists():
            return "absent", None
        if self.proc is not None:
            alive = self.proc.poll() is None
        else:
            alive = pid_alive(json.loads((self.folder / "started.json").read_text())["pid"])
        return ("running" if alive else "died"), None

    def seconds(self) -> float:
        started = json.loads((self.folder / "started.json").read_text())["epoch"]
        done = self.folder / "done"
        return (done.stat().st_mtime if done.exists() else time.time()) - started


def kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_process(argv: list[str], env: dict, limit_s: float, log_path: Path) -> tuple[int | None, bool, float]:
    """(exit status, whether it was stopped at `limit_s`, seconds): `argv` in a process group of its own, its output
    in `log_path`; past the limit the whole group is ended (SIGTERM, then SIGKILL)."""
    started = time.monotonic()
    with open(log_path, "wb") as log:
        # a process group of its own in this session: killed whole at its limit, and by the machine's own cleanup
        # when the call returns (a new session, as the background build has, would outlive it)
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, preexec_fn=os.setpgrp)
        try:
            return proc.wait(timeout=max(limit_s, 0.1)), False, time.monotonic() - started
        except subprocess.TimeoutExpired:
            kill_group(proc)
            return proc.returncode, True, time.monotonic() - started
        except BaseException:
            kill_group(proc)
            raise


class Run:
    """One call: its folders, the machine, the needs, the loop, the files it leaves."""

    def __init__(self, args, items: list[gpu_items.Item]):
        self.args, self.items = args, items
        self.started = time.monotonic()
        self.work = Path(args.work)
        self.results = self.work / "results"
        self.site = self.work / "site"
        self.sage = Background(self.work / "sage")
        self.lines: list[str] = []
        self.record: dict = {"started": utc(), "deadline_s": args.deadline, "items": {}}
        self.probe: dict = {}
        self.prefix = ""
        self.sage_installed = False
        self.sage_reported = False
        self.python = sys.executable

    # --- output -------------------------------------------------------------------------------------------------
    def say(self, text: str) -> None:
        line = f"[{time.monotonic() - self.started:6.1f} s] {text}"
        self.lines.append(line)
        print(line, flush=True)

    def left(self) -> float:
        return self.args.deadline - self.args.reserve - (time.monotonic() - self.started)

    def env(self, item: gpu_items.Item | None = None) -> dict:
        env = dict(os.environ, PYTHONUNBUFFERED="1", ATTN_DISPATCH_TUNE_CACHE="off",
                   PYTHONPATH=os.pathsep.join(p for p in (str(self.site), os.environ.get("PYTHONPATH")) if p))
        if item is not None:
            if "comfyui" in item.needs:
                env["COMFYUI_PATH"] = str(self.path(self.args.comfyui))
            env.update({k: self.fill(v, item) for k, v in item.env.items()})
        return env

    @staticmethod
    def path(text: str) -> Path:
        return (ROOT / text).resolve()

    # --- resume, markers ----------------------------------------------------------------------------------------
    def marker(self, name: str) -> dict | None:
        path = self.results / "done" / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def finished(self, name: str) -> bool:
        m = self.marker(name)
        return m is not None and m["status"] in (("ok",) if self.args.retry_failed else DONE)

    def resume(self) -> None:
        (self.results / "done").mkdir(parents=True, exist_ok=True)
        source = self.path(self.args.resume)
        if not source.is_dir():
            return
        copied = 0
        for path in sorted(source.rglob("*")):
            target = self.results / path.relative_to(source)
            if path.is_file() and not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)
                copied += 1
        self.say(f"resumed from {self.args.resume}: {copied} files")

    def stem(self, name: str) -> Path:
        m = self.marker(name)
        return self.results / m["stem"] if m and m.get("stem") else self.results / f"{self.prefix}{name}"

    def fill(self, text: str, item: gpu_items.Item) -> str:
        return substitute(text, {"python": self.python, "out": self.stem(item.name),
                                 "comfyui": self.path(self.args.comfyui), "before": self.path(self.args.before)},
                          self.stem)

    def argv(self, item: gpu_items.Item, optional: bool = True) -> list[str]:
        extra = [a for key, args in item.optional.items() if optional and self.path(self.fill(key, item)).exists()
                 for a in args]
        return [self.fill(a, item) for a in (*item.argv, *extra)]

    # --- setup --------------------------------------------------------------------------------------------------
    def install_wheels(self) -> None:
        base = self.path(self.args.wheels)
        if not base.is_dir():
            self.say(f"no wheels carried ({self.args.wheels})")
            return
        wheels, missing = device_wheels.join(base, self.work / "wheels")
        self.record["wheels"] = {"installed": [w.name for w in wheels], "incomplete": missing}
        if missing:
            self.say("wheels left out (not every part carried): " + "; ".join(missing))
        done = self.site / ".installed.json"
        if wheels and not (done.exists() and json.loads(done.read_text()) == sorted(w.name for w in wheels)):
            t0 = time.monotonic()
            device_wheels.pip_install(wheels, self.site)
            done.write_text(json.dumps(sorted(w.name for w in wheels)))
            self.say(f"installed {len(wheels)} wheels into {self.site} in {time.monotonic() - t0:.0f} s: "
                     + ", ".join(w.name for w in wheels))
        pth = sorted(p.name for p in self.site.glob("*.pth")) if self.site.is_dir() else []
        if pth:  # PYTHONPATH folders do not run .pth files
            self.say(f"note: {', '.join(pth)} in {self.site} are not processed on PYTHONPATH")

    def sage_version(self) -> str | None:
        import importlib.metadata as md
        dists = md.distributions(path=[str(self.site), *sys.path], name="sageattention")
        return next((d.version for d in dists), None)

    def start_sage(self) -> None:
        version = self.sage_version()
        self.sage_installed = bool(version) and int(version.split(".")[0]) >= 2
        state, _ = self.sage.state()
        source = self.path(self.args.sage_source)
        if self.sage_installed:
            self.say(f"sageattention {version} is installed: no build")
        elif state in ("running", "done"):
            self.say(f"the SageAttention build of an earlier call is {state}")
        elif not (source / "setup.py").is_file():
            self.say(f"no SageAttention source carried ({self.args.sage_source}) nor its wheel: items that need it "
                     "are skipped")
        else:
            env = dict(os.environ, ATTN_DISPATCH_WHEEL_CACHE=str(self.work / "sage" / "wheel"))
            env.pop("PYTHONPATH", None)  # the build runs against the image's torch alone, as a user's would
            self.sage.start([sys.executable, "install.py", "--build", "sageattention", "--source", str(source),
                             "--json"], env)
            self.say(f"started the SageAttention build from {self.args.sage_source} in the background "
                     "(183-264 s on an H100/H200)")

    def machine(self) -> None:
        calls = self.results / "calls"
        calls.mkdir(parents=True, exist_ok=True)
        self.record["call"] = n = len(list(calls.glob("call-*.json"))) + 1
        smi = {}
        if shutil.which("nvidia-smi"):
            query = "name,driver_version,power.limit,memory.total,clocks.max.sm,pci.bus_id"
            done = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                                  capture_output=True, text=True, timeout=60)
            smi = [dict(zip(query.split(","), (v.strip() for v in line.split(","))))
                   for line in done.stdout.strip().splitlines()]
            full = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=60).stdout
            (calls / f"call-{n}-nvidia-smi.txt").write_text(full)
        done = subprocess.run([sys.executable, "-c", PROBE, str(ROOT), ",".join(PACKAGES), ",".join(PROBE_BACKENDS)],
                              capture_output=True, text=True, env=self.env(), timeout=300)
        line = next((l for l in done.stdout.splitlines() if l.startswith("PROBE ")), None)
        self.probe = json.loads(line[6:]) if line else {"error": (done.stderr or done.stdout)[-2000:]}
        nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
        release = None
        if Path(nvcc).exists():
            text = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
            release = (re.findall(r"release ([\d.]+)", text) or [None])[0]
        pip = subprocess.run([sys.executable, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                             env=self.env(), timeout=120).stdout
        (calls / f"call-{n}-pip.txt").write_text(pip)
        name = self.probe.get("device") or (smi[0]["name"] if smi else None)
        self.record["machine"] = {
            "slug": machine_slug(name), "gpu": name, "nvidia_smi": smi, "nvcc": release, "cores": os.cpu_count(),
            "cpu": next((l.split(":", 1)[1].strip() for l in _lines("/proc/cpuinfo") if l.startswith("model name")),
                        None), **self.probe, "commit": self.commit(), "code_digest": code_digest()}
        self.prefix = f"{datetime.datetime.now(datetime.timezone.utc).date().isoformat()}-{machine_slug(name)}-"
        self.say(f"machine: {name or 'no GPU'} ({self.record['machine']['slug']}), driver "
                 f"{smi[0]['driver_version'] if smi else '-'}, torch {self.probe.get('torch')}, CUDA "
                 f"{self.probe.get('cuda')}, cuDNN {self.probe.get('cudnn')}, nvcc {release}, "
                 f"{os.cpu_count()} cores, code {self.record['machine']['commit'] or '?'}")
        cannot = {k: v for k, v in (self.probe.get("backends") or {}).items() if v}
        if cannot:
            self.say("cannot run here: " + "; ".join(f"{k} ({v[0][:80]})" for k, v in cannot.items()))

    def commit(self) -> str | None:
        if self.args.commit:
            return self.args.commit
        try:
            done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                                  timeout=30)
            return done.stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            return None

    # --- needs --------------------------------------------------------------------------------------------------
    def need(self, name: str, item: gpu_items.Item) -> tuple[str, str]:
        backends = self.probe.get("backends") or {}
        if name == "gpu":
            return (MET, "") if self.probe.get("gpu") else (NEVER, "no CUDA GPU visible to torch")
        if name == "fa3":
            why = backends.get("_flash_3", ["not probed"])
            return (MET, "") if not why else (NEVER, f"FA3 cannot run ({why[0][:120]}): carry .whl/gpu/batch-1")
        if name == "sage":
            return self.sage_need()
        if name == "comfyui":
            found = (self.path(self.args.comfyui) / "comfy" / "ldm").is_dir()
            return (MET, "") if found else (NEVER, f"no ComfyUI carried at {self.args.comfyui}")
        if name == "quiet":
            running = self.sage.state()[0] == "running"
            return (LATER, "the SageAttention build is running beside it") if running else (MET, "")
        if name.startswith("after:"):
            other = name.split(":", 1)[1]
            m, here = self.marker(other), self.record["items"].get(other, {})
            if m and m["status"] == "ok":
                return MET, ""
            if m or other not in {i.name for i in self.items}:
                return NEVER, f"{other} did not succeed" if m else f"{other} is not run in this call"
            if here.get("status") in ("skipped", "no time", "cut"):  # it will not run in this call
                return NEVER, f"{other} was {here['status']} in this call"
            return LATER, f"waits for {other}"
        raise ValueError(f"{item.name}: unknown need {name!r}")

    def sage_need(self) -> tuple[str, str]:
        if self.sage_installed:
            return MET, ""
        state, rc = self.sage.state()
        if state == "running":
            return LATER, f"SageAttention is building ({self.sage.seconds():.0f} s so far)"
        if state == "done":
            result = {}
            try:
                result = json.loads((self.sage.folder / "stdout").read_text())["build"]
            except (OSError, ValueError, KeyError):
                pass
            if not self.sage_reported:
                self.sage_reported = True
                shutil.copy2(self.sage.folder / "log", self.results / f"{self.prefix}sage-build.txt")
                (self.results / f"{self.prefix}sage-build.json").write_text(json.dumps(result, indent=1) + "\n")
                self.say(f"SageAttention build ended (exit {rc}, {self.sage.seconds():.0f} s): "
                         f"{result.get('status')}: {str(result.get('message'))[:300]}")
            if rc == 0 and result.get("status") == "built":
                return MET, ""
            return NEVER, f"the SageAttention build failed: {str(result.get('message'))[:200]}"
        if state == "died":
            return NEVER, "the SageAttention build stopped without a result (its log: sage-build.txt)"
        return NEVER, f"no SageAttention: carry its source ({self.args.sage_source}) or the wheel a call returned"

    def check(self, item: gpu_items.Item) -> tuple[str, str]:
        """(MET | LATER | NEVER, why) for all of the item's needs."""
        later = []
        for name in item.needs:
            state, why = self.need(name, item)
            if state == NEVER and name.split(":")[0] not in self.args.allow_missing:
                return NEVER, why
            if state == LATER:
                later.append(why)
        return (LATER, "; ".join(later)) if later else (MET, "")

    # --- the loop -----------------------------------------------------------------------------------------------
    def loop(self) -> None:
        pending = [i for i in self.items if not self.finished(i.name)]
        for item in self.items:
            if item not in pending:
                self.record["items"][item.name] = {**_brief(self.marker(item.name)), "status": "done before",
                                                   "result": self.marker(item.name)["status"]}
        while pending:
            chosen, waiting = None, []
            for item in pending:
                state, why = self.check(item)
                if state == NEVER:
                    self.note(item, "skipped", why)
                    continue
                if state == LATER:
                    waiting.append(item)
                    self.note(item, "waiting", why)
                    continue
                if item.estimate_s > self.left():
                    self.note(item, "no time", f"needs ~{item.estimate_s} s, {max(self.left(), 0):.0f} s left")
                    continue
                chosen = item
                break
            pending = [i for i in pending if self.record["items"].get(i.name, {}).get("status") != "skipped"]
            if chosen is not None:
                self.run_item(chosen)
                pending.remove(chosen)
                continue
            if waiting and min(i.estimate_s for i in waiting) <= self.left():
                time.sleep(self.args.poll)
                continue
            break

    def note(self, item: gpu_items.Item, status: str, why: str) -> None:
        before = self.record["items"].get(item.name, {})
        self.record["items"][item.name] = {"status": status, "why": why}
        if (before.get("status"), re.sub(r"\d+", "#", before.get("why", ""))) != (status, re.sub(r"\d+", "#", why)):
            self.say(f"{item.name}: {status}: {why}")

    def run_item(self, item: gpu_items.Item) -> None:
        earlier = self.marker(item.name)
        if earlier:  # a rerun (--retry-failed) replaces the earlier try's files and marker
            for name in earlier.get("files", []):
                (self.results / name).unlink(missing_ok=True)
            (self.results / "done" / f"{item.name}.json").unlink()
        argv, env = self.argv(item), self.env(item)
        limit = min(item.limit_s, self.left())
        stem = self.stem(item.name)
        building = self.sage.state()[0] == "running"
        self.say(f"{item.name}: running (~{item.estimate_s} s, limit {limit:.0f} s): {shlex.join(argv)}")
        rc, stopped, seconds = run_process(argv, env, limit, Path(f"{stem}.txt"))
        cut = stopped and limit < item.limit_s
        status = "cut" if cut else "timeout" if stopped else "ok" if rc == 0 else "failed"
        files = sorted(p.name for p in self.results.glob(f"{stem.name}.*"))
        entry = {"item": item.name, "group": item.group, "status": status, "rc": rc, "seconds": round(seconds, 1),
                 "estimate_s": item.estimate_s, "limit_s": round(limit), "stem": stem.name, "files": files,
                 "argv": argv, "call": self.record["call"], "at": utc(),
                 "sage_building": building or self.sage.state()[0] == "running"}
        tail = _last_line(Path(f"{stem}.txt"))
        if status == "cut":  # cut by the deadline: no marker, the next call runs it again; its output kept apart
            for name in files:
                (self.results / name).replace(self.results / "calls" / f"call-{self.record['call']}-cut-{name}")
        else:
            (self.results / "done" / f"{item.name}.json").write_text(json.dumps(entry, indent=1) + "\n")
        self.record["items"][item.name] = _brief(entry)
        self.say(f"{item.name}: {status} (exit {rc}) in {seconds:.0f} s" + (f": {tail}" if tail else ""))

    # --- what comes back ----------------------------------------------------------------------------------------
    def finish(self) -> None:
        out = Path(self.args.out)
        out.mkdir(parents=True, exist_ok=True)
        self.record.update(ended=utc(), seconds=round(time.monotonic() - self.started, 1),
                           sage=self.sage_summary(), figures=self.figures(), next=self.next_steps())
        n = self.record.get("call", 0)
        calls = self.results / "calls"
        calls.mkdir(parents=True, exist_ok=True)
        (calls / f"call-{n}.json").write_text(json.dumps(self.record, indent=1, default=str) + "\n")
        (calls / f"call-{n}.log").write_text("\n".join(self.lines) + "\n")
        archive = out / "gpu-run-results.tar.gz"
        with tarfile.open(archive, "w:gz") as tar:
            for path in sorted(self.results.rglob("*")):
                if path.is_file():
                    tar.add(path, arcname=str(path.relative_to(self.results)))
        if archive.stat().st_size > FILE_BYTES:  # cut in parts of 16 MiB: cat gpu-run-results.tar.gz.part* | tar -xz
            for piece in device_wheels.pieces([archive], FILE_BYTES, out):
                self.say(f"results in parts: {piece['path'].name}")
            archive.unlink()
        returned = self.return_sage_wheel(out)
        (out / "gpu-run-summary.json").write_text(json.dumps(self.record, indent=1, default=str) + "\n")
        (out / "gpu-run.log").write_text("\n".join(self.lines) + "\n")
        files = [p for p in out.rglob("*") if p.is_file()]
        if len(files) > FILES_BACK and returned:
            shutil.rmtree(out / "sage")
            self.say("left the SageAttention wheel out: more than 8 files")
        print(f"--- {len([p for p in out.rglob('*') if p.is_file()])} files in {out}", flush=True)

    def return_sage_wheel(self, out: Path) -> bool:
        """The wheel built here (not one carried), as a batch folder the next call carries (.whl/gpu/sage)."""
        built = sorted((self.work / "sage" / "wheel").glob("sageattention-*.whl"))
        if not built or (self.work / "sage" / "returned").exists():
            return False
        device_wheels.pack(built[-1], out / "sage", FILE_BYTES - 2**20)
        (self.work / "sage" / "returned").touch()
        self.say(f"returning {built[-1].name} ({built[-1].stat().st_size / 2**20:.1f} MiB) in sage/: carry it as "
                 ".whl/gpu/sage next time instead of building")
        return True

    def sage_summary(self) -> dict:
        state, rc = self.sage.state()
        summary = {"installed_before": self.sage_installed, "build": state, "exit": rc}
        if state != "absent":
            summary["seconds"] = round(self.sage.seconds())
        return summary

    def figures(self) -> list | str:
        try:
            import results_table
            return results_table.figures(self.results)
        except Exception as exc:  # the figures are a convenience: never lose the run for them
            return f"figures not made: {type(exc).__name__}: {exc}"

    def next_steps(self) -> dict:
        left = {name: entry for name, entry in self.record["items"].items()
                if entry["status"] not in DONE + ("done before",)}
        carry = ["the repository's working tree", self.args.wheels + "/batch-1", ".gpu/resume (bench/gpu_carry.py "
                 "unpack: this call's gpu-run-results.tar.gz)", self.args.comfyui]
        carry.append(".whl/gpu/sage (this call's sage/)" if (self.work / "sage" / "returned").exists() or
                     self.sage_installed else self.args.sage_source)
        return {"items_left": left, "all_done": not left, "carry": carry if left else []}


def substitute(text: str, values: dict, stem) -> str:
    """The item's placeholders filled: {python}, {out}, {comfyui}, {before} from `values`, {out:NAME} by `stem`
    (other braces, as in an item's Python code, are left alone)."""
    text = re.sub(r"\{out:([\w.-]+)\}", lambda m: str(stem(m.group(1))), text)
    return re.sub(r"\{(python|out|comfyui|before)\}", lambda m: str(values[m.group(1)]), text)


def _brief(entry: dict | None) -> dict:
    keys = ("status", "rc", "seconds", "estimate_s", "limit_s", "files", "call", "sage_building")
    return {k: entry[k] for k in keys if entry and k in entry}


def _lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def _last_line(path: Path) -> str:
    lines = [l.strip() for l in _lines(str(path)) if re.search(r"\w", l)]  # not a closing brace of JSON
    return lines[-1][:200] if lines else ""


def code_digest() -> str:
    """sha256 of the pack's code (CODE), so a result names the code it ran even without git."""
    digest = hashlib.sha256()
    for top in CODE:
        base = ROOT / top
        for path in sorted([base] if base.is_file() else base.rglob("*.py")):
            digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def cpu_tries(items: list[gpu_items.Item]) -> list[gpu_items.Item]:
    """The items that have a CPU try, as that try: their `cpu` arguments last, no GPU, FA3 or SageAttention needed."""
    import dataclasses
    return [dataclasses.replace(i, argv=(*i.argv, *i.cpu), needs=tuple(n for n in i.needs
                                                                       if n not in ("gpu", "fa3", "sage")))
            for i in items if i.cpu is not None]


def select(items: list[gpu_items.Item], only: str | None) -> list[gpu_items.Item]:
    if not only:
        return list(items)
    wanted = [w for w in only.split(",") if w]
    unknown = [w for w in wanted if not w.isdigit() and w not in {i.name for i in items}]
    if unknown:
        raise SystemExit(f"--only: unknown item(s) {', '.join(unknown)}; --dry-run lists them")
    return [i for i in items if i.name in wanted or str(i.group) in wanted]


# --- the dry run: the items, and whether each script takes its arguments ------------------------------------------

ARGS_CHECK = r"""
import argparse, json, os, runpy, sys
script, argvs = sys.argv[1], json.loads(sys.argv[2])
class Accepted(Exception): pass
class Refused(Exception): pass
original = argparse.ArgumentParser.parse_args
def parse_args(self, args=None, namespace=None):
    original(self, args, namespace)
    raise Accepted
def error(self, message):
    raise Refused(f"{self.prog}: {message}")
argparse.ArgumentParser.parse_args = parse_args
argparse.ArgumentParser.error = error
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
module = runpy.run_path(script, run_name="gpu_run_args_check")
verdicts = []
for argv in argvs:
    sys.argv = [script, *argv]
    try:
        module["main"]()
        verdicts.append("main() returned without parsing its arguments")
    except Accepted:
        verdicts.append("")
    except Refused as exc:
        verdicts.append(str(exc))
print("ARGS " + json.dumps(verdicts))
"""
# pytest's own options and selection, for each argument list in one process (torch and the pack imported once):
# exit 0 when it collects tests, 5 when it selects none.
COLLECT_CHECK = r"""
import contextlib, io, json, sys
import pytest
verdicts = []
for argv in json.loads(sys.argv[1]):
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        try:
            code = int(pytest.main(["--collect-only", *argv]))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 4
    verdicts.append("" if code == 0 else f"pytest exit {code}: " + text.getvalue().strip()[-400:])
print("ARGS " + json.dumps(verdicts))
"""


class Dry(Run):
    """The run's view of its items without a machine: {out} is RESULTS/DATE-MACHINE-NAME, paths as given."""

    def __init__(self, args, items):
        super().__init__(args, items)
        self.python = "python3"

    def stem(self, name: str) -> Path:
        return Path("RESULTS") / f"DATE-MACHINE-{name}"

    @staticmethod
    def path(text: str) -> Path:
        return Path(text)


def dry_items(items: list[gpu_items.Item], args) -> list[dict]:
    """Each item as the run would start it."""
    dry = Dry(args, items)
    rows = []
    for item in items:
        rows.append({"name": item.name, "group": item.group, "needs": list(item.needs),
                     "estimate_s": item.estimate_s, "limit_s": item.limit_s, "basis": item.basis,
                     "script": item.script, "argv": dry.argv(item, optional=False),
                     "optional": {dry.fill(k, item): [dry.fill(a, item) for a in v] for k, v in item.optional.items()},
                     "env": {k: dry.fill(v, item) for k, v in item.env.items()}})
    return rows


def check_args(items: list[gpu_items.Item], python: str = sys.executable) -> dict[str, str]:
    """{item: "" when its script exists and takes its arguments (its own argparse, or pytest collecting exactly its
    tests), else why not}. Placeholders become paths under a scratch folder; optional arguments are included."""
    import tempfile
    verdicts: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as scratch:
        def fill(text: str) -> str:
            return substitute(text, {"python": python, "out": f"{scratch}/out", "comfyui": scratch,
                                     "before": scratch}, lambda name: f"{scratch}/{name}")
        by_script: dict[str, list[gpu_items.Item]] = {}
        for item in items:
            if not (ROOT / item.script).exists():
                verdicts[item.name] = f"{item.script} does not exist"
            else:
                by_script.setdefault(item.script, []).append(item)
        tests = [i for group in by_script.values() for i in group if i.pytest]
        if tests:  # every pytest item in one process
            by_script = {k: v for k, v in by_script.items() if not v[0].pytest} | {"pytest": tests}
        for script, group in by_script.items():
            argvs = [[fill(a) for a in (*i.argv, *(x for v in i.optional.values() for x in v))] for i in group]
            check = ([COLLECT_CHECK, json.dumps([a[3:] for a in argvs])] if script == "pytest" else
                     [ARGS_CHECK, str(ROOT / script), json.dumps([a[2:] for a in argvs])])
            done = subprocess.run([python, "-c", *check], cwd=ROOT, capture_output=True, text=True, timeout=900)
            line = next((l for l in done.stdout.splitlines() if l.startswith("ARGS ")), None)
            found = json.loads(line[5:]) if line else [f"the check failed: {(done.stderr or done.stdout)[-400:]}"]
            verdicts.update({item.name: found[i] if i < len(found) else found[0] for i, item in enumerate(group)})
    return verdicts


def dry_run(items: list[gpu_items.Item], args) -> int:
    rows = dry_items(items, args)
    if args.check_args:
        verdicts = check_args(items)
        for row in rows:
            row["args_ok"], row["args_error"] = not verdicts[row["name"]], verdicts[row["name"]]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        total = sum(r["estimate_s"] for r in rows)
        print(f"{len(rows)} items, about {total} s in all (one call: --deadline {args.deadline} s)")
        for row in rows:
            check = f"  ARGS: {row['args_error']}" if row.get("args_error") else ""
            print(f"[{row['group']}] {row['name']}: ~{row['estimate_s']} s (limit {row['limit_s']} s), needs "
                  f"{', '.join(row['needs'])}{check}\n    {shlex.join(row['argv'])}"
                  + "".join(f"\n    + {' '.join(v)} when {k} exists" for k, v in row["optional"].items())
                  + "".join(f"\n    env {k}={v}" for k, v in row["env"].items()))
    return 0 if all(r.get("args_ok", True) for r in rows) else 1


def main(argv=None, items: list[gpu_items.Item] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT"), help="where the files to bring back go ($OUT)")
    parser.add_argument("--deadline", type=float, default=540.0, help="seconds from the start for everything")
    parser.add_argument("--reserve", type=float, default=15.0, help="seconds kept at the end to pack the results")
    parser.add_argument("--only", help="items or group numbers, comma-separated (default: all)")
    parser.add_argument("--dry-run", action="store_true", help="list the items and their commands; run nothing")
    parser.add_argument("--json", action="store_true", help="--dry-run: as JSON")
    parser.add_argument("--check-args", action="store_true",
                        help="--dry-run: check each item's script exists and takes its arguments")
    parser.add_argument("--retry-failed", action="store_true", help="run failed and timed-out items again")
    parser.add_argument("--allow-missing", default="", help="needs (e.g. sage,fa3) to run items without")
    parser.add_argument("--work", default="/tmp/gpu-run", help="this machine's folder for the run (kept while warm)")
    parser.add_argument("--resume", default=".gpu/resume", help="the results of earlier calls, carried back")
    parser.add_argument("--wheels", default=".whl/gpu", help="the carried wheel batches")
    parser.add_argument("--sage-source", default=".gpu/sage-src", help="the carried SageAttention source")
    parser.add_argument("--comfyui", default=".gpu/ComfyUI", help="the carried ComfyUI (COMFYUI_PATH)")
    parser.add_argument("--before", default=".gpu/before", help="the carried pack of the previous main")
    parser.add_argument("--commit", help="the commit the working tree is (the machine gets no .git)")
    parser.add_argument("--poll", type=float, default=5.0, help="seconds between looks while items wait")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="run the items that have a CPU try (gpu_items.py `cpu`) on a CPU at toy sizes")
    args = parser.parse_args(argv)
    args.allow_missing = {n for n in args.allow_missing.split(",") if n}
    chosen = select(gpu_items.ITEMS if items is None else items, args.only)
    if args.cpu_smoke:
        chosen = cpu_tries(chosen)
    if args.dry_run:
        return dry_run(chosen, args)
    if not args.out:
        parser.error("--out (or $OUT) names where the files to bring back go")
    run = Run(args, chosen)
    signal.signal(signal.SIGTERM, _stop)
    status = 0
    try:
        run.resume()
        run.install_wheels()
        run.machine()
        run.start_sage()
        run.loop()
    except KeyboardInterrupt:
        run.say("stopped (SIGTERM or Ctrl-C): packing what there is")
        status = 130
    except Exception:  # a defect here: say it, and still bring back what ran
        import traceback
        run.say("the run broke off:\n" + traceback.format_exc())
        status = 1
    finally:
        run.finish()
    return status


def _stop(*_):
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())

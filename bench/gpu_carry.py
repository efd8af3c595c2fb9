"""What a `bench/gpu_run.py` call carries to the GPU machine, and what comes back: run here, beside the calls.

    python bench/gpu_carry.py prepare [--comfyui PATH] [--sage PATH] [--before REV]   # before a call
    python bench/gpu_carry.py unpack FILES                                             # after it

`prepare` fills the git-ignored .gpu/ and .whl/gpu/ and prints the call (its carry list and command) with the size
of all that travels (64 MiB a call, the working tree included):
- .whl/gpu/batch-1: the first wheel set (bench/device_wheels.py prepare --sets first, 29 MiB), unless there;
- .gpu/ComfyUI: the part of a ComfyUI 0.3.64 checkout (--comfyui, default $COMFYUI_PATH) the model-step items
  import: `comfy/` without its tokenizer data (text_encoders/, sd1_tokenizer/: 9.7 MB no model step reads), and
  comfyui_version.py; 2.8 MB. What it imports beyond torch (einops, numpy, Pillow, psutil, tqdm) is in the GPU
  image;
- .gpu/sage-src: SageAttention's build sources (setup.py, pyproject.toml, csrc/, sageattention/, README.md, LICENSE:
  0.5 MB; the checkout's examples and assets are 39 MB) from a checkout (--sage) at SAGE_COMMIT, when
  .whl/gpu/sage (the wheel an earlier call built and returned) is not there;
- .gpu/before: the pack (__init__.py, dispatcher/, nodes/) at --before REV, for `small_call.py --before`.
- .gpu/resume, when there (from `unpack`): the earlier calls' results and markers, so the call resumes.

`unpack FILES` takes the folder a call's files came back in: gpu-run-results.tar.gz goes to .gpu/resume (replacing
it: each call's archive holds every result so far), sage/ to .whl/gpu/sage; it prints what ran, what is left and
the next call. Then `python bench/results_table.py .gpu/resume --readme bench/results/README.md` writes the figures.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
import device_wheels  # noqa: E402  (bench/ is on sys.path when a script of it runs)

sys.path.insert(0, str(ROOT))
from dispatcher.tools.sage_build import SAGE_COMMIT, _check_source  # noqa: E402

GPU = ROOT / ".gpu"
WHEELS = ROOT / ".whl" / "gpu"
LIMIT = 64 * 2**20
COMFYUI_KEEP = ("comfy", "comfyui_version.py")
COMFYUI_DROP = ("text_encoders", "sd1_tokenizer", "__pycache__")  # under comfy/: data no model step imports
SAGE_KEEP = ("setup.py", "pyproject.toml", "csrc", "sageattention", "README.md", "LICENSE")
PACK = ("__init__.py", "dispatcher", "nodes")


def size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def tree_size() -> int:
    """The working tree that travels: tracked files and untracked ones git does not ignore."""
    names = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           check=True).stdout.split(b"\0")
    return sum(size(ROOT / n.decode()) for n in names if n and (ROOT / n.decode()).is_file())


def ignored(path: Path) -> bool:
    return subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=ROOT).returncode == 0


def replace(folder: Path) -> Path:
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    return folder


def comfyui(source: Path, into: Path) -> None:
    if not (source / "comfy" / "ldm").is_dir():
        raise SystemExit(f"{source} is not a ComfyUI checkout (no comfy/ldm): pass --comfyui PATH")
    replace(into)
    for name in COMFYUI_KEEP:
        if (source / name).is_dir():
            shutil.copytree(source / name, into / name, ignore=shutil.ignore_patterns(*COMFYUI_DROP, "*.pyc"))
        elif (source / name).exists():
            shutil.copy2(source / name, into / name)


def sage_source(source: Path, into: Path) -> None:
    """SageAttention's build sources at SAGE_COMMIT (from git when `source` is a checkout, else as they are)."""
    replace(into)
    if (source / ".git").exists() or subprocess.run(["git", "-C", str(source), "rev-parse"],
                                                    capture_output=True).returncode == 0:
        archive = subprocess.run(["git", "-C", str(source), "archive", "--format=tar", SAGE_COMMIT, *SAGE_KEEP],
                                 capture_output=True)
        if archive.returncode != 0:
            raise SystemExit(f"{source}: no commit {SAGE_COMMIT[:12]} (SAGE_COMMIT): {archive.stderr.decode()[:300]}")
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(into, filter="data")
    else:
        for name in SAGE_KEEP:
            if (source / name).is_dir():
                shutil.copytree(source / name, into / name)
            elif (source / name).exists():
                shutil.copy2(source / name, into / name)
    print(f"SageAttention {_check_source(into)} sources in {rel(into)}")


def pack_at(rev: str, into: Path) -> None:
    archive = subprocess.run(["git", "archive", "--format=tar", rev, *PACK], cwd=ROOT, capture_output=True)
    if archive.returncode != 0:
        raise SystemExit(f"git archive {rev}: {archive.stderr.decode()[:300]}")
    replace(into)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    (into / "REVISION").write_text(subprocess.run(["git", "rev-parse", rev], cwd=ROOT, capture_output=True,
                                                  text=True).stdout)


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def carry_list() -> list[Path]:
    """What the next call carries, of what is here."""
    paths = [WHEELS / "batch-1"]
    paths.append(WHEELS / "sage" if (WHEELS / "sage" / "manifest.json").exists() else GPU / "sage-src")
    paths += [GPU / "ComfyUI", GPU / "before", GPU / "resume"]
    return [p for p in paths if p.exists()]


def show_call() -> int:
    carried = carry_list()
    sizes = {p: size(p) for p in carried}
    tree = tree_size()
    total = tree + sum(sizes.values())
    print(f"travels: the working tree {tree / 2**20:.1f} MiB"
          + "".join(f", {rel(p)} {s / 2**20:.1f} MiB" for p, s in sizes.items())
          + f": {total / 2**20:.1f} of 64 MiB")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    carry = json.dumps([rel(p) for p in carried])
    print(f"run(timeout_s=600, carry={carry},\n    command=\"python3 bench/gpu_run.py --commit {commit[:12]}"
          f"{'+changes' if dirty else ''}\")")
    for p in (GPU, WHEELS):
        if p.exists() and p.is_relative_to(ROOT) and not ignored(p):
            print(f"warning: {rel(p)} is not git-ignored: it would travel and could be committed")
    if total > LIMIT:
        print("over 64 MiB: leave .gpu/before out, or carry the SageAttention wheel (.whl/gpu/sage) instead of its "
              "source")
        return 1
    return 0


def prepare(args) -> int:
    if not (WHEELS / "batch-1" / "manifest.json").exists():
        device_wheels.main(["prepare", "--sets", "first"])
    if args.comfyui:
        comfyui(Path(args.comfyui), GPU / "ComfyUI")
        print(f"ComfyUI's model code in .gpu/ComfyUI: {size(GPU / 'ComfyUI') / 2**20:.1f} MiB")
    elif not (GPU / "ComfyUI").exists():
        print("no ComfyUI (--comfyui or COMFYUI_PATH): the step-table and small-call items will be skipped")
    if args.sage:
        sage_source(Path(args.sage), GPU / "sage-src")
    elif not (GPU / "sage-src").exists() and not (WHEELS / "sage").exists():
        print("no SageAttention source (--sage) nor wheel: the items that need it will be skipped")
    if args.before:
        pack_at(args.before, GPU / "before")
        print(f"the pack at {args.before} in .gpu/before ({size(GPU / 'before') / 2**20:.1f} MiB)")
    return show_call()


def unpack(args) -> int:
    files = Path(args.files)
    parts = sorted(files.glob("gpu-run-results.tar.gz.part*"), key=lambda p: int(p.name.rsplit("part", 1)[1]))
    archive = files / "gpu-run-results.tar.gz"
    data = archive.read_bytes() if archive.exists() else b"".join(p.read_bytes() for p in parts)
    if not data:
        raise SystemExit(f"no gpu-run-results.tar.gz in {files}")
    resume = replace(GPU / "resume")
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(resume, filter="data")
    print(f"results in .gpu/resume ({len([p for p in resume.rglob('*') if p.is_file()])} files)")
    if (files / "sage" / "manifest.json").exists():
        sage = replace(WHEELS / "sage")
        for path in (files / "sage").iterdir():  # the contents alone: what came back is read-only
            shutil.copyfile(path, sage / path.name)
        print("the SageAttention wheel built there in .whl/gpu/sage: the next call carries it instead of building")
    summary = files / "gpu-run-summary.json"
    if summary.exists():
        record = json.loads(summary.read_text())
        for name, entry in record.get("items", {}).items():
            print(f"  {name}: {entry.get('status')}" + (f" ({entry['why']})" if entry.get("why") else "")
                  + (f" in {entry['seconds']} s" if entry.get("seconds") is not None else ""))
        if record.get("next", {}).get("all_done"):
            print("every item is done")
    return show_call()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--comfyui", default=os.environ.get("COMFYUI_PATH"), help="a ComfyUI 0.3.64 checkout")
    p.add_argument("--sage", help=f"a SageAttention checkout (its commit {SAGE_COMMIT[:12]} is taken)")
    p.add_argument("--before", help="the revision whose pack small_call.py compares with (e.g. main~1)")
    u = sub.add_parser("unpack")
    u.add_argument("files", help="the folder a call's files came back in")
    args = parser.parse_args(argv)
    return prepare(args) if args.verb == "prepare" else unpack(args)


if __name__ == "__main__":
    sys.exit(main())

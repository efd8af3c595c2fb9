"""Wheels for the lent GPU machine, which reaches no package index and takes at most 64 MiB per command.

    python bench/device_wheels.py prepare            # here: download, slim, split into batches under .whl/device/
    python bench/device_wheels.py install            # there, after every batch was carried: join, check, pip install

What the H200 needs for issue 31's kernels (Python 3.12, torch 2.11.0+cu130 already there): comfy-kitchen 0.2.40
(67.8 MB, of which its ROCm library is 158 MB of the 199 MB unpacked) and flash-attn-4 4.0.0b40 with its CuTe DSL
(nvidia-cutlass-dsl, whose CUDA 13 library wheel alone is 92 MB). Since 4.6 the DSL's Python package (`cutlass`,
`cutlass.cute`) is a wheel of its own, nvidia-cutlass-dsl-libs-core, required by nvidia-cutlass-dsl-libs-base (which
carries only `cutlass/_mlir`): the set of 2026-12-05 lacked it, so `cutlass` imported as a namespace package and
`cutlass.cute` did not. `prepare` now checks the set's closure (`unmet`): every Requires-Dist of every wheel is in
the set, on the device already (`DEVICE_HAS`) or the other CUDA major's library. `prepare`:
- downloads the pinned set below with `pip download --no-deps` for CPython 3.12 on manylinux x86_64 (no torch:
  the device has it), into .whl/device/downloads (`.whl/` is git-ignored: no wheel is ever committed);
- repacks comfy-kitchen without `comfy_kitchen/backends/hip/_C*.so` (and its RECORD line): the package loads that
  library only under a ROCm torch (`if getattr(torch.version, "hip", None)` in its __init__), so on CUDA nothing
  changes but the size;
- splits any file still over the batch size into parts, and packs everything into batches of at most
  `--batch-mib` (default 56: the working tree travels too), each with a manifest of sha256 sums.
It prints, per batch, the `run` call that carries it. Each command carries one batch (`carry=[".whl/device/batch-1"]`,
then batch-2, ...): a carried path that a later command does not name stays on the machine while it is warm.
`install` (on the device) joins the parts, checks every file against its manifest, and runs
`pip install --no-index --no-deps` on the exact set (--no-deps: the set is complete, and the device's torch must not
be touched), then imports comfy_kitchen and flash_attn.cute.

The CuTe DSL ships one runtime per CUDA major (nvidia-cutlass-dsl-libs-cu12 / -cu13); `--cuda 13` (the default,
the H200 image's torch is cu130) brings the CUDA 13 one only; `--cuda 12,13` brings both, as pip would.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DIR = ROOT / ".whl" / "device"
PYTHON, PLATFORM = "3.12", "manylinux_2_28_x86_64"
# flash-attn-4 4.0.0b40's Requires-Dist, resolved on 2026-12-04, without torch (and typing-extensions) which the
# device has; nvidia-cutlass-dsl's library wheels are chosen by --cuda.
PINNED = ("comfy-kitchen==0.2.40", "flash-attn-4==4.0.0b40", "nvidia-cutlass-dsl==4.8.1",
          "nvidia-cutlass-dsl-libs-base==4.8.1", "nvidia-cutlass-dsl-libs-core==4.8.1", "quack-kernels==0.6.5",
          "apache-tvm-ffi==0.1.15.post2", "torch-c-dlpack-ext==0.1.5", "einops==0.8.2", "cuda-bindings==13.5.0",
          "cuda-pathfinder==1.9.1", "protobuf==7.36.2")
# What the device's torch 2.11.0+cu130 already brings (never carried: torch must not be touched).
DEVICE_HAS = ("torch", "typing-extensions", "triton", "numpy")
CUTLASS_LIBS = "nvidia-cutlass-dsl-libs-cu{}==4.8.1"
# Members a repacked wheel leaves out: (wheel name prefix, member prefix, why).
STRIP = (("comfy_kitchen-", "comfy_kitchen/backends/hip/_C", "its ROCm library, loaded only under a ROCm torch"),)
IMPORTS = ("comfy_kitchen", "cutlass.cute", "flash_attn.cute")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _requires(wheel: Path) -> tuple[str, list[str]]:
    """(its distribution name, its Requires-Dist lines), from the wheel's METADATA."""
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(name).decode().splitlines()
    dist = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("Name:"))
    return dist, [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")]


def unmet(wheels: list[Path], cuda: str) -> list[str]:
    """Each requirement of the wheels (for CPython 3.12 on Linux x86_64, no extras) that neither the set, the
    device (DEVICE_HAS) nor the choice of CUDA majors (`cuda`: the other major's DSL library is left out on purpose)
    provides: `pip install --no-deps` would install the set without it, and an import would fail on the device."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    environment = {"python_version": PYTHON, "python_full_version": f"{PYTHON}.0", "sys_platform": "linux",
                   "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
                   "os_name": "posix", "extra": ""}
    found = dict(_requires(w) for w in wheels)
    have = {canonicalize_name(d) for d in found} | {canonicalize_name(d) for d in DEVICE_HAS}
    have |= {f"nvidia-cutlass-dsl-libs-cu{major}" for major in ("12", "13") if major not in cuda.split(",")}
    missing = []
    for dist, requires in sorted(found.items()):
        for line in requires:
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate(environment):
                continue
            if canonicalize_name(requirement.name) not in have:
                missing.append(f"{dist} requires {line}")
    return missing


def download(requirements: list[str], target: Path) -> list[Path]:
    target.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
                    PYTHON, "--implementation", "cp", "--platform", PLATFORM, "-d", str(target), *requirements],
                   check=True)
    return sorted(target.glob("*.whl"))


def strip(wheel: Path, out_dir: Path) -> Path:
    """The wheel without the members STRIP names for it (same file name; RECORD without their lines)."""
    rules = [(member, why) for prefix, member, why in STRIP if wheel.name.startswith(prefix)]
    if not rules:
        return wheel
    out = out_dir / wheel.name
    removed = []
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if any(info.filename.startswith(member) for member, _ in rules):
                removed.append(info.filename)
                continue
            data = src.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines
                               if not any(line.startswith(member) for member, _ in rules)).encode()
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    if not removed:
        raise SystemExit(f"{wheel.name}: nothing matched {[m for m, _ in rules]}; the wheel's layout changed")
    print(f"  {wheel.name}: left out {', '.join(removed)} ({'; '.join(w for _, w in rules)}): "
          f"{wheel.stat().st_size / 2**20:.1f} -> {out.stat().st_size / 2**20:.1f} MiB")
    return out


def pieces(files: list[Path], limit: int, parts_dir: Path) -> list[dict]:
    """Each file whole, or cut into parts of at most `limit` bytes: [{"path", "wheel", "part", "parts"}]."""
    out = []
    for path in files:
        size = path.stat().st_size
        if size <= limit:
            out.append({"path": path, "wheel": path.name, "part": 0, "parts": 1})
            continue
        count = -(-size // limit)
        with open(path, "rb") as f:
            for i in range(count):
                part = parts_dir / f"{path.name}.part{i}"
                part.write_bytes(f.read(limit))
                out.append({"path": part, "wheel": path.name, "part": i, "parts": count})
    return out


def folder_of(args) -> Path:
    base = Path(args.dir).resolve()
    if not base.is_relative_to(ROOT):
        raise SystemExit(f"--dir {args.dir} must be inside the repository: the device carries repository paths")
    return base


def prepare(args) -> int:
    base = folder_of(args)
    if base.exists():
        shutil.rmtree(base)
    downloads, slim, parts = base / "downloads", base / "slim", base / "parts"
    for folder in (slim, parts):
        folder.mkdir(parents=True)
    requirements = list(PINNED) + [CUTLASS_LIBS.format(c) for c in args.cuda.split(",")]
    wheels = [strip(w, slim) for w in download(requirements, downloads)]
    missing = unmet(wheels, args.cuda)
    if missing:
        raise SystemExit("the wheel set is not closed (pin these in PINNED): " + "; ".join(missing))
    sums = {w.name: sha256(w) for w in wheels}
    limit = int(args.batch_mib * 2**20)
    batches: list[list[dict]] = []
    for piece in sorted(pieces(wheels, limit, parts), key=lambda p: -p["path"].stat().st_size):  # first fit
        size = piece["path"].stat().st_size
        home = next((b for b in batches if sum(p["path"].stat().st_size for p in b) + size <= limit), None)
        if home is None:
            batches.append(home := [])
        home.append(piece)
    for i, batch in enumerate(batches, 1):
        folder = base / f"batch-{i}"
        folder.mkdir()
        for piece in batch:
            shutil.move(str(piece["path"]), folder / piece["path"].name)
        manifest = [{"file": p["path"].name, "wheel": p["wheel"], "part": p["part"], "parts": p["parts"],
                     "sha256": sums[p["wheel"]]} for p in batch]
        (folder / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        total = sum((folder / p["path"].name).stat().st_size for p in batch)
        print(f"batch-{i}: {total / 2**20:.1f} MiB, {', '.join(p['path'].name for p in batch)}")
        print(f"  run(carry=['{folder.relative_to(ROOT)}'], command='ls {folder.relative_to(ROOT)}')")
    shutil.rmtree(slim)
    shutil.rmtree(parts)
    shutil.rmtree(downloads)
    print(f"then, in the last call: python bench/device_wheels.py install --dir {base.relative_to(ROOT)}")
    return 0


def install(args) -> int:
    base = folder_of(args)
    entries = []
    for manifest in sorted(base.glob("batch-*/manifest.json")):
        entries += [{**e, "path": manifest.parent / e["file"]} for e in json.loads(manifest.read_text())]
    if not entries:
        raise SystemExit(f"no batch under {base}: carry .whl/device/batch-N first")
    wheels_dir = base / "wheels"
    wheels_dir.mkdir(exist_ok=True)
    by_wheel: dict[str, list[dict]] = {}
    for e in entries:
        by_wheel.setdefault(e["wheel"], []).append(e)
    missing = []
    for wheel, got in sorted(by_wheel.items()):
        want = got[0]["parts"]
        if sorted(e["part"] for e in got) != list(range(want)) or not all(e["path"].exists() for e in got):
            missing.append(f"{wheel} ({len(got)} of {want} parts here)")
            continue
        out = wheels_dir / wheel
        with open(out, "wb") as f:
            for e in sorted(got, key=lambda e: e["part"]):
                f.write(e["path"].read_bytes())
        if sha256(out) != got[0]["sha256"]:
            raise SystemExit(f"{wheel}: sha256 differs from the manifest; carry its batches again")
    if missing:
        raise SystemExit("incomplete: " + "; ".join(missing) + ". Carry the missing batch (a machine given back "
                                                               "loses what earlier commands carried)")
    command = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps",
               *sorted(str(w) for w in wheels_dir.glob("*.whl"))]
    if args.dry_run:
        print("joined and checked; would run:", " ".join(command))
        return 0
    subprocess.run(command, check=True)
    for module in IMPORTS:
        subprocess.run([sys.executable, "-c", f"import {module}; print('import {module}: ok')"], check=True,
                       env={**os.environ})
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="verb", required=True)
    for verb in ("prepare", "install"):
        p = sub.add_parser(verb)
        p.add_argument("--dir", default=str(DEFAULT_DIR))
    sub.choices["prepare"].add_argument("--batch-mib", type=float, default=56.0)
    sub.choices["prepare"].add_argument("--cuda", default="13", choices=("12", "13", "12,13"))
    sub.choices["install"].add_argument("--dry-run", action="store_true", help="join and check only")
    args = parser.parse_args(argv)
    return prepare(args) if args.verb == "prepare" else install(args)


if __name__ == "__main__":
    sys.exit(main())

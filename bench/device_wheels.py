"""Wheels for a GPU machine that reaches no package index and takes at most 64 MiB per command.

    python bench/device_wheels.py prepare [--sets first]  # here: download, slim, split into batches under .whl/gpu/
    python bench/device_wheels.py install [--target DIR]  # there: join the carried batches, check, pip install

The sets, in the order their batches are numbered (`SETS`): `first`, what the first items of bench/gpu_run.py need
and nothing more (fa3-fwd 0.0.3, FlashAttention-3's forward kernels for Hopper, 27.6 MB; kernels 0.19.1, the pack's
own requirement, which the device lacks, with tomlkit; 29 MiB in all: batch-1, carried with every call of
gpu_run.py); `kitchen` and `fa4`, carried later (FA4's CUDA 13 library alone is 92 MB: its parts take two calls on a
warm machine).

What the H200 needs for issue 31's kernels (Python 3.12, torch 2.11.0+cu130 already there): comfy-kitchen 0.2.40
(67.8 MB, of which its ROCm library is 158 MB of the 199 MB unpacked) and flash-attn-4 4.0.0b40 with its CuTe DSL
(nvidia-cutlass-dsl, whose CUDA 13 library wheel alone is 92 MB). Since 4.6 the DSL's Python package (`cutlass`,
`cutlass.cute`) is a wheel of its own, nvidia-cutlass-dsl-libs-core, required by nvidia-cutlass-dsl-libs-base (which
carries only `cutlass/_mlir`): the set of 2026-12-05 lacked it, so `cutlass` imported as a namespace package and
`cutlass.cute` did not. `prepare` now checks the set's closure (`unmet`): every Requires-Dist of every wheel is in
the set, on the device already (`DEVICE_HAS`) or the other CUDA major's library. `prepare`:
- downloads the pinned sets below with `pip download --no-deps` for CPython 3.12 on manylinux x86_64 (no torch:
  the device has it), into .whl/gpu/downloads (`.whl/` is git-ignored: no wheel is ever committed);
- repacks comfy-kitchen without `comfy_kitchen/backends/hip/_C*.so` (and its RECORD line): the package loads that
  library only under a ROCm torch (`if getattr(torch.version, "hip", None)` in its __init__), so on CUDA nothing
  changes but the size;
- splits any file still over the batch size into parts, and packs each set into batches of at most `--batch-mib`
  (default 56: the working tree travels too), a set's batches after the previous set's, each with a manifest of
  sha256 sums.
It prints, per batch, the `run` call that carries it. A command carries batches (`carry=[".whl/gpu/batch-1"]`, ...):
a carried path that a later command does not name stays on the machine while it is warm.
`install` (on the device) joins the parts of every batch carried (any folder under --dir with a manifest.json: a
SageAttention wheel that bench/gpu_run.py returned too), checks every file against its manifest, and runs
`pip install --no-index --no-deps` on the complete wheels (--no-deps: the set is closed, and the device's torch must
not be touched), with --target into a folder to put on PYTHONPATH (bench/gpu_run.py does), or into the environment;
a wheel whose parts were not all carried is named and left out. It then imports what it installed.

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
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DIR = ROOT / ".whl" / "gpu"
PYTHON = "3.12"
# pip matches a manylinux tag's glibc version exactly: fa3-fwd 0.0.3 is manylinux_2_24, kernels 0.19.1 manylinux_2_17.
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# Each set's pins; flash-attn-4 4.0.0b40's Requires-Dist resolved on 2026-12-04, without torch (and
# typing-extensions) which the device has; nvidia-cutlass-dsl's library wheels are chosen by --cuda.
SETS = {
    "first": ("fa3-fwd==0.0.3", "kernels==0.19.1", "tomlkit==0.15.3"),
    "kitchen": ("comfy-kitchen==0.2.40",),
    "fa4": ("flash-attn-4==4.0.0b40", "nvidia-cutlass-dsl==4.8.1", "nvidia-cutlass-dsl-libs-base==4.8.1",
            "nvidia-cutlass-dsl-libs-core==4.8.1", "quack-kernels==0.6.5", "apache-tvm-ffi==0.1.15.post2",
            "torch-c-dlpack-ext==0.1.5", "einops==0.8.2", "cuda-bindings==13.5.0", "cuda-pathfinder==1.9.1",
            "protobuf==7.36.2"),
}
PINNED = tuple(pin for pins in SETS.values() for pin in pins)
# What the device's image already brings (never carried: torch must not be touched), as far as the sets require it.
DEVICE_HAS = ("torch", "typing-extensions", "triton", "numpy", "einops", "packaging", "ninja", "huggingface-hub",
              "pyyaml")
CUTLASS_LIBS = "nvidia-cutlass-dsl-libs-cu{}==4.8.1"
# Members a repacked wheel leaves out: (wheel name prefix, member prefix, why).
STRIP = (("comfy_kitchen-", "comfy_kitchen/backends/hip/_C", "its ROCm library, loaded only under a ROCm torch"),)
# What each installed distribution must make importable (checked after install).
IMPORTS = {"fa3-fwd": "fa3_fwd_interface", "kernels": "kernels", "comfy-kitchen": "comfy_kitchen",
           "flash-attn-4": "flash_attn.cute", "nvidia-cutlass-dsl": "cutlass.cute", "sageattention": "sageattention"}


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
    """The wheels of `requirements` (pins), downloaded into `target` (a folder of their own)."""
    target.mkdir(parents=True, exist_ok=True)
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
                    PYTHON, "--implementation", "cp", *platforms, "-d", str(target), *requirements], check=True)
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


def write_batch(folder: Path, batch: list[dict], sums: dict[str, str], label: str = "") -> int:
    """Move a batch's pieces into `folder` with its manifest; its size in bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    for piece in batch:
        if piece["path"].parent != folder:
            shutil.move(str(piece["path"]), folder / piece["path"].name)
    manifest = [{"file": p["path"].name, "wheel": p["wheel"], "part": p["part"], "parts": p["parts"],
                 "sha256": sums[p["wheel"]], **({"set": label} if label else {})} for p in batch]
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return sum((folder / p["path"].name).stat().st_size for p in batch)


def pack(wheel: Path, folder: Path, limit: int) -> list[Path]:
    """One wheel as a batch folder of its own (parts of at most `limit` bytes, a manifest): what `install` joins.
    bench/gpu_run.py returns the SageAttention wheel it built this way. The files written."""
    with tempfile.TemporaryDirectory() as parts:
        batch = pieces([wheel], limit, Path(parts))
        if batch[0]["parts"] == 1:  # whole: copy, the wheel stays where it is
            shutil.copy2(wheel, Path(parts) / wheel.name)
            batch = [{**batch[0], "path": Path(parts) / wheel.name}]
        write_batch(folder, batch, {wheel.name: sha256(wheel)})
    return sorted(folder.iterdir())


def folder_of(args) -> Path:
    base = Path(args.dir).resolve()
    if not base.is_relative_to(ROOT):
        raise SystemExit(f"--dir {args.dir} must be inside the repository: the device carries repository paths")
    return base


def prepare(args) -> int:
    base = folder_of(args)
    names = [n for n in args.sets.split(",") if n]
    unknown = [n for n in names if n not in SETS]
    if unknown:
        raise SystemExit(f"unknown set(s) {', '.join(unknown)}; the sets: {', '.join(SETS)}")
    downloads, slim, parts = base / "downloads", base / "slim", base / "parts"
    for old in [*base.glob("batch-*"), downloads, slim, parts]:  # other folders (a returned wheel's) stay
        shutil.rmtree(old, ignore_errors=True)
    for folder in (slim, parts):
        folder.mkdir(parents=True)
    by_set = {}
    for name in SETS:  # the sets' order, whatever the order asked
        if name in names:
            requirements = list(SETS[name]) + ([CUTLASS_LIBS.format(c) for c in args.cuda.split(",")]
                                               if name == "fa4" else [])
            by_set[name] = [strip(w, slim) for w in download(requirements, downloads / name)]
    wheels = [w for ws in by_set.values() for w in ws]
    missing = [f"{name}: {m}" for name, ws in by_set.items() for m in unmet(ws, args.cuda)]  # each set alone installs
    if missing:
        raise SystemExit("a wheel set is not closed (pin these in SETS): " + "; ".join(missing))
    sums = {w.name: sha256(w) for w in wheels}
    limit = int(args.batch_mib * 2**20)
    number = 0
    for name, set_wheels in by_set.items():
        batches: list[list[dict]] = []
        for piece in sorted(pieces(set_wheels, limit, parts), key=lambda p: -p["path"].stat().st_size):  # first fit
            size = piece["path"].stat().st_size
            home = next((b for b in batches if sum(p["path"].stat().st_size for p in b) + size <= limit), None)
            if home is None:
                batches.append(home := [])
            home.append(piece)
        for batch in batches:
            number += 1
            folder = base / f"batch-{number}"
            total = write_batch(folder, batch, sums, name)
            print(f"batch-{number} ({name}): {total / 2**20:.1f} MiB, {', '.join(p['path'].name for p in batch)}")
            print(f"  run(carry=['{folder.relative_to(ROOT)}'], ...)")
    for folder in (slim, parts, downloads):
        shutil.rmtree(folder)
    print(f"on the device: python bench/device_wheels.py install --dir {base.relative_to(ROOT)} [--target DIR] "
          "(bench/gpu_run.py does it)")
    return 0


def join(base: Path, into: Path) -> tuple[list[Path], list[str]]:
    """(the wheels whose every part was carried, checked against their manifests: a whole one where it lies, one
    carried in parts joined into `into`; what was not: "NAME (k of n parts here)"). Every folder under `base` with a
    manifest.json is a batch."""
    entries = []
    for manifest in sorted(base.glob("*/manifest.json")):
        entries += [{**e, "path": manifest.parent / e["file"]} for e in json.loads(manifest.read_text())]
    by_wheel: dict[str, list[dict]] = {}
    for e in entries:
        by_wheel.setdefault(e["wheel"], []).append(e)
    joined, missing = [], []
    for wheel, got in sorted(by_wheel.items()):
        want = got[0]["parts"]
        if sorted({e["part"] for e in got}) != list(range(want)) or not all(e["path"].exists() for e in got):
            missing.append(f"{wheel} ({len({e['part'] for e in got if e['path'].exists()})} of {want} parts here)")
            continue
        out = got[0]["path"]
        if want > 1:
            into.mkdir(parents=True, exist_ok=True)
            out = into / wheel
            with open(out, "wb") as f:
                for e in sorted(got, key=lambda e: e["part"]):
                    f.write(e["path"].read_bytes())
        if sha256(out) != got[0]["sha256"]:
            raise SystemExit(f"{wheel}: sha256 differs from the manifest; carry its batches again")
        joined.append(out)
    return joined, missing


def pip_install(wheels: list[Path], target: Path | None) -> None:
    """`pip install --no-index --no-deps` of exactly these wheels: into `target` (a folder for PYTHONPATH), or into
    this environment."""
    where = ["--target", str(target), "--upgrade"] if target is not None else []
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", *where, *sorted(str(w) for w in wheels)], check=True)


def distribution(wheel: Path) -> str:
    """The distribution's name of a wheel file, normalised (fa3_fwd-0.0.3-...whl -> fa3-fwd)."""
    return wheel.name.split("-")[0].replace("_", "-").lower()


def install(args) -> int:
    base = folder_of(args)
    wheels, missing = join(base, base / "wheels")  # never carried: not a batch (no manifest)
    if missing:
        print("left out, not every part was carried (a machine given back loses what earlier commands carried): "
              + "; ".join(missing))
    if not wheels:
        raise SystemExit(f"no complete wheel under {base}: carry .whl/gpu/batch-N first")
    target = Path(args.target).resolve() if args.target else None
    if args.dry_run:
        print("joined and checked; would install:", ", ".join(w.name for w in wheels),
              f"into {target}" if target else "into this environment")
        return 0
    pip_install(wheels, target)
    env = dict(os.environ)
    if target is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(target), env.get("PYTHONPATH")) if p)
    for module in sorted({IMPORTS[d] for d in map(distribution, wheels) if d in IMPORTS}):
        subprocess.run([sys.executable, "-c", f"import {module}; print('import {module}: ok')"], check=True, env=env)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="verb", required=True)
    for verb in ("prepare", "install"):
        p = sub.add_parser(verb)
        p.add_argument("--dir", default=str(DEFAULT_DIR))
    sub.choices["prepare"].add_argument("--batch-mib", type=float, default=56.0)
    sub.choices["prepare"].add_argument("--cuda", default="13", choices=("12", "13", "12,13"))
    sub.choices["prepare"].add_argument("--sets", default=",".join(SETS), help=f"of {', '.join(SETS)}")
    sub.choices["install"].add_argument("--target", help="install into this folder (for PYTHONPATH), not the "
                                                         "environment")
    sub.choices["install"].add_argument("--dry-run", action="store_true", help="join and check only")
    args = parser.parse_args(argv)
    return prepare(args) if args.verb == "prepare" else install(args)


if __name__ == "__main__":
    sys.exit(main())

"""How `auto`'s disk cache behaves at a large size: a tuning cache of ~60 MB (the size a long-lived ComfyUI reached,
issue #41: a new signature then took 34.8 s) is written in the legacy JSON form (format 4), then read and written
through `dispatcher.auto.cache` the way the tuner does. Figures: the first access (a migration, where there is one),
a lookup of a saved signature, a lookup of an unknown one, and an insert of a new decision (median of --repeat).

    python bench/tune_cache_size.py --mb 60 [--folder /tmp/x]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dispatcher.auto import cache  # noqa: E402
from dispatcher.auto.fingerprint import fingerprint_key, machine_fingerprint  # noqa: E402

NAMES = ["_native_flash", "_native_efficient", "_native_cudnn", "native", "flex", "flash", "sage", "xformers"]


def decision(i: int) -> dict:
    times = [round(0.1 + 0.001 * (i % 97) + 0.0001 * r, 6) for r in range(10)]
    return {"candidates": NAMES, "tuned_at": "2026-12-01T00:00:00+00:00", "seconds": 0.41,
            "timings": {n: {"median_ms": times[4], "times_ms": times} for n in NAMES},
            "verdicts": {f"model-{i % 7}": {str(b): {n: {"status": "valid", "rel_error": 0.0012, "reason": ""}
                                                     for n in NAMES} for b in range(3)}}}


def legacy_file(path: Path, megabytes: float) -> int:
    one = len(json.dumps(decision(0), indent=1, sort_keys=True))
    count = int(megabytes * 1e6 / one)
    key = fingerprint_key(machine_fingerprint())
    data = {"format": 4, "machines": {key: {"machine": machine_fingerprint(), "updated": "2026-12-01",
                                            "decisions": {f"sig-{i}": decision(i) for i in range(count)}}}}
    path.write_text(json.dumps(data, indent=1, sort_keys=True))
    return count


def timed(fn, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=60.0)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--folder", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    folder = args.folder or Path(tempfile.mkdtemp(prefix="tune-cache-bench-"))
    legacy = folder / "tune.json"
    count = legacy_file(legacy, args.mb)
    print(f"legacy tune.json: {legacy.stat().st_size / 1e6:.1f} MB, {count} decisions")
    cache.set_default_dir(folder)
    path = cache.default_cache_path()
    start = time.perf_counter()
    cache.lookup(path, "sig-0")
    print(f"first lookup (migration if any): {(time.perf_counter() - start) * 1e3:.0f} ms")
    saved = next(f"sig-{i}" for i in range(count) if cache.lookup(path, f"sig-{i}") is not None)
    print(f"lookup, saved signature: {timed(lambda: cache.lookup(path, saved), args.repeat):.2f} ms")
    print(f"lookup, unknown signature: {timed(lambda: cache.lookup(path, 'nothing-here'), args.repeat):.2f} ms")
    n = iter(range(10**9))
    print(f"insert a new decision: "
          f"{timed(lambda: cache.update(path, f'new-{next(n)}', lambda saved: decision(1)), args.repeat):.2f} ms")
    size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file() and p.name.startswith(path.name))
    print(f"cache on disk after: {size / 1e6:.1f} MB ({path.name} and its WAL; the JSON file kept beside is not "
          f"counted)")


if __name__ == "__main__":
    main()

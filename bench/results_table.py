"""The figures of a `bench/gpu_run.py` results folder, as bench/results/README.md's figures section.

    python bench/results_table.py RESULTS_DIR [--readme bench/results/README.md] [--no-copy]

RESULTS_DIR is what a run brought back, unpacked (bench/gpu_carry.py unpack puts it in .gpu/resume). Each result
file is DATE-MACHINE-WHAT; WHAT says which bench wrote it, and so which figures it holds and against which of issue
46's targets they are read. Without --readme the figures are printed. With it, the text between the README's
`<!-- figures -->` and `<!-- /figures -->` markers is replaced by: the machine and versions of the run, one table of
the figures with their targets and the file each comes from, the step table (bench/step_table.py's, with its chart
when matplotlib imports) and the kernels side by side; and every result file is copied beside the README (unless
--no-copy) with the run's machine records (DATE-MACHINE-gpu-run.json), so each link resolves.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_items  # noqa: E402  (bench/ is on sys.path when a script of it runs)
import step_table  # noqa: E402

START, END = "<!-- figures -->", "<!-- /figures -->"
NAME = re.compile(r"^(\d{4}-\d{2}-\d{2})-([a-z0-9.]+(?:-[0-9][a-z0-9.]*)?)-(.+)$")  # DATE-MACHINE-WHAT
SHAPES = {"wan1.3b": "WAN 1.3B self-attention", "wan14b": "Wan 14B self-attention", "flux": "Flux",
          "sdxl": "SDXL 64x64", "sdxl-1024": "SDXL 32x32", "sdxl-cross": "SDXL cross-attention"}
VIDEO = ("wan1.3b", "wan14b")
SIDE = {"_native_cudnn": "cuDNN", "_flash_3": "FA3", "flash_4": "FA4", "flash_3_fp8": "FA3 FP8",
        "sage_sm90_per_warp": "Sage per warp", "auto_exact": "`auto_exact`", "auto_fast": "`auto_fast`"}


def parts(path: Path) -> tuple[str, str, str] | None:
    """(date, machine, what) of a results file, None for another file."""
    match = NAME.match(path.name.split(".json")[0].split(".xml")[0].split(".txt")[0])
    return match.groups() if match else None


def row(what: str, measured: str, file: str, target: str = "", met: bool | None = None) -> dict:
    return {"what": what, "measured": measured, "target": target, "met": met, "file": file}


def check_time(data: dict, file: str) -> list[dict]:
    rows = []
    for name, s in data["shapes"].items():
        video = name in VIDEO
        rows.append(row(f"the check on {SHAPES.get(name, name)}: its time / the call's ({s['path']})",
                        f"{s['check_share_of_call']:.2%} ({s['check_ms']:.3f} / {s['call_ms']:.3f} ms; model "
                        f"{s['model_check_ms']:.3f} ms; interval {s['measured_interval']} measured, "
                        f"{s['model_interval']} modelled)", file,
                        "<= 2%" if video else "", s["check_share_of_call"] <= 0.02 if video else None))
        if s.get("check_extra_peak_mib") is not None and name == "wan14b":
            rows.append(row(f"the check's extra peak memory on {SHAPES[name]}", f"{s['check_extra_peak_mib']} MiB",
                            file, "a few MB (<= 8 MiB)", s["check_extra_peak_mib"] <= 8))
    return rows


def call_cost(data: dict, file: str) -> list[dict]:
    rows = []
    for name, s in data["shapes"].items():
        added = s["added_share"].get("default")
        checked = any(s["checks_per_call"].values())  # none: an exact kernel served, nothing was guarded
        rows.append(row(f"the guard on {SHAPES.get(name, name)} calls (`{data['backend']}`, served by "
                        f"{', '.join(s['served'])}), default interval: time added",
                        f"{added:+.2%} ({s['checks_per_call'].get('default')} checks a call; every call checked: "
                        f"{s['added_share'].get('every 1', float('nan')):+.2%})"
                        + ("" if checked else "; no guarded kernel served: the difference is noise"),
                        file, "<= 1%" if checked else "", added <= 0.01 if checked else None))
    return rows


def one_bad_block(data: dict, file: str) -> list[dict]:
    every = data["every"]
    how = "every call checked" if every == 1 else f"interval {data['interval']}" + (" (default)" if not every else "")
    site = ", one shared site" if data.get("shared_site") else ""
    target = "0" if every == 1 else "<= 1"
    guarded = bool(data["guard_checks"])  # 0: an exact kernel served every block, the guard was not put to test
    served = sorted(set(data.get("served", {}).values())) if isinstance(data.get("served"), dict) else []
    return [row(f"one bad block of {data['blocks']} from step {data['bad_from_step']} of {data['steps']} "
                f"(`{data['backend']}`, {how}{site}): spoiled calls",
                f"{data['spoiled_calls']} of {data['calls']} ({data['guard_checks']} checks, "
                f"{len(data['guard_failures'])} failed)"
                + ("" if guarded else f"; served by {', '.join(served) or 'an exact kernel'}: the guard was not tested"),
                file, target if guarded else "", data["spoiled_calls"] <= (0 if every == 1 else 1) if guarded else None)]


def refit(data: dict, file: str) -> list[dict]:
    return [row(f"the guard's cost model: {name}, fitted", f"{data['current'][name]:.3g} -> {value:.3g} (largest "
                f"error after {data['largest_relative_error_after']:.1%})", file)
            for name, value in data["fitted"].items()]


def step(data: dict, file: str) -> list[dict]:
    rows = []
    for r in data["table"]:
        if r["attention"].startswith("auto") and r.get("vs_best_pinned"):
            rows.append(row(f"{r['model']} step, {r['mode']}: `{r['attention']}` / the best pinned kernel",
                            f"{r['vs_best_pinned']:.3f} ({r['ms']:.1f} ms, x{r['vs_comfy']:.3f} of ComfyUI's own; "
                            f"served by {', '.join(r['served'])})", file, ">= 0.99", r["vs_best_pinned"] >= 0.99))
    return rows


def small_call(data: dict, file: str) -> list[dict]:
    rows = []
    for key, what, bound in (("dispatcher_minus_bare_host_us", "a repeat call's host time: the dispatcher over bare "
                              "SDPA", 5), ("override_minus_comfy_optimized_host_us", "a repeat call's host time: the "
                              "override over ComfyUI's own attention", 3)):
        if key in data:
            rows.append(row(what, f"{data[key]:+.1f} us", file, f"<= {bound} us", data[key] <= bound))
    return rows


def side_by_side(data: dict, file: str) -> list[dict]:
    fp8 = data["tflops_equivalent"].get("flash_3_fp8")
    if data["shape_bhld"][1] != 40 or data["inputs"] != "noise" or fp8 is None:
        return []
    return [row("FA3 FP8 on Wan 14B (noise): TFLOP/s-equivalent", f"{fp8:.0f} ({data['ms']['flash_3_fp8']:.2f} ms, "
                f"error {data['rel_error_vs_float64']['flash_3_fp8']:.1e})", file, ">= 1000", fp8 >= 1000)]


def tests(path: Path, file: str) -> list[dict]:
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    return [row(f"tests: {parts(path)[2]}", f"{passed} passed, {n['failures']} failed, "
                f"{n['errors']} errors, {n['skipped']} skipped", file, "0 failed",
                n["failures"] == 0 and n["errors"] == 0)]


READERS = {"guard-check-time": check_time, "guard-call-cost": call_cost, "guard-one-bad-block": one_bad_block,
           "guard-refit": refit, "step-table": step, "small-call": small_call, "side-by-side": side_by_side}


def result_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and parts(p))


def figures(folder: Path) -> list[dict]:
    """Every figure of the results folder: {what, measured, target, met, file}, in the items' order of kind."""
    rows = []
    for path in result_files(folder):
        what = parts(path)[2]
        try:
            if path.suffix == ".xml":
                rows += tests(path, path.name)
                continue
            reader = next((f for prefix, f in READERS.items() if what == prefix or what.startswith(prefix + "-")),
                          None)
            if reader is not None and path.suffix == ".json":
                rows += reader(json.loads(path.read_text()), path.name)
        except (ValueError, KeyError, TypeError, ET.ParseError) as exc:
            rows.append(row(f"{path.name}: not read", f"{type(exc).__name__}: {exc}", path.name))
    order = {item.name: i for i, item in enumerate(gpu_items.ITEMS)}  # the run's own order
    return sorted(rows, key=lambda r: order.get((parts(Path(r["file"])) or ("", "", ""))[2], len(order)))


def step_data(folder: Path) -> dict | None:
    """The step table's items merged into one table (bench/step_table.py's input)."""
    merged = None
    for path in result_files(folder):
        if parts(path)[2].startswith("step-table") and path.suffix == ".json":
            data = json.loads(path.read_text())
            if merged is None:
                merged = {**data, "table": [], "failed": {}}
            merged["table"] += data["table"]
            merged["failed"].update(data.get("failed", {}))
    return merged


def side_table(folder: Path) -> str:
    lines = ["| shape | inputs | " + " | ".join(SIDE.values()) + " |", "|---" * (len(SIDE) + 2) + "|"]
    found = False
    for path in result_files(folder):
        if not parts(path)[2].startswith("side-by-side") or path.suffix != ".json":
            continue
        data, found = json.loads(path.read_text()), True
        cells = []
        for name in SIDE:
            if name in data["ms"]:
                served = data["served"].get(name, name)
                cells.append(f"{data['ms'][name]:.3f} ({data['rel_error_vs_float64'][name]:.1e}"
                             + (f", {served}" if served != name else "") + ")")
            else:
                cells.append("-")
        lines.append(f"| {tuple(data['shape_bhld'])} | {data['inputs']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) if found else ""


def calls(folder: Path) -> list[dict]:
    found = sorted((folder / "calls").glob("call-*.json"), key=lambda p: int(re.findall(r"\d+", p.name)[0]))
    return [{k: v for k, v in json.loads(p.read_text()).items() if k != "figures"} for p in found]


def header(records: list[dict]) -> str:
    if not records:
        return "Machine: not recorded (no calls/ folder in the results)."
    m = records[-1].get("machine", {})
    smi = (m.get("nvidia_smi") or [{}])[0]
    packages = ", ".join(f"{k} {v}" for k, v in (m.get("packages") or {}).items() if v)
    dates = sorted({r.get("started", "")[:10] for r in records})
    gpu = smi.get("name") or ("a GPU" if m.get("gpu") else "no GPU")
    return (f"{gpu}, driver {smi.get('driver_version', '?')} ({smi.get('power.limit', '?')}), "
            f"{m.get('cores')} cores; Python {m.get('python')}, CUDA {m.get('cuda')}, cuDNN {m.get('cudnn')}, "
            f"nvcc {m.get('nvcc')}; {packages}. Code: {m.get('commit') or '?'} (digest {m.get('code_digest')}). "
            f"{len(records)} call(s) of `bench/gpu_run.py`, {', '.join(dates)}.")


def markdown(folder: Path, png: str | None) -> str:
    rows = figures(folder)
    mark = {True: "yes", False: "**no**", None: ""}
    lines = ["| what | measured | target | met | file |", "|---|---|---|---|---|"]
    lines += [f"| {r['what']} | {r['measured']} | {r['target']} | {mark[r['met']]} | "
              f"[{(parts(Path(r['file'])) or ('', '', r['file']))[2]}]({r['file']}) |" for r in rows]
    text = [f"Written by `bench/results_table.py` from the results of `bench/gpu_run.py`, not by hand. "
            f"{header(calls(folder))}", "", *lines]
    steps = step_data(folder)
    if steps:
        text += ["", "One step per model (`bench/comfy_model_step.py --table`, one item per model and mode):", ""]
        text += ([f"![Step time per model and attention]({png})", ""] if png else []) + [step_table.markdown(steps)]
        if steps["failed"]:
            text += ["", "Not measured: " + "; ".join(f"{k}: {v[:120]}" for k, v in steps["failed"].items())]
    side = side_table(folder)
    if side:
        text += ["", "Kernels side by side (`bench/side_by_side.py`; ms, error against float64, what an auto served):",
                 "", side]
    return "\n".join(text)


# The GPU machine's own paths in what its commands printed: a result names what ran, never where a machine kept it.
# Checked by tests/test_project_words.py (no machine path in a tracked file).
_MACHINE_PATHS = (
    (re.compile(r"/tmp/gpu-run\b"), "<gpu_run work>"),
    (re.compile(r"/opt/torch/\.venv\b"), "<venv>"),
    (re.compile(r"/tmp/pytest-of-[\w-]+/pytest-\d+"), "<pytest tmp>"),
    (re.compile(r"/(?:work|root|home|opt)/[^\s\"'`),;\]]*?/(?=(?:bench|dispatcher|nodes|tests|web|\.gpu)/"
                r"|kernels\.lock\.json)"), ""),  # the checkout's own files: repository-relative
    (re.compile(r"/tmp/(?=[\w.-])"), "<tmp>/"),
)


def scrub(text: str) -> str:
    """`text` with the machine's paths replaced: the checkout's files repository-relative, the rest by a name."""
    for pattern, name in _MACHINE_PATHS:
        text = pattern.sub(name, text)
    return text


def fill(readme: Path, block: str) -> None:
    text = readme.read_text()
    if text.count(START) != 1 or text.count(END) != 1:
        raise SystemExit(f"{readme} needs one {START} ... {END} slot")
    head, rest = text.split(START, 1)
    readme.write_text(f"{head}{START}\n{block}\n{END}{rest.split(END, 1)[1]}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, help="a bench/gpu_run.py results folder")
    parser.add_argument("--readme", type=Path, help="fill this README's figures slot")
    parser.add_argument("--no-copy", action="store_true", help="--readme: do not copy the result files beside it")
    args = parser.parse_args(argv)
    if not args.results.is_dir():
        raise SystemExit(f"{args.results} is not a folder (unpack gpu-run-results.tar.gz: bench/gpu_carry.py unpack)")
    if args.readme is None:
        print(markdown(args.results, None))
        return 0
    found = result_files(args.results)
    if not found:
        raise SystemExit(f"no DATE-MACHINE-WHAT result in {args.results}")
    date, machine, _ = parts(found[-1])
    where = args.readme.parent
    png = None
    steps = step_data(args.results)
    if steps:
        try:
            step_table.write_png(steps, str(where / f"{date}-{machine}-step-table.png"))
            png = f"{date}-{machine}-step-table.png"
        except ImportError:
            print("matplotlib is not installed: the step table without its chart")
    if not args.no_copy:
        for path in found:
            (where / path.name).write_text(scrub(path.read_text(errors="replace")))
        (where / f"{date}-{machine}-gpu-run.json").write_text(scrub(json.dumps({"calls": calls(args.results)},
                                                                               indent=1, default=str)) + "\n")
    fill(args.readme, markdown(args.results, png))
    print(f"filled the figures of {args.readme} from {args.results} ({len(found)} files"
          + ("" if args.no_copy else ", copied beside it") + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Re-fit the guard's cost model (dispatcher/guard_sizing.py: CHECK_HOST_S, MEMORY_BYTES_S, CHECK_FLOPS) from what
`bench/guard_cost.py --scenario check-time` measured on a GPU (bench/gpu_run.py's item guard-check-time).

    python bench/guard_fit.py RESULTS/DATE-MACHINE-guard-check-time.json [--json PATH]

The model prices a check by the Triton kernel as CHECK_HOST_S + read / MEMORY_BYTES_S + qk / KERNEL_FLOPS +
pv / CHECK_FLOPS (read: the bytes of K, V and the output; qk, pv: the flops of the checked rows). The terms come from
`guard.check_seconds` itself, evaluated with one constant at a time left in, so the fit follows the model as it is
written (and stops, saying so, if the model is no longer a sum of these terms). KERNEL_FLOPS stays: it prices the
call too. The other three are fitted by non-negative least squares on relative errors (check times span 0.05-5 ms)
over the shapes measured with the kernel. Self-attention shapes read and multiply in one fixed ratio (K, V and the
output against the checked rows' P.V), so only a cross-attention shape (SDXL's 77 text tokens) tells MEMORY_BYTES_S
from CHECK_FLOPS: without one, CHECK_FLOPS is kept and the note says so.

Prints the fitted constants, each shape's measured check time against the model before and after, and the interval
each shape gets before and after (`guard.interval`), beside the interval the measured check and call times give.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dispatcher import guard_sizing as guard  # noqa: E402  (the cost model and its constants)
from dispatcher.inputs import AttentionInputs  # noqa: E402

FITTED = ("CHECK_HOST_S", "MEMORY_BYTES_S", "CHECK_FLOPS")
TERMS = {"host": "CHECK_HOST_S", "read": "MEMORY_BYTES_S", "qk": "KERNEL_FLOPS", "pv": "CHECK_FLOPS"}


@contextlib.contextmanager
def constants(**values):
    """guard's module constants set to `values` for the block (check_seconds and interval read them at call time)."""
    saved = {name: getattr(guard, name) for name in values}
    try:
        for name, value in values.items():
            setattr(guard, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(guard, name, value)


def terms(inputs) -> dict[str, float]:
    """{host, read, qk, pv}: check_seconds(inputs, kernel) = host * CHECK_HOST_S + read / MEMORY_BYTES_S
    + qk / KERNEL_FLOPS + pv / CHECK_FLOPS, each read off guard.check_seconds with the other constants at zero cost."""
    free = {"CHECK_HOST_S": 0.0, "MEMORY_BYTES_S": math.inf, "KERNEL_FLOPS": math.inf, "CHECK_FLOPS": math.inf}
    out = {}
    for term, name in TERMS.items():
        with constants(**{**free, name: 1.0}):
            out[term] = guard.check_seconds(inputs, kernel=True)
    model = (out["host"] * guard.CHECK_HOST_S + out["read"] / guard.MEMORY_BYTES_S + out["qk"] / guard.KERNEL_FLOPS
             + out["pv"] / guard.CHECK_FLOPS)
    if not math.isclose(model, guard.check_seconds(inputs, kernel=True), rel_tol=1e-9):
        raise SystemExit("guard.check_seconds is no longer CHECK_HOST_S + read / MEMORY_BYTES_S + qk / KERNEL_FLOPS "
                         "+ pv / CHECK_FLOPS: update bench/guard_fit.py with the model")
    return out


def inputs_of(row: dict, dtype: str):
    b, lq, h, d = row["shape_bshd"]
    return AttentionInputs.of(b, h, lq, d, len_kv=row["len_kv"], dtype=dtype, device="cuda")


def least_squares(rows: list[list[float]], y: list[float]) -> list[float] | None:
    """Solve min |A x - y| (normal equations; a few unknowns), None when A's columns are dependent."""
    n = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] + [sum(r[i] * t for r, t in zip(rows, y))]
         for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12 * max(1.0, max(abs(v) for v in a[col][:n])):
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [v - f * w for v, w in zip(a[r], a[col])]
    return [a[i][n] / a[i][i] for i in range(n)]


def nnls(rows: list[list[float]], y: list[float]) -> list[float]:
    """Non-negative least squares by trying every subset of columns (three at most): the best fit whose
    coefficients are all >= 0."""
    n, best, best_cost = len(rows[0]), [0.0] * len(rows[0]), sum(t * t for t in y)
    for size in range(1, n + 1):
        for cols in itertools.combinations(range(n), size):
            x = least_squares([[r[c] for c in cols] for r in rows], y)
            if x is None or min(x) < 0:
                continue
            full = [0.0] * n
            for c, v in zip(cols, x):
                full[c] = v
            cost = sum((sum(r[i] * full[i] for i in range(n)) - t) ** 2 for r, t in zip(rows, y))
            if cost < best_cost:
                best, best_cost = full, cost
    return best


def fit(data: dict) -> dict:
    """The re-fit of one check-time result (guard_cost.py's JSON)."""
    dtype = "float32" if data.get("device") == "cpu" else "bfloat16"
    measured = {name: row for name, row in data["shapes"].items() if row.get("path") == "triton"}
    if not measured:
        raise SystemExit("no shape was checked by the Triton kernel in this run (a CPU run?): nothing to fit")
    t = {name: terms(inputs_of(row, dtype)) for name, row in measured.items()}
    ratios = [t[n]["read"] / t[n]["pv"] for n in measured if t[n]["pv"]]
    separable = max(ratios) > 1.05 * min(ratios)  # else read and pv are one column
    columns = ("host", "read", "pv") if separable else ("host", "read")
    rows, y = [], []
    for name, row in measured.items():
        seconds = row["check_ms"] / 1e3
        rest = t[name]["qk"] / guard.KERNEL_FLOPS + (0.0 if separable else t[name]["pv"] / guard.CHECK_FLOPS)
        rows.append([t[name][c] / seconds for c in columns])  # relative: every shape counts alike
        y.append(1.0 - rest / seconds)
    x = dict(zip(columns, nnls(rows, y)))
    current = {name: getattr(guard, name) for name in (*FITTED, "KERNEL_FLOPS")}
    fitted = {"CHECK_HOST_S": x["host"],
              "MEMORY_BYTES_S": 1 / x["read"] if x["read"] > 0 else math.inf,
              "CHECK_FLOPS": (1 / x["pv"] if x["pv"] > 0 else math.inf) if separable else guard.CHECK_FLOPS}
    shapes = {}
    for name, row in measured.items():
        inputs = inputs_of(row, dtype)
        before = guard.check_seconds(inputs, kernel=True)
        interval_before = guard.interval(inputs, kernel=True)
        with constants(**fitted):
            after = guard.check_seconds(inputs, kernel=True)
            interval_after = guard.interval(inputs, kernel=True)
        shapes[name] = {"check_ms": row["check_ms"], "model_ms_before": round(before * 1e3, 4),
                        "model_ms_after": round(after * 1e3, 4), "call_ms": row.get("call_ms"),
                        "model_call_ms": round(guard.call_seconds(inputs) * 1e3, 4),
                        "interval_before": interval_before, "interval_after": interval_after,
                        "interval_measured": max(1, math.ceil(row["check_ms"] / (guard.BUDGET * row["call_ms"])))
                        if row.get("call_ms") else None}
    worst = max(abs(s["model_ms_after"] / s["check_ms"] - 1) for s in shapes.values())
    note = ("" if separable else "every shape measured reads and multiplies in one ratio (no cross-attention "
            "shape): MEMORY_BYTES_S is fitted with CHECK_FLOPS kept at its value. ")
    return {"source_device": data.get("device"), "torch": data.get("torch"), "triton": data.get("triton"),
            "current": current, "fitted": {k: float(f"{v:.3g}") for k, v in fitted.items()},
            "kept": {"KERNEL_FLOPS": guard.KERNEL_FLOPS}, "largest_relative_error_after": round(worst, 3),
            "shapes": shapes, "note": note + "Copy the fitted constants into dispatcher/guard_sizing.py with the run they "
                                             "came from; `interval_measured` is what this machine's own times give."}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("check_time_json", help="bench/guard_cost.py --scenario check-time's --json")
    parser.add_argument("--json", help="also write the re-fit here")
    args = parser.parse_args(argv)
    result = fit(json.loads(Path(args.check_time_json).read_text()))
    result["source"] = Path(args.check_time_json).name
    print(f"re-fit from {result['source']} ({result['source_device']}):")
    for name, value in result["fitted"].items():
        print(f"  {name:15} {result['current'][name]:.3g} -> {value:.3g}")
    print(f"  {'shape':12} {'check ms':>9} {'model before':>13} {'model after':>12} {'call ms':>8} "
          f"{'interval before/after/measured':>31}")
    for name, s in result["shapes"].items():
        print(f"  {name:12} {s['check_ms']:9.4f} {s['model_ms_before']:13.4f} {s['model_ms_after']:12.4f} "
              f"{s['call_ms'] or 0:8.3f} {s['interval_before']:>13} / {s['interval_after']} / {s['interval_measured']}")
    print(f"  largest relative error after the re-fit: {result['largest_relative_error_after']:.1%}. {result['note']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

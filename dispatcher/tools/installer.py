"""`python install.py`: plan, fetch the Hub kernels that fit this machine, pin them; never break an install.

    python install.py                 # detect, print the plan, fetch + pin the Hub kernels that fit
    python install.py --plan          # only the plan (no network, nothing written)
    python install.py --dry-run       # the plan and what would be fetched/installed; changes nothing
    python install.py --json          # machine-readable (progress lines go to stderr)
    python install.py --simulate h200 # the plan for a named simulated machine
    python install.py --yes-pip       # also pip-install missing attention packages (torch is pinned)
    python install.py --only flash_hub,sage   # restrict fetching / pip to these backends
    python install.py --build sageattention [--source PATH]   # build SageAttention 2 for this GPU (minutes)

Exit status is 0 whatever the machine, network or Hub does (ComfyUI-Manager treats anything else as a
failed install); only a command-line mistake (an unknown flag or simulated machine) exits 2. `--build`
is never part of a plain install: it runs only when asked for, and exits 1 when it refuses or fails
(the environment is then as it was).
"""

from __future__ import annotations

import argparse
import json
import sys

from .. import hub
from . import fetch, install_plan, sage_build


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python install.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Attention Dispatch set-up: detect this machine, plan the attention backends, fetch and pin "
                    "the Hub kernels that fit.",
        epilog="Simulated machines: " + ", ".join(install_plan.SIMULATED) + "\n\nEnvironment: "
               "DIFFUSERS_TRUST_REMOTE_KERNELS=true (allow untrusted publishers), DIFFUSERS_DISABLE_REMOTE_CODE=true "
               "(fetch nothing), ATTN_DISPATCH_KERNEL_LOCK (the lock file), HF_HUB_OFFLINE=1 (cache only), "
               "HF_HUB_CACHE / KERNELS_CACHE (where kernels go), LOCAL_KERNELS (local checkouts win).")
    parser.add_argument("--plan", action="store_true", help="print the plan only: no network, nothing written")
    parser.add_argument("--dry-run", action="store_true",
                        help="show what would be fetched or installed; change nothing")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout (progress on stderr)")
    parser.add_argument("--simulate", metavar="NAME", help="plan for a simulated machine (implies --plan)")
    parser.add_argument("--yes-pip", action="store_true",
                        help="run the pip commands for missing attention packages (never torch)")
    parser.add_argument("--only", metavar="BACKENDS", help="comma-separated backends to fetch / install for")
    parser.add_argument("--build", choices=["sageattention"], metavar="sageattention",
                        help="build SageAttention 2 from source for this GPU's architecture only, verify it through "
                             "the dispatcher, install and record it (needs nvcc matching torch's CUDA; minutes)")
    parser.add_argument("--source", metavar="PATH",
                        help=f"with --build: a checkout of {sage_build.SAGE_REPO} (default: clone it at "
                             f"{sage_build.SAGE_COMMIT[:12]})")
    parser.add_argument("--jobs", type=int, default=None, help="with --build: parallel compile jobs (default: all cores)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out_stream = sys.stderr if args.json else sys.stdout

    def out(line: str) -> None:
        print(line, file=out_stream, flush=True)

    if args.source and not args.build:
        print("install.py: --source goes with --build sageattention", file=sys.stderr)
        return 2
    if args.build:
        result = sage_build.build(args.source, dry_run=args.dry_run, out=out, jobs=args.jobs)
        if args.json:
            print(json.dumps({"build": result.as_dict()}, indent=2, default=str))
        return 0 if result.status in ("built", "dry-run") else 1

    machine = None
    if args.simulate is not None:  # '' too: an empty name is a mistake, never "this machine"
        try:
            machine = install_plan.simulated(args.simulate)
        except ValueError as exc:
            print(f"install.py: {exc}", file=sys.stderr)
            return 2
    only = {n.strip() for n in args.only.split(",") if n.strip()} if args.only else None
    if only:
        from .. import registry
        unknown = sorted(n for n in only if n not in registry.names())
        if unknown:
            print(f"install.py: unknown backend(s) {', '.join(unknown)}; valid: {', '.join(registry.names())}",
                  file=sys.stderr)
            return 2

    document: dict = {"dry_run": args.dry_run, "lock_file": str(hub.lock_path())}
    try:
        plan = install_plan.build(machine, is_cached=fetch.is_cached)
        plan_only = args.plan or machine is not None
        if not args.json:
            out(install_plan.render(plan))
            out("")
        if plan_only:
            if machine is not None and not args.json:
                out(f"{fetch.PREFIX} simulated machine '{args.simulate}': nothing is fetched or installed")
        else:
            pip_results = fetch.install_packages(plan, yes=args.yes_pip, dry_run=args.dry_run, only=only, out=out)
            if args.yes_pip and not args.dry_run and any(r.status == "installed" for r in pip_results):
                plan = install_plan.build(None, is_cached=fetch.is_cached)  # new packages: plan again
            results = fetch.fetch(plan, dry_run=args.dry_run, only=only, out=out)
            document["fetch"] = [r.as_dict() for r in results]
            document["pip"] = [r.as_dict() for r in pip_results]
            if not args.json:
                out(_summary(results, args.dry_run))
        document["plan"] = plan.as_dict()
    except Exception as exc:  # noqa: BLE001  never fail an install, even on our own bug
        message = (f"{fetch.PREFIX} install.py could not finish ({type(exc).__name__}: {exc}); nothing else "
                   "was changed, and the pack still works with PyTorch attention. Run `python -m dispatcher doctor`.")
        print(message, file=sys.stderr)
        document["error"] = message
    if args.json:
        print(json.dumps(document, indent=2, default=str))
    return 0


def _summary(results: list[fetch.FetchResult], dry_run: bool) -> str:
    if not results:
        return f"{fetch.PREFIX} done: nothing to fetch."
    counts: dict[str, int] = {}
    for r in results:
        counts[r.status] = counts.get(r.status, 0) + 1
    text = ", ".join(f"{n} {s}" for s, n in counts.items())
    tail = " (dry run: nothing changed)" if dry_run else ""
    return f"{fetch.PREFIX} done: {text}{tail}. `python -m dispatcher doctor` shows what each backend can do now."

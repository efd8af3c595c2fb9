"""`python -m dispatcher doctor [--json]`: what can run on this machine and why the rest cannot.
`python -m dispatcher bench [--small|--full] [--json PATH] [--png PATH]`: every backend, measured."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__package__ or 'dispatcher'}", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    doctor = commands.add_parser("doctor", help="show every attention backend, available or not and why")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    from .tools import bench as bench_module
    bench = commands.add_parser("bench", help="time every attention backend on common model shapes (or yours)",
                                description=bench_module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_module.add_arguments(bench)
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from .tools.doctor import main as doctor_main
        return doctor_main(as_json=args.json)
    if args.command == "bench":
        return bench_module.main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())

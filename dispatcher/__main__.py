"""`python -m dispatcher doctor [--json]`: what can run on this machine, which backend to use, and why the rest cannot.
`python -m dispatcher bench [--small|--full] [--json PATH] [--png PATH]`: every backend, measured.
(Installed as a library: `attention-dispatch ...` or `python -m attention_dispatch ...`.)"""

from __future__ import annotations

import argparse
import sys

from .tools import command, named


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=command(), description=named(__doc__))
    commands = parser.add_subparsers(dest="command", required=True)
    doctor = commands.add_parser("doctor", help="which attention backend to use here, every backend available or "
                                                "not and why")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    from .tools import bench as bench_module
    bench = commands.add_parser("bench", help="time every attention backend on common model shapes (or yours)",
                                description=named(bench_module.__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
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

"""`python -m dispatcher doctor [--json]`: what can run on this machine and why the rest cannot."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dispatcher", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    doctor = commands.add_parser("doctor", help="show every attention backend, available or not and why")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from .doctor import main as doctor_main
        return doctor_main(as_json=args.json)
    return 2


if __name__ == "__main__":
    sys.exit(main())

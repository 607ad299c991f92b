"""The ``secagg`` command line: ``simulate``, ``train`` and ``budget``.

Each subcommand lives in its own module under ``fl/commands/`` and exposes
``add_parser(subparsers)`` and ``run(args) -> int``. Heavy imports (torch) happen
inside ``run`` so that ``secagg simulate`` works on a core install.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

_COMMANDS = ("simulate", "train", "budget")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="secagg",
        description="Secure aggregation with distributed differential privacy for federations.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _COMMANDS:
        module = importlib.import_module(f"fl.commands.{name}")
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    module = importlib.import_module(f"fl.commands.{args.command}")
    try:
        return int(module.run(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

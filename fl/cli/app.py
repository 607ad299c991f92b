"""The ``secagg`` command line: ``simulate``, ``train``, ``budget``, ``keygen`` and ``broker``.

Each command lives in its own module under ``fl/cli/`` and exposes
``add_parser(subparsers)`` and ``run(args) -> int``. Heavy imports (torch) happen inside
``run`` so that ``secagg simulate`` and ``secagg budget`` work on a core install. What the
commands share (the error shape and exit codes, -v/-q, ``--json``, ``--config RUN.toml``)
is :mod:`fl.cli._common`, applied here to every command.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from collections.abc import Sequence
from importlib import metadata

from fl.cli._common import (
    RUNTIME,
    USAGE,
    HelpFormatter,
    Parser,
    UsageError,
    add_common_options,
    error,
    unknown_options,
    verbosity,
)

_COMMANDS = ("simulate", "train", "budget", "keygen", "broker")
EXAMPLES = {
    None: """examples:
  secagg simulate --clients 20 --drop-rate 0.3 --report round.json
  secagg train --sites 5 --rounds 40 --save-model model.pt
  secagg train --config run.toml --rounds 10      (flags override the file)
  secagg budget --epsilon 4 --delta 1e-5 --sample-rate 0.1 --rounds 40 --json
run `secagg COMMAND --help` for a command's options""",
    "simulate": """examples:
  secagg simulate --clients 20 --drop-rate 0.3 --report round.json
  secagg simulate --inputs vectors/ --output sum.npy --bits 32
  secagg simulate --clients 100 --dim 100000 --drop-rate 0.3 --kill --processes 2""",
    "train": """examples:
  secagg train --sites 5 --rounds 40 --save-model model.pt --report report.json
  secagg train --sites 5 --rounds 30 --dataset ehr --dp distributed --epsilon 4 --delta 1e-5
  secagg train --sites 3 --rounds 10 --dataset digits --model cnn --lr 0.5
  secagg train --sites 4 --rounds 30 --csv visits.csv --patient-column mrn \\
               --label-column readmitted --dp site --epsilon 4
  secagg train --config run.toml --json > report.json
  secagg train --role coordinator --sites 1,2,3 --rounds 40 --dp distributed --epsilon 4 \\
               --broker mqtts://host:8883
  secagg train --role site --site-id 2 --csv visits.csv --patient-column mrn \\
               --label-column readmitted --dp distributed --broker mqtts://site-2@host:8883""",
    "budget": """examples:
  secagg budget --epsilon 4 --delta 1e-5 --sample-rate 0.1 --noise-multiplier 1.1
  secagg budget --epsilon 4 --delta 1e-5 --sample-rate 0.1 --rounds 40 --json""",
    "keygen": """examples:
  secagg keygen --out site-3.key     (writes site-3.key, mode 0600, and site-3.pub)
  secagg train --role site --site-id 3 --signing-key site-3.key --peer-keys federation/ ...""",
    "broker": """examples:
  secagg broker --sites 3 --dir federation/      (writes the credentials, runs the broker)
  secagg broker --sites 1,2,3 --dir federation/ --write-only   (files for Mosquitto too)""",
}


def version() -> str:
    try:
        return metadata.version("secagg")
    except metadata.PackageNotFoundError:  # a source checkout that is not installed
        return "0+unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="secagg", epilog=EXAMPLES[None],
        formatter_class=HelpFormatter,
        description="Secure aggregation with distributed differential privacy for federations.")
    parser.add_argument("--version", action="version", version=f"secagg {version()}",
                        help="print the version and exit")
    add_common_options(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _COMMANDS:
        module = importlib.import_module(f"fl.cli.{name}")
        command = module.add_parser(sub)
        command.epilog = EXAMPLES[name]
        command.formatter_class = HelpFormatter
        add_common_options(command)
    return parser


def _command_index(argv: list[str]) -> int | None:
    for i, token in enumerate(argv):
        if token in _COMMANDS:
            return i
        if not token.startswith("-"):
            return None
    return None


def config_arguments(path: str, command: str, parser: argparse.ArgumentParser) -> list[str]:
    """The options of ``path`` (TOML) as command-line tokens, to go before the user's own
    (later tokens win, so flags override the file); raises :class:`UsageError`."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        raise UsageError("--config needs Python 3.11 or later (tomllib)") from None
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except OSError as exc:
        raise UsageError(f"--config {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"--config {path}: not valid TOML: {exc}") from None
    table = data.get(command, data)
    if not isinstance(table, dict):
        raise UsageError(f"--config {path}: [{command}] must be a table")
    options = {a.dest: a for a in parser._actions if a.option_strings}
    tokens: list[str] = []
    for key, value in table.items():
        if isinstance(value, dict):
            continue  # another command's table
        dest = key.replace("-", "_")
        action = options.get(dest)
        if action is None or dest in ("config", "help"):
            raise UsageError(f"--config {path}: unknown option {key!r} for secagg {command}")
        flag = max(action.option_strings, key=len)
        if isinstance(value, bool):
            if action.nargs != 0:
                raise UsageError(f"--config {path}: {key} takes a value, not true/false")
            if value:
                tokens.append(flag)
        elif isinstance(value, list):
            tokens += [flag, ",".join(str(v) for v in value)]
        elif isinstance(value, (int, float, str)):
            tokens += [flag, str(value)]
        else:
            raise UsageError(f"--config {path}: {key} = {value!r} is not a number, string, "
                             "boolean or list")
    return tokens


def _expand_config(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    at = _command_index(argv)
    if at is None:
        return argv
    command = argv[at]
    rest = argv[at + 1:]
    path = None
    kept: list[str] = []
    skip = False
    for i, token in enumerate(rest):
        if skip:
            skip = False
        elif token == "--config" and i + 1 < len(rest):
            path, skip = rest[i + 1], True
        elif token.startswith("--config="):
            path = token.split("=", 1)[1]
        else:
            kept.append(token)
    if path is None:
        return argv
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [*argv[:at + 1], *config_arguments(path, command, sub.choices[command]), *kept]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    tokens = list(sys.argv[1:] if argv is None else argv)
    at = _command_index(tokens)
    command = tokens[at] if at is not None else "secagg"
    try:
        tokens = _expand_config(tokens, parser)
    except UsageError as exc:
        return error(command, exc, USAGE)
    args, unknown = parser.parse_known_args(tokens)
    if unknown:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices[args.command].error(unknown_options(unknown, sub.choices[args.command]))
    module = importlib.import_module(f"fl.cli.{args.command}")
    try:
        return int(module.run(args))
    except KeyboardInterrupt:
        print(f"secagg {args.command}: interrupted", file=sys.stderr)
        return 130
    except ValueError as exc:  # UsageError, a bad file, a rejected setting
        return error(args.command, exc, USAGE)
    except Exception as exc:  # a runtime failure: one line unless -v
        if verbosity(args) > 0:
            traceback.print_exc()
        return error(args.command, str(exc) or type(exc).__name__, RUNTIME)


if __name__ == "__main__":
    sys.exit(main())

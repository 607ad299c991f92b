"""What every ``secagg`` command shares: one error shape, exit codes, verbosity, progress.

* Errors read ``secagg <cmd>: error: <what to change>`` on stderr, whatever raised them:
  exit 2 for a usage error (a bad option or file, :class:`UsageError`, ``ValueError``),
  1 for a runtime failure (an unreachable broker, a round that keeps aborting). A user
  error never prints a traceback; ``-v`` adds one for runtime failures.
* ``-q`` / ``-v`` / ``--log-level`` set how much goes to stderr: progress lines are INFO.
* ``--json`` prints exactly one JSON object on stdout (:func:`emit_json`); progress and
  errors stay on stderr, so ``secagg <cmd> --json | jq`` always parses.

``fl.cli.app`` applies this to every command; a command's ``run`` may also call
:func:`error` itself and return its code.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import logging
import math
import signal
import sys
from collections.abc import Iterator
from typing import Any, NoReturn

from ..errors import FLError

USAGE, RUNTIME = 2, 1
LEVELS = ("debug", "info", "warning", "error")


class UsageError(FLError, ValueError):
    """A bad option, option combination or input file: exit 2, no traceback."""


SUGGEST = {
    "--data": "--csv PATH (your own table) or --dataset NAME (a built-in one)",
    "--data-file": "--csv PATH (your own table)",
    "--file": "--csv PATH (your own table)",
}
"""Options users reach for that the commands do not have, and the ones they mean."""


def unknown_options(tokens: list[str], parser: argparse.ArgumentParser) -> str:
    """The message for ``tokens`` ``parser`` did not recognise: each unknown option with the
    option it most likely meant (:data:`SUGGEST`, then close spellings)."""
    known = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    for token in tokens:
        name = token.split("=", 1)[0]
        if not name.startswith("--"):
            continue
        meant = SUGGEST.get(name)
        if meant is not None and meant.split()[0] not in known:
            meant = None  # another command's option
        close = [o for o in known if o.startswith(name)] or difflib.get_close_matches(
            name, known, n=2, cutoff=0.75)
        if meant or close:
            hints.append(f"{name}: did you mean {meant or ' or '.join(close)}?")
    return (f"unrecognized arguments: {' '.join(tokens)}"
            + (f" ({'; '.join(hints)})" if hints else ""))


class Parser(argparse.ArgumentParser):
    """argparse with the CLI's one error path: a bad option is one line on stderr naming
    the option and what to change (no usage dump), exit 2. Options are never abbreviated
    (``--data`` is not ``--dataset``): an unknown one is an error that names the likely
    option (:func:`unknown_options`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr,
              flush=True)
        raise SystemExit(USAGE)


class HelpFormatter(argparse.HelpFormatter):
    """Wraps descriptions; keeps an epilog of examples as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("examples:"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def _number(text: str, kind: type, low: float | None, low_open: bool, high: float | None,
            what: str) -> Any:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: need {what}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text}: need {what} (a finite number)")
    too_low = low is not None and (value <= low if low_open else value < low)
    if too_low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"{text}: need {what}")
    return value


def nonnegative_int(text: str) -> int:
    """An argparse type: an integer >= 0 (argparse names the option and exits 2)."""
    return int(_number(text, int, 0, False, None, "a non-negative integer"))


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    return int(_number(text, int, 1, False, None, "a positive integer"))


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    return float(_number(text, float, 0.0, True, None, "a number above 0"))


def nonnegative_float(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    return float(_number(text, float, 0.0, False, None, "a number at least 0"))


def parse_sites(value: str | None, role: str) -> tuple[int, ...]:
    """``--sites``: a count S (ids 1..S) or a comma-separated list of site ids."""
    if value is None:
        if role == "site":
            return ()
        raise ValueError(f"--role {role} needs --sites")
    text = value.strip()
    try:
        if "," not in text:
            count = int(text)
            if count < 2:
                raise ValueError(f"--sites {value}: need at least 2 sites")
            return tuple(range(1, count + 1))
        ids = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        if "--sites" in str(exc):
            raise
        raise ValueError(f"--sites {value}: give a number or ids like 1,2,3") from None
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise ValueError(f"--sites {value}: site {repeated[0]} is listed twice; list each "
                         "site once")
    outside = [i for i in ids if not 1 <= i < 1 << 32]
    if outside:
        raise ValueError(f"--sites {value}: site id {outside[0]} is outside 1..2**32-1")
    if len(ids) < 2:
        raise ValueError(f"--sites {value}: need at least 2 sites")
    if role == "all" and ids != tuple(range(1, len(ids) + 1)):
        raise ValueError(f"--sites {value}: --role all numbers its sites 1..S; give S")
    return tuple(sorted(ids))


def error(command: str, message: object, code: int = USAGE) -> int:
    """Print ``secagg <command>: error: <message>`` on stderr; returns ``code``."""
    print(f"secagg {command}: error: {message}", file=sys.stderr, flush=True)
    return code


def add_common_options(parser: argparse.ArgumentParser, *, top: bool = False) -> None:
    """``-v``/``-q``/``--log-level`` (and, under a command, ``--config``)."""
    default = 0 if top else argparse.SUPPRESS  # a command's flags refine the top's
    group = parser.add_argument_group("messages on stderr")
    group.add_argument("-v", "--verbose", dest="verbosity", action="count", default=default,
                       help="more detail on stderr: -v debug messages and tracebacks of "
                            "runtime failures")
    group.add_argument("-q", "--quiet", dest="verbosity", action="store_const", const=-1,
                       default=default, help="no progress on stderr, only warnings and errors")
    group.add_argument("--log-level", choices=LEVELS, default=argparse.SUPPRESS,
                       help="set the stderr level directly (info: progress, the default)")
    if not top:
        parser.add_argument("--config", metavar="RUN.toml", default=argparse.SUPPRESS,
                            help="read options from a TOML file (its [<command>] table, or "
                                 "its top-level keys); flags on the command line override it")


def verbosity(args: argparse.Namespace) -> int:
    """-1 quiet, 0 progress (default), 1 and more debug."""
    level = getattr(args, "log_level", None)
    if level is not None:
        return {"debug": 1, "info": 0, "warning": -1, "error": -1}[level]
    return int(getattr(args, "verbosity", 0) or 0)


class CurrentStderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is when a record is emitted, not to the stream
    that was ``sys.stderr`` when logging was set up: a command run in-process (a notebook,
    a test capturing its output) leaves no handler on a stream that was closed since."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:  # StreamHandler.__init__ assigns it
        pass


def setup_logging(args: argparse.Namespace, tag: str) -> None:
    level = {1: logging.DEBUG, 0: logging.WARNING, -1: logging.ERROR}[
        max(-1, min(1, verbosity(args)))]
    if getattr(args, "log_level", None) == "info":
        level = logging.INFO
    handler = CurrentStderrHandler()
    handler.setFormatter(logging.Formatter(f"[{tag}] %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    if verbosity(args) < 1:  # paho's connection chatter repeats what the error says
        logging.getLogger("mqtt").setLevel(logging.ERROR)


def progress_log(args: argparse.Namespace, tag: str) -> Any:
    """A ``log(text)`` that prints ``[tag] text`` on stderr unless ``-q``."""
    quiet = verbosity(args) < 0

    def log(text: str) -> None:
        if not quiet:
            print(f"[{tag}] {text}", file=sys.stderr, flush=True)

    return log


def emit_json(data: Any) -> None:
    """One JSON object on stdout (NaN/inf become null: strict JSON parsers accept it)."""
    print(json.dumps(_finite(data)), flush=True)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM reached a command that runs :func:`stop_signals` (``signum``)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """SIGINT and SIGTERM raise :class:`Stopped` while the block runs, even in a process
    started in the background (where the shell leaves SIGINT ignored and Python then does
    not raise ``KeyboardInterrupt``); the previous handlers come back after."""
    def stop(signum: int, frame: object) -> None:
        raise Stopped(signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)

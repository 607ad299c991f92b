"""A newcomer's command line: every bad value is refused before any work starts, in one
line on stderr that names the option and says what to change, with exit code 2, and no
library warning or traceback reaches the terminal (issue: front doors)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _secagg(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fl.cli", *argv], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


def _one_line_error(done: subprocess.CompletedProcess[str], option: str) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert len(lines) == 1 and "Traceback" not in done.stderr and "Warning" not in done.stderr, \
        done.stderr
    assert option in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(("argv", "option"), [
    (["simulate", "--seed", "-1"], "--seed"),
    (["simulate", "--seed", "x"], "--seed"),
    (["train", "--sites", "1,1,2,3"], "site 1 is listed twice"),
    (["train", "--sites", "3", "--rounds", "1", "--batch-size", "0"], "--batch-size"),
    (["train", "--sites", "3", "--rounds", "1", "--lr", "nan"], "--lr"),
    (["train", "--sites", "3", "--rounds", "1", "--lr", "-1"], "--lr"),
    (["train", "--sites", "3", "--rounds", "1", "--alpha", "0"], "--alpha"),
    (["train", "--sites", "3", "--rounds", "x"], "--rounds"),
    (["train", "--sites", "3", "--rounds", "1", "--seed", "-1"], "--seed"),
    (["simulate", "--threshold", "0"], "--threshold"),
    (["broker", "--sites", "2", "--dir", "/proc/no-such-dir", "--write-only"], "/proc"),
])
def test_a_bad_value_is_refused_before_any_work_naming_its_option(argv: list[str],
                                                                   option: str) -> None:
    _one_line_error(_secagg(*argv), option)


def test_a_suggested_value_is_one_the_parser_accepts() -> None:
    line = _one_line_error(_secagg("simulate", "--clients", "10", "--neighbors", "2"),
                           "--neighbors")
    assert "None" not in line and "drop --neighbors" in line


def test_budget_says_one_line_without_a_library_warning() -> None:
    done = _secagg("budget", "--epsilon", "0.01", "--delta", "1e-5", "--sample-rate", "0.9",
                   "--rounds", "3000")
    line = _one_line_error(done, "epsilon")
    assert "raise epsilon" in line


@pytest.mark.parametrize(("argv", "meant"), [
    (["train", "--sites", "3", "--rounds", "1", "--data", "visits.csv"], "--csv PATH"),
    (["train", "--sites", "3", "--rounds", "1", "--data=visits.csv"], "--csv PATH"),
    (["simulate", "--client", "3"], "--clients"),
    (["budget", "--epsilon", "4", "--delta", "1e-5", "--sample-rate", "0.1", "--rounds", "3",
      "--acc", "prv"], "--accountant"),
])
def test_an_abbreviated_or_unknown_option_is_refused_naming_the_one_meant(
        argv: list[str], meant: str) -> None:
    """Options are never abbreviated (``--data visits.csv`` once became ``--dataset`` and
    failed on the value): an unknown option is refused before any work, with the option
    the user most likely meant (``--data`` -> ``--csv``, a prefix -> the full option)."""
    line = _one_line_error(_secagg(*argv), argv[-2].split("=")[0] if "=" not in argv[-1]
                           else "--data")
    assert "unrecognized arguments" in line and f"did you mean {meant}" in line


def test_an_epsilon_that_protects_nothing_is_said_to() -> None:
    """``--epsilon 1e9`` plans (per-site noise about 1e-4) but says, before the plan, that
    such a bound protects nothing; an ordinary budget says nothing of the kind."""
    pytest.importorskip("torch")
    plan = ["train", "--sites", "3", "--rounds", "2", "--dp", "distributed", "--delta",
            "1e-5", "--plan", "--epsilon"]
    huge = _secagg(*plan, "1e9")
    assert huge.returncode == 0, huge.stderr
    assert "warning: --epsilon 1e+09 protects nothing" in huge.stderr
    usual = _secagg(*plan, "4")
    assert usual.returncode == 0 and "protects nothing" not in usual.stderr

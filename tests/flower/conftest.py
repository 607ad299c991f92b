"""The Flower adapter's tests need the ``flower`` extra; on a core install they are not
collected (the header of the pytest run says so) and the rest of the suite runs."""

from __future__ import annotations

import importlib.util
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


def _have_flwr() -> bool:
    try:
        return importlib.util.find_spec("flwr") is not None
    except (ImportError, ValueError):
        return False


if not _have_flwr():
    collect_ignore_glob = ["*.py"]

    def pytest_report_header() -> str:
        return ("tests/flower not collected: flwr is not installed "
                "(pip install -e '.[flower]' -c constraints.txt)")


@pytest.fixture(autouse=True)
def _own_stage_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """In-process nodes keep their forward-only stage records (fl.flower.guard) and their
    privacy ledgers (default ``$XDG_STATE_HOME/secagg``) per test."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))  # the nodes' ledgers
    yield

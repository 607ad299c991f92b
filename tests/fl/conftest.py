"""Shared fixtures of the fl tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _site_state_in_tmp(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
                       ) -> Path:
    """A site process started by a test without ``--ledger`` keeps its privacy ledger
    under ``$XDG_STATE_HOME/secagg`` (fl/cli/train.py ``default_ledger``): point it at
    a temporary directory so no test writes to the user's home. Child processes inherit
    the variable."""
    state = tmp_path_factory.mktemp("xdg-state")
    monkeypatch.setenv("XDG_STATE_HOME", str(state))
    return state

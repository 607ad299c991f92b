"""Suite-wide guards: no test leaves a logging handler behind.

A command run in-process (``fl.cli.main([...])``, the broker's ``main``) configures the root
logger; a handler it leaves on a stream that the test's capture closed afterwards made every
later log record print a "--- Logging error ---" traceback (97 of them once, from the broker's
``_refuse`` under the login-flood test, which kept that test running for 20 minutes).

And OpenMP's idle threads sleep instead of spinning (``OMP_WAIT_POLICY=PASSIVE``, unless the
environment says otherwise). With torch's default of one thread per core, every parallel
region of a tiny model waits for a thread that a busy host has not scheduled while the
waiting threads spin on the cores it needs: on this 2-core machine at load 10 a 62-parameter
``index_add_`` took 140 ms instead of 0.05 ms, and tests/fl/test_private_scaler.py's
18 trainings 71 s instead of 19 s. Measured again at load 6-9 (other jobs; alone, runs
alternated): that file's breast-cancer training 24.6 s and 13.7 s with PASSIVE, 31.4 s and
32.8 s without; tests/fl/test_multiprocess_training.py's SCAFFOLD across processes 65.8 s
and 56.0 s with, 72.2 s and 44.3 s without (noise): it does not cost. The thread count
itself is left alone (tests must pass with any), only how idle threads wait; it is set
here, before any test module imports torch (the OpenMP runtime reads it when torch loads),
and the subprocesses the tests start inherit it."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(autouse=True)
def _own_state_home(tmp_path_factory: pytest.TempPathFactory,
                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test's sites and nodes keep their default ledgers (``$XDG_STATE_HOME/secagg``)
    in a folder of the test's own, as do the processes it starts. Before, the tests that set
    none wrote to the user's ``~/.local/state/secagg`` (464 files here), and runs of the
    suite at once shared those ledgers, which admit one process each (dp/ledger.py): in
    three runs at once the slow-link benchmark's coordinator heard none of its sites in
    300 s. A test that sets its own folder overrides this one."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in root.handlers:
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    for handler in handlers:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(level)

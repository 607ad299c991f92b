"""Suite-wide guards: no test leaves a logging handler behind.

A command run in-process (``fl.cli.main([...])``, the broker's ``main``) configures the root
logger; a handler it leaves on a stream that the test's capture closed afterwards made every
later log record print a "--- Logging error ---" traceback (97 of them once, from the broker's
``_refuse`` under the login-flood test, which kept that test running for 20 minutes)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


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

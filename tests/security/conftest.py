"""Security review suite: attack metadata for the generated report.

Every test in this folder carries ``@threat(...)`` (see ``adversary.threat``). This hook
copies the metadata, and the reason of a strict ``documented_limitation`` xfail, into the
test's ``user_properties``, which ``--junitxml`` writes as ``<property>`` elements;
``scripts/security_report.py`` reads them from there.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "threat(attack, adversary, controls, protocol, mode, shows): a row of the "
        "attack table in docs/security.md")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/security/" not in item.nodeid.replace("\\", "/"):
            continue
        mark = item.get_closest_marker("threat")
        if mark is None:
            continue
        for key in ("attack", "adversary", "controls", "protocol", "mode", "shows"):
            item.user_properties.append((f"threat.{key}", str(mark.kwargs.get(key, ""))))
        xfail = item.get_closest_marker("xfail")
        if xfail is not None:
            item.user_properties.append(("threat.known", str(xfail.kwargs.get("reason", ""))))


# the step-by-step round driver of tests/secagg (read-only reuse)
_SECAGG_TESTS = str(Path(__file__).resolve().parent.parent / "secagg")
if _SECAGG_TESTS not in sys.path:
    sys.path.append(_SECAGG_TESTS)

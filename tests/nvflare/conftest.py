"""The NVFlare runtime's tests need the ``nvflare`` extra (``pip install 'secagg[nvflare]'``);
without it every test module here skips (``pytest.importorskip("nvflare")`` at its top) and
the rest of the suite runs."""

from __future__ import annotations

import importlib.util


def pytest_report_header() -> str | None:
    if importlib.util.find_spec("nvflare") is None:
        return "tests/nvflare skipped: nvflare is not installed (pip install 'secagg[nvflare]')"
    return None

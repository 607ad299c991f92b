"""The NVFlare runtime's tests need the ``nvflare`` extra
(``pip install -e '.[nvflare]' -c constraints.txt``); without it every test module here
skips (``pytest.importorskip("nvflare.apis")`` at its top: with ``tests/`` on ``sys.path``
this very folder is a namespace package ``nvflare``, so the check names a module only the
real NVFlare has) and the rest of the suite runs."""

from __future__ import annotations

import importlib.util


def _have_nvflare() -> bool:
    try:
        return importlib.util.find_spec("nvflare.apis") is not None
    except ImportError:
        return False


def pytest_report_header() -> str | None:
    if not _have_nvflare():
        return ("tests/nvflare skipped: nvflare is not installed "
                "(pip install -e '.[nvflare]' -c constraints.txt)")
    return None

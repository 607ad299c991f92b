"""The ``secagg`` command line: ``main`` (fl/cli/app.py) parses, dispatches to one module
per command (``simulate``, ``train``, ``budget``, ``keygen``, ``broker``) and is the one
error path: a bad option or value is one line naming it, exit 2; a runtime failure one line,
exit 1 (a traceback only with ``-v``)."""

from .app import main

__all__ = ["main"]

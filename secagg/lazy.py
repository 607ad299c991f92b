"""Front doors that import a name on first use (PEP 562), for the names behind an optional
extra or a module a layer's import should not load: ``import fl`` and ``import dp`` need no
torch, ``import transport`` does not load the broker's command line."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``names[name]`` on first use and
    keeps it in the package: a submodule (``".units"``) whose attribute of the same name is
    exported, or ``".module:attribute"`` to export that attribute under ``name``. Any other
    name is an ``AttributeError``, as for a module without one."""

    def __getattr__(name: str) -> Any:
        where = names.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, attribute = where.partition(":")
        value = getattr(importlib.import_module(module, package), attribute or name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__

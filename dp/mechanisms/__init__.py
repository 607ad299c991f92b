"""The integer noise mechanisms of distributed DP, found by name (:mod:`dp.mechanisms.base`).

Each module of this package defines one :class:`~dp.mechanisms.base.IntegerMechanism` and
registers it; importing the package imports every one of them, so a new mechanism is one new
module here (plus its tests), and every caller (encoding, bit width, accounting, the audit
export, site policies, round setups) finds it by the name a round carries.
"""

from __future__ import annotations

import importlib
import pkgutil

from dp.errors import PrivacyConfigError
from dp.mechanisms.base import I64, IntegerMechanism, register, registered, unregister
from dp.randomness import RandomSource

for _info in pkgutil.iter_modules(__path__):
    if _info.name != "base" and not _info.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_info.name}")


def mechanism(name: object) -> IntegerMechanism:
    """The registered mechanism called ``name``; an unknown name raises
    :class:`PrivacyConfigError` listing the known ones."""
    found = registered().get(name) if isinstance(name, str) else None
    if found is None:
        raise PrivacyConfigError(f"mechanism must be one of {names()}, got {name!r}")
    return found


def names() -> tuple[str, ...]:
    """The names of the registered mechanisms (what ``mechanism`` fields may say)."""
    return tuple(registered())


def sample_noise(name: str, variance: float, n: int, source: RandomSource | None = None
                 ) -> I64:
    """``n`` draws of one site's share of mechanism ``name`` with the given variance."""
    return mechanism(name).sample(variance, n, source)


__all__ = ["IntegerMechanism", "mechanism", "names", "register", "registered",
           "sample_noise", "unregister"]

"""Privacy modes as objects: one class per mode, one registry from its wire name.

A round's privacy mode decides four things, and each :class:`PrivacyMode` owns all four,
for every runtime:

* **encode** (:meth:`PrivacyMode.encode`): a site's rows and weight -> the integers it
  masks; before that, what a site computes (:meth:`PrivacyMode.update`: the site role's
  training, ``secagg train``) or sends from its trained arrays (:meth:`PrivacyMode.reply`:
  the Flower and NVFlare runtimes, :mod:`fl.round_setup`);
* **decode** (:meth:`PrivacyMode.decode`): the sum -> the mean and its count, divided by the
  number of sites in the sum when each site adds one row (the runtimes' round setup), by
  the noisy unit count when each sampled unit adds one (the site role's distributed DP);
* **proposal** (:meth:`PrivacyMode.proposal`): what the site's policy and ledger are asked
  to admit (:func:`fl.site.core.site_proposal`, the site session's gate);
* **event** (:meth:`PrivacyMode.lone`, :meth:`PrivacyMode.released`): the DP event the
  site's ledger charges (its own noise share only when the roster is the server's word;
  the replace-one sensitivity of a runtime's one clipped row).

The registry maps the wire value (``mode`` in both :class:`fl.contribution.RoundTask` and
:class:`fl.round_setup.RoundSetup`) to the object: :func:`privacy_mode`. The three built-in
modes are :data:`dp.policy.MODES`; a new mode is one subclass and :func:`register`
(tests/fl/test_modes.py registers one from a test).

The shared part of both round descriptions, the encoding, is :class:`SumEncoding`, and its
distributed-DP parameters go to and from the wire through :func:`encoding_fields` and
:func:`read_encoding` only.

The folder: ``base.py`` (the interface, :class:`SumEncoding`), ``builtin.py`` (the three
modes), ``wire.py`` (the encoding's reader and writer), this front door (the registry).
Nothing here imports torch, a runtime or the coordinator (the site imports this module).
"""

from __future__ import annotations

from collections.abc import Callable

from fl.modes.base import (
    Grouping,
    ModeError,
    PrivacyMode,
    Release,
    Rows,
    SiteDpRelease,
    SumEncoding,
    Task,
    Trainer,
    cap_units,
    counted_count_stddev,
    local_seed,
    own_share,
)
from fl.modes.builtin import DistributedDp, NoDp, SiteDp
from fl.modes.wire import ENCODING_KEYS, DpSpec, encoding_fields, read_encoding

__all__ = ["BUILT_IN", "ENCODING_KEYS", "DistributedDp", "DpSpec", "Grouping", "ModeError",
           "NoDp", "PrivacyMode", "Release", "Rows", "SiteDp", "SiteDpRelease", "SumEncoding",
           "Task", "Trainer", "cap_units", "counted_count_stddev", "encoding_fields",
           "local_seed", "mode_names", "own_share", "privacy_mode", "read_encoding",
           "register", "unregister"]

# -- the registry ---------------------------------------------------------------------------

_REGISTRY: dict[str, PrivacyMode] = {}


def register(mode: PrivacyMode) -> PrivacyMode:
    """Make ``mode`` known by its ``name`` to both round descriptions (a name taken by
    another mode is a ``ValueError``)."""
    known = _REGISTRY.get(mode.name)
    if known is not None and known is not mode:
        raise ValueError(f"privacy mode {mode.name!r} is already registered")
    _REGISTRY[mode.name] = mode
    return mode


def unregister(name: str) -> None:
    """Forget a mode :func:`register` added (a built-in mode stays)."""
    if name in BUILT_IN:
        raise ValueError(f"privacy mode {name!r} is built in")
    _REGISTRY.pop(name, None)


def mode_names(*, in_setup: bool = False) -> tuple[str, ...]:
    """The registered modes' wire names (``in_setup``: those a runtime's setup runs)."""
    return tuple(name for name, mode in _REGISTRY.items() if mode.in_setup or not in_setup)


def privacy_mode(name: str, error: Callable[[str], Exception] = ModeError) -> PrivacyMode:
    """The mode registered as ``name``; ``error(message)`` is raised for an unknown one."""
    mode = _REGISTRY.get(name)
    if mode is None:
        raise error(f"privacy mode {name!r}: use one of {mode_names()}")
    return mode


BUILT_IN = tuple(register(mode).name for mode in (NoDp(), SiteDp(), DistributedDp()))
"""The built-in modes, :data:`dp.policy.MODES` in its order."""

"""The interface of an integer noise mechanism of distributed DP, and its registry.

A mechanism is one object that owns everything the package needs to know about it (after
Opacus' accountant registry, ``opacus.accountants.registry``, where an accountant is found
by name): how a site samples its share (:meth:`IntegerMechanism.sample`), how far the noise
of the summed shares reaches (:meth:`IntegerMechanism.tail_bound`, which the bit width of the
modular sum is chosen from), below which per-site stddev it has no privacy bound
(:attr:`IntegerMechanism.min_stddev`), its per-step Renyi DP (:meth:`IntegerMechanism.rdp_fn`,
which :mod:`dp.distributed` subsamples and composes) and its description as a
dp-accounting ``ZCDpEvent`` for the audit export (:meth:`IntegerMechanism.zcdp`).

Every caller finds a mechanism by the name a round carries (``EncodingParams.mechanism``,
the wire's ``mechanism`` field, a site policy's ``mechanisms``) through :func:`mechanism`;
:mod:`dp.mechanisms` registers the built-in ones, each in its own module.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from dp.errors import PrivacyConfigError
from dp.randomness import RandomSource

I64 = npt.NDArray[np.int64]


class IntegerMechanism(ABC):
    """An integer noise distribution whose sum over sites is the release's noise.

    ``sigma`` below is one site's standard deviation in the integer domain (the update's
    ``scale * noise_stddev``), ``threshold`` the fewest summed shares (the noise is
    calibrated to them), sensitivities are one unit's rounded vector in the integer domain.
    """

    name: ClassVar[str]
    """The name a round, a wire message and a site policy carry (``"dgauss"``)."""
    title: ClassVar[str]
    """What a report calls it (``"distributed discrete Gaussian"``)."""
    min_stddev: ClassVar[float] = 0.0
    """The smallest per-site integer stddev its privacy bound holds for (a round below it
    has no bound: its RDP is infinite, so it never fits a budget)."""

    @abstractmethod
    def sample(self, variance: float, n: int, source: RandomSource | None = None) -> I64:
        """``n`` independent draws of one site's share of the given variance."""

    @abstractmethod
    def tail_bound(self, variance: float, log_term: float) -> float:
        """``a`` with ``P[|X| > a] <= 2 exp(-log_term)`` for one coordinate of the sum ``X``
        of the shares, whose total variance is ``variance`` (the encoding's bit width holds
        it, :func:`dp.distributed.choose_bits`)."""

    @abstractmethod
    def rdp_fn(self, l2: float, l1: float, sigma: float, threshold: int, dim: int
               ) -> Callable[[int], float]:
        """Per-step, unsubsampled RDP of ``threshold`` summed shares, by integer order."""

    @abstractmethod
    def zcdp(self, l2: float, l1: float, sigma: float, threshold: int, dim: int
             ) -> tuple[float, float]:
        """``(rho, xi)``: the same release as approximate zCDP (a dp-accounting
        ``ZCDpEvent``, :mod:`dp.audit`); its RDP is at most ``xi + rho * order``."""


_REGISTRY: dict[str, IntegerMechanism] = {}


def register(mech: IntegerMechanism) -> IntegerMechanism:
    """Make ``mech`` findable by its name; a name already taken raises
    :class:`PrivacyConfigError` (two mechanisms must not answer to one name)."""
    name = getattr(mech, "name", None)
    if not isinstance(mech, IntegerMechanism) or not isinstance(name, str) or not name:
        raise PrivacyConfigError(f"register an IntegerMechanism with a name, got {mech!r}")
    if name in _REGISTRY and _REGISTRY[name] is not mech:
        raise PrivacyConfigError(f"a mechanism named {name!r} is already registered")
    _REGISTRY[name] = mech
    return mech


def unregister(name: str) -> None:
    """Forget the mechanism ``name`` (a test's own mechanism, after the test)."""
    _REGISTRY.pop(name, None)


def registered() -> dict[str, IntegerMechanism]:
    """The registered mechanisms by name, in registration order (a copy)."""
    return dict(_REGISTRY)

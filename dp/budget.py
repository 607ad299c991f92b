"""A privacy budget fixed before training and never exceeded (docs/architecture.md section 6).

A round is described by an event; the budget answers whether it still fits
(:meth:`PrivacyBudget.can_run`), records it (:meth:`PrivacyBudget.spend`, which refuses a
round that would overshoot by raising :class:`dp.errors.BudgetExceeded`, leaving the budget
unchanged) and reports the spent ``(epsilon, delta)`` after every round.

Events: :class:`GaussianRound` (site mode, or a central sampled Gaussian), and
:class:`RdpRound` (any mechanism given by its RDP curve, e.g. the distributed discrete
Gaussian or Skellam from :func:`dp.distributed.round_rdp`, or the adaptive-clipping count).
The budget composes with a registered accountant (:func:`dp.accounting.get_accountant`):
with ``"rdp"`` everything composes by adding RDP curves (Mironov 2017, Prop. 1); with
``"prv"`` (Opacus' PRV accountant) or ``"pld"`` (dp-accounting's) only Gaussian rounds.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np

from dp.accounting import (
    F64,
    ORDERS,
    adaptive_clip_noise_multiplier,
    epsilon_of_history,
    gaussian_rdp,
    get_accountant,
    rdp_to_epsilon,
)
from dp.errors import BudgetExceeded, PrivacyConfigError


@functools.lru_cache(maxsize=256)
def _gaussian_step_rdp(noise_multiplier: float, sample_rate: float) -> F64:
    """One step's RDP curve (RDP composes additively, so steps multiply it)."""
    curve = gaussian_rdp(noise_multiplier, sample_rate, 1)
    curve.setflags(write=False)
    return curve


@dataclass(frozen=True)
class GaussianRound:
    """``steps`` steps of the sampled Gaussian mechanism (noise multiplier, sample rate).

    With ``count_stddev`` every step also releases the centred adaptive-clipping count on the
    same sample (Andrew et al. 2021): the pair is one Gaussian mechanism with the
    :attr:`effective_noise_multiplier` (Thm. 1).
    """

    noise_multiplier: float
    sample_rate: float
    steps: int = 1
    count_stddev: float | None = None

    def __post_init__(self) -> None:
        if not self.noise_multiplier > 0:
            raise PrivacyConfigError(f"noise_multiplier must be > 0, got {self.noise_multiplier}")
        if not 0 < self.sample_rate <= 1:
            raise PrivacyConfigError(f"sample_rate must be in (0, 1], got {self.sample_rate}")
        if self.steps < 1:
            raise PrivacyConfigError(f"steps must be >= 1, got {self.steps}")
        if self.count_stddev is not None and not self.count_stddev > 0:
            raise PrivacyConfigError(f"count_stddev must be > 0, got {self.count_stddev}")

    @property
    def effective_noise_multiplier(self) -> float:
        if self.count_stddev is None:
            return self.noise_multiplier
        return adaptive_clip_noise_multiplier(self.noise_multiplier, self.count_stddev)

    def rdp(self) -> F64:
        return _gaussian_step_rdp(self.effective_noise_multiplier, self.sample_rate) * self.steps


@dataclass(frozen=True)
class RdpRound:
    """A round given by its RDP at :data:`dp.accounting.ORDERS` (already composed over steps).

    ``spec`` optionally describes the mechanism (JSON-able pairs) for the audit export
    (:mod:`dp.audit`).
    """

    rdp_curve: tuple[float, ...]
    label: str = "rdp"
    spec: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if len(self.rdp_curve) != len(ORDERS):
            raise PrivacyConfigError(f"rdp_curve must have {len(ORDERS)} entries (ORDERS)")

    @classmethod
    def from_array(cls, rdp: F64, label: str = "rdp",
                   spec: dict[str, float] | None = None) -> RdpRound:
        return cls(tuple(float(x) for x in rdp), label,
                   tuple(sorted((spec or {}).items())))

    def rdp(self) -> F64:
        return np.asarray(self.rdp_curve, dtype=np.float64)


Event = GaussianRound | RdpRound
R_contra = TypeVar("R_contra", contravariant=True)


class Budget(Protocol[R_contra]):
    """The one spend signature of every budget: :class:`PrivacyBudget` (a run's, per
    :class:`Event`), :class:`dp.idp.GroupLedger` (a site's rate groups, per number of
    DP-SGD steps) and the coordinator's patient-idp budget (``fl.site.idp``, per round).

    ``spend(release)`` records the release and returns the spent ``(epsilon, delta)``, or
    raises :class:`dp.errors.BudgetExceeded` and records nothing; ``can_run(release)`` asks
    the same question without recording."""

    @property
    def spent(self) -> tuple[float, float]: ...

    def can_run(self, release: R_contra, /) -> bool: ...

    def spend(self, release: R_contra, /) -> tuple[float, float]: ...


@dataclass
class PrivacyBudget(Budget[Event]):
    """``(epsilon, delta)`` per unit (patient by default), fixed at construction."""

    epsilon: float
    delta: float
    accountant: str = "rdp"
    _events: list[Event] = field(default_factory=list, init=False, repr=False)
    _rdp: F64 = field(default_factory=lambda: np.zeros(len(ORDERS)), init=False, repr=False)
    _spent: float = field(default=0.0, init=False, repr=False)

    def __post_init__(self) -> None:
        if not (self.epsilon > 0 and math.isfinite(self.epsilon)):
            raise PrivacyConfigError(f"epsilon must be a positive number, got {self.epsilon}")
        if not 0 < self.delta < 1:
            raise PrivacyConfigError(
                f"delta must be in (0, 1), e.g. below 1/number of patients; got {self.delta}"
            )
        self.accountant = get_accountant(self.accountant).name

    # -- queries -------------------------------------------------------------------------
    @property
    def spent(self) -> tuple[float, float]:
        """``(epsilon, delta)`` spent so far (delta is the fixed target once anything ran)."""
        return (self._spent, self.delta if self._events else 0.0)

    @property
    def remaining(self) -> float:
        return max(0.0, self.epsilon - self._spent)

    @property
    def rounds(self) -> int:
        return len(self._events)

    def epsilon_after(self, event: Event) -> float:
        """The epsilon that would be spent if ``event`` ran next."""
        if self._adds_rdp:  # the curves add: the cost does not grow with history
            return self._epsilon_of([], self._rdp + event.rdp())
        return self._epsilon_of([*self._events, event], None)

    def copy(self) -> PrivacyBudget:
        """An independent budget that has spent what this one has."""
        other = PrivacyBudget(self.epsilon, self.delta, self.accountant)
        other._events, other._rdp, other._spent = list(self._events), self._rdp.copy(), self._spent
        return other

    @property
    def _adds_rdp(self) -> bool:
        return get_accountant(self.accountant).composes_rdp

    def can_run(self, event: Event) -> bool:
        return self.epsilon_after(event) <= self.epsilon

    # -- spending ------------------------------------------------------------------------
    def spend(self, event: Event) -> tuple[float, float]:
        """Record ``event`` and return the new spent ``(epsilon, delta)``.

        Raises :class:`BudgetExceeded` (and records nothing) if it would overshoot.
        """
        rdp = self._rdp + event.rdp() if self._adds_rdp else None
        after = self._epsilon_of([] if rdp is not None else [*self._events, event], rdp)
        if not after <= self.epsilon:
            raise BudgetExceeded(
                f"this round would bring epsilon to {after:.4g} > budget {self.epsilon:.4g} "
                f"(spent {self._spent:.4g} over {self.rounds} rounds); stop training, or "
                "raise the noise multiplier / lower the sample rate for the remaining rounds",
                epsilon_limit=self.epsilon, epsilon_after=after,
            )
        self._events.append(event)
        if rdp is not None:
            self._rdp = rdp
        self._spent = after
        return self.spent

    def _epsilon_of(self, events: list[Event], rdp: F64 | None) -> float:
        if rdp is not None:
            return rdp_to_epsilon(rdp, self.delta)
        history = []
        for e in events:
            if not isinstance(e, GaussianRound):
                raise PrivacyConfigError(
                    f"the {self.accountant.upper()} accountant only composes Gaussian rounds; "
                    "use accountant='rdp' for distributed (discrete Gaussian / Skellam) rounds"
                )
            history.append((e.effective_noise_multiplier, e.sample_rate, e.steps))
        return epsilon_of_history(history, self.delta, self.accountant)


# --- persistence (checkpoints, site ledgers) -------------------------------------------
def event_to_json(event: Event) -> dict[str, Any]:
    if isinstance(event, GaussianRound):
        data: dict[str, Any] = {"kind": "gaussian", "noise_multiplier": event.noise_multiplier,
                                "sample_rate": event.sample_rate, "steps": event.steps}
        if event.count_stddev is not None:
            data["count_stddev"] = event.count_stddev
        return data
    return {"kind": "rdp", "label": event.label, "rdp_curve": list(event.rdp_curve),
            "spec": dict(event.spec)}


def event_from_json(data: dict[str, Any]) -> Event:
    """The inverse of :func:`event_to_json`; a malformed record raises PrivacyConfigError."""
    try:
        if data["kind"] == "gaussian":
            count = data.get("count_stddev")
            return GaussianRound(float(data["noise_multiplier"]), float(data["sample_rate"]),
                                 int(data["steps"]),
                                 None if count is None else float(count))
        spec = {str(k): float(v) for k, v in dict(data.get("spec") or {}).items()}
        return RdpRound(tuple(float(x) for x in data["rdp_curve"]), str(data["label"]),
                        tuple(sorted(spec.items())))
    except (KeyError, TypeError, ValueError) as exc:
        raise PrivacyConfigError(f"not a privacy event record: {exc}") from None

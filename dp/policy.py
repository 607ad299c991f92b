"""The site's own privacy policy and ledger (docs/architecture.md section 9: the site is
sovereign over its privacy; docs/privacy.md section 1).

The coordinator *proposes* each release (a training round, or feature statistics); the site
checks the proposal against the :class:`SitePolicy` its operator set (flags or a policy file,
never the coordinator) and against its :class:`Ledger`, and refuses with
:class:`PolicyRefused` naming the rule that would break. The site computes the privacy cost
itself from the proposed parameters (:class:`Proposal` builds the event; nothing the
coordinator says about epsilon is believed).

The ledger is write-ahead: :meth:`Ledger.charge` writes the release's cost durably (fsync,
atomic rename) *before* the site computes or sends the input that makes the release
possible, so a crash at any later point never leaves a release uncounted. A charge may be
withdrawn (:meth:`Ledger.withdraw`) only while the input provably never left the site (the
round moved on before the site sent anything). Every attempt whose input was sent stays
charged, whether or not the coordinator says the round completed: a dishonest coordinator
could claim an abort and decode anyway.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from dp.budget import Event, GaussianRound, PrivacyBudget, event_from_json, event_to_json
from dp.errors import LedgerWriteError, PrivacyConfigError, PrivacyError

MODES = ("none", "site", "distributed")
MECHANISMS = ("gaussian", "dgauss", "skellam")
UNITS = ("patient", "record", "patient-idp")
"""The privacy units a site's policy can name: whose data one unit of sensitivity covers
(``patient-idp``: the patient, by individual per-record sampling rates per rate group,
:mod:`dp.idp`; accounted per group)."""
LEDGER_FORMAT = 1


class PolicyRefused(PrivacyError):
    """A proposed release breaks the site's policy; ``rule`` names the rule (a
    :class:`SitePolicy` field name such as ``"unit"``, ``"budget"`` or
    ``"exact-release"``)."""

    def __init__(self, rule: str, message: str, *, private: bool = False) -> None:
        super().__init__(f"refused by site policy [{rule}]: {message}")
        self.rule = rule
        self.public = (f"refused by site policy [{rule}]: the site's own plan for this "
                       "proposal breaks the rule (details in the site's log)"
                       if private else str(self))
        """What the site tells the coordinator: without the numbers when they come from
        the site's private plan (``unit="patient-idp"``: its rate groups depend on its
        patients' records and budgets)."""


@dataclass(frozen=True)
class Proposal:
    """One release a coordinator asks the site to take part in, as the site sees it.

    ``noise_multiplier`` is the Gaussian-equivalent central noise multiplier (noise stddev
    over the unit's sensitivity) that any ``calibration_threshold`` summed sites carry;
    ``secagg_threshold`` is the fewest sites the secure sum can be decoded from; ``unit``:
    the privacy unit the release is computed over (one unit's data is clipped together).
    """

    kind: str
    mode: str
    mechanism: str | None
    noise_multiplier: float
    sample_rate: float
    steps: int
    clip_norm: float | None
    calibration_threshold: int | None
    secagg_threshold: int
    event: Event | None
    label: str = ""
    unit: str = "patient"
    groups: tuple[tuple[str, float, Event], ...] = ()
    """``unit="patient-idp"``: ``(group key, target epsilon, event)`` per rate group of the
    site's plan (each group's patients' cost; ``event`` is then None)."""
    patients: str = ""
    """``unit="patient-idp"``: which patient is in which group
    (:meth:`dp.idp.PatientGroups.digest`)."""

    @classmethod
    def site_idp(cls, plan: Any, *, steps: int, secagg_threshold: int, label: str = "",
                 patients: str = "") -> Proposal:
        """Site mode under ``--unit patient-idp``: ``steps`` steps of the *site's own*
        :class:`dp.idp.IdpPlan` (its rate groups from its own table, grouped as
        ``patients`` says); every group is charged its own event
        (:meth:`dp.idp.IdpPlan.group_events`)."""
        events = plan.group_events(steps) if steps >= 1 else []
        groups = tuple((g.key, g.target_epsilon, e)
                       for g, e in zip(plan.groups, events, strict=True))
        return cls("train", "site", "gaussian", plan.noise_multiplier,
                   max(g.sample_rate for g in plan.groups), steps,
                   max(g.clip_norm for g in plan.groups), None, secagg_threshold, None, label,
                   "patient-idp", groups, patients)

    @classmethod
    def site_dp(cls, *, noise_multiplier: float, sample_rate: float, steps: int,
                clip_norm: float, secagg_threshold: int, count_stddev: float | None = None,
                label: str = "", unit: str = "patient") -> Proposal:
        """Site mode: ``steps`` DP-SGD steps at the site (optionally adaptive clipping)."""
        event = None
        z = noise_multiplier
        if z > 0 and 0 < sample_rate <= 1 and steps >= 1:
            event = GaussianRound(z, sample_rate, steps, count_stddev)
            z = event.effective_noise_multiplier
        return cls("train", "site", "gaussian", z, sample_rate, steps, clip_norm, None,
                   secagg_threshold, event, label, unit)

    @classmethod
    def distributed(cls, params: Any, *, sample_rate: float, secagg_threshold: int,
                    label: str = "", kind: str = "train", unit: str = "patient") -> Proposal:
        """Distributed mode: one noisy secure sum of ``params`` (:class:`EncodingParams`);
        ``kind="scaler"``: the noised feature statistics (fl/private_scaler.py)."""
        from dp.audit import distributed_event
        from dp.distributed import effective_noise_multiplier

        z = effective_noise_multiplier(params) if params.noise_stddev > 0 else 0.0
        event = distributed_event(params, sample_rate) if 0 < sample_rate <= 1 else None
        return cls(kind, "distributed", params.mechanism, z, sample_rate, 1,
                   params.clip_norm, params.threshold, secagg_threshold, event, label, unit)

    @classmethod
    def exact(cls, kind: str, *, secagg_threshold: int, label: str = "") -> Proposal:
        """An exact (un-noised) secure sum: a ``--dp none`` round, or feature statistics."""
        return cls(kind, "none", None, 0.0, 1.0, 1, None, None, secagg_threshold, None, label)


@dataclass(frozen=True)
class SitePolicy:
    """What this site agrees to release, set by its operator.

    ``modes`` lists the privacy modes the site takes part in. ``"none"`` (an exact sum: a
    ``--dp none`` round, exact feature statistics) is an explicit opt-in of the operator
    (``--dp none`` on the site role, or a policy file listing it): the default policy
    releases nothing exact.
    ``unit``: the privacy unit the operator's budget is about (``patient``, the package's
    default, or ``record``); a release computed over another unit is refused, since with
    ``record`` one patient's k records add up to k times the sensitivity.
    ``min_noise_multiplier``: the Gaussian-equivalent noise multiplier floor;
    ``min_threshold``: the fewest sites the noise is calibrated to and the secure sum can be
    decoded from; ``max_sample_rate``, ``max_steps`` (DP-SGD steps per release),
    ``max_clip_norm``, ``max_releases`` (releases the ledger will ever record);
    ``epsilon``/``delta``: this site's budget per patient (``epsilon=None``: no cap, still
    accounted and reported).
    """

    modes: tuple[str, ...] = ("site", "distributed")
    mechanisms: tuple[str, ...] = MECHANISMS
    min_noise_multiplier: float = 0.0
    min_threshold: int = 2
    max_sample_rate: float = 1.0
    max_steps: int | None = None
    max_clip_norm: float | None = None
    max_releases: int | None = None
    epsilon: float | None = None
    delta: float = 1e-5
    unit: str = "patient"

    def __post_init__(self) -> None:
        problems = []
        if not self.modes or set(self.modes) - set(MODES):
            problems.append(f"modes must be among {MODES}, got {self.modes}")
        if self.unit not in UNITS:
            problems.append(f"unit must be one of {UNITS}, got {self.unit!r}")
        if not self.mechanisms or set(self.mechanisms) - set(MECHANISMS):
            problems.append(f"mechanisms must be among {MECHANISMS}, got {self.mechanisms}")
        if not (self.min_noise_multiplier >= 0 and math.isfinite(self.min_noise_multiplier)):
            problems.append(f"min_noise_multiplier must be >= 0, got "
                            f"{self.min_noise_multiplier}")
        if self.min_threshold < 1:
            problems.append(f"min_threshold must be >= 1, got {self.min_threshold}")
        if not 0 < self.max_sample_rate <= 1:
            problems.append(f"max_sample_rate must be in (0, 1], got {self.max_sample_rate}")
        for name in ("max_steps", "max_releases"):
            value = getattr(self, name)
            if value is not None and value < 1:
                problems.append(f"{name} must be >= 1, got {value}")
        if self.max_clip_norm is not None and not self.max_clip_norm > 0:
            problems.append(f"max_clip_norm must be > 0, got {self.max_clip_norm}")
        if self.epsilon is not None and not (self.epsilon > 0 and math.isfinite(self.epsilon)):
            problems.append(f"epsilon must be a positive number, got {self.epsilon}")
        if not 0 < self.delta < 1:
            problems.append(f"delta must be in (0, 1), e.g. 1e-5, got {self.delta}")
        if problems:
            raise PrivacyConfigError("site policy: " + "; ".join(problems))

    @property
    def requires_dp(self) -> bool:
        return "none" not in self.modes

    # -- files --------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["modes"], data["mechanisms"] = list(self.modes), list(self.mechanisms)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SitePolicy:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise PrivacyConfigError(f"site policy: unknown keys {unknown}; known: "
                                     f"{sorted(names)}")
        values = dict(data)
        for key in ("modes", "mechanisms"):
            if key in values:
                values[key] = tuple(str(v) for v in values[key])
        try:
            return cls(**values)
        except TypeError as exc:
            raise PrivacyConfigError(f"site policy: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> SitePolicy:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise PrivacyConfigError(f"site policy file {path}: {exc}") from None
        if not isinstance(data, dict):
            raise PrivacyConfigError(f"site policy file {path}: expected a JSON object")
        return cls.from_json(data)

    # -- the rules ------------------------------------------------------------------------
    def check(self, p: Proposal) -> None:
        """Raise :class:`PolicyRefused` naming the first rule ``p`` breaks (the budget and
        ``max_releases`` are the ledger's: :meth:`Ledger.charge`)."""
        # Noised feature statistics are a distributed release in any DP mode of training.
        noised_statistics = p.kind == "scaler" and p.mode != "none" and self.requires_dp
        if p.mode not in self.modes and not noised_statistics:
            if p.mode == "none":
                raise PolicyRefused("exact-release", f"this site requires differential "
                                    f"privacy ({'/'.join(self.modes)}) and does not release "
                                    f"an exact {p.kind} sum")
            raise PolicyRefused("modes", f"mode {p.mode!r} is not among this site's "
                                f"{list(self.modes)}")
        if p.secagg_threshold < self.min_threshold:
            raise PolicyRefused("min_threshold", f"the secure sum could be decoded from "
                                f"{p.secagg_threshold} sites; this site needs at least "
                                f"{self.min_threshold}")
        if p.mode == "none":
            return
        if p.unit != self.unit:
            raise PolicyRefused("unit", f"the release is computed per {p.unit}; this site's "
                                f"budget is per {self.unit} (its operator's --unit)")
        if p.mechanism not in self.mechanisms:
            raise PolicyRefused("mechanisms", f"mechanism {p.mechanism!r} is not among "
                                f"this site's {list(self.mechanisms)}")
        if (p.event is None and not p.groups) or not p.noise_multiplier > 0:
            raise PolicyRefused("min_noise_multiplier", "the proposed round adds no noise "
                                "(or has no valid privacy bound)")
        private = p.unit == "patient-idp"  # noise, rates and clip from the site's own plan
        if p.noise_multiplier < self.min_noise_multiplier:
            raise PolicyRefused("min_noise_multiplier", f"noise multiplier "
                                f"{p.noise_multiplier:.4g} < this site's floor "
                                f"{self.min_noise_multiplier:g}", private=private)
        if p.calibration_threshold is not None:
            if p.calibration_threshold < self.min_threshold:
                raise PolicyRefused("min_threshold", f"the noise is calibrated to "
                                    f"{p.calibration_threshold} sites; this site needs at "
                                    f"least {self.min_threshold}")
            if p.secagg_threshold < p.calibration_threshold:
                raise PolicyRefused("min_threshold", f"the sum could be decoded from "
                                    f"{p.secagg_threshold} sites but the noise is calibrated "
                                    f"to {p.calibration_threshold}: fewer survivors would "
                                    "carry less noise than accounted")
        if p.kind != "train":  # the ceilings below are on training rounds
            return
        if p.sample_rate > self.max_sample_rate:
            raise PolicyRefused("max_sample_rate", f"sample rate {p.sample_rate:g} > this "
                                f"site's ceiling {self.max_sample_rate:g}", private=private)
        if self.max_steps is not None and p.steps > self.max_steps:
            raise PolicyRefused("max_steps", f"{p.steps} steps per round > this site's "
                                f"ceiling {self.max_steps}")
        if (self.max_clip_norm is not None and p.clip_norm is not None
                and p.clip_norm > self.max_clip_norm):
            raise PolicyRefused("max_clip_norm", f"clip norm {p.clip_norm:g} > this site's "
                                f"ceiling {self.max_clip_norm:g}", private=private)


@dataclass(frozen=True)
class Charge:
    """One ledger entry: a release this site made possible, and what it cost."""

    id: int
    label: str
    kind: str
    mode: str
    mechanism: str | None
    noise_multiplier: float
    sample_rate: float
    steps: int
    event: dict[str, Any] | None
    epsilon_after: float
    at: float
    withdrawn: str | None = None
    unit: str | None = None
    """The privacy unit of the release (None in ledgers written before it was recorded)."""
    groups: list[dict[str, Any]] | None = None
    """``unit="patient-idp"``: per rate group its key, target, event and epsilon after."""
    patients: str | None = None
    """``unit="patient-idp"``: the grouping the groups' spending belongs to."""


@dataclass
class Ledger:
    """The site's persistent record of every release (JSON at ``path``, write-ahead).

    Opening a ledger takes an exclusive lock on ``path + ".lock"`` (one site process per
    ledger); :meth:`close` releases it.
    """

    path: Path
    policy: SitePolicy
    charges: list[Charge] = field(default_factory=list)
    _lock: Any = field(default=None, repr=False)

    @classmethod
    def open(cls, path: str | Path, policy: SitePolicy) -> Ledger:
        path = Path(path)
        if not path.parent.is_dir():
            raise PrivacyConfigError(f"privacy ledger {path}: its directory does not exist")
        ledger = cls(path, policy)
        ledger._lock = _lock_file(path.with_name(path.name + ".lock"))
        try:
            ledger.charges = _read(path)
        except BaseException:
            ledger.close()
            raise
        return ledger

    def close(self) -> None:
        if self._lock is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock)
            self._lock = None

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- queries --------------------------------------------------------------------------
    def active(self) -> Iterator[Charge]:
        return (c for c in self.charges if c.withdrawn is None)

    def budget(self) -> PrivacyBudget:
        """Everything charged so far, composed (RDP; it composes every mechanism)."""
        cap = sys.float_info.max if self.policy.epsilon is None else self.policy.epsilon
        budget = PrivacyBudget(cap, self.policy.delta)
        for c in self.active():
            if c.event is not None:
                budget.spend(event_from_json(c.event))
        return budget

    def group_budgets(self) -> dict[str, PrivacyBudget]:
        """Per rate group (``patient-idp`` charges): everything its patients were charged,
        composed (the releases charged to every patient, then the group's own events)."""
        common = [event_from_json(c.event) for c in self.active() if c.event is not None]
        out: dict[str, PrivacyBudget] = {}
        for c in self.active():
            for g in c.groups or ():
                if g["group"] not in out:
                    out[g["group"]] = PrivacyBudget(sys.float_info.max, self.policy.delta)
                    for event in common:
                        out[g["group"]].spend(event)
                out[g["group"]].spend(event_from_json(g["event"]))
        return out

    @property
    def epsilon(self) -> float:
        """This site's epsilon: the largest of any patient's (a rate group's, if any)."""
        return max([self.budget().spent[0],
                    *(b.spent[0] for b in self.group_budgets().values())])

    @property
    def releases(self) -> int:
        return sum(1 for _ in self.active())

    # -- the write-ahead record -------------------------------------------------------------
    def charge(self, proposal: Proposal) -> Charge:
        """Check ``proposal`` against the policy and the budget, then record its cost
        durably; only after this returns may the site compute and send its input."""
        self.policy.check(proposal)
        if self.policy.max_releases is not None and self.releases >= self.policy.max_releases:
            raise PolicyRefused("max_releases", f"this site already took part in "
                                f"{self.releases} releases (its ceiling)")
        budget = self.budget()
        after = budget.spent[0]
        if proposal.groups and any(c.groups and c.patients != proposal.patients
                                   for c in self.active()):
            raise PolicyRefused("budget", "this site's patients are grouped differently from "
                                "its ledger's earlier patient-idp releases (another table?): "
                                "their spending cannot be matched group by group; keep the "
                                "table this ledger was kept for")
        groups = self._charge_groups(proposal, budget) if proposal.groups else None
        if groups is not None:
            after = max(g["epsilon_after"] for g in groups)
        if proposal.event is not None:
            after = budget.epsilon_after(proposal.event)
            if not math.isfinite(after):
                raise PolicyRefused("min_noise_multiplier", "the proposed round has no finite "
                                    "privacy bound (e.g. a discrete Gaussian share below 1/2)")
            if self.policy.epsilon is not None and not after <= self.policy.epsilon:
                raise PolicyRefused("budget", f"this release would bring this site's "
                                    f"epsilon to {after:.4g} > its budget "
                                    f"{self.policy.epsilon:g} (spent {budget.spent[0]:.4g} "
                                    f"over {self.releases} releases)")
            # A release charged to every patient also counts for the ledger's rate groups
            # (a ledger that went on under another unit): none may pass its target.
            spent = self.group_budgets()
            for key, target in self._targets().items():
                after = max(after, self._within(spent[key].epsilon_after(proposal.event),
                                                target))
        entry = Charge(len(self.charges) + 1, proposal.label, proposal.kind, proposal.mode,
                       proposal.mechanism, proposal.noise_multiplier, proposal.sample_rate,
                       proposal.steps,
                       None if proposal.event is None else event_to_json(proposal.event),
                       after, time.time(), unit=None if proposal.mode == "none" else
                       proposal.unit, groups=groups,
                       patients=proposal.patients if groups else None)
        self._write([*self.charges, entry])
        self.charges.append(entry)
        return entry

    def _targets(self) -> dict[str, float]:
        """Every rate group of the ledger's (active) charges and its target epsilon."""
        return {g["group"]: float(g["target_epsilon"]) for c in self.active()
                for g in c.groups or ()}

    def _within(self, after: float, target: float) -> float:
        """``after`` if a rate group may reach it (its target and the site's budget), else
        the refusal, which names no group: it goes to the coordinator."""
        cap = target if self.policy.epsilon is None else min(target, self.policy.epsilon)
        if not after <= cap:
            raise PolicyRefused("budget", "this release would take the patients of one of "
                                "this site's rate groups past their target epsilon (the "
                                "groups' spending is in the site's ledger)")
        return after

    def _charge_groups(self, proposal: Proposal, budget: PrivacyBudget
                       ) -> list[dict[str, Any]]:
        """Every rate group's epsilon after ``proposal`` (refused if any passes its target);
        a group new to the ledger starts from what every patient was charged (``budget``)."""
        spent = self.group_budgets()
        return [{"group": key, "target_epsilon": target, "event": event_to_json(event),
                 "epsilon_after": self._within(spent.get(key, budget).epsilon_after(event),
                                               target)}
                for key, target, event in proposal.groups]

    def withdraw(self, charge: Charge, reason: str) -> None:
        """Undo ``charge`` -- only when its input never left the site."""
        updated = [c if c.id != charge.id else _withdrawn(c, reason) for c in self.charges]
        self._write(updated)
        self.charges = updated

    def _write(self, charges: list[Charge]) -> None:
        """Replace the ledger file with ``charges``, durably; :class:`LedgerWriteError`
        (naming the file, nothing changed) when the disk refuses."""
        data = {"format": LEDGER_FORMAT, "policy": self.policy.to_json(),
                "charges": [asdict(c) for c in charges]}
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            with open(tmp, "w", encoding="utf-8") as handle:
                handle.write(json.dumps(data, indent=1) + "\n")
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise LedgerWriteError(
                f"cannot write the privacy ledger {self.path}: {exc.strerror or exc}; "
                "nothing is released until it can be (free space on its disk)") from None
        with contextlib.suppress(OSError):  # make the rename itself durable
            fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _withdrawn(c: Charge, reason: str) -> Charge:
    from dataclasses import replace

    return replace(c, withdrawn=reason)


def _read(path: Path) -> list[Charge]:
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format") != LEDGER_FORMAT:
            raise ValueError(f"unknown format {data.get('format')!r}")
        charges = [Charge(**c) for c in data["charges"]]
        for c in charges:
            if c.event is not None:
                event_from_json(c.event)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise PrivacyConfigError(f"privacy ledger {path} is unreadable ({exc}); it is the "
                                 "site's record of what it released: restore it from a "
                                 "backup rather than deleting it") from None
    return charges


def _lock_file(path: Path) -> int:
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise PrivacyConfigError(f"privacy ledger {path.with_suffix('')} is in use by another "
                                 "process: one site process per ledger") from None
    return fd

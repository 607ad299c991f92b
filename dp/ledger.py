"""The site's write-ahead privacy ledger (docs/architecture.md section 9; the rules it
enforces with the budget are :class:`dp.policy.SitePolicy`).

The ledger is write-ahead: :meth:`Ledger.charge` checks a :class:`dp.policy.Proposal`
against the policy and the budget and writes the release's cost durably (fsync, atomic
rename) *before* the site computes or sends the input that makes the release possible, so
a crash at any later point never leaves a release uncounted. A charge may be withdrawn
(:meth:`Ledger.withdraw`) only while the input provably never left the site (the round
moved on before the site sent anything). Every attempt whose input was sent stays charged,
whether or not the coordinator says the round completed: a dishonest coordinator could
claim an abort and decode anyway.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dp.budget import PrivacyBudget, event_from_json, event_to_json
from dp.errors import LedgerWriteError, PrivacyConfigError
from dp.policy import PolicyRefused, Proposal, SitePolicy

LEDGER_FORMAT = 1


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

"""The site's write-ahead privacy ledger (docs/architecture.md section 9; the rules it
enforces with the budget are :class:`dp.policy.SitePolicy`).

The ledger is write-ahead: :meth:`Ledger.charge` checks a :class:`dp.policy.Proposal`
against the policy and the budget and writes the release's cost durably (fsync) *before*
the site computes or sends the input that makes the release possible, so a crash at any
later point never leaves a release uncounted. A charge may be withdrawn
(:meth:`Ledger.withdraw`) only while the input provably never left the site (the round
moved on before the site sent anything). Every attempt whose input was sent stays charged,
whether or not the coordinator says the round completed: a dishonest coordinator could
claim an abort and decode anyway.

The file is an append-only log of JSON lines (format 2): a header
``{"format": 2, "policy": ...}``, then one record a line -- ``{"charge": {...}}`` (its
``epsilon_after`` is the running total the charge brought the site to),
``{"withdraw": id, "reason": ...}``, or ``{"policy": ...}`` when the site starts under
another policy. A charge appends one line and the composed totals are kept in memory, so
its cost does not grow with the ledger (``benchmarks/bench_ledger.py``). A crash while a
line is written leaves a torn last line: that record was never acknowledged (``charge``
had not returned, so nothing was computed or sent on it), and opening the ledger cuts it;
a damaged line anywhere else is refused. A format-1 ledger (one JSON document) is read and
rewritten as format 2 by the next charge or withdrawal.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from dp.budget import PrivacyBudget, event_from_json, event_to_json
from dp.errors import LedgerWriteError, PrivacyConfigError
from dp.policy import MODE_NONE, PolicyRefused, Proposal, SitePolicy

LEDGER_FORMAT = 2


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
    """The site's persistent record of every release (JSON lines at ``path``, write-ahead).

    Opening a ledger takes an exclusive lock on ``path + ".lock"`` (one site process per
    ledger); :meth:`close` releases it.
    """

    path: Path
    policy: SitePolicy
    charges: list[Charge] = field(default_factory=list)
    _lock: Any = field(default=None, repr=False)
    _size: int = field(default=0, repr=False)
    """Bytes of whole records in the file (where the next record goes)."""
    _format: int = field(default=LEDGER_FORMAT, repr=False)
    _logged_policy: dict[str, Any] | None = field(default=None, repr=False)
    _totals: _Totals | None = field(default=None, repr=False)
    _newline: bool = field(default=False, repr=False)
    """The last record's newline is missing (written before the next record)."""
    _by_id: dict[int, int] = field(default_factory=dict, repr=False)
    """Each charge's position in :attr:`charges`, by its id."""
    _active: dict[int, None] = field(default_factory=dict, repr=False)
    """The ids of the active charges, in order."""
    _keys: set[str] = field(default_factory=set, repr=False)
    """Every round key a charge's label names (:func:`label_keys`), withdrawn ones too."""

    @classmethod
    def open(cls, path: str | Path, policy: SitePolicy) -> Ledger:
        path = Path(path)
        if not path.parent.is_dir():
            raise PrivacyConfigError(f"privacy ledger {path}: its directory does not exist")
        ledger = cls(path, policy)
        ledger._lock = _lock_file(path.with_name(path.name + ".lock"))
        try:
            read = _read(path)
            ledger._size = read.size
            for charge in read.charges:
                ledger._add(charge)
            ledger._format, ledger._logged_policy = read.format, read.policy
            ledger._newline = read.unterminated
            if read.torn:
                _cut(path, read.size)
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

    def _add(self, charge: Charge) -> None:
        """``charge`` at the end of :attr:`charges`, and in the indexes."""
        self._by_id[charge.id] = len(self.charges)
        self.charges.append(charge)
        if charge.withdrawn is None:
            self._active[charge.id] = None
        self._keys.update(label_keys(charge.label))

    # -- queries --------------------------------------------------------------------------
    def active(self) -> Iterator[Charge]:
        return (self.charges[self._by_id[i]] for i in list(self._active))

    def get(self, charge_id: int) -> Charge | None:
        """The charge ``charge_id`` (active or withdrawn), None if the ledger has none."""
        at = self._by_id.get(charge_id)
        return None if at is None else self.charges[at]

    def holds_key(self, key: str) -> bool:
        """Whether a charge (active or withdrawn) names round key ``key`` at the end of its
        label (``"... [key <key>]"``, :func:`fl.site.session.label_of`); constant time."""
        return key in self._keys

    @property
    def _running(self) -> _Totals:
        """The composed totals of the active charges, kept as charges are added."""
        if self._totals is None:
            self._totals = _Totals(self.policy)
            for c in self.active():
                self._totals.add(c)
        return self._totals

    def budget(self) -> PrivacyBudget:
        """Everything charged so far, composed (RDP; it composes every mechanism)."""
        return self._running.common.copy()

    def group_budgets(self) -> dict[str, PrivacyBudget]:
        """Per rate group (``patient-idp`` charges): everything its patients were charged,
        composed (the releases charged to every patient, then the group's own events)."""
        return {k: b.copy() for k, b in self._running.groups.items()}

    @property
    def epsilon(self) -> float:
        """This site's epsilon: the largest of any patient's (a rate group's, if any)."""
        return self._running.epsilon()

    @property
    def releases(self) -> int:
        return self._running.releases

    # -- the write-ahead record -------------------------------------------------------------
    def charge(self, proposal: Proposal) -> Charge:
        """Check ``proposal`` against the policy and the budget, then record its cost
        durably; only after this returns may the site compute and send its input."""
        self.policy.check(proposal)
        running = self._running
        if self.policy.max_releases is not None and running.releases >= self.policy.max_releases:
            raise PolicyRefused("max_releases", f"this site already took part in "
                                f"{running.releases} releases (its ceiling)")
        budget = running.common
        after = budget.spent[0]
        if proposal.groups and running.patients - {proposal.patients}:
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
                                    f"over {running.releases} releases)")
            # A release charged to every patient also counts for the ledger's rate groups
            # (a ledger that went on under another unit): none may pass its target.
            for key, target in running.targets.items():
                after = max(after, self._within(
                    running.groups[key].epsilon_after(proposal.event), target))
        entry = Charge(len(self.charges) + 1, proposal.label, proposal.kind, proposal.mode,
                       proposal.mechanism, proposal.noise_multiplier, proposal.sample_rate,
                       proposal.steps,
                       None if proposal.event is None else event_to_json(proposal.event),
                       after, time.time(), unit=None if proposal.mode == MODE_NONE else
                       proposal.unit, groups=groups,
                       patients=proposal.patients if groups else None)
        self._append({"charge": asdict(entry)})
        self._add(entry)
        running.add(entry)
        return entry

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
        spent = self._running.groups
        return [{"group": key, "target_epsilon": target, "event": event_to_json(event),
                 "epsilon_after": self._within(spent.get(key, budget).epsilon_after(event),
                                               target)}
                for key, target, event in proposal.groups]

    def withdraw(self, charge: Charge, reason: str) -> None:
        """Undo ``charge`` -- only when its input never left the site."""
        at = self._by_id.get(charge.id)
        if at is None:
            raise KeyError(f"charge {charge.id} is not in the privacy ledger {self.path}")
        self._append({"withdraw": charge.id, "reason": reason, "at": time.time()})
        entry = self.charges[at] = replace(self.charges[at], withdrawn=reason)
        if charge.id not in self._active:
            return
        del self._active[charge.id]
        if entry.event is not None or entry.groups:
            self._totals = None  # composed again from the active charges
        elif self._totals is not None:
            self._totals.releases -= 1  # a release with no privacy event: only its count

    # -- the file -----------------------------------------------------------------------------
    def _append(self, record: dict[str, Any]) -> None:
        """``record`` as one line at the end of the log, fsynced (after the header, and a
        policy line when the site runs under another policy than the last one logged)."""
        policy = self.policy.to_json()
        lines = []
        if self._format != LEDGER_FORMAT:  # a format-1 ledger: rewritten once, as a log
            self._rewrite(policy)
        if self._size == 0:
            lines.append({"format": LEDGER_FORMAT, "policy": policy})
        elif policy != self._logged_policy:
            lines.append({"policy": policy})
        lines.append(record)
        data = b"\n" * self._newline + b"".join(_line(x) for x in lines)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                _write_at(fd, data, self._size)
                os.fsync(fd)
            finally:
                os.close(fd)
            if self._size == 0:
                _fsync_dir(self.path.parent)  # the new file's name is durable too
        except OSError as exc:
            raise self._write_error(exc) from None
        self._size += len(data)
        self._logged_policy, self._newline = policy, False

    def _rewrite(self, policy: dict[str, Any]) -> None:
        """The whole ledger as a format-2 log (atomic rename): the migration of a format-1
        file, written once."""
        data = _line({"format": LEDGER_FORMAT, "policy": policy})
        for c in self.charges:
            data += _line({"charge": asdict(replace(c, withdrawn=None))})
            if c.withdrawn is not None:
                data += _line({"withdraw": c.id, "reason": c.withdrawn, "at": c.at})
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                _write_at(fd, data, 0)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
            _fsync_dir(self.path.parent)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise self._write_error(exc) from None
        self._format, self._size, self._logged_policy = LEDGER_FORMAT, len(data), policy
        self._newline = False

    def _write_error(self, exc: OSError) -> LedgerWriteError:
        return LedgerWriteError(
            f"cannot write the privacy ledger {self.path}: {exc.strerror or exc}; "
            "nothing is released until it can be (free space on its disk)")


class _Totals:
    """The active charges composed: every patient's budget, each rate group's, how many
    releases, the groups' targets and groupings. Adding a charge costs the same whatever
    the ledger's length."""

    def __init__(self, policy: SitePolicy) -> None:
        self.delta = policy.delta
        cap = sys.float_info.max if policy.epsilon is None else policy.epsilon
        self.common = PrivacyBudget(cap, policy.delta)
        self.groups: dict[str, PrivacyBudget] = {}
        self.targets: dict[str, float] = {}
        self.patients: set[str | None] = set()
        self.releases = 0

    def add(self, c: Charge) -> None:
        self.releases += 1
        if c.event is not None:
            event = event_from_json(c.event)
            self.common.spend(event)
            for budget in self.groups.values():
                budget.spend(event)
        for g in c.groups or ():
            if g["group"] not in self.groups:
                budget = self.common.copy()
                budget.epsilon = sys.float_info.max
                self.groups[g["group"]] = budget
            self.groups[g["group"]].spend(event_from_json(g["event"]))
            self.targets[g["group"]] = float(g["target_epsilon"])
        if c.groups:
            self.patients.add(c.patients)

    def epsilon(self) -> float:
        return max([self.common.spent[0], *(b.spent[0] for b in self.groups.values())])


@dataclass
class _Read:
    charges: list[Charge]
    size: int
    """Bytes of whole records."""
    format: int
    policy: dict[str, Any] | None
    torn: bool
    """A torn last line follows the whole records (cut on open)."""
    unterminated: bool = False
    """The last record is whole but its newline was not written (the next write adds it)."""


_RECORDS = (b'{"format": ', b'{"charge": ', b'{"withdraw": ', b'{"policy": ')
"""How every line of a format-2 ledger starts (the header first)."""


_KEY = "[key "


def label_keys(label: str) -> set[str]:
    """The round keys ``label`` ends with: every ``k`` for which it ends with ``"[key k]"``
    (what :func:`fl.site.session.label_of` appends)."""
    if not label.endswith("]"):
        return set()
    found, at = set(), label.find(_KEY)
    while at >= 0:
        found.add(label[at + len(_KEY):-1])
        at = label.find(_KEY, at + 1)
    return found


def read_charges(path: str | Path) -> list[Charge]:
    """The charges recorded in the ledger at ``path`` (withdrawn ones too), without taking
    its lock: for audits and reports, not for charging."""
    return _read(Path(path)).charges


def _line(record: dict[str, Any]) -> bytes:
    return json.dumps(record, sort_keys=False).encode() + b"\n"


def _write_at(fd: int, data: bytes, offset: int) -> None:
    """``data`` at ``offset``, and the file ends there (a torn line beyond it is cut)."""
    os.ftruncate(fd, offset)
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # make the new name itself durable
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _cut(path: Path, size: int) -> None:
    """Cut the torn last line of ``path`` (an unacknowledged record) at ``size`` bytes."""
    with contextlib.suppress(OSError):  # a read-only ledger: the next write cuts it
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
        try:
            os.ftruncate(fd, size)
            os.fsync(fd)
        finally:
            os.close(fd)


def _read(path: Path) -> _Read:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return _Read([], 0, LEDGER_FORMAT, None, False)
    except OSError as exc:
        raise _unreadable(path, exc) from None
    with os.fdopen(fd, "rb") as handle:
        raw = handle.read()
    try:
        if raw.startswith(b"{\n"):  # format 1: one JSON document, rewritten at all charges
            return _read_format1(raw)
        return _read_log(raw)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise _unreadable(path, exc) from None


def _unreadable(path: Path, exc: Exception) -> PrivacyConfigError:
    return PrivacyConfigError(f"privacy ledger {path} is unreadable ({exc}); it is the "
                              "site's record of what it released: restore it from a "
                              "backup rather than deleting it")


def _read_format1(raw: bytes) -> _Read:
    data = json.loads(raw)
    if data.get("format") != 1:
        raise ValueError(f"unknown format {data.get('format')!r}")
    charges = [_charge(c) for c in data["charges"]]
    return _Read(charges, len(raw), 1, data.get("policy"), False)


def _read_log(raw: bytes) -> _Read:
    lines = raw.split(b"\n")
    whole, tail = lines[:-1], lines[-1]
    torn = False
    if tail:  # no newline after the last record: a write that never returned
        try:
            json.loads(tail)
            whole.append(tail)  # a complete record (its newline not written): it counts
        except ValueError:
            # Cut only what this module writes, torn: anything else is damage.
            if not tail.startswith(_RECORDS if whole else _RECORDS[:1]):
                raise ValueError("its last line is neither a record nor a torn one") from None
            torn = True
    size = len(raw) - len(tail) if torn else len(raw)
    if not whole:
        return _Read([], 0, LEDGER_FORMAT, None, torn)
    header = json.loads(whole[0])
    if header.get("format") != LEDGER_FORMAT:
        raise ValueError(f"unknown format {header.get('format')!r}")
    policy = header.get("policy")
    charges: list[Charge] = []
    for number, line in enumerate(whole[1:], start=2):
        try:
            record = json.loads(line)
        except ValueError:
            raise ValueError(f"line {number} is damaged (not a torn last line)") from None
        if "charge" in record:
            charge = _charge(record["charge"])
            if charge.id != len(charges) + 1 or charge.withdrawn is not None:
                raise ValueError(f"line {number}: charge {charge.id} out of sequence")
            charges.append(charge)
        elif "withdraw" in record:
            at = int(record["withdraw"]) - 1
            if not 0 <= at < len(charges):
                raise ValueError(f"line {number} withdraws an unknown charge")
            charges[at] = replace(charges[at], withdrawn=str(record["reason"]))
        elif "policy" in record:
            policy = record["policy"]
        else:
            raise ValueError(f"line {number} is not a ledger record")
    return _Read(charges, size, LEDGER_FORMAT, policy, torn, bool(tail) and not torn)


def _charge(data: dict[str, Any]) -> Charge:
    charge = Charge(**data)
    if charge.event is not None:
        event_from_json(charge.event)
    return charge


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

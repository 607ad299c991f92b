"""The site core: what a site guarantees, whatever runtime drives it (docs/architecture.md
section 10, "one site core, thin runtimes").

A hospital's guarantees do not depend on who moves its messages. Every runtime -- the
``secagg train --role site`` process (:mod:`fl.remote.site`), the Flower mod
(:mod:`fl.flower.client`), any later one -- holds one :class:`SiteCore` and asks it, for
every round, *before* the site's data is touched:

1. :meth:`SiteCore.check_protocol`: the secure-aggregation parameters against the site's own
   floors: the threshold floor (``min_threshold``) and the SecAgg+ (k, t) safe for the
   dropout and corrupt rates the site itself assumes (``min_dropout_rate``,
   ``min_corrupt_rate``; ``secagg.secagg_plus_parameters``), never the rates a server states;
2. :meth:`SiteCore.admit`: the release against the operator's :class:`dp.policy.SitePolicy`
   (modes, unit, mechanisms, noise multiplier floor relative to the clip, sample-rate, steps
   and clip ceilings) and the site's budget, charged write-ahead to its
   :class:`dp.ledger.Ledger` before any input is computed or sent.

A runtime adds only its transport and its hooks (the site role withdraws a charge when it can
prove its input never left, :meth:`SiteCore.not_sent`; the Flower node never withdraws). A
check added here holds in every runtime. Nothing here imports torch or a runtime.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dp import (
    MODE_DISTRIBUTED,
    MODE_NONE,
    Charge,
    EncodingParams,
    Ledger,
    LedgerWriteError,
    PolicyRefused,
    PrivacyConfigError,
    Proposal,
    SitePolicy,
    check_delta,
)
from fl.modes import Release, privacy_mode
from secagg.graph import check_pair, complete_graph_threshold

if TYPE_CHECKING:
    from fl.site.idp import SiteIdp


@dataclass(frozen=True)
class SecureSum:
    """A round that releases one secure sum and nothing computed under local DP-SGD: an exact
    sum (``params=None``) or a distributed-DP sum encoded with ``params``. What a runtime
    without the site role's :class:`fl.contribution.RoundTask` proposes (the Flower node)."""

    params: EncodingParams | None = None
    sample_rate: float = 1.0
    unit: str = "patient"
    kind: str = "train"

    @property
    def mode(self) -> str:
        return MODE_NONE if self.params is None else MODE_DISTRIBUTED


def site_proposal(task: Release | None, *, secagg_threshold: int, label: str = "",
                  idp: SiteIdp | None = None) -> Proposal:
    """What a round's task (:class:`fl.contribution.RoundTask`, a :class:`SecureSum`, None for
    the feature statistics' exact sum, a :class:`fl.site.private_scaler.ScalerPlan` for their noised
    sum) asks this site to release, as its policy sees it: its privacy mode's proposal
    (:meth:`fl.modes.PrivacyMode.proposal`). ``idp``: under ``--unit patient-idp`` the site's
    *own* plan and grouping for the task (:class:`fl.site.idp.SiteIdp`), whose rate groups are
    charged each their own cost; without one such a task is refused."""
    if task is None:
        return Proposal.exact("scaler", secagg_threshold=secagg_threshold, label=label)
    return privacy_mode(task.mode, PrivacyConfigError).proposal(
        task, secagg_threshold=secagg_threshold, label=label, idp=idp)


def lone_share(task: Release | None, proposal: Proposal) -> Proposal:
    """``proposal`` as a site must count it when the coordinator alone picks the roster: it
    may fill the round with sites it simulates (zero noise), so only this site's own share
    of a noised round's noise is certain (:meth:`fl.modes.PrivacyMode.lone`). Site-mode
    rounds (each site's update private on its own) and exact sums are unchanged."""
    if task is None:
        return proposal
    return privacy_mode(task.mode, PrivacyConfigError).lone(task, proposal)


def charged_proposal(task: Release | None, *, secagg_threshold: int, label: str = "",
                     idp: SiteIdp | None = None, authenticated: bool = False) -> Proposal:
    """What a site's ledger charges for ``task``: :func:`site_proposal`, counted as
    :func:`lone_share` unless the round's roster is authenticated. The one place both the
    site (:meth:`SiteCore.admit`) and a server reporting the sites' figure compute it."""
    proposal = site_proposal(task, secagg_threshold=secagg_threshold, label=label, idp=idp)
    return proposal if authenticated else lone_share(task, proposal)


class SiteCore:
    """One site's guarantees: its operator's policy, its write-ahead ledger and the protocol
    margins it derives itself (module docstring). Every runtime calls :meth:`check_protocol`
    and :meth:`admit` before it computes the site's input.

    ``authenticated_roster`` (set by the runtime when the round's parties are authenticated
    by keys the site's operator enrolled: the site role with ``--peer-keys``, the Flower
    node in malicious mode with its ``trusted_keys``) is what lets a distributed round count
    the noise of the other sites it is calibrated to; without it every round is charged as
    :func:`lone_share` (docs/privacy.md section 1).

    A refusal is a :class:`dp.policy.PolicyRefused` naming the rule (the site sits the round
    out). ``num_units`` (the site's patients) only feeds the delta warning.
    """

    def __init__(self, ledger: Ledger, log: Callable[[str], object] | None = None,
                 num_units: int | None = None) -> None:
        self.ledger = ledger
        self.log = log or (lambda text: None)
        self.pending: dict[Hashable, tuple[Charge, int]] = {}
        self.authenticated_roster = False
        warning = check_delta(ledger.policy.delta, num_units) if num_units else None
        if warning:
            self.log(f"warning: {warning}")

    @property
    def policy(self) -> SitePolicy:
        return self.ledger.policy

    def check_protocol(self, *, num_clients: int, threshold: int, neighbors: int | None,
                       security: str) -> None:
        """Refuse secure-aggregation parameters below this site's own floors: a threshold
        under ``min_threshold``; on the complete graph a threshold that the corrupt parties
        the site assumes (``min_corrupt_rate``) could reach; under SecAgg+ a (k, t) that is
        not safe at the site's ``min_dropout_rate`` and ``min_corrupt_rate`` (Bell et al.
        2020: ``secagg.graph.check_pair``, whose message names the safe pair). The rates a
        server states are never used here."""
        p = self.policy
        if threshold < p.min_threshold:
            raise PolicyRefused("min_threshold", f"the secure sum could be decoded from "
                                f"{threshold} sites; this site needs at least "
                                f"{p.min_threshold}")
        rates = f"min_dropout_rate={p.min_dropout_rate:g}, min_corrupt_rate={p.min_corrupt_rate:g}"
        if neighbors is None or neighbors >= num_clients:
            low = complete_graph_threshold(num_clients, p.min_corrupt_rate, security)
            if threshold < low:
                raise PolicyRefused("min_corrupt_rate", f"threshold {threshold} of "
                                    f"{num_clients} sites is within reach of the corrupt "
                                    f"parties this site assumes ({rates}); it needs at "
                                    f"least {low}")
            return
        try:
            check_pair(range(num_clients), neighbors, threshold, p.min_dropout_rate,
                       p.min_corrupt_rate, security)
        except ValueError as exc:
            raise PolicyRefused("min_dropout_rate", f"SecAgg+ parameters below this site's "
                                f"own margins ({rates}): {exc}") from None

    def admit(self, task: Release | None, *, secagg_threshold: int, label: str,
              key: Hashable = None, idp: SiteIdp | None = None) -> Charge:
        """Check and charge the round (raises :class:`dp.policy.PolicyRefused`); ``key``
        (the announcement's) lets :meth:`check_go` and :meth:`not_sent` find the charge;
        ``idp``: the site's own plan and grouping under ``--unit patient-idp``."""
        charge = self.ledger.charge(charged_proposal(
            task, secagg_threshold=secagg_threshold, label=label, idp=idp,
            authenticated=self.authenticated_roster))
        if key is not None:
            self.pending = {key: (charge, secagg_threshold)}
        if charge.groups:
            self.log(f"{label}: charged to this site's ledger, per rate group epsilon now "
                     + "; ".join(f"{g['group']}: {g['epsilon_after']:.4g}"
                                 for g in charge.groups))
        elif charge.event is not None:
            self.log(f"{label}: charged to this site's ledger, epsilon now "
                     f"{charge.epsilon_after:.4g}"
                     + (f" of {self.ledger.policy.epsilon:g}"
                        if self.ledger.policy.epsilon is not None else ""))
        return charge

    def check_go(self, key: Hashable, threshold: int) -> None:
        """The round's final secure-aggregation threshold must be the one admitted (a
        coordinator lowering it at ``go`` would decode from fewer sites than calibrated)."""
        _, admitted = self.pending.get(key, (None, threshold))
        if threshold < admitted:
            raise PolicyRefused("min_threshold", f"the round starts with threshold "
                                f"{threshold}, below the {admitted} it was admitted with")

    def not_sent(self, key: Hashable, reason: str) -> None:
        """The input of ``key``'s round never left the site: withdraw its charge (the site
        session's withdrawal rule, :mod:`fl.site.session`)."""
        entry = self.pending.pop(key, None)
        if entry is not None:
            self.withdraw(entry[0].id, reason)

    def withdraw(self, charge: int, reason: str) -> None:
        """Withdraw the ledger's charge ``charge`` (its id) unless already withdrawn; a ledger
        that cannot be written keeps it (conservative, said once)."""
        entry = self.ledger.get(charge)
        if entry is None or entry.withdrawn is not None:
            return
        try:
            self.ledger.withdraw(entry, reason)
        except LedgerWriteError as exc:
            self.log(f"the charge of a round whose input never left stays: {exc}")
            return
        self.log(f"charge {charge} withdrawn: {reason}")

    def close(self) -> None:
        """Release the ledger's lock."""
        self.ledger.close()

    def __enter__(self) -> SiteCore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def state_directory() -> Path:
    """Where a site keeps its ledgers by default: ``$XDG_STATE_HOME/secagg`` (default state
    home ``~/.local/state``), outside any working tree and temporary directory."""
    base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    folder = base / "secagg"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    return folder


def open_site_core(*, policy: SitePolicy, ledger_path: str,
                   log: Callable[[str], object] | None = None,
                   num_units: int | None = None) -> SiteCore:
    """A site's core over the ledger at ``ledger_path`` (created if absent)."""
    if not isinstance(policy, SitePolicy):
        raise PrivacyConfigError(f"a site's policy must be a dp.policy.SitePolicy, got "
                                 f"{type(policy).__name__}")
    return SiteCore(Ledger.open(ledger_path, policy), log, num_units)

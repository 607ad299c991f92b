"""A site's data and what its process computes from a round's blob.

The computation itself is :func:`fl.contribution.site_input`, as in simulation: what a site
computes does not depend on where it runs. This module only checks that the blob is about
this site's table (schema, model size) and validates every task field first, so a hostile
coordinator can make a site refuse a round, never crash it.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from dp import LedgerWriteError, PolicyRefused, PrivacyError
from fl.contribution import RoundTask, SecaggBound, TaskError, scaler_input, secagg_bound
from fl.contribution import site_input as contribution
from fl.data import DataError, Table, csv_schema, load_csv
from fl.models import make_model
from fl.remote.blob import Blob
from fl.remote.messages import Announce, WireError, get_int, get_names, get_str
from fl.settings import MODELS, TrainSettings
from fl.site.core import SiteCore
from fl.site.session import Admitted, Replayed, SiteSession, Terms
from fl.site.training import Scaler, Site

if TYPE_CHECKING:  # the module itself is imported where it is used (site_input)
    from fl.site.private_scaler import ScalerPlan
from fl.vector import ParameterLayout

U64 = npt.NDArray[np.uint64]
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Schema:
    """A table's columns as the federation agrees on them (names only, never values)."""

    features: tuple[str, ...]
    labels: tuple[str, ...]


def dataset_schema(num_features: int, num_classes: int) -> Schema:
    """The schema of a bundled dataset: its columns are positional, its labels 0..c-1."""
    return Schema(tuple(f"x{i}" for i in range(num_features)),
                  tuple(str(c) for c in range(num_classes)))


class SiteData:
    """One hospital's table: a shard of a bundled dataset (demo) or its own CSV."""

    def __init__(self, site_id: int, *, table: Table | None = None, csv: str | None = None,
                 patient_column: str | None = None, label_column: str | None = None,
                 labels: Sequence[str] | None = None, budget_column: str | None = None
                 ) -> None:
        """``labels``: the federation's public label list as the site's operator pinned it
        (``--labels`` on the site role): the site then takes part only in rounds announcing
        exactly that list, a check on public data alone (docs/privacy.md section 1).
        ``budget_column``: the CSV's per-patient epsilon column (``--unit patient-idp``),
        read here, never a feature and never announced."""
        self.site_id = site_id
        self._csv = csv
        self._columns = (patient_column or "", label_column or "")
        self._budget_column = budget_column
        self._tables: dict[tuple[str, ...], Table] = {}
        self.control: Any = None
        """``--strategy scaffold``: this site's control variate ``c_k`` (None: zeros), and
        the one its last input proposed, adopted when that round completes
        (:meth:`commit_control`)."""
        self.proposed_control: Any = None
        self.idp: Any = None
        """``--unit patient-idp``: this site's rate groups (:class:`fl.site.idp.SitePatients`)."""
        if csv is not None:
            features, own_labels = csv_schema(csv, patient_column=self._columns[0],
                                              label_column=self._columns[1])
            self.schema = Schema(tuple(f for f in features if f != budget_column),
                                 own_labels)
        else:
            if table is None:
                raise ValueError("SiteData needs a table or a csv path")
            self._fixed = table
            self.schema = dataset_schema(table.num_features, table.num_classes)
        self.pinned = None if labels is None else tuple(labels)
        if self.pinned is not None:
            outside = sorted(set(self.schema.labels) - set(self.pinned))
            if outside or len(set(self.pinned)) != len(self.pinned) or len(self.pinned) < 2:
                raise DataError(f"--labels must list at least two distinct labels, every "
                                f"label of this site's table among them (missing: {outside})")

    def commit_control(self) -> None:
        """The round this site's last input went into completed with it: adopt the control
        variate that input proposed (SCAFFOLD; as the simulated coordinator does for an
        included site)."""
        if self.proposed_control is not None:
            self.control, self.proposed_control = self.proposed_control, None

    def fingerprint(self) -> str:
        """SHA-256 of this site's data (the CSV's bytes, or the shard's records and patient
        ids): what the default privacy ledger is keyed by, so it follows the patients and
        not the broker's address (fl/cli/train.py ``default_ledger``)."""
        digest = hashlib.sha256()
        if self._csv is not None:
            with open(self._csv, "rb") as handle:
                for chunk in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(chunk)
        else:
            for array in (self._fixed.x, self._fixed.y, self._fixed.patient_ids):
                digest.update(np.ascontiguousarray(array).tobytes())
        return digest.hexdigest()

    def table(self, labels: tuple[str, ...]) -> Table:
        """The table with labels numbered as the federation numbers them."""
        if self._csv is None:
            if labels != self.schema.labels:
                raise DataError(f"the federation's labels {list(labels)} are not this "
                                f"dataset's {list(self.schema.labels)}")
            return self._fixed
        if labels not in self._tables:
            self._tables = {labels: load_csv(self._csv, patient_column=self._columns[0],
                                             label_column=self._columns[1],
                                             labels=list(labels),
                                             budget_column=self._budget_column)}
        return self._tables[labels]


def demo_site_data(settings: TrainSettings, site_id: int, site_ids: Sequence[int]) -> SiteData:
    """Site ``site_id``'s shard of a bundled dataset, split exactly as ``--role all`` does
    (the same ``--seed``, ``--alpha`` and number of sites give the same shard)."""
    from fl.federation import load_split

    ids = sorted(site_ids)
    if site_id not in ids:
        raise ValueError(f"--site-id {site_id} is not among --sites {ids}")
    split = load_split(replace(settings, sites=len(ids)))
    return SiteData(site_id, table=split.site_tables[ids.index(site_id)])


SCHEMA_MISMATCH = ("the round's columns or labels do not match this site's data (the "
                   "details are in the site's own log)")
"""The one reason a site gives the coordinator for any schema problem: which of its labels
are missing would tell the coordinator the site's label set (docs/privacy.md section 1)."""


def check_schema(task: Mapping[str, Any], schema: Schema) -> tuple[str, ...]:
    """The federation's labels, once its columns are this site's and its labels cover the
    site's own (the site's label values never leave it: :func:`site_input` answers any
    mismatch with :data:`SCHEMA_MISMATCH` only, after the privacy gate)."""
    features = get_names(task, "features")
    labels = get_names(task, "labels")
    if features != schema.features:
        raise WireError(f"the federation's features {list(features)[:8]}... differ from this "
                        f"site's columns {list(schema.features)[:8]}...")
    missing = sorted(set(schema.labels) - set(labels))
    if missing or len(labels) < 2 or len(set(labels)) != len(labels):
        raise WireError(f"the federation's labels {list(labels)[:10]} do not cover all of "
                        "this site's labels")
    return labels


def round_bound(blob: Blob, dim: int) -> SecaggBound:
    """Input validation's ``Config`` fields for this blob's round (a training round with
    ``norm_bound``; (None, None) otherwise): the coordinator derives the same from the same public
    task (:func:`fl.contribution.secagg_bound`), so both sides' session ids agree."""
    return secagg_bound(blob.task, dim) if blob.kind == "train" else (None, None)


def site_input(data: SiteData, blob: Blob, announce: Announce, *,
               require_dp: str | None, guard: SiteCore) -> U64:
    """This site's secure-aggregation vector for the announced round: :func:`site_round`
    in a site session over ``guard`` (:class:`fl.site.core.SiteCore`: the site operator's
    policy and ledger; mandatory)."""
    return site_round(data, blob, announce, require_dp=require_dp,
                      session=SiteSession(core=guard, runtime="site"))[1]


def site_round(data: SiteData, blob: Blob, announce: Announce, *,
               require_dp: str | None, session: SiteSession) -> tuple[Admitted, U64]:
    """The site role's join of the announced round in its site session
    (:mod:`fl.site.session`): this parses and checks the announced task, joins it with its
    :class:`fl.site.session.Terms` (:meth:`fl.site.session.SiteSession.admit`: the
    protocol margins, the replay rule and the write-ahead charge, the code the Flower mod
    and the NVFlare executor run), and only then trains and encodes (the session's train and
    encode steps: :func:`fl.contribution.site_input`, as in simulation). Returns the
    admitted round (its charge, which the session's ``end`` withdraws when the masked input
    never existed) and the site's secure-aggregation vector.

    The session's core checks the round and charges it to the site's ledger *before*
    anything about the site's own data is looked at or computed; a refusal names the policy
    rule (docs/privacy.md section 1). The task's shape comes from the announced (public) columns
    and labels; whether they match the site's table is checked after the gate, and a
    mismatch is declined with :data:`SCHEMA_MISMATCH` alone (its charge stays: the answer
    depends on the site's data). With labels pinned by the operator the labels are checked
    against that public list first, and nothing about the site's data is revealed.
    """
    task = blob.task
    num_features = len(get_names(task, "features"))
    num_labels = len(get_names(task, "labels"))
    if data.pinned is not None and get_names(task, "labels") != data.pinned:
        # A comparison with public data only: refused before the gate, nothing charged.
        logger.warning("site %d: the announced labels are not the pinned --labels",
                       data.site_id)
        raise WireError(SCHEMA_MISMATCH)
    cid = data.site_id
    cohort = len(announce.cohort)
    if blob.kind == "scaler" and task.get("noised") is not None:
        from fl.site import private_scaler

        try:  # bounded, noised statistics (fl/site/private_scaler.py): a DP release
            noised = private_scaler.from_wire(task["noised"], num_features)
        except TaskError as exc:
            raise WireError(str(exc)) from None
        dim = noised.params.encoded_dim
        if get_int(task, "dim", dim, dim) != dim or get_int(task, "bits", 8, 64) != \
                noised.params.bits:
            raise WireError("the scaler task's dimension or bits differ from its encoding")
        admitted = _admit(session, noised, announce, "feature scaling")
        return admitted, private_scaler.site_input(noised, _table(data, task, cid))
    if blob.kind == "scaler":
        dim = 2 * num_features + 1
        if get_int(task, "dim", dim, dim) != dim:
            raise WireError("the scaler task's dimension does not match its columns")
        admitted = _admit(session, None, announce, "feature scaling")
        return admitted, scaler_input(Site(cid, _table(data, task, cid)).feature_sums(),
                                      cohort)
    scaler = None if blob.scaler is None else Scaler(*blob.scaler)
    if scaler is not None and scaler.mean.size != num_features:
        raise WireError("the scaler does not match the number of features")
    model = make_model(get_str(task, "model", MODELS), num_features, num_labels)
    layout = ParameterLayout.of(model)
    if blob.model is None or blob.model.size != layout.size:
        raise WireError(f"the blob's model does not have the {layout.size} parameters of "
                        f"{task['model']} on the announced columns")
    layout.load(model, blob.model)
    try:
        round_task = RoundTask.from_wire(task, layout.size)
    except TaskError as exc:
        raise WireError(str(exc)) from None
    if require_dp is not None and round_task.mode != require_dp:
        raise WireError(f"the coordinator asks for --dp {round_task.mode}; this site "
                        f"requires --dp {require_dp}")
    if round_task.round != announce.round or round_task.cohort != cohort:
        raise WireError("the task's round or cohort differs from the announcement")
    idp = None
    if round_task.unit == "patient-idp" and data.idp is not None:
        try:  # the site's own plan for the proposal (fl/site/idp.py); its groups are charged
            idp = data.idp.for_task(round_task)
        except (PrivacyError, ValueError) as exc:  # details name groups: own log only
            logger.warning("site %d: no patient-idp plan: %s", cid, exc)
            raise WireError("no patient-idp plan of this site meets its patients' targets "
                            "for the proposed rate, steps and clip") from None
    admitted = _admit(session, round_task, announce, f"round {announce.round}", idp)
    table = _table(data, task, cid)
    if task.get("model") == "cox":  # the Cox partial likelihood (fl/survival.py)
        from fl.survival import CoxSite

        site: Site = CoxSite(cid, table, scaler)
    else:
        site = Site(cid, table, scaler)
    site.idp = idp
    site.control = data.control
    if round_task.strategy == "scaffold" and blob.control is None:
        raise WireError("a SCAFFOLD round needs the server's control variate in its blob")
    try:
        given = contribution(site, model, round_task, cid, control=blob.control)
    except TaskError as exc:
        raise WireError(str(exc)) from None
    data.proposed_control = given.control
    return admitted, given.vector


def _table(data: SiteData, task: Mapping[str, Any], site_id: int) -> Table:
    """The site's table numbered by the announced labels, or :data:`SCHEMA_MISMATCH` (the
    details go to the site's own log only)."""
    try:
        return data.table(check_schema(task, data.schema))
    except (WireError, DataError) as exc:
        logger.warning("site %d: %s", site_id, exc)
        raise WireError(SCHEMA_MISMATCH) from None


def announce_key(announce: Announce) -> str:
    """The key the replay rule knows an announced round by (run, round, attempt, kind)."""
    run, number, attempt, kind = announce.key
    return f"{run.hex()}-{number}-{attempt}-{kind}"


def _admit(session: SiteSession, task: RoundTask | ScalerPlan | None, announce: Announce,
           label: str, idp: Any = None) -> Admitted:
    """The site's privacy gate: the site session's admission of the announced round's
    :class:`fl.site.session.Terms` (:meth:`fl.site.session.SiteSession.admit`, the
    code the Flower mod and the NVFlare executor run): the protocol margins, the replay rule
    (a round is joined once), then a write-ahead charge, or a refusal naming the rule;
    ``idp``: the site's own :class:`fl.site.idp.SiteIdp` plan under ``--unit
    patient-idp``."""
    try:
        return session.admit(Terms(
            announce_key(announce), label, num_clients=len(announce.cohort),
            threshold=announce.threshold, neighbors=None, security=announce.security,
            charge=lambda core, text: core.admit(task, secagg_threshold=announce.threshold,
                                                 label=text, key=announce.key, idp=idp)))
    except LedgerWriteError:
        raise  # the site role says it in one line; the file stays in its own log
    except Replayed as exc:
        raise WireError(str(exc)) from None
    except PrivacyError as exc:  # the coordinator learns the rule, not the site's plan
        public = exc.public if isinstance(exc, PolicyRefused) else str(exc)
        if public != str(exc):
            logger.warning("%s: %s", label, exc)
        raise WireError(public) from None

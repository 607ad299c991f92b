"""docs/privacy.md section 1 ("No exact statistic escapes epsilon"): whatever feature bounds
a coordinator sends with the noised feature-statistics task, a patient's row has norm at
most the clip, so the bounds change utility, never privacy.

The coordinator's task goes through the site's own validation (``fl.site.private_scaler.
from_wire``) and the site's own input function (``site_input``), with the noise set to zero
so that the site's input *is* what a patient contributes; its norm is then compared with
the bound the accounting uses (``EncodingParams.rounded_l2_bound``)."""

from __future__ import annotations

import numpy as np
import pytest
from adversary import threat

from fl.data import Table, breast_cancer
from fl.plan import scaler as plan_scaler
from fl.settings import TrainSettings
from fl.site import private_scaler

pytestmark = pytest.mark.security

SETTINGS = TrainSettings(sites=3, rounds=1, dataset="breast-cancer", dp="distributed",
                         epsilon=4.0, broker="inprocess")

# bounds that pass the site's validation (finite, high > low) but no honest coordinator sends
HOSTILE_BOUNDS = {
    "a sliver below the data": lambda lo, hi: (lo - 1e-9, lo),
    "a sliver inside the data": lambda lo, hi: (lo, np.nextafter(lo, np.inf)),
    "the whole float range": lambda lo, hi: (np.full_like(lo, -1e308), np.full_like(hi, 1e308)),
    "inverted around the data": lambda lo, hi: (hi, hi + 1e-12),
    "one feature's width in a thousand": lambda lo, hi: (lo, lo + (hi - lo) / 1000),
}


def _one_patient(table: Table, patient: int) -> Table:
    keep = table.patient_ids == patient
    return Table(table.x[keep], table.y[keep], table.patient_ids[keep], table.num_classes)


@threat(attack="Feature bounds chosen to inflate one patient's statistics",
        adversary="malicious server",
        controls="the public feature bounds of the noised feature-statistics task the "
                 "coordinator sends each site (slivers, the whole float range, bounds "
                 "outside the data)",
        protocol="the site clips each feature to the bounds, maps it to [0, 1] and scales each "
                 "patient's row to the update clip before the integer encoder clips and rounds "
                 "it again: a patient's contribution never exceeds the norm the accounting "
                 "assumes, whatever the bounds")
@pytest.mark.parametrize("how", sorted(HOSTILE_BOUNDS))
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_hostile_feature_bounds_never_raise_a_patients_norm(how: str) -> None:
    table = breast_cancer()
    plan = plan_scaler.scaler_plan(SETTINGS, table)
    assert plan is not None
    body = plan_scaler.to_wire(plan)
    lo = np.asarray(body["low"], dtype=np.float64)
    hi = np.asarray(body["high"], dtype=np.float64)
    low, high = HOSTILE_BOUNDS[how](lo, hi)
    body = {**body, "low": np.asarray(low).tolist(), "high": np.asarray(high).tolist(),
            "params": {**body["params"], "noise_stddev": 0.0}}
    hostile = private_scaler.from_wire(body, table.num_features)  # well-formed: accepted
    bound = hostile.params.rounded_l2_bound
    encoder = hostile.codec().encoder
    for patient in np.unique(table.patient_ids)[:25]:
        contribution = encoder.unwrap(private_scaler.site_input(hostile,
                                                                _one_patient(table, patient)))
        assert float(np.linalg.norm(contribution.astype(np.float64))) <= bound + 1e-9

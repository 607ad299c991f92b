"""DP-FedAvg+'s heterogeneity-aware site weights on a survival federation, from DP releases
only (the mechanism and the weights: :mod:`dp.site_weights`; docs/privacy.md, "DP-FedAvg+
privately").

The released scalar is a patient's observed-time interval on the discrete-time model's
public grid (:data:`fl.survival.INTERVAL_EDGES`: years 1-10, then one open interval; 11
cells), a public range by construction, and the outcome whose distribution differs most
between the Fed-TCGA-BRCA centers (follow-up length). One patient is in one cell.

Each site releases once, before training (the run's first release, charged to the budget
before it is made; the rounds are calibrated to compose with it, ``prior=``); the weights
are post-processing of the releases. The site computes its release from its own table
(:func:`release`, this module); the coordinator computes every weight from the releases alone
(:func:`fl.plan.weights.weights_from_releases`) and sends each site its weight in the round
task.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from dp import RandomSource, site_weights
from fl.data import Table

I64 = npt.NDArray[np.int64]

#: The grid's cell centres in years (public): the middle of years 1-10, and 10.5 for the
#: open interval beyond 10 years.
CENTRES = tuple(k + 0.5 for k in range(11))


def patient_cells(table: Table) -> I64:
    """Each patient's observed-time interval (its cell) in a person-period table: the last
    interval of its rows (the interval one-hot is the last 11 features)."""
    intervals = np.asarray(table.x[:, -len(CENTRES):]).argmax(axis=1)
    _, inverse = np.unique(table.patient_ids, return_inverse=True)
    cells = np.zeros(int(inverse.max()) + 1 if inverse.size else 0, dtype=np.int64)
    np.maximum.at(cells, inverse, intervals)
    return cells


def release(plan: site_weights.HistogramRelease, table: Table,
            source: RandomSource | None = None) -> I64:
    """A site's release: its noised histogram of :func:`patient_cells` and noised count."""
    return plan.release(patient_cells(table), source)

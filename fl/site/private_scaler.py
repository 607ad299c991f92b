"""A site's side of feature scaling under differential privacy (docs/privacy.md section 1,
issue 13 item 2): the plan it is sent (:class:`ScalerPlan`, validated from the wire by
:func:`from_wire`) and its encoded input (:func:`site_input`).

In the DP modes an exact secure sum of ``[sum x, sum x^2, n]`` is never released. When the
features have *public* bounds, each site instead contributes, per unit (patient), the mean
over the unit's records of ``[u, u^2]`` with ``u = (clip(x, low, high) - low) / (high -
low)`` in ``[0, 1]``, scaled so every unit's row has L2 norm at most the codec's update clip,
and the count column. The rows go through the distributed-DP integer encoder of the training
rounds (:class:`fl.codec.DistributedCodec`: clip, rotate, round, the site's discrete
Gaussian share) and one secure aggregation. The coordinator's side (the plan, its budget
share and charge, decoding the noised sum) is :mod:`fl.plan.scaler`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from dp import EncodingParams, RdpRound, distributed_event
from fl.codec import DistributedCodec
from fl.contribution import TaskError
from fl.data import Table
from fl.modes import read_encoding

F64 = npt.NDArray[np.float64]
U64 = npt.NDArray[np.uint64]


@dataclass(frozen=True)
class Bounds:
    """Public per-feature ``[low, high]`` (``high > low``)."""

    low: F64
    high: F64

    def __post_init__(self) -> None:
        if (self.low.shape != self.high.shape or self.low.ndim != 1
                or not (np.all(np.isfinite(self.low)) and np.all(np.isfinite(self.high)))
                or not np.all(self.high > self.low)):
            raise ValueError("feature bounds: one finite [low, high] per feature, high > low")

    def unit(self, x: npt.NDArray[Any]) -> F64:
        """Features clipped to the bounds and mapped to ``[0, 1]``."""
        x = np.clip(np.asarray(x, dtype=np.float64), self.low, self.high)
        return (x - self.low) / (self.high - self.low)


@dataclass(frozen=True)
class ScalerPlan:
    """The noised feature statistics' release: bounds, encoding, and its cost."""

    bounds: Bounds
    params: EncodingParams
    epsilon_target: float
    unit: str = "patient"
    charged: Callable[[EncodingParams], EncodingParams] | None = field(
        default=None, compare=False, repr=False)
    """The encoding as each site's ledger charges it when that is not :attr:`params` (its
    own noise share only, when the roster is the coordinator's word); the coordinator's
    side only, never on the wire: :meth:`event` is that charge."""
    mode = "distributed"
    kind = "scaler"
    sample_rate = 1.0
    """As a site's policy sees it (:func:`fl.site.core.site_proposal`): one unsubsampled
    distributed release."""

    @property
    def num_features(self) -> int:
        return int(self.bounds.low.size)

    def event(self) -> RdpRound:
        return distributed_event(self.params if self.charged is None
                                 else self.charged(self.params), 1.0)

    def codec(self) -> DistributedCodec:
        return DistributedCodec(self.params)

    @property
    def row_scale(self) -> float:
        """Each unit's ``[u, u^2]`` (norm <= sqrt(2 f)) times this has the update clip's norm."""
        return self.codec().update_clip / math.sqrt(2 * self.num_features)

    def describe(self) -> str:
        counted = ("" if self.charged is None
                   or self.charged(self.params).threshold == self.params.threshold
                   else " as each site's ledger counts it: its own noise share only")
        return (f"noised secure sum of bounded feature statistics (distributed discrete "
                f"Gaussian, per-site stddev {self.params.noise_stddev:.4g}, any "
                f"{self.params.threshold} sites carry it; calibrated to epsilon "
                f"{self.epsilon_target:g} of the budget{counted})")


def site_input(plan: ScalerPlan, table: Table) -> U64:
    """A site's encoded input: per unit the mean of its records' ``[u, u^2]``, scaled to
    the codec's clip, plus the site's noise share. Whatever bounds a coordinator sends, a
    unit's row has norm at most the clip: the bounds change utility, never the privacy."""
    if plan.num_features != table.num_features:
        raise ValueError(f"the feature statistics task has {plan.num_features} features, "
                         f"this table {table.num_features}")
    u = plan.bounds.unit(table.x)
    rows = np.hstack([u, u * u])
    if plan.unit != "record":
        _, inverse = np.unique(table.patient_ids, return_inverse=True)
        sums = np.zeros((int(inverse.max()) + 1, rows.shape[1]))
        np.add.at(sums, inverse, rows)
        rows = sums / np.bincount(inverse)[:, None]
    return plan.codec().encode(rows * plan.row_scale)


# -- the plan on the wire (multi-machine: the coordinator's blob, validated by each site) --
def from_wire(body: object, num_features: int) -> ScalerPlan:
    """A coordinator's feature-statistics task, every field checked (raises
    :class:`fl.contribution.TaskError`); its cost is then the site's own to judge."""
    if not isinstance(body, dict):
        raise TaskError("task field 'noised' must be a map")
    params = read_encoding(body.get("params"), 2 * num_features + 1, error=TaskError,
                           what="task field", with_dim=True)
    try:
        bounds = Bounds(np.asarray(body.get("low"), dtype=np.float64),
                        np.asarray(body.get("high"), dtype=np.float64))
    except (TypeError, ValueError) as exc:
        raise TaskError(f"invalid feature bounds: {exc}") from None
    if bounds.low.size != num_features:
        raise TaskError(f"the feature bounds are not {num_features}, one per feature")
    unit = body.get("unit")
    target = body.get("epsilon_target")
    if unit not in ("patient", "record") or not isinstance(target, (int, float)):
        raise TaskError("task fields 'unit' (patient or record) and 'epsilon_target'")
    return ScalerPlan(bounds, params, float(target), unit)

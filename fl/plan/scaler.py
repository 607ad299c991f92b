"""The coordinator's side of feature scaling under differential privacy: bounded features,
distributed noise, one more release charged to the run's budget (docs/privacy.md section 1,
issue 13 item 2).

In the DP modes an exact secure sum of ``[sum x, sum x^2, n]`` is never released. When the
features have *public* bounds (the dataset's published ranges, or ``--feature-bounds``),
each site instead contributes, per unit (patient), the mean over the unit's records of
``[u, u^2]`` with ``u = (clip(x, low, high) - low) / (high - low)`` in ``[0, 1]``, scaled so
every unit's row has L2 norm at most the codec's update clip, and the count column. The
rows go through the distributed-DP integer encoder of the training rounds
(:class:`fl.codec.DistributedCodec`: clip, rotate, round, the site's discrete Gaussian
share) and one secure aggregation (:func:`fl.federation.secure_scaler`). The release is one
unsubsampled distributed discrete Gaussian event (:func:`dp.audit.distributed_event`),
calibrated to :data:`SCALER_FRACTION` of ``--epsilon`` (or ``--scaler-epsilon``), spent on
the same budget as the rounds *before* the sum is aggregated; the training rounds are
calibrated to compose with it to ``--epsilon`` (:func:`fl.federation.make_plan`,
``prior=``).

Decoding is post-processing: means are clamped to the bounds, a variance below the noise's
own standard error is raised to it (so a noisy, tiny variance never blows a feature up).
A site's side (the plan it is sent, its encoded input) is :mod:`fl.site.private_scaler`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from dp import MODE_NONE, EncodingParams, choose_bits, event_json, event_to_json, noise_for_budget
from fl import checkpoint as ckpt
from fl.data import Table
from fl.models import make_model
from fl.modes import encoding_fields
from fl.plan.privacy import DEFAULT_MAX_UNITS, restore_budget
from fl.settings import TrainSettings
from fl.site.private_scaler import Bounds
from fl.site.private_scaler import ScalerPlan as ScalerPlan  # the plan this module makes
from fl.site.training import Scaler
from secagg import Config

if TYPE_CHECKING:
    from fl.checkpoint import Checkpoint
    from fl.coordinator import Coordinator

F64 = npt.NDArray[np.float64]
U64 = npt.NDArray[np.uint64]

#: The share of ``--epsilon`` the noised feature statistics get when ``--scaler-epsilon`` is
#: not given; the rounds are calibrated to the rest.
SCALER_FRACTION = 0.1
#: The scaler's epsilon when the run has no ``--epsilon`` (a fixed ``--noise-multiplier``).
SCALER_EPSILON_WITHOUT_BUDGET = 0.5
GRANULARITY_BITS = 16

#: Public per-feature ranges of the bundled breast-cancer set, as its publisher prints them
#: (scikit-learn's ``load_breast_cancer().DESCR``, "Summary Statistics", Min and Max; the
#: same order as the columns). A deployment gives its own, e.g. clinical reference ranges.
BREAST_CANCER_BOUNDS: tuple[tuple[float, float], ...] = (
    (6.981, 28.11), (9.71, 39.28), (43.79, 188.5), (143.5, 2501.0), (0.053, 0.163),
    (0.019, 0.345), (0.0, 0.427), (0.0, 0.201), (0.106, 0.304), (0.05, 0.097),
    (0.112, 2.873), (0.36, 4.885), (0.757, 21.98), (6.802, 542.2), (0.002, 0.031),
    (0.002, 0.135), (0.0, 0.396), (0.0, 0.053), (0.008, 0.079), (0.001, 0.03),
    (7.93, 36.04), (12.02, 49.54), (50.41, 251.2), (185.2, 4254.0), (0.071, 0.223),
    (0.027, 1.058), (0.0, 1.252), (0.0, 0.291), (0.156, 0.664), (0.055, 0.208))


def public_bounds(settings: TrainSettings, num_features: int) -> Bounds | None:
    """The table's public feature bounds: ``--feature-bounds FILE`` (``{"low": [..],
    "high": [..]}``), else the bundled dataset's published ranges, else None."""
    path = settings.feature_bounds
    if path is not None:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            bounds = Bounds(np.asarray(data["low"], dtype=np.float64),
                            np.asarray(data["high"], dtype=np.float64))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"--feature-bounds {path}: need a JSON object with 'low' and "
                             f"'high' lists, high > low ({exc})") from None
        if bounds.low.size != num_features:
            raise ValueError(f"--feature-bounds {path}: need {num_features} bounds, "
                             "one per feature")
        return bounds
    if settings.csv is None and settings.dataset == "breast-cancer":
        pairs = np.asarray(BREAST_CANCER_BOUNDS, dtype=np.float64)
        return Bounds(pairs[:, 0], pairs[:, 1])
    return None


def scaler_epsilon(settings: TrainSettings) -> float:
    """The feature statistics' share of the budget (see :data:`SCALER_FRACTION`)."""
    given = settings.scaler_epsilon
    if given is not None:
        return float(given)
    if settings.epsilon is None:
        return SCALER_EPSILON_WITHOUT_BUDGET
    return SCALER_FRACTION * float(settings.epsilon)


def uses_noised_scaler(settings: TrainSettings, table: Table | None = None) -> bool:
    """The default in the DP modes (``--scaling auto``) for data not on a public scale that
    has public bounds (:func:`public_bounds`). Not with ``--accountant prv`` (PRV composes
    only the sampled Gaussian) nor ``--unit patient-idp`` (per-patient budgets)."""
    if table is not None and table.standardized:
        return False
    has_bounds = (settings.feature_bounds is not None
                  or (settings.csv is None and settings.dataset == "breast-cancer"))
    return (settings.dp != MODE_NONE and settings.scaling == "auto" and has_bounds
            and settings.scaler_file is None and settings.release_accountant == "rdp"
            and settings.unit != "patient-idp")


def scaler_plan(settings: TrainSettings, table: Table | None, num_features: int | None = None, *,
                charged: Callable[[EncodingParams], EncodingParams] | None = None
                ) -> ScalerPlan | None:
    """The release's plan (None when the run uses no noised scaler): every site takes part,
    the noise is calibrated to the secure-aggregation threshold of all ``--sites``, and the
    modulus to the public bound on a site's units (as a distributed round's). ``charged``:
    the encoding as each site's ledger charges it, when that is not the encoding itself
    (:func:`fl.plan.privacy.distributed_plan`'s); the noise is the least whose release
    costs the target epsilon as charged."""
    if not uses_noised_scaler(settings, table):
        return None
    f = table.num_features if table is not None else int(num_features or 0)
    bounds = public_bounds(settings, f)
    assert bounds is not None
    num_sites = settings.sites
    threshold = Config(num_clients=num_sites, dim=1).threshold
    max_units = settings.max_units or DEFAULT_MAX_UNITS
    scale = 2.0**GRANULARITY_BITS
    template = EncodingParams(dim=2 * f + 1, clip_norm=1.0, scale=scale, bits=64,
                              noise_stddev=0.0, rotation_seed=0, threshold=threshold)
    target = scaler_epsilon(settings)
    if settings.epsilon is not None and not target < settings.epsilon:
        raise ValueError(f"--scaler-epsilon {target:g} leaves nothing of --epsilon "
                         f"{settings.epsilon:g} for training")
    counted = template if charged is None else charged(template)
    params = replace(template, noise_stddev=noise_for_budget(
        counted, target, settings.delta, 1.0, 1).noise_stddev)
    bits = choose_bits(dim=2 * f + 1, clip_norm=1.0, scale=scale,
                       noise_stddev=params.noise_stddev, num_sites=num_sites,
                       units_per_site=max_units).bits
    unit = "record" if settings.unit == "record" else "patient"
    return ScalerPlan(bounds, replace(params, bits=max(bits, 8)), target, unit, charged)


def from_sum(plan: ScalerPlan, total: U64, included: int) -> Scaler:
    """The federation's mean and std from the noised sum (post-processing only)."""
    sums, count = plan.codec().decode(np.asarray(total, dtype=np.uint64), included)
    f = plan.num_features
    n = max(count, 1.0)
    s = sums / plan.row_scale
    mean_u = np.clip(s[:f] / n, 0.0, 1.0)
    second = np.clip(s[f:] / n, 0.0, 1.0)
    # The noise's standard error on the second moment: a variance below it is noise.
    floor = math.sqrt(included) * plan.params.noise_stddev / (plan.row_scale * n)
    var_u = np.maximum(second - mean_u**2, max(floor, 1e-6))
    std_u = np.minimum(np.sqrt(var_u), 0.5)
    width = plan.bounds.high - plan.bounds.low
    return Scaler(plan.bounds.low + width * mean_u, width * std_u)


@dataclass
class Released:
    """The scaler the federation obtained, its audit record, and the run's events with its
    charge (the coordinator continues from them: :meth:`attach`)."""

    scaler: Scaler
    record: dict[str, Any]
    events: list[dict[str, Any]]

    def scaler_json(self) -> dict[str, Any]:
        """What the checkpoint and the model info keep: the statistics and their release."""
        return {"mean": self.scaler.mean.tolist(), "std": self.scaler.std.tolist(),
                "release": self.record}

    def attach(self, coordinator: Coordinator) -> None:
        """Put the charge on the coordinator's budget and checkpoint (the rounds compose
        with it)."""
        s = coordinator.settings
        coordinator.events = list(self.events)
        coordinator.budget = restore_budget(s.epsilon, s.delta, self.events,
                                            s.release_accountant)
        coordinator.save()


@dataclass
class Charged:
    """The release's cost, already on the budget and in the checkpoint."""

    plan: ScalerPlan
    events: list[dict[str, Any]]
    before: float
    after: float

    def released(self, scaler: Scaler, included: list[int]) -> Released:
        return Released(scaler, release_record(self.plan, included, self.before, self.after),
                        self.events)


def charge(plan: ScalerPlan, settings: TrainSettings, saved: Checkpoint | None, num_features: int,
           num_classes: int) -> Charged:
    """Charge the release to the run's budget (the checkpoint's events, if resuming) and
    write that charge to the checkpoint (write-ahead: before the sum exists). A budget that
    cannot afford it raises :class:`dp.errors.BudgetExceeded`; nothing is released."""
    events = list(saved.events) if saved is not None else []
    budget = restore_budget(settings.epsilon, settings.delta, events,
                            settings.release_accountant)
    before = budget.spent[0]
    after = budget.spend(plan.event())[0]
    events.append(event_to_json(plan.event()))
    if settings.checkpoint is not None and (saved is None or saved.round == 0):
        model = make_model(settings.model, num_features, num_classes, settings.seed)
        ckpt.save(settings.checkpoint, ckpt.Checkpoint(
            round=0, model=model.state_dict(), fingerprint=settings.fingerprint(),
            events=events))
    return Charged(plan, events, before, after)


def release_record(plan: ScalerPlan, included: list[int], epsilon_before: float,
                   epsilon_after: float) -> dict[str, Any]:
    """The release's line of the audit trail."""
    return {"round": 0, "to": "the coordinator (and whoever it shares the model with)",
            "what": "the noised sum over the sites of their patients' bounded feature "
                    "statistics [u, u^2] and the patient count (feature scaling)",
            "included": included, "mode": "distributed",
            "mechanism": "distributed discrete Gaussian (secure sum)",
            "per_site_noise_stddev": plan.params.noise_stddev,
            "calibration_threshold": plan.params.threshold, "sample_rate": 1.0,
            "epsilon_charged": epsilon_after - epsilon_before,
            "epsilon_after": epsilon_after, "dp_event": event_json(plan.event())}


# -- the plan on the wire (multi-machine: the coordinator's blob, validated by each site) --
def to_wire(plan: ScalerPlan) -> dict[str, Any]:
    return {"params": encoding_fields(plan.params, with_dim=True),
            "low": plan.bounds.low.tolist(), "high": plan.bounds.high.tolist(),
            "unit": plan.unit, "epsilon_target": plan.epsilon_target}


def releases(scaler_json: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The scaler's release record for a report's ``releases`` (none if it released none)."""
    record = (scaler_json or {}).get("release")
    return [record] if isinstance(record, dict) else []

"""Assemble and run a simulated federation from :class:`fl.settings.TrainSettings`.

Data: the table is split by patient into a held-out test set (the coordinator's) and a
training set spread over the sites non-IID (:func:`fl.data.dirichlet_split`). Features that
are not standardized at the source are scaled with federation-wide statistics obtained by
one secure aggregation of ``[sum x, sum x^2, n]``: no site reveals its own. That release is
exact, not noised: in the DP modes use data on a public scale (the EHR generator is) or
``--scaling none`` for a guarantee that covers everything released.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dp import (
    MODE_DISTRIBUTED,
    MODE_NONE,
    MODE_SITE,
    EncodingParams,
    check_delta,
    event_from_json,
    run_json,
)
from fl import checkpoint as ckpt
from fl.aggregation import Aggregator, Tap, open_aggregator
from fl.contribution import scaler_from_sum, scaler_input
from fl.coordinator import Coordinator, RoundCapture, evaluate
from fl.data import Table, dirichlet_split, load_csv, load_dataset, split_patients
from fl.models import make_model
from fl.modes import own_share
from fl.plan import idp as fl_idp
from fl.plan import scaler as plan_scaler
from fl.plan import weights as site_weights
from fl.plan.privacy import (
    DEFAULT_MAX_UNITS,
    NoPrivacy,
    Plan,
    distributed_plan,
    schedule,
    site_plan,
)
from fl.settings import TrainSettings
from fl.site import private_scaler
from fl.site.training import Scaler, Site
from fl.survival import evaluate_cox
from fl.vector import ParameterLayout
from secagg import Config

Log = Callable[[str], None]


@dataclass
class Split:
    train: Table
    test: Table
    site_tables: list[Table]
    site_tests: list[Table] | None = None
    """A naturally federated set's per-site test sets (``tcga-brca``), else None."""


def load_split(settings: TrainSettings) -> Split:
    """The settings' table, split into test and per-site training data (seeded)."""
    if settings.survival:
        from fl.data import tcga_brca

        data = tcga_brca()  # FLamby's natural centers and static split
        if settings.model == "discrete-time":  # person-period rows, public feature scale
            from fl.data import pooled
            from fl.survival import person_period, public_scale

            rows = [person_period(t) for t in data.train]
            tests = [public_scale(t) for t in data.test]
            return Split(pooled(rows, "tcga-brca-person-period"), pooled(tests, "tcga-brca-test"),
                         rows, tests)
        return Split(data.pooled_train, data.pooled_test, list(data.train), list(data.test))
    if settings.csv is not None:
        assert settings.patient_column is not None and settings.label_column is not None
        table = load_csv(settings.csv, patient_column=settings.patient_column,
                         label_column=settings.label_column,
                         budget_column=settings.budget_column)
    else:
        table = load_dataset(settings.dataset, settings.seed, settings.ehr_patients)
    train, test = split_patients(table, settings.test_fraction, settings.seed)
    sites = dirichlet_split(train, settings.sites, settings.alpha, settings.seed)
    return Split(train, test, sites)


def uses_scaler(settings: TrainSettings, table: Table) -> bool:
    """Whether to scale with an exact secure sum of feature statistics. Never by default in
    the DP modes: that sum is not covered by epsilon (``--scaling secure`` with ``--dp`` is
    refused by :class:`TrainSettings`); use pre-scaled data there."""
    if settings.scaler_file is not None:
        return False
    if settings.scaling == "auto":
        return not table.standardized and settings.dp == MODE_NONE
    return settings.scaling == "secure"


def public_scaler(settings: TrainSettings, num_features: int) -> Scaler | None:
    """``--scaler FILE``: public per-feature statistics (``{"mean": [..], "std": [..]}``,
    e.g. from a reference population), given rather than computed from the sites' data, so
    they release nothing (docs/privacy.md section 1)."""
    if settings.scaler_file is None:
        return None

    try:
        data = json.loads(Path(settings.scaler_file).read_text(encoding="utf-8"))
        mean = np.asarray(data["mean"], dtype=np.float64)
        std = np.asarray(data["std"], dtype=np.float64)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--scaler {settings.scaler_file}: need a JSON object with 'mean' "
                         f"and 'std' lists ({exc})") from None
    if mean.shape != (num_features,) or std.shape != (num_features,):
        raise ValueError(f"--scaler {settings.scaler_file}: need {num_features} means and "
                         "stds, one per feature")
    if not (np.all(np.isfinite(mean)) and np.all(np.isfinite(std)) and np.all(std > 0)):
        raise ValueError(f"--scaler {settings.scaler_file}: means finite, stds > 0")
    return Scaler(mean, std)


def secure_scaler(sites: dict[int, Site], aggregator: Aggregator,
                  noised: private_scaler.ScalerPlan | None = None) -> Scaler:
    """Federation-wide mean and std from one secure sum of every site's feature sums:
    exact (``--dp none``), or with ``noised`` the bounded, noised statistics of
    :mod:`fl.plan.scaler` (the DP modes; charged to the budget by the caller)."""
    f = next(iter(sites.values())).table.num_features
    if noised is not None:
        inputs = {cid: private_scaler.site_input(noised, site.table)
                  for cid, site in sites.items()}
        config = Config(num_clients=len(sites), dim=noised.params.encoded_dim,
                        bits=noised.params.bits)
        outcome = aggregator.aggregate(config, inputs, {})
        return plan_scaler.from_sum(noised, outcome.total, len(outcome.included))
    inputs = {cid: scaler_input(site.feature_sums(), len(sites))
              for cid, site in sites.items()}
    config = Config(num_clients=len(sites), dim=2 * f + 1, bits=64)
    return scaler_from_sum(aggregator.aggregate(config, inputs, {}).total, f, len(sites))


def make_plan(settings: TrainSettings, sites: dict[int, Site] | None, model_dim: int,
              threshold: int, *, max_units: int | None = None, prior: Sequence[Any] = (),
              charged: Callable[[EncodingParams], EncodingParams] | None = None) -> Plan:
    """The privacy plan. Distributed DP sizes the modulus for a *public* bound on the units
    a site sums (``max_units``, ``--max-units``, else :data:`fl.plan.privacy.DEFAULT_MAX_UNITS`),
    never for a site's actual patient count: ``bits`` is published. ``sites`` is unused.
    The rounds are calibrated to fit ``--epsilon`` together with ``prior`` (the events of
    releases before them: the noised feature statistics, :mod:`fl.plan.scaler`).
    ``charged``: a distributed round's encoding as each site's ledger charges it
    (:func:`site_charge`), the figure the plan is calibrated, spent and reported at."""
    epsilon = settings.epsilon
    if settings.dp == MODE_SITE:
        return site_plan(epsilon=epsilon, delta=settings.delta,
                         sample_rate=settings.sample_rate, steps=settings.steps_per_round,
                         rounds=settings.rounds, clip_norm=settings.clip_norm,
                         noise_multiplier=settings.noise_multiplier,
                         # patient-idp: each site's own plan replaces this one's noise
                         accountant=settings.release_accountant,
                         target_quantile=settings.adaptive_clip,
                         count_stddev=settings.clip_count_stddev, prior=prior)
    if settings.dp == MODE_DISTRIBUTED:
        units = max_units or settings.max_units or DEFAULT_MAX_UNITS
        return distributed_plan(model_dim=model_dim, epsilon=epsilon,
                                delta=settings.delta, sample_rate=settings.sample_rate,
                                rounds=settings.rounds, clip_norm=settings.clip_norm,
                                num_sites=settings.cohort_size, threshold=threshold,
                                max_units_per_site=units,
                                noise_multiplier=settings.noise_multiplier, prior=prior,
                                target_quantile=settings.adaptive_clip,
                                count_stddev=settings.clip_count_stddev,
                                max_weight=(1.0 if settings.site_weights is None
                                            else settings.max_site_weight),
                                charged=charged)
    return NoPrivacy()


def site_charge(authenticated: bool) -> Callable[[EncodingParams], EncodingParams] | None:
    """How the sites of a multi-machine run charge a distributed release
    (:func:`fl.site.core.charged_proposal`): every share of the noise it is calibrated to
    when the roster is authenticated by the operators' own keys (``--peer-keys``), else the
    site's own share only (:func:`fl.modes.own_share`: the coordinator could fill the
    rest of the round with sites it simulates). ``--role all`` simulates its sites and
    counts every share (None)."""
    return None if authenticated else own_share


def federation_plan(settings: TrainSettings, num_features: int, num_classes: int, *,
                    prior: Sequence[Any] = (),
                    charged: Callable[[EncodingParams], EncodingParams] | None = None
                    ) -> tuple[int, int, Plan]:
    """``(model parameters, secagg threshold, privacy plan)`` of a run: what ``secagg train
    --plan`` prints and what the run uses (``charged``: :func:`make_plan`'s)."""
    model = make_model(settings.model, num_features, num_classes, settings.seed)
    dim = ParameterLayout.of(model).size
    threshold = settings.secagg_threshold
    return dim, threshold, make_plan(settings, None, dim, threshold, prior=prior,
                                     charged=charged)


def plan_warnings(settings: TrainSettings, split: Split) -> list[str]:
    if settings.dp == MODE_NONE:
        return []
    units = split.train.num_patients if settings.unit == "patient" else len(split.train)
    warning = check_delta(settings.delta, units)
    return [warning] if warning else []


def prior_releases(noised: private_scaler.ScalerPlan | None,
                   weighing: Any) -> tuple[Any, ...]:
    """The events of the releases before the rounds, in the order they are made: the noised
    feature statistics, then the site weights' histograms (:mod:`fl.plan.weights`)."""
    return tuple(p.event() for p in (noised, weighing) if p is not None)


def privacy_plan(settings: TrainSettings,
                 charged: Callable[[EncodingParams], EncodingParams] | None = None
                 ) -> dict[str, Any]:
    """The run's privacy plan without training (``secagg train --plan``): mode, mechanism,
    noise, thresholds, the rounds the budget affords and epsilon after each round
    (``charged``: :func:`make_plan`'s, for ``--role coordinator``: :func:`site_charge`)."""
    split = load_split(settings)
    noised = plan_scaler.scaler_plan(settings, split.train, charged=charged)
    weighing = site_weights.release_plan(settings)
    prior = prior_releases(noised, weighing)
    dim, threshold, plan = federation_plan(
        settings, split.train.num_features, split.train.num_classes, prior=prior,
        charged=charged)
    out = schedule(plan, rounds=settings.rounds, epsilon=settings.epsilon,
                   delta=settings.delta, accountant=settings.release_accountant,
                   threshold=threshold, prior=prior)
    if weighing is not None:
        out["site_weights"] = (f"each site's noised histogram of observed-time intervals "
                               f"(discrete Gaussian stddev {weighing.noise_stddev:.4g}, "
                               f"epsilon {weighing.epsilon_target:g} of the budget); weights "
                               f"exp(-{settings.site_weights:g} W1) in "
                               f"[{settings.min_site_weight:g}, {settings.max_site_weight:g}]")
    out.update(description=plan.describe(), model_parameters=dim, sites=settings.sites,
               cohort=settings.cohort_size, warnings=plan_warnings(settings, split),
               feature_scaling=("public (--scaler)" if settings.scaler_file else
                                "exact secure sum (no DP: --dp none)"
                                if uses_scaler(settings, split.train) else
                                noised.describe() if noised is not None else "none"))
    if settings.unit == "patient-idp":
        fl_idp.plan_summary(settings, {i + 1: Site(i + 1, t)
                                       for i, t in enumerate(split.site_tables)}, out)
    return out


def tensors(table: Table, scaler: Scaler | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A table as (features, labels) tensors, scaled like the sites scale theirs; a
    survival table's targets are ``[event, time]`` rows (:func:`fl.survival.targets`)."""
    x = table.x if scaler is None else scaler.apply(table.x)
    if table.times is not None:
        from fl.survival import targets

        return torch.from_numpy(np.ascontiguousarray(x)), targets(table)
    return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(table.y.copy())


def survival_evaluator(site_tests: Sequence[Table] | None,
                       discrete_time: bool = False) -> Any:
    """Round metrics of a survival task: the pooled test set's C-index and Cox loss, and
    each site's own test C-index (``c_index_by_site``, if the data set has per-site tests);
    ``discrete_time``: of the discrete-time model's risk (fl.survival.discrete_time_risk)."""
    per_site = [tensors(t, None) for t in site_tests or ()]

    def metrics(model: torch.nn.Module,
                test: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
        c_index, loss = evaluate_cox(model, *test, discrete_time=discrete_time)
        return {"accuracy": None, "c_index": c_index, "loss": loss,
                "c_index_by_site": {str(k + 1): evaluate_cox(model, *xy, discrete_time)[0]
                                    for k, xy in enumerate(per_site)}}

    return metrics


@contextlib.contextmanager
def _aggregator(settings: TrainSettings, tap: Tap | None) -> Iterator[Aggregator]:
    with open_aggregator(settings.broker, range(1, settings.sites + 1), tap=tap) as agg:
        yield agg


def load_checkpoint(settings: TrainSettings, say: Log) -> ckpt.Checkpoint | None:
    """The checkpoint to resume from (None: start fresh); refuses to overwrite one."""
    if settings.checkpoint is None:
        return None
    saved = ckpt.load(settings.checkpoint)
    if saved is not None and not settings.resume:
        raise ckpt.CheckpointError(f"{settings.checkpoint} already holds a checkpoint "
                                   f"(round {saved.round}); pass --resume to continue it "
                                   "or choose an empty directory")
    if saved is None and settings.resume:
        say(f"no checkpoint in {settings.checkpoint} yet; starting from round 1")
    return saved


def report(settings: TrainSettings, plan: Plan, threshold: int, dim: int,
           coordinator: Coordinator, model: torch.nn.Module, *, in_features: int,
           labels: Sequence[str]) -> dict[str, Any]:
    """The JSON report of a training run (the same for every ``--role``); ``model_info``
    is what :func:`fl.checkpoint.save_model` records next to the model."""
    final = coordinator.history[-1] if coordinator.history else {}
    return {"model_info": {"model": settings.model, "in_features": in_features,
                           "task": "survival" if settings.survival else "classification",
                           "num_classes": len(labels), "labels": list(labels),
                           "scaler": coordinator.scaler, "rounds": coordinator.round,
                           "final_accuracy": final.get("accuracy"),
                           "final_c_index": final.get("c_index"),
                           "final_epsilon": final.get("epsilon"),
                           "privacy": plan.describe()},
            "settings": {k: v for k, v in vars(settings).items()},
            "privacy": plan.describe(), "threshold": threshold, "model_parameters": dim,
            "releases": plan_scaler.releases(coordinator.scaler) + coordinator.releases
            + [row["release"] for row in coordinator.history if "release" in row],
            "dp_events": run_json([event_from_json(e) for e in coordinator.events]),
            "rounds": coordinator.history, "stopped": coordinator.stopped,
            "final_accuracy": final.get("accuracy"), "final_c_index": final.get("c_index"),
            "final_epsilon": final.get("epsilon"),
            "model": coordinator.layout.to_vector(model).tolist()}


def train(settings: TrainSettings, *, log: Log | None = None, tap: Tap | None = None,
          on_capture: Callable[[RoundCapture], None] | None = None,
          on_failure: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run (or resume) federated training; returns the report (``rounds`` per round).

    A failure while the rounds run (a round that kept aborting, a checkpoint that could
    not be written) propagates as raised, after ``on_failure`` got the report of the
    rounds completed before it (``"failed"`` says why): ``secagg train`` writes it."""
    say = log or (lambda text: None)
    torch.manual_seed(settings.seed)
    split = load_split(settings)
    saved = load_checkpoint(settings, say)
    site_class = Site
    if settings.survival and settings.model == "cox":
        from fl.survival import CoxSite

        site_class = CoxSite
    raw_sites = {i + 1: site_class(i + 1, t) for i, t in enumerate(split.site_tables)}
    with _aggregator(settings, tap) as aggregator:
        scaler: Scaler | None = None
        if saved is not None and saved.scaler is not None:
            scaler = Scaler(np.asarray(saved.scaler["mean"]), np.asarray(saved.scaler["std"]))
        elif settings.scaler_file is not None:
            scaler = public_scaler(settings, split.train.num_features)
        elif uses_scaler(settings, split.train):
            scaler = secure_scaler(raw_sites, aggregator)
        noised = plan_scaler.scaler_plan(settings, split.train)
        released = None
        if scaler is None and noised is not None:
            charged = plan_scaler.charge(noised, settings, saved,
                                            split.train.num_features, split.train.num_classes)
            scaler = secure_scaler(raw_sites, aggregator, noised)
            released = charged.released(scaler, sorted(raw_sites))
            say(f"feature scaling: {noised.describe()}; epsilon "
                f"{released.record['epsilon_after']:.4g} after it")
        sites = {cid: site_class(cid, s.table, scaler) for cid, s in raw_sites.items()}
        model = make_model(settings.model, split.train.num_features, split.train.num_classes,
                           settings.seed)
        weighing = site_weights.release_plan(settings)
        dim, threshold, plan = federation_plan(
            settings, split.train.num_features, split.train.num_classes,
            prior=prior_releases(noised, weighing))
        for warning in plan_warnings(settings, split):
            say(f"warning: {warning}")
        say(f"{settings.sites} sites ({', '.join(str(len(s.table)) for s in sites.values())} "
            f"records), test {len(split.test)} records, model {settings.model} ({dim} "
            f"parameters), broker {aggregator.name}, threshold {threshold}")
        idp_text = fl_idp.configure(settings, sites) if settings.unit == "patient-idp" else None
        say(f"privacy: {idp_text or plan.describe()}")
        scaler_json = (None if scaler is None else
                       {"mean": scaler.mean.tolist(), "std": scaler.std.tolist()})
        if released is not None:
            scaler_json = released.scaler_json()
        elif saved is not None and saved.scaler is not None:
            scaler_json = saved.scaler  # keeps the record of how it was released
        coordinator = Coordinator(settings, model, sites, tensors(split.test, scaler), plan,
                                  aggregator, scaler=scaler_json, log=say,
                                  on_capture=on_capture,
                                  evaluator=(survival_evaluator(
                                      split.site_tests, settings.model == "discrete-time")
                                             if settings.survival else None))
        if idp_text is not None:
            coordinator.budget = fl_idp.FederationBudget(settings, sites)  # type: ignore[assignment]
        if saved is not None:
            coordinator.restore(saved)
            if idp_text is not None:  # every site's group ledger, replayed
                coordinator.budget = fl_idp.restore(settings, sites, coordinator)  # type: ignore[assignment]
            say(f"resumed from {settings.checkpoint} after round {saved.round}")
        if released is not None:  # the feature statistics' release is on the budget
            released.attach(coordinator)
        if weighing is not None:  # charged, then released, then the weights computed
            weights = site_weights.release_and_weigh(coordinator, weighing, settings)
            budget = coordinator.budget
            say("site weights from the DP releases: "
                + ", ".join(f"{k} {w:.3f}" for k, w in sorted(weights.weights.items()))
                + (f"; epsilon {budget.spent[0]:.4g} after them" if budget is not None
                   else ""))
        try:
            coordinator.run()
        except Exception as failure:
            if on_failure is not None:
                out = _report(settings, plan, threshold, dim, coordinator, model, split,
                              sites, idp_text)
                out["failed"] = str(failure)
                on_failure(out)
            raise
    if coordinator.stopped is None and coordinator.round >= settings.rounds:
        say(f"done: {coordinator.round} rounds")
    return _report(settings, plan, threshold, dim, coordinator, model, split, sites, idp_text)


def _report(settings: TrainSettings, plan: Plan, threshold: int, dim: int,
            coordinator: Coordinator, model: torch.nn.Module, split: Split,
            sites: dict[int, Site], idp_text: str | None) -> dict[str, Any]:
    out = report(settings, plan, threshold, dim, coordinator, model,
                 in_features=split.train.num_features, labels=_label_names(settings, split))
    return out if idp_text is None else fl_idp.finish_report(settings, sites, out, idp_text)


def _label_names(settings: TrainSettings, split: Split) -> list[str]:
    """The label values class ``i`` stands for (a CSV's sorted values, else ``"i"``)."""
    if settings.csv is not None:
        from fl.data import csv_schema

        return list(csv_schema(settings.csv, patient_column=settings.patient_column or "",
                               label_column=settings.label_column or "")[1])
    return [str(c) for c in range(split.train.num_classes)]


def train_central(settings: TrainSettings, epochs: int | None = None) -> dict[str, float]:
    """The same model trained on the pooled training data (the non-federated reference).

    Same split, same scaling (pooled statistics), same initialisation and optimizer;
    ``epochs`` defaults to ``rounds * local_epochs``, the passes FedAvg makes over the data.
    """
    split = load_split(settings)
    scaler = None
    if uses_scaler(settings, split.train):
        x = split.train.x.astype(np.float64)
        std = x.std(axis=0)
        scaler = Scaler(x.mean(axis=0), np.where(std > 1e-6, std, 1.0))
    model = make_model(settings.model, split.train.num_features, split.train.num_classes,
                       settings.seed)
    site = Site(0, split.train, scaler)
    layout = ParameterLayout.of(model)
    passes = epochs or settings.rounds * settings.local_epochs
    update = site.fedavg_update(model, layout, epochs=passes, lr=settings.lr,
                                batch_size=settings.batch_size, seed=settings.seed)
    layout.load(model, layout.to_vector(model) + update)
    acc, loss = evaluate(model, *tensors(split.test, scaler))
    return {"accuracy": acc, "loss": loss, "epochs": float(passes),
            "records": float(len(split.train)), "chance": float(
                np.bincount(split.test.y).max() / max(1, len(split.test)))
            if len(split.test) else math.nan}

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
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fl import checkpoint as ckpt
from fl.aggregation import Aggregator, Tap, open_aggregator
from fl.contribution import scaler_from_sum, scaler_input
from fl.coordinator import Coordinator, RoundCapture, evaluate
from fl.data import Table, dirichlet_split, load_csv, load_dataset, split_patients
from fl.models import make_model
from fl.privacy import NoPrivacy, Plan, distributed_plan, site_plan
from fl.settings import TrainSettings
from fl.site import Scaler, Site
from fl.vector import ParameterLayout
from secagg import Config

Log = Callable[[str], None]


@dataclass
class Split:
    train: Table
    test: Table
    site_tables: list[Table]


def load_split(settings: TrainSettings) -> Split:
    """The settings' table, split into test and per-site training data (seeded)."""
    if settings.csv is not None:
        assert settings.patient_column is not None and settings.label_column is not None
        table = load_csv(settings.csv, patient_column=settings.patient_column,
                         label_column=settings.label_column)
    else:
        table = load_dataset(settings.dataset, settings.seed, settings.ehr_patients)
    train, test = split_patients(table, settings.test_fraction, settings.seed)
    sites = dirichlet_split(train, settings.sites, settings.alpha, settings.seed)
    return Split(train, test, sites)


def uses_scaler(settings: TrainSettings, table: Table) -> bool:
    if settings.scaling == "auto":
        return not table.standardized
    return settings.scaling == "secure"


def secure_scaler(sites: dict[int, Site], aggregator: Aggregator) -> Scaler:
    """Federation-wide mean and std from one secure sum of every site's feature sums."""
    f = next(iter(sites.values())).table.num_features
    inputs = {cid: scaler_input(site.feature_sums(), len(sites))
              for cid, site in sites.items()}
    config = Config(num_clients=len(sites), dim=2 * f + 1, bits=64)
    return scaler_from_sum(aggregator.aggregate(config, inputs, {}).total, f, len(sites))


def make_plan(settings: TrainSettings, sites: dict[int, Site] | None, model_dim: int,
              threshold: int, *, max_units: int | None = None) -> Plan:
    """The privacy plan. Distributed DP sizes the modulus for the largest site: its unit
    count comes from ``sites`` (simulation) or ``max_units`` (a public bound the federation
    agrees on when the sites are other processes)."""
    if settings.dp == "site":
        return site_plan(epsilon=settings.epsilon, delta=settings.delta,
                         sample_rate=settings.sample_rate, steps=settings.steps_per_round,
                         rounds=settings.rounds, clip_norm=settings.clip_norm,
                         noise_multiplier=settings.noise_multiplier)
    if settings.dp == "distributed":
        if max_units is None:
            if not sites:
                raise ValueError("distributed DP needs a bound on the units per site "
                                 "(--max-units)")
            max_units = max((s.num_patients if settings.unit == "patient" else s.num_records)
                            for s in sites.values())
        units = max_units
        return distributed_plan(model_dim=model_dim, epsilon=settings.epsilon,
                                delta=settings.delta, sample_rate=settings.sample_rate,
                                rounds=settings.rounds, clip_norm=settings.clip_norm,
                                num_sites=settings.cohort_size, threshold=threshold,
                                max_units_per_site=units,
                                noise_multiplier=settings.noise_multiplier)
    return NoPrivacy()


def tensors(table: Table, scaler: Scaler | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A table as (features, labels) tensors, scaled like the sites scale theirs."""
    x = table.x if scaler is None else scaler.apply(table.x)
    return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(table.y.copy())


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
           coordinator: Coordinator, model: torch.nn.Module) -> dict[str, Any]:
    """The JSON report of a training run (the same for every ``--role``)."""
    final = coordinator.history[-1] if coordinator.history else {}
    return {"settings": {k: v for k, v in vars(settings).items()},
            "privacy": plan.describe(), "threshold": threshold, "model_parameters": dim,
            "rounds": coordinator.history, "stopped": coordinator.stopped,
            "final_accuracy": final.get("accuracy"), "final_epsilon": final.get("epsilon"),
            "model": coordinator.layout.to_vector(model).tolist()}


def train(settings: TrainSettings, *, log: Log | None = None, tap: Tap | None = None,
          on_capture: Callable[[RoundCapture], None] | None = None) -> dict[str, Any]:
    """Run (or resume) federated training; returns the report (``rounds`` per round)."""
    say = log or (lambda text: None)
    torch.manual_seed(settings.seed)
    split = load_split(settings)
    saved = load_checkpoint(settings, say)
    raw_sites = {i + 1: Site(i + 1, t) for i, t in enumerate(split.site_tables)}
    with _aggregator(settings, tap) as aggregator:
        scaler: Scaler | None = None
        if saved is not None and saved.scaler is not None:
            scaler = Scaler(np.asarray(saved.scaler["mean"]), np.asarray(saved.scaler["std"]))
        elif uses_scaler(settings, split.train):
            scaler = secure_scaler(raw_sites, aggregator)
            if settings.dp != "none":
                say("note: feature scaling statistics come from an exact secure sum that the "
                    "privacy budget does not cover; use --scaling none or pre-scaled data for "
                    "a guarantee that covers every release")
        sites = {cid: Site(cid, s.table, scaler) for cid, s in raw_sites.items()}
        model = make_model(settings.model, split.train.num_features, split.train.num_classes,
                           settings.seed)
        dim = ParameterLayout.of(model).size
        threshold = int(Config(num_clients=settings.cohort_size, dim=1).threshold or 2)
        plan = make_plan(settings, sites, dim, threshold)
        say(f"{settings.sites} sites ({', '.join(str(len(s.table)) for s in sites.values())} "
            f"records), test {len(split.test)} records, model {settings.model} ({dim} "
            f"parameters), broker {aggregator.name}, threshold {threshold}")
        say(f"privacy: {plan.describe()}")
        scaler_json = (None if scaler is None else
                       {"mean": scaler.mean.tolist(), "std": scaler.std.tolist()})
        coordinator = Coordinator(settings, model, sites, tensors(split.test, scaler), plan,
                                  aggregator, scaler=scaler_json, log=say,
                                  on_capture=on_capture)
        if saved is not None:
            coordinator.restore(saved)
            say(f"resumed from {settings.checkpoint} after round {saved.round}")
        coordinator.run()
    if coordinator.stopped is None and coordinator.round >= settings.rounds:
        say(f"done: {coordinator.round} rounds")
    return report(settings, plan, threshold, dim, coordinator, model)


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

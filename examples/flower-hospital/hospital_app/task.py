"""The hospital task: patients with several visits each (fl.data.synthetic_ehr), split over
the hospitals non-IID by patient (fl.data.dirichlet_split), a logistic regression on torch."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from fl.data import Table, dirichlet_split, load_dataset, split_patients
from fl.models import make_model


@lru_cache(maxsize=4)
def _split(num_patients: int, seed: int) -> tuple[Table, Table]:
    return split_patients(load_dataset("ehr", seed, num_patients), 0.2, seed)


def hospital_table(partition: int, hospitals: int, num_patients: int, seed: int) -> Table:
    """The records of hospital ``partition`` (all visits of a patient at one hospital)."""
    train, _ = _split(num_patients, seed)
    return dirichlet_split(train, hospitals, alpha=1.0, seed=seed)[partition]


def test_table(num_patients: int, seed: int) -> Table:
    return _split(num_patients, seed)[1]


def new_model(table: Table) -> torch.nn.Module:
    return make_model("logreg", table.num_features, table.num_classes, seed=0)


def train(model: torch.nn.Module, table: Table, *, epochs: int, lr: float, batch_size: int,
          seed: int) -> float:
    """Local SGD; returns the mean training loss of the last epoch."""
    x, y = torch.from_numpy(table.x), torch.from_numpy(table.y)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    loss_fn = torch.nn.CrossEntropyLoss()
    last = 0.0
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=generator)
        losses = []
        for start in range(0, len(y), batch_size):
            batch = order[start:start + batch_size]
            optimizer.zero_grad()
            loss = loss_fn(model(x[batch]), y[batch])
            loss.backward()
            optimizer.step()
            losses.append(loss.detach().item())
        last = float(np.mean(losses))
    return last


def evaluate(model: torch.nn.Module, table: Table) -> tuple[float, float]:
    """(loss, accuracy) on ``table``."""
    with torch.no_grad():
        logits = model(torch.from_numpy(table.x))
        y = torch.from_numpy(table.y)
        loss = float(torch.nn.functional.cross_entropy(logits, y))
        accuracy = float((logits.argmax(dim=1) == y).float().mean())
    return loss, accuracy

"""Small models for tabular clinical data: logistic regression and a one-hidden-layer MLP."""

from __future__ import annotations

import torch


def make_model(kind: str, in_features: int, num_classes: int, seed: int = 0,
               hidden: int = 16) -> torch.nn.Module:
    """``logreg`` (one linear layer) or ``mlp`` (linear, ReLU, linear); seeded init."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        if kind == "logreg":
            return torch.nn.Linear(in_features, num_classes)
        if kind == "mlp":
            return torch.nn.Sequential(torch.nn.Linear(in_features, hidden), torch.nn.ReLU(),
                                       torch.nn.Linear(hidden, num_classes))
        raise ValueError(f"unknown model {kind!r}: use logreg or mlp")
    finally:
        torch.random.set_rng_state(generator_state)

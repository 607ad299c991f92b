"""Built-in models: logistic regression and an MLP for tables, a small CNN for images, the
linear Cox model for survival (risk score ``x . beta``).

Every model takes a batch of flat feature rows ``(batch, features)``; the CNN reshapes its
rows into square single-channel images (``features`` must be a square, e.g. 64 pixels of
an 8x8 image). Your own ``torch.nn.Module`` works the same way through :mod:`fl.api`.
"""

from __future__ import annotations

import math

import torch

MODELS = ("logreg", "mlp", "cnn", "cox", "discrete-time")


def make_model(kind: str, in_features: int, num_classes: int, seed: int = 0,
               hidden: int = 16) -> torch.nn.Module:
    """``logreg``, ``mlp`` (linear, ReLU, linear), ``cnn``, or ``cox`` (the linear Cox model:
    one risk score ``x . beta`` per record, ``num_classes`` unused); seeded initialisation."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        if kind in ("logreg", "discrete-time"):  # discrete-time: logreg on person-periods
            return torch.nn.Linear(in_features, num_classes)
        if kind == "cox":
            # No bias: the partial likelihood is invariant to shifting every risk by one
            # constant, so a bias gets no gradient, and a server optimizer would only
            # amplify the rounding noise of its zero update (m / sqrt(v)).
            return torch.nn.Linear(in_features, 1, bias=False)
        if kind == "mlp":
            return torch.nn.Sequential(torch.nn.Linear(in_features, hidden), torch.nn.ReLU(),
                                       torch.nn.Linear(hidden, num_classes))
        if kind == "cnn":
            return image_cnn(in_features, num_classes)
        raise ValueError(f"unknown model {kind!r}: use one of {', '.join(MODELS)}")
    finally:
        torch.random.set_rng_state(generator_state)


def image_cnn(in_features: int, num_classes: int, channels: int = 8) -> torch.nn.Module:
    """conv 3x3 -> ReLU -> 2x2 max-pool -> linear over ``side x side`` grey images.

    Layers Opacus computes per-sample gradients for (Conv2d, Linear), no BatchNorm (its
    batch statistics would mix patients), so every privacy mode applies.
    """
    side = math.isqrt(in_features)
    if side * side != in_features or side < 2:
        raise ValueError(f"--model cnn needs square images: {in_features} features is not "
                         "side x side pixels (e.g. 64 for 8x8)")
    pooled = side // 2
    return torch.nn.Sequential(
        torch.nn.Unflatten(1, (1, side, side)),
        torch.nn.Conv2d(1, channels, kernel_size=3, padding=1), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Flatten(),
        torch.nn.Linear(channels * pooled * pooled, num_classes))

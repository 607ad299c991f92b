"""What the server does with a round's securely aggregated update (``--strategy``).

The secure sum decodes to the sample-weighted mean update ``delta = sum n_k delta_k /
sum n_k`` of the included sites (:func:`fl.contribution.decoder`); the server never sees one
site's update. Per strategy:

* ``fedavg``, ``fedprox``: ``x <- x + server_lr * delta`` (FedProx differs at the sites).
* ``scaffold`` (Karimireddy et al. 2020, Algorithm 1): each site's input is
  ``[n_k delta_y_k, n_k delta_c_k, n_k]``, so the control variates' deltas travel in the same
  secure sum as the model's; ``x <- x + server_lr * mean delta_y`` and ``c <- c + mean
  delta_c`` (the sample-weighted mean, the weighting of the objective; with every site
  included ``c`` stays the weighted mean of the sites' ``c_k``). A site adopts its new
  ``c_k`` only when the round's sum included it.
* ``fedadam``, ``fedyogi``, ``fedadagrad`` (Reddi et al. 2021, "Adaptive Federated
  Optimization", Algorithm 2): ``delta`` is the pseudo-gradient; ``m <- beta1 m + (1 -
  beta1) delta``; ``v`` by Adam's ``beta2 v + (1 - beta2) delta^2``, Yogi's ``v - (1 -
  beta2) delta^2 sign(v - delta^2)`` or Adagrad's ``v + delta^2``; ``x <- x + server_lr m /
  (sqrt(v) + tau)``. ``m`` and ``v`` start at zero and there is no bias correction, as in the
  paper's algorithm and FLamby's implementation.

The server applies them to the released sum only, so they add nothing to what secure
aggregation reveals, and under DP they are post-processing of the noised sum.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from fl.settings import TrainSettings

F64 = npt.NDArray[np.float64]
ADAPTIVE = ("fedadam", "fedyogi", "fedadagrad")


class ServerStrategy:
    """The server's state across rounds (moments, SCAFFOLD's control) and its step."""

    def __init__(self, kind: str, dim: int, *, lr: float = 1.0, beta1: float = 0.9,
                 beta2: float = 0.999, tau: float = 1e-8) -> None:
        self.kind = kind
        self.dim = dim
        self.lr = lr
        self.beta1 = beta1
        self.beta2 = beta2
        self.tau = tau
        self.m = np.zeros(dim)
        self.v = np.zeros(dim)
        self.control: F64 | None = np.zeros(dim) if kind == "scaffold" else None
        """SCAFFOLD's server control variate ``c`` (sent with the round's model)."""

    @classmethod
    def of(cls, settings: TrainSettings, dim: int) -> ServerStrategy:
        return cls(settings.strategy, dim, lr=settings.server_lr, beta1=settings.server_beta1,
                   beta2=settings.server_beta2, tau=settings.server_tau)

    def state(self) -> dict[str, Any]:
        """The state a checkpoint keeps (JSON): the moments of the adaptive optimizers."""
        return {"kind": self.kind, "m": self.m.tolist(), "v": self.v.tolist()}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state` of the same strategy and model size."""
        m = np.asarray(state.get("m", ()), dtype=np.float64)
        v = np.asarray(state.get("v", ()), dtype=np.float64)
        if state.get("kind") != self.kind or m.shape != (self.dim,) or v.shape != (self.dim,):
            raise ValueError(f"the checkpoint's server state is not that of strategy "
                             f"{self.kind} with {self.dim} parameters; use a new "
                             "--checkpoint directory")
        self.m, self.v = m, v

    @property
    def update_width(self) -> int:
        """Length of the decoded mean update: the model's, and SCAFFOLD's control's."""
        return 2 * self.dim if self.kind == "scaffold" else self.dim

    def step(self, weights: F64, update: F64) -> F64:
        """The next global weights from the current ones and the round's decoded mean
        update (length :attr:`update_width`)."""
        update = np.asarray(update, dtype=np.float64)
        if update.shape != (self.update_width,):
            raise ValueError(f"the decoded update has {update.shape} values; strategy "
                             f"{self.kind} expects {self.update_width}")
        if self.kind == "scaffold":
            assert self.control is not None
            self.control = self.control + update[self.dim:]
            return weights + self.lr * update[:self.dim]
        if self.kind not in ADAPTIVE:
            return weights + self.lr * update
        square = update * update
        self.m = self.beta1 * self.m + (1 - self.beta1) * update
        if self.kind == "fedadam":
            self.v = self.beta2 * self.v + (1 - self.beta2) * square
        elif self.kind == "fedyogi":
            self.v = self.v - (1 - self.beta2) * square * np.sign(self.v - square)
        else:
            self.v = self.v + square
        return weights + self.lr * self.m / (np.sqrt(self.v) + self.tau)

"""Bring your own model: federated training of your ``torch.nn.Module`` with secure
aggregation and differential privacy, in the spirit of Opacus' ``make_private``.

One object wraps a hospital's own objects and says what the site contributes::

    site = PrivateSite(module, optimizer, data_loader, patient_ids=ids)
    given = site.contribute(task)          # the uint64 vector secure aggregation sums

and :func:`train_federated` runs the rounds over simulated sites (the protocol over the
in-memory bus or the embedded MQTT broker, as ``secagg train`` does)::

    result = train_federated(global_model, [site_a, site_b, site_c], rounds=10,
                             dp="distributed", epsilon=4.0, delta=1e-5, test=(x, y))
    save_model("model.pt", result.model, result.report["model_info"])

What each privacy mode does with your objects (``task.mode``, :mod:`fl.contribution`):

* ``none``: local training with *your* optimizer and loss over *your* data loader for
  ``local_epochs`` passes (or your ``train_fn(module)`` once per epoch), FedProx's proximal
  term if ``fedprox_mu > 0``; the site contributes ``[n * delta, n]`` (weighted FedAvg).
* ``site``: DP-SGD with Opacus on a copy of the global model: Poisson-sampled patients,
  per-patient clipping, Gaussian noise; a fresh optimizer of *your* optimizer's class and
  settings (learning rate included) and *your* loss summed over the batch (DP-SGD must own
  the steps, so a ``train_fn`` or your optimizer's running state is not used).
* ``distributed``: one clipped gradient of *your* loss per sampled patient at the global
  model, and the site's share of discrete Gaussian noise in the integer domain.

The DP modes need per-sample gradients, so your module must be made of layers Opacus
supports (Linear, Conv, RNN, LayerNorm, ...; no BatchNorm), and your loss must be a torch
loss module with a ``reduction`` attribute (the DP modes sum it over a batch).

For secure sums of your own vectors without torch, :class:`fl.codec.FixedPointCodec` is
the float-to-``uint64`` encoding (see README, "Secure sums of your own floats").
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import DataLoader, TensorDataset

from fl.aggregation import open_aggregator
from fl.checkpoint import load_model, save_model
from fl.codec import FixedPointCodec
from fl.contribution import Contribution, RoundTask, decoder, round_task, site_input
from fl.coordinator import Coordinator
from fl.federation import make_plan, report
from fl.settings import TrainSettings
from fl.site.training import Site
from fl.vector import ParameterLayout
from secagg import Config

F64 = npt.NDArray[np.float64]
TrainFn = Callable[[torch.nn.Module], None]

__all__ = ["Contribution", "FederatedResult", "FixedPointCodec", "PrivateSite", "RoundTask",
           "decoder", "load_model", "round_task", "save_model", "train_federated"]


def _tensors(data_loader: DataLoader[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every ``(input, target)`` of the loader's dataset, stacked (the DP modes sample
    patients from them; a site's data fits in memory)."""
    dataset = data_loader.dataset
    if isinstance(dataset, TensorDataset):
        x, y = dataset.tensors[0], dataset.tensors[1]
    else:
        items = [dataset[i] for i in range(len(dataset))]  # type: ignore[arg-type]
        x = torch.stack([torch.as_tensor(item[0]) for item in items])
        y = torch.stack([torch.as_tensor(item[1]) for item in items])
    return x.float(), y.long()


class PrivateSite(Site):
    """A hospital's own module, optimizer and data loader as a federation site.

    ``patient_ids[i]`` is record ``i``'s patient (the privacy unit; default: every record
    its own patient). ``loss_fn`` defaults to cross-entropy; ``train_fn(module)``, if given,
    replaces the built-in loop in mode ``none`` (one call per local epoch).
    """

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 data_loader: DataLoader[Any], *, patient_ids: Sequence[Any] | None = None,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 train_fn: TrainFn | None = None, site_id: int = 1) -> None:
        self.site_id = site_id
        self.module = module
        self.optimizer = optimizer
        self.data_loader = data_loader
        self.loss_fn = loss_fn or torch.nn.CrossEntropyLoss()
        self.train_fn = train_fn
        self.x, self.y = _tensors(data_loader)
        n = len(self.y)
        if n == 0:
            raise ValueError(f"site {site_id}: the data loader's dataset is empty")
        ids = np.arange(n) if patient_ids is None else np.asarray(list(patient_ids))
        if ids.shape != (n,):
            raise ValueError(f"site {site_id}: {len(ids)} patient ids for {n} records")
        _, self.patient_ids = np.unique(ids, return_inverse=True)
        self._layout = ParameterLayout.of(module)

    @property
    def num_records(self) -> int:
        return len(self.y)

    @property
    def num_patients(self) -> int:
        return int(np.unique(self.patient_ids).size)

    def feature_sums(self) -> F64:
        raise NotImplementedError("a PrivateSite scales its own features")

    def dp_loss(self) -> torch.nn.Module:
        """Your loss with ``reduction="sum"`` (a copy; yours is left as it is)."""
        if not isinstance(self.loss_fn, torch.nn.Module) or not hasattr(self.loss_fn,
                                                                         "reduction"):
            raise ValueError(
                f"site {self.site_id}: the DP modes need a torch loss module with a "
                "'reduction' attribute (e.g. torch.nn.CrossEntropyLoss()), to sum per-record "
                f"losses before per-patient clipping; got {self.loss_fn!r}")
        loss = copy.copy(self.loss_fn)
        cast(Any, loss).reduction = "sum"  # a plain attribute of torch's loss modules
        return loss

    def dp_optimizer(self, params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
        """A fresh optimizer of your optimizer's class and settings (its learning rate
        included, as in mode ``none``) over the copy of the global model DP-SGD trains."""
        return type(self.optimizer)(params, **self.optimizer.defaults)

    def contribute(self, task: RoundTask, model: torch.nn.Module | None = None) -> Contribution:
        """What this site hands secure aggregation for ``task`` at the global ``model``
        (default: its own module's current weights)."""
        return site_input(self, self.module if model is None else model, task, self.site_id)

    def fedavg_update(self, model: torch.nn.Module, layout: ParameterLayout, *, epochs: int,
                      lr: float, batch_size: int, mu: float = 0.0, seed: int = 0,
                      steps: int | None = None, correction: F64 | None = None) -> F64:
        """``w_local - w_global`` after ``epochs`` passes of *your* loop (the task's ``lr``
        and ``batch_size`` are your optimizer's and loader's to decide)."""
        del lr, batch_size, seed
        if steps is not None or correction is not None:
            raise ValueError(f"site {self.site_id}: local_steps and strategy scaffold step "
                             "the built-in loop; a PrivateSite trains with its own loop "
                             "(use local_epochs and fedavg, fedprox or a server optimizer)")
        start = layout.to_vector(model)
        self._layout.load(self.module, start)  # refuses a module of another layout
        self.module.train()
        anchor = [p.detach().clone() for p in self.module.parameters() if p.requires_grad]
        for _ in range(epochs):
            if self.train_fn is not None:
                self.train_fn(self.module)
                continue
            for x, y in self.data_loader:
                self.optimizer.zero_grad(set_to_none=True)
                loss = self.loss_fn(self.module(x), y)
                if mu > 0:
                    trainable = [p for p in self.module.parameters() if p.requires_grad]
                    loss = loss + mu / 2 * sum(((p - a) ** 2).sum() for p, a in
                                               zip(trainable, anchor, strict=True))
                loss.backward()
                self.optimizer.step()
        delta = self._layout.to_vector(self.module) - start
        self._layout.load(self.module, start)
        return delta


@dataclass
class FederatedResult:
    """The trained global model and the run's report (``rounds``, ``model_info``, ...)."""

    model: torch.nn.Module
    report: dict[str, Any]


def train_federated(model: torch.nn.Module, sites: Sequence[PrivateSite], *, rounds: int,
                    dp: str = "none", epsilon: float | None = None, delta: float = 1e-5,
                    test: tuple[torch.Tensor, torch.Tensor] | None = None,
                    broker: str = "memory", log: Callable[[str], None] | None = None,
                    **options: Any) -> FederatedResult:
    """Train ``model`` (updated in place) over ``sites`` with secure aggregation every round.

    ``options`` are :class:`fl.settings.TrainSettings` fields: ``local_epochs``,
    ``fedprox_mu``, ``server_lr``, ``clip_norm``, ``sample_rate``, ``noise_multiplier``,
    ``unit``, ``site_steps``, ``max_units``, ``drop_rate``, ``seed``, ``lr`` (the DP modes'
    step size), ... The budget stops training before a round that would exceed ``epsilon``.
    """
    settings = TrainSettings(sites=len(sites), rounds=rounds, dp=dp, epsilon=epsilon,
                             delta=delta, broker=broker, **options)
    by_id = {i + 1: site for i, site in enumerate(sites)}
    for cid, site in by_id.items():
        site.site_id = cid
    layout = ParameterLayout.of(model)
    threshold = Config(num_clients=settings.cohort_size, dim=1).threshold
    plan = make_plan(settings, None, layout.size, threshold)
    say = log or (lambda text: None)
    say(f"privacy: {plan.describe()}")
    with open_aggregator(settings.broker, sorted(by_id)) as aggregator:
        coordinator = Coordinator(settings, model, by_id, test, plan, aggregator, log=say)
        coordinator.run()
    num_classes = int(torch.cat([s.y for s in sites]).max()) + 1
    out = report(settings, plan, threshold, layout.size, coordinator, model,
                 in_features=int(sites[0].x[0].numel()),
                 labels=[str(c) for c in range(num_classes)])
    out["model_info"]["model"] = None  # your own architecture: load it with your module
    out.pop("model", None)
    return FederatedResult(model, out)

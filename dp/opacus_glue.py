"""Site mode: each site runs DP-SGD with full local noise, on Opacus, at the patient level.

Follows Opacus' shape (one object wraps the user's model and optimizer; the accountant is a
separate object): :class:`SitePrivacyEngine` wraps the model in Opacus' ``GradSampleModule``
(per-record gradients, Abadi et al. 2016) and the optimizer in Opacus' ``DPOptimizer``
(clip, add Gaussian noise ``noise_multiplier * max_grad_norm``, average). Between the two it
regroups per-record gradients into per-unit sums (:mod:`dp.units`), so Opacus clips and
noises *patients*. Sampling is Poisson over units with rate ``sample_rate``; each step is one
step of the sampled Gaussian mechanism for the Opacus RDP/PRV accountants, and a
:class:`dp.budget.PrivacyBudget`, if given, refuses a round that would exceed it.

Needs torch and opacus (the ``torch`` extra).
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Sequence

import numpy as np
import torch
from opacus import GradSampleModule
from opacus.accountants import RDPAccountant
from opacus.optimizers import DPOptimizer
from torch.utils.data import Dataset

from dp.budget import GaussianRound, PrivacyBudget
from dp.errors import BudgetExceeded, PrivacyConfigError
from dp.randomness import RandomSource, SystemRandom
from dp.units import LossFn, UnitIndex, per_unit_gradients


class SitePrivacyEngine:
    """DP-SGD for one site with patient-level (or record-level) units.

    ``dataset[i]`` returns ``(input, target)`` tensors; ``patient_ids[i]`` is record i's
    patient. ``loss_fn`` must *sum* over records (``reduction="sum"``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: Dataset[tuple[torch.Tensor, torch.Tensor]],
        *,
        loss_fn: LossFn,
        noise_multiplier: float,
        max_grad_norm: float,
        sample_rate: float,
        patient_ids: Sequence[Hashable] | None = None,
        unit: str = "patient",
        budget: PrivacyBudget | None = None,
        source: RandomSource | None = None,
    ) -> None:
        if not noise_multiplier > 0 or not max_grad_norm > 0:
            raise PrivacyConfigError("noise_multiplier and max_grad_norm must be > 0")
        self.dataset = dataset
        self.index = UnitIndex(patient_ids, len(dataset), unit)  # type: ignore[arg-type]
        if not 0 < sample_rate <= 1:
            raise PrivacyConfigError(f"sample_rate must be in (0, 1], got {sample_rate}")
        self.sample_rate = sample_rate
        self.noise_multiplier = noise_multiplier
        self.loss_fn = loss_fn
        self.budget = budget
        self.source = source or SystemRandom()
        self.module = GradSampleModule(model, loss_reduction="sum")
        generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "big") >> 1)
        self.optimizer = DPOptimizer(
            optimizer, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
            expected_batch_size=max(1, round(sample_rate * self.index.num_units)),
            loss_reduction="mean", generator=generator,
        )
        self.accountant = RDPAccountant()

    def round_event(self, steps: int) -> GaussianRound:
        return GaussianRound(self.noise_multiplier, self.sample_rate, steps)

    def step(self) -> float:
        """One DP-SGD step over a Poisson sample of units; returns the summed loss."""
        units = self.index.sample(self.sample_rate, self.source)
        records, position = self.index.batch(units)
        self.optimizer.zero_grad(set_to_none=True)
        if len(records) == 0:
            loss = 0.0
            for p in self.module.parameters():  # no unit sampled: the step is pure noise
                if p.requires_grad:
                    p.grad_sample = torch.zeros((1, *p.shape), dtype=p.dtype)
        else:
            xs, ys = zip(*(self.dataset[int(i)] for i in records), strict=True)
            inputs, targets = torch.stack(list(xs)), torch.stack(list(ys))
            per_unit_gradients(self.module, self.loss_fn, inputs, targets, position, len(units))
            with torch.no_grad():
                loss = float(self.loss_fn(self.module(inputs), targets))
        self.optimizer.step()
        self.accountant.step(noise_multiplier=self.noise_multiplier,
                             sample_rate=self.sample_rate)
        return loss

    def train_round(self, local_steps: int = 1) -> tuple[float, float]:
        """Run ``local_steps`` steps if the budget affords them; returns spent (eps, delta).

        Raises :class:`BudgetExceeded` *before* training if the round does not fit.
        """
        event = self.round_event(local_steps)
        if self.budget is not None and not self.budget.can_run(event):
            raise BudgetExceeded(
                f"round of {local_steps} steps would exceed epsilon={self.budget.epsilon}; "
                "stop training here",
                epsilon_limit=self.budget.epsilon,
                epsilon_after=self.budget.epsilon_after(event),
            )
        for _ in range(local_steps):
            self.step()
        if self.budget is None:
            return (0.0, 0.0)
        return self.budget.spend(event)

    def epsilon(self, delta: float) -> float:
        """Epsilon spent by this site's steps so far (Opacus RDP accountant)."""
        return float(self.accountant.get_epsilon(delta=delta))

    @property
    def model(self) -> torch.nn.Module:
        return self.module._module


def unit_count(patient_ids: Sequence[Hashable]) -> int:
    """Number of distinct patients (helper for choosing ``sample_rate`` and ``delta``)."""
    return int(np.unique(np.asarray([hash(p) for p in patient_ids])).size)

"""DP-SGD with individual per-record sampling rates and clip norms (:mod:`dp.idp`), on Opacus.

Every record is its own Poisson coin at its group's rate (coins from the cryptographic
source, :mod:`dp.randomness`); Opacus' ``GradSampleModule`` computes per-record gradients;
each is clipped to its group's clip norm here, then Opacus' ``DPOptimizer`` (whose own clip,
at the largest group clip, is then a no-op) adds Gaussian noise of stddev ``z * C`` and
divides by the plan's expected batch size. Each rate group carries its own
:class:`dp.budget.PrivacyBudget` (the group's target), so no patient's budget is exceeded:
a round that would overshoot any group is refused before it runs.

Needs torch and opacus (the ``torch`` extra).
"""

from __future__ import annotations

import os

import numpy as np
import numpy.typing as npt
import torch
from opacus import GradSampleModule
from opacus.optimizers import DPOptimizer
from torch.utils.data import Dataset

from dp.budget import PrivacyBudget, RdpRound
from dp.errors import BudgetExceeded, PrivacyConfigError
from dp.idp import IdpPlan, poisson_sample
from dp.randomness import RandomSource, SystemRandom
from dp.units import LossFn, per_unit_gradients


class IdpSgd:
    """One site's DP-SGD under an :class:`dp.idp.IdpPlan`.

    ``record_group[i]`` is record i's rate group (``dp.idp.group_patients``; -1: beyond the
    cut-off, never sampled). ``loss_fn`` must *sum* over records (``reduction="sum"``).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 dataset: Dataset[tuple[torch.Tensor, torch.Tensor]], *, loss_fn: LossFn,
                 plan: IdpPlan, record_group: npt.NDArray[np.int64],
                 source: RandomSource | None = None) -> None:
        groups = np.asarray(record_group, dtype=np.int64)
        if groups.shape != (len(dataset),):  # type: ignore[arg-type]
            raise PrivacyConfigError(f"need one group per record ({len(dataset)}), got "  # type: ignore[arg-type]
                                     f"{groups.shape}")
        if groups.max(initial=-1) >= len(plan.groups) or groups.min(initial=0) < -1:
            raise PrivacyConfigError("record_group refers to a group the plan does not have")
        self.plan = plan
        self.dataset = dataset
        self.loss_fn = loss_fn
        self.record_group = groups
        rates = np.array([g.sample_rate for g in plan.groups] + [0.0])
        clips = np.array([g.clip_norm for g in plan.groups] + [0.0])
        self.rate = rates[groups]  # index -1 picks the trailing 0: never sampled
        self.clip = clips[groups]
        self.source: RandomSource = source or SystemRandom()
        self.module = GradSampleModule(model, loss_reduction="sum")
        top = max(g.clip_norm for g in plan.groups)
        generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "big") >> 1)
        self.optimizer = DPOptimizer(
            optimizer, noise_multiplier=plan.noise_multiplier * plan.clip_norm / top,
            max_grad_norm=top, expected_batch_size=max(1, round(plan.expected_batch_size)),
            loss_reduction="mean", generator=generator)
        self.budgets = [PrivacyBudget(g.target_epsilon, plan.delta) for g in plan.groups]
        self.steps_done = 0

    def step(self) -> float:
        """One step over a Poisson sample of records; returns the summed loss."""
        records = poisson_sample(self.rate, self.source)
        self.optimizer.zero_grad(set_to_none=True)
        loss = 0.0
        if len(records) == 0:
            for p in self.module.parameters():  # nothing sampled: the step is pure noise
                if p.requires_grad:
                    p.grad_sample = torch.zeros((1, *p.shape), dtype=p.dtype)
        else:
            xs, ys = zip(*(self.dataset[int(i)] for i in records), strict=True)
            inputs, targets = torch.stack(list(xs)), torch.stack(list(ys))
            per_unit_gradients(self.module, self.loss_fn, inputs, targets,
                               np.arange(len(records)), len(records))
            self._clip_each(torch.as_tensor(self.clip[records]))
            with torch.no_grad():
                loss = float(self.loss_fn(self.module(inputs), targets))
        self.optimizer.step()
        self.steps_done += 1
        return loss

    def _clip_each(self, clip: torch.Tensor) -> None:
        """Scale record i's gradient to norm at most ``clip[i]`` (its group's sensitivity)."""
        params = [p for p in self.module.parameters()
                  if getattr(p, "grad_sample", None) is not None]
        norms = torch.stack([p.grad_sample.reshape(len(p.grad_sample), -1).norm(dim=1)
                             for p in params], dim=1).norm(dim=1)
        factor = (clip.to(norms.dtype) / norms.clamp_min(1e-12)).clamp(max=1.0)
        for p in params:
            p.grad_sample = p.grad_sample * factor.view(-1, *([1] * (p.grad_sample.dim() - 1)))

    def _events(self, steps: int) -> list[RdpRound]:
        return [RdpRound.from_array(self.plan.group_rdp(g, steps), "idp")
                for g in self.plan.groups]

    def can_run(self, steps: int) -> bool:
        """Whether ``steps`` more steps keep every group within its target."""
        if self.plan.bound != "rdp":
            return self.steps_done + steps <= self.plan.steps
        return all(b.can_run(e) for b, e in zip(self.budgets, self._events(steps), strict=True))

    def train_round(self, steps: int) -> list[float]:
        """Run ``steps`` steps if every group affords them; returns each group's epsilon.

        Raises :class:`BudgetExceeded` *before* training if any group would overshoot.
        """
        if not self.can_run(steps):
            after = [self.plan.group_epsilon(g, self.steps_done + steps) for g in self.plan.groups]
            i = int(np.argmax([a - g.target_epsilon for a, g in zip(after, self.plan.groups,
                                                                     strict=True)]))
            g = self.plan.groups[i]
            raise BudgetExceeded(
                f"{steps} more steps would bring patients with {g.records} records to epsilon "
                f"{after[i]:.4g} > their target {g.target_epsilon:g}; stop training here",
                epsilon_limit=g.target_epsilon, epsilon_after=after[i])
        events = self._events(steps) if self.plan.bound == "rdp" else None
        for _ in range(steps):
            self.step()
        for budget, event in zip(self.budgets, events or [], strict=events is not None):
            budget.spend(event)
        return self.epsilons()

    def epsilons(self) -> list[float]:
        """Patient-level epsilon spent so far, per rate group."""
        if self.plan.bound == "rdp":
            return [b.spent[0] for b in self.budgets]
        return [self.plan.group_epsilon(g, self.steps_done) for g in self.plan.groups]

    @property
    def model(self) -> torch.nn.Module:
        return self.module._module

    def close(self) -> None:
        """Remove Opacus' hooks from the wrapped model."""
        self.module._close()

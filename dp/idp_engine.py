"""DP-SGD with individual per-record sampling rates and clip norms (:mod:`dp.idp`), on Opacus.

Every record is its own Poisson coin at its group's rate (coins from the cryptographic
source, :mod:`dp.randomness`); Opacus' ``GradSampleModule`` computes per-record gradients;
each is clipped to its group's clip norm here, then Opacus' ``DPOptimizer`` (whose own clip,
at the largest group clip, is then a no-op) adds Gaussian noise of stddev ``z * C`` drawn
from the same cryptographic source as the coins (as in site mode:
:class:`dp.opacus_glue.SecureNoiseOptimizer`) and divides by the operator's declared expected
batch (``expected_batch``, public) or not at all (the sum): never by the plan's record counts,
which are the site's own.
A :class:`dp.idp.GroupLedger` (one budget per rate group, at the group's target; shared
across rounds) refuses a round that would take any group past its target before it runs.

Needs torch and opacus (the ``torch`` extra).
"""

from __future__ import annotations

from typing import cast

import numpy as np
import numpy.typing as npt
import torch
from opacus import GradSampleModule
from torch.utils.data import Dataset, TensorDataset

from dp.errors import PrivacyConfigError
from dp.idp import GroupLedger, IdpPlan, poisson_sample
from dp.opacus_glue import SecureNoiseOptimizer
from dp.randomness import RandomSource, SystemRandom
from dp.units import LossFn, per_unit_gradients


class IdpSgd:
    """One site's DP-SGD under an :class:`dp.idp.IdpPlan`.

    ``record_group[i]`` is record i's rate group (``dp.idp.group_patients``; -1: beyond the
    cut-off, never sampled). ``loss_fn`` must *sum* over records (``reduction="sum"``).
    ``ledger`` carries the spending across rounds (a new one per engine by default).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 dataset: Dataset[tuple[torch.Tensor, ...]], *, loss_fn: LossFn,
                 plan: IdpPlan, record_group: npt.NDArray[np.int64],
                 source: RandomSource | None = None, ledger: GroupLedger | None = None,
                 expected_batch: float | None = None) -> None:
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
        if expected_batch is not None and not expected_batch > 0:
            raise PrivacyConfigError(f"expected_batch must be > 0 (the declared records per "
                                     f"step), got {expected_batch}")
        self.normaliser = 1.0 if expected_batch is None else float(expected_batch)
        # The noise from the engine's source (the kernel CSPRNG by default), as in site mode
        # (dp.opacus_glue.SecureNoiseOptimizer), never torch's Mersenne Twister.
        self.optimizer = SecureNoiseOptimizer(
            optimizer, noise_multiplier=plan.noise_multiplier * plan.clip_norm / top,
            max_grad_norm=top, expected_batch_size=self.normaliser,
            loss_reduction="sum" if expected_batch is None else "mean")
        self.optimizer.noise_source = self.source
        self.ledger = ledger or GroupLedger(plan)
        if self.ledger.plan is not plan:
            raise PrivacyConfigError("the ledger belongs to another plan")
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
            if isinstance(self.dataset, TensorDataset):  # index the tensors at once
                rows = torch.as_tensor(records)
                inputs, targets = self.dataset.tensors[0][rows], self.dataset.tensors[1][rows]
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

    def train_round(self, steps: int) -> list[float]:
        """Run ``steps`` steps if every group affords them; returns each group's epsilon.

        Raises :class:`BudgetExceeded` *before* training if any group would overshoot.
        """
        self.ledger.check(steps)
        for _ in range(steps):
            self.step()
        self.ledger.spend(steps)
        return self.ledger.epsilons()

    def epsilons(self) -> list[float]:
        """Patient-level epsilon spent so far, per rate group."""
        return self.ledger.epsilons()

    @property
    def model(self) -> torch.nn.Module:
        return cast(torch.nn.Module, self.module._module)

    def close(self) -> None:
        """Remove Opacus' hooks from the wrapped model."""
        self.module._close()

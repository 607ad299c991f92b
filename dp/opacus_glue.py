"""Site mode: each site runs DP-SGD with full local noise, on Opacus, at the patient level.

Follows Opacus' shape (one object wraps the user's model and optimizer; the accountant is a
separate object): :class:`SitePrivacyEngine` wraps the model in Opacus' ``GradSampleModule``
(per-record gradients, Abadi et al. 2016) and the optimizer in Opacus' ``DPOptimizer``
(clip, add Gaussian noise ``noise_multiplier * max_grad_norm``, average). Between the two it
regroups per-record gradients into per-unit sums (:mod:`dp.units`), so Opacus clips and
noises *patients*. Sampling is Poisson over units with rate ``sample_rate``; each step is one
step of the sampled Gaussian mechanism for the Opacus RDP/PRV accountants, and a
:class:`dp.budget.PrivacyBudget`, if given, refuses a round that would exceed it.

Noise: by default (``secure_noise=True``) the Gaussian noise comes from the kernel CSPRNG
(:func:`dp.randomness.secure_normal`: ``os.urandom``, Box-Muller, and the sum-of-four remedy
of Opacus' ``secure_mode`` against floating-point attacks) instead of torch's Mersenne
Twister; it costs 32 bytes of ``os.urandom`` per parameter per step (about 1 ms per 10^5
parameters here), affordable for every model this package trains.

The normaliser is public: the noised sum of clipped unit gradients is divided by
``expected_batch``, the operator's *declared* expected number of units per step (a public
parameter, ``--expected-batch``), or not divided at all (``expected_batch=None``: the sum; the
learning rate is then per unit). It is never computed from the site's records: Opacus' own
convention, ``sample_rate * len(dataset)``, makes the update's noise scale ``z C / round(q N)``
a function of the patient count N, so two neighbouring sites (42 and 43 patients at q = 0.2:
8 and 9) get different noise and the accounted epsilon no longer holds
(``tests/dp/test_public_parameters.py``).

Adaptive clipping (``target_quantile``; Andrew et al. 2021): every step also counts the
sampled units whose norm is within the clip, centred (``b - 1/2``), adds Gaussian noise
``count_stddev`` and moves the clip geometrically toward the target quantile; the noisy
fraction divides by the declared ``expected_batch``, which adaptive clipping therefore
needs. The count and the update use the same sample; together they are one Gaussian
mechanism whose noise multiplier is
:attr:`dp.budget.GaussianRound.effective_noise_multiplier` (Thm. 1), which is what the event
of :meth:`SitePrivacyEngine.round_event` accounts.

Needs torch and opacus (the ``torch`` extra).
"""

from __future__ import annotations

import math
import os
from collections.abc import Hashable, Sequence
from typing import cast

import torch
from opacus import GradSampleModule
from opacus.accountants import RDPAccountant
from opacus.optimizers import DPOptimizer
from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed
from torch.utils.data import Dataset

from dp.budget import GaussianRound, PrivacyBudget
from dp.errors import BudgetExceeded, PrivacyConfigError
from dp.randomness import RandomSource, SystemRandom, secure_normal
from dp.units import LossFn, UnitIndex, per_unit_gradients


class SecureNoiseOptimizer(DPOptimizer):  # type: ignore[misc]  # Opacus has no types
    """Opacus' ``DPOptimizer`` drawing its Gaussian noise from a cryptographic source."""

    noise_source: RandomSource

    def add_noise(self) -> None:
        std = self.noise_multiplier * self.max_grad_norm
        for p in self.params:
            _check_processed_flag(p.summed_grad)
            noise = secure_normal(self.noise_source, p.summed_grad.numel()) * std
            p.grad = (p.summed_grad + torch.as_tensor(noise, dtype=p.summed_grad.dtype)
                      .view_as(p.summed_grad)).view_as(p)
            _mark_as_processed(p.summed_grad)


class SitePrivacyEngine:
    """DP-SGD for one site with patient-level (or record-level) units.

    ``dataset[i]`` returns ``(input, target)`` tensors; ``patient_ids[i]`` is record i's
    patient. ``loss_fn`` must *sum* over records (``reduction="sum"``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: Dataset[tuple[torch.Tensor, ...]],
        *,
        loss_fn: LossFn,
        noise_multiplier: float,
        max_grad_norm: float,
        sample_rate: float,
        patient_ids: Sequence[Hashable] | None = None,
        unit: str = "patient",
        budget: PrivacyBudget | None = None,
        source: RandomSource | None = None,
        secure_noise: bool = True,
        target_quantile: float | None = None,
        count_stddev: float | None = None,
        clip_learning_rate: float = 0.2,
        expected_batch: float | None = None,
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
        if (target_quantile is None) != (count_stddev is None):
            raise PrivacyConfigError("adaptive clipping needs both target_quantile and "
                                     "count_stddev")
        if target_quantile is not None and not 0 < target_quantile < 1:
            raise PrivacyConfigError(f"target_quantile must be in (0, 1), got {target_quantile}")
        if count_stddev is not None and not count_stddev > 0:
            raise PrivacyConfigError(f"count_stddev must be > 0, got {count_stddev}")
        if expected_batch is not None and not (math.isfinite(expected_batch)
                                               and expected_batch > 0):
            raise PrivacyConfigError(f"expected_batch must be a positive number (the declared "
                                     f"units per step), got {expected_batch}")
        if target_quantile is not None and expected_batch is None:
            raise PrivacyConfigError(
                "adaptive clipping in site mode divides the noised clip count by the declared "
                "expected batch: pass expected_batch (--expected-batch B, a public figure, "
                "never the site's own count)")
        self.target_quantile = target_quantile
        self.count_stddev = count_stddev
        self.clip_learning_rate = clip_learning_rate
        generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "big") >> 1)
        cls = SecureNoiseOptimizer if secure_noise else DPOptimizer
        self.expected_batch = expected_batch
        self.optimizer = cls(
            optimizer, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
            expected_batch_size=self.normaliser,
            loss_reduction="mean" if expected_batch is not None else "sum",
            generator=generator,
        )
        if isinstance(self.optimizer, SecureNoiseOptimizer):
            self.optimizer.noise_source = self.source
        self.accountant = RDPAccountant()

    @property
    def normaliser(self) -> float:
        """What the noised sum is divided by: the declared expected batch, or 1 (the sum).
        A public figure: never read from the records."""
        return 1.0 if self.expected_batch is None else float(self.expected_batch)

    @property
    def noise_stddev(self) -> float:
        """Stddev of the noise on each coordinate of one step's update (before the learning
        rate): ``z C / normaliser``."""
        return self.noise_multiplier * self.clip_norm / self.normaliser

    def round_event(self, steps: int) -> GaussianRound:
        return GaussianRound(self.noise_multiplier, self.sample_rate, steps, self.count_stddev)

    @property
    def clip_norm(self) -> float:
        return float(self.optimizer.max_grad_norm)

    def _adapt_clip(self, num_units: int) -> None:
        """Andrew et al. 2021, Alg. 1: the noisy centred count of unclipped units (on this
        step's sample) moves the clip toward the target quantile for the next step."""
        assert self.target_quantile is not None and self.count_stddev is not None
        clip = self.clip_norm
        if num_units:
            norms = torch.stack([p.grad_sample.reshape(num_units, -1).norm(2, dim=1)
                                 for p in self.module.parameters()
                                 if p.requires_grad and p.grad_sample is not None],
                                dim=1).norm(2, dim=1)
            centred = float((norms <= clip).sum()) - num_units / 2
        else:
            centred = 0.0
        noisy = centred + float(secure_normal(self.source, 1)[0]) * self.count_stddev
        fraction = noisy / self.normaliser + 0.5
        self.optimizer.max_grad_norm = clip * math.exp(
            -self.clip_learning_rate * (fraction - self.target_quantile))

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
        clip = self.clip_norm
        if self.target_quantile is not None:
            self._adapt_clip(len(units))
            self.optimizer.max_grad_norm, next_clip = clip, self.clip_norm
        self.optimizer.step()
        if self.target_quantile is not None:
            self.optimizer.max_grad_norm = next_clip
        self.accountant.step(noise_multiplier=self.round_event(1).effective_noise_multiplier,
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
        return cast(torch.nn.Module, self.module._module)


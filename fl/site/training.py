"""A site (hospital): its records stay here; only its secure-aggregation input leaves.

The site trains on a private copy of the global model and returns a *float* update to the
federation code in the same process, which encodes it (:mod:`fl.codec`) and hands only the
encoded, masked vector to the transport. Three ways to compute the update, one per mode:

* :meth:`Site.fedavg_update`: FedAvg local epochs (or steps) of minibatch SGD (McMahan et
  al. 2017), optionally with the FedProx proximal term ``mu/2 ||w - w_global||^2`` (Li et al.
  2020); :meth:`Site.scaffold_update` adds SCAFFOLD's control variates.
* :meth:`Site.site_dp_update`: DP-SGD steps with Opacus at the patient level
  (:class:`dp.opacus_glue.SitePrivacyEngine`); the update is private before it leaves.
* :meth:`Site.unit_gradients`: one gradient per Poisson-sampled patient at the global model,
  for distributed DP (the site clips and noises them in :class:`fl.codec.DistributedCodec`).
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import TensorDataset

from fl.data import Table
from fl.site.idp import SiteIdp
from fl.vector import ParameterLayout

F64 = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Scaler:
    """Per-feature standardization, computed once for the whole federation."""

    mean: npt.NDArray[np.float64]
    std: npt.NDArray[np.float64]

    def apply(self, x: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        return ((x - self.mean) / self.std).astype(np.float32)


class Site:
    """One hospital's data and local training."""

    control: F64 | None = None
    """SCAFFOLD: this site's control variate ``c_i`` (None: zeros, before round 1)."""

    def __init__(self, site_id: int, table: Table, scaler: Scaler | None = None) -> None:
        if len(table) == 0:
            raise ValueError(f"site {site_id} has no records")
        self.site_id = site_id
        self.table = table
        x = table.x if scaler is None else scaler.apply(table.x)
        self.x = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
        self.y = torch.from_numpy(np.ascontiguousarray(table.y, dtype=np.int64))
        self.patient_ids = table.patient_ids
        self.idp: SiteIdp | None = None
        """``--unit patient-idp``: this site's rate groups and ledger (:mod:`fl.site.idp`)."""

    @property
    def num_records(self) -> int:
        return len(self.table)

    @property
    def num_patients(self) -> int:
        return self.table.num_patients

    def feature_sums(self) -> F64:
        """``[sum x, sum x^2, n]`` for the federation's secure scaler (raw features)."""
        x = self.table.x.astype(np.float64)
        return np.concatenate([x.sum(axis=0), (x * x).sum(axis=0), [float(len(x))]])

    def train_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The local training loss of mode ``none``, averaged over a batch: cross-entropy
        here; a survival site (:class:`fl.survival.CoxSite`) uses the Cox loss."""
        return torch.nn.functional.cross_entropy(outputs, targets)

    def batches(self, *, epochs: int, batch_size: int, seed: int,
                steps: int | None = None) -> list[torch.Tensor]:
        """The row indices of each local step: ``epochs`` seeded shuffles cut into batches,
        or with ``steps`` that many batches, reshuffling whenever a pass ends (FLamby's
        "local updates")."""
        generator = torch.Generator().manual_seed(seed)
        n = self.num_records
        out: list[torch.Tensor] = []
        passes = 0
        while (steps is None and passes < epochs) or (steps is not None and len(out) < steps):
            order = torch.randperm(n, generator=generator)
            out.extend(order[start:start + batch_size] for start in range(0, n, batch_size))
            passes += 1
        return out if steps is None else out[:steps]

    def fedavg_update(self, model: torch.nn.Module, layout: ParameterLayout, *, epochs: int,
                      lr: float, batch_size: int, mu: float = 0.0, seed: int = 0,
                      steps: int | None = None, correction: F64 | None = None) -> F64:
        """``w_local - w_global`` after ``epochs`` (or ``steps`` minibatches) of SGD: FedProx
        if ``mu > 0``; SCAFFOLD's drift correction ``c - c_i`` (a flat vector in ``layout``
        order) added to every gradient if ``correction`` is given (Karimireddy et al.
        2020)."""
        local = copy.deepcopy(model)
        local.train()
        anchor = [p.detach().clone() for p in local.parameters() if p.requires_grad]
        trainable = [p for p in local.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(trainable, lr=lr)
        shifts = None
        if correction is not None:
            shifts, offset = [], 0
            for p in trainable:
                chunk = correction[offset:offset + p.numel()]
                shifts.append(torch.from_numpy(chunk.copy()).reshape(p.shape).to(p.dtype))
                offset += p.numel()
        for rows in self.batches(epochs=epochs, batch_size=batch_size, seed=seed, steps=steps):
            optimizer.zero_grad(set_to_none=True)
            loss = self.train_loss(local(self.x[rows]), self.y[rows])
            if mu > 0:
                # FedProx keeps heterogeneous sites from drifting far from the global model.
                prox = sum(((p - a) ** 2).sum() for p, a in zip(trainable, anchor, strict=True))
                loss = loss + mu / 2 * prox
            torch.autograd.backward(loss)  # loss.backward(), which torch leaves untyped
            if shifts is not None:
                for p, shift in zip(trainable, shifts, strict=True):
                    assert p.grad is not None
                    p.grad.add_(shift)
            optimizer.step()
        return layout.to_vector(local) - layout.to_vector(model)

    def scaffold_update(self, model: torch.nn.Module, layout: ParameterLayout, *,
                        server_control: F64, epochs: int, lr: float, batch_size: int,
                        seed: int = 0, steps: int | None = None) -> tuple[F64, F64]:
        """SCAFFOLD's local round (Karimireddy et al. 2020, Algorithm 1, option II):
        ``(delta_y, c_i+)``: the model update after corrected SGD steps and the site's next
        control variate ``c_i - c + (x - y) / (K lr)``. The site's :attr:`control` is not
        changed here: :meth:`commit_control` adopts ``c_i+`` once the round's sum is used."""
        control = self.control if self.control is not None else np.zeros(layout.size)
        k = len(self.batches(epochs=epochs, batch_size=batch_size, seed=seed, steps=steps))
        delta = self.fedavg_update(model, layout, epochs=epochs, lr=lr, batch_size=batch_size,
                                   seed=seed, steps=steps, correction=server_control - control)
        return delta, control - server_control - delta / (k * lr)

    def commit_control(self, control: F64) -> None:
        """Adopt the control variate of a round whose secure sum included this site."""
        self.control = np.asarray(control, dtype=np.float64).copy()

    def dp_loss(self) -> torch.nn.Module:
        """The loss of the DP modes, summed over a batch (per-unit clipping needs each
        record's own gradient, not a mean): cross-entropy here; a site of your own
        (:class:`fl.api.PrivateSite`) uses its loss."""
        return torch.nn.CrossEntropyLoss(reduction="sum")

    def dp_optimizer(self, params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
        """The optimizer DP-SGD steps with in site mode: plain SGD at the task's ``lr``; a
        site of your own uses its optimizer's class and settings."""
        return torch.optim.SGD(params, lr=lr)

    def site_dp_update(self, model: torch.nn.Module, layout: ParameterLayout, *,
                       noise_multiplier: float, clip_norm: float, sample_rate: float,
                       steps: int, lr: float, unit: str = "patient",
                       target_quantile: float | None = None,
                       count_stddev: float | None = None,
                       round_number: int | None = None,
                       expected_batch: float | None = None) -> F64:
        """``w_local - w_global`` after ``steps`` DP-SGD steps (Poisson-sampled patients);
        with ``target_quantile``/``count_stddev``, private adaptive clipping per step. The
        noised sum is divided by ``expected_batch`` (declared, public) or not at all.
        ``unit="patient-idp"``: this site's own rates and noise (:mod:`fl.site.idp`) instead."""
        if unit == "patient-idp":
            if self.idp is None:
                raise ValueError(f"site {self.site_id}: --unit patient-idp needs the site's "
                                 "plan (fl.plan.idp.configure)")
            return self.idp.update(self, model, layout, steps=steps, lr=lr,
                                   round_number=round_number, expected_batch=expected_batch)

        from dp import SitePrivacyEngine

        local = copy.deepcopy(model)
        local.train()
        optimizer = self.dp_optimizer([p for p in local.parameters() if p.requires_grad], lr)
        engine = SitePrivacyEngine(
            local, optimizer, TensorDataset(self.x, self.y),
            loss_fn=self.dp_loss(),
            noise_multiplier=noise_multiplier, max_grad_norm=clip_norm,
            sample_rate=sample_rate, patient_ids=self.patient_ids.tolist(), unit=unit,
            target_quantile=target_quantile, count_stddev=count_stddev,
            expected_batch=expected_batch)
        with warnings.catch_warnings():  # inputs need no grad; Opacus' hook warns about it
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(steps):
                engine.step()
        update = layout.to_vector(engine.model) - layout.to_vector(model)
        engine.module._close()
        return update

    def unit_gradients(self, model: torch.nn.Module, *, sample_rate: float,
                       unit: str = "patient") -> F64:
        """Per-unit gradients (``(units, d)``) of the loss at the global model for a Poisson
        sample of units (coins from ``os.urandom``: the sample must stay secret)."""
        from dp import UnitIndex, site_unit_gradients

        ids = self.patient_ids.tolist() if unit == "patient" else None
        index = UnitIndex(ids, self.num_records, unit)
        units = index.sample(sample_rate)
        records, _ = index.batch(units)
        if len(records) == 0:
            return np.zeros((0, sum(e.numel for e in ParameterLayout.of(model).entries)))
        rec = torch.as_tensor(records, dtype=torch.long)
        local = copy.deepcopy(model)
        local.train()  # Opacus captures activations only in training mode
        with warnings.catch_warnings():  # inputs need no grad; Opacus' hook warns about it
            warnings.simplefilter("ignore", UserWarning)
            _, rows = site_unit_gradients(
                local, self.dp_loss(), self.x[rec], self.y[rec],
                self.patient_ids[records].tolist() if unit == "patient" else None, unit)
        return rows

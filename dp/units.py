"""Privacy units: all records of one patient are one unit (docs/architecture.md section 6).

Opacus computes per-*record* gradients (``GradSampleModule``); it does not group. Grouping
is done here: per-record gradients are summed per patient *before* clipping, so one patient
with many records still moves the update by at most the clip norm. Sampling draws patients,
not rows (Poisson, with coins from the cryptographic source, as amplification by subsampling
assumes the sample is secret). ``unit="record"`` makes every row its own unit.

Needs torch (the ``torch`` extra); ``import dp`` does not import this module.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable, Sequence
from typing import cast

import numpy as np
import numpy.typing as npt
import torch
from opacus import GradSampleModule

from dp.encoding import finite_units
from dp.errors import PrivacyConfigError
from dp.randomness import RandomSource, SystemRandom, uniform_words

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class UnitIndex:
    """Maps records to privacy units (``unit="patient"``: by patient id; ``"record"``: by row)."""

    def __init__(self, unit_ids: Sequence[Hashable] | None, num_records: int,
                 unit: str = "patient") -> None:
        if unit not in ("patient", "record"):
            raise PrivacyConfigError(f"unit must be 'patient' or 'record', got {unit!r}")
        if unit == "patient":
            if unit_ids is None or len(unit_ids) != num_records:
                raise PrivacyConfigError(
                    "unit='patient' needs one patient id per record (got "
                    f"{None if unit_ids is None else len(unit_ids)} for {num_records} records); "
                    "pass patient_ids, or use unit='record'"
                )
            keys = list(dict.fromkeys(unit_ids))
        else:
            keys = list(range(num_records))
            unit_ids = keys
        position = {k: i for i, k in enumerate(keys)}
        self.unit = unit
        self.keys: list[Hashable] = keys
        self.record_unit = np.fromiter((position[u] for u in unit_ids), dtype=np.int64,
                                       count=num_records)
        order = np.argsort(self.record_unit, kind="stable")
        bounds = np.searchsorted(self.record_unit[order], np.arange(len(keys) + 1))
        self.records_of = [order[bounds[i]:bounds[i + 1]] for i in range(len(keys))]

    @property
    def num_units(self) -> int:
        return len(self.keys)

    def sample(self, rate: float, source: RandomSource | None = None) -> npt.NDArray[np.int64]:
        """Poisson sampling of units: each unit independently with probability ``rate``."""
        if not 0 < rate <= 1:
            raise PrivacyConfigError(f"sample rate must be in (0, 1], got {rate}")
        u = (uniform_words(source or SystemRandom(), self.num_units) >> np.uint64(11))
        return np.flatnonzero(u.astype(np.float64) / 2.0**53 < rate)

    def batch(self, units: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.int64],
                                                          npt.NDArray[np.int64]]:
        """Record indices of ``units`` and, per record, the position of its unit in ``units``."""
        if len(units) == 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        recs = [self.records_of[u] for u in units]
        pos = np.concatenate([np.full(len(r), i) for i, r in enumerate(recs)])
        return np.concatenate(recs), pos


def regroup_grad_samples(module: GradSampleModule, position: torch.Tensor,
                         num_units: int) -> None:
    """Replace each parameter's per-record ``grad_sample`` by per-unit sums (before clipping)."""
    for p in module.parameters():
        gs = getattr(p, "grad_sample", None)
        if gs is None:
            continue
        if isinstance(gs, list):
            gs = torch.cat(gs, dim=0)
        grouped = torch.zeros((num_units, *gs.shape[1:]), dtype=gs.dtype, device=gs.device)
        p.grad_sample = grouped.index_add_(0, position.to(gs.device), gs)


def per_unit_gradients(module: GradSampleModule, loss_fn: LossFn, inputs: torch.Tensor,
                       targets: torch.Tensor, position: npt.NDArray[np.int64],
                       num_units: int) -> None:
    """Forward/backward with a summed loss, then group per unit into ``p.grad_sample``; a
    unit whose gradient has a NaN or an infinity gets a zero one
    (:func:`dp.encoding.finite_units`: the rule distributed DP applies to its rows)."""
    if module.loss_reduction != "sum":
        raise PrivacyConfigError("wrap the model with GradSampleModule(loss_reduction='sum')")
    module.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        # Opacus' per-sample hooks are full backward hooks; on a first layer whose inputs
        # need no gradient (the data) torch warns on every backward, though the hooks
        # capture exactly the per-sample gradients they should (tests/dp/test_units.py)
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        loss = loss_fn(module(inputs), targets)
        loss.backward()  # type: ignore[no-untyped-call]
    regroup_grad_samples(module, torch.as_tensor(position, dtype=torch.long), num_units)
    grads = [p.grad_sample for p in module.parameters()
             if getattr(p, "grad_sample", None) is not None]
    finite = np.ones(num_units, dtype=bool)
    for g in grads:
        finite &= finite_units(g.detach().cpu())
    if not finite.all():
        for g in grads:
            g[torch.as_tensor(~finite, device=g.device)] = 0


def flat_unit_gradients(module: GradSampleModule) -> npt.NDArray[np.float64]:
    """``(num_units, d)`` matrix of the grouped per-unit gradients (flattened parameters)."""
    rows = [p.grad_sample.reshape(p.grad_sample.shape[0], -1)
            for p in module.parameters() if getattr(p, "grad_sample", None) is not None]
    return cast(npt.NDArray[np.float64], torch.cat(rows, dim=1).detach().double().cpu().numpy())


def clipped_unit_sum(grads: npt.NDArray[np.float64], clip_norm: float) -> npt.NDArray[np.float64]:
    """Sum of the per-unit gradients, each clipped to L2 norm ``clip_norm`` (sensitivity C)."""
    norms = np.linalg.norm(grads, axis=1, keepdims=True)
    return cast(npt.NDArray[np.float64],
                (grads * np.minimum(1.0, clip_norm / np.maximum(norms, 1e-300))).sum(axis=0))


def site_unit_gradients(model: torch.nn.Module | GradSampleModule, loss_fn: LossFn,
                        inputs: torch.Tensor, targets: torch.Tensor,
                        unit_ids: Sequence[Hashable] | None, unit: str = "patient"
                        ) -> tuple[list[Hashable], npt.NDArray[np.float64]]:
    """Distributed mode, site side: per-unit gradient rows for :class:`dp.encoding.IntegerEncoder`.

    Returns the unit keys and a ``(units, d)`` matrix (unclipped; ``encode_units`` clips).
    ``loss_fn`` must sum over records (e.g. ``CrossEntropyLoss(reduction="sum")``).
    """
    owned = not isinstance(model, GradSampleModule)
    gsm = GradSampleModule(model, loss_reduction="sum") if owned else model
    try:
        index = UnitIndex(unit_ids, len(inputs), unit)
        per_unit_gradients(gsm, loss_fn, inputs, targets, index.record_unit, index.num_units)
        rows = flat_unit_gradients(gsm)
        gsm.zero_grad(set_to_none=True)
        return index.keys, rows
    finally:
        if owned:
            gsm._close()  # type: ignore[operator]  # remove Opacus' hooks (caller's model unchanged)

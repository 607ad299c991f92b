"""Survival analysis: FLamby's Fed-TCGA-BRCA, the linear Cox model, its loss and the C-index.

The data (bundled in ``fl/datasets/tcga_brca/``, attribution and terms in
docs/results.md section "Fed-TCGA-BRCA") are TCGA breast-cancer clinical records of 1,088
patients, 39 features, an event indicator ``E`` and a time ``T``, split by FLamby (Ogier du
Terrail et al. 2022) into 6 natural centers, the regions of the patients' tissue source
sites, each with a static train/test split. Site ``k + 1`` of a federation is FLamby's
center ``k`` (:data:`CENTERS` names its region). Features are used as FLamby gives them (no
scaling), so results compare with FLamby's.

* :func:`cox_loss`: the negative Cox partial log-likelihood with Breslow's handling of ties,
  averaged over the batch (FLamby's normalisation: a sum over events divided by the batch
  size).
* :func:`concordance_index`: Harrell's C-index of risk scores (higher risk, earlier event),
  with lifelines' conventions for ties.
* :class:`CoxSite`: a site whose local training minimises :func:`cox_loss`.
* :func:`person_period`: the discrete-time formulation (Andreux et al. 2020, the
  preprocessing FLamby's data come from): one row per patient and time interval at risk,
  label "event in this interval", features ``[x, interval one-hot]``; a logistic model on
  these rows is a discrete-time proportional-odds survival model whose loss is a *sum of
  per-patient terms*, so per-patient clipping bounds one patient's influence and the
  package's patient-level DP modes apply as they are (``--model discrete-time``).
"""

from __future__ import annotations

import copy

import numpy as np
import numpy.typing as npt
import torch

from fl.data import (  # noqa: F401  (the dataset, re-exported beside its task)
    CENTERS,
    DATA_DIR,
    NUM_FEATURES,
    DataError,
    Table,
    TcgaBrca,
    pooled,
    tcga_brca,
)
from fl.site.training import Scaler, Site

INTERVAL_EDGES = tuple(365.25 * year for year in range(11))
"""Public interval boundaries of the discrete-time model, in days: years 1 to 10, then one
open interval beyond 10 years (11 intervals)."""
AGE_SCALE = 100.0
"""``--model discrete-time`` puts age (column 0, years) on a public scale: age / 100. The
other 38 features are 0/1 indicators. No statistic of the data is used (nothing released)."""


def targets(table: Table) -> torch.Tensor:
    """``(n, 2)`` float tensor of ``[event, time]`` per record (FLamby's target layout)."""
    if table.times is None:
        raise DataError(f"{table.name}: not a survival table (no times)")
    return torch.from_numpy(np.stack([table.y.astype(np.float64), table.times], axis=1))


def cox_loss(risk: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Negative Cox partial log-likelihood of a batch, Breslow ties, divided by the batch
    size: ``(1/n) sum_{i: E_i = 1} [log sum_{j: T_j >= T_i} exp(r_j) - r_i]``. ``risk``:
    the model's ``(n, 1)`` or ``(n,)`` scores; ``target``: ``(n, 2)`` ``[E, T]``."""
    r = risk.reshape(-1)
    events = target[:, 0].to(r.dtype)
    times = target[:, 1]
    at_risk = times.reshape(1, -1) >= times.reshape(-1, 1)  # [i, j]: j is in i's risk set
    scores = r.reshape(1, -1).expand(len(r), -1).masked_fill(~at_risk, float("-inf"))
    return (events * (torch.logsumexp(scores, dim=1) - r)).sum() / len(r)


def concordance_index(times: npt.ArrayLike, risk: npt.ArrayLike,
                      events: npt.ArrayLike) -> float:
    """Harrell's C: among comparable pairs (``i`` had the event and ``j`` outlived it:
    ``T_i < T_j``, or ``T_i == T_j`` with ``j`` censored), the share where ``i`` has the
    higher risk, ties in risk counting one half (lifelines' ``concordance_index`` of the
    negated risk). Raises :class:`fl.data.DataError` when no pair is comparable."""
    t = np.asarray(times, dtype=np.float64).reshape(-1)
    r = np.asarray(risk, dtype=np.float64).reshape(-1)
    e = np.asarray(events).reshape(-1).astype(bool)
    if not len(t) == len(r) == len(e):
        raise DataError(f"{len(t)} times, {len(r)} risks and {len(e)} events: need one each "
                        "per record")
    ti, tj = t[:, None], t[None, :]
    comparable = e[:, None] & ((ti < tj) | ((ti == tj) & ~e[None, :]))
    pairs = int(comparable.sum())
    if pairs == 0:
        raise DataError("no comparable pair (no event before another record's time): the "
                        "C-index is undefined")
    higher = (r[:, None] > r[None, :]) & comparable
    tied = (r[:, None] == r[None, :]) & comparable
    return float((higher.sum() + 0.5 * tied.sum()) / pairs)


def evaluate_cox(model: torch.nn.Module, x: torch.Tensor, target: torch.Tensor,
                 discrete_time: bool = False) -> tuple[float, float]:
    """``(C-index, Cox loss)`` of ``model``'s risk scores on a survival test set (of
    :func:`discrete_time_risk` if ``discrete_time``)."""
    model.eval()
    with torch.no_grad():
        risk = (discrete_time_risk(model, x) if discrete_time else model(x)).reshape(-1)
        loss = float(cox_loss(risk.double(), target.double()))
    return concordance_index(target[:, 1].numpy(), risk.numpy(), target[:, 0].numpy()), loss


class CoxSite(Site):
    """A hospital of a survival federation: targets ``[E, T]``, local loss :func:`cox_loss`
    (mode ``none``; the DP modes are refused for survival data by
    :class:`fl.settings.TrainSettings`: the partial likelihood couples the patients of a
    batch, so per-patient clipping does not bound one patient's influence)."""

    def __init__(self, site_id: int, table: Table, scaler: Scaler | None = None) -> None:
        super().__init__(site_id, table, scaler)
        self.y = targets(table).to(torch.float32)

    def train_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return cox_loss(outputs, targets)


def train_single_centric(model: torch.nn.Module, table: Table, *, epochs: int = 30,
                         lr: float = 0.1, batch_size: int = 8, seed: int = 0
                         ) -> torch.nn.Module:
    """FLamby's single-centric baseline (pooled training, or one center alone): Adam at
    ``lr`` over ``epochs`` seeded shuffles in batches of ``batch_size``, Cox loss; returns
    a trained copy of ``model``."""
    site = CoxSite(0, table)
    local = copy.deepcopy(model)
    local.train()
    optimizer = torch.optim.Adam(local.parameters(), lr=lr)
    for rows in site.batches(epochs=epochs, batch_size=batch_size, seed=seed):
        optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(site.train_loss(local(site.x[rows]), site.y[rows]))
        optimizer.step()
    return local


def public_scale(table: Table) -> Table:
    """``table`` with age divided by :data:`AGE_SCALE` (a public constant), marked
    standardized (on a public scale: no secure scaler)."""
    x = table.x.copy()
    x[:, 0] = x[:, 0] / AGE_SCALE
    return Table(x, table.y, table.patient_ids, table.num_classes, table.name, True,
                 table.budgets, table.times)


def person_period(table: Table) -> Table:
    """The discrete-time rows of a survival table (features publicly scaled): a patient
    whose time falls in interval ``k`` (of :data:`INTERVAL_EDGES`) has rows ``0..k``, each
    ``[x, one-hot(j)]`` with label 1 only in row ``k`` and only if the event was observed;
    every row keeps the patient's id (the privacy unit)."""
    if table.times is None:
        raise DataError(f"{table.name}: not a survival table (no times)")
    scaled = public_scale(table)
    edges = np.asarray(INTERVAL_EDGES[1:])
    last = np.searchsorted(edges, table.times, side="right")  # interval of each time
    rows = np.repeat(np.arange(len(table)), last + 1)
    interval = np.concatenate([np.arange(k + 1) for k in last])
    onehot = np.eye(len(INTERVAL_EDGES), dtype=np.float32)[interval]
    labels = ((interval == last[rows]) & (table.y[rows] == 1)).astype(np.int64)
    return Table(np.hstack([scaled.x[rows], onehot]), labels, table.patient_ids[rows], 2,
                 f"{table.name}-person-period", True)


def discrete_time_risk(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A discrete-time model's risk score of each patient (features publicly scaled): the
    covariate part of the hazard's log-odds, ``x . (w_event - w_no_event)``; the intervals'
    baseline is common to every patient, so it does not change the ranking."""
    weight = next(p for name, p in model.named_parameters() if name.endswith("weight"))
    beta = (weight[1] - weight[0])[:x.shape[1]]
    return x @ beta

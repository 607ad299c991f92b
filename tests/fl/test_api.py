"""Bring your own model (``fl.api``): a user-defined torch module, its optimizer and data
loaders train through secure aggregation with distributed DP, and the saved model loads
back in one line of plain torch."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from fl.api import PrivateSite, RoundTask, load_model, save_model, train_federated
from fl.checkpoint import CheckpointError

pytestmark = pytest.mark.timeout(120)


class TwoBranchNet(torch.nn.Module):
    """Not a built-in: two branches over the features, summed, then a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.left = torch.nn.Linear(6, 8)
        self.right = torch.nn.Linear(6, 8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.left(x)) + torch.relu(self.right(x)))


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype(np.float32)
    y = (x[:, 0] > 0.4).astype(np.int64) + (x[:, 1] + x[:, 2] > 0.5).astype(np.int64)
    return torch.from_numpy(x), torch.from_numpy(y)


def _site(seed: int, n: int = 150) -> PrivateSite:
    torch.manual_seed(seed)
    module = TwoBranchNet()
    x, y = _data(n, seed)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    # Each hospital's records come two per patient: the privacy unit is the patient.
    return PrivateSite(module, torch.optim.Adam(module.parameters(), lr=0.02), loader,
                       patient_ids=[f"p{seed}-{i // 2}" for i in range(n)])


def _accuracy(model: torch.nn.Module, test: tuple[torch.Tensor, torch.Tensor]) -> float:
    with torch.no_grad():
        return float((model(test[0]).argmax(1) == test[1]).float().mean())


def test_user_model_trains_with_secure_aggregation_and_dp_and_loads_back(
        tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TwoBranchNet()
    test = _data(400, 99)
    before = _accuracy(model, test)
    sites = [_site(seed) for seed in (1, 2, 3)]
    result = train_federated(model, sites, rounds=4, dp="distributed", epsilon=30.0,
                             delta=1e-5, test=test, sample_rate=0.5, lr=1.0, clip_norm=1.0,
                             unit="patient", max_units=200, broker="memory")
    rows = result.report["rounds"]
    assert len(rows) == 4
    assert all(r["aggregate_correct"] is True and r["included"] == [1, 2, 3] for r in rows)
    assert 0 < rows[-1]["epsilon"] <= 30.0 and rows[0]["epsilon"] < rows[-1]["epsilon"]
    assert result.model is model and _accuracy(model, test) > before + 0.1

    path = tmp_path / "model.pt"
    meta_path = save_model(path, model, result.report["model_info"])
    plain = TwoBranchNet()
    plain.load_state_dict(torch.load(path))  # the one line a torch user writes
    assert _accuracy(plain, test) == _accuracy(model, test)
    again, meta = load_model(path, TwoBranchNet())
    assert torch.equal(again.head.weight, model.head.weight)
    assert meta["layout"][0] == {"name": "left.weight", "shape": [8, 6],
                                 "dtype": "torch.float32"} and meta_path.exists()
    with pytest.raises(CheckpointError, match="user-defined"):
        load_model(path)  # no built-in to rebuild: the caller brings the module
    with pytest.raises(CheckpointError, match="differ from the saved layout"):
        load_model(path, torch.nn.Linear(6, 3))


def test_a_site_contributes_with_its_own_optimizer_or_train_function() -> None:
    site = _site(5, n=40)
    task = RoundTask(mode="none", round=1, cohort=3, seed=0, local_epochs=2)
    before = [p.detach().clone() for p in site.module.parameters()]
    given = site.contribute(task)
    assert given.vector.dtype == np.uint64 and given.vector.size == 6 * 8 * 2 + 16 + 8 * 3 + 3 + 1
    assert given.count == 40  # weighted FedAvg: the site's record count rides along
    # The site's module is back at the global weights after contributing.
    assert all(torch.equal(a, b) for a, b in zip(before, site.module.parameters(), strict=True))
    assert len(site.optimizer.state) > 0  # Adam's state: the user's optimizer stepped

    # Site mode: Opacus DP-SGD on a copy of the global model; the count is only "one site".
    private = site.contribute(RoundTask(mode="site", round=1, cohort=3, seed=0,
                                        noise_multiplier=1.0, clip_norm=1.0, sample_rate=0.3,
                                        steps=2, lr=0.5))
    assert private.count == 1 and private.vector.view(np.int64)[-1] == 2**24
    assert all(torch.equal(a, b) for a, b in zip(before, site.module.parameters(), strict=True))

    calls: list[int] = []

    def train_fn(module: torch.nn.Module) -> None:
        calls.append(1)
        with torch.no_grad():
            module.head.bias.add_(1.0)

    custom = PrivateSite(TwoBranchNet(), torch.optim.SGD([torch.zeros(1)], lr=0.1),
                         site.data_loader, train_fn=train_fn)
    delta_task = RoundTask(mode="none", round=1, cohort=3, seed=0, local_epochs=3)
    layout_vector = custom.contribute(delta_task).vector.view(np.int64) / 2**24
    assert len(calls) == 3
    # Only the head bias moved, by 3.0, weighted by the 40 records.
    assert np.allclose(layout_vector[-4:-1], 3.0 * 40) and np.allclose(layout_vector[:-4], 0)


def test_the_cnn_learns_bundled_digits_and_its_site_gradients_are_per_patient() -> None:
    """The image path: scikit-learn's 8x8 digits through the built-in CNN (mode none), and
    one clipped gradient per sampled image for distributed DP (Opacus handles the conv)."""
    from fl.data import digits
    from fl.federation import train
    from fl.models import make_model
    from fl.settings import TrainSettings
    from fl.site.training import Site

    report = train(TrainSettings(sites=3, rounds=1, dataset="digits", model="cnn",
                                 broker="memory", lr=0.5))
    assert report["final_accuracy"] > 0.5  # ten classes: chance is 0.1
    table = digits()
    model = make_model("cnn", 64, 10)
    rows = Site(1, table.subset(np.arange(40))).unit_gradients(model, sample_rate=1.0)
    assert rows.shape == (40, sum(p.numel() for p in model.parameters()))


class _CountingLoss(torch.nn.CrossEntropyLoss):
    reductions: ClassVar[list[str]] = []

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        _CountingLoss.reductions.append(self.reduction)
        return super().forward(input, target)


class _CountingSGD(torch.optim.SGD):
    steps = 0

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        _CountingSGD.steps += 1
        return super().step(closure)


def test_the_dp_modes_use_the_sites_own_loss_and_optimizer() -> None:
    """Site mode steps with a fresh optimizer of the user's class and settings and the
    user's loss summed over the batch; distributed mode's per-patient gradients use the
    same loss; the user's loss object is left as it was; a loss without ``reduction`` is
    refused with a message that says what to pass."""
    x, y = _data(40, 9)
    module = TwoBranchNet()
    loss = _CountingLoss()
    site = PrivateSite(module, _CountingSGD(module.parameters(), lr=0.05),
                       DataLoader(TensorDataset(x, y), batch_size=8), loss_fn=loss,
                       patient_ids=[i // 2 for i in range(40)])
    _CountingLoss.reductions.clear()
    _CountingSGD.steps = 0
    site.contribute(RoundTask(mode="site", round=1, cohort=3, seed=0, noise_multiplier=1.0,
                              clip_norm=1.0, sample_rate=0.5, steps=3, lr=0.5))
    assert _CountingSGD.steps == 3
    assert _CountingLoss.reductions and set(_CountingLoss.reductions) == {"sum"}
    assert loss.reduction == "mean"
    _CountingLoss.reductions.clear()
    rows = site.unit_gradients(site.module, sample_rate=1.0)  # distributed mode's input
    assert rows.shape[0] == 20 and set(_CountingLoss.reductions) == {"sum"}

    bare = PrivateSite(TwoBranchNet(), torch.optim.SGD([torch.zeros(1)], lr=0.1),
                       site.data_loader, loss_fn=lambda out, target: out.sum())
    with pytest.raises(ValueError, match="reduction"):
        bare.contribute(RoundTask(mode="site", round=1, cohort=3, seed=0,
                                  noise_multiplier=1.0, clip_norm=1.0, sample_rate=0.5,
                                  steps=1, lr=0.5))


def test_the_python_api_runs_private_adaptive_clipping_in_distributed_mode() -> None:
    """``train_federated(..., dp="distributed", adaptive_clip=Q)``: the clip moves round to
    round from the noised count, and the epsilon charged per round includes the count."""
    torch.manual_seed(0)
    sites = [_site(seed) for seed in (1, 2, 3)]
    common = {"rounds": 3, "dp": "distributed", "noise_multiplier": 2.0, "delta": 1e-5,
              "sample_rate": 0.5, "lr": 1.0, "clip_norm": 0.5, "max_units": 200,
              "broker": "memory"}
    adaptive = train_federated(TwoBranchNet(), sites, adaptive_clip=0.5,
                               clip_count_stddev=3.0, **common).report["rounds"]
    fixed = train_federated(TwoBranchNet(), sites, **common).report["rounds"]
    clips = [r["clip_norm"] for r in adaptive]
    assert clips[0] == 0.5 and len(set(clips)) == 3
    assert all(r["clip_norm"] is None for r in fixed)
    assert adaptive[-1]["epsilon"] > fixed[-1]["epsilon"]
